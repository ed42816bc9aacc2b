#include "kernels/linear.h"

#include "kernels/gemv.h"

namespace tinkerd::kernels {

at::Tensor Linear(const LinearParams& p) {
  const at::ScalarType dt = p.x_NI.scalar_type();
  const at::Tensor w = p.w_OI.to(dt);
  at::Tensor y;
  if (GemvServes(p.x_NI, w)) {
    y = Gemv({p.x_NI, w});
    if (p.b_O.defined()) y.add_(p.b_O.to(dt));
  } else {
    y = p.b_O.defined() ? at::addmm(p.b_O.to(dt), p.x_NI, w.t()) : at::mm(p.x_NI, w.t());
  }
  if (p.A_rI.defined()) {
    const at::Tensor low_Nr = LinearProduct(p.x_NI, p.A_rI.to(dt));
    y = y + LinearProduct(low_Nr, p.B_Or.to(dt)) * p.scale;
  }
  int64_t row = 0;
  for (const LoraRun& run : p.runs) {
    TORCH_CHECK(!p.A_rI.defined(), "Linear: runs and a single adapter are exclusive");
    if (run.A_rI.defined()) {
      // The single adapter's arithmetic on the run's rows, so each row rounds as it would alone.
      const at::Tensor low_Nr = LinearProduct(p.x_NI.narrow(0, row, run.rows), run.A_rI.to(dt));
      y.narrow(0, row, run.rows).add_(LinearProduct(low_Nr, run.B_Or.to(dt)) * run.scale);
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
