#include "kernels/rms_norm.h"

#include <c10/core/GradMode.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "kernels/cpu_clones.h"
#include "kernels/mixed_grad.h"
#include "kernels/parallel.h"
#include "kernels/vec16.h"

namespace tinkerd::kernels {
namespace {

// Whether the rows loop serves: asked for (a sampler's decode or prefill step), float on the CPU,
// no gradient to record. Training's norms and the trainer's Forward stay ATen's.
bool RowsServe(const RmsNormParams& p) {
  const bool grad =
      c10::GradMode::is_enabled() && (p.x_ND.requires_grad() || p.w_D.requires_grad());
  return p.inference && !grad && p.x_ND.scalar_type() == at::kFloat &&
         p.w_D.scalar_type() == at::kFloat && p.x_ND.device().is_cpu() && p.w_D.device().is_cpu() &&
         p.x_ND.dim() >= 1 && p.w_D.dim() == 1 && p.w_D.size(0) == p.x_ND.size(-1);
}

// ATen's expression row by row in float, its roundings in its order: the mean of the squares
// (summed in sixteen lanes, then Total), r = 1 / sqrt(mean + eps), y = (x · r) · w. A row's result
// does not depend on the others.
TINKERD_CPU_CLONES void NormRows(const float* x, const float* w, float* y, int64_t rows, int64_t D,
                                 float eps) {
  const int64_t whole = D / 16 * 16;
  for (int64_t n = 0; n < rows; ++n) {
    const float* xn = x + n * D;
    float* yn = y + n * D;
    V16 squares = {};
    for (int64_t j = 0; j < whole; j += 16) {
      const V16 v = *reinterpret_cast<const V16u*>(xn + j);
      squares += v * v;
    }
    if (whole < D) {  // the last D mod 16, zero-padded
      V16 v = {};
      std::memcpy(&v, xn + whole, (D - whole) * sizeof(float));
      squares += v * v;
    }
    const float r = 1.0f / std::sqrt(Total(squares) / static_cast<float>(D) + eps);
    for (int64_t j = 0; j < whole; j += 16) {
      *reinterpret_cast<V16u*>(yn + j) =
          *reinterpret_cast<const V16u*>(xn + j) * r * *reinterpret_cast<const V16u*>(w + j);
    }
    for (int64_t j = whole; j < D; ++j) yn[j] = xn[j] * r * w[j];
  }
}

}  // namespace

at::Tensor RmsNorm(const RmsNormParams& p) {
  if (RowsServe(p)) {
    // Six ATen ops per norm, each allocating, took 1.7 ms of a 24 ms batch-64 decode step on a
    // 2-vCPU Xeon (13 norms); the loop takes a few microseconds. A decode step's rows run on the
    // calling thread (grain: 64 Ki elements), a prefill's across threads.
    const at::Tensor x = p.x_ND.contiguous(), w = p.w_D.contiguous();
    at::Tensor y = at::empty_like(x);
    const int64_t D = x.size(-1), rows = D > 0 ? x.numel() / D : 0;
    const float* xp = x.data_ptr<float>();
    const float* wp = w.data_ptr<float>();
    float* yp = y.data_ptr<float>();
    const float eps = static_cast<float>(p.eps);
    ParallelFor(0, rows, std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(D, 1)),
                [&](int64_t begin, int64_t end) {
                  NormRows(xp + begin * D, wp, yp + begin * D, end - begin, D, eps);
                });
    return y;
  }
  const at::ScalarType dt = p.x_ND.scalar_type();
  const at::Tensor x = dt == at::kDouble ? p.x_ND : p.x_ND.to(at::kFloat);
  const at::Tensor normed = x * at::rsqrt(x.pow(2).mean(-1, /*keepdim=*/true) + p.eps);
  const at::Tensor normed_dt = normed.to(dt);
  if (MixedInUse(normed_dt, p.w_D)) return MixedScale({normed_dt, p.w_D});
  return normed_dt * p.w_D.to(dt);
}

}  // namespace tinkerd::kernels
