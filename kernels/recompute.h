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

// Weights that live elsewhere (slices on every rank, runner/dist/param_shard.h): `gather` brings
// them whole (undefined entries stay undefined), once for the forward and again for the
// backward's recompute, and they are dropped after each. Their gradients leave through `scatter`,
// position by position (undefined where none reached), not through the graph. Without `scatter`
// they are frozen (a sharded base's): no gradient of theirs is computed at all. Either function
// may throw; the backward then fails.
struct Gathered {
  std::function<std::vector<at::Tensor>()> gather;
  std::function<void(const std::vector<at::Tensor>& grads)> scatter;
};
using GatheredFn =
    std::function<at::Tensor(const at::Tensor& x, const std::vector<at::Tensor>& weights)>;

// y = fn(x, gathered weights), checkpointed as Recompute is; `params` are as Recompute's (a
// layer's LoRA pairs over a sharded base), their gradients flowing through the graph as x's does.
// Without grad mode, fn(x, gather()).
at::Tensor RecomputeGathered(GatheredFn fn, Gathered weights, const at::Tensor& x,
                             const std::vector<at::Tensor>& params = {});

}  // namespace tinkerd::kernels
