#include "runner/optim/adamw.h"

#include <ATen/core/grad_mode.h>

#include <cmath>

#include "absl/strings/str_cat.h"

namespace tinkerd {

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
