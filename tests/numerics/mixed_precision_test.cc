// bfloat16 compute (base weights and activations in bf16, fp32 master weights, accumulators and
// moments) and activation checkpointing, at the level of the runner: the exactness promise in the
// fp32 accumulators, agreement with float64, and that a bf16 model trains.
#include <gtest/gtest.h>

#include "tests/test_util.h"

namespace tinkerd::testing {
namespace {

std::unique_ptr<ModelRunner> Runner(const std::string& model, ComputeDType dtype,
                                    int64_t micro_batch_tokens, bool checkpointing = false) {
  RunnerConfig rc;
  rc.base_model_path = model;
  rc.compute_dtype = dtype;
  rc.micro_batch_tokens = micro_batch_tokens;
  rc.activation_checkpointing = checkpointing;
  rc.device = TestDevice();
  auto r = ModelRunner::Create(rc);
  EXPECT_TRUE(r.ok()) << r.status().message();
  return r.ok() ? std::move(*r) : nullptr;
}

std::string NewModel(ModelRunner& r) {
  CreateModelOptions o;
  o.seed = 3;
  o.lora = LoraConfig{4, 8, true, true, true};
  auto id = r.CreateModel(o);
  EXPECT_TRUE(id.ok()) << id.status().message();
  return *id;
}

// A step with a large learning rate first, so that every adapter matrix (B starts at 0) has a
// gradient well above rounding.
void Warm(ModelRunner& r, const std::string& id) {
  SplitMix64 g(5);
  ASSERT_TRUE(
      r.ForwardBackward(id, RandomData(g, {6, 11}, "cross_entropy", 128), "cross_entropy", {})
          .ok());
  AdamParams p;
  p.learning_rate = 0.05;
  ASSERT_TRUE(r.OptimStep(id, p).ok());
}

TEST(MixedPrecision, Bf16SplitVsCombinedInTheFp32Accumulators) {
  // micro_batch_tokens = 1 runs every sequence as its own micro-batch in both the split and the
  // combined call, so each sequence's bf16 forward and backward are the same operations on the
  // same values. What the split changes is only the order in which fp32 per-sequence gradients
  // are summed: 6 terms, so at most 6 · 2^-24 ≈ 4e-7 of Σ|terms| per element. Relative to the
  // largest element (terms may partly cancel) we allow 1e-4. The per-call-denominator broken
  // control is off by O(1e-1).
  TempDir dir;
  const std::string model = WriteModel(dir, TinyConfig("llama"));
  auto runner = Runner(model, ComputeDType::kBFloat16, /*micro_batch_tokens=*/1);
  const std::string combined = NewModel(*runner), split = NewModel(*runner);
  Warm(*runner, combined);
  Warm(*runner, split);
  SplitMix64 g(9);
  const auto data = RandomData(g, {2, 31, 5, 17, 3, 24}, "cross_entropy", 128);
  ASSERT_TRUE(runner->ForwardBackward(combined, data, "cross_entropy", {}).ok());
  std::vector<double> previous = Flat(Snap(*runner, split, StateKind::kGrads));
  std::vector<double> broken(previous.size(), 0.0);
  for (auto [b, e] : std::vector<std::pair<size_t, size_t>>{{0, 1}, {1, 4}, {4, 6}}) {
    auto r = runner->ForwardBackward(split, Slice(data, b, e), "cross_entropy", {});
    ASSERT_TRUE(r.ok()) << r.status().message();
    const auto now = Flat(Snap(*runner, split, StateKind::kGrads));
    for (size_t k = 0; k < now.size(); ++k) {
      broken[k] += (now[k] - previous[k]) / r->metrics.at("num_tokens:sum") / 3.0;
    }
    previous = now;
  }
  const double tokens = static_cast<double>(runner->GetInfo(combined)->accumulated_tokens);
  const auto want = Scaled(Flat(Snap(*runner, combined, StateKind::kGrads)), 1.0 / tokens);
  const auto got = Scaled(Flat(Snap(*runner, split, StateKind::kGrads)), 1.0 / tokens);
  const double scale = MaxAbs(want);
  ASSERT_GT(scale, 1e-6);
  EXPECT_LE(MaxAbsDiff(want, got), 1e-4 * scale);
  EXPECT_GT(MaxAbsDiff(want, broken), 1e-2 * scale) << "the broken control agreed";
}

TEST(MixedPrecision, Bf16LogprobsTrackFloat64AndTheModelTrains) {
  TempDir dir;
  const std::string model = WriteModel(dir, TinyConfig("qwen3"));
  auto f64 = Runner(model, ComputeDType::kFloat64, 4096);
  auto bf16 = Runner(model, ComputeDType::kBFloat16, 4096);
  const std::string a = NewModel(*f64), b = NewModel(*bf16);
  SplitMix64 g(13);
  const auto data = RandomData(g, {40, 64, 23}, "cross_entropy", 128);
  auto ref = f64->Forward(a, data, "cross_entropy", {});
  auto low = bf16->Forward(b, data, "cross_entropy", {});
  ASSERT_TRUE(ref.ok() && low.ok());
  // Each of the ~25 ops between the embedding and a logit rounds to bf16 (2^-8 relative); their
  // errors add up to ~25 · 2^-8 ≈ 0.1 relative on a logit in the worst case and far less on
  // average (they are independent). Logits here are O(1) and logprobs O(5): we bound the mean
  // absolute logprob error by 0.05 and the largest by 0.5.
  double sum = 0, worst = 0;
  int64_t n = 0;
  for (size_t i = 0; i < data.size(); ++i) {
    for (size_t t = 0; t < ref->outputs[i].logprobs.size(); ++t) {
      const double e = std::abs(ref->outputs[i].logprobs[t] - low->outputs[i].logprobs[t]);
      sum += e;
      worst = std::max(worst, e);
      ++n;
    }
  }
  EXPECT_LT(sum / n, 0.05);
  EXPECT_LT(worst, 0.5);
  EXPECT_GT(worst, 0.0) << "bf16 and float64 agree exactly: the bf16 path did not run";

  // Trains: the loss on a fixed batch falls over a few steps.
  AdamParams p;
  p.learning_rate = 0.02;
  double first = 0, last = 0;
  for (int step = 0; step < 8; ++step) {
    auto r = bf16->ForwardBackward(b, data, "cross_entropy", {});
    ASSERT_TRUE(r.ok());
    (step == 0 ? first : last) = r->metrics.at("loss:sum") / r->metrics.at("num_tokens:sum");
    ASSERT_TRUE(bf16->OptimStep(b, p).ok());
  }
  EXPECT_LT(last, first - 0.1) << "bf16 loss per token went from " << first << " to " << last;
}

TEST(MixedPrecision, ActivationCheckpointingIsBitwiseInFloat64) {
  TempDir dir;
  const std::string model = WriteModel(dir, TinyConfig("mistral"));  // sliding window
  auto plain = Runner(model, ComputeDType::kFloat64, 48);
  auto ckpt = Runner(model, ComputeDType::kFloat64, 48, /*checkpointing=*/true);
  const std::string a = NewModel(*plain), b = NewModel(*ckpt);
  Warm(*plain, a);
  Warm(*ckpt, b);
  SplitMix64 g(17);
  const auto data = RandomData(g, {30, 9, 44}, "ppo", 128);
  auto ra = plain->ForwardBackward(a, data, "ppo", {});
  auto rb = ckpt->ForwardBackward(b, data, "ppo", {});
  ASSERT_TRUE(ra.ok() && rb.ok());
  const auto ga = Flat(Snap(*plain, a, StateKind::kGrads));
  const auto gb = Flat(Snap(*ckpt, b, StateKind::kGrads));
  ASSERT_GT(MaxAbs(ga), 1e-6);
  EXPECT_EQ(MaxAbsDiff(ga, gb), 0.0);
}

}  // namespace
}  // namespace tinkerd::testing
