// AdamW over a list of tensors in one call, with torch.optim.AdamW's semantics (decoupled weight
// decay, bias-corrected moments), for each parameter p with gradient g at step t ≥ 1:
//   p ← p·(1 − lr·wd)
//   m ← β1·m + (1 − β1)·g          v ← β2·v + (1 − β2)·g²
//   p ← p − lr/(1 − β1ᵗ) · m / (sqrt(v)/sqrt(1 − β2ᵗ) + eps)
// Each line is one multi-tensor (_foreach) op over every parameter: on a GPU, a handful of
// kernel launches a step instead of about ten per parameter (torch.optim.AdamW's default
// implementation on CUDA is the same). On the CPU the ops loop over the tensors, bitwise as the
// per-tensor ops, so a parameter's update does not depend on which others share the call; on CUDA
// the multi-tensor division may round in the last bit otherwise than a per-tensor one.
#pragma once

#include <ATen/ATen.h>

#include <vector>

namespace tinkerd::kernels {

struct AdamWParams {
  // Parallel lists, one entry per parameter: same shape, dtype and device within an entry.
  std::vector<at::Tensor> params;       // updated in place
  std::vector<at::Tensor> grads;        // read only
  std::vector<at::Tensor> exp_avgs;     // m, updated in place
  std::vector<at::Tensor> exp_avg_sqs;  // v, updated in place
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  int64_t step = 1;  // the step being taken, counted from 1
};

void AdamW(const AdamWParams& p);

}  // namespace tinkerd::kernels
