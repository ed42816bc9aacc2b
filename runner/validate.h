// Checks a batch of datums against a loss and a model before anything runs. Torch-free. Called
// through Batch::Check (runner/batch.h) alone: once per request, where it enters the server.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "runner/loss/loss_spec.h"
#include "runner/types.h"

namespace tinkerd {

struct ModelLimits {
  int64_t vocab_size = 0;
  int64_t max_context_length = 0;
  bool tokenizer = false;  // the base model has one, so stop strings can be matched
  // A mixture of experts: its experts, the experts per token and how many layers route
  // (router replay's `routed_experts` input); 0 for a dense model.
  int64_t experts = 0, top_k = 0, routed_layers = 0;
};

// InvalidArgument naming the datum, the field and the reason, e.g.
//   data[3].loss_fn_inputs["weights"]: shape [5] does not match model_input: want [7]
// Checks: a non-empty batch; non-empty datums within the context length; token ids (inputs and
// targets) in [0, vocab); exactly the inputs the loss takes (plus an optional "mask" of 0/1);
// dtypes (int64 targets, float32 others); finite values; shapes [T], T the input length, except
// cross_entropy's top-K form: target_tokens and weights both [T, K], 1 ≤ K ≤ vocab, one K for
// every datum of the batch. A mixture of experts also takes `routed_experts` (router replay):
// int64 [T, R, k], R the routed layers and k the experts per token, each an expert id, distinct
// within a token's layer; every datum of a call carries it or none does.
absl::Status ValidateData(const std::vector<Datum>& data, const LossSpec& loss,
                          const ModelLimits& limits);

// K of a checked datum's [T, K] targets; 0 for [T].
int64_t TargetWidth(const Datum& d);

// InvalidArgument naming the field (adam_params.<field>) when a hyper-parameter is not finite or
// out of range: learning_rate >= 0, beta1 and beta2 in [0, 1), eps > 0 (eps = 0 divides 0 by 0
// for a parameter whose gradient stayed 0, and the NaN then spreads to every later step),
// weight_decay >= 0, grad_clip_norm >= 0 (0 disables clipping). The server checks this before it
// queues an optim_step; the runner again at its boundary (a few comparisons, for its other
// callers).
absl::Status ValidateAdamParams(const AdamParams& p);

}  // namespace tinkerd
