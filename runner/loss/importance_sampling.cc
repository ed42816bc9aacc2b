#include "runner/loss/losses.h"

namespace tinkerd {

LossTokenOutputs ImportanceSamplingLoss(const LossTokenInputs& in, const Config&) {
  at::Tensor ratio_T = at::exp(in.logp_T - in.logq_T);
  return {-ratio_T * in.adv_T, at::Tensor()};
}

}  // namespace tinkerd
