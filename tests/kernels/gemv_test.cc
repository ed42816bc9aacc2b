// kernels/gemv against a float64 loop within the derived bound, with broken controls; a row's
// result the same to the bit alone, in any batch and on any thread count; and the products it
// leaves to LibTorch. Gemv runs on the CPU only, whatever the test device.
//
// The bound. y[n, o] is sixteen partial sums of ceil(I/16) products each, then four rounds of
// pairwise additions. Along the way each product is rounded at most twice per step (once with a
// fused multiply-add) and each addition once, so with u = 2^-24 (float32) and first order in u:
//   |y − y_exact| <= (2·ceil(I/16) + 4) · u · Σ_i |x_ni · w_oi|
// The float64 reference is exact to far below that.
//
// Shape suffixes: N rows, I in features, O out features.
#include "kernels/gemv.h"

#include <ATen/Parallel.h>
#include <ATen/core/grad_mode.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>

#include "tests/kernels/kernel_test_util.h"

namespace tinkerd::testing {
namespace {

constexpr double kU = 1.0 / (1 << 24);

// The largest ratio |got − want| / bound over the outputs, the bound as derived above.
double WorstOverBound(const at::Tensor& got_NO, const at::Tensor& want_NO, const at::Tensor& x_NI,
                      const at::Tensor& w_OI) {
  const int64_t I = x_NI.size(1);
  const double steps = 2.0 * static_cast<double>((I + 15) / 16) + 4.0;
  const at::Tensor magnitude = at::mm(x_NI.to(at::kDouble).abs(), w_OI.to(at::kDouble).abs().t());
  const at::Tensor bound = magnitude * (steps * kU) + 1e-300;
  return ((got_NO.to(at::kDouble) - want_NO).abs() / bound).max().item<double>();
}

at::Tensor Reference(const at::Tensor& x_NI, const at::Tensor& w_OI) {
  return at::mm(x_NI.to(at::kDouble), w_OI.to(at::kDouble).t());
}

TEST(Gemv, MatchesFloat64WithinTheDerivedBound) {
  at::NoGradGuard no_grad;
  uint64_t seed = 100;
  for (int64_t N : {1, 3, 4, 5, 13, 130}) {
    for (int64_t O : {1, 3, 4, 9}) {
      for (int64_t I : {5, 16, 37, 96}) {
        const at::Tensor x = Randn({N, I}, ++seed).to(at::kFloat);
        const at::Tensor w = Randn({O, I}, ++seed).to(at::kFloat);
        const at::Tensor y = kernels::Gemv({x, w});
        ASSERT_EQ(y.sizes(), (at::IntArrayRef{N, O}));
        EXPECT_LE(WorstOverBound(y, Reference(x, w), x, w), 1.0)
            << "N " << N << " O " << O << " I " << I;
        // Controls: the outputs of the neighbouring weight row, and (with a tail) the product
        // without the last I mod 16 elements, are rejected by the same bound.
        if (O > 1) {
          const at::Tensor shifted = Reference(x, w.roll(1, 0));
          EXPECT_GT(WorstOverBound(y, shifted, x, w), 1.0) << "N " << N << " O " << O;
        }
        if (I % 16 != 0) {
          const int64_t kept = I - I % 16;
          const at::Tensor no_tail = Reference(x.narrow(1, 0, kept), w.narrow(1, 0, kept));
          EXPECT_GT(WorstOverBound(y, no_tail, x, w), 1.0) << "N " << N << " I " << I;
        }
      }
    }
  }
}

TEST(Gemv, ReadsRowsWithAStride) {
  at::NoGradGuard no_grad;
  // x's rows 40 floats apart, 33 of them used: a narrowed activation.
  const at::Tensor wide = Randn({6, 40}, 7).to(at::kFloat);
  const at::Tensor x = wide.narrow(1, 3, 33);
  ASSERT_FALSE(x.is_contiguous());
  const at::Tensor w = Randn({11, 33}, 8).to(at::kFloat);
  EXPECT_LE(WorstOverBound(kernels::Gemv({x, w}), Reference(x, w), x, w), 1.0);
}

// y[n, o] summed in gemv.h's order, one scalar at a time: lane j accumulates x[i]·w[i] for i = j,
// j + 16, ... by fused multiply-adds (std::fma; the kernels' builds fuse `acc += x * w`), the
// lanes past I adding 0·0; then lanes j + 8, j + 4 and the last four pairwise. With `fused` off,
// each product is rounded before it is added (this file is built for baseline x86-64, which has
// no FMA to contract into): the control.
float InTheOrder(const float* x, const float* w, int64_t I, bool fused = true) {
  float lane[16] = {};
  for (int64_t i0 = 0; i0 < I; i0 += 16) {
    for (int j = 0; j < 16; ++j) {
      const bool in = i0 + j < I;
      const float xi = in ? x[i0 + j] : 0.0f, wi = in ? w[i0 + j] : 0.0f;
      lane[j] = fused ? std::fma(xi, wi, lane[j]) : lane[j] + xi * wi;
    }
  }
  float s8[8], s4[4];
  for (int j = 0; j < 8; ++j) s8[j] = lane[j] + lane[j + 8];
  for (int j = 0; j < 4; ++j) s4[j] = s8[j] + s8[j + 4];
  return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

// Each CPU kind runs its own blocks (4 × 4 of 16-lane registers on AVX-512, 3 × 2 in halves on
// AVX2); both must sum in the one order, so that a result does not depend on which ran it. The
// shapes give every block size of either kind, and tails of 0, 1, 3, 8 and 13 elements (past the
// first half of the last sixteen).
TEST(Gemv, SumsInTheStatedOrderToTheBit) {
  if (!kernels::GemvRunsHere()) GTEST_SKIP() << "without AVX2 and FMA Gemv rounds each product";
  at::NoGradGuard no_grad;
  uint64_t seed = 300;
  for (int64_t N : {1, 2, 3, 4, 7, 70}) {
    for (int64_t O : {1, 2, 3, 5, 7, 8}) {
      for (int64_t I : {3, 16, 29, 40, 257}) {
        const at::Tensor x = Randn({N, I}, ++seed).to(at::kFloat);
        const at::Tensor w = Randn({O, I}, ++seed).to(at::kFloat);
        const at::Tensor y = kernels::Gemv({x, w});
        at::Tensor want = at::empty({N, O}, at::kFloat), unfused = at::empty({N, O}, at::kFloat);
        auto want_NO = want.accessor<float, 2>();
        auto unfused_NO = unfused.accessor<float, 2>();
        for (int64_t n = 0; n < N; ++n) {
          for (int64_t o = 0; o < O; ++o) {
            const float* xn = x.data_ptr<float>() + n * I;
            const float* wo = w.data_ptr<float>() + o * I;
            want_NO[n][o] = InTheOrder(xn, wo, I);
            unfused_NO[n][o] = InTheOrder(xn, wo, I, /*fused=*/false);
          }
        }
        EXPECT_TRUE(at::equal(y, want)) << "N " << N << " O " << O << " I " << I;
        // The control, the same order without fused multiply-adds, rounds otherwise somewhere
        // in each case with more than a few outputs.
        if (N * O >= 8 && I > 16) {
          EXPECT_FALSE(at::equal(y, unfused)) << "N " << N << " O " << O << " I " << I;
        }
      }
    }
  }
}

TEST(Gemv, ARowIsTheSameToTheBitInAnyBatchAndOnAnyThreadCount) {
  at::NoGradGuard no_grad;
  // Two whole tiles and part of a third: rows on either side of each tile's edge.
  const int64_t N = 2 * kernels::kGemvTileRows + 22;
  const at::Tensor x = Randn({N, 300}, 11).to(at::kFloat);
  const at::Tensor w = Randn({301, 300}, 12).to(at::kFloat);
  const at::Tensor all = kernels::Gemv({x, w});
  for (int64_t n :
       {int64_t{0}, int64_t{5}, kernels::kGemvTileRows - 1, kernels::kGemvTileRows, N - 1}) {
    EXPECT_TRUE(at::equal(kernels::Gemv({x.narrow(0, n, 1), w}), all.narrow(0, n, 1))) << n;
  }
  EXPECT_TRUE(at::equal(kernels::Gemv({x.narrow(0, 3, 7), w}), all.narrow(0, 3, 7)));
  EXPECT_TRUE(at::equal(kernels::Gemv({x.narrow(0, 60, 70), w}), all.narrow(0, 60, 70)));
  const int threads = at::get_num_threads();
  at::set_num_threads(1);
  const at::Tensor one_thread = kernels::Gemv({x, w});
  at::set_num_threads(threads);
  EXPECT_TRUE(at::equal(one_thread, all));
  // Controls: the comparison tells a one-ulp difference apart, and the BLAS's product of the same
  // rows (what a product over 64 rows took before tiles) rounds otherwise.
  at::Tensor nudged = all.clone();
  nudged[0][0] = std::nextafter(nudged[0][0].item<float>(), 1e9f);
  EXPECT_FALSE(at::equal(nudged, all));
  EXPECT_FALSE(at::equal(at::mm(x, w.t()), all));
}

TEST(Gemv, ServesFloat32OutsideAutogradOnly) {
  const at::Tensor x = Randn({8, 32}, 21).to(at::kFloat);
  const at::Tensor w = Randn({16, 32}, 22).to(at::kFloat);
  const bool runs = kernels::GemvRunsHere();  // where it serves at all
  {
    at::NoGradGuard no_grad;
    EXPECT_EQ(kernels::GemvServes(x, w), runs);
    EXPECT_EQ(kernels::GemvServes(x.requires_grad_(true), w), runs);
    x.requires_grad_(false);
    EXPECT_FALSE(kernels::GemvServes(x.to(at::kDouble), w.to(at::kDouble)));
    EXPECT_FALSE(kernels::GemvServes(x.to(at::kBFloat16), w.to(at::kBFloat16)));
    const at::Tensor many = Randn({kernels::kGemvTileRows * 40 + 1, 32}, 23).to(at::kFloat);
    EXPECT_EQ(kernels::GemvServes(many, w), runs);  // a prefill, in tiles
  }
  // Under autograd a product that needs a gradient is LibTorch's, and records one.
  const at::Tensor xg = x.clone().requires_grad_(true);
  EXPECT_FALSE(kernels::GemvServes(xg, w));
  const at::Tensor y = kernels::LinearProduct(xg, w);
  EXPECT_TRUE(y.requires_grad());
  y.sum().backward();
  EXPECT_LE(RelErr(xg.grad(), w.sum(0).expand({8, 32})), 1e-6);
  // LinearProduct by Gemv equals the BLAS's product within the bound.
  at::NoGradGuard no_grad;
  EXPECT_LE(WorstOverBound(kernels::LinearProduct(x, w), Reference(x, w), x, w), 1.0);
}

}  // namespace
}  // namespace tinkerd::testing
