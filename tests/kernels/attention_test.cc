// kernels/attention against a float64 reference that forms every [Lq, Lk] score matrix in full,
// its gradients against autograd through that reference and against finite differences, the
// KV-cache decode case, and on a GPU the device path against the same reference.
#include "kernels/attention.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "tests/kernels/kernel_test_util.h"

namespace tinkerd::testing {
namespace {

using kernels::AttentionParams;

// Float64 attention with the whole score matrix per sequence and head; `shift` moves the causal
// boundary (0 is correct; the broken control uses 1).
at::Tensor Reference(const at::Tensor& q_THd, const at::Tensor& k_UKd, const at::Tensor& v_UKd,
                     const std::vector<int64_t>& cu_q, const std::vector<int64_t>& cu_k,
                     int64_t window, int64_t shift = 0) {
  const int64_t H = q_THd.size(1), K = k_UKd.size(1), G = H / K, d = q_THd.size(2);
  std::vector<at::Tensor> rows;
  for (size_t s = 0; s + 1 < cu_q.size(); ++s) {
    const int64_t Lq = cu_q[s + 1] - cu_q[s], Lk = cu_k[s + 1] - cu_k[s];
    if (Lq == 0) continue;
    std::vector<at::Tensor> heads;
    for (int64_t h = 0; h < H; ++h) {
      const at::Tensor q = q_THd.narrow(0, cu_q[s], Lq).select(1, h);
      const at::Tensor k = k_UKd.narrow(0, cu_k[s], Lk).select(1, h / G);
      const at::Tensor v = v_UKd.narrow(0, cu_k[s], Lk).select(1, h / G);
      at::Tensor S = at::mm(q, k.t()) / std::sqrt(static_cast<double>(d));
      const at::Tensor pos = at::arange(Lk - Lq, Lk, at::kLong).unsqueeze(1);
      const at::Tensor j = at::arange(Lk, at::kLong).unsqueeze(0);
      at::Tensor hidden = j > pos + shift;
      if (window > 0) hidden = hidden.logical_or(pos - j >= window);
      S = S.masked_fill(hidden, -std::numeric_limits<double>::infinity());
      heads.push_back(at::mm(at::softmax(S, 1), v).unsqueeze(1));
    }
    rows.push_back(at::cat(heads, 1));
  }
  return at::cat(rows, 0);
}

std::vector<int64_t> Cumulative(const std::vector<int64_t>& lengths) {
  std::vector<int64_t> cu{0};
  for (int64_t L : lengths) cu.push_back(cu.back() + L);
  return cu;
}

struct Case {
  at::Tensor q, k, v;
  std::vector<int64_t> cu_q, cu_k;
};

Case MakeCase(const std::vector<int64_t>& lq, const std::vector<int64_t>& lk, int64_t H, int64_t K,
              int64_t d, uint64_t seed) {
  Case c;
  c.cu_q = Cumulative(lq);
  c.cu_k = Cumulative(lk);
  c.q = Randn({c.cu_q.back(), H, d}, seed);
  c.k = Randn({c.cu_k.back(), K, d}, seed + 1);
  c.v = Randn({c.cu_k.back(), K, d}, seed + 2);
  return c;
}

AttentionParams Params(const Case& c, int64_t window, at::ScalarType dt = at::kDouble,
                       at::Device dev = at::kCPU) {
  AttentionParams p;
  // Copies: tests perturb and mark these for grad without touching the case.
  p.q_THd = c.q.to(dev, dt, /*non_blocking=*/false, /*copy=*/true);
  p.k_UKd = c.k.to(dev, dt, /*non_blocking=*/false, /*copy=*/true);
  p.v_UKd = c.v.to(dev, dt, /*non_blocking=*/false, /*copy=*/true);
  p.cu_seqlens_q = c.cu_q;
  p.cu_seqlens_k = c.cu_k;
  p.window = window;
  // Small tiles so that every sequence spans several, ragged at both ends.
  p.block_q = 16;
  p.block_k = 8;
  return p;
}

// Float64: the online softmax sums at most Lk = 100 terms, each rescaled a few times, so the
// output's relative error is a small multiple of Lk · 2^-53 ≈ 1e-14; 1e-12 leaves margin.
constexpr double kF64Tol = 1e-12;

TEST(Attention, ForwardMatchesFullSoftmaxFloat64) {
  const std::vector<int64_t> lengths{1, 5, 37, 64, 100};
  for (int64_t window : {0, 7}) {
    const Case c = MakeCase(lengths, lengths, 4, 2, 8, 11);
    const at::Tensor out = kernels::Attention(Params(c, window));
    const at::Tensor ref = Reference(c.q, c.k, c.v, c.cu_q, c.cu_k, window);
    EXPECT_LT(RelErr(out, ref), kF64Tol) << "window " << window;
  }
}

TEST(Attention, BrokenControlsAreDetected) {
  // The same comparison must fail against a reference whose mask is off by one, in the causal
  // boundary or in the window: the tolerance is tight enough to see a masking bug.
  const std::vector<int64_t> lengths{37, 64};
  const Case c = MakeCase(lengths, lengths, 4, 2, 8, 12);
  const at::Tensor out = kernels::Attention(Params(c, 7));
  EXPECT_GT(RelErr(out, Reference(c.q, c.k, c.v, c.cu_q, c.cu_k, 8)), 1e3 * kF64Tol);
  EXPECT_GT(RelErr(out, Reference(c.q, c.k, c.v, c.cu_q, c.cu_k, 7, /*shift=*/1)), 1e3 * kF64Tol);
}

TEST(Attention, DecodeAndChunkedPrefillAgainstACache) {
  // Queries are the last Lq positions of each sequence: Lq = 1 is a decode step, 1 < Lq < Lk a
  // prompt continued against a cache; an empty query range is allowed.
  const Case c = MakeCase({1, 1, 3, 0, 17}, {1, 40, 29, 5, 50}, 6, 3, 8, 13);
  for (int64_t window : {0, 9}) {
    const at::Tensor out = kernels::Attention(Params(c, window));
    EXPECT_LT(RelErr(out, Reference(c.q, c.k, c.v, c.cu_q, c.cu_k, window)), kF64Tol);
  }
}

TEST(Attention, GradientsMatchAutogradOfTheReference) {
  const std::vector<int64_t> lengths{3, 33, 70};
  for (int64_t window : {0, 10}) {
    const Case c = MakeCase(lengths, lengths, 4, 1, 8, 14);
    const at::Tensor R = Randn({lengths[0] + lengths[1] + lengths[2], 4, 8}, 15);
    AttentionParams p = Params(c, window);
    p.q_THd.requires_grad_(true);
    p.k_UKd.requires_grad_(true);
    p.v_UKd.requires_grad_(true);
    (kernels::Attention(p) * R).sum().backward();
    const at::Tensor q = c.q.clone().requires_grad_(true), k = c.k.clone().requires_grad_(true),
                     v = c.v.clone().requires_grad_(true);
    (Reference(q, k, v, c.cu_q, c.cu_k, window) * R).sum().backward();
    // Same derivation as kF64Tol; the backward sums over both queries and keys.
    EXPECT_LT(RelErr(p.q_THd.grad(), q.grad()), kF64Tol) << "dq, window " << window;
    EXPECT_LT(RelErr(p.k_UKd.grad(), k.grad()), kF64Tol) << "dk, window " << window;
    EXPECT_LT(RelErr(p.v_UKd.grad(), v.grad()), kF64Tol) << "dv, window " << window;
  }
}

TEST(Attention, GradientsMatchFiniteDifferences) {
  const std::vector<int64_t> lengths{9, 20};
  const Case c = MakeCase(lengths, lengths, 2, 1, 4, 16);
  const at::Tensor R = Randn({29, 2, 4}, 17);
  AttentionParams p = Params(c, 6);
  for (at::Tensor* t : {&p.q_THd, &p.k_UKd, &p.v_UKd}) t->requires_grad_(true);
  (kernels::Attention(p) * R).sum().backward();
  auto loss = [&](const AttentionParams& pp) {
    return (kernels::Attention(pp) * R).sum().item<double>();
  };
  // Central differences: truncation h²·|f'''| ~ 1e-12, rounding 2^-53·|f|/h ~ 1e-10 for
  // |f| ~ 10, h = 1e-6; 1e-7 bounds both with margin.
  const double h = 1e-6;
  for (int which = 0; which < 3; ++which) {
    for (int64_t flat : {0, 17, 40, 77, 115}) {
      AttentionParams plus = Params(c, 6), minus = Params(c, 6);
      at::Tensor* tp = which == 0 ? &plus.q_THd : which == 1 ? &plus.k_UKd : &plus.v_UKd;
      at::Tensor* tm = which == 0 ? &minus.q_THd : which == 1 ? &minus.k_UKd : &minus.v_UKd;
      const int64_t i = flat % tp->numel();
      tp->view(-1)[i] += h;
      tm->view(-1)[i] -= h;
      const double fd = (loss(plus) - loss(minus)) / (2 * h);
      const at::Tensor& grad = which == 0   ? p.q_THd.grad()
                               : which == 1 ? p.k_UKd.grad()
                                            : p.v_UKd.grad();
      EXPECT_NEAR(grad.view(-1)[i].item<double>(), fd, 1e-7) << "input " << which << " at " << i;
    }
  }
}

TEST(Attention, DevicePathMatchesTheReference) {
  // On the CPU this runs the tiled path in float32 and bfloat16 (fp32 tiles); on a GPU, float32
  // takes the tiled path and bfloat16 LibTorch's flash kernel. Every comparison is against the
  // float64 reference on the same (rounded) inputs.
  const at::Device dev = KernelDevice();
  const std::vector<int64_t> lengths{1, 31, 128, 200};
  const Case base = MakeCase(lengths, lengths, 8, 2, 64, 18);
  const at::Tensor R = Randn({base.cu_q.back(), 8, 64}, 19);
  for (at::ScalarType dt : {at::kFloat, at::kBFloat16}) {
    // Round the inputs to the tested dtype first, so that the reference sees the same values.
    Case c = base;
    for (at::Tensor* t : {&c.q, &c.k, &c.v}) *t = t->to(dt).to(at::kDouble);
    for (int64_t window : {0, 50}) {
      AttentionParams p = Params(c, window, dt, dev);
      for (at::Tensor* t : {&p.q_THd, &p.k_UKd, &p.v_UKd}) t->requires_grad_(true);
      const at::Tensor out = kernels::Attention(p);
      (out.to(at::kDouble) * R.to(dev)).sum().backward();
      const at::Tensor q = c.q.clone().requires_grad_(true), k = c.k.clone().requires_grad_(true),
                       v = c.v.clone().requires_grad_(true);
      const at::Tensor ref = Reference(q, k, v, c.cu_q, c.cu_k, window);
      (ref * R).sum().backward();
      // float32: d = 64 products and up to 200 softmax terms, ~2^-24 each: ~1e-5 relative.
      // bfloat16: the output is rounded to 2^-9 relative, and the flash kernel also rounds P to
      // bf16 before P·V (2^-9 per weight); 2e-2 covers both on the gradients too, which add
      // the rounding of dO and dS.
      const double tol = dt == at::kFloat ? 2e-5 : 2e-2;
      EXPECT_LT(RelErr(out, ref), tol) << at::toString(dt) << " window " << window
                                       << (kernels::UsesFlashAttention(p) ? " (flash)" : "");
      EXPECT_LT(RelErr(p.q_THd.grad(), q.grad()), tol) << "dq " << at::toString(dt);
      EXPECT_LT(RelErr(p.k_UKd.grad(), k.grad()), tol) << "dk " << at::toString(dt);
      EXPECT_LT(RelErr(p.v_UKd.grad(), v.grad()), tol) << "dv " << at::toString(dt);
    }
  }
}

}  // namespace
}  // namespace tinkerd::testing
