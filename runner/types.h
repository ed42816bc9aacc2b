// The runner's public data types. Torch-free on purpose: the gRPC server and the client include
// this header without paying for LibTorch's headers.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace tinkerd {

// How OptimStep turns the accumulated raw loss into the gradient it applies (DESIGN.md §3).
//   kTokenMean        raw = Σ_t m·ℓ per datum,         divided by accumulated valid tokens N_all
//   kSum              raw = Σ_t m·ℓ per datum,         divided by 1 (Tinker's own semantics)
//   kSeqMeanTokenMean raw = (1/N_i)·Σ_t m·ℓ per datum, divided by accumulated valid sequences B_all
//   kSeqMeanTokenSum  raw = Σ_t m·ℓ per datum,         divided by accumulated valid sequences B_all
enum class LossReduction { kTokenMean, kSum, kSeqMeanTokenMean, kSeqMeanTokenSum };
absl::StatusOr<LossReduction> ParseLossReduction(absl::string_view name);
absl::string_view LossReductionName(LossReduction r);

// A named input tensor of a datum, as Tinker's TensorData: int64 or float32, row-major.
struct TensorData {
  enum class DType { kInt64, kFloat32 };
  DType dtype = DType::kFloat32;
  std::vector<int64_t> shape;  // empty means 1-D of the data's length
  std::vector<int64_t> int64_data;
  std::vector<float> float32_data;

  static TensorData Int64(std::vector<int64_t> v);
  static TensorData Float32(std::vector<float> v);
  int64_t NumElements() const;
};

// One training example. Position t of `tokens` predicts loss_fn_inputs["target_tokens"][t].
// Every loss input has the length of `tokens`.
struct Datum {
  std::vector<int64_t> tokens;
  std::map<std::string, TensorData> loss_fn_inputs;
};

struct DatumOutput {
  // log p(target | tokens_≤t) under the current weights, row-major in the targets' shape:
  // [T], or [T, K] for top-K targets.
  std::vector<float> logprobs;
  std::vector<int64_t> logprobs_shape;
};

struct ForwardBackwardResult {
  std::vector<DatumOutput> outputs;       // in the caller's datum order
  std::map<std::string, double> metrics;  // keys are "name:reduction", e.g. "loss:sum"
};

// AdamW with torch.optim.AdamW semantics (decoupled weight decay); defaults are Tinker's.
struct AdamParams {
  double learning_rate = 1e-4;
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-12;
  double weight_decay = 0.0;
  double grad_clip_norm = 0.0;  // 0 disables clipping; otherwise the max global L2 norm
};

struct OptimStepResult {
  double grad_norm = 0;      // global L2 norm after normalization, before clipping
  double learning_rate = 0;  // the rate applied
  double denominator = 0;    // what the summed gradient was divided by
  bool clipped = false;
  bool skipped = false;       // non-finite norm: nothing applied, accumulators cleared
  int64_t num_tokens = 0;     // valid tokens accumulated since the previous step
  int64_t num_sequences = 0;  // valid sequences accumulated since the previous step
  int64_t step = 0;           // optimizer steps applied so far, after this call
};

struct LoraConfig {
  int64_t rank = 32;
  double alpha = 32;  // the adapter's output is scaled by alpha / rank
  bool train_attn = true;
  bool train_mlp = true;
  bool train_unembed = true;
};

struct CreateModelOptions {
  std::optional<LoraConfig> lora = LoraConfig{};  // nullopt: full fine-tuning of every weight
  LossReduction loss_reduction = LossReduction::kTokenMean;
  uint64_t seed = 0;  // initializes the adapter
};

struct ModelInfo {
  std::string model_id;
  std::string base_model;    // path or name of the shared base
  std::string architecture;  // e.g. "LlamaForCausalLM"
  bool is_lora = true;
  LoraConfig lora;
  LossReduction loss_reduction = LossReduction::kTokenMean;
  int64_t step = 0;
  int64_t accumulated_tokens = 0;
  int64_t accumulated_sequences = 0;
  int64_t skipped_steps = 0;
  int64_t trainable_parameters = 0;
  int64_t vocab_size = 0;
  int64_t max_context_length = 0;
};

struct SaveStateOptions {
  bool overwrite = false;            // replace an existing checkpoint of that name (atomically)
  bool include_accumulated = false;  // also save unapplied gradients; otherwise they are refused
  int64_t last_seq_id = 0;           // recorded in the manifest (the server's request position)
};

// A copy of one named tensor of a model's state, widened to double; for tests and checksums.
struct NamedValues {
  std::string name;
  std::vector<int64_t> shape;
  std::vector<double> values;
};
enum class StateKind { kParams, kGrads, kAdamExpAvg, kAdamExpAvgSq };

}  // namespace tinkerd
