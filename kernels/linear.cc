#include "kernels/linear.h"

#include <c10/core/GradMode.h>

#include <algorithm>
#include <cstring>

#include "kernels/cpu_clones.h"
#include "kernels/gemv.h"
#include "kernels/mixed_grad.h"
#include "kernels/parallel.h"
#include "kernels/vec16.h"

namespace tinkerd::kernels {
namespace {

// y = g / (1 + e^−g) · u, sixteen at a time: ATen's silu and product, in its order of operations,
// with vec16.h's Exp.
TINKERD_CPU_CLONES void SwiGLULoop(const float* g, const float* u, float* y, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const V16 gate = *reinterpret_cast<const V16u*>(g + i);
    V16 e = -gate;
    Exp(e);
    *reinterpret_cast<V16u*>(y + i) = gate / (1.0f + e) * *reinterpret_cast<const V16u*>(u + i);
  }
  if (i < n) {  // the last n mod 16, zero-padded
    V16 gate = {}, up = {};
    std::memcpy(&gate, g + i, (n - i) * sizeof(float));
    std::memcpy(&up, u + i, (n - i) * sizeof(float));
    V16 e = -gate;
    Exp(e);
    const V16 out = gate / (1.0f + e) * up;
    std::memcpy(y + i, &out, (n - i) * sizeof(float));
  }
}

// x·c(w)ᵀ with w cast to x's dtype: through MixedLinear when it records a bf16 gradient.
at::Tensor Product(const at::Tensor& x_NI, const at::Tensor& w_OI) {
  if (MixedInUse(x_NI, w_OI)) return MixedLinear({x_NI, w_OI, {}});
  return LinearProduct(x_NI, w_OI.to(x_NI.scalar_type()));
}

}  // namespace

at::Tensor Linear(const LinearParams& p) {
  const at::ScalarType dt = p.x_NI.scalar_type();
  const bool bias = p.b_O.defined();
  at::Tensor y = MixedInUse(p.x_NI, p.w_OI) || (bias && MixedInUse(p.x_NI, p.b_O))
                     ? MixedLinear({p.x_NI, p.w_OI, p.b_O})
                     : AffineProduct(p.x_NI, p.w_OI.to(dt), bias ? p.b_O.to(dt) : at::Tensor());
  if (p.A_rI.defined()) {
    const at::Tensor low_Nr = Product(p.x_NI, p.A_rI);
    y = y + Product(low_Nr, p.B_Or) * p.scale;
  }
  int64_t row = 0;
  for (const LoraRun& run : p.runs) {
    TORCH_CHECK(!p.A_rI.defined(), "Linear: runs and a single adapter are exclusive");
    if (run.A_rI.defined()) {
      // The single adapter's arithmetic on the run's rows, so each row rounds as it would alone.
      const at::Tensor low_Nr = Product(p.x_NI.narrow(0, row, run.rows), run.A_rI);
      y.narrow(0, row, run.rows).add_(Product(low_Nr, run.B_Or) * run.scale);
    }
    row += run.rows;
  }
  TORCH_CHECK(p.runs.empty() || row == p.x_NI.size(0), "Linear: runs cover ", row, " rows of ",
              p.x_NI.size(0));
  return y;
}

at::Tensor SwiGLU(const at::Tensor& gate_NI, const at::Tensor& up_NI, bool inference) {
  const bool grad =
      c10::GradMode::is_enabled() && (gate_NI.requires_grad() || up_NI.requires_grad());
  if (inference && !grad && gate_NI.scalar_type() == at::kFloat &&
      up_NI.scalar_type() == at::kFloat && gate_NI.device().is_cpu() && up_NI.device().is_cpu() &&
      gate_NI.sizes() == up_NI.sizes()) {
    // ATen's two ops, each a parallel region and an allocation, took 0.55 ms of a 22 ms batch-64
    // decode step on a 2-vCPU Xeon. Tasks of at least 32 Ki elements: a batch-64 step's 90 Ki
    // split on its team (kernels/parallel.h), whose loops cost a few microseconds to start.
    const at::Tensor g = gate_NI.contiguous(), u = up_NI.contiguous();
    at::Tensor y = at::empty_like(g);
    const float* gp = g.data_ptr<float>();
    const float* up = u.data_ptr<float>();
    float* yp = y.data_ptr<float>();
    ParallelFor(0, g.numel(), int64_t{1} << 15, [&](int64_t begin, int64_t end) {
      SwiGLULoop(gp + begin, up + begin, yp + begin, end - begin);
    });
    return y;
  }
  return at::silu(gate_NI) * up_NI;
}

}  // namespace tinkerd::kernels
