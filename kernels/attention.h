// Varlen causal attention with grouped-query heads and an optional sliding window, tiled with an
// online softmax (the FlashAttention-2 algorithm) so that no [L, L] tensor ever exists per head:
// memory is O(tokens × heads × head_dim) forward and backward.
//
// Sequence s has Lq queries and Lk >= Lq keys; its queries are the last Lq positions, so training
// has Lq = Lk and a KV-cache decode step has Lq = 1. For query i at position p = Lk − Lq + i and
// key j, with query head h reading kv head h / (H / K):
//   S_ij  = scale · q_i·k_j  if j <= p and (window == 0 or p − j < window), else −inf
//   lse_i = log Σ_j exp(S_ij),   o_i = Σ_j exp(S_ij − lse_i) · v_j
// Backward recomputes each tile's P = exp(S − lse) from the saved lse:
//   Δ_i = do_i·o_i,  dv_j = Σ_i P_ij do_i,  dS_ij = P_ij (do_i·v_j − Δ_i),
//   dq_i = scale Σ_j dS_ij k_j,  dk_j = scale Σ_i dS_ij q_i.
// Scores, the running max/sum and the accumulators are fp32 (fp64 for fp64 inputs).
//
// Shape suffixes: T packed query tokens, U packed key tokens, H query heads, K kv heads,
// d head_dim.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace tinkerd::kernels {

struct AttentionParams {
  at::Tensor q_THd;
  at::Tensor k_UKd;
  at::Tensor v_UKd;
  std::vector<int64_t> cu_seqlens_q;  // [S+1], from 0 to T
  std::vector<int64_t> cu_seqlens_k;  // [S+1], from 0 to U; equal to cu_seqlens_q in training
  int64_t window = 0;                 // 0: every earlier key is visible
  double scale = 0;                   // 0: 1/sqrt(d)
  // Tile sizes of the portable implementation (the CPU twin).
  int64_t block_q = 128;
  int64_t block_k = 256;
};

// o_THd, differentiable with respect to q, k and v. On CUDA with bf16/fp16 inputs and LibTorch 2.x
// it runs LibTorch's varlen flash attention; on the CPU the forward is AttentionForwardRows
// (kernels/decode_attention.h: each query summed as a decode step sums it) and the backward the
// tiled one below; elsewhere the tiled implementation both ways.
at::Tensor Attention(const AttentionParams& p);

// The tiled implementation on any device: the CPU kernel, the GPU fallback and the test oracle
// for the flash path. lse_HT is fp32 (fp64 for fp64 inputs).
struct AttentionForward {
  at::Tensor o_THd;
  at::Tensor lse_HT;
};
AttentionForward AttentionForwardTiled(const AttentionParams& p);

struct AttentionGrads {
  at::Tensor dq_THd, dk_UKd, dv_UKd;
};
AttentionGrads AttentionBackwardTiled(const AttentionParams& p, const at::Tensor& o_THd,
                                      const at::Tensor& lse_HT, const at::Tensor& do_THd);

// Whether Attention() takes LibTorch's flash kernel for these inputs.
bool UsesFlashAttention(const AttentionParams& p);

}  // namespace tinkerd::kernels
