// Internal: training checkpoints of a full fine-tune whose parameters are sharded (--shard=full,
// runner/dist/param_shard.h). They are written in the unsharded layout (params.safetensors,
// optimizer.safetensors, accumulators.safetensors: whole tensors under their names, state_io.h),
// so that they load at any world size and sharding, and a replica's checkpoint loads here.
//
// A save gathers every tensor whole, a unit at a time, in each file's order: a collective that
// every rank runs in the same sequence whatever happens to rank 0's files (rank 0 alone writes,
// streaming, and every rank holds at most one unit whole, and gathers each once per file). A load
// reads the checkpoint on every rank, a tensor at a time, and each rank keeps only its slice of
// each (SlicesOf), so that it holds 1/W of the checkpoint and one tensor whole, not the whole
// checkpoint.
#pragma once

#include <string>

#include "absl/status/status.h"
#include "runner/checkpoint/state_io.h"
#include "runner/dist/collectives.h"
#include "runner/model_state.h"

namespace tinkerd {

// Every rank calls it with the same `accumulated`; rank 0 passes the directory it is committing
// and writes the files and, last, the manifest; the others pass "" and only gather. The outcome
// is rank 0's writing (the others' is the gathers').
absl::Status WriteGatheredTrainingState(Collectives& c, const ModelState& t,
                                        const CheckpointMeta& meta, bool accumulated,
                                        const std::string& dir);

// A merged sampler export (WriteMergedExport's files) of the model's parameters, gathered as
// WriteGatheredTrainingState gathers them: rank 0 passes the directory it is committing, the
// others "".
absl::Status WriteGatheredMergedModel(Collectives& c, const ModelState& t,
                                      const ModelConfig& config, uint64_t base_fingerprint,
                                      const std::string& dir);

// A LoRA model's merged export (WriteMergedModel's files) on a sharded base (--shard_base): the
// base gathered as above, each weight merged with the adapter (replicated on every rank) as rank
// 0's file reaches it, so that a rank holds one unit whole and one merged weight beside it.
absl::Status WriteGatheredMergedLora(Collectives& c, const ModelState& t, const ParamShard& base,
                                     const ModelConfig& config, uint64_t base_fingerprint,
                                     const std::string& dir);

// How this rank reads a checkpoint into `t` (ReadTrainingState): each tensor's part in its slice.
ReadSlices SlicesOf(const ModelState& t);

// Checks that `s` (whole, or read by SlicesOf) holds every tensor of `t` with its shape, and
// nothing else: FAILED_PRECONDITION otherwise.
absl::Status CheckShardedCompatible(const ModelState& t, const LoadedState& s);
// Takes this rank's slices of `s` (the gradient sum, already the global one, too); moments and
// step from zero without `with_optimizer`.
void ScatterLoadedState(ModelState& t, const LoadedState& s, bool with_optimizer);

}  // namespace tinkerd
