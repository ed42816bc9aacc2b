// OptimStep: the first AdamW step checked analytically from the accumulated gradient, clipping on
// the normalized global norm, and the decided edge cases (DESIGN.md §3): the zero-gradient step
// against LibTorch's own AdamW.
//
// Tolerances (float64): the test recomputes the update from the same gradient with a handful of
// operations per element, so results agree to a few ulps; 1e-14 absolute on parameters of O(1)
// and moments of O(1e-2) leaves ~50× margin over 2^-52 ≈ 2.2e-16 per operation.
#include <gtest/gtest.h>
#include <torch/optim/adamw.h>

#include "tests/faulty_collectives.h"
#include "tests/test_util.h"

namespace tinkerd::testing {
namespace {

struct Fixture {
  TempDir dir;
  std::unique_ptr<ModelRunner> runner;
  std::string id;
  explicit Fixture(LossReduction mode, ComputeDType dt = ComputeDType::kFloat64,
                   std::shared_ptr<Collectives> collectives = nullptr) {
    const std::string model = WriteModel(dir, TinyConfig("llama"));
    RunnerConfig rc;
    rc.base_model_path = model;
    rc.compute_dtype = dt;
    rc.micro_batch_tokens = 16;
    rc.collectives = std::move(collectives);
    rc.device = TestDevice();
    runner = std::move(*ModelRunner::Create(rc));
    CreateModelOptions o;
    o.loss_reduction = mode;
    o.lora = LoraConfig{4, 8, true, true, true};
    id = *runner->CreateModel(o);
  }
};

// Expected AdamW step 1 from raw gradient sums G, written out from torch.optim.AdamW's docs:
// g = G/denom·coef; m = (1−β1)g; v = (1−β2)g²; p' = p(1−lr·wd) − lr·(m/(1−β1)) / (sqrt(v/(1−β2)) +
// eps).
void CheckFirstStep(const AdamParams& p, LossReduction mode) {
  Fixture f(mode);
  SplitMix64 g(21);
  auto data = RandomData(g, {6, 15, 2, 27}, "importance_sampling", 128);
  ASSERT_TRUE(f.runner->ForwardBackward(f.id, data, "importance_sampling", {}).ok());
  const auto info = *f.runner->GetInfo(f.id);
  const double denom = mode == LossReduction::kTokenMean ? info.accumulated_tokens
                       : mode == LossReduction::kSum     ? 1.0
                                                         : info.accumulated_sequences;
  const auto G = Flat(Snap(*f.runner, f.id, StateKind::kGrads));
  const auto P0 = Flat(Snap(*f.runner, f.id, StateKind::kParams));
  double sq = 0;
  for (double x : G) sq += (x / denom) * (x / denom);
  const double norm = std::sqrt(sq);
  ASSERT_GT(norm, 0);
  AdamParams q = p;
  if (q.grad_clip_norm < 0) q.grad_clip_norm = 0.5 * norm;  // force clipping
  const double coef = q.grad_clip_norm > 0 ? std::min(1.0, q.grad_clip_norm / (norm + 1e-6)) : 1.0;

  auto r = f.runner->OptimStep(f.id, q);
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_NEAR(r->grad_norm, norm, 1e-12 * norm);
  EXPECT_EQ(r->clipped, coef < 1.0);
  EXPECT_FALSE(r->skipped);
  EXPECT_EQ(r->step, 1);
  EXPECT_EQ(r->num_tokens, info.accumulated_tokens);
  EXPECT_DOUBLE_EQ(r->denominator, denom);

  const auto P1 = Flat(Snap(*f.runner, f.id, StateKind::kParams));
  const auto M = Flat(Snap(*f.runner, f.id, StateKind::kAdamExpAvg));
  const auto V = Flat(Snap(*f.runner, f.id, StateKind::kAdamExpAvgSq));
  size_t moved = 0;
  for (size_t k = 0; k < G.size(); ++k) {
    const double gk = G[k] / denom * coef;
    const double m = (1 - q.beta1) * gk;
    const double v = (1 - q.beta2) * gk * gk;
    const double want =
        P0[k] * (1 - q.learning_rate * q.weight_decay) -
        q.learning_rate * (m / (1 - q.beta1)) / (std::sqrt(v / (1 - q.beta2)) + q.eps);
    ASSERT_NEAR(M[k], m, 1e-14) << k;
    ASSERT_NEAR(V[k], v, 1e-14) << k;
    ASSERT_NEAR(P1[k], want, 1e-14) << k;
    moved += P1[k] != P0[k];
  }
  EXPECT_GT(moved, G.size() / 2);
  // Accumulators and counters are cleared by the step.
  EXPECT_EQ(MaxAbs(Flat(Snap(*f.runner, f.id, StateKind::kGrads))), 0.0);
  EXPECT_EQ(f.runner->GetInfo(f.id)->accumulated_tokens, 0);
  EXPECT_EQ(f.runner->GetInfo(f.id)->step, 1);
}

TEST(AdamW, FirstStepAnalyticDefaults) {
  CheckFirstStep(AdamParams{}, LossReduction::kTokenMean);
}

TEST(AdamW, FirstStepAnalyticWeightDecayAndClipping) {
  AdamParams p;
  p.learning_rate = 3e-3;
  p.weight_decay = 0.1;
  p.eps = 1e-8;
  p.grad_clip_norm = -1;  // replaced by half the norm: the step must clip
  CheckFirstStep(p, LossReduction::kSeqMeanTokenSum);
}

TEST(AdamW, FirstStepAnalyticClipNotReached) {
  AdamParams p;
  p.grad_clip_norm = 1e12;  // Tinker users' trick to get the norm reported: never clips
  CheckFirstStep(p, LossReduction::kSum);
}

// torch.optim.AdamW (LibTorch's C++ twin of it, float64) over a copy of the model's trainable
// values, stepped with the gradients the runner should have applied: the oracle for the
// zero-gradient step, written by others than the kernel under test.
class TorchAdamW {
 public:
  TorchAdamW(const std::vector<NamedValues>& params, const AdamParams& p) {
    for (const NamedValues& n : params) {
      params_.push_back(torch::tensor(n.values, torch::dtype(torch::kDouble).requires_grad(true)));
    }
    optimizer_ =
        std::make_unique<torch::optim::AdamW>(params_, torch::optim::AdamWOptions(p.learning_rate)
                                                           .betas({p.beta1, p.beta2})
                                                           .eps(p.eps)
                                                           .weight_decay(p.weight_decay));
  }
  // One step with gradient g (flat, in Snap's order).
  void Step(const std::vector<double>& g) {
    size_t k = 0;
    for (torch::Tensor& t : params_) {
      const int64_t n = t.numel();
      t.mutable_grad() =
          torch::tensor(std::vector<double>(g.begin() + k, g.begin() + k + n), torch::kDouble);
      k += n;
    }
    ASSERT_EQ(k, g.size());
    optimizer_->step();
  }
  std::vector<double> Params() const {
    std::vector<double> out;
    for (const torch::Tensor& t : params_) {
      const torch::Tensor c = t.detach().contiguous();
      out.insert(out.end(), c.data_ptr<double>(), c.data_ptr<double>() + c.numel());
    }
    return out;
  }

 private:
  std::vector<torch::Tensor> params_;
  std::unique_ptr<torch::optim::AdamW> optimizer_;
};

// A batch whose every token is masked: advantages all 0, the RL convention for "no signal".
std::vector<Datum> AllMasked(SplitMix64& g) {
  auto data = RandomData(g, {5, 9}, "ppo", 128);
  for (Datum& d : data) {
    for (float& a : d.loss_fn_inputs["advantages"].float32_data) a = 0.0f;
  }
  return data;
}

// optim_step with nothing valid accumulated takes a zero-gradient step (DESIGN.md §3): what
// tinker-cookbook relies on when every group of an RL batch had a constant reward. Checked after
// a real step, so the moments are non-zero and the zero-gradient step moves the weights.
void CheckZeroGradientStep(LossReduction mode) {
  Fixture f(mode);
  AdamParams p;
  p.learning_rate = 1e-2;
  p.weight_decay = 0.1;
  p.eps = 1e-8;
  TorchAdamW torch_adamw(Snap(*f.runner, f.id, StateKind::kParams), p);

  SplitMix64 g(31);
  ASSERT_TRUE(
      f.runner->ForwardBackward(f.id, RandomData(g, {6, 15, 2}, "ppo", 128), "ppo", {}).ok());
  const auto info = *f.runner->GetInfo(f.id);
  const double denom = mode == LossReduction::kTokenMean ? info.accumulated_tokens
                       : mode == LossReduction::kSum     ? 1.0
                                                         : info.accumulated_sequences;
  ASSERT_GT(denom, 0);
  ASSERT_NO_FATAL_FAILURE(
      torch_adamw.Step(Scaled(Flat(Snap(*f.runner, f.id, StateKind::kGrads)), 1.0 / denom)));
  ASSERT_TRUE(f.runner->OptimStep(f.id, p).ok());
  const auto p1 = Flat(Snap(*f.runner, f.id, StateKind::kParams));
  ASSERT_LE(MaxAbsDiff(p1, torch_adamw.Params()), 1e-14);
  const auto m1 = Flat(Snap(*f.runner, f.id, StateKind::kAdamExpAvg));
  const auto v1 = Flat(Snap(*f.runner, f.id, StateKind::kAdamExpAvgSq));

  // Every token of the next call is masked: nothing valid is accumulated.
  auto fb = f.runner->ForwardBackward(f.id, AllMasked(g), "ppo", {});
  ASSERT_TRUE(fb.ok()) << fb.status().message();
  EXPECT_EQ(fb->metrics.at("num_tokens:sum"), 0.0);
  EXPECT_EQ(f.runner->GetInfo(f.id)->accumulated_tokens, 0);
  EXPECT_EQ(MaxAbs(Flat(Snap(*f.runner, f.id, StateKind::kGrads))), 0.0);

  auto r = f.runner->OptimStep(f.id, p);
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ(r->num_tokens, 0);
  EXPECT_EQ(r->num_sequences, 0);
  EXPECT_EQ(r->grad_norm, 0.0);
  EXPECT_FALSE(r->skipped);
  EXPECT_FALSE(r->clipped);
  EXPECT_EQ(r->step, 2);
  EXPECT_EQ(f.runner->GetInfo(f.id)->step, 2);

  const auto zeros = std::vector<double>(p1.size(), 0.0);
  ASSERT_NO_FATAL_FAILURE(torch_adamw.Step(zeros));
  const auto p2 = Flat(Snap(*f.runner, f.id, StateKind::kParams));
  EXPECT_LE(MaxAbsDiff(p2, torch_adamw.Params()), 1e-14);
  // With g = 0 the moments only decay: m ← β1·m, v ← β2·v. A kernel that writes the update as a
  // lerp or a fused multiply-add rounds two or three times, each within 2^-53 of the moment's
  // magnitude: 4·2^-53·max|m| bounds it.
  const double eps53 = std::ldexp(1.0, -53);
  EXPECT_LE(MaxAbsDiff(Flat(Snap(*f.runner, f.id, StateKind::kAdamExpAvg)), Scaled(m1, p.beta1)),
            4 * eps53 * MaxAbs(m1));
  EXPECT_LE(MaxAbsDiff(Flat(Snap(*f.runner, f.id, StateKind::kAdamExpAvgSq)), Scaled(v1, p.beta2)),
            4 * eps53 * MaxAbs(v1));
  EXPECT_GT(MaxAbs(m1), 0.0);
  // Control: the step is not a no-op. The moments of step 1 and the weight decay move the
  // weights by ~lr, far above the 1e-14 the comparison allows, so a server that skipped the
  // step (or refused it) would fail the comparison above.
  EXPECT_GE(MaxAbsDiff(p2, p1), 1e-4);
}

TEST(OptimStep, ZeroGradientStepTokenMean) {
  CheckZeroGradientStep(LossReduction::kTokenMean);
}

TEST(OptimStep, ZeroGradientStepSum) {
  CheckZeroGradientStep(LossReduction::kSum);
}

TEST(OptimStep, ZeroGradientStepSeqMeanTokenMean) {
  CheckZeroGradientStep(LossReduction::kSeqMeanTokenMean);
}

// The first step of a fresh model with nothing accumulated: the moments stay 0, so only the
// decoupled weight decay acts, p ← p·(1 − lr·wd), exactly as torch's AdamW with a zero gradient.
TEST(OptimStep, ZeroGradientFirstStepOnlyDecays) {
  Fixture f(LossReduction::kTokenMean);
  AdamParams p;
  p.weight_decay = 0.5;
  p.learning_rate = 1e-2;
  const auto p0 = Flat(Snap(*f.runner, f.id, StateKind::kParams));
  auto r = f.runner->OptimStep(f.id, p);
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ(r->step, 1);
  EXPECT_EQ(r->num_tokens, 0);
  EXPECT_EQ(r->grad_norm, 0.0);
  EXPECT_EQ(MaxAbs(Flat(Snap(*f.runner, f.id, StateKind::kAdamExpAvg))), 0.0);
  EXPECT_EQ(MaxAbs(Flat(Snap(*f.runner, f.id, StateKind::kAdamExpAvgSq))), 0.0);
  const auto p1 = Flat(Snap(*f.runner, f.id, StateKind::kParams));
  EXPECT_LE(MaxAbsDiff(p1, Scaled(p0, 1 - p.learning_rate * p.weight_decay)), 1e-15);
  EXPECT_GT(MaxAbs(p0), 0.0);  // LoRA A is random, so the decay is visible
}

TEST(OptimStep, BadAdamParamsAreInvalidArgumentAndChangeNothing) {
  Fixture f(LossReduction::kTokenMean);
  SplitMix64 g(1);
  ASSERT_TRUE(
      f.runner->ForwardBackward(f.id, RandomData(g, {7}, "cross_entropy", 128), "cross_entropy", {})
          .ok());
  const auto grads = Flat(Snap(*f.runner, f.id, StateKind::kGrads));
  for (auto mutate : std::vector<std::function<void(AdamParams&)>>{
           [](AdamParams& p) { p.learning_rate = -1; }, [](AdamParams& p) { p.beta1 = 1.0; },
           [](AdamParams& p) { p.beta2 = -0.1; }, [](AdamParams& p) { p.eps = NAN; },
           [](AdamParams& p) { p.weight_decay = -1; },
           [](AdamParams& p) { p.grad_clip_norm = INFINITY; }}) {
    AdamParams p;
    mutate(p);
    auto r = f.runner->OptimStep(f.id, p);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find("adam_params."), absl::string_view::npos);
  }
  EXPECT_EQ(Flat(Snap(*f.runner, f.id, StateKind::kGrads)), grads);
  EXPECT_GT(f.runner->GetInfo(f.id)->accumulated_tokens, 0);
}

// optim_step reserves its transient (a copy of the gradients) before it changes anything: with no
// room it is RESOURCE_EXHAUSTED and the model is as it was, and once there is room the same step
// is taken over the same accumulated gradients.
TEST(OptimStep, WithoutMemoryForItsTransientItChangesNothing) {
  if (TestDevice() != "cpu") GTEST_SKIP() << "the account reserves steps on the CPU only";
  Fixture f(LossReduction::kTokenMean);
  Fixture reference(LossReduction::kTokenMean);
  SplitMix64 g(5);
  const auto data = RandomData(g, {7, 12}, "cross_entropy", 128);
  ASSERT_TRUE(f.runner->ForwardBackward(f.id, data, "cross_entropy", {}).ok());
  ASSERT_TRUE(reference.runner->ForwardBackward(reference.id, data, "cross_entropy", {}).ok());
  const auto grads = Flat(Snap(*f.runner, f.id, StateKind::kGrads));
  const auto params = Flat(Snap(*f.runner, f.id, StateKind::kParams));
  std::shared_ptr<MemoryAccount> account = f.runner->memory_account();
  absl::StatusOr<Reservation> others =
      account->Reserve(account->capacity() - account->reserved() - 64, "others", "");
  ASSERT_TRUE(others.ok()) << others.status();
  auto refused = f.runner->OptimStep(f.id, AdamParams());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();
  EXPECT_NE(refused.status().message().find("optim_step: its copy of the gradients"),
            absl::string_view::npos)
      << refused.status();
  EXPECT_EQ(Flat(Snap(*f.runner, f.id, StateKind::kGrads)), grads);
  EXPECT_EQ(Flat(Snap(*f.runner, f.id, StateKind::kParams)), params);
  EXPECT_EQ(f.runner->GetInfo(f.id)->step, 0);
  *others = Reservation();
  auto taken = f.runner->OptimStep(f.id, AdamParams());
  auto want = reference.runner->OptimStep(reference.id, AdamParams());
  ASSERT_TRUE(taken.ok()) << taken.status();
  ASSERT_TRUE(want.ok()) << want.status();
  EXPECT_EQ(taken->grad_norm, want->grad_norm);
  EXPECT_EQ(Flat(Snap(*f.runner, f.id, StateKind::kParams)),
            Flat(Snap(*reference.runner, reference.id, StateKind::kParams)));
}

TEST(OptimStep, NonFiniteNormSkipsClearsAndCounts) {
  // float32 compute: weights near FLT_MAX overflow the float32 gradient to inf.
  Fixture f(LossReduction::kSum, ComputeDType::kFloat32);
  SplitMix64 g(3);
  auto data = RandomData(g, {32, 32}, "cross_entropy", 128);
  for (Datum& d : data) {
    for (float& w : d.loss_fn_inputs["weights"].float32_data) w = 3.0e38f;
  }
  ASSERT_TRUE(f.runner->ForwardBackward(f.id, data, "cross_entropy", {}).ok());
  const auto p0 = Flat(Snap(*f.runner, f.id, StateKind::kParams));
  auto r = f.runner->OptimStep(f.id, AdamParams{});
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_TRUE(r->skipped);
  EXPECT_FALSE(std::isfinite(r->grad_norm));
  EXPECT_EQ(r->step, 0);
  EXPECT_EQ(Flat(Snap(*f.runner, f.id, StateKind::kParams)), p0);
  EXPECT_EQ(MaxAbs(Flat(Snap(*f.runner, f.id, StateKind::kGrads))), 0.0);
  const auto info = *f.runner->GetInfo(f.id);
  EXPECT_EQ(info.skipped_steps, 1);
  EXPECT_EQ(info.accumulated_tokens, 0);
  // The model trains normally afterwards.
  ASSERT_TRUE(
      f.runner->ForwardBackward(f.id, RandomData(g, {9}, "cross_entropy", 128), "cross_entropy", {})
          .ok());
  auto ok = f.runner->OptimStep(f.id, AdamParams{});
  ASSERT_TRUE(ok.ok());
  EXPECT_FALSE(ok->skipped);
  EXPECT_EQ(ok->step, 1);
}

TEST(ForwardBackward, FailedCallLeavesStateUnchanged) {
  auto faulty = std::make_shared<FaultyCollectives>(MakeLocalCollectives(), Faults{});
  Fixture f(LossReduction::kTokenMean, ComputeDType::kFloat64, faulty);
  SplitMix64 g(5);
  ASSERT_TRUE(
      f.runner->ForwardBackward(f.id, RandomData(g, {10, 4}, "cispo", 128), "cispo", {}).ok());
  const auto grads = Flat(Snap(*f.runner, f.id, StateKind::kGrads));
  const auto info = *f.runner->GetInfo(f.id);
  // Three micro-batches of ≤16 tokens; the fault strikes after all three were back-propagated
  // and the call's counts reduced, at its last collective before it commits.
  auto data = RandomData(g, {14, 12, 15}, "cispo", 128);
  faulty->faults().fail_loss_reduction = true;
  auto r = f.runner->ForwardBackward(f.id, data, "cispo", {});
  faulty->faults().fail_loss_reduction = false;
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable) << r.status();
  EXPECT_EQ(Flat(Snap(*f.runner, f.id, StateKind::kGrads)), grads);
  EXPECT_EQ(f.runner->GetInfo(f.id)->accumulated_tokens, info.accumulated_tokens);
  EXPECT_EQ(f.runner->GetInfo(f.id)->accumulated_sequences, info.accumulated_sequences);
  // Validation failures change nothing either.
  auto bad = data;
  bad[1].loss_fn_inputs["advantages"].float32_data[3] = NAN;
  EXPECT_EQ(f.runner->ForwardBackward(f.id, bad, "cispo", {}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Flat(Snap(*f.runner, f.id, StateKind::kGrads)), grads);
  // Control: without the fault the same call does change the accumulators.
  ASSERT_TRUE(f.runner->ForwardBackward(f.id, data, "cispo", {}).ok());
  EXPECT_NE(Flat(Snap(*f.runner, f.id, StateKind::kGrads)), grads);
}

}  // namespace
}  // namespace tinkerd::testing
