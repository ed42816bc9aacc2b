// The router's auxiliary load-balancing loss (runner/loss/router_aux.h, loss_fn_config
// "router_aux_loss_coef"): its gradient is its formula's, in the operator and through the model
// (central differences), and like every loss it adds up exactly under any split into calls,
// micro-batches and recomputed layers. Its value against the independent float64 reference is in
// model_reference_test.cc.
//
// Shape suffixes: T rows, E experts, k choices per row.
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "runner/loss/router_aux.h"
#include "runner/model/safetensors.h"
#include "tests/test_util.h"

namespace tinkerd::testing {
namespace {

constexpr char kCoef[] = "router_aux_loss_coef";

// ---- the operator alone

// The formula written out: one-hot picks per sequence, autograd through the probabilities.
at::Tensor FormulaLoss(double coef, const std::vector<at::Tensor>& probs_TE,
                       const std::vector<at::Tensor>& experts_Tk, const std::vector<int64_t>& cu,
                       const std::vector<double>& weight_S) {
  const auto L = static_cast<double>(probs_TE.size());
  const int64_t E = probs_TE.front().size(1);
  at::Tensor total = at::zeros({}, at::kDouble);
  for (size_t s = 0; s + 1 < cu.size(); ++s) {
    const int64_t begin = cu[s], T = cu[s + 1] - cu[s];
    at::Tensor picks_E = at::zeros({E}, at::kDouble), probs_E = at::zeros({E}, at::kDouble);
    for (size_t l = 0; l < probs_TE.size(); ++l) {
      picks_E = picks_E + at::one_hot(experts_Tk[l].narrow(0, begin, T), E)
                              .to(at::kDouble)
                              .sum(at::IntArrayRef{0, 1});
      probs_E = probs_E + probs_TE[l].narrow(0, begin, T).sum(0);
    }
    const double rows = L * static_cast<double>(T);
    total = total + coef * weight_S[s] * static_cast<double>(E) *
                        ((picks_E / rows) * (probs_E / rows)).sum();
  }
  return total;
}

// Three routed layers over three sequences (one of weight 0). Each layer's probabilities are first
// observed without a graph (a recomputed layer's forward) and again with one (its rerun), as
// kernels::Recompute runs them: counted once, differentiated once. The gradient reaching the
// logits and the value equal the formula's to float64 rounding. Control: the whole micro-batch
// taken as one sequence (Hugging Face's batch-wide form) is far from it.
TEST(RouterAuxOperator, GradientAndValueAreTheFormulas) {
  const int64_t E = 5, k = 2, T = 13;
  const std::vector<int64_t> cu = {0, 4, 11, 13};
  const std::vector<double> weight_S = {4, 0, 1.5};
  const double coef = 0.3;
  at::manual_seed(11);
  std::vector<at::Tensor> logits_TE, probs_TE, experts_Tk, upstream_TE;
  for (int l = 0; l < 3; ++l) {
    logits_TE.push_back(at::randn({T, E}, at::kDouble).requires_grad_(true));
    probs_TE.push_back(at::softmax(logits_TE.back(), -1));
    experts_Tk.push_back(std::get<1>(at::topk(probs_TE.back().detach(), k, -1)));
    upstream_TE.push_back(at::randn({T, E}, at::kDouble));
  }
  auto gradients = [&](const std::vector<int64_t>& sequences, const std::vector<double>& weights,
                       double* value) {
    RouterAux aux(coef, E, 3, sequences);
    std::vector<at::Tensor> probs;
    for (int l = 0; l < 3; ++l) aux.Observe(l, probs_TE[l].detach(), experts_Tk[l]);
    for (int l = 0; l < 3; ++l) {
      probs.push_back(at::softmax(logits_TE[l], -1));
      aux.Observe(l, probs.back(), experts_Tk[l]);
    }
    aux.SetWeights(weights);
    *value = aux.Value();
    at::Tensor loss = at::zeros({}, at::kDouble);
    for (int l = 0; l < 3; ++l) loss = loss + (probs[l] * upstream_TE[l]).sum();
    return torch::autograd::grad({loss}, logits_TE);
  };
  double value = 0;
  const std::vector<at::Tensor> got = gradients(cu, weight_S, &value);

  at::Tensor reference = FormulaLoss(coef, probs_TE, experts_Tk, cu, weight_S);
  at::Tensor loss = reference;
  for (int l = 0; l < 3; ++l) loss = loss + (probs_TE[l] * upstream_TE[l]).sum();
  const std::vector<at::Tensor> want =
      torch::autograd::grad({loss}, logits_TE, {}, /*retain_graph=*/true);
  EXPECT_NEAR(value, reference.item<double>(), 1e-14 * reference.item<double>());
  double worst = 0, scale = 0, aux_part = 0;
  const std::vector<at::Tensor> upstream_only = torch::autograd::grad(
      {(probs_TE[0] * upstream_TE[0]).sum() + (probs_TE[1] * upstream_TE[1]).sum() +
       (probs_TE[2] * upstream_TE[2]).sum()},
      logits_TE);
  for (int l = 0; l < 3; ++l) {
    worst = std::max(worst, (got[l] - want[l]).abs().max().item<double>());
    scale = std::max(scale, want[l].abs().max().item<double>());
    aux_part = std::max(aux_part, (want[l] - upstream_only[l]).abs().max().item<double>());
  }
  EXPECT_LE(worst, 1e-14 * scale);
  EXPECT_GT(aux_part, 1e-3 * scale) << "the loss must matter beside the upstream gradient";

  double batchwide = 0;
  const std::vector<at::Tensor> control = gradients({0, T}, {5.5}, &batchwide);
  double off = 0;
  for (int l = 0; l < 3; ++l)
    off = std::max(off, (control[l] - want[l]).abs().max().item<double>());
  EXPECT_GT(off, 1e3 * 1e-14 * scale);
  EXPECT_GT(std::abs(batchwide - value), 1e-6 * value);
}

// ---- through the model

// Qwen3-MoE with both layers routed (so the loss spans several layers), in float64.
ModelConfig TwoRoutedLayers(const std::string& family) {
  ModelConfig c = TinyConfig(family);
  c.moe.layer_routes.assign(static_cast<size_t>(c.num_hidden_layers), true);
  return c;
}

std::unique_ptr<ModelRunner> Runner(const std::string& dir, int64_t micro_batch_tokens,
                                    bool checkpointing) {
  return MakeRunner(dir, ComputeDType::kFloat64, micro_batch_tokens, ShardMode::kNone, 0,
                    checkpointing);
}

// Writes `weights` (float64 by HF name) as one float32 safetensors file beside `config_from`'s
// config.json.
void WriteWeights(const std::string& config_from, const std::string& dir,
                  const std::map<std::string, at::Tensor>& weights) {
  std::filesystem::create_directories(dir);
  std::filesystem::copy_file(config_from + "/config.json", dir + "/config.json");
  std::vector<SafetensorsSpec> specs;
  for (const auto& [name, t] : weights) specs.push_back({name, "F32", t.sizes().vec()});
  auto writer = SafetensorsWriter::Open(dir + "/model.safetensors", specs, {});
  ASSERT_TRUE(writer.ok()) << writer.status().message();
  for (const SafetensorsSpec& s : (*writer)->order()) {
    const at::Tensor f = weights.at(s.name).to(at::kFloat).contiguous();
    ASSERT_TRUE((*writer)
                    ->Append(absl::string_view(static_cast<const char*>(f.data_ptr()), f.nbytes()))
                    .ok());
  }
  ASSERT_TRUE((*writer)->Commit().ok());
}

// The accumulated gradient of a full fine-tune with the loss on, along a direction V over every
// router and the first layer's q_proj (upstream of both routers), against the central difference
// of loss:sum + router_aux_loss:sum between models written at W ± h·V. W is rounded to multiples
// of 2^-24 and V is ±1 with h = 2^-20, so that both models hold W ± h·V exactly in float32. h is
// that small because the loss jumps where a token's top-k changes: a router logit moves by about
// h·Σ|x| ≈ 3e-5 here (2^-12 moved them by 1e-2 and flipped choices). Tolerance: the central
// difference's truncation error, h²/6 times the third derivative along V, is ~1e-13 relative;
// the float64 sums (|loss| ~ 200) add ~1e-16·200/h ≈ 2e-8 absolute against a derivative ~10, so
// 1e-6 relative leaves a margin of 500. Control: the difference of loss:sum alone misses the
// gradient by far more (the router's loss is a visible part of it).
TEST(RouterAuxModel, GradientIsTheCentralDifferenceOfTheReportedLoss) {
  TempDir dir;
  const ModelConfig config = TwoRoutedLayers("qwen3_moe");
  const std::string written = WriteModel(dir, config, 3);
  TinyModelSpec spec;
  spec.config = config;
  spec.seed = 3;
  spec.init_std = 0.2;
  auto generated = GenerateTinyWeights(spec);
  ASSERT_TRUE(generated.ok()) << generated.status().message();
  std::map<std::string, at::Tensor> base, plus, minus, direction;
  const double h = std::ldexp(1.0, -20);
  SplitMix64 g(5);
  for (auto& [name, t] : *generated) {
    base[name] = name.find("norm") == std::string::npos
                     ? at::round(t.to(at::kDouble) * std::ldexp(1.0, 24)) / std::ldexp(1.0, 24)
                     : t.to(at::kFloat).to(at::kDouble);
    at::Tensor v = at::zeros_like(base[name]);
    if (name.find("mlp.gate.weight") != std::string::npos ||
        name == "model.layers.0.self_attn.q_proj.weight") {
      auto* p = v.data_ptr<double>();
      const auto* w = base[name].data_ptr<double>();
      for (int64_t i = 0; i < v.numel(); ++i) {
        p[i] = std::abs(w[i]) + h < 1 ? (g.Next() % 2 ? 1.0 : -1.0) : 0.0;
      }
      direction[name] = v;
    }
    plus[name] = base[name] + h * v;
    minus[name] = base[name] - h * v;
  }
  ASSERT_EQ(direction.size(), 3u);
  for (const auto& [sub, weights] :
       {std::pair{"base", &base}, std::pair{"plus", &plus}, std::pair{"minus", &minus}}) {
    ASSERT_NO_FATAL_FAILURE(WriteWeights(written, dir.Sub(sub), *weights));
  }

  const auto data = RandomData(g, {9, 17, 4, 12}, "cross_entropy", 128);
  const std::map<std::string, double> cfg{{kCoef, 2.0}};
  CreateModelOptions full;
  full.lora.reset();
  full.loss_reduction = LossReduction::kSum;
  auto total = [&](const std::string& sub, double* loss_only) {
    auto r = Runner(dir.Sub(sub), 4096, false);
    const std::string id = *r->CreateModel(full);
    auto out = r->Forward(id, data, "cross_entropy", cfg);
    EXPECT_TRUE(out.ok()) << out.status().message();
    *loss_only = out->metrics.at("loss:sum");
    return out->metrics.at("loss:sum") + out->metrics.at("router_aux_loss:sum");
  };
  double loss_plus = 0, loss_minus = 0;
  const double difference = (total("plus", &loss_plus) - total("minus", &loss_minus)) / (2 * h);
  const double loss_difference = (loss_plus - loss_minus) / (2 * h);

  auto r = Runner(dir.Sub("base"), 4096, false);
  const std::string id = *r->CreateModel(full);
  ASSERT_TRUE(r->ForwardBackward(id, data, "cross_entropy", cfg).ok());
  double along = 0;
  for (const NamedValues& n : Snap(*r, id, StateKind::kGrads)) {
    const auto it = direction.find(n.name);
    if (it == direction.end()) continue;
    const auto* v = it->second.data_ptr<double>();
    for (size_t i = 0; i < n.values.size(); ++i) along += n.values[i] * v[i];
  }
  ASSERT_GT(std::abs(along), 1e-3);
  EXPECT_NEAR(difference, along, 1e-6 * std::abs(along));
  EXPECT_GT(std::abs(loss_difference - along), 1e-3 * std::abs(along)) << "the control";
}

// Split into calls, micro-batches of 24 tokens and recomputed layers against one call in one
// micro-batch: the accumulated gradients and the summed loss agree to float64 rounding
// (accumulation_test.cc's bound), for a LoRA model under seq_mean_token_mean and a full fine-tune
// under token_mean, Qwen3-MoE, Mixtral and Qwen2-MoE (its shared expert's adapters recomputed
// with their layer). Control: the same calls without the loss end far away,
// so the agreement covers its gradient.
struct SplitCase {
  std::string family;
  bool full;
};

void PrintTo(const SplitCase& c, std::ostream* os) {
  *os << c.family << (c.full ? " full" : " lora");
}

class RouterAuxSplit : public ::testing::TestWithParam<SplitCase> {};

TEST_P(RouterAuxSplit, AccumulatesExactlyUnderAnySplit) {
  constexpr double kRelTol = 1e-10;
  const SplitCase& c = GetParam();
  TempDir dir;
  const std::string model = WriteModel(dir, TwoRoutedLayers(c.family), 7);
  auto whole = Runner(model, 4096, false);
  auto cut = Runner(model, 24, true);
  CreateModelOptions o;
  o.seed = 7;
  o.lora = c.full ? std::nullopt : std::optional<LoraConfig>(LoraConfig{4, 8, true, true, false});
  o.loss_reduction = c.full ? LossReduction::kTokenMean : LossReduction::kSeqMeanTokenMean;
  const std::string a = *whole->CreateModel(o);
  const std::string b = *cut->CreateModel(o);
  const std::string without = *whole->CreateModel(o);
  SplitMix64 g(19);
  const auto data = RandomData(g, {2, 31, 5, 17, 3, 24}, "ppo", 128);
  const std::map<std::string, double> cfg{{kCoef, 0.5}};
  auto all = whole->ForwardBackward(a, data, "ppo", cfg);
  ASSERT_TRUE(all.ok()) << all.status().message();
  ASSERT_TRUE(whole->ForwardBackward(without, data, "ppo", {}).ok());
  double split_sum = 0;
  for (auto [begin, end] : {std::pair<size_t, size_t>{0, 1}, {1, 4}, {4, 6}}) {
    auto part = cut->ForwardBackward(b, Slice(data, begin, end), "ppo", cfg);
    ASSERT_TRUE(part.ok()) << part.status().message();
    split_sum += part->metrics.at("router_aux_loss:sum");
  }
  const double want_sum = all->metrics.at("router_aux_loss:sum");
  ASSERT_GT(want_sum, 0);
  EXPECT_NEAR(split_sum, want_sum, kRelTol * want_sum);

  const auto want = Flat(Snap(*whole, a, StateKind::kGrads));
  const double scale = MaxAbs(want);
  ASSERT_GT(scale, 1e-6);
  EXPECT_LE(MaxAbsDiff(want, Flat(Snap(*cut, b, StateKind::kGrads))), kRelTol * scale);
  EXPECT_GT(MaxAbsDiff(want, Flat(Snap(*whole, without, StateKind::kGrads))),
            1e3 * kRelTol * scale);
}

INSTANTIATE_TEST_SUITE_P(
    Families, RouterAuxSplit,
    ::testing::Values(SplitCase{"qwen3_moe", false}, SplitCase{"qwen3_moe", true},
                      SplitCase{"mixtral", false}, SplitCase{"qwen2_moe", false}),
    [](const auto& info) { return info.param.family + (info.param.full ? "_full" : "_lora"); });

// A dense model has no router: the key is refused by name, in a call and when a stream begins,
// and a negative coefficient anywhere.
TEST(RouterAuxRequest, ADenseModelOrANegativeCoefficientIsRefusedByName) {
  TempDir dir;
  auto dense = MakeRunner(WriteModel(dir, TinyConfig("qwen3"), 1, "dense"));
  const std::string id = *dense->CreateModel(CreateModelOptions{});
  SplitMix64 g(2);
  const auto data = RandomData(g, {5}, "cross_entropy", 128);
  auto refused = dense->ForwardBackward(id, data, "cross_entropy", {{kCoef, 0.1}});
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find(kCoef), std::string::npos);
  // A stream is refused when it begins, so none is left open to block the model's calls.
  auto stream = dense->BeginStream(id, "cross_entropy", {{kCoef, 0.1}});
  EXPECT_EQ(stream.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(dense->ForwardBackward(id, data, "cross_entropy", {{kCoef, 0.0}}).ok());

  auto moe = MakeRunner(WriteModel(dir, TinyConfig("mixtral"), 1, "moe"));
  const std::string m = *moe->CreateModel(CreateModelOptions{});
  auto negative = moe->ForwardBackward(m, data, "cross_entropy", {{kCoef, -0.1}});
  EXPECT_EQ(negative.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(negative.status().message().find(kCoef), std::string::npos);
  EXPECT_EQ(moe->GetInfo(m)->accumulated_tokens, 0);
}

}  // namespace
}  // namespace tinkerd::testing
