// Batched multi-adapter training (runner/joint_call.h): LoRA models of one base trained in shared
// passes get what they get alone.
//
// Twins: each model has a twin of the same seed and warm step. One twin of every model trains
// alone (ForwardBackward per model), the other together (ForwardBackwardJoint). Their outputs,
// counts, loss sums, gradient sums and, after an optimizer step, parameters must agree:
//   - bitwise in float32 and bfloat16 on the CPU: a call is planned into the same micro-batches as
//     alone, each adapter's products run over the same rows, and the base products, attention,
//     norms and the logprob head are row-invariant there (docs/kernels.md), so every value is
//     formed by the same operations on the same operands (float32's products, forward and
//     backward, are Gemv's, on CPUs with AVX2 or AVX-512: CpuFloat32RoundsByRows skips its cases
//     elsewhere);
//   - in float64 always to 1e-12 relative (the bound; the same argument gives equality).
// The broken control sends one token's rows to its neighbour's adapter: that token's gradient
// reaches the wrong model, and the comparison must see it (O(1e-2) relative, against 1e-12).
#include <gtest/gtest.h>

#include "runner/dist/collectives.h"
#include "runner/joint_call.h"
#include "runner/loss/loss_spec.h"
#include "runner/model/tiny_model.h"
#include "runner/model_state.h"
#include "runner/train_step.h"
#include "tests/test_util.h"

namespace tinkerd::testing {
namespace {

constexpr double kRelTol = 1e-12;

struct Tenant {
  std::string loss;
  LossReduction mode;
  LoraConfig lora;  // rank, alpha, attn, mlp, unembed
  std::vector<int> lengths;
};

// Different ranks, targets, losses and reductions; calls of one to several micro-batches.
const std::vector<Tenant> kTenants = {
    {"cross_entropy", LossReduction::kTokenMean, {4, 8, true, true, true}, {9, 14, 3}},
    {"ppo", LossReduction::kSum, {2, 4, true, false, false}, {21}},
    {"importance_sampling", LossReduction::kSeqMeanTokenMean, {8, 16, false, true, true}, {5, 6}},
    {"gspo", LossReduction::kSeqMeanTokenSum, {4, 4, true, true, false}, {30, 7, 11, 2}},
};

std::map<std::string, double> ConfigFor(const std::string& loss) {
  if (loss == "ppo" || loss == "gspo") {
    return {{"clip_low_threshold", 0.9}, {"clip_high_threshold", 1.1}};
  }
  return {};
}

std::string WarmModel(ModelRunner& r, const Tenant& t, uint64_t seed) {
  CreateModelOptions o;
  o.loss_reduction = t.mode;
  o.seed = seed;
  o.lora = t.lora;
  auto id = r.CreateModel(o);
  EXPECT_TRUE(id.ok()) << id.status().message();
  SplitMix64 g(seed);
  EXPECT_TRUE(
      r.ForwardBackward(*id, RandomData(g, {6, 10}, "cross_entropy", 128), "cross_entropy", {})
          .ok());
  AdamParams p;
  p.learning_rate = 0.05;
  EXPECT_TRUE(r.OptimStep(*id, p).ok());
  return *id;
}

// Whether two value lists agree: bitwise (tolerance 0), or within rel_tol of `scale`.
void ExpectAgree(const std::vector<double>& want, const std::vector<double>& got, double rel_tol,
                 const std::string& what) {
  ASSERT_EQ(want.size(), got.size()) << what;
  const double scale = MaxAbs(want);
  ASSERT_GT(scale, 0) << what << " vanished: the comparison would be vacuous";
  if (rel_tol == 0) {
    size_t differ = 0;
    for (size_t i = 0; i < want.size(); ++i) differ += want[i] != got[i];
    EXPECT_EQ(differ, 0u) << what << ": " << differ << " of " << want.size()
                          << " values differ, max " << MaxAbsDiff(want, got) / scale;
  } else {
    EXPECT_LE(MaxAbsDiff(want, got), rel_tol * scale) << what;
  }
}

std::vector<double> Logprobs(const ForwardBackwardResult& r) {
  std::vector<double> v;
  for (const auto& o : r.outputs) v.insert(v.end(), o.logprobs.begin(), o.logprobs.end());
  return v;
}

struct JointCase {
  ComputeDType dtype;
  bool checkpointing;
  int64_t micro_batch_tokens;
  std::string family = "qwen3";  // a mixture of experts routes each model's rows apart
};

class AloneVsTogether : public ::testing::TestWithParam<JointCase> {};

TEST_P(AloneVsTogether, EachModelGetsWhatItGetsAlone) {
  const JointCase c = GetParam();
  if (c.dtype == ComputeDType::kFloat32 && CpuFloat32RoundsByRows()) {
    GTEST_SKIP() << "float32 gradients are bitwise only where the BLAS's products are "
                    "row-invariant; the float64 cases hold everywhere";
  }
  TempDir dir;
  const std::string model = WriteModel(dir, TinyConfig(c.family));
  RunnerConfig rc;
  rc.base_model_path = model;
  rc.compute_dtype = c.dtype;
  rc.micro_batch_tokens = c.micro_batch_tokens;
  rc.activation_checkpointing = c.checkpointing;
  rc.device = TestDevice();
  auto made = ModelRunner::Create(rc);
  ASSERT_TRUE(made.ok()) << made.status().message();
  ModelRunner& r = **made;
  const double tol = c.dtype == ComputeDType::kFloat64 ? kRelTol : 0.0;

  std::vector<std::string> alone, together;
  for (size_t k = 0; k < kTenants.size(); ++k) {
    alone.push_back(WarmModel(r, kTenants[k], 100 + k));
    together.push_back(WarmModel(r, kTenants[k], 100 + k));
  }
  // Two rounds: forward_backward per model, then a step each; the second round starts from the
  // stepped adapters.
  SplitMix64 g(5);
  for (int round = 0; round < 2; ++round) {
    std::vector<Batch> batches;
    for (const Tenant& t : kTenants) {
      auto b = Batch::Check(RandomData(g, t.lengths, t.loss, 128), t.loss, ConfigFor(t.loss),
                            r.limits());
      ASSERT_TRUE(b.ok()) << b.status().message();
      batches.push_back(*std::move(b));
    }
    std::vector<ModelRunner::Call> calls;
    for (size_t k = 0; k < kTenants.size(); ++k) calls.push_back({together[k], &batches[k]});
    auto joint = r.ForwardBackwardJoint(calls, /*backward=*/true);
    ASSERT_EQ(joint.size(), kTenants.size());
    for (size_t k = 0; k < kTenants.size(); ++k) {
      const std::string what = absl::StrCat("round ", round, " model ", k);
      auto solo = r.ForwardBackward(alone[k], batches[k]);
      ASSERT_TRUE(solo.ok()) << solo.status().message();
      ASSERT_TRUE(joint[k].ok()) << what << ": " << joint[k].status().message();
      ExpectAgree(Logprobs(*solo), Logprobs(*joint[k]), tol, what + " logprobs");
      for (const char* m : {"loss:sum", "num_tokens:sum", "num_sequences:sum"}) {
        ExpectAgree({solo->metrics.at(m)}, {joint[k]->metrics.at(m)}, tol, what + " " + m);
      }
      ExpectAgree(Flat(Snap(r, alone[k], StateKind::kGrads)),
                  Flat(Snap(r, together[k], StateKind::kGrads)), tol, what + " gradient sums");
    }
    // The steps: alone, and together in one OptimStepJoint, two models sharing a learning rate
    // (one AdamW over both) and the others their own; one clips.
    std::vector<ModelRunner::Step> steps;
    for (size_t k = 0; k < kTenants.size(); ++k) {
      AdamParams p;
      p.learning_rate = k < 2 ? 0.02 : 0.01 * static_cast<double>(k);
      p.weight_decay = k == 3 ? 0.1 : 0.0;
      p.grad_clip_norm = k == 2 ? 1e-3 : 0.0;
      auto want = r.OptimStep(alone[k], p);
      ASSERT_TRUE(want.ok()) << want.status().message();
      steps.push_back({together[k], p});
    }
    auto stepped = r.OptimStepJoint(steps);
    ASSERT_EQ(stepped.size(), kTenants.size());
    for (size_t k = 0; k < kTenants.size(); ++k) {
      const std::string what = absl::StrCat("round ", round, " model ", k);
      ASSERT_TRUE(stepped[k].ok()) << what << ": " << stepped[k].status().message();
      EXPECT_EQ(stepped[k]->step, round + 2);  // after the warm step
      ExpectAgree(Flat(Snap(r, alone[k], StateKind::kParams)),
                  Flat(Snap(r, together[k], StateKind::kParams)), tol, what + " parameters");
      ExpectAgree(Flat(Snap(r, alone[k], StateKind::kAdamExpAvgSq)),
                  Flat(Snap(r, together[k], StateKind::kAdamExpAvgSq)), tol, what + " moments");
      EXPECT_EQ(r.GetInfo(together[k])->accumulated_tokens, 0);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, AloneVsTogether,
                         ::testing::Values(JointCase{ComputeDType::kFloat64, false, 24},
                                           JointCase{ComputeDType::kFloat64, true, 40},
                                           JointCase{ComputeDType::kFloat32, false, 24},
                                           JointCase{ComputeDType::kFloat32, true, 64},
                                           JointCase{ComputeDType::kBFloat16, false, 32},
                                           JointCase{ComputeDType::kFloat64, false, 40, "mixtral"},
                                           JointCase{ComputeDType::kFloat32, true, 40, "qwen3_moe"},
                                           JointCase{ComputeDType::kFloat64, true, 40, "qwen3_moe"},
                                           JointCase{ComputeDType::kBFloat16, false, 32,
                                                     "mixtral"}),
                         [](const auto& info) {
                           const JointCase& c = info.param;
                           return absl::StrCat(c.dtype == ComputeDType::kFloat64   ? "f64"
                                               : c.dtype == ComputeDType::kFloat32 ? "f32"
                                                                                   : "bf16",
                                               c.checkpointing ? "_checkpointed" : "", "_mb",
                                               c.micro_batch_tokens,
                                               c.family == "qwen3" ? "" : "_" + c.family);
                         });

// A call that fails alone fails in the joint call too, and the others are untouched by it.
TEST(JointCall, OneCallsFailureIsItsOwn) {
  TempDir dir;
  auto r = MakeRunner(WriteModel(dir, TinyConfig("llama")), ComputeDType::kFloat64, 32);
  const std::string a = WarmModel(*r, kTenants[0], 1), b = WarmModel(*r, kTenants[0], 1);
  SplitMix64 g(3);
  auto batch =
      Batch::Check(RandomData(g, {12, 5}, "cross_entropy", 128), "cross_entropy", {}, r->limits());
  ASSERT_TRUE(batch.ok());
  auto results = r->ForwardBackwardJoint({{"model-gone", &*batch}, {a, &*batch}}, true);
  ASSERT_EQ(results.size(), 2u);
  EXPECT_EQ(results[0].status().code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(results[1].ok()) << results[1].status().message();
  ASSERT_TRUE(r->ForwardBackward(b, *batch).ok());
  ExpectAgree(Flat(Snap(*r, b, StateKind::kGrads)), Flat(Snap(*r, a, StateKind::kGrads)), kRelTol,
              "the surviving call");
  // A step that fails alone fails together, and the other step is taken.
  AdamParams bad;
  bad.learning_rate = -1;
  AdamParams good;
  good.learning_rate = 0.01;
  auto stepped = r->OptimStepJoint({{a, bad}, {b, good}});
  EXPECT_EQ(stepped[0].status().code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(stepped[1].ok()) << stepped[1].status().message();
  EXPECT_EQ(r->GetInfo(a)->step, 1);
  EXPECT_EQ(r->GetInfo(b)->step, 2);
  // A model twice in one joint call: both calls apply, in order.
  results = r->ForwardBackwardJoint({{a, &*batch}, {a, &*batch}}, true);
  ASSERT_TRUE(results[0].ok() && results[1].ok());
  // a kept its first call's sum (its step was refused), so it holds three calls' tokens now.
  EXPECT_EQ(r->GetInfo(a)->accumulated_tokens,
            3 * static_cast<int64_t>(results[0]->metrics.at("num_tokens:sum")));
}

// Calls that set the router's auxiliary loss (runner/loss/router_aux.h, counted per pass over one
// call's datums) are not joined: each runs alone and gets what it gets alone, bitwise, while the
// calls without it still share their passes.
TEST(JointCall, CallsWithTheRoutersLossRunAlone) {
  TempDir dir;
  auto r = MakeRunner(WriteModel(dir, TinyConfig("qwen3_moe")), ComputeDType::kFloat64, 32);
  const std::string a = WarmModel(*r, kTenants[0], 1), b = WarmModel(*r, kTenants[0], 1);
  const std::string c = WarmModel(*r, kTenants[0], 1);
  SplitMix64 g(5);
  const auto data = RandomData(g, {12, 5, 9}, "cross_entropy", 128);
  auto aux = Batch::Check(data, "cross_entropy", {{"router_aux_loss_coef", 0.1}}, r->limits());
  ASSERT_TRUE(aux.ok()) << aux.status().message();
  auto results = r->ForwardBackwardJoint({{a, &*aux}, {b, &*aux}}, true);
  ASSERT_TRUE(results[0].ok()) << results[0].status().message();
  ASSERT_TRUE(results[1].ok()) << results[1].status().message();
  ASSERT_TRUE(r->ForwardBackward(c, *aux).ok());
  const auto alone = Flat(Snap(*r, c, StateKind::kGrads));
  EXPECT_EQ(Flat(Snap(*r, a, StateKind::kGrads)), alone);
  EXPECT_EQ(Flat(Snap(*r, b, StateKind::kGrads)), alone);
  EXPECT_GT(results[0]->metrics.at("router_aux_loss:sum"), 0);
}

// The passes keep every call's micro-batches in order, one per call per pass, within the budget.
TEST(JointCall, PassesKeepOrderAndBudget) {
  const std::vector<std::vector<int64_t>> tokens = {{10, 30, 5}, {40}, {20, 20}, {}};
  const auto passes = PlanPasses(tokens, 40);
  std::vector<int> next(tokens.size(), 0);
  for (const auto& pass : passes) {
    int64_t used = 0;
    std::set<int> calls;
    for (auto [call, mb] : pass) {
      EXPECT_EQ(mb, next[call]++) << "call " << call << " out of order";
      EXPECT_TRUE(calls.insert(call).second) << "call " << call << " twice in a pass";
      used += tokens[call][mb];
    }
    EXPECT_TRUE(used <= 40 || pass.size() == 1) << used << " tokens in a shared pass";
  }
  for (size_t c = 0; c < tokens.size(); ++c) EXPECT_EQ(next[c], tokens[c].size());
  EXPECT_LT(passes.size(), 6u) << "no pass was shared";
}

// The broken control, on the stages themselves: in a shared micro-batch of two models, the
// first model's last token is given the second model's adapter.
TEST(JointCall, ATokenSentToItsNeighboursAdapterIsSeen) {
  const ModelConfig config = TinyConfig("llama");
  TinyModelSpec spec;
  spec.config = config;
  spec.seed = 1;
  auto tensors = GenerateTinyWeights(spec);
  ASSERT_TRUE(tensors.ok());
  auto base = BaseWeightsFromTensors(config, *tensors);
  ASSERT_TRUE(base.ok()) << base.status().message();
  auto collectives = MakeLocalCollectives();
  StepContext ctx{&config, &*base, collectives.get(), at::kDouble, at::kCPU, 64, {}, nullptr};
  auto make = [&](uint64_t seed) {
    at::manual_seed(seed);
    ModelState m;
    m.options.lora = LoraConfig{4, 8, true, true, true};
    m.lora = *LoraAdapter::Create(config, *m.options.lora, seed, at::kDouble, at::kCPU);
    m.params = m.lora->Parameters();
    for (const auto& [name, p] : m.params) {
      // A non-zero B, so that a token's adapter changes its logprob and every gradient.
      if (name.find("lora_B") != std::string::npos) {
        p.detach().copy_(at::randn(p.sizes(), at::TensorOptions().dtype(at::kDouble)) * 0.1);
      }
      m.grad_sum[name] = at::zeros_like(p).set_requires_grad(false);
    }
    return m;
  };
  SplitMix64 g(9);
  const auto data0 = RandomData(g, {7, 5}, "cross_entropy", 128);
  const auto data1 = RandomData(g, {9}, "cross_entropy", 128);
  auto loss = ResolveLoss("cross_entropy", {});
  ASSERT_TRUE(loss.ok());

  // Returns the first model's gradient after one shared micro-batch; `shift` rows of the first
  // piece go to the second piece's adapter.
  auto run = [&](int64_t shift) {
    ModelState m0 = make(1), m1 = make(2);
    CallStage s0(ctx, m0, *loss, true), s1(ctx, m1, *loss, true);
    auto p0 = s0.Plan(data0), p1 = s1.Plan(data1);
    EXPECT_EQ(p0.size(), 1u);
    EXPECT_EQ(p1.size(), 1u);
    PackedPieces packed = Pack({{&s0, p0[0]}, {&s1, p1[0]}});
    packed.adapters.runs[0].second -= shift;
    packed.adapters.runs[1].second += shift;
    RunPacked(packed);
    EXPECT_TRUE(s0.Commit(absl::OkStatus()).ok());
    std::vector<double> v;
    for (const auto& [name, t] : m0.grad_sum) {
      const at::Tensor f = t.contiguous();
      v.insert(v.end(), f.data_ptr<double>(), f.data_ptr<double>() + f.numel());
    }
    return v;
  };
  // The honest pass against the first model alone.
  ModelState solo = make(1);
  CallStage s(ctx, solo, *loss, true);
  s.Run(data0);
  ASSERT_TRUE(s.Commit(absl::OkStatus()).ok());
  std::vector<double> want;
  for (const auto& [name, t] : solo.grad_sum) {
    want.insert(want.end(), t.data_ptr<double>(), t.data_ptr<double>() + t.numel());
  }
  const std::vector<double> honest = run(0), broken = run(1);
  ExpectAgree(want, honest, kRelTol, "the shared pass");
  EXPECT_GT(MaxAbsDiff(want, broken), 1e6 * kRelTol * MaxAbs(want))
      << "a token on its neighbour's adapter went unseen: this test cannot see misrouting";
}

}  // namespace
}  // namespace tinkerd::testing
