// kernels/routed_experts.h against a float64 reference written with loops (one token, one
// expert, one element at a time), and its gradients against autograd through the dense form
// Σ_e mask_e·w_e·expert_e(x), every expert over every token: the formula the kernel's grouping
// must equal without ever computing it.
//
// Shape suffixes: T tokens, D hidden, E experts, I an expert's intermediate size, k choices.
#include "kernels/routed_experts.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "kernels/gemv.h"
#include "kernels/linear.h"
#include "tests/kernels/kernel_test_util.h"

namespace tinkerd::testing {
namespace {

constexpr int64_t T = 37, D = 24, E = 6, I = 16, K = 2;

struct Experts {
  at::Tensor router_ED, gate_EID, up_EID, down_EDI;  // float64 on the CPU

  Experts To(at::ScalarType dt, at::Device device) const {
    auto c = [&](const at::Tensor& t) { return t.to(device, dt); };
    return {c(router_ED), c(gate_EID), c(up_EID), c(down_EDI)};
  }
};

Experts Random(uint64_t seed) {
  return {Randn({E, D}, seed, 0.5), Randn({E, I, D}, seed + 1, 0.3),
          Randn({E, I, D}, seed + 2, 0.3), Randn({E, D, I}, seed + 3, 0.3)};
}

double Silu(double v) {
  return v / (1 + std::exp(-v));
}

// The reference: per token, the softmax by hand, the k largest (ties broken by the lower index,
// as topk does on distinct values), then each chosen expert's SwiGLU by loops.
at::Tensor Reference(const at::Tensor& x64_TD, const Experts& w, bool normalize,
                     std::vector<std::vector<int64_t>>* picks) {
  const auto x = x64_TD.accessor<double, 2>();
  const auto r = w.router_ED.accessor<double, 2>();
  const auto g = w.gate_EID.accessor<double, 3>(), u = w.up_EID.accessor<double, 3>();
  const auto dn = w.down_EDI.accessor<double, 3>();
  at::Tensor y_TD = at::zeros({T, D}, at::kDouble);
  auto y = y_TD.accessor<double, 2>();
  picks->assign(T, {});
  for (int64_t t = 0; t < T; ++t) {
    std::vector<double> p(E);
    double top = -INFINITY;
    for (int64_t e = 0; e < E; ++e) {
      double z = 0;
      for (int64_t d = 0; d < D; ++d) z += r[e][d] * x[t][d];
      p[e] = z;
      top = std::max(top, z);
    }
    double sum = 0;
    for (double& v : p) sum += (v = std::exp(v - top));
    for (double& v : p) v /= sum;
    std::vector<int64_t> order(E);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return p[a] > p[b]; });
    order.resize(K);
    (*picks)[t] = order;
    std::sort((*picks)[t].begin(), (*picks)[t].end());  // the kernel returns them by expert
    double kept = 0;
    for (int64_t e : order) kept += p[e];
    for (int64_t e : order) {
      const double weight = normalize ? p[e] / kept : p[e];
      std::vector<double> act(I);
      for (int64_t i = 0; i < I; ++i) {
        double a = 0, b = 0;
        for (int64_t d = 0; d < D; ++d) {
          a += g[e][i][d] * x[t][d];
          b += u[e][i][d] * x[t][d];
        }
        act[i] = Silu(a) * b;
      }
      for (int64_t d = 0; d < D; ++d) {
        double o = 0;
        for (int64_t i = 0; i < I; ++i) o += dn[e][d][i] * act[i];
        y[t][d] += weight * o;
      }
    }
  }
  return y_TD;
}

// x·wᵀ by kernels::Linear.
at::Tensor Product(const at::Tensor& x_NI, const at::Tensor& w_OI) {
  kernels::LinearParams p;
  p.x_NI = x_NI;
  p.w_OI = w_OI;
  return kernels::Linear(p);
}

// The kernel with experts made of ATen products (or kernels::Linear, for the row-invariance
// test), every input possibly requiring grad.
at::Tensor Kernel(const at::Tensor& x_TD, const Experts& w, bool normalize, bool linear_kernel,
                  kernels::Routing* routing_out = nullptr, const at::Tensor& replay = {}) {
  kernels::RouteParams rp;
  // With the linear kernel the router's product too is the model's (transformer.cc routes through
  // kernels::Linear): at::matmul of one row takes BLAS's gemv, which may round otherwise than the
  // gemm of a batch, so the bitwise test below would see the router, not the experts, differ.
  rp.logits_TE = linear_kernel ? Product(x_TD, w.router_ED) : at::matmul(x_TD, w.router_ED.t());
  rp.top_k = K;
  rp.normalize = normalize;
  rp.experts_Tk = replay;
  const kernels::Routing routing = kernels::Route(rp);
  if (routing_out != nullptr) *routing_out = routing;
  return kernels::RoutedExperts(
      {x_TD, &routing,
       [&](int64_t e, const at::Tensor& x_ND) {
         if (linear_kernel) {
           const at::Tensor gate = Product(x_ND, w.gate_EID[e]), up = Product(x_ND, w.up_EID[e]);
           return Product(kernels::SwiGLU(gate, up), w.down_EDI[e]);
         }
         const at::Tensor act =
             at::silu(at::matmul(x_ND, w.gate_EID[e].t())) * at::matmul(x_ND, w.up_EID[e].t());
         return at::matmul(act, w.down_EDI[e].t());
       },
       /*slots=*/nullptr});
}

// Σ_e mask_e·w_e·expert_e(x): every expert over every token, masked by the choices experts_Tk
// (renormalized weights), differentiable in everything.
at::Tensor Dense(const at::Tensor& x, const Experts& w, const at::Tensor& experts_Tk) {
  const at::Tensor p = at::softmax(at::matmul(x, w.router_ED.t()), -1);
  const at::Tensor kept = p * at::zeros({T, E}, at::kDouble).scatter_(1, experts_Tk, 1.0);
  const at::Tensor weight_TE = kept / kept.sum(-1, true);
  at::Tensor out = at::zeros({T, D}, at::kDouble);
  for (int64_t e = 0; e < E; ++e) {
    const at::Tensor act =
        at::silu(at::matmul(x, w.gate_EID[e].t())) * at::matmul(x, w.up_EID[e].t());
    out = out + weight_TE.select(1, e).unsqueeze(1) * at::matmul(act, w.down_EDI[e].t());
  }
  return out;
}

TEST(RoutedExperts, Float64EqualsTheLoopReference) {
  const at::Tensor x = Randn({T, D}, 5);
  const Experts w = Random(10);
  for (bool normalize : {true, false}) {
    std::vector<std::vector<int64_t>> picks;
    const at::Tensor want = Reference(x, w, normalize, &picks);
    kernels::Routing routing;
    const at::Tensor got = Kernel(x, w, normalize, false, &routing);
    // Float64 against float64: a few ulp of sums of ~D + I terms of order 1 (≤ 1e-13 relative);
    // 1e-12 leaves a margin and is ~1e9 below a wrong route or weight.
    EXPECT_LE(RelErr(got, want), 1e-12) << "normalize " << normalize;
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t j = 0; j < K; ++j) {
        EXPECT_EQ(routing.experts_Tk[t][j].item<int64_t>(), picks[t][j]) << t << "," << j;
      }
    }
    int64_t slots = 0;
    for (int64_t n : routing.rows_E) slots += n;
    EXPECT_EQ(slots, T * K);
  }
}

TEST(RoutedExperts, DeviceFloat32EqualsTheReference) {
  const at::Tensor x = Randn({T, D}, 6);
  const Experts w = Random(20);
  std::vector<std::vector<int64_t>> picks;
  const at::Tensor want = Reference(x, w, true, &picks);
  const at::Device dev = KernelDevice();
  kernels::Routing routing;
  const at::Tensor got =
      Kernel(x.to(dev, at::kFloat), w.To(at::kFloat, dev), true, true, &routing).cpu();
  // Each output sums k experts' products over D and I terms, after a D-term router product and a
  // softmax: rounding error at most ~(D + I + 8)·2^-24 ≈ 3e-6 relative to the largest output;
  // 2e-5 is that with a margin for the softmax's exp, and far below a swapped expert (O(1)).
  EXPECT_LE(RelErr(got, want), 2e-5);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t j = 0; j < K; ++j) {
      EXPECT_EQ(routing.experts_Tk[t][j].item<int64_t>(), picks[t][j]) << t << "," << j;
    }
  }
}

TEST(RoutedExperts, GradientsEqualTheDenseForm) {
  const at::Tensor x0 = Randn({T, D}, 7);
  const Experts w0 = Random(30);
  auto leaves = [&] {
    Experts w{w0.router_ED.clone().requires_grad_(), w0.gate_EID.clone().requires_grad_(),
              w0.up_EID.clone().requires_grad_(), w0.down_EDI.clone().requires_grad_()};
    return std::make_pair(x0.clone().requires_grad_(), w);
  };
  const at::Tensor dy = Randn({T, D}, 8);

  auto [x, w] = leaves();
  kernels::Routing routing;
  (Kernel(x, w, true, false, &routing) * dy).sum().backward();

  auto [xd, wd] = leaves();
  const at::Tensor dense = Dense(xd, wd, routing.experts_Tk);
  (dense * dy).sum().backward();

  // Same reasoning as the forward's 1e-12: sums of a few hundred float64 terms, reassociated.
  EXPECT_LE(RelErr(x.grad(), xd.grad()), 1e-12);
  EXPECT_LE(RelErr(w.router_ED.grad(), wd.router_ED.grad()), 1e-12);
  EXPECT_LE(RelErr(w.gate_EID.grad(), wd.gate_EID.grad()), 1e-12);
  EXPECT_LE(RelErr(w.up_EID.grad(), wd.up_EID.grad()), 1e-12);
  EXPECT_LE(RelErr(w.down_EDI.grad(), wd.down_EDI.grad()), 1e-12);
  EXPECT_GT(w.router_ED.grad().abs().max().item<double>(), 1e-3)
      << "the router must learn through the weights";
}

// Broken control: a dispatch that sends one slot's token to the wrong expert's rows (the token of
// two slots swapped) is seen by the reference comparison.
TEST(RoutedExperts, AMisroutedTokenIsSeen) {
  const at::Tensor x = Randn({T, D}, 9);
  const Experts w = Random(40);
  std::vector<std::vector<int64_t>> picks;
  const at::Tensor want = Reference(x, w, true, &picks);
  kernels::Routing routing;
  Kernel(x, w, true, false, &routing);
  kernels::Routing broken = routing;
  broken.order_S = routing.order_S.clone();
  const int64_t last = T * K - 1;
  broken.order_S[0] = routing.order_S[last].item<int64_t>();
  broken.order_S[last] = routing.order_S[0].item<int64_t>();
  ASSERT_NE(routing.order_S[0].item<int64_t>() / K, routing.order_S[last].item<int64_t>() / K);
  const at::Tensor got = kernels::RoutedExperts({x, &broken,
                                                 [&](int64_t e, const at::Tensor& xe) {
                                                   const at::Tensor act =
                                                       at::silu(at::matmul(xe, w.gate_EID[e].t())) *
                                                       at::matmul(xe, w.up_EID[e].t());
                                                   return at::matmul(act, w.down_EDI[e].t());
                                                 },
                                                 /*slots=*/nullptr});
  EXPECT_GT(RelErr(got, want), 1e-3);
}

// Router replay: the computed choices sent back give the same bits; other choices give the
// reference's output for those choices (p at them, renormalized), not the recomputed route's.
TEST(RoutedExperts, ReplayedRoutesAreUsed) {
  const at::Tensor x = Randn({T, D}, 11);
  const Experts w = Random(50);
  kernels::Routing routing;
  const at::Tensor computed = Kernel(x, w, true, false, &routing);
  EXPECT_TRUE(at::equal(Kernel(x, w, true, false, nullptr, routing.experts_Tk), computed));
  const at::Tensor other = (routing.experts_Tk + 1).remainder(E);
  kernels::Routing replayed;
  const at::Tensor got = Kernel(x, w, true, false, &replayed, other);
  EXPECT_TRUE(at::equal(replayed.experts_Tk, std::get<0>(other.sort(1))));
  // A row holding a -1 routes itself, whatever else it holds.
  at::Tensor partly = other.clone();
  partly.select(1, 1).fill_(-1);
  EXPECT_TRUE(at::equal(Kernel(x, w, true, false, nullptr, partly), computed));
  // The same routes in another order within a token: the same bits.
  EXPECT_TRUE(at::equal(Kernel(x, w, true, false, nullptr, routing.experts_Tk.flip(1)), computed));
  EXPECT_GT(RelErr(got, computed), 1e-3);
  // The replayed output by the dense form with those choices.
  const at::Tensor want = Dense(x, w, other);
  EXPECT_LE(RelErr(got, want), 1e-12);
}

// With row-invariant products (Gemv, on the CPU in float32), a token's output is the same bits
// whatever else is in the batch: the first tokens alone equal their rows of the whole batch.
TEST(RoutedExperts, ATokensOutputDoesNotDependOnTheBatch) {
  if (KernelDevice() != at::Device("cpu")) GTEST_SKIP() << "the bitwise promise is the CPU's";
  if (!kernels::GemvRunsHere())
    GTEST_SKIP() << "row-invariant products need Gemv (AVX2 or AVX-512)";
  const at::Tensor x = Randn({T, D}, 12).to(at::kFloat);
  const Experts w = Random(60).To(at::kFloat, at::kCPU);
  const at::Tensor all = Kernel(x, w, true, true);
  for (int64_t n : {1, 5, 20}) {
    EXPECT_TRUE(
        at::equal(Kernel(x.narrow(0, 0, n).contiguous(), w, true, true), all.narrow(0, 0, n)))
        << n << " tokens";
  }
}

}  // namespace
}  // namespace tinkerd::testing
