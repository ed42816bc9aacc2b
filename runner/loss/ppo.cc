#include "runner/loss/losses.h"

namespace tinkerd {

// Thresholds bound the ratio itself (0.8 / 1.2 by default), not an epsilon around 1.
LossTokenOutputs PpoLoss(const LossTokenInputs& in, const Config& cfg) {
  const double lo = cfg.at("clip_low_threshold");
  const double hi = cfg.at("clip_high_threshold");
  at::Tensor ratio_T = at::exp(in.logp_T - in.logq_T);
  at::Tensor unclipped_T = ratio_T * in.adv_T;
  at::Tensor clipped_T = at::clamp(ratio_T, lo, hi) * in.adv_T;
  at::Tensor was_clipped = ratio_T.detach().lt(lo).logical_or(ratio_T.detach().gt(hi));
  return {-at::min(unclipped_T, clipped_T), was_clipped};
}

}  // namespace tinkerd
