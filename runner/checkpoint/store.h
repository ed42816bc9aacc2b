// Atomic checkpoint directories, without LibTorch.
//
// A checkpoint named P is a symlink P -> P.v<K> (relative), where P.v<K> is a complete directory
// whose manifest.json was written last. Commit writes into a hidden temporary directory, fsyncs
// every file and the directory, renames it to a fresh P.v<K>, then atomically replaces the
// symlink (rename of a new link over the old one) and only then removes the previous version.
// So a reader sees the old checkpoint or the new one, never a partial one, and overwriting never
// leaves a moment without a valid checkpoint; a crash leaves at worst temporaries and
// unreferenced versions, which the next commit in that folder (of any name) removes, as does
// SweepCheckpointLeftovers at start-up.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "runner/util/hash.h"  // Fnv64: the per-file checksum kept in manifests

namespace tinkerd {

// Writes a checkpoint's files into `tmp_dir` (manifest.json must be among them).
using CheckpointWriter = std::function<absl::Status(const std::string& tmp_dir)>;

// ALREADY_EXISTS when `path` exists and !overwrite.
absl::Status CommitCheckpoint(const std::string& path, bool overwrite,
                              const CheckpointWriter& write);

// The complete directory behind `path`; NOT_FOUND when there is none.
absl::StatusOr<std::string> ResolveCheckpoint(const std::string& path);

// Names of complete checkpoints directly under `folder`, sorted.
std::vector<std::string> ListCheckpoints(const std::string& folder);

// Removes, in every folder under `root`, the leftovers of saves that are over (killed mid-way):
// their temporaries and versions no checkpoint points to. Saves still running are left alone.
void SweepCheckpointLeftovers(const std::string& root);

// Removes the link and its directory. NOT_FOUND when absent.
absl::Status DeleteCheckpoint(const std::string& path);

}  // namespace tinkerd
