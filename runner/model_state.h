// Internal: the training state of one model a ModelRunner holds: its trainable tensors, their
// gradient sums and AdamW moments, and the counters of what was accumulated since the last step.
// (Not an API-key owner: those are tenants, server/common/auth.h.)
#pragma once

#include <ATen/ATen.h>

#include <map>
#include <optional>
#include <string>

#include "runner/dist/param_shard.h"
#include "runner/dist/shard.h"
#include "runner/model/lora.h"
#include "runner/model/transformer.h"
#include "runner/types.h"
#include "runner/util/memory_account.h"

namespace tinkerd {

struct ModelState {
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
  // Under ShardMode::kOptimizer: this rank's slice of the sums and moments, reduced per call;
  // grad_sum, exp_avg and exp_avg_sq are then empty.
  std::optional<OptimizerShard> shard;
  // Under ShardMode::kFull, a full fine-tune: this rank's slices of the parameters, sums and
  // moments, unit by unit; `full`, params and the maps above are then empty.
  std::optional<ParamShard> sharded;
  // Of params and accumulators, as admitted (ModelRunner::CreateModel), held in the process's
  // memory account while the model lives.
  Reservation memory;
  int64_t accumulated_tokens = 0;     // global valid tokens since the last step
  int64_t accumulated_sequences = 0;  // global valid sequences since the last step
  int64_t step = 0;
  int64_t skipped_steps = 0;
};

}  // namespace tinkerd
