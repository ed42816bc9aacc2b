// kernels/logprob_head against a float64 reference that forms the full [T, V] logits, with
// ragged chunks in both directions; gradients against autograd through that reference and
// against finite differences; a broken control; and on a GPU the device path.
#include "kernels/logprob_head.h"

#include <gtest/gtest.h>

#include <vector>

#include "tests/kernels/kernel_test_util.h"

namespace tinkerd::testing {
namespace {

using kernels::LogprobHeadParams;

struct Inputs {
  at::Tensor h, W, A, B, y;
  double s = 0.75;
};

Inputs MakeInputs(int64_t T, int64_t D, int64_t V, int64_t r, uint64_t seed, double h_std = 1.0) {
  Inputs in;
  in.h = Randn({T, D}, seed, h_std);
  in.W = Randn({V, D}, seed + 1);
  if (r > 0) {
    in.A = Randn({r, D}, seed + 2);
    in.B = Randn({V, r}, seed + 3);
  }
  at::Generator g = at::detail::createCPUGenerator(seed + 4);
  in.y = at::randint(V, {T}, g, at::TensorOptions().dtype(at::kLong));
  return in;
}

// logp and lse from the whole logits matrix; `vocab_limit` > 0 is the broken control that takes
// the logsumexp over the first `vocab_limit` entries only (a chunk that was never combined).
std::pair<at::Tensor, at::Tensor> Reference(const Inputs& in, const at::Tensor& h,
                                            const at::Tensor& W, const at::Tensor& A,
                                            const at::Tensor& B, int64_t vocab_limit = 0) {
  at::Tensor z = at::mm(h, W.t());
  if (A.defined()) z = z + in.s * at::mm(at::mm(h, A.t()), B.t());
  at::Tensor lse = at::logsumexp(vocab_limit > 0 ? z.narrow(1, 0, vocab_limit) : z, 1);
  return {z.gather(1, in.y.unsqueeze(1)).squeeze(1) - lse, lse};
}

LogprobHeadParams Params(const Inputs& in, at::ScalarType dt = at::kDouble,
                         at::Device dev = at::kCPU) {
  auto copy = [&](const at::Tensor& t) {
    return t.defined() ? t.to(dev, dt, false, /*copy=*/true) : t;
  };
  LogprobHeadParams p;
  p.hidden_TD = copy(in.h);
  p.weight_VD = copy(in.W);
  p.lora_A_rD = copy(in.A);
  p.lora_B_Vr = copy(in.B);
  p.lora_scale = in.s;
  p.targets_T = in.y.to(dev);
  p.chunk_tokens = 5;  // 23 tokens: 4 full chunks and a ragged one
  p.chunk_vocab = 7;   // 50 entries: 7 full chunks and a ragged one
  return p;
}

// Float64: logits sum D + r = 9 products and lse sums V = 50 exponentials, online over 8 chunks;
// relative errors are a few hundred ulps at most, ~1e-14; 1e-12 leaves margin.
constexpr double kF64Tol = 1e-12;

TEST(LogprobHead, ForwardMatchesFullLogitsFloat64) {
  for (int64_t r : {0, 3}) {
    const Inputs in = MakeInputs(23, 6, 50, r, 21);
    const auto out = kernels::TokenLogprobs(Params(in));
    const auto [logp, lse] = Reference(in, in.h, in.W, in.A, in.B);
    EXPECT_LT(RelErr(out.logp_T, logp), kF64Tol) << "rank " << r;
    EXPECT_LT(RelErr(out.lse_T, lse), kF64Tol) << "rank " << r;
  }
}

TEST(LogprobHead, LargeLogitsStayFinite) {
  // Logits in the thousands: an unshifted exp would overflow.
  const Inputs in = MakeInputs(23, 6, 50, 3, 22, /*h_std=*/300.0);
  const auto out = kernels::TokenLogprobs(Params(in));
  EXPECT_TRUE(out.logp_T.isfinite().all().item<bool>());
  EXPECT_LT(RelErr(out.logp_T, Reference(in, in.h, in.W, in.A, in.B).first), kF64Tol);
}

TEST(LogprobHead, BrokenControlIsDetected) {
  const Inputs in = MakeInputs(23, 6, 50, 3, 23);
  const auto out = kernels::TokenLogprobs(Params(in));
  const auto broken = Reference(in, in.h, in.W, in.A, in.B, /*vocab_limit=*/7);
  EXPECT_GT(RelErr(out.logp_T, broken.first), 1e3 * kF64Tol);
}

// A decode step's head over policies of one base: runs of rows with adapters of ranks 3, none
// and 5, each run's logits those of the full-logits reference with its own adapter; the control
// gives every row the first run's adapter.
TEST(LogprobHead, LogitsWithAdaptersByRunFloat64) {
  const Inputs in = MakeInputs(9, 6, 50, 0, 24);
  const std::vector<Inputs> adapters = {MakeInputs(1, 6, 50, 3, 25), MakeInputs(1, 6, 50, 0, 26),
                                        MakeInputs(1, 6, 50, 5, 27)};
  const std::vector<int64_t> rows = {2, 3, 4};
  LogprobHeadParams p = Params(in);
  for (size_t i = 0; i < rows.size(); ++i) {
    kernels::LoraRun& run = p.lora_runs.emplace_back();
    run.rows = rows[i];
    run.A_rI = adapters[i].A;
    run.B_Or = adapters[i].B;
    run.scale = adapters[i].s;
  }
  const at::Tensor z = kernels::HeadLogits(p);
  auto logits = [&](const at::Tensor& h, const Inputs& a) {
    at::Tensor ref = at::mm(h, in.W.t());
    return a.A.defined() ? ref + a.s * at::mm(at::mm(h, a.A.t()), a.B.t()) : ref;
  };
  int64_t row = 0;
  for (size_t i = 0; i < rows.size(); ++i) {
    const at::Tensor h = in.h.narrow(0, row, rows[i]);
    const at::Tensor got = z.narrow(0, row, rows[i]);
    // D + r ≤ 11 products per logit: a few ulps; kF64Tol as above.
    EXPECT_LT(RelErr(got, logits(h, adapters[i])), kF64Tol) << "run " << i;
    if (i > 0) {
      EXPECT_GT(RelErr(got, logits(h, adapters[0])), 1e-3) << "the control must differ, run " << i;
    }
    row += rows[i];
  }
  p.lora_runs.back().rows = 3;  // 8 of 9 rows
  EXPECT_THROW(kernels::HeadLogits(p), c10::Error);
}

TEST(LogprobHead, GradientsMatchAutogradOfTheReference) {
  for (int64_t r : {0, 3}) {
    for (bool train_W : {false, true}) {
      const Inputs in = MakeInputs(23, 6, 50, r, 24);
      const at::Tensor g = Randn({23}, 25);
      LogprobHeadParams p = Params(in);
      p.hidden_TD.requires_grad_(true);
      p.weight_VD.requires_grad_(train_W);
      if (r > 0) {
        p.lora_A_rD.requires_grad_(true);
        p.lora_B_Vr.requires_grad_(true);
      }
      (kernels::TokenLogprobs(p).logp_T * g).sum().backward();
      const at::Tensor h = in.h.clone().requires_grad_(true), W = in.W.clone().requires_grad_(true);
      at::Tensor A, B;
      if (r > 0) {
        A = in.A.clone().requires_grad_(true);
        B = in.B.clone().requires_grad_(true);
      }
      (Reference(in, h, W, A, B).first * g).sum().backward();
      EXPECT_LT(RelErr(p.hidden_TD.grad(), h.grad()), kF64Tol);
      if (train_W) {
        EXPECT_LT(RelErr(p.weight_VD.grad(), W.grad()), kF64Tol);
      } else {
        EXPECT_FALSE(p.weight_VD.grad().defined());
      }
      if (r > 0) {
        EXPECT_LT(RelErr(p.lora_A_rD.grad(), A.grad()), kF64Tol);
        EXPECT_LT(RelErr(p.lora_B_Vr.grad(), B.grad()), kF64Tol);
      }
    }
  }
}

// Top-K targets [T, K], a repeated target within a row among them: logp_TK and the gradient of
// Σ g_tk·logp_tk against the full-logits reference; the control drops every column but the first
// from the backward (dz = g_t1 (1[v = y_t1] − P_tv)), which a [T]-only kernel would compute.
TEST(LogprobHead, TopKTargetsMatchTheReference) {
  const int64_t T = 23, K = 4, V = 50;
  Inputs in = MakeInputs(T, 6, V, 3, 41);
  at::Generator gen = at::detail::createCPUGenerator(42);
  in.y = at::randint(V, {T, K}, gen, at::TensorOptions().dtype(at::kLong));
  in.y.select(1, 2).copy_(in.y.select(1, 0));  // column 2 repeats column 0
  const at::Tensor g = Randn({T, K}, 43);
  LogprobHeadParams p = Params(in);
  p.hidden_TD.requires_grad_(true);
  p.weight_VD.requires_grad_(true);
  p.lora_A_rD.requires_grad_(true);
  p.lora_B_Vr.requires_grad_(true);
  const auto out = kernels::TokenLogprobs(p);
  ASSERT_EQ(out.logp_T.sizes(), at::IntArrayRef({T, K}));
  (out.logp_T * g).sum().backward();

  auto reference = [&](const at::Tensor& h, const at::Tensor& W, const at::Tensor& A,
                       const at::Tensor& B) {
    const at::Tensor z = at::mm(h, W.t()) + in.s * at::mm(at::mm(h, A.t()), B.t());
    return z.gather(1, in.y) - at::logsumexp(z, 1).unsqueeze(1);
  };
  const at::Tensor h = in.h.clone().requires_grad_(true), W = in.W.clone().requires_grad_(true);
  const at::Tensor A = in.A.clone().requires_grad_(true), B = in.B.clone().requires_grad_(true);
  const at::Tensor logp = reference(h, W, A, B);
  (logp * g).sum().backward();
  EXPECT_LT(RelErr(out.logp_T, logp), kF64Tol);
  EXPECT_LT(RelErr(p.hidden_TD.grad(), h.grad()), kF64Tol);
  EXPECT_LT(RelErr(p.weight_VD.grad(), W.grad()), kF64Tol);
  EXPECT_LT(RelErr(p.lora_A_rD.grad(), A.grad()), kF64Tol);
  EXPECT_LT(RelErr(p.lora_B_Vr.grad(), B.grad()), kF64Tol);
  // Column k of the [T, K] result is the [T] result for targets y[:, k].
  Inputs column = in;
  column.y = in.y.select(1, 1).contiguous();
  EXPECT_EQ(RelErr(out.logp_T.select(1, 1), kernels::TokenLogprobs(Params(column)).logp_T), 0.0);

  const at::Tensor h0 = in.h.clone().requires_grad_(true);
  (reference(h0, in.W, in.A, in.B).select(1, 0) * g.select(1, 0)).sum().backward();
  EXPECT_GT(RelErr(p.hidden_TD.grad(), h0.grad()), 1e3 * kF64Tol);
}

TEST(LogprobHead, GradientsMatchFiniteDifferences) {
  const Inputs in = MakeInputs(23, 6, 50, 3, 26);
  const at::Tensor g = Randn({23}, 27);
  LogprobHeadParams p = Params(in);
  p.hidden_TD.requires_grad_(true);
  p.lora_A_rD.requires_grad_(true);
  (kernels::TokenLogprobs(p).logp_T * g).sum().backward();
  // Central differences, h = 1e-6: truncation ~h²·|f'''| ~ 1e-11, rounding 2^-53·|f|/h ~ 1e-9
  // for |f| ~ 100; 1e-6 bounds both.
  const double h = 1e-6;
  for (bool hidden : {true, false}) {
    for (int64_t i : {0, 13, 57, 100, 137}) {
      LogprobHeadParams plus = Params(in), minus = Params(in);
      at::Tensor& tp = hidden ? plus.hidden_TD : plus.lora_A_rD;
      at::Tensor& tm = hidden ? minus.hidden_TD : minus.lora_A_rD;
      const int64_t k = i % tp.numel();
      tp.view(-1)[k] += h;
      tm.view(-1)[k] -= h;
      const double fd = ((kernels::TokenLogprobs(plus).logp_T * g).sum().item<double>() -
                         (kernels::TokenLogprobs(minus).logp_T * g).sum().item<double>()) /
                        (2 * h);
      const at::Tensor& grad = hidden ? p.hidden_TD.grad() : p.lora_A_rD.grad();
      EXPECT_NEAR(grad.view(-1)[k].item<double>(), fd, 1e-6) << (hidden ? "h" : "A") << k;
    }
  }
}

TEST(LogprobHead, DevicePathMatchesTheReference) {
  const at::Device dev = KernelDevice();
  const Inputs base = MakeInputs(300, 64, 1000, 8, 28, 0.2);
  const at::Tensor g = Randn({300}, 29);
  for (at::ScalarType dt : {at::kFloat, at::kBFloat16}) {
    Inputs in = base;
    for (at::Tensor* t : {&in.h, &in.W, &in.A, &in.B}) *t = t->to(dt).to(at::kDouble);
    LogprobHeadParams p = Params(in, dt, dev);
    p.chunk_tokens = 128;
    p.chunk_vocab = 384;
    p.hidden_TD.requires_grad_(true);
    const auto out = kernels::TokenLogprobs(p);
    (out.logp_T.to(at::kDouble) * g.to(dev)).sum().backward();
    const at::Tensor h = in.h.clone().requires_grad_(true);
    const auto [logp, lse] = Reference(in, h, in.W, in.A, in.B);
    (logp * g).sum().backward();
    // float32: 72-term dot products and 1000-term sums at 2^-24: ~1e-5 relative to |lse| ~ 7.
    // bfloat16: each logit is rounded to 2^-9 relative (|z| ≲ 4 here, so ≲ 1e-2 absolute) and
    // logp differences of such logits are compared to |lse| ~ 7: 1e-2 relative covers it.
    const double tol = dt == at::kFloat ? 2e-5 : 1e-2;
    EXPECT_LT(RelErr(out.lse_T, lse), tol) << at::toString(dt);
    EXPECT_LT(RelErr(out.logp_T, logp), tol) << at::toString(dt);
    EXPECT_LT(RelErr(p.hidden_TD.grad(), h.grad()), 2 * tol) << at::toString(dt);
  }
}

}  // namespace
}  // namespace tinkerd::testing
