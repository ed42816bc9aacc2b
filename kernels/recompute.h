// Activation checkpointing: y = fn(x) computed without keeping fn's intermediate activations, and
// recomputed with autograd on when the backward pass reaches y. A checkpointed decoder layer keeps
// only its input alive, so a model's activation memory is the residual stream plus the one layer
// being recomputed.
//
// `params` are the trainable tensors fn reads besides x (a layer's LoRA pair, or its weights under
// full fine-tuning); their gradients come out exactly as without checkpointing, provided fn is
// deterministic (every op here is, on the CPU and in the flash forward).
#pragma once

#include <ATen/ATen.h>

#include <functional>
#include <vector>

namespace tinkerd::kernels {

using LayerFn = std::function<at::Tensor(const at::Tensor&)>;

// Without grad mode, or with nothing that needs a gradient, this is fn(x).
at::Tensor Recompute(LayerFn fn, const at::Tensor& x, const std::vector<at::Tensor>& params);

}  // namespace tinkerd::kernels
