#include "kernels/adamw.h"

#include <ATen/core/grad_mode.h>

#include <cmath>

namespace tinkerd::kernels {

void AdamW(const AdamWParams& p) {
  if (p.params.empty()) return;
  at::NoGradGuard no_grad;
  const double bias1 = 1.0 - std::pow(p.beta1, static_cast<double>(p.step));
  const double bias2 = 1.0 - std::pow(p.beta2, static_cast<double>(p.step));
  if (p.weight_decay != 0) at::_foreach_mul_(p.params, 1.0 - p.lr * p.weight_decay);
  at::_foreach_mul_(p.exp_avgs, p.beta1);
  at::_foreach_add_(p.exp_avgs, p.grads, 1.0 - p.beta1);
  at::_foreach_mul_(p.exp_avg_sqs, p.beta2);
  at::_foreach_addcmul_(p.exp_avg_sqs, p.grads, p.grads, 1.0 - p.beta2);
  std::vector<at::Tensor> denom = at::_foreach_sqrt(p.exp_avg_sqs);
  at::_foreach_div_(denom, std::sqrt(bias2));
  at::_foreach_add_(denom, p.eps);
  at::_foreach_addcdiv_(p.params, p.exp_avgs, denom, -p.lr / bias1);
}

}  // namespace tinkerd::kernels
