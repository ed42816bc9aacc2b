// Router replay for mixtures of experts: the sampler returns the experts every token met in every
// routed layer (SampleRequest::routed_experts), and a datum that sends them back
// (loss_fn_inputs["routed_experts"], [T, R, k]) is trained through those experts instead of the
// ones the router picks now. Recomputed routes can differ from the sampler's where the two compute
// the router differently (another device, kernel or precision); replayed ones cannot.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "runner/batch.h"
#include "runner/sample/engine.h"
#include "runner/sample/policy.h"
#include "tests/test_util.h"

namespace tinkerd::testing {
namespace {

constexpr double kRelTol = 1e-10;  // accumulation_test.cc's float64 bound

class RouterReplay : public ::testing::TestWithParam<ComputeDType> {
 protected:
  void SetUp() override {
    dir_ = std::make_unique<TempDir>();
    config_ = TinyConfig("qwen3_moe");
    config_.moe.layer_routes = {true, true};  // both layers route: R = 2
    runner_ = MakeRunner(WriteModel(*dir_, config_, 5), GetParam());
    ASSERT_NE(runner_, nullptr);
    CreateModelOptions options;
    options.lora = LoraConfig{4, 8, true, true, false};
    options.loss_reduction = LossReduction::kSum;
    options.seed = 3;
    model_ = *runner_->CreateModel(options);
    SplitMix64 g(4);
    ASSERT_TRUE(runner_
                    ->ForwardBackward(model_, RandomData(g, {9, 14}, "cross_entropy", 128),
                                      "cross_entropy", {})
                    .ok());
    AdamParams adam;
    adam.learning_rate = 0.05;
    ASSERT_TRUE(runner_->OptimStep(model_, adam).ok());
    auto policy = runner_->FreezePolicy(model_);
    ASSERT_TRUE(policy.ok()) << policy.status().message();
    policy_ = *policy;
  }

  // Samples n sequences of 6 tokens after `prompt`, with their routes.
  SampleResult Sample(const std::vector<int64_t>& prompt, int64_t n) {
    SampleRequest r;
    r.prompt = prompt;
    r.num_samples = n;
    r.params.max_tokens = 6;
    r.params.seed = 7;
    r.routed_experts = true;
    SampleEngine engine(EngineLimits{});
    SampleResult out;
    EXPECT_TRUE(engine
                    .Admit(policy_, r,
                           [&out](const absl::StatusOr<SampleResult>& result) {
                             ASSERT_TRUE(result.ok()) << result.status().message();
                             out = *result;
                           })
                    .ok());
    while (engine.Step()) {
    }
    return out;
  }

  // A datum of prompt + sampled[:-1] predicting prompt[1:] + sampled, with `routes` ([T, R, k],
  // flat) replayed when non-empty.
  Datum Trajectory(const std::vector<int64_t>& prompt, const SampledSequence& s,
                   const std::vector<int64_t>& routes) const {
    Datum d;
    d.tokens = prompt;
    d.tokens.insert(d.tokens.end(), s.tokens.begin(), s.tokens.end() - 1);
    std::vector<int64_t> targets(prompt.begin() + 1, prompt.end());
    targets.insert(targets.end(), s.tokens.begin(), s.tokens.end());
    d.loss_fn_inputs["target_tokens"] = TensorData::Int64(targets);
    d.loss_fn_inputs["weights"] = TensorData::Float32(std::vector<float>(targets.size(), 1.f));
    if (!routes.empty()) {
      TensorData t = TensorData::Int64(routes);
      t.shape = {static_cast<int64_t>(d.tokens.size()), R(), config_.moe.top_k};
      d.loss_fn_inputs["routed_experts"] = t;
    }
    return d;
  }

  std::vector<float> Logprobs(const std::vector<Datum>& data) {
    auto f = runner_->Forward(model_, data, "cross_entropy", {});
    EXPECT_TRUE(f.ok()) << f.status().message();
    std::vector<float> out;
    if (!f.ok()) return out;
    for (const DatumOutput& o : f->outputs)
      out.insert(out.end(), o.logprobs.begin(), o.logprobs.end());
    return out;
  }

  int64_t R() const { return config_.moe.RoutedLayers(); }

  std::unique_ptr<TempDir> dir_;
  ModelConfig config_;
  std::unique_ptr<ModelRunner> runner_;
  std::string model_;
  std::shared_ptr<const Policy> policy_;
};

const std::vector<int64_t> kPrompt = {5, 17, 99, 3, 64, 12, 7};

// The sampler's routes, sent back, give the trainer's logprobs to the bit (they are the routes it
// computes itself); one token's experts changed in one layer change the logprobs from that
// position on and leave every earlier one alone: the replayed routes are what the trainer uses.
TEST_P(RouterReplay, SampledRoutesAreTheTrainersAndAreUsedWhereSent) {
  const SampleResult result = Sample(kPrompt, 3);
  const int64_t P = static_cast<int64_t>(kPrompt.size()), k = config_.moe.top_k;
  ASSERT_EQ(static_cast<int64_t>(result.prompt_routed_experts.size()), P * R() * k);
  std::vector<Datum> recomputed, replayed;
  for (const SampledSequence& s : result.sequences) {
    const int64_t n = static_cast<int64_t>(s.tokens.size());
    ASSERT_EQ(static_cast<int64_t>(s.routed_experts.size()), (n - 1) * R() * k);
    std::vector<int64_t> routes = result.prompt_routed_experts;
    routes.insert(routes.end(), s.routed_experts.begin(), s.routed_experts.end());
    recomputed.push_back(Trajectory(kPrompt, s, {}));
    replayed.push_back(Trajectory(kPrompt, s, routes));
  }
  const std::vector<float> own = Logprobs(recomputed);
  EXPECT_EQ(Logprobs(replayed), own);

  // Control: token 9 of the first trajectory meets another expert in routed layer 1.
  std::vector<Datum> moved = {replayed[0]};
  std::vector<int64_t>& routes = moved[0].loss_fn_inputs["routed_experts"].int64_data;
  const int64_t token = 9, layer = 1;
  int64_t* row = routes.data() + (token * R() + layer) * k;
  int64_t other = 0;
  while (std::find(row, row + k, other) != row + k) ++other;
  row[0] = other;
  const std::vector<float> changed = Logprobs(moved);
  ASSERT_EQ(changed.size(), moved[0].tokens.size());
  for (int64_t t = 0; t < token; ++t) EXPECT_EQ(changed[t], own[t]) << "position " << t;
  EXPECT_NE(changed[token], own[token]);
}

// Training through replayed routes is exact under any split into calls (float64's promise), and
// its gradient is not the recomputed routes' one.
class RouterReplayExact : public RouterReplay {};

TEST_P(RouterReplayExact, ReplayedGradientsAreIndependentOfTheSplit) {
  const SampleResult result = Sample(kPrompt, 4);
  std::vector<Datum> data, recomputed;
  for (const SampledSequence& s : result.sequences) {
    std::vector<int64_t> routes = result.prompt_routed_experts;
    routes.insert(routes.end(), s.routed_experts.begin(), s.routed_experts.end());
    // Every token's first choice moved to the next expert not already chosen: routes the router
    // would not pick.
    const int64_t k = config_.moe.top_k, E = config_.moe.num_experts;
    for (size_t row = 0; row < routes.size(); row += k) {
      int64_t e = routes[row];
      do e = (e + 1) % E;
      while (std::find(routes.begin() + row, routes.begin() + row + k, e) !=
             routes.begin() + row + k);
      routes[row] = e;
    }
    data.push_back(Trajectory(kPrompt, s, routes));
    recomputed.push_back(Trajectory(kPrompt, s, {}));
  }
  CreateModelOptions o;
  o.lora = LoraConfig{4, 8, true, true, false};
  o.seed = 5;
  const std::string whole = *runner_->CreateModel(o), cut = *runner_->CreateModel(o),
                    control = *runner_->CreateModel(o);
  ASSERT_TRUE(runner_->ForwardBackward(whole, data, "cross_entropy", {}).ok());
  ASSERT_TRUE(runner_->ForwardBackward(cut, Slice(data, 0, 1), "cross_entropy", {}).ok());
  ASSERT_TRUE(runner_->ForwardBackward(cut, Slice(data, 1, 4), "cross_entropy", {}).ok());
  ASSERT_TRUE(runner_->ForwardBackward(control, recomputed, "cross_entropy", {}).ok());
  const auto want = Flat(Snap(*runner_, whole, StateKind::kGrads));
  const double scale = MaxAbs(want);
  ASSERT_GT(scale, 1e-6);
  EXPECT_LE(MaxAbsDiff(want, Flat(Snap(*runner_, cut, StateKind::kGrads))), kRelTol * scale);
  EXPECT_GT(MaxAbsDiff(want, Flat(Snap(*runner_, control, StateKind::kGrads))),
            1e3 * kRelTol * scale);
}

INSTANTIATE_TEST_SUITE_P(Float64, RouterReplayExact, ::testing::Values(ComputeDType::kFloat64),
                         [](const auto& info) {
                           return std::string(ComputeDTypeName(info.param));
                         });
INSTANTIATE_TEST_SUITE_P(Dtypes, RouterReplay,
                         ::testing::Values(ComputeDType::kFloat64, ComputeDType::kBFloat16),
                         [](const auto& info) {
                           return std::string(ComputeDTypeName(info.param));
                         });

// Each way a client can send routes wrong is refused naming routed_experts, before anything runs.
TEST(RouterReplayValidation, BadRoutesAreNamed) {
  TempDir dir;
  auto moe = MakeRunner(WriteModel(dir, TinyConfig("mixtral")));  // 4 experts, top 2, R = 2
  const ModelLimits limits = moe->limits();
  ASSERT_EQ(limits.routed_layers, 2);
  auto datum = [](std::vector<int64_t> routes, std::vector<int64_t> shape, bool floats = false) {
    Datum d;
    d.tokens = {1, 2};
    d.loss_fn_inputs["target_tokens"] = TensorData::Int64({2, 3});
    d.loss_fn_inputs["weights"] = TensorData::Float32({1.f, 1.f});
    TensorData t = floats ? TensorData::Float32(std::vector<float>(routes.size(), 0.f))
                          : TensorData::Int64(std::move(routes));
    t.shape = std::move(shape);
    d.loss_fn_inputs["routed_experts"] = t;
    return d;
  };
  const std::vector<int64_t> good = {0, 1, 2, 3, 1, 3, 0, 2};
  ASSERT_TRUE(Batch::Check({datum(good, {2, 2, 2})}, "cross_entropy", {}, limits).ok());
  Datum plain = datum(good, {2, 2, 2});
  plain.loss_fn_inputs.erase("routed_experts");
  for (const auto& [data, why] : std::vector<std::pair<std::vector<Datum>, std::string>>{
           {{datum(good, {2, 2, 2}, true)}, "int64"},
           {{datum(good, {2, 4})}, "shape"},
           {{datum({0, 1, 2, 3, 1, 3, 0, 2, 0, 1, 2, 3}, {2, 3, 2})}, "shape"},
           {{datum({0, 1, 2, 3, 1, 3, 0, 4}, {2, 2, 2})}, "outside [0, 4)"},
           {{datum({0, 1, 2, 3, 1, 3, -1, 2}, {2, 2, 2})}, "outside [0, 4)"},
           {{datum({0, 1, 2, 3, 1, 1, 0, 2}, {2, 2, 2})}, "appears twice"},
           {{datum(good, {2, 2, 2}), plain}, "or none does"}}) {
    auto b = Batch::Check(data, "cross_entropy", {}, limits);
    EXPECT_EQ(b.status().code(), absl::StatusCode::kInvalidArgument) << why;
    EXPECT_NE(b.status().message().find("routed_experts"), std::string::npos) << b.status();
    EXPECT_NE(b.status().message().find(why), std::string::npos) << b.status();
  }
  TempDir dense_dir;
  auto dense = MakeRunner(WriteModel(dense_dir, TinyConfig("llama")));
  auto b = Batch::Check({datum(good, {2, 2, 2})}, "cross_entropy", {}, dense->limits());
  EXPECT_NE(b.status().message().find("routes no experts"), std::string::npos) << b.status();
  SampleRequest r;
  r.prompt = {1, 2};
  r.routed_experts = true;
  const absl::Status st = ValidateSampleRequest(r, dense->limits(), SampleLimits{});
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("routed_experts"), std::string::npos) << st;
  EXPECT_TRUE(ValidateSampleRequest(r, moe->limits(), SampleLimits{}).ok());
}

}  // namespace
}  // namespace tinkerd::testing
