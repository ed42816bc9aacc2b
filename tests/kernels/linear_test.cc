// kernels/linear with adapters by row runs (a decode step mixing LoRA policies of one base)
// against a float64 loop and against the single-adapter Linear on each run, with a broken
// control (runs one row off), and refusal of runs that do not cover the rows.
//
// Shape suffixes: N rows, I in features, O out features, r rank.
#include "kernels/linear.h"

#include <ATen/core/grad_mode.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include <cmath>
#include <vector>

#include "tests/kernels/kernel_test_util.h"

namespace tinkerd::testing {
namespace {

constexpr int64_t kIn = 24, kOut = 10;

struct Case {
  at::Tensor x_NI, w_OI, b_O;
  std::vector<kernels::LoraRun> runs;
};

// Three runs: rank 2 (3 rows), unadapted (2 rows), rank 5 (4 rows).
Case MakeCase(at::ScalarType dt) {
  Case c;
  c.x_NI = Randn({9, kIn}, 41).to(dt);
  c.w_OI = Randn({kOut, kIn}, 42).to(dt);
  c.b_O = Randn({kOut}, 43).to(dt);
  c.runs.push_back({3, Randn({2, kIn}, 44).to(dt), Randn({kOut, 2}, 45).to(dt), 0.5});
  c.runs.push_back({2, {}, {}, 1.0});
  c.runs.push_back({4, Randn({5, kIn}, 46).to(dt), Randn({kOut, 5}, 47).to(dt), 2.0});
  return c;
}

// y_no = Σ_i x_ni w_oi + b_o + s Σ_j (Σ_i x_ni A_ji) B_oj, each row by the adapter of the run
// `shift` rows before it (0: its own; 1: the broken control), in double.
at::Tensor Reference(const Case& c, int64_t shift = 0) {
  const at::Tensor x = c.x_NI.to(at::kDouble), w = c.w_OI.to(at::kDouble);
  at::Tensor y = at::mm(x, w.t()) + c.b_O.to(at::kDouble);
  std::vector<const kernels::LoraRun*> run_of;
  for (const kernels::LoraRun& run : c.runs) run_of.insert(run_of.end(), run.rows, &run);
  for (int64_t n = 0; n < x.size(0); ++n) {
    const kernels::LoraRun* run = run_of[std::max<int64_t>(0, n - shift)];
    if (!run->A_rI.defined()) continue;
    const at::Tensor A = run->A_rI.to(at::kDouble), B = run->B_Or.to(at::kDouble);
    for (int64_t o = 0; o < kOut; ++o) {
      double sum = 0;
      for (int64_t j = 0; j < A.size(0); ++j) {
        double low = 0;
        for (int64_t i = 0; i < kIn; ++i) low += x[n][i].item<double>() * A[j][i].item<double>();
        sum += low * B[o][j].item<double>();
      }
      y[n][o] += run->scale * sum;
    }
  }
  return y;
}

kernels::LinearParams Params(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b) {
  kernels::LinearParams p;
  p.x_NI = x;
  p.w_OI = w;
  p.b_O = b;
  return p;
}

at::Tensor Apply(const Case& c, at::Device dev) {
  kernels::LinearParams p = Params(c.x_NI.to(dev), c.w_OI.to(dev), c.b_O.to(dev));
  for (kernels::LoraRun run : c.runs) {
    if (run.A_rI.defined()) {
      run.A_rI = run.A_rI.to(dev);
      run.B_Or = run.B_Or.to(dev);
    }
    p.runs.push_back(run);
  }
  return kernels::Linear(p);
}

TEST(LinearRuns, EachRunHasItsOwnAdapterFloat64) {
  const Case c = MakeCase(at::kDouble);
  const at::Tensor y = Apply(c, KernelDevice());
  // Sums of at most 24 products: ~24 ulps, ~5e-15 relative; 1e-12 leaves margin.
  EXPECT_LT(RelErr(y, Reference(c)), 1e-12);
  // The control: adapters one row late; rows at run boundaries then change by their low-rank
  // terms, O(1) here.
  EXPECT_GT(RelErr(y, Reference(c, /*shift=*/1)), 1e-3);
}

TEST(LinearRuns, EqualsTheSingleAdapterLinearOnEachRun) {
  const Case c = MakeCase(at::kDouble);
  const at::Tensor y = Apply(c, at::kCPU);
  int64_t row = 0;
  for (const kernels::LoraRun& run : c.runs) {
    kernels::LinearParams alone = Params(c.x_NI.narrow(0, row, run.rows), c.w_OI, c.b_O);
    alone.A_rI = run.A_rI;
    alone.B_Or = run.B_Or;
    alone.scale = run.scale;
    // The same operations on the same rows: only the row count of the products differs, which
    // BLAS may block differently; 1e-14 bounds a few ulps.
    EXPECT_LT(RelErr(y.narrow(0, row, run.rows), kernels::Linear(alone)), 1e-14) << "row " << row;
    row += run.rows;
  }
}

TEST(LinearRuns, Float32WithinItsBound) {
  const Case c = MakeCase(at::kFloat);
  const at::Tensor y = Apply(c, KernelDevice());
  // Each output is a float32 sum of I products, plus a bias, plus s times a sum of r products
  // of float32 sums of I: its error is at most γ·Σ|terms| with γ = (I + r + 2)·2^-24 (first
  // order), where Σ|terms| is the same computation on absolute values.
  Case abs = c;
  abs.x_NI = c.x_NI.abs();
  abs.w_OI = c.w_OI.abs();
  abs.b_O = c.b_O.abs();
  for (kernels::LoraRun& run : abs.runs) {
    if (!run.A_rI.defined()) continue;
    run.A_rI = run.A_rI.abs();
    run.B_Or = run.B_Or.abs();
  }
  const at::Tensor ref = Reference(c);
  const double gamma = (kIn + 5 + 2) * std::ldexp(1.0, -24);
  const double bound = gamma * Reference(abs).max().item<double>() / ref.abs().max().item<double>();
  EXPECT_LT(RelErr(y, ref), bound);
}

TEST(SwiGLU, EveryPathTakesTheLoopWhichMatchesFloat64) {
  // 70 × 45 elements: the sixteen-lane loop and its remainder.
  const at::Tensor g = Randn({70, 45}, 60, 3.0).to(at::kFloat),
                   u = Randn({70, 45}, 61).to(at::kFloat);
  at::Tensor loop, row;
  {
    const at::NoGradGuard no_grad;
    loop = kernels::SwiGLU(g, u);
    row = kernels::SwiGLU(g.narrow(0, 69, 1), u.narrow(0, 69, 1));
  }
  const at::Tensor g64 = g.to(at::kDouble), u64 = u.to(at::kDouble);
  const at::Tensor ref = g64 / (1 + at::exp(-g64)) * u64;
  // Per element: Exp within 2 ulps moves 1 + e^-g by at most that, then the sum, the division
  // and the product round once each: 5 · 2^-24 = 3e-7 relative; 5e-7 with margin.
  const double worst =
      ((loop.to(at::kDouble) - ref).abs() / ref.abs().clamp_min(1e-30)).max().item<double>();
  EXPECT_LT(worst, 5e-7);
  // Control: gate and up swapped is far off.
  EXPECT_GT(RelErr(kernels::SwiGLU(u, g), ref), 1e-2);
  // A row alone is its row of the batch, and training's forward is the loop, bitwise; ATen's
  // expression (control) is not.
  EXPECT_TRUE(at::equal(row, loop.narrow(0, 69, 1)));
  const at::Tensor gg = g.clone().requires_grad_(true), ug = u.clone().requires_grad_(true);
  const at::Tensor trained = kernels::SwiGLU(gg, ug);
  ASSERT_TRUE(trained.requires_grad());
  EXPECT_TRUE(at::equal(loop, trained.detach()));
  EXPECT_FALSE(at::equal(loop, at::silu(g) * u));
  // Its gradient by the formula against float64 autograd: dg = dy·u·σ(1 + g(1 − σ)) rounds about
  // eight times in fp32, 8 · 2^-24 = 5e-7 relative per element; 2e-6 with margin for σ's exp.
  const at::Tensor dy = Randn({70, 45}, 62).to(at::kFloat);
  const auto grads = torch::autograd::grad({trained}, {gg, ug}, {dy});
  const at::Tensor g64r = g64.clone().requires_grad_(true), u64r = u64.clone().requires_grad_(true);
  const auto want =
      torch::autograd::grad({at::silu(g64r) * u64r}, {g64r, u64r}, {dy.to(at::kDouble)});
  EXPECT_LT(RelErr(grads[0], want[0]), 2e-6);
  EXPECT_LT(RelErr(grads[1], want[1]), 2e-6);
  EXPECT_GT(RelErr(grads[0], want[1]), 1e-2);  // control: the other input's gradient
}

TEST(SwiGLU, BFloat16LoopRoundsAsATensTwoOpsAndTrainsAlike) {
  const at::Tensor g = Randn({33, 40}, 63, 3.0).to(at::kBFloat16),
                   u = Randn({33, 40}, 64).to(at::kBFloat16);
  at::Tensor loop;
  {
    const at::NoGradGuard no_grad;
    loop = kernels::SwiGLU(g, u);
  }
  ASSERT_EQ(loop.scalar_type(), at::kBFloat16);
  // Two roundings to bf16 (silu, then the product), 2^-8 each relative, against the float64
  // value of the same bf16 inputs: 2^-7.
  const at::Tensor g64 = g.to(at::kDouble), u64 = u.to(at::kDouble);
  const at::Tensor ref = g64 / (1 + at::exp(-g64)) * u64;
  const at::Tensor rel = (loop.to(at::kDouble) - ref).abs() / ref.abs().clamp_min(1e-30);
  EXPECT_LE(rel.max().item<double>(), std::ldexp(1.0, -7));
  const at::Tensor trained = kernels::SwiGLU(g.clone().requires_grad_(true), u);
  EXPECT_TRUE(at::equal(loop, trained.detach()));
  EXPECT_GT(RelErr(kernels::SwiGLU(u, g).to(at::kDouble), ref), 1e-2);  // control
}

TEST(LinearRuns, RunsMustCoverTheRows) {
  Case c = MakeCase(at::kDouble);
  c.runs.back().rows = 3;  // 8 of 9 rows
  EXPECT_THROW(Apply(c, at::kCPU), c10::Error);
  Case both = MakeCase(at::kDouble);
  kernels::LinearParams p = Params(both.x_NI, both.w_OI, both.b_O);
  p.A_rI = both.runs[0].A_rI;
  p.B_Or = both.runs[0].B_Or;
  p.runs = both.runs;
  EXPECT_THROW(kernels::Linear(p), c10::Error);
}

}  // namespace
}  // namespace tinkerd::testing
