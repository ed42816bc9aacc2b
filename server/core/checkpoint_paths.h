// tinker://<model_id>/<kind>/<name> paths and where they live under the checkpoint root.
#pragma once

#include <array>
#include <string>

#include "absl/status/statusor.h"

namespace tinkerd {

// The kinds of checkpoint, by their folder: training state, sampler exports, and external
// exports (Tinker's save_weights_external: the same files as a sampler export, in Hugging Face
// layout, for download).
inline constexpr std::array<const char*, 3> kCheckpointKinds = {"weights", "sampler_weights",
                                                                "external_weights"};
// A kind's name in listings (Tinker's checkpoint_type): "training", "sampler" or "external".
std::string CheckpointKindName(const std::string& kind);

struct CheckpointPath {
  std::string model_id;
  std::string kind;  // one of kCheckpointKinds
  std::string name;

  std::string Uri() const;                        // tinker://model/kind/name
  std::string Fs(const std::string& root) const;  // root/model/kind/name
};

// INVALID_ARGUMENT unless the path has exactly that shape with safe components (no '/', no
// leading '.', nothing outside [A-Za-z0-9._:-]), so no path can escape the root.
absl::StatusOr<CheckpointPath> ParseCheckpointPath(const std::string& uri);
// A checkpoint name a client chose (or a model id used as a folder), checked the same way; the
// error names `field`.
absl::Status ValidateCheckpointName(const std::string& name, absl::string_view field = "name");

}  // namespace tinkerd
