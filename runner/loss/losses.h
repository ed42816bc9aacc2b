// Per-token losses ℓ_t of Tinker's loss functions (DESIGN.md §4). Each returns ℓ for every
// position; masking and the sum over tokens happen in the runner, so every loss is a plain sum.
//
// r = exp(logp − logq) with logq the sampler's logprobs; A the advantages; sg = stop-gradient.
//   cross_entropy        ℓ = −w·logp, or with K targets per token ℓ = −Σ_k w_k·logp_k
//   importance_sampling  ℓ = −r·A
//   ppo                  ℓ = −min(r·A, clip(r, lo, hi)·A)
//   cispo                ℓ = −sg(clip(r, lo, hi))·logp·A
//   dro                  ℓ = −(logp·A − ½·β·(logp − logq)²)
//   gspo                 ℓ = −min(r_t·A, clip(r_t, lo, hi)·A), where r_t = sg(s)·exp(logp −
//   sg(logp))
//                        and log s = the mean of sg(logp) − logq over the datum's positions whose
//                        sequence_ratio_mask is non-zero (0 when it has none): GSPO-token, whose
//                        every token carries its sequence's ratio s as its value and its own
//                        logprob's gradient.
// Shape suffix: T tokens of a packed micro-batch.
#pragma once

#include <ATen/ATen.h>

#include <map>
#include <string>
#include <vector>

namespace tinkerd {

struct LossTokenInputs {
  at::Tensor logp_T;                // learner logprobs of the targets (differentiable)
  at::Tensor weights_T;             // cross_entropy only; [T, K] with logp_T for top-K targets
  at::Tensor logq_T;                // sampler logprobs (RL losses)
  at::Tensor adv_T;                 // advantages (RL losses)
  at::Tensor ratio_mask_T;          // gspo: which positions enter the sequence ratio
  std::vector<int64_t> cu_seqlens;  // gspo: where each datum of the micro-batch starts and ends
};

struct LossTokenOutputs {
  at::Tensor loss_T;
  at::Tensor clipped_T;  // bool, defined for ppo/cispo: the ratio was outside [lo, hi]
};

using Config = std::map<std::string, double>;

LossTokenOutputs CrossEntropyLoss(const LossTokenInputs& in, const Config& cfg);
LossTokenOutputs ImportanceSamplingLoss(const LossTokenInputs& in, const Config& cfg);
LossTokenOutputs PpoLoss(const LossTokenInputs& in, const Config& cfg);
LossTokenOutputs CispoLoss(const LossTokenInputs& in, const Config& cfg);
LossTokenOutputs DroLoss(const LossTokenInputs& in, const Config& cfg);
LossTokenOutputs GspoLoss(const LossTokenInputs& in, const Config& cfg);

// Dispatches on the loss name (already validated by ResolveLoss).
LossTokenOutputs PerTokenLoss(const std::string& name, const LossTokenInputs& in,
                              const Config& cfg);

}  // namespace tinkerd
