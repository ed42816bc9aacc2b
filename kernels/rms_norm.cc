#include "kernels/rms_norm.h"

namespace tinkerd::kernels {

at::Tensor RmsNorm(const RmsNormParams& p) {
  const at::ScalarType dt = p.x_ND.scalar_type();
  const at::Tensor x = dt == at::kDouble ? p.x_ND : p.x_ND.to(at::kFloat);
  const at::Tensor normed = x * at::rsqrt(x.pow(2).mean(-1, /*keepdim=*/true) + p.eps);
  return normed.to(dt) * p.w_D.to(dt);
}

}  // namespace tinkerd::kernels
