// RMSNorm in Hugging Face's order of operations:
//   y = w ⊙ cast_x( x / sqrt(mean_j x_j² + eps) )
// with the mean of squares and the division in fp32 (fp64 for fp64 inputs), the result cast back
// to x's dtype before the weight (cast to x's dtype too: an fp32 master under bf16 compute)
// multiplies. Differentiable through ATen's autograd, and an fp32 master weight's gradient summed
// in fp32 (kernels/mixed_grad.h); with
// activation checkpointing its intermediates live only while one layer is recomputed.
// With `inference`, float32 on the CPU with no gradient to record runs as one loop over rows, the
// same roundings in the same order but the sum of squares in sixteen lanes: a row's result is its
// own, whatever the batch. The sampler asks for it; the trainer's Forward does not, so that its
// logprobs stay those of forward_backward on the same data (the loop's sums round otherwise).
#pragma once

#include <ATen/ATen.h>

namespace tinkerd::kernels {

struct RmsNormParams {
  at::Tensor x_ND;  // any leading shape; normalizes the last dimension
  at::Tensor w_D;
  double eps = 1e-6;
  bool inference = false;  // the sampler's steps: the rows loop where it serves (above)
};

at::Tensor RmsNorm(const RmsNormParams& p);

}  // namespace tinkerd::kernels
