// Finite-difference checks (float64) of each loss's gradient with respect to the learner's
// logprobs, the only differentiable input.
//
// Central differences with step h have truncation error h²/6·|f'''| and rounding error
// ε64·|f|/h. With |f''| , |f'''| = O(e^{|logp−logq|}) ≤ O(10) on these inputs and |f| ≤ O(100):
// h = 1e-5 gives ≈ 2e-10 + 2e-9 ≈ 2e-9; kTol = 1e-7 leaves 50× margin.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "runner/loss/loss_spec.h"
#include "runner/loss/losses.h"
#include "runner/util/rng.h"

namespace tinkerd {
namespace {

constexpr double kH = 1e-5;
constexpr double kTol = 1e-7;

at::Tensor Rand(SplitMix64& g, int64_t n, double lo, double hi) {
  at::Tensor t = at::empty({n}, at::kDouble);
  for (int64_t i = 0; i < n; ++i) t.data_ptr<double>()[i] = g.Uniform(lo, hi);
  return t;
}

void CheckLoss(const std::string& name, const std::map<std::string, double>& user_cfg) {
  auto resolved = ResolveLoss(name, user_cfg);
  ASSERT_TRUE(resolved.ok());
  const auto& cfg = resolved->config;
  SplitMix64 g(17);
  const int64_t n = 40;
  at::Tensor logq = Rand(g, n, -4, -0.5);
  // Keep r = exp(logp − logq) away from the clip kinks, where the loss is not differentiable.
  at::Tensor logp = logq + Rand(g, n, -0.7, 0.7);
  if (cfg.count("clip_low_threshold")) {
    for (int64_t i = 0; i < n; ++i) {
      double& lp = logp.data_ptr<double>()[i];
      const double q = logq.data_ptr<double>()[i];
      for (double kink : {cfg.at("clip_low_threshold"), cfg.at("clip_high_threshold")}) {
        if (kink > 0 && std::abs(std::exp(lp - q) - kink) < 1e-3) lp += 5e-3;
      }
    }
  }
  LossTokenInputs in;
  in.logp_T = logp.clone().set_requires_grad(true);
  in.weights_T = Rand(g, n, -1, 2);
  in.logq_T = logq;
  in.adv_T = Rand(g, n, -1, 1);
  at::Tensor f = PerTokenLoss(name, in, cfg).loss_T.sum();
  at::Tensor grad = torch::autograd::grad({f}, {in.logp_T})[0];

  // CISPO's clipped ratio is a stop-gradient weight: hold it at its value at the point.
  at::Tensor cispo_weight = at::clamp(
      at::exp(logp - logq), cfg.count("clip_low_threshold") ? cfg.at("clip_low_threshold") : 0,
      cfg.count("clip_high_threshold") ? cfg.at("clip_high_threshold") : 0);
  auto eval = [&](const at::Tensor& lp) {
    if (name == "cispo") return (-cispo_weight * lp * in.adv_T).sum().item<double>();
    LossTokenInputs x = in;
    x.logp_T = lp;
    return PerTokenLoss(name, x, cfg).loss_T.sum().item<double>();
  };
  double max_err = 0, max_grad = 0;
  for (int64_t i = 0; i < n; ++i) {
    at::Tensor up = logp.clone(), down = logp.clone();
    up.data_ptr<double>()[i] += kH;
    down.data_ptr<double>()[i] -= kH;
    const double fd = (eval(up) - eval(down)) / (2 * kH);
    max_err = std::max(max_err, std::abs(fd - grad.data_ptr<double>()[i]));
    max_grad = std::max(max_grad, std::abs(fd));
  }
  EXPECT_GT(max_grad, 1e-2) << name << ": vacuous check";
  EXPECT_LT(max_err, kTol) << name;
}

TEST(LossGradcheck, CrossEntropy) {
  CheckLoss("cross_entropy", {});
}
TEST(LossGradcheck, ImportanceSampling) {
  CheckLoss("importance_sampling", {});
}
TEST(LossGradcheck, PpoWithActiveClipping) {
  CheckLoss("ppo", {{"clip_low_threshold", 0.9}, {"clip_high_threshold", 1.1}});
}
TEST(LossGradcheck, Cispo) {
  CheckLoss("cispo", {{"clip_low_threshold", 0.8}, {"clip_high_threshold", 1.2}});
}
TEST(LossGradcheck, Dro) {
  CheckLoss("dro", {{"beta", 0.5}});
}

// GSPO-token: each token's ratio has its sequence's value s = exp(mean over the positions of
// sequence_ratio_mask of logp − logq) and its own logprob's gradient. The value is checked against
// that definition written with plain loops; the gradient by central differences of the loss with
// s held at its value (the stop-gradient), and a control shows that differentiating through s
// too would be told apart.
TEST(LossGradcheck, GspoTokenRatioCarriesTheSequenceValue) {
  auto resolved =
      ResolveLoss("gspo", {{"clip_low_threshold", 0.98}, {"clip_high_threshold", 1.02}});
  ASSERT_TRUE(resolved.ok()) << resolved.status().message();
  const auto& cfg = resolved->config;
  const double lo = cfg.at("clip_low_threshold"), hi = cfg.at("clip_high_threshold");
  const std::vector<int64_t> cu = {0, 12, 21, 28, 40};  // the third datum has no ratio position
  const int64_t n = cu.back();
  SplitMix64 g(23);
  at::Tensor logq = Rand(g, n, -4, -0.5);
  at::Tensor logp = logq + Rand(g, n, -0.4, 0.4);
  at::Tensor adv = Rand(g, n, -1, 1);
  at::Tensor in_ratio = at::empty({n}, at::kDouble);
  for (int64_t t = 0; t < n; ++t) {
    in_ratio.data_ptr<double>()[t] = (t >= 21 && t < 28) ? 0.0 : (g.Uniform(0, 1) < 0.8);
  }
  // Datum j's ratio s = exp(mean over its ratio positions of lp − logq), with plain loops.
  auto ratio = [&](const at::Tensor& lp, size_t j) {
    double sum = 0;
    int count = 0;
    for (int64_t t = cu[j]; t < cu[j + 1]; ++t) {
      if (in_ratio.data_ptr<double>()[t] != 0) {
        sum += lp.data_ptr<double>()[t] - logq.data_ptr<double>()[t];
        ++count;
      }
    }
    return std::exp(count > 0 ? sum / count : 0.0);
  };
  std::vector<double> s(cu.size() - 1);  // held fixed below: the stop-gradient
  for (size_t j = 0; j + 1 < cu.size(); ++j) s[j] = ratio(logp, j);
  // f(lp) = −Σ_t min(r_t·A_t, clip(r_t)·A_t) with r_t = s_j·exp(lp_t − logp_t); `through_s`
  // recomputes s_j from lp, as a loss without the stop-gradient would.
  auto f = [&](const at::Tensor& lp, bool through_s) {
    double total = 0;
    for (size_t j = 0; j + 1 < cu.size(); ++j) {
      const double sj = through_s ? ratio(lp, j) : s[j];
      for (int64_t t = cu[j]; t < cu[j + 1]; ++t) {
        const double r =
            through_s ? sj : sj * std::exp(lp.data_ptr<double>()[t] - logp.data_ptr<double>()[t]);
        const double a = adv.data_ptr<double>()[t];
        total -= std::min(r * a, std::clamp(r, lo, hi) * a);
      }
    }
    return total;
  };
  // Keep every s away from the clip kinks, where the loss is not differentiable.
  for (double sj : s) ASSERT_GT(std::min(std::abs(sj - lo), std::abs(sj - hi)), 1e-3) << sj;
  EXPECT_TRUE(std::any_of(s.begin(), s.end(), [&](double x) { return x < lo || x > hi; }))
      << "some datum must be clipped: s = " << s[0] << ", " << s[1] << ", " << s[2] << ", " << s[3];

  LossTokenInputs in{logp.clone().set_requires_grad(true), at::Tensor(), logq, adv, in_ratio, cu};
  const at::Tensor loss = GspoLoss(in, cfg).loss_T.sum();
  EXPECT_NEAR(loss.item<double>(), f(logp, false), 1e-12 * std::max(1.0, std::abs(f(logp, false))));
  const at::Tensor grad = torch::autograd::grad({loss}, {in.logp_T})[0];
  double max_err = 0, max_grad = 0, through_s_gap = 0;
  for (int64_t i = 0; i < n; ++i) {
    at::Tensor up = logp.clone(), down = logp.clone();
    up.data_ptr<double>()[i] += kH;
    down.data_ptr<double>()[i] -= kH;
    const double fd = (f(up, false) - f(down, false)) / (2 * kH);
    const double fd_through_s = (f(up, true) - f(down, true)) / (2 * kH);
    max_err = std::max(max_err, std::abs(fd - grad.data_ptr<double>()[i]));
    max_grad = std::max(max_grad, std::abs(fd));
    through_s_gap = std::max(through_s_gap, std::abs(fd_through_s - grad.data_ptr<double>()[i]));
  }
  EXPECT_GT(max_grad, 1e-2) << "vacuous check";
  EXPECT_LT(max_err, kTol);
  EXPECT_GT(through_s_gap, 1e-3) << "the control must tell the stop-gradient apart";
}

// PPO's clip zeroes the gradient of tokens whose ratio left the trust region in the direction the
// advantage favours; CISPO never does. This is the behavioural difference between the two.
TEST(LossGradcheck, PpoClipsGradientCispoDoesNot) {
  const std::map<std::string, double> cfg = {{"clip_low_threshold", 0.8},
                                             {"clip_high_threshold", 1.2}};
  at::Tensor logq = at::full({1}, -1.0, at::kDouble);
  at::Tensor logp = (logq + std::log(1.5)).set_requires_grad(true);  // r = 1.5 > hi
  at::Tensor adv = at::ones({1}, at::kDouble);                       // A > 0: PPO clips
  LossTokenInputs in;
  in.logp_T = logp;
  in.logq_T = logq;
  in.adv_T = adv;
  auto ppo = PpoLoss(in, cfg);
  EXPECT_EQ(torch::autograd::grad({ppo.loss_T.sum()}, {logp})[0].item<double>(), 0.0);
  EXPECT_TRUE(ppo.clipped_T.item<bool>());
  auto cispo = CispoLoss(in, cfg);
  EXPECT_DOUBLE_EQ(torch::autograd::grad({cispo.loss_T.sum()}, {logp})[0].item<double>(), -1.2);
}

}  // namespace
}  // namespace tinkerd
