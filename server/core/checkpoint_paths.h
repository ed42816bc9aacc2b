// tinker://<model_id>/<kind>/<name> paths and where they live under the checkpoint root.
#pragma once

#include <string>

#include "absl/status/statusor.h"

namespace tinkerd {

struct CheckpointPath {
  std::string model_id;
  std::string kind;  // "weights" or "sampler_weights"
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
