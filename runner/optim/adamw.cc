#include "runner/optim/adamw.h"

#include <ATen/core/grad_mode.h>

#include <cmath>

#include "absl/strings/str_cat.h"

namespace tinkerd {

absl::Status ValidateAdamParams(const AdamParams& p) {
  auto bad = [](const char* field, const char* why, double v) {
    return absl::InvalidArgumentError(
        absl::StrCat("adam_params.", field, ": ", why, " (got ", v, ")"));
  };
  if (!std::isfinite(p.learning_rate) || p.learning_rate < 0)
    return bad("learning_rate", "must be finite and >= 0", p.learning_rate);
  if (!(p.beta1 >= 0 && p.beta1 < 1)) return bad("beta1", "must be in [0, 1)", p.beta1);
  if (!(p.beta2 >= 0 && p.beta2 < 1)) return bad("beta2", "must be in [0, 1)", p.beta2);
  if (!std::isfinite(p.eps) || p.eps < 0) return bad("eps", "must be finite and >= 0", p.eps);
  if (!std::isfinite(p.weight_decay) || p.weight_decay < 0)
    return bad("weight_decay", "must be finite and >= 0", p.weight_decay);
  if (!std::isfinite(p.grad_clip_norm) || p.grad_clip_norm < 0)
    return bad("grad_clip_norm", "must be finite and >= 0 (0 disables clipping)", p.grad_clip_norm);
  return absl::OkStatus();
}

void AdamWUpdate(const AdamParams& p, int64_t step, const at::Tensor& grad, at::Tensor& param,
                 at::Tensor& exp_avg, at::Tensor& exp_avg_sq) {
  at::NoGradGuard no_grad;
  const double bias1 = 1.0 - std::pow(p.beta1, static_cast<double>(step));
  const double bias2 = 1.0 - std::pow(p.beta2, static_cast<double>(step));
  if (p.weight_decay != 0) param.mul_(1.0 - p.learning_rate * p.weight_decay);
  exp_avg.mul_(p.beta1).add_(grad, 1.0 - p.beta1);
  exp_avg_sq.mul_(p.beta2).addcmul_(grad, grad, 1.0 - p.beta2);
  at::Tensor denom = (exp_avg_sq.sqrt() / std::sqrt(bias2)).add_(p.eps);
  param.addcdiv_(exp_avg, denom, -p.learning_rate / bias1);
}

}  // namespace tinkerd
