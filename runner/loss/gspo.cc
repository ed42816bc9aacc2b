#include "runner/loss/losses.h"

namespace tinkerd {

// Each datum's ratio is reduced over its own positions alone (narrow + sum, in position order), so
// it does not depend on which datums share the micro-batch, and needs no atomics on a GPU.
LossTokenOutputs GspoLoss(const LossTokenInputs& in, const Config& cfg) {
  const double lo = cfg.at("clip_low_threshold");
  const double hi = cfg.at("clip_high_threshold");
  const at::Tensor in_ratio_T = in.ratio_mask_T.ne(0);
  const at::Tensor diff_T =
      at::where(in_ratio_T, in.logp_T.detach() - in.logq_T, at::zeros_like(in.logq_T));
  std::vector<at::Tensor> log_s;
  for (size_t j = 0; j + 1 < in.cu_seqlens.size(); ++j) {
    const int64_t start = in.cu_seqlens[j], length = in.cu_seqlens[j + 1] - start;
    const at::Tensor count = in_ratio_T.narrow(0, start, length).sum().to(diff_T.scalar_type());
    const at::Tensor mean = diff_T.narrow(0, start, length).sum() / count.clamp_min(1);
    log_s.push_back(mean.expand({length}));
  }
  const at::Tensor ratio_T = at::exp(at::cat(log_s) + in.logp_T - in.logp_T.detach());
  const at::Tensor unclipped_T = ratio_T * in.adv_T;
  const at::Tensor clipped_T = at::clamp(ratio_T, lo, hi) * in.adv_T;
  const at::Tensor was_clipped = ratio_T.detach().lt(lo).logical_or(ratio_T.detach().gt(hi));
  return {-at::min(unclipped_T, clipped_T), was_clipped};
}

}  // namespace tinkerd
