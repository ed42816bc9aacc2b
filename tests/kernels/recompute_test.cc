// kernels/recompute: a checkpointed function gives the same gradients, bitwise, as the same
// function kept in the graph, for its input and for the parameters it reads; a function that
// does not recompute the same values (the broken control) is seen to differ.
#include "kernels/recompute.h"

#include <gtest/gtest.h>

#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/autograd.h>

#include <vector>

#include "kernels/gemv.h"
#include "kernels/rms_norm.h"
#include "tests/kernels/kernel_test_util.h"

namespace tinkerd::testing {
namespace {

struct Grads {
  at::Tensor x, W, b;
};

// Two stacked "layers" y = tanh(x·W + b) + x, the first checkpointed or not, then a scalar loss.
// `drift` is added on every call after the first: a layer that is not deterministic.
Grads RunLayers(bool checkpoint, double drift) {
  const at::Tensor x = Randn({5, 4}, 41).requires_grad_(true);
  const at::Tensor W = Randn({4, 4}, 42).requires_grad_(true);
  const at::Tensor b = Randn({4}, 43).requires_grad_(true);
  const at::Tensor frozen = Randn({4, 4}, 44);
  int calls = 0;
  kernels::LayerFn layer = [&](const at::Tensor& in) {
    const double extra = calls++ > 0 ? drift : 0.0;
    return at::tanh(at::mm(in, W) + b + extra) + at::mm(in, frozen);
  };
  const at::Tensor h = checkpoint ? kernels::Recompute(layer, x, {W, b, frozen}) : layer(x);
  const at::Tensor loss = (at::tanh(at::mm(h, W)) * Randn({5, 4}, 45)).sum();
  const auto g = torch::autograd::grad({loss}, {x, W, b});
  return {g[0], g[1], g[2]};
}

TEST(Recompute, GradientsEqualTheUncheckpointedGraph) {
  const Grads plain = RunLayers(false, 0), ckpt = RunLayers(true, 0);
  EXPECT_TRUE(at::equal(plain.x, ckpt.x));
  EXPECT_TRUE(at::equal(plain.W, ckpt.W));
  EXPECT_TRUE(at::equal(plain.b, ckpt.b));
}

// A float32 layer of the model's own kernels: h = W_frozen · norm(x) ⊙ g + x, g trainable. Its norm
// is the rows loop, differentiated by its formula (kernels/rms_norm.h); the checkpointed forward
// must rerun exactly that.
std::vector<at::Tensor> RunKernelLayer(bool checkpoint) {
  const at::Tensor x = Randn({70, 48}, 47).to(at::kFloat).requires_grad_(true);
  const at::Tensor g = Randn({64}, 48).to(at::kFloat).requires_grad_(true);
  const at::Tensor W = Randn({64, 48}, 49).to(at::kFloat), norm_w = Randn({48}, 50).to(at::kFloat);
  kernels::LayerFn layer = [&](const at::Tensor& in) {
    const at::Tensor normed = kernels::RmsNorm({in, norm_w, 1e-6});
    return at::tanh(kernels::LinearProduct(normed, W) * g).sum(1, true) + in;
  };
  const at::Tensor h = checkpoint ? kernels::Recompute(layer, x, {g}) : layer(x);
  const at::Tensor loss = (h * h).sum();
  return torch::autograd::grad({loss}, {x, g});
}

TEST(Recompute, Float32KernelLayerGradientsEqualTheUncheckpointedGraph) {
  const std::vector<at::Tensor> plain = RunKernelLayer(false), ckpt = RunKernelLayer(true);
  EXPECT_TRUE(at::equal(plain[0], ckpt[0]));  // x's gradient
  EXPECT_TRUE(at::equal(plain[1], ckpt[1]));  // g's
  // Control: ATen's expression of the same norm differs from the loop in the last bits, so a
  // checkpoint that ran another norm than the forward's would be seen.
  const at::Tensor x = Randn({70, 48}, 47).to(at::kFloat);
  const at::Tensor norm_w = Randn({48}, 50).to(at::kFloat);
  const at::Tensor loop = kernels::RmsNorm({x.clone().requires_grad_(true), norm_w, 1e-6});
  const at::Tensor aten = x * at::rsqrt(x.pow(2).mean(-1, true) + 1e-6) * norm_w;
  EXPECT_FALSE(at::equal(loop.detach(), aten));
}

// Frozen gathered weights (a sharded base's, runner/dist/param_shard.h) under trainable params (a
// LoRA pair): x's and the params' gradients are the uncheckpointed graph's bitwise, the weights
// are gathered once for the forward and once for the recompute, and no gradient of theirs is
// made (they never require one). Control: with a scatter the same weights record gradients.
TEST(Recompute, GatheredFrozenWeightsPassParamsGradients) {
  const at::Tensor W = Randn({4, 4}, 51), b = Randn({4}, 52);
  auto run = [&](bool checkpoint, bool scatter, int* gathers, bool* weights_grad) {
    const at::Tensor x = Randn({5, 4}, 53).requires_grad_(true);
    const at::Tensor A = Randn({2, 4}, 54).requires_grad_(true);
    const at::Tensor B = Randn({4, 2}, 55).requires_grad_(true);
    kernels::GatheredFn fn = [&](const at::Tensor& in, const std::vector<at::Tensor>& w) {
      *weights_grad = *weights_grad || w[0].requires_grad();
      return at::tanh(at::mm(in, w[0]) + w[1] + at::mm(at::mm(in, A.t()), B.t())) + in;
    };
    kernels::Gathered source;
    source.gather = [&] {
      ++*gathers;
      return std::vector<at::Tensor>{W.clone(), b.clone()};
    };
    if (scatter) source.scatter = [](const std::vector<at::Tensor>&) {};
    const at::Tensor h =
        checkpoint ? kernels::RecomputeGathered(fn, source, x, {A, B}) : fn(x, {W, b});
    const at::Tensor loss = (at::tanh(h) * Randn({5, 4}, 56)).sum();
    return torch::autograd::grad({loss}, {x, A, B});
  };
  int gathers = 0;
  bool weights_grad = false;
  const auto plain = run(false, false, &gathers, &weights_grad);
  const auto ckpt = run(true, false, &gathers, &weights_grad);
  for (size_t i = 0; i < plain.size(); ++i) EXPECT_TRUE(at::equal(plain[i], ckpt[i])) << i;
  EXPECT_EQ(gathers, 2);
  EXPECT_FALSE(weights_grad);
  run(true, true, &gathers, &weights_grad);
  EXPECT_TRUE(weights_grad);
}

TEST(Recompute, NonDeterministicLayerIsDetected) {
  const Grads plain = RunLayers(false, 0), broken = RunLayers(true, 1e-3);
  EXPECT_FALSE(at::equal(plain.W, broken.W));
  EXPECT_GT(RelErr(broken.W, plain.W), 1e-6);
}

TEST(Recompute, WithoutGradModeItIsAPlainCall) {
  at::NoGradGuard no_grad;
  const at::Tensor x = Randn({2, 3}, 46);
  int calls = 0;
  const at::Tensor y = kernels::Recompute(
      [&](const at::Tensor& in) {
        ++calls;
        return in * 2;
      },
      x, {});
  EXPECT_EQ(calls, 1);
  EXPECT_TRUE(at::equal(y, x * 2));
  EXPECT_FALSE(y.requires_grad());
}

}  // namespace
}  // namespace tinkerd::testing
