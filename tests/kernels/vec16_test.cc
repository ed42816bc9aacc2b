// kernels/vec16.h's Exps: the float one (the softmax exponentials of the CPU attention kernels)
// against libm's exp in float64, over every 97th float from −87.33 to 88 and at its edges; the
// double one (the sampler's log-sum-exp) against long double. And the sampler's LogSumExp
// (runner/sample/choose.h), which sums them, against a long double loop.
#include "kernels/vec16.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "kernels/cpu_clones.h"
#include "runner/sample/choose.h"
#include "tests/kernels/kernel_test_util.h"

namespace tinkerd::testing {
namespace {

using kernels::V16;

// The kernels' own build of Exp: the clone this CPU runs (FMA where it has it).
TINKERD_CPU_CLONES void ExpAllDouble(const double* x, double* y, int64_t n) {
  for (int64_t i = 0; i + 8 <= n; i += 8) {
    kernels::V8d v;
    std::memcpy(&v, x + i, sizeof(v));
    kernels::Exp(v);
    std::memcpy(y + i, &v, sizeof(v));
  }
}

TINKERD_CPU_CLONES void ExpAll(const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i + 16 <= n; i += 16) {
    V16 v;
    std::memcpy(&v, x + i, sizeof(v));
    kernels::Exp(v);
    std::memcpy(y + i, &v, sizeof(v));
  }
}

std::vector<float> Exps(const std::vector<float>& x) {
  std::vector<float> y(x.size());
  ExpAll(x.data(), y.data(), static_cast<int64_t>(x.size()));
  return y;
}

// The distance from y to e^x in units of the float spacing at e^x (ulps).
double Ulps(float y, float x) {
  const double e = std::exp(static_cast<double>(x));
  const double ulp = std::ldexp(1.0, std::ilogb(e) - 23);
  return std::abs(static_cast<double>(y) - e) / ulp;
}

TEST(Exp, IsWithinTwoUlpsOfLibmOverItsRange) {
  // Every 97th float of [−87.33, 88]: about 23 million of the range's two billion, every binade.
  std::vector<float> x;
  auto sweep = [&x](float from, float to, float sign) {  // magnitudes from..to, every 97th float
    uint32_t a, b;
    std::memcpy(&a, &from, sizeof(a));
    std::memcpy(&b, &to, sizeof(b));
    for (uint32_t bits = a; bits <= b; bits += 97) {
      float v;
      std::memcpy(&v, &bits, sizeof(v));
      x.push_back(sign * v);
    }
  };
  sweep(std::numeric_limits<float>::denorm_min(), 87.33f, -1.0f);
  sweep(std::numeric_limits<float>::denorm_min(), 88.0f, 1.0f);
  x.resize(x.size() / 16 * 16);
  const std::vector<float> y = Exps(x);
  double worst = 0;
  float at = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const double u = Ulps(y[i], x[i]);
    if (u > worst) worst = u, at = x[i];
  }
  // The Taylor remainder is 0.1 ulp; the reduction's rounding of r (|r| <= 0.35, its ulp 2^-25)
  // moves e^r by < 0.25 ulp; Horner's eight roundings, each of a value below e^0.35 = 1.42 and
  // weighted by the derivative of the rest, add < 1.5 ulp. Two ulps bound the sum (measured: 0.90).
  EXPECT_LE(worst, 2.0) << "at x = " << at;
  // Control: the same measure sees e^1.5 · (1 + 2^-21), 4.5 ulps off.
  EXPECT_GT(Ulps(static_cast<float>(std::exp(1.5) * (1 + std::ldexp(1.0, -21))), 1.5f), 2.0);
}

TEST(Exp, EdgesAreExact) {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> x = {0.0f,  -0.0f, -87.34f, -100.0f, -1e30f, -inf,   nan,    1.0f,
                          -1.0f, 0.5f,  -87.33f, 88.0f,   -2.0f,  -10.0f, -50.0f, -80.0f};
  const std::vector<float> y = Exps(x);
  EXPECT_EQ(y[0], 1.0f);  // a softmax's largest score weighs exactly 1
  EXPECT_EQ(y[1], 1.0f);
  for (int i : {2, 3, 4, 5}) EXPECT_EQ(y[i], 0.0f) << x[i];  // below the smallest normal float
  EXPECT_TRUE(std::isnan(y[6]));
  EXPECT_GT(y[10], 0.0f);
  EXPECT_TRUE(std::isfinite(y[11]));
  for (int i : {7, 8, 9, 10, 11, 12, 13, 14, 15}) EXPECT_LE(Ulps(y[i], x[i]), 2.0) << x[i];
}

// The distance from y to e^x in units of the double spacing at e^x, e^x in long double (64
// significant bits on x86-64).
double UlpsDouble(double y, double x) {
  const long double e = std::exp(static_cast<long double>(x));
  const long double ulp = std::ldexp(1.0L, std::ilogb(static_cast<double>(e)) - 52);
  return static_cast<double>(std::fabs(static_cast<long double>(y) - e) / ulp);
}

TEST(ExpDouble, IsWithinTwoUlpsOverItsRange) {
  // Two million evenly spaced x over [−708.39, 709], and 800,000 over [−1, 1] where e^x's binade
  // changes near 0.
  std::vector<double> x;
  for (int64_t i = 0; i < 2000000; ++i) x.push_back(-708.39 + i * (709.0 + 708.39) / 2000000);
  for (int64_t i = 0; i < 800000; ++i) x.push_back(-1.0 + i * 2.0 / 800000);
  std::vector<double> y(x.size());
  ExpAllDouble(x.data(), y.data(), static_cast<int64_t>(x.size()));
  double worst = 0, at = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const double u = UlpsDouble(y[i], x[i]);
    if (u > worst) worst = u, at = x[i];
  }
  // As the float Exp's: the remainder 0.03 ulp, r's rounding < 0.25 ulp, Horner's fourteen
  // roundings < 1.5 ulp.
  EXPECT_LE(worst, 2.0) << "at x = " << at;
  // Control: e^1.5 · (1 + 2^-50) is 4.5 ulps off.
  EXPECT_GT(UlpsDouble(std::exp(1.5) * (1 + std::ldexp(1.0, -50)), 1.5), 2.0);
  const double inf = std::numeric_limits<double>::infinity();
  std::vector<double> edges = {0.0, -708.4, -1e300, -inf, std::nan(""), 709.0, -708.39, 1.0};
  std::vector<double> e(edges.size());
  ExpAllDouble(edges.data(), e.data(), 8);
  EXPECT_EQ(e[0], 1.0);
  for (int i : {1, 2, 3}) EXPECT_EQ(e[i], 0.0) << edges[i];
  EXPECT_TRUE(std::isnan(e[4]));
  for (int i : {5, 6, 7}) EXPECT_LE(UlpsDouble(e[i], edges[i]), 2.0) << edges[i];
}

TEST(LogSumExp, MatchesALongDoubleLoopAndIsTheSameForTheSameRow) {
  // Rows of 8,192 and 8,197 logits (the second with a remainder past the eight lanes).
  for (int64_t V : {8192, 8197}) {
    at::Tensor z = Randn({V}, 40, 4.0);
    z[V - 1] = z.max();  // the control below leaves it out: its probability is >= 1/V
    const double* zp = z.data_ptr<double>();
    long double m = -INFINITY, sum = 0;
    for (int64_t v = 0; v < V; ++v) m = std::max<long double>(m, zp[v]);
    for (int64_t v = 0; v < V; ++v) sum += std::exp(static_cast<long double>(zp[v]) - m);
    const double expected = static_cast<double>(m + std::log(sum));
    // V terms within 2 ulps each, summed in V/8 + 3 roundings: (2 + V/8 + 3) · 2^-53 relative to
    // the sum, ~1.2e-13 at V = 8,197, and log moves that to an absolute error; 1e-12 with margin.
    const double lse = LogSumExp(zp, V);
    EXPECT_NEAR(lse, expected, 1e-12) << V;
    // Control: the last logit left out (what a lost remainder would do) moves the result by
    // -log(1 - p) >= p >= 1/V = 1.2e-4, far past the bound.
    EXPECT_GT(std::abs(LogSumExp(zp, V - 1) - expected), 1e-4) << V;
    EXPECT_EQ(LogSumExp(zp, V), lse);
  }
  // Rows with an infinite or NaN logit give it back, as a log-sum-exp must, whether it sits in
  // the eight lanes (3) or past them (17).
  for (int at : {3, 17}) {
    std::vector<double> row(20, 0.5);
    row[at] = std::numeric_limits<double>::infinity();
    EXPECT_EQ(LogSumExp(row.data(), 20), std::numeric_limits<double>::infinity()) << at;
    row[at] = std::nan("");
    EXPECT_TRUE(std::isnan(LogSumExp(row.data(), 20))) << at;
  }
}

}  // namespace
}  // namespace tinkerd::testing
