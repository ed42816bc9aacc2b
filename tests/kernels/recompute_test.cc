// kernels/recompute: a checkpointed function gives the same gradients, bitwise, as the same
// function kept in the graph, for its input and for the parameters it reads; a function that
// does not recompute the same values (the broken control) is seen to differ.
#include "kernels/recompute.h"

#include <gtest/gtest.h>

#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/autograd.h>

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
