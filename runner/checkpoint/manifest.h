// manifest.json of a training checkpoint, without LibTorch: written last (its presence marks a
// complete checkpoint) and read first, before any tensor file is touched. Torch-free so that the
// parser can be fuzzed on its own (tests/fuzz/fuzz_manifest.cc).
//
// Layout (format_version 1):
//   {"format": "tinkerd-checkpoint", "format_version": 1, "kind": "training", "model_id": ...,
//    "step": n, "skipped_steps": n, "last_seq_id": n, "loss_reduction": "token_mean",
//    "seed": "<u64 decimal>", "training_dtype": "float32"|"float64", "base_model": ...,
//    "base_fingerprint": "<u64 decimal>", "lora": null | {rank, alpha, train_attn, train_mlp,
//    train_unembed}, "accumulated": {tokens, sequences} (optional), "shards": W (optional),
//    "files": {name: {"bytes": n, "fnv64": "<u64 decimal>"}}}
// 64-bit values that JSON readers may round through a double are decimal strings.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "runner/model/safetensors.h"  // FileDigest
#include "runner/types.h"

namespace tinkerd {

inline constexpr int kCheckpointFormatVersion = 1;
// A loader opens one file per shard: a forged manifest must not make it open millions.
inline constexpr int kMaxCheckpointShards = 65536;

struct Accumulated {
  int64_t tokens = 0;
  int64_t sequences = 0;
  bool operator==(const Accumulated&) const = default;
};

struct TrainingManifest {
  std::string model_id;
  CreateModelOptions options;  // LoRA config, loss_reduction, seed
  int64_t step = 0;
  int64_t skipped_steps = 0;
  int64_t last_seq_id = 0;
  std::string training_dtype;  // "float32" or "float64"
  std::string base_model;
  uint64_t base_fingerprint = 0;
  std::optional<Accumulated> accumulated;  // set iff the checkpoint holds unapplied gradients
  // 0: optimizer.safetensors (and accumulators.safetensors) hold whole tensors; W: W files each
  // of flat slices, one per rank that saved them (runner/checkpoint/state_io.h).
  int shards = 0;
  std::map<std::string, FileDigest> files;  // plain file names in the checkpoint directory
};

std::string TrainingManifestToJson(const TrainingManifest& m);

// Strict: every field present with its JSON type, counters non-negative, names plain. Errors:
// DATA_LOSS for text that is not a well-formed manifest, INVALID_ARGUMENT for a sampler export
// (not training state), FAILED_PRECONDITION for another format version.
absl::StatusOr<TrainingManifest> ParseTrainingManifest(absl::string_view text);

}  // namespace tinkerd
