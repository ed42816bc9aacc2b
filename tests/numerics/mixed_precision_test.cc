// bfloat16 compute (base weights and activations in bf16, fp32 master weights, accumulators and
// moments) and activation checkpointing, at the level of the runner: the exactness promise in the
// fp32 accumulators, agreement with float64, and that a bf16 model trains.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"

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

std::string NewModel(ModelRunner& r, bool lora = true) {
  CreateModelOptions o;
  o.seed = 3;
  o.lora = lora ? std::optional<LoraConfig>(LoraConfig{4, 8, true, true, true}) : std::nullopt;
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

// x rounded to the nearest bfloat16 (ties to even), through float.
double RoundToBf16(double x) {
  const float f = static_cast<float>(x);
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000u;
  float out;
  std::memcpy(&out, &bits, sizeof out);
  return out;
}

// The gradient one call adds to `id`'s accumulators.
std::vector<double> CallGradient(ModelRunner& r, const std::string& id,
                                 const std::vector<Datum>& data) {
  const std::vector<double> before = Flat(Snap(r, id, StateKind::kGrads));
  EXPECT_TRUE(r.ForwardBackward(id, data, "cross_entropy", {}).ok());
  std::vector<double> delta = Flat(Snap(r, id, StateKind::kGrads));
  for (size_t k = 0; k < delta.size(); ++k) delta[k] -= before[k];
  return delta;
}

struct SplitCase {
  std::string family;
  bool lora;
  int64_t micro_batch_tokens;
};

std::string CaseName(const ::testing::TestParamInfo<SplitCase>& info) {
  return absl::StrCat(info.param.family, info.param.lora ? "Lora" : "Full", "Micro",
                      info.param.micro_batch_tokens);
}

class Bf16SplitVsCombined : public ::testing::TestWithParam<SplitCase> {};

// Under bf16 compute each fp32 accumulator element is a sum of per-position terms, each the
// product of two bf16 values and so exact in fp32 (8-bit significands: the product fits in 24
// bits); nothing is rounded to bf16 on the way. However the datums are split into calls and packed
// into micro-batches, only the order of that fp32 sum changes, and two orders of summing N terms
// differ by at most 2(N − 1)·u·Σ|terms|, u = 2^-24. Here N is twice the 82 positions (a tied
// embedding sums the embedding's and the head's terms). Σ|terms| is not observable from outside
// the runner: the per-datum gradients' magnitudes Σ_i|δ_i| stand in for it, and undercount it
// where one datum's positions cancel, which the bound's worst-case factor N (reordering errors
// grow as √N: 13 against 164) covers. The largest element sets the scale, so that an element whose
// terms cancel to nearly 0 cannot demand a tighter bound than its terms allow.
// The broken control restores the bf16 rounding between the token sums and the accumulator, per
// call: it is about 2^-9 of a gradient, far above the bound, and must exceed it.
TEST_P(Bf16SplitVsCombined, WithinTheFloat32Bound) {
  const SplitCase& c = GetParam();
  TempDir dir;
  const std::string model = WriteModel(dir, TinyConfig(c.family));
  auto runner = Runner(model, ComputeDType::kBFloat16, c.micro_batch_tokens);
  ASSERT_NE(runner, nullptr);
  const std::string combined = NewModel(*runner, c.lora), split = NewModel(*runner, c.lora);
  const std::string single = NewModel(*runner, c.lora);
  if (c.lora) {
    for (const std::string& id : {combined, split, single}) Warm(*runner, id);
  }
  SplitMix64 g(9);
  const std::vector<int> lengths = {2, 31, 5, 17, 3, 24};
  const auto data = RandomData(g, lengths, "cross_entropy", 128);
  const std::vector<double> want = CallGradient(*runner, combined, data);
  std::vector<double> got(want.size(), 0.0), broken(want.size(), 0.0);
  for (auto [b, e] : std::vector<std::pair<size_t, size_t>>{{0, 1}, {1, 4}, {4, 6}}) {
    const std::vector<double> delta = CallGradient(*runner, split, Slice(data, b, e));
    for (size_t k = 0; k < delta.size(); ++k) {
      got[k] += delta[k];
      broken[k] += RoundToBf16(delta[k]);
    }
  }
  std::vector<double> magnitude(want.size(), 0.0);
  for (size_t i = 0; i < data.size(); ++i) {
    const std::vector<double> delta = CallGradient(*runner, single, Slice(data, i, i + 1));
    for (size_t k = 0; k < delta.size(); ++k) magnitude[k] += std::abs(delta[k]);
  }
  // The accumulators are fp32: `got` is the split's accumulator read back, summed again in double
  // above, which adds no error (fp32 values, three terms, double's 53 bits).
  int64_t positions = 0;
  for (int n : lengths) positions += n;
  const double n_terms = 2.0 * static_cast<double>(positions);
  const double bound = 2.0 * (n_terms - 1.0) * std::ldexp(1.0, -24) * MaxAbs(magnitude);
  ASSERT_GT(MaxAbs(want), 0.0);
  EXPECT_LE(MaxAbsDiff(want, got), bound);
  std::vector<double> broken_want(want.size());
  for (size_t k = 0; k < want.size(); ++k) broken_want[k] = RoundToBf16(want[k]);
  EXPECT_GT(MaxAbsDiff(broken_want, broken), bound) << "the broken control agreed";
}

// micro_batch_tokens 1 runs every datum alone; 16 and 64 pack several datums into a micro-batch
// (a longer one runs alone), grouped differently in the split calls than in the combined one;
// 4096 packs a whole call into one. llama: LoRA on every module and the head; qwen2: biases and a
// tied embedding; qwen3: q/k norms.
INSTANTIATE_TEST_SUITE_P(
    MixedPrecision, Bf16SplitVsCombined,
    ::testing::Values(SplitCase{"llama", true, 1}, SplitCase{"llama", true, 16},
                      SplitCase{"llama", true, 64}, SplitCase{"llama", true, 4096},
                      SplitCase{"qwen2", false, 1}, SplitCase{"qwen2", false, 16},
                      SplitCase{"qwen2", false, 64}, SplitCase{"qwen3", false, 64},
                      SplitCase{"qwen3", true, 16}),
    CaseName);

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
