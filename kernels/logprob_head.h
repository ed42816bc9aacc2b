// The fused log-probability head: per-token log-probability of the target token and the
// logsumexp, chunked over tokens and vocabulary so that no [T, V] tensor exists.
//
//   z_tv  = h_t·W_v + s·(h_t·Aᵀ)·B_vᵀ        (the LoRA term only when the head is adapted)
//   lse_t = log Σ_v exp(z_tv),   logp_tk = z_{t,y_tk} − lse_t
// with K targets y_t1..y_tK per token (K = 1 for targets [T]; top-K soft targets otherwise).
// Backward recomputes each chunk's logits; for g_tk = ∂L/∂logp_tk and P_tv = exp(z_tv − lse_t):
//   dz_tv = Σ_k g_tk 1[v = y_tk] − (Σ_k g_tk) P_tv
//   dh = dz·W + s·(dz·B)·A,   dW = dzᵀ·h,   dB = s·dzᵀ·(h·Aᵀ),   dA = s·(dz·B)ᵀ·h
// Logits are formed in the input dtype (as a bf16 model's lm_head would) and the softmax, max,
// sum, lse and logp are fp32 (fp64 for fp64 inputs).
//
// On the CPU a token's logprob has one definition, the sampler's as the trainer's
// (docs/kernels.md, "the reduction order"): each logit by kernels::LinearProduct (Gemv's order in
// float32), then lse folded over vocabulary chunks of chunk_vocab in order from the first, each
// chunk's maximum and exponentials in sixteen lanes (LogitsLse), and logp = z_target − lse in the
// accumulate type. Neither depends on the other tokens, the chunk of tokens or the threads.
//
// Shape suffixes: T tokens, D hidden, V vocabulary, r LoRA rank, K targets per token.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

#include "kernels/linear.h"

namespace tinkerd::kernels {

struct LogprobHeadParams {
  at::Tensor hidden_TD;
  at::Tensor weight_VD;
  at::Tensor lora_A_rD;  // undefined when the head is not adapted
  at::Tensor lora_B_Vr;
  double lora_scale = 1.0;
  at::Tensor targets_T;  // int64 [T] or [T, K], each in [0, V)
  // Peak memory beyond the inputs is about 3 · chunk_tokens · chunk_vocab accumulate-type values.
  int64_t chunk_tokens = 1024;
  int64_t chunk_vocab = 8192;
  // HeadLogits only: the rows' adapters by run (kernels/linear.h; I = D, O = V), for a decode
  // step over policies of one base. Non-empty: lora_A_rD/lora_B_Vr must be undefined.
  std::vector<LoraRun> lora_runs;
};

struct LogprobHeadOutput {
  at::Tensor logp_T;  // shaped as targets_T; differentiable w.r.t. hidden, weight and LoRA pair
  at::Tensor lse_T;   // not differentiable
};

LogprobHeadOutput TokenLogprobs(const LogprobHeadParams& p);

// The logits z_TV themselves (accumulate type), each chunk formed as TokenLogprobs forms it, for
// the few rows a sampler draws from (one per sequence per decode step); with lora_runs, each
// run's rows as TokenLogprobs would form them with that run's adapter. targets_T is not read;
// no graph is kept.
at::Tensor HeadLogits(const LogprobHeadParams& p);

// lse_T of logits z_TV (accumulate type, as HeadLogits gives them) on the host, folded as
// TokenLogprobs folds them with chunk_vocab: z_{t,y} − lse_t is TokenLogprobs' logp of target y.
at::Tensor LogitsLse(const at::Tensor& z_TV, int64_t chunk_vocab = LogprobHeadParams{}.chunk_vocab);

}  // namespace tinkerd::kernels
