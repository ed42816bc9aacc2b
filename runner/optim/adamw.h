// AdamW with torch.optim.AdamW semantics (decoupled weight decay, bias-corrected moments):
//   p ← p·(1 − lr·wd)
//   m ← β1·m + (1 − β1)·g          v ← β2·v + (1 − β2)·g²
//   p ← p − lr/(1 − β1ᵗ) · m / (sqrt(v)/sqrt(1 − β2ᵗ) + eps)
// where g is the normalized gradient times the clip coefficient and t the step being taken (≥ 1).
#pragma once

#include <ATen/ATen.h>

#include "absl/status/status.h"
#include "runner/types.h"
#include "runner/validate.h"  // ValidateAdamParams: torch-free, so the server checks at its edge

namespace tinkerd {

// Updates `param`, `exp_avg`, `exp_avg_sq` in place. `grad` is read only.
void AdamWUpdate(const AdamParams& p, int64_t step, const at::Tensor& grad, at::Tensor& param,
                 at::Tensor& exp_avg, at::Tensor& exp_avg_sq);

}  // namespace tinkerd
