// Exactness of gradient accumulation (DESIGN.md §3): however a logical batch is split into calls
// and micro-batches, the normalized gradient OptimStep applies equals one pass over the batch.
//
// Everything runs in float64. Tolerance: a gradient element is a sum of at most
// n = tokens × hidden × layers ≈ 80 × 32 × 2 ≈ 5e3 products, each carried through a forward of
// depth ~20 ops; reassociating that sum (different splits) moves it by at most about
// n · depth · ε64 ≈ 5e3 · 20 · 1.1e-16 ≈ 1.1e-11 relative to the largest gradient element.
// We use kRelTol = 1e-10 (≈10× that bound). The broken controls differ by O(1e-1) relative.
#include <gtest/gtest.h>

#include "tests/test_util.h"

namespace tinkerd::testing {
namespace {

constexpr double kRelTol = 1e-10;

// cross_entropy_topk: cross_entropy with [T, K] targets and weights (RandomTopKData).
const std::vector<std::string> kLosses = {
    "cross_entropy", "cross_entropy_topk", "importance_sampling", "ppo", "cispo", "dro", "gspo"};
const std::vector<LossReduction> kModes = {LossReduction::kTokenMean, LossReduction::kSum,
                                           LossReduction::kSeqMeanTokenMean,
                                           LossReduction::kSeqMeanTokenSum};

std::map<std::string, double> ConfigFor(const std::string& loss) {
  if (loss == "dro") return {{"beta", 0.3}};
  if (loss == "ppo" || loss == "gspo") {
    return {{"clip_low_threshold", 0.9}, {"clip_high_threshold", 1.1}};
  }
  return {};
}

// The denominator the test expects for a mode, computed from the counters independently.
double Denominator(LossReduction mode, double tokens, double sequences) {
  switch (mode) {
    case LossReduction::kTokenMean:
      return tokens;
    case LossReduction::kSum:
      return 1.0;
    default:
      return sequences;
  }
}

// A model whose adapter already moved one step, so that every LoRA matrix gets a non-zero grad.
std::string WarmModel(ModelRunner& r, LossReduction mode, SplitMix64& g) {
  CreateModelOptions o;
  o.loss_reduction = mode;
  o.seed = 7;
  o.lora = LoraConfig{4, 8, true, true, true};
  auto id = r.CreateModel(o);
  EXPECT_TRUE(id.ok());
  auto warm = RandomData(g, {5, 9}, "cross_entropy", 128);
  EXPECT_TRUE(r.ForwardBackward(*id, warm, "cross_entropy", {}).ok());
  AdamParams p;
  p.learning_rate = 0.05;
  EXPECT_TRUE(r.OptimStep(*id, p).ok());
  return *id;
}

struct SplitCase {
  std::string loss;
  LossReduction mode;
};

class SplitVsCombined : public ::testing::TestWithParam<SplitCase> {};

TEST_P(SplitVsCombined, NormalizedGradientIndependentOfCallSplit) {
  const auto [loss, mode] = GetParam();
  TempDir dir;
  const std::string model = WriteModel(dir, TinyConfig("llama"));
  auto runner = MakeRunner(model, ComputeDType::kFloat64, /*micro_batch_tokens=*/24);
  SplitMix64 g(11);
  const std::string combined_id = WarmModel(*runner, mode, g);
  SplitMix64 g2(11);
  const std::string split_id = WarmModel(*runner, mode, g2);  // identical state

  // Strongly unequal lengths; the split puts 1, 3 and 2 datums into three calls.
  const std::vector<int> lengths = {2, 31, 5, 17, 3, 24};
  const bool topk = loss == "cross_entropy_topk";
  auto data = topk ? RandomTopKData(g, lengths, 3, 128) : RandomData(g, lengths, loss, 128);
  const auto cfg = ConfigFor(loss);
  const std::string loss_fn = topk ? "cross_entropy" : loss;
  auto all = runner->ForwardBackward(combined_id, data, loss_fn, cfg);
  ASSERT_TRUE(all.ok()) << all.status().message();

  std::vector<std::pair<size_t, size_t>> calls = {{0, 1}, {1, 4}, {4, 6}};
  std::vector<double> previous = Flat(Snap(*runner, split_id, StateKind::kGrads));
  std::vector<double> broken(previous.size(), 0.0);  // Σ_c g_c / D_c: a per-call local denominator
  double loss_sum = 0;
  for (auto [b, e] : calls) {
    auto r = runner->ForwardBackward(split_id, Slice(data, b, e), loss_fn, cfg);
    ASSERT_TRUE(r.ok()) << r.status().message();
    loss_sum += r->metrics.at("loss:sum");
    const auto now = Flat(Snap(*runner, split_id, StateKind::kGrads));
    const double local =
        Denominator(mode, r->metrics.at("num_tokens:sum"), r->metrics.at("num_sequences:sum"));
    for (size_t k = 0; k < now.size(); ++k)
      broken[k] += (now[k] - previous[k]) / local / calls.size();
    previous = now;
  }
  auto info_all = runner->GetInfo(combined_id);
  auto info_split = runner->GetInfo(split_id);
  EXPECT_EQ(info_all->accumulated_tokens, info_split->accumulated_tokens);
  EXPECT_EQ(info_all->accumulated_sequences, info_split->accumulated_sequences);
  EXPECT_NEAR(loss_sum, all->metrics.at("loss:sum"), 1e-10 * std::max(1.0, std::abs(loss_sum)));

  const double denom =
      Denominator(mode, info_all->accumulated_tokens, info_all->accumulated_sequences);
  const auto want = Scaled(Flat(Snap(*runner, combined_id, StateKind::kGrads)), 1.0 / denom);
  const auto got = Scaled(Flat(Snap(*runner, split_id, StateKind::kGrads)), 1.0 / denom);
  const double scale = MaxAbs(want);
  ASSERT_GT(scale, 1e-6) << "gradient vanished: the comparison would be vacuous";
  EXPECT_LE(MaxAbsDiff(want, got), kRelTol * scale);
  // Broken control: normalizing per call must be detectably wrong (not for `sum`, which has no
  // denominator to get wrong).
  if (mode != LossReduction::kSum) {
    EXPECT_GT(MaxAbsDiff(want, broken), 1e3 * kRelTol * scale)
        << "the per-call-denominator control agreed: this test cannot see normalization bugs";
  }

  // Both models then take the same step: parameters, norm and moments must agree too.
  auto s1 = runner->OptimStep(combined_id, AdamParams{});
  auto s2 = runner->OptimStep(split_id, AdamParams{});
  ASSERT_TRUE(s1.ok() && s2.ok());
  EXPECT_NEAR(s1->grad_norm, s2->grad_norm, kRelTol * s1->grad_norm);
  EXPECT_DOUBLE_EQ(s1->denominator, denom);
  const auto p1 = Flat(Snap(*runner, combined_id, StateKind::kParams));
  const auto p2 = Flat(Snap(*runner, split_id, StateKind::kParams));
  // AdamW's first-moment update is lr·g/|g| per element at most: differences of kRelTol in g
  // relative move parameters by at most lr·kRelTol·(a few) — bounded by 1e-12 here.
  EXPECT_LE(MaxAbsDiff(p1, p2), 1e-12);
}

std::vector<SplitCase> AllCases() {
  std::vector<SplitCase> v;
  for (const auto& l : kLosses)
    for (auto m : kModes) v.push_back({l, m});
  return v;
}

INSTANTIATE_TEST_SUITE_P(AllLossesAllModes, SplitVsCombined, ::testing::ValuesIn(AllCases()),
                         [](const auto& info) {
                           return info.param.loss + "_" +
                                  std::string(LossReductionName(info.param.mode));
                         });

// Top-K cross_entropy, −Σ_t Σ_k w_tk·logp_tk, is linear in its columns: one [T, K] call equals K
// one-target calls, one per column (under `sum`, where the token count does not enter), in the
// gradient and, bit for bit, in each column's logprobs. The control is a kernel that backpropagates
// column 0 alone: the first column's call by itself.
TEST(TopKCrossEntropy, EqualsTheSumOfItsColumns) {
  TempDir dir;
  const std::string model = WriteModel(dir, TinyConfig("qwen3"));
  auto runner = MakeRunner(model, ComputeDType::kFloat64, /*micro_batch_tokens=*/24);
  const int64_t K = 4;
  SplitMix64 g(17);
  const auto data = RandomTopKData(g, {9, 30, 4, 13}, K, 128);
  SplitMix64 ga(5), gb(5), gc(5);
  const std::string whole = WarmModel(*runner, LossReduction::kSum, ga);
  const std::string columns = WarmModel(*runner, LossReduction::kSum, gb);
  const std::string first = WarmModel(*runner, LossReduction::kSum, gc);
  auto all = runner->ForwardBackward(whole, data, "cross_entropy", {});
  ASSERT_TRUE(all.ok()) << all.status().message();
  double loss_sum = 0;
  for (int64_t k = 0; k < K; ++k) {
    auto col = runner->ForwardBackward(columns, TopKColumn(data, k), "cross_entropy", {});
    ASSERT_TRUE(col.ok()) << col.status().message();
    loss_sum += col->metrics.at("loss:sum");
    for (size_t i = 0; i < data.size(); ++i) {
      const auto& got = all->outputs[i];
      ASSERT_EQ(got.logprobs_shape,
                (std::vector<int64_t>{static_cast<int64_t>(data[i].tokens.size()), K}));
      for (size_t t = 0; t < data[i].tokens.size(); ++t) {
        ASSERT_EQ(got.logprobs[t * K + k], col->outputs[i].logprobs[t])
            << i << " " << t << " " << k;
      }
    }
  }
  ASSERT_TRUE(runner->ForwardBackward(first, TopKColumn(data, 0), "cross_entropy", {}).ok());
  EXPECT_NEAR(all->metrics.at("loss:sum"), loss_sum, 1e-10 * std::abs(loss_sum));
  // Valid positions count once however many targets they hold: the completion rows.
  int64_t valid = 0;
  for (const Datum& d : data) valid += static_cast<int64_t>(d.tokens.size() - d.tokens.size() / 4);
  EXPECT_EQ(all->metrics.at("num_tokens:sum"), static_cast<double>(valid));

  const auto want = Flat(Snap(*runner, columns, StateKind::kGrads));
  const auto got = Flat(Snap(*runner, whole, StateKind::kGrads));
  const double scale = MaxAbs(want);
  ASSERT_GT(scale, 1e-6);
  EXPECT_LE(MaxAbsDiff(want, got), kRelTol * scale);
  EXPECT_GT(MaxAbsDiff(Flat(Snap(*runner, first, StateKind::kGrads)), got), 1e3 * kRelTol * scale);
}

TEST(MicroBatching, TokenBudgetDoesNotChangeGradients) {
  TempDir dir;
  const std::string model = WriteModel(dir, TinyConfig("qwen3"));
  SplitMix64 g(3);
  auto data = RandomData(g, {40, 3, 9, 1, 22, 7, 13}, "ppo", 128);
  std::vector<std::vector<double>> grads;
  std::vector<std::vector<float>> logprobs;
  // Budget 1: every datum alone. 20: several packed micro-batches. 1e6: everything in one.
  for (int64_t budget : {int64_t{1}, int64_t{20}, int64_t{1000000}}) {
    auto r = MakeRunner(model, ComputeDType::kFloat64, budget);
    SplitMix64 gw(5);
    const std::string id = WarmModel(*r, LossReduction::kTokenMean, gw);
    auto out = r->ForwardBackward(id, data, "ppo", {});
    ASSERT_TRUE(out.ok()) << out.status().message();
    grads.push_back(Flat(Snap(*r, id, StateKind::kGrads)));
    logprobs.push_back(out->outputs[3].logprobs);
  }
  const double scale = MaxAbs(grads[0]);
  ASSERT_GT(scale, 1e-6);
  EXPECT_LE(MaxAbsDiff(grads[0], grads[1]), kRelTol * scale);
  EXPECT_LE(MaxAbsDiff(grads[0], grads[2]), kRelTol * scale);
  EXPECT_EQ(logprobs[0].size(), 1u);  // outputs come back in the caller's order
}

TEST(Packing, PackedEqualsEachSequenceAlone) {
  TempDir dir;
  ModelConfig cfg = TinyConfig("mistral");
  cfg.sliding_window = 6;
  const std::string model = WriteModel(dir, cfg);
  auto r = MakeRunner(model, ComputeDType::kFloat64, /*micro_batch_tokens=*/1000000);
  SplitMix64 g(8), gw(9), gw2(9);
  const std::string packed = WarmModel(*r, LossReduction::kSum, gw);
  const std::string alone = WarmModel(*r, LossReduction::kSum, gw2);
  auto data = RandomData(g, {12, 1, 30, 4, 17}, "cross_entropy", 128);
  auto all = r->ForwardBackward(packed, data, "cross_entropy", {});
  ASSERT_TRUE(all.ok());
  for (size_t i = 0; i < data.size(); ++i) {
    auto one = r->ForwardBackward(alone, Slice(data, i, i + 1), "cross_entropy", {});
    ASSERT_TRUE(one.ok());
    ASSERT_EQ(one->outputs[0].logprobs.size(), all->outputs[i].logprobs.size());
    for (size_t t = 0; t < one->outputs[0].logprobs.size(); ++t) {
      // float32 outputs of the same f64 value: equal up to one float32 rounding (2^-24 relative).
      EXPECT_NEAR(one->outputs[0].logprobs[t], all->outputs[i].logprobs[t],
                  2 * 6e-8 * std::abs(all->outputs[i].logprobs[t]));
    }
  }
  const auto a = Flat(Snap(*r, packed, StateKind::kGrads));
  const auto b = Flat(Snap(*r, alone, StateKind::kGrads));
  EXPECT_LE(MaxAbsDiff(a, b), kRelTol * MaxAbs(a));

  // Control: the same datums fused into ONE sequence (attention crossing boundaries) differ.
  Datum fused;
  std::vector<int64_t> tg;
  std::vector<float> w;
  for (const Datum& d : data) {
    fused.tokens.insert(fused.tokens.end(), d.tokens.begin(), d.tokens.end());
    const auto& t = d.loss_fn_inputs.at("target_tokens").int64_data;
    const auto& ww = d.loss_fn_inputs.at("weights").float32_data;
    tg.insert(tg.end(), t.begin(), t.end());
    w.insert(w.end(), ww.begin(), ww.end());
  }
  fused.loss_fn_inputs["target_tokens"] = TensorData::Int64(tg);
  fused.loss_fn_inputs["weights"] = TensorData::Float32(w);
  auto f = r->Forward(packed, {fused}, "cross_entropy", {});
  ASSERT_TRUE(f.ok());
  // Fused position 13 is datum 2's first token; its window of 6 reaches into datums 0 and 1.
  EXPECT_GT(std::abs(f->outputs[0].logprobs[13] - all->outputs[2].logprobs[0]), 1e-4);
}

TEST(ZeroWeights, CallWithAllZeroWeightsIsBitExactNoOp) {
  TempDir dir;
  const std::string model = WriteModel(dir, TinyConfig("llama"));
  for (ComputeDType dt : {ComputeDType::kFloat32, ComputeDType::kFloat64}) {
    auto r = MakeRunner(model, dt, 16);
    SplitMix64 g(4), gw(2);
    const std::string id = WarmModel(*r, LossReduction::kTokenMean, gw);
    ASSERT_TRUE(
        r->ForwardBackward(id, RandomData(g, {9, 14}, "cross_entropy", 128), "cross_entropy", {})
            .ok());
    const auto before = Flat(Snap(*r, id, StateKind::kGrads));
    const auto info_before = *r->GetInfo(id);
    auto zero = RandomData(g, {20, 3, 11}, "cross_entropy", 128);
    for (Datum& d : zero) {
      for (float& w : d.loss_fn_inputs["weights"].float32_data) w = 0.0f;
    }
    auto out = r->ForwardBackward(id, zero, "cross_entropy", {});
    ASSERT_TRUE(out.ok());
    EXPECT_EQ(out->metrics.at("num_tokens:sum"), 0.0);
    EXPECT_EQ(Flat(Snap(*r, id, StateKind::kGrads)), before);  // bit-exact
    EXPECT_EQ(r->GetInfo(id)->accumulated_tokens, info_before.accumulated_tokens);
    EXPECT_EQ(r->GetInfo(id)->accumulated_sequences, info_before.accumulated_sequences);
  }
}

TEST(Isolation, OneModelsBatchDoesNotTouchAnother) {
  TempDir dir;
  const std::string model = WriteModel(dir, TinyConfig("qwen2"));
  auto r = MakeRunner(model);
  SplitMix64 g(1), gw(6), gw2(7);
  const std::string a = WarmModel(*r, LossReduction::kTokenMean, gw);
  const std::string b = WarmModel(*r, LossReduction::kSum, gw2);
  const auto params_b = Flat(Snap(*r, b, StateKind::kParams));
  const auto grads_b = Flat(Snap(*r, b, StateKind::kGrads));
  ASSERT_TRUE(
      r->ForwardBackward(a, RandomData(g, {8, 12}, "dro", 128), "dro", {{"beta", 0.1}}).ok());
  ASSERT_TRUE(r->OptimStep(a, AdamParams{}).ok());
  EXPECT_EQ(Flat(Snap(*r, b, StateKind::kParams)), params_b);
  EXPECT_EQ(Flat(Snap(*r, b, StateKind::kGrads)), grads_b);
  EXPECT_EQ(r->GetInfo(b)->accumulated_tokens, 0);
  EXPECT_NE(Flat(Snap(*r, a, StateKind::kParams)), Flat(Snap(*r, b, StateKind::kParams)));
}

TEST(FullFineTuning, SplitEqualsCombined) {
  TempDir dir;
  const std::string model = WriteModel(dir, TinyConfig("qwen3"));
  auto r = MakeRunner(model, ComputeDType::kFloat64, 16);
  CreateModelOptions o;
  o.lora.reset();
  auto a = r->CreateModel(o);
  auto b = r->CreateModel(o);
  ASSERT_TRUE(a.ok() && b.ok());
  SplitMix64 g(2);
  auto data = RandomData(g, {3, 19, 8}, "cross_entropy", 128);
  ASSERT_TRUE(r->ForwardBackward(*a, data, "cross_entropy", {}).ok());
  ASSERT_TRUE(r->ForwardBackward(*b, Slice(data, 0, 2), "cross_entropy", {}).ok());
  ASSERT_TRUE(r->ForwardBackward(*b, Slice(data, 2, 3), "cross_entropy", {}).ok());
  const auto ga = Flat(Snap(*r, *a, StateKind::kGrads));
  EXPECT_LE(MaxAbsDiff(ga, Flat(Snap(*r, *b, StateKind::kGrads))), kRelTol * MaxAbs(ga));
  EXPECT_GT(r->GetInfo(*a)->trainable_parameters, 20000);  // every base weight is trainable
}

// Mixtures of experts (Qwen3-MoE with a dense layer, Mixtral, Qwen2-MoE with its shared expert):
// the experts' own adapters (LoRA on every expert's gate, up and down) or every expert and router
// weight (full fine-tuning)
// accumulate exactly under any split into calls and micro-batches: routing is per token, so a
// token meets the same experts however the batch is cut. Control: the split missing one datum.
struct MoeCase {
  std::string family;
  bool full;
};

class MoeSplitVsCombined : public ::testing::TestWithParam<MoeCase> {};

TEST_P(MoeSplitVsCombined, ExpertGradientsIndependentOfTheSplit) {
  const MoeCase& c = GetParam();
  TempDir dir;
  const std::string model = WriteModel(dir, TinyConfig(c.family));
  auto whole = MakeRunner(model, ComputeDType::kFloat64, /*micro_batch_tokens=*/4096);
  auto cut = MakeRunner(model, ComputeDType::kFloat64, /*micro_batch_tokens=*/24);
  CreateModelOptions o;
  o.seed = 7;
  o.lora = c.full ? std::nullopt : std::optional<LoraConfig>(LoraConfig{4, 8, true, true, false});
  auto a = whole->CreateModel(o);
  auto b = cut->CreateModel(o);
  auto broken = cut->CreateModel(o);
  ASSERT_TRUE(a.ok() && b.ok() && broken.ok());
  SplitMix64 g(23);
  // A first step moves every adapter's B off zero, so that every A gets a gradient too.
  const auto warm = RandomData(g, {6, 11}, "cross_entropy", 128);
  for (auto [runner, id] : {std::pair{whole.get(), *a}, {cut.get(), *b}, {cut.get(), *broken}}) {
    ASSERT_TRUE(runner->ForwardBackward(id, warm, "cross_entropy", {}).ok());
    AdamParams p;
    p.learning_rate = 0.05;
    ASSERT_TRUE(runner->OptimStep(id, p).ok());
  }

  const auto data = RandomData(g, {2, 31, 5, 17, 3, 24}, "cross_entropy", 128);
  ASSERT_TRUE(whole->ForwardBackward(*a, data, "cross_entropy", {}).ok());
  for (auto [begin, end] : {std::pair<size_t, size_t>{0, 1}, {1, 4}, {4, 6}}) {
    ASSERT_TRUE(cut->ForwardBackward(*b, Slice(data, begin, end), "cross_entropy", {}).ok());
  }
  ASSERT_TRUE(cut->ForwardBackward(*broken, Slice(data, 0, 5), "cross_entropy", {}).ok());

  const std::vector<NamedValues> grads = Snap(*whole, *a, StateKind::kGrads);
  const auto want = Flat(grads);
  const auto got = Flat(Snap(*cut, *b, StateKind::kGrads));
  const double scale = MaxAbs(want);
  ASSERT_GT(scale, 1e-6);
  EXPECT_LE(MaxAbsDiff(want, got), kRelTol * scale);
  EXPECT_GT(MaxAbsDiff(want, Flat(Snap(*cut, *broken, StateKind::kGrads))), 1e3 * kRelTol * scale);
  // Every expert of every routed layer learned: each one's tensors have a non-zero gradient,
  // and the router's too under full fine-tuning.
  const ModelConfig config = TinyConfig(c.family);
  int64_t experts_seen = 0, router_seen = 0, shared_seen = 0;
  for (const NamedValues& n : grads) {
    const bool nonzero = MaxAbs(n.values) > 0;
    if (n.name.find(".experts.") != std::string::npos) experts_seen += nonzero;
    if (n.name.find(config.moe.names.Router() + ".") != std::string::npos) router_seen += nonzero;
    if (n.name.find(".shared_expert") != std::string::npos) shared_seen += nonzero;
  }
  const int64_t routed =
      std::count(config.moe.layer_routes.begin(), config.moe.layer_routes.end(), true);
  // Per expert: gate, up, down, each a weight (full) or an A and a B (LoRA); the shared expert
  // (Qwen2-MoE) likewise, and its gate's weight under full fine-tuning.
  EXPECT_EQ(experts_seen, routed * config.moe.num_experts * (c.full ? 3 : 6));
  EXPECT_EQ(router_seen, c.full ? routed : 0);
  EXPECT_EQ(shared_seen,
            config.moe.shared_expert_intermediate_size > 0 ? routed * (c.full ? 4 : 6) : 0);

  auto s1 = whole->OptimStep(*a, AdamParams{});
  auto s2 = cut->OptimStep(*b, AdamParams{});
  ASSERT_TRUE(s1.ok() && s2.ok());
  EXPECT_NEAR(s1->grad_norm, s2->grad_norm, kRelTol * s1->grad_norm);
  EXPECT_LE(MaxAbsDiff(Flat(Snap(*whole, *a, StateKind::kParams)),
                       Flat(Snap(*cut, *b, StateKind::kParams))),
            1e-12);
}

INSTANTIATE_TEST_SUITE_P(Families, MoeSplitVsCombined,
                         ::testing::Values(MoeCase{"qwen3_moe", false}, MoeCase{"qwen3_moe", true},
                                           MoeCase{"mixtral", false}, MoeCase{"mixtral", true},
                                           MoeCase{"qwen2_moe", false}, MoeCase{"qwen2_moe", true}),
                         [](const auto& info) {
                           return info.param.family + (info.param.full ? "_full" : "_lora");
                         });

// A full fine-tune of a mixture of experts under --shard=full (each layer a unit with its router
// and experts, gathered before it runs; one process here, the ranks are tests/dist's) trains as the
// replicated one: the same tensors by the same names, to rounding.
TEST(MoeSharded, AFullyShardedMixtureOfExpertsTrainsAsTheReplicatedOne) {
  TempDir dir;
  const std::string model = WriteModel(dir, TinyConfig("qwen3_moe"));
  auto sharded = MakeRunner(model, ComputeDType::kFloat64, 24, ShardMode::kFull);
  auto replicated = MakeRunner(model, ComputeDType::kFloat64, 24);
  CreateModelOptions fine_tune;
  fine_tune.lora.reset();
  const std::string a = *sharded->CreateModel(fine_tune);
  const std::string b = *replicated->CreateModel(fine_tune);
  SplitMix64 g(29);
  for (int step = 0; step < 2; ++step) {
    const auto data = RandomData(g, {9, 14, 3}, "cross_entropy", 128);
    ASSERT_TRUE(sharded->ForwardBackward(a, data, "cross_entropy", {}).ok());
    ASSERT_TRUE(replicated->ForwardBackward(b, data, "cross_entropy", {}).ok());
    AdamParams p;
    p.learning_rate = 0.05;
    ASSERT_TRUE(sharded->OptimStep(a, p).ok());
    ASSERT_TRUE(replicated->OptimStep(b, p).ok());
  }
  std::map<std::string, std::vector<double>> want;
  for (NamedValues& n : Snap(*replicated, b, StateKind::kParams)) want[n.name] = n.values;
  std::map<std::string, std::vector<double>> got;
  for (NamedValues& n : Snap(*sharded, a, StateKind::kParams)) got[n.name] = n.values;
  ASSERT_EQ(got.size(), want.size());
  int64_t experts = 0;
  for (const auto& [name, values] : want) {
    ASSERT_TRUE(got.count(name)) << name;
    EXPECT_LE(MaxAbsDiff(got[name], values), 1e-12) << name;
    experts += name.find(".experts.") != std::string::npos;
  }
  EXPECT_EQ(experts, 8 * 3);
  // Control: the trained weights moved from the base.
  auto fresh = MakeRunner(model, ComputeDType::kFloat64, 24);
  const std::string c = *fresh->CreateModel(fine_tune);
  EXPECT_GT(MaxAbsDiff(Flat(Snap(*fresh, c, StateKind::kParams)),
                       Flat(Snap(*replicated, b, StateKind::kParams))),
            1e-3);
}

}  // namespace
}  // namespace tinkerd::testing
