// The (LoRA) linear layer:
//   y = x·Wᵀ + b + s·(x·Aᵀ)·Bᵀ
// b and the low-rank pair are optional. With `runs`, the rows of x fall in consecutive runs, each
// with its own pair (of any rank) or none:
//   y[run] = x[run]·Wᵀ + b + s_run·(x[run]·A_runᵀ)·B_runᵀ
// so that one product with W serves every row: a decode step over policies of one base model, or
// one training pass over several models' calls (each pair's gradient from its own rows alone).
// Every weight may be held in a wider dtype than x (fp32 master weights under bf16 compute); each
// is cast to x's dtype for the product, and a trained master's gradient is summed over the rows in
// its own dtype, never rounded to x's (kernels/mixed_grad.h).
//
// Shape suffixes: N rows, I in features, O out features, r rank.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace tinkerd::kernels {

struct LoraRun {
  int64_t rows = 0;
  at::Tensor A_rI;  // undefined: these rows are not adapted
  at::Tensor B_Or;
  double scale = 1.0;
};

struct LinearParams {
  at::Tensor x_NI;
  at::Tensor w_OI;
  at::Tensor b_O;   // undefined: no bias
  at::Tensor A_rI;  // undefined: not adapted
  at::Tensor B_Or;
  double scale = 1.0;  // s = alpha / r
  // Non-empty: the rows' adapters by run (their rows sum to N); A_rI/B_Or must then be undefined.
  std::vector<LoraRun> runs;
};

at::Tensor Linear(const LinearParams& p);

// silu(gate) ⊙ up, the gated activation of Llama-family MLPs. Float32 and bfloat16 on the CPU run
// one vectorized loop, in every path (sampler, Forward, forward_backward): ATen's order of
// operations with kernels/vec16.h's exponential, each element its own, differentiated by its
// formula; elsewhere ATen's ops.
at::Tensor SwiGLU(const at::Tensor& gate_NI, const at::Tensor& up_NI);

}  // namespace tinkerd::kernels
