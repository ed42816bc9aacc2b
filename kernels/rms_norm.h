// RMSNorm in Hugging Face's order of operations:
//   y = w ⊙ cast_x( x / sqrt(mean_j x_j² + eps) )
// with the mean of squares and the division in fp32 (fp64 for fp64 inputs), the result cast back
// to x's dtype before the weight (cast to x's dtype too: an fp32 master under bf16 compute)
// multiplies. An fp32 master weight's gradient is summed in fp32 (kernels/mixed_grad.h); with
// activation checkpointing the intermediates live only while one layer is recomputed.
//
// On the CPU, in float32 and bfloat16, every norm (the sampler's, the trainer's Forward and
// forward_backward's) runs one loop over rows: the sum of squares in sixteen lanes, then Total,
// r = 1 / sqrt(mean + eps), y = cast(x · r) · w. A row's result does not depend on the others, so
// each token's norm is the same bits in every path (docs/kernels.md, "the reduction order").
// Training differentiates the loop's x · r by its formula:
//   dx = r · (g − x̂ · mean_j(g_j x̂_j)),  x̂ = x · r,  g = dy ⊙ w
// Elsewhere (float64, CUDA) ATen's ops, differentiated by autograd.
#pragma once

#include <ATen/ATen.h>

namespace tinkerd::kernels {

struct RmsNormParams {
  at::Tensor x_ND;  // any leading shape; normalizes the last dimension
  at::Tensor w_D;
  double eps = 1e-6;
};

at::Tensor RmsNorm(const RmsNormParams& p);

}  // namespace tinkerd::kernels
