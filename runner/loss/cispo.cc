#include "runner/loss/losses.h"

namespace tinkerd {

// The clipped ratio is detached: it only weighs the policy-gradient term, so no token's gradient
// is zeroed by the clip (unlike PPO).
LossTokenOutputs CispoLoss(const LossTokenInputs& in, const Config& cfg) {
  const double lo = cfg.at("clip_low_threshold");
  const double hi = cfg.at("clip_high_threshold");
  at::Tensor ratio_T = at::exp(in.logp_T.detach() - in.logq_T);
  at::Tensor weight_T = at::clamp(ratio_T, lo, hi);
  at::Tensor was_clipped = ratio_T.lt(lo).logical_or(ratio_T.gt(hi));
  return {-weight_T * in.logp_T * in.adv_T, was_clipped};
}

}  // namespace tinkerd
