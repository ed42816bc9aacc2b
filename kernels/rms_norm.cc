#include "kernels/rms_norm.h"

#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "kernels/cpu_clones.h"
#include "kernels/mixed_grad.h"
#include "kernels/parallel.h"
#include "kernels/vec16.h"

namespace tinkerd::kernels {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Whether the rows loop serves: float or bf16 on the CPU.
bool RowsServe(const RmsNormParams& p) {
  const at::ScalarType dt = p.x_ND.scalar_type();
  return (dt == at::kFloat || dt == at::kBFloat16) && p.x_ND.device().is_cpu() &&
         p.w_D.device().is_cpu() && p.x_ND.dim() >= 1 && p.w_D.dim() == 1 &&
         p.w_D.size(0) == p.x_ND.size(-1);
}

template <typename T>
TINKERD_CPU_CLONES void NormRows(const T* x, const T* w, T* y, int64_t rows, int64_t D, float eps) {
  for (int64_t n = 0; n < rows; ++n) {
    const T* xn = x + n * D;
    T* yn = y + n * D;
    V16 squares = {};
    for (int64_t j = 0; j < D; j += 16) {
      V16 v;
      Widen(xn + j, std::min<int64_t>(16, D - j), v);
      squares += v * v;
    }
    const float r = 1.0f / std::sqrt(Total(squares) / static_cast<float>(D) + eps);
    if constexpr (std::is_same_v<T, float>) {
      const int64_t whole = D / 16 * 16;
      for (int64_t j = 0; j < whole; j += 16) {
        const V16 normed = *reinterpret_cast<const V16u*>(xn + j) * r;
        *reinterpret_cast<V16u*>(yn + j) =
            w != nullptr ? normed * *reinterpret_cast<const V16u*>(w + j) : normed;
      }
      for (int64_t j = whole; j < D; ++j) yn[j] = w != nullptr ? xn[j] * r * w[j] : xn[j] * r;
    } else {
      for (int64_t j = 0; j < D; ++j) {
        const T normed = static_cast<T>(static_cast<float>(xn[j]) * r);
        yn[j] = w != nullptr ? static_cast<T>(static_cast<float>(normed) * static_cast<float>(w[j]))
                             : normed;
      }
    }
  }
}

// The loop over every row of x (w undefined: no weight). A decode step's rows run on the calling
// thread (grain: 64 Ki elements), longer inputs across threads. Six ATen ops per norm, each
// allocating, took 1.7 ms of a 24 ms batch-64 decode step on a 2-vCPU Xeon (13 norms); the loop
// takes a few microseconds.
at::Tensor Rows(const at::Tensor& x_ND, const at::Tensor& w_D, double eps) {
  const at::Tensor x = x_ND.contiguous();
  const at::Tensor w = w_D.defined() ? w_D.to(x.scalar_type()).contiguous() : at::Tensor();
  at::Tensor y = at::empty_like(x);
  const int64_t D = x.size(-1), rows = D > 0 ? x.numel() / D : 0;
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "rms_norm_rows", [&] {
    if constexpr (std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, at::BFloat16>) {
      const scalar_t* xp = x.data_ptr<scalar_t>();
      const scalar_t* wp = w.defined() ? w.data_ptr<scalar_t>() : nullptr;
      scalar_t* yp = y.data_ptr<scalar_t>();
      ParallelFor(0, rows, std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(D, 1)),
                  [&](int64_t begin, int64_t end) {
                    NormRows(xp + begin * D, wp, yp + begin * D, end - begin, D,
                             static_cast<float>(eps));
                  });
    }
  });
  return y;
}

// x̂ = cast(x · r) by the rows loop, differentiated by its formula in fp32.
struct NormalizeFunction : torch::autograd::Function<NormalizeFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, double eps) {
    ctx->save_for_backward({x});
    ctx->saved_data["eps"] = eps;
    return Rows(x, at::Tensor(), eps);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const at::Tensor x = ctx->get_saved_variables()[0];
    const double eps = ctx->saved_data["eps"].toDouble();
    const at::Tensor xf = x.to(at::kFloat), g = grads[0].to(at::kFloat);
    const at::Tensor r = at::rsqrt(xf.pow(2).mean(-1, /*keepdim=*/true) + eps);
    const at::Tensor normed = xf * r;
    const at::Tensor dx = r * (g - normed * (g * normed).mean(-1, /*keepdim=*/true));
    return {dx.to(x.scalar_type()), at::Tensor()};
  }
};

}  // namespace

at::Tensor RmsNorm(const RmsNormParams& p) {
  const bool grad =
      c10::GradMode::is_enabled() && (p.x_ND.requires_grad() || p.w_D.requires_grad());
  const bool rows = RowsServe(p);
  if (rows && !grad) return Rows(p.x_ND, p.w_D, p.eps);
  // cast(x · r): the loop's, differentiated by its formula, or ATen's ops (float64, CUDA).
  const at::ScalarType dt = p.x_ND.scalar_type();
  at::Tensor normed;
  if (rows) {
    normed = NormalizeFunction::apply(p.x_ND, p.eps);
  } else {
    const at::Tensor x = dt == at::kDouble ? p.x_ND : p.x_ND.to(at::kFloat);
    normed = (x * at::rsqrt(x.pow(2).mean(-1, /*keepdim=*/true) + p.eps)).to(dt);
  }
  if (MixedInUse(normed, p.w_D)) return MixedScale({normed, p.w_D});
  return normed * p.w_D.to(dt);
}

}  // namespace tinkerd::kernels
