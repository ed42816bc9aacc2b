// Internal: one trained model ("tenant") of a ModelRunner and the two functions that change its
// training state. Shape suffixes: T tokens of a micro-batch, V vocab.
#pragma once

#include <ATen/ATen.h>

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "runner/dist/collectives.h"
#include "runner/loss/loss_spec.h"
#include "runner/model/config.h"
#include "runner/model/lora.h"
#include "runner/model/transformer.h"
#include "runner/runner_config.h"
#include "runner/types.h"

namespace tinkerd {

struct Tenant {
  std::string id;
  CreateModelOptions options;
  std::optional<LoraAdapter> lora;  // LoRA models
  std::optional<BaseWeights> full;  // full fine-tuning: this model's own copy of every weight
  // Trainable tensors by name (sorted), and per name the fp32-or-wider gradient accumulator and
  // AdamW moments. Accumulators hold raw sums: see DESIGN.md §3.
  std::map<std::string, at::Tensor> params;
  std::map<std::string, at::Tensor> grad_sum;
  std::map<std::string, at::Tensor> exp_avg;
  std::map<std::string, at::Tensor> exp_avg_sq;
  int64_t accumulated_tokens = 0;     // global valid tokens since the last step
  int64_t accumulated_sequences = 0;  // global valid sequences since the last step
  int64_t step = 0;
  int64_t skipped_steps = 0;
};

// Everything a training step needs besides the tenant.
struct StepContext {
  const ModelConfig* config;
  const BaseWeights* base;
  Collectives* collectives;
  at::ScalarType compute_dtype;
  int64_t micro_batch_tokens;
  RunnerConfig::TestHooks* test_hooks;  // may be null
};

// Runs `data` through the model in packed micro-batches. With `backward`, the call's raw loss
// gradient and global counts are added to the tenant only after every micro-batch succeeded;
// on error the tenant is untouched. Data must already be validated.
absl::StatusOr<ForwardBackwardResult> RunForward(const StepContext& ctx, Tenant& tenant,
                                                 const std::vector<Datum>& data,
                                                 const ResolvedLoss& loss, bool backward);

// Normalize, reduce, clip, AdamW, clear. See ModelRunner::OptimStep.
absl::StatusOr<OptimStepResult> ApplyOptimStep(const StepContext& ctx, Tenant& tenant,
                                               const AdamParams& params);

}  // namespace tinkerd
