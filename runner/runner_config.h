// Typed configuration of the runner; validated once, logged at start-up.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace tinkerd {

class Collectives;    // runner/dist/collectives.h
class MemoryAccount;  // runner/util/memory_account.h

// The dtype the model computes in. Under bfloat16/float16 the base weights are held in it, while
// trainable master weights, gradient accumulators and Adam moments stay float32 and norms,
// softmax and logsumexp accumulate in float32 (DESIGN.md §7).
enum class ComputeDType { kFloat32, kFloat64, kBFloat16, kFloat16 };
absl::StatusOr<ComputeDType> ParseComputeDType(absl::string_view name);
const char* ComputeDTypeName(ComputeDType dtype);

// What each data-parallel rank holds of a model's training state. kNone: all of it (replicas).
// kOptimizer: every parameter, but 1/W of the gradient sums and AdamW moments
// (runner/dist/shard.h). kFull: a full fine-tune's parameters too, each decoder layer gathered
// only while it runs (runner/dist/param_shard.h); LoRA models and the frozen base are as under
// kOptimizer.
enum class ShardMode { kNone, kOptimizer, kFull };
absl::StatusOr<ShardMode> ParseShardMode(absl::string_view name);
const char* ShardModeName(ShardMode mode);

struct RunnerConfig {
  std::string base_model_path;  // directory with config.json and *.safetensors
  ComputeDType compute_dtype = ComputeDType::kFloat32;
  // Token budget of one packed micro-batch. A single sequence longer than this runs alone.
  int64_t micro_batch_tokens = 4096;
  // Recompute each decoder layer in backward instead of keeping its activations: memory becomes
  // the residual stream plus one layer's intermediates, for about a third more compute.
  bool activation_checkpointing = false;
  int num_threads = 0;  // intra-op threads for LibTorch; 0 keeps LibTorch's default
  int max_models = 64;  // tenants resident at once
  // Admission of a model by the trainable state it would hold (parameters, gradient sums and
  // AdamW moments, estimated from the model and its LoRA layout before anything is allocated):
  // at most max_model_bytes for one model (0: no limit but the budget; a multi-tenant server sets
  // one so that no client takes the whole budget). memory_budget_bytes is the capacity of the
  // memory account that models, training calls and samples reserve in (ModelRunner::
  // memory_account; 0: three quarters of what the process may still use once the base model is
  // loaded). Past either, the request is RESOURCE_EXHAUSTED.
  int64_t max_model_bytes = 0;
  int64_t memory_budget_bytes = 0;
  // Where weights live and compute runs: "cpu", "cuda" (device 0) or "cuda:N". A CUDA device
  // needs a CUDA build of LibTorch and a visible GPU; ModelRunner::Create checks both.
  std::string device = "cpu";
  ShardMode shard = ShardMode::kNone;
  // With shard kFull: the frozen base too is held in slices, 1/W per rank, each layer gathered
  // while it runs (runner/dist/param_shard.h), so that a base no one rank holds trains LoRA
  // models and full fine-tunes, exports them, and samples them (each sampler forward gathers the
  // base; ModelRunner::ForwardGatheredBase).
  bool shard_base = false;
  // Under shard kFull: each micro-batch's next layer is gathered while this one computes, on a
  // group of its own (runner/dist/layer_prefetch.h), holding one layer more whole. CPU runs only
  // for now (on CUDA it is ignored, with a warning).
  bool prefetch_layers = true;
  // Expert parallelism (runner/dist/expert_parallel.h): groups of this many ranks split each
  // routed layer's experts. 1: every rank holds every expert. It must divide the world size and
  // the model's experts per layer, and (for now) go with shard none.
  int expert_parallel = 1;
  // Data-parallel hook; null means a single process (world size 1).
  std::shared_ptr<Collectives> collectives;
  // Set: the runner reserves in this account instead of one of its own (memory_budget_bytes is
  // then unused), and holds its base model's weights in it for its life: several base models in
  // one process (the server's --base_model given again) share one budget.
  std::shared_ptr<MemoryAccount> account;

  absl::Status Validate() const;
  std::string DebugString() const;
};

// A parsed RunnerConfig::device, torch-free.
struct DeviceSpec {
  bool cuda = false;
  int index = 0;
};
absl::StatusOr<DeviceSpec> ParseDevice(absl::string_view device);

}  // namespace tinkerd
