#include "runner/loss/losses.h"

namespace tinkerd {

LossTokenOutputs DroLoss(const LossTokenInputs& in, const Config& cfg) {
  const double beta = cfg.at("beta");
  at::Tensor drift_T = in.logp_T - in.logq_T;
  return {-(in.logp_T * in.adv_T - 0.5 * beta * drift_T * drift_T), at::Tensor()};
}

}  // namespace tinkerd
