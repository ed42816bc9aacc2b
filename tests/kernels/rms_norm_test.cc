// kernels/rms_norm against a float64 loop, in bfloat16 against Hugging Face's order of
// operations, its gradient against finite differences, and a broken control.
#include "kernels/rms_norm.h"

#include <ATen/core/grad_mode.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include <cmath>

#include "tests/kernels/kernel_test_util.h"

namespace tinkerd::testing {
namespace {

// y_nj = w_j · x_nj / sqrt(mean_j x² + eps), one row at a time in double; `eps_inside` false
// is the broken control (eps added after the square root).
at::Tensor Reference(const at::Tensor& x, const at::Tensor& w, double eps, bool eps_inside = true) {
  at::Tensor y = at::empty_like(x);
  const int64_t N = x.size(0), D = x.size(1);
  for (int64_t n = 0; n < N; ++n) {
    double ss = 0;
    for (int64_t j = 0; j < D; ++j) ss += x[n][j].item<double>() * x[n][j].item<double>();
    const double denom = eps_inside ? std::sqrt(ss / D + eps) : std::sqrt(ss / D) + eps;
    for (int64_t j = 0; j < D; ++j) y[n][j] = w[j].item<double>() * x[n][j].item<double>() / denom;
  }
  return y;
}

TEST(RmsNorm, MatchesALoopFloat64) {
  // Small rows (std 1e-3, mean square 1e-6) make eps = 1e-6 matter, so the control must fail.
  const at::Tensor x = Randn({7, 33}, 31, 1e-3), w = Randn({33}, 32);
  const at::Tensor y = kernels::RmsNorm({x, w, 1e-6});
  // 33 squares summed and one sqrt and division: a few ulps, ~1e-15; 1e-13 leaves margin.
  EXPECT_LT(RelErr(y, Reference(x, w, 1e-6)), 1e-13);
  EXPECT_GT(RelErr(y, Reference(x, w, 1e-6, /*eps_inside=*/false)), 1e-3);
}

TEST(RmsNorm, BFloat16FollowsHuggingFaceOrder) {
  // In bf16 the normalization runs in fp32 and is rounded once to bf16 before the weight
  // multiplies (itself rounded): two roundings to bf16's 8 significant bits, 2^-8 relative each,
  // so 2^-7 bounds the error against the float64 value of the same rounded inputs.
  const at::Device dev = KernelDevice();
  const at::Tensor x = Randn({16, 256}, 33).to(at::kBFloat16),
                   w = Randn({256}, 34).to(at::kBFloat16);
  const at::Tensor y = kernels::RmsNorm({x.to(dev), w.to(dev), 1e-6});
  EXPECT_EQ(y.scalar_type(), at::kBFloat16);
  const at::Tensor ref = Reference(x.to(at::kDouble), w.to(at::kDouble), 1e-6);
  const at::Tensor rel = ((y.to(at::kCPU, at::kDouble) - ref).abs() / ref.abs().clamp_min(1e-30));
  EXPECT_LE(rel.max().item<double>(), std::ldexp(1.0, -7));
}

TEST(RmsNorm, FloatRowsMatchALoopTheirBatchAndTraining) {
  // D = 40 takes the sixteen-lane sum and its remainder, D = 512 a decode step's rows.
  for (int64_t D : {40, 512}) {
    const at::Tensor x = Randn({70, D}, 38, 1e-3).to(at::kFloat), w = Randn({D}, 39).to(at::kFloat);
    at::Tensor y, alone;
    {
      const at::NoGradGuard no_grad;
      y = kernels::RmsNorm({x, w, 1e-6});
      alone = kernels::RmsNorm({x.narrow(0, 69, 1), w, 1e-6});
    }
    EXPECT_EQ(y.scalar_type(), at::kFloat);
    // The sum of D squares in sixteen lanes rounds D/16 + 4 times, then the division by D, the
    // sqrt, the reciprocal and two products once each: (D/16 + 9) · 2^-24 relative, 1.7e-6 at
    // D = 512; 4e-6 leaves margin. The control (eps after the sqrt) is off by ~0.3.
    const at::Tensor ref = Reference(x.to(at::kDouble), w.to(at::kDouble), 1e-6);
    EXPECT_LT(RelErr(y, ref), 4e-6) << D;
    EXPECT_GT(RelErr(y, Reference(x.to(at::kDouble), w.to(at::kDouble), 1e-6, false)), 1e-2);
    // A row alone is its row in the batch, bitwise; control: the next row differs.
    EXPECT_TRUE(at::equal(alone, y.narrow(0, 69, 1))) << D;
    EXPECT_FALSE(at::equal(alone, y.narrow(0, 68, 1))) << D;
    // With a gradient to record (x's, or a trained weight's) the forward is the same loop,
    // bitwise; ATen's expression of the norm (control) rounds otherwise.
    const at::Tensor xg = x.clone().requires_grad_(true), wg = w.clone().requires_grad_(true);
    const at::Tensor yg = kernels::RmsNorm({xg, wg, 1e-6});
    ASSERT_TRUE(yg.requires_grad());
    EXPECT_TRUE(at::equal(y, yg.detach())) << D;
    EXPECT_FALSE(at::equal(y, x * at::rsqrt(x.pow(2).mean(-1, true) + 1e-6) * w)) << D;
    // Its gradients by the formula against float64 autograd through the reference expression:
    // dx = r·(g − x̂·mean(g·x̂)) sums D terms in fp32, (D + 8) · 2^-24 relative to their
    // magnitudes, which RMSNorm keeps O(1): 3.1e-5 at D = 512; 1e-4 with margin.
    const at::Tensor R = Randn({70, D}, 40).to(at::kFloat);
    const auto grads = torch::autograd::grad({(yg * R).sum()}, {xg, wg});
    const at::Tensor x64 = x.to(at::kDouble).requires_grad_(true);
    const at::Tensor w64 = w.to(at::kDouble).requires_grad_(true);
    const at::Tensor y64 = x64 * at::rsqrt(x64.pow(2).mean(-1, true) + 1e-6) * w64;
    const auto want = torch::autograd::grad({(y64 * R.to(at::kDouble)).sum()}, {x64, w64});
    EXPECT_LT(RelErr(grads[0], want[0]), 1e-4) << D;
    EXPECT_LT(RelErr(grads[1], want[1]), 1e-4) << D;
    EXPECT_GT(RelErr(grads[0], want[0] * 1.01), 5e-3) << D;  // control: 1% off is seen
  }
}

TEST(RmsNorm, BFloat16RowsAreTheirBatchsAndTrainingsToTheBit) {
  const at::Tensor x = Randn({33, 72}, 41).to(at::kBFloat16), w = Randn({72}, 42);
  at::Tensor y, alone;
  {
    const at::NoGradGuard no_grad;
    y = kernels::RmsNorm({x, w, 1e-6});  // an fp32 master weight, cast to bf16
    alone = kernels::RmsNorm({x.narrow(0, 32, 1), w, 1e-6});
  }
  ASSERT_EQ(y.scalar_type(), at::kBFloat16);
  EXPECT_TRUE(at::equal(alone, y.narrow(0, 32, 1)));
  EXPECT_FALSE(at::equal(alone, y.narrow(0, 31, 1)));
  const at::Tensor yg =
      kernels::RmsNorm({x.clone().requires_grad_(true), w.clone().requires_grad_(true), 1e-6});
  EXPECT_TRUE(at::equal(y, yg.detach()));
}

TEST(RmsNorm, GradientMatchesFiniteDifferences) {
  const at::Tensor x0 = Randn({3, 9}, 35), w = Randn({9}, 36), R = Randn({3, 9}, 37);
  const at::Tensor x = x0.clone().requires_grad_(true);
  (kernels::RmsNorm({x, w, 1e-6}) * R).sum().backward();
  // Central differences, h = 1e-6: truncation and rounding both below 1e-9 at |f| ~ 10.
  const double h = 1e-6;
  for (int64_t i = 0; i < x0.numel(); i += 4) {
    at::Tensor plus = x0.clone(), minus = x0.clone();
    plus.view(-1)[i] += h;
    minus.view(-1)[i] -= h;
    const double fd = ((kernels::RmsNorm({plus, w, 1e-6}) * R).sum().item<double>() -
                       (kernels::RmsNorm({minus, w, 1e-6}) * R).sum().item<double>()) /
                      (2 * h);
    EXPECT_NEAR(x.grad().view(-1)[i].item<double>(), fd, 1e-7) << i;
  }
}

}  // namespace
}  // namespace tinkerd::testing
