#include "runner/loss/losses.h"

namespace tinkerd {

// Weights are real-valued and may be negative (Tinker's forward_backward_custom relies on it).
// Top-K targets: logp_TK and weights_TK, ℓ_t = −Σ_k w_tk·logp_tk; a zero weight's term is 0
// whatever its logprob (a padded slot's may be −inf).
LossTokenOutputs CrossEntropyLoss(const LossTokenInputs& in, const Config&) {
  if (in.logp_T.dim() == 1) return {-in.weights_T * in.logp_T, at::Tensor()};
  const at::Tensor terms_TK =
      at::where(in.weights_T.ne(0), -in.weights_T * in.logp_T, at::zeros_like(in.logp_T));
  return {terms_TK.sum(1), at::Tensor()};
}

}  // namespace tinkerd
