// OptimStep: the first AdamW step checked analytically from the accumulated gradient, clipping on
// the normalized global norm, and the decided edge cases (DESIGN.md §3).
//
// Tolerances (float64): the test recomputes the update from the same gradient with a handful of
// operations per element, so results agree to a few ulps; 1e-14 absolute on parameters of O(1)
// and moments of O(1e-2) leaves ~50× margin over 2^-52 ≈ 2.2e-16 per operation.
#include <gtest/gtest.h>

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

TEST(OptimStep, ZeroDenominatorIsRejectedAndChangesNothing) {
  Fixture f(LossReduction::kTokenMean);
  const auto p0 = Flat(Snap(*f.runner, f.id, StateKind::kParams));
  auto r = f.runner->OptimStep(f.id, AdamParams{});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  // A call whose tokens are all masked adds nothing either.
  SplitMix64 g(1);
  auto data = RandomData(g, {5}, "ppo", 128);
  for (float& a : data[0].loss_fn_inputs["advantages"].float32_data) a = 0.0f;
  ASSERT_TRUE(f.runner->ForwardBackward(f.id, data, "ppo", {}).ok());
  EXPECT_EQ(f.runner->OptimStep(f.id, AdamParams{}).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(Flat(Snap(*f.runner, f.id, StateKind::kParams)), p0);
  EXPECT_EQ(f.runner->GetInfo(f.id)->step, 0);
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
