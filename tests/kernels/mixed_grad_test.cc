// kernels/mixed_grad against float64 references of the same bf16 values: the forward is the
// unmastered layer's bit for bit, dx is the compute-dtype product autograd would form, and the
// masters' gradients are fp32 sums of exact products, within fp32's bound. Broken control: the
// gradient autograd forms through the cast (a bf16 sum) misses that bound.
//
// Shape suffixes: N rows, I in features, O out features, D normalized features.
#include "kernels/mixed_grad.h"

#include <ATen/core/grad_mode.h>
#include <gtest/gtest.h>

#include <cmath>
#include <iostream>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/gemv.h"
#include "tests/kernels/kernel_test_util.h"

namespace tinkerd::testing {
namespace {

constexpr int64_t kRows = 300, kIn = 48, kOut = 40;
const double kU = std::ldexp(1.0, -24);  // fp32's unit roundoff

// How many elements of `got` are off `want` (float64) by more than n·u·magnitude elementwise: a sum
// of n exact terms in fp32, in any order, is within (n − 1)·u·Σ|terms| of the exact sum.
int64_t OutsideBound(const at::Tensor& got, const at::Tensor& want, const at::Tensor& magnitude,
                     int64_t n) {
  const at::Tensor err = (got.detach().to(at::kCPU, at::kDouble) - want).abs();
  return err.gt(magnitude * (static_cast<double>(n - 1) * kU)).sum().item<int64_t>();
}

at::Tensor Bf16(const at::Tensor& t) {
  return t.to(at::kBFloat16).to(KernelDevice());
}

at::Tensor Master(const at::Tensor& t) {
  return t.to(at::kFloat).to(KernelDevice()).set_requires_grad(true);
}

at::Tensor Double(const at::Tensor& t) {
  return t.detach().to(at::kCPU, at::kDouble);
}

TEST(MixedGrad, LinearGradientsAreFp32SumsOfExactProducts) {
  const at::Tensor x = Bf16(Randn({kRows, kIn}, 1)), dy = Bf16(Randn({kRows, kOut}, 2));
  const at::Tensor w = Master(Randn({kOut, kIn}, 3)), b = Master(Randn({kOut}, 4));
  ASSERT_TRUE(kernels::MixedInUse(x, w));
  const at::Tensor y = kernels::MixedLinear({x.detach().requires_grad_(true), w, b});
  {
    at::NoGradGuard no_grad;
    EXPECT_TRUE(y.equal(kernels::AffineProduct(x, w.to(at::kBFloat16), b.to(at::kBFloat16))))
        << "the forward is not the unmastered layer's";
  }
  y.backward(dy);
  const at::Tensor x64 = Double(x), dy64 = Double(dy);
  EXPECT_EQ(w.grad().scalar_type(), at::kFloat);
  EXPECT_EQ(OutsideBound(w.grad(), at::mm(dy64.t(), x64), at::mm(dy64.abs().t(), x64.abs()), kRows),
            0);
  EXPECT_EQ(OutsideBound(b.grad(), dy64.sum(0), dy64.abs().sum(0), kRows), 0);

  // The control: the same product differentiated through the cast, as before masters.
  const at::Tensor w2 = Master(Randn({kOut, kIn}, 3)), xg = x.detach().requires_grad_(true);
  at::mm(xg, w2.to(at::kBFloat16).t()).backward(dy);
  EXPECT_GT(
      OutsideBound(w2.grad(), at::mm(dy64.t(), x64), at::mm(dy64.abs().t(), x64.abs()), kRows), 0)
      << "the broken control (a bf16 sum) stayed within fp32's bound";
  // dx is dy·c(w) in bf16 (to bf16's rounding of the float64 product).
  const at::Tensor x3 = x.detach().requires_grad_(true);
  kernels::MixedLinear({x3, Master(Randn({kOut, kIn}, 3)), {}}).backward(dy);
  const at::Tensor dx64 = at::mm(dy64, Double(w2.to(at::kBFloat16)));
  // Each element is a sum of 40 exact products, summed in fp32 and rounded once to bf16: within
  // 2^-8 of its magnitude plus 40·2^-24 of the products' (far smaller), so 2^-7 relative to
  // Σ|terms|.
  EXPECT_LE(((Double(x3.grad()) - dx64).abs() -
             at::mm(dy64.abs(), Double(w2.to(at::kBFloat16)).abs()) * std::ldexp(1.0, -7))
                .max()
                .item<double>(),
            0.0);
}

TEST(MixedGrad, ScaleGradientSumsEveryLeadingRow) {
  constexpr int64_t D = 16;
  const at::Tensor x = Bf16(Randn({kRows / 4, 4, D}, 5)), dy = Bf16(Randn({kRows / 4, 4, D}, 6));
  const at::Tensor w = Master(Randn({D}, 7));
  const at::Tensor y = kernels::MixedScale({x, w});
  EXPECT_TRUE(y.detach().equal(x * w.detach().to(at::kBFloat16)));
  y.backward(dy);
  const at::Tensor x64 = Double(x).reshape({-1, D}), dy64 = Double(dy).reshape({-1, D});
  EXPECT_EQ(OutsideBound(w.grad(), (dy64 * x64).sum(0), (dy64 * x64).abs().sum(0), kRows), 0);
  const at::Tensor w2 = Master(Randn({D}, 7));
  (x * w2.to(at::kBFloat16)).backward(dy);
  EXPECT_GT(OutsideBound(w2.grad(), (dy64 * x64).sum(0), (dy64 * x64).abs().sum(0), kRows), 0)
      << "the broken control (a bf16 sum) stayed within fp32's bound";
}

TEST(MixedGrad, WideProductKeepsFp32) {
  const at::Tensor a = Bf16(Randn({kOut, kRows}, 8)), b = Bf16(Randn({kRows, kIn}, 9));
  const at::Tensor out = kernels::WideProduct({a, b});
  EXPECT_EQ(out.scalar_type(), at::kFloat);
  const at::Tensor a64 = Double(a), b64 = Double(b);
  EXPECT_EQ(OutsideBound(out, at::mm(a64, b64), at::mm(a64.abs(), b64.abs()), kRows), 0);
  EXPECT_GT(OutsideBound(at::mm(a, b), at::mm(a64, b64), at::mm(a64.abs(), b64.abs()), kRows), 0)
      << "a bf16 product stayed within fp32's bound";
}

// A product whose rows depend on the row count, as cuBLAS's is (the broken control): with more
// than 64 rows it sums the two halves of K separately, each rounded to bf16, as a split-K kernel
// that rounds its partial sums would.
at::Tensor SplitKByRows(const at::Tensor& a, const at::Tensor& b) {
  const int64_t K = a.size(1), half = K / 2;
  if (a.size(0) <= 64 || half == 0) return at::mm(a, b);
  return at::mm(a.narrow(1, 0, half), b.narrow(0, 0, half)) +
         at::mm(a.narrow(1, half, K - half), b.narrow(0, half, K - half));
}

// Each row of dx is the same whether its row runs alone or among others, at every row count: the
// property that makes a packed micro-batch's per-token gradients those of each datum alone. In
// bf16, and in float32 where Gemv runs (on a CPU with AVX2 or AVX-512), whose input gradients are
// Gemv's (OpenBLAS's AVX2 kernels move rows at most of these counts).
TEST(MixedGrad, RowProductRowsAreTheirOwn) {
  std::vector<at::ScalarType> dtypes = {at::kBFloat16};
  if (KernelDevice().is_cpu() && kernels::GemvRunsHere()) dtypes.push_back(at::kFloat);
  for (at::ScalarType dt : dtypes) {
    const auto as = [&](const at::Tensor& t) { return t.to(dt).to(KernelDevice()); };
    // The LoRA shapes (rank 4) and a layer's, the weight frozen in the compute dtype as a LoRA
    // model's base; on a GPU a wide one too. Row counts across CUDA's tiles of 1024 and Gemv's of
    // 64, at an offset of 5 rows.
    std::vector<std::pair<int64_t, int64_t>> shapes = {{kOut, kIn}, {32, 4}, {4, 32}};
    if (!KernelDevice().is_cpu()) shapes.push_back({1024, 1024});
    std::vector<int64_t> counts = {100, 127,  128,  129,  255,  256,  300, 500,
                                   777, 1023, 1024, 1025, 2048, 2049, 2500};
    for (int64_t n = 1; n <= 64; ++n) counts.push_back(n);
    for (auto [O, I] : shapes) {
      const std::string what = absl::StrCat(c10::toString(dt), " ", O, "x", I);
      const at::Tensor dy = as(Randn({2600, O}, 12)), w = as(Randn({O, I}, 13));
      const at::Tensor all = kernels::RowProduct({dy, w}), broken = SplitKByRows(dy, w);
      const at::Tensor plain = at::mm(dy, w);
      int64_t moved = 0, moved_broken = 0, moved_plain = 0;
      for (int64_t n : counts) {
        moved += !kernels::RowProduct({dy.narrow(0, 5, n), w}).equal(all.narrow(0, 5, n));
        moved_broken += !SplitKByRows(dy.narrow(0, 5, n), w).equal(broken.narrow(0, 5, n));
        moved_plain += !at::mm(dy.narrow(0, 5, n), w).equal(plain.narrow(0, 5, n));
      }
      EXPECT_EQ(moved, 0) << what;
      EXPECT_GT(moved_broken, 0) << "the broken control's rows did not move: " << what;
      // What LibTorch's own product does here (LibTorch 1.13's bf16 CPU product moved rows at
      // small counts on a Cooperlake Xeon, cuBLAS's a 32→4 product's on an H100, OpenBLAS's AVX2
      // float32 product most rows on an EPYC): reported, as it depends on the library and the
      // processor.
      std::cout << "[ " << KernelDevice() << " ] at::mm " << what << ": rows moved at "
                << moved_plain << " of " << counts.size() << " row counts\n";
    }
    // Through MixedLinear with a frozen weight: dx of 3 rows alone is dx of those rows among 300.
    const at::Tensor x = as(Randn({kRows, kIn}, 14)), dy = as(Randn({kRows, kOut}, 15));
    const at::Tensor w = as(Randn({kOut, kIn}, 16));
    const at::Tensor x_all = x.detach().requires_grad_(true), x_few = x.narrow(0, 0, 3).detach();
    x_few.requires_grad_(true);
    kernels::MixedLinear({x_all, w, {}}).backward(dy);
    kernels::MixedLinear({x_few, w, {}}).backward(dy.narrow(0, 0, 3));
    EXPECT_TRUE(x_few.grad().equal(x_all.grad().narrow(0, 0, 3))) << c10::toString(dt);
  }
}

TEST(MixedGrad, InUseWhereABf16GradientIsRecorded) {
  const at::Tensor x = Bf16(Randn({2, kIn}, 10));
  EXPECT_TRUE(kernels::MixedInUse(x, Master(Randn({kOut, kIn}, 11))));
  EXPECT_TRUE(kernels::MixedInUse(x.detach().requires_grad_(true), Bf16(Randn({kOut, kIn}, 11))));
  EXPECT_FALSE(kernels::MixedInUse(x, Master(Randn({kOut, kIn}, 11)).detach()));
  const at::Tensor x32 = Randn({2, kIn}, 10).to(at::kFloat).to(KernelDevice());
  EXPECT_FALSE(kernels::MixedInUse(x32, Master(Randn({kOut, kIn}, 11))));
  at::NoGradGuard no_grad;
  EXPECT_FALSE(kernels::MixedInUse(x, Master(Randn({kOut, kIn}, 11))));
}

}  // namespace
}  // namespace tinkerd::testing
