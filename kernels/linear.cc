#include "kernels/linear.h"

namespace tinkerd::kernels {

at::Tensor Linear(const LinearParams& p) {
  const at::ScalarType dt = p.x_NI.scalar_type();
  const at::Tensor w = p.w_OI.to(dt);
  at::Tensor y = p.b_O.defined() ? at::addmm(p.b_O.to(dt), p.x_NI, w.t()) : at::mm(p.x_NI, w.t());
  if (p.A_rI.defined()) {
    const at::Tensor low_Nr = at::mm(p.x_NI, p.A_rI.to(dt).t());
    y = y + at::mm(low_Nr, p.B_Or.to(dt).t()) * p.scale;
  }
  int64_t row = 0;
  for (const LoraRun& run : p.runs) {
    TORCH_CHECK(!p.A_rI.defined(), "Linear: runs and a single adapter are exclusive");
    if (run.A_rI.defined()) {
      // The single adapter's arithmetic on the run's rows, so each row rounds as it would alone.
      const at::Tensor low_Nr = at::mm(p.x_NI.narrow(0, row, run.rows), run.A_rI.to(dt).t());
      y.narrow(0, row, run.rows).add_(at::mm(low_Nr, run.B_Or.to(dt).t()) * run.scale);
    }
    row += run.rows;
  }
  TORCH_CHECK(p.runs.empty() || row == p.x_NI.size(0), "Linear: runs cover ", row, " rows of ",
              p.x_NI.size(0));
  return y;
}

at::Tensor SwiGLU(const at::Tensor& gate_NI, const at::Tensor& up_NI) {
  return at::silu(gate_NI) * up_NI;
}

}  // namespace tinkerd::kernels
