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
  return y;
}

at::Tensor SwiGLU(const at::Tensor& gate_NI, const at::Tensor& up_NI) {
  return at::silu(gate_NI) * up_NI;
}

}  // namespace tinkerd::kernels
