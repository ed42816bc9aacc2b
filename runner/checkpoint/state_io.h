// Internal: a model's training state to and from a checkpoint directory, and sampler exports.
//
// A training checkpoint holds params.safetensors (trainable tensors, training dtype, exact),
// optimizer.safetensors (AdamW moments; per-rank files of slices when the optimizer state was
// sharded, see WriteStateShard), optionally accumulators.safetensors (unapplied gradient
// sums and their counters), and manifest.json: format and version, step, skipped steps, the last
// applied seq_id, LoRA config, loss_reduction, seed, the base model's fingerprint, and a size and
// FNV-64 checksum per file. The runner draws no random numbers after initialization (no dropout),
// so the seed is the whole RNG state.
#pragma once

#include <functional>
#include <string>

#include "absl/status/statusor.h"
#include "runner/checkpoint/manifest.h"
#include "runner/model_state.h"

namespace tinkerd {

struct CheckpointMeta {
  int64_t last_seq_id = 0;
  uint64_t base_fingerprint = 0;
  std::string base_model;
  std::string training_dtype;  // "float32" or "float64"
};

// `accumulated`: the gradient sums to save with the counters (summed over data-parallel ranks),
// or null to save none.
absl::Status WriteTrainingState(const ModelState& t, const CheckpointMeta& meta,
                                const std::map<std::string, at::Tensor>* accumulated,
                                const std::string& dir);

// Sharded optimizer state (--shard=optimizer), saved by every rank in parallel: each writes its
// slices of the moments (and, with the accumulation, of the gradient sums) as flat tensors to
// optimizer-<r>-of-<W>.safetensors (accumulators-<r>-of-<W>.safetensors) and returns their
// digests; rank 0 then writes params.safetensors and, last, the manifest ("shards": W) naming
// every rank's files. ReadTrainingState joins the slices back into whole tensors, so such a
// checkpoint loads at any world size, sharded or not.
absl::StatusOr<std::map<std::string, FileDigest>> WriteStateShard(const OptimizerShard& shard,
                                                                  bool accumulated,
                                                                  const std::string& dtype,
                                                                  const std::string& dir);
absl::Status WriteShardedTrainingState(const ModelState& t, const CheckpointMeta& meta,
                                       bool accumulated, int world_size,
                                       const std::map<std::string, FileDigest>& shard_files,
                                       const std::string& dir);

// The manifest, written last (its presence marks the checkpoint complete), listing `m.files`
// (the parameters' among them).
absl::Status WriteManifest(const ModelState& t, const CheckpointMeta& meta, bool accumulated,
                           TrainingManifest m, const std::string& dir);

struct LoadedState {
  CreateModelOptions options;
  int64_t step = 0;
  int64_t skipped_steps = 0;
  int64_t last_seq_id = 0;
  std::map<std::string, at::Tensor> params, exp_avg, exp_avg_sq, grad_sum;  // grad_sum may be empty
  int64_t accumulated_tokens = 0, accumulated_sequences = 0;
  // Read in parts (ReadSlices): the maps above hold what `take` kept of each tensor.
  bool sliced = false;
};

// How a sharded model reads a checkpoint (--shard=full, runner/checkpoint/param_shard_io.h):
// `take(name, whole)` keeps its part of each tensor (by parameter name; undefined where the name
// or the shape is not the model's) as the tensor is read, `fraction` of the checkpoint in all (a
// part may be a small tensor whole), so that a rank holds one tensor whole (at most
// `largest_values` values, in the stored and the read dtype at once) beside its parts.
struct ReadSlices {
  TensorTransform take;
  double fraction = 1;
  int64_t largest_values = 0;
};

// The manifest of a checkpoint: what a model made from it must be. FAILED_PRECONDITION for
// another base model, as ReadTrainingState.
absl::StatusOr<CreateModelOptions> ReadCheckpointOptions(const std::string& dir,
                                                         uint64_t base_fingerprint);

// Reads and verifies a checkpoint (format, checksums, base fingerprint). Tensors come back in
// `dtype`, whole, or in parts with `slices` (from a checkpoint of --shard=optimizer, whose files
// are flat stretches of every tensor, each stretch is cut at the tensors as it is read, and a
// tensor that spans two files is put together whole first). Corrupt or truncated files are
// DATA_LOSS; another base model is FAILED_PRECONDITION. Once the manifest is read and before any
// tensor file is, `admit` gets the bytes the read and its caller's use of the result may hold at
// most; its error is returned, with nothing read.
absl::StatusOr<LoadedState> ReadTrainingState(
    const std::string& dir, uint64_t base_fingerprint, at::ScalarType dtype,
    const std::function<absl::Status(int64_t bytes)>& admit, const ReadSlices* slices = nullptr);

// Checks that `s` fits `t` (same adapter layout and shapes): FAILED_PRECONDITION otherwise.
absl::Status CheckCompatible(const ModelState& t, const LoadedState& s);

// PEFT adapter (adapter_config.json + adapter_model.safetensors, PEFT/vLLM tensor names); the
// manifest records the base model's fingerprint, which the adapter only makes sense on.
absl::Status WritePeftAdapter(const ModelState& t, const std::string& base_model,
                              uint64_t base_fingerprint, const std::string& dir);
// How a LoRA model's merged export differs from its base: the config it is exported with (a
// tied head that the adapter adapts no longer equals the embedding: untied, and the file adds
// lm_head.weight, made from the embedding), and `merge`, which makes each adapted weight as the
// file reaches it, W + scale·B·A in W's dtype, so that one merged tensor is held at a time.
struct LoraMerge {
  ModelConfig config;
  bool adds_head = false;
  TensorTransform merge;  // refers to `lora`, which must outlive it
};
LoraMerge MergeOf(const LoraAdapter& lora, const ModelConfig& config);

// Full weights in Hugging Face layout with the adapter merged in; loadable as a base model.
absl::Status WriteMergedModel(const ModelState& t, const ModelConfig& config,
                              const BaseWeights& base, uint64_t base_fingerprint,
                              const std::string& dir);
// A merged export's files around its weights: config.json (`config`, which says float32 whatever
// the files' `dtype`), the tensors `weights` writes into the file it is given (model.safetensors),
// and the manifest, which records the fingerprint of the base it was trained on (a server of
// several bases samples it on that one). Each step runs only when the one before it succeeded.
absl::Status WriteMergedExport(
    const ModelState& t, ModelConfig config, uint64_t base_fingerprint, const std::string& dir,
    const std::function<absl::StatusOr<FileDigest>(const std::string& file)>& weights);

// A sampler export read back, to sample from: a PEFT adapter on the base model, or merged full
// weights (with their own config: tying may differ from the base's).
struct SamplerWeights {
  std::string model_id;  // the model it was exported from
  int64_t step = 0;
  ModelConfig config;
  std::optional<BaseWeights> weights;  // merged layout
  std::optional<LoraAdapter> lora;     // PEFT layout, without gradients
};

// FAILED_PRECONDITION when the export belongs to another base model (another fingerprint, or an
// architecture or tensor shapes that differ from `base_config`); INVALID_ARGUMENT for a training
// checkpoint; DATA_LOSS when its files are missing or malformed. `keep` (an adapter's: expert
// parallelism) leaves out the modules it does not keep.
absl::StatusOr<SamplerWeights> ReadSamplerWeights(const std::string& dir,
                                                  const ModelConfig& base_config,
                                                  uint64_t base_fingerprint, at::ScalarType dtype,
                                                  at::Device device,
                                                  const LoraAdapter::Keep& keep = nullptr);

// A cheap identity of the base model: its config and a sample of its weights.
uint64_t BaseFingerprint(const ModelConfig& config, const BaseWeights& base);
// The same from the final norm and FingerprintedEmbedding(embedding), kept while a sharded base
// is read a tensor at a time (no rank holds either whole afterwards).
uint64_t BaseFingerprint(const ModelConfig& config, const at::Tensor& final_norm_D,
                         const at::Tensor& embedding_head);
at::Tensor FingerprintedEmbedding(const at::Tensor& embed_VD);

}  // namespace tinkerd
