// Sampling's promises against the trainer's own computation (runner/sample/engine.h): logprob
// identity, greedy = argmax, determinism under batching, and the sampled distribution. Each has a
// broken control that the same check must reject.
//
// Shape suffixes: T tokens, D hidden, V vocab.
#include <ATen/core/grad_mode.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>
#include <optional>

#include "kernels/gemv.h"
#include "kernels/logprob_head.h"
#include "runner/call_memory.h"
#include "runner/sample/engine.h"
#include "runner/sample/policy.h"
#include "tests/test_util.h"

namespace tinkerd::testing {
namespace {

class SamplingTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::make_unique<TempDir>();
    const std::string model = WriteModel(*dir_, TinyConfig("llama"), 5);
    WriteTokenizerJson(model, 128);  // for stop strings
    runner_ = MakeRunner(model);
    ASSERT_NE(runner_, nullptr);
    ASSERT_NO_FATAL_FAILURE(TrainedLora(4, 9, 3, &model_, &policy_));
  }

  // A LoRA model (attention, MLP and head adapted) after one large step, so that the adapter
  // (B starts at zero) changes the function sampled, and its policy.
  void TrainedLora(int64_t rank, uint64_t seed, uint64_t data_seed, std::string* model,
                   std::shared_ptr<const Policy>* policy) {
    CreateModelOptions options;
    options.lora = LoraConfig{rank, 2.0 * static_cast<double>(rank), true, true, true};
    options.loss_reduction = LossReduction::kSum;
    options.seed = seed;
    auto id = runner_->CreateModel(options);
    ASSERT_TRUE(id.ok()) << id.status().message();
    *model = *id;
    SplitMix64 g(data_seed);
    auto fb = runner_->ForwardBackward(*model, RandomData(g, {9, 14}, "cross_entropy", 128),
                                       "cross_entropy", {});
    ASSERT_TRUE(fb.ok()) << fb.status().message();
    AdamParams adam;
    adam.learning_rate = 0.05;
    ASSERT_TRUE(runner_->OptimStep(*model, adam).ok());
    auto frozen = runner_->FreezePolicy(*model);
    ASSERT_TRUE(frozen.ok()) << frozen.status().message();
    *policy = *frozen;
  }

  // Runs requests through one engine, all admitted before the first step, to completion; request
  // i samples policies[i] (policy_ where there is none). `decode_forwards` gets the engine's count.
  std::vector<SampleResult> Run(const std::vector<SampleRequest>& requests,
                                EngineLimits limits = {},
                                const std::vector<std::shared_ptr<const Policy>>& policies = {},
                                int64_t* decode_forwards = nullptr) {
    SampleEngine engine(limits);
    std::vector<SampleResult> out(requests.size());
    int answered = 0;
    for (size_t i = 0; i < requests.size(); ++i) {
      absl::Status st = engine.Admit(i < policies.size() ? policies[i] : policy_, requests[i],
                                     [&out, &answered, i](const absl::StatusOr<SampleResult>& r) {
                                       EXPECT_TRUE(r.ok()) << r.status().message();
                                       if (r.ok()) out[i] = *r;
                                       ++answered;
                                     });
      EXPECT_TRUE(st.ok()) << st.message();
    }
    while (engine.Step()) {
    }
    EXPECT_EQ(answered, static_cast<int>(requests.size()));
    if (decode_forwards != nullptr) *decode_forwards = engine.decode_forwards();
    return out;
  }

  // The trainer's hidden states of a whole sequence: one packed forward, no cache.
  at::Tensor TrainerHidden(const std::vector<int64_t>& tokens, const KvStep* kv = nullptr,
                           const Policy* policy = nullptr) const {
    const Policy& pol = policy != nullptr ? *policy : *policy_;
    at::NoGradGuard no_grad;
    const int64_t T = static_cast<int64_t>(tokens.size());
    // On the policy's device: under TINKERD_TEST_DEVICE=cuda the weights are there.
    PackedBatch batch{at::tensor(at::ArrayRef<int64_t>(tokens), at::kLong).to(pol.device), {0, T}};
    ForwardOptions options;
    options.compute_dtype = pol.compute_dtype;
    options.kv = kv;
    return ForwardHidden(pol.config, pol.weights, pol.lora ? &*pol.lora : nullptr, batch, options);
  }

  kernels::LogprobHeadParams Head(const at::Tensor& hidden_TD,
                                  const Policy* policy = nullptr) const {
    const Policy& pol = policy != nullptr ? *policy : *policy_;
    kernels::LogprobHeadParams head;
    head.hidden_TD = hidden_TD;
    head.weight_VD = pol.weights.lm_head_VD;
    if (const LoraPair* pair = HeadAdapter(pol.lora ? &*pol.lora : nullptr)) {
      head.lora_A_rD = pair->A_rI;
      head.lora_B_Vr = pair->B_Or;
      head.lora_scale = pol.lora->scale();
    }
    return head;
  }

  // The trainer's logprob of each token of `sequence` after position `from` (Forward's head).
  std::vector<double> TrainerLogprobs(const std::vector<int64_t>& sequence, size_t from,
                                      const Policy* policy = nullptr) const {
    at::NoGradGuard no_grad;
    const std::vector<int64_t> inputs(sequence.begin(), sequence.end() - 1);
    const std::vector<int64_t> targets(sequence.begin() + 1, sequence.end());
    kernels::LogprobHeadParams head = Head(TrainerHidden(inputs, nullptr, policy), policy);
    head.targets_T =
        at::tensor(at::ArrayRef<int64_t>(targets), at::kLong).to(head.hidden_TD.device());
    const at::Tensor logp = kernels::TokenLogprobs(head).logp_T.cpu();
    std::vector<double> out;
    for (size_t t = from - 1; t < targets.size(); ++t) out.push_back(logp[t].item<double>());
    return out;
  }

  // log softmax over the vocabulary after `context`, by the trainer's head with every token as
  // a target.
  std::vector<double> TrainerDistribution(const std::vector<int64_t>& context) const {
    at::NoGradGuard no_grad;
    const at::Tensor h = TrainerHidden(context);
    const int64_t V = policy_->config.vocab_size;
    kernels::LogprobHeadParams head = Head(h.narrow(0, h.size(0) - 1, 1).expand({V, -1}));
    head.targets_T = at::arange(V, at::TensorOptions(at::kLong).device(h.device()));
    const at::Tensor logp = kernels::TokenLogprobs(head).logp_T.cpu().contiguous();
    return {logp.data_ptr<double>(), logp.data_ptr<double>() + V};
  }

  std::unique_ptr<TempDir> dir_;
  std::unique_ptr<ModelRunner> runner_;
  std::string model_;
  std::shared_ptr<const Policy> policy_;
};

const std::vector<int64_t> kPrompt = {5, 17, 99, 3, 64, 12, 7};

SampleRequest Request(uint64_t seed, int64_t max_tokens, int64_t n = 1) {
  SampleRequest r;
  r.prompt = kPrompt;
  r.num_samples = n;
  r.params.max_tokens = max_tokens;
  r.params.seed = seed;
  return r;
}

std::vector<int64_t> Concat(std::vector<int64_t> a, const std::vector<int64_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// float64: the KV-cache decode and the packed forward differ only in summation order, ~1e-16
// relative per op over a few dozen ops; 1e-12 leaves four orders of margin.
constexpr double kFloat64Tol = 1e-12;

TEST_F(SamplingTest, SampledLogprobsEqualTheTrainersForward) {
  SampleRequest r = Request(7, 12, 3);
  r.prompt_logprobs = true;
  const SampleResult result = Run({r})[0];
  ASSERT_EQ(result.sequences.size(), 3u);
  for (const SampledSequence& s : result.sequences) {
    ASSERT_EQ(s.tokens.size(), 12u);
    const std::vector<double> want = TrainerLogprobs(Concat(kPrompt, s.tokens), kPrompt.size());
    ASSERT_EQ(want.size(), s.logprobs.size());
    for (size_t t = 0; t < want.size(); ++t) {
      EXPECT_NEAR(s.logprobs[t], want[t], kFloat64Tol * std::abs(want[t])) << "token " << t;
    }
  }
  // compute_logprobs' path: the prompt's own logprobs.
  const std::vector<double> prompt = TrainerLogprobs(kPrompt, 1);
  ASSERT_EQ(result.prompt_logprobs.size(), kPrompt.size());
  EXPECT_TRUE(std::isnan(result.prompt_logprobs[0]));
  for (size_t t = 1; t < kPrompt.size(); ++t) {
    EXPECT_NEAR(result.prompt_logprobs[t], prompt[t - 1], kFloat64Tol * std::abs(prompt[t - 1]));
  }
  // And the public Forward (float32 logprobs: within float32 rounding).
  const SampledSequence& s = result.sequences[0];
  Datum d;
  const std::vector<int64_t> all = Concat(kPrompt, s.tokens);
  d.tokens.assign(all.begin(), all.end() - 1);
  d.loss_fn_inputs["target_tokens"] = TensorData::Int64({all.begin() + 1, all.end()});
  d.loss_fn_inputs["weights"] = TensorData::Float32(std::vector<float>(d.tokens.size(), 1.f));
  auto fwd = runner_->Forward(model_, {d}, "cross_entropy", {});
  ASSERT_TRUE(fwd.ok()) << fwd.status().message();
  for (size_t t = 0; t < s.tokens.size(); ++t) {
    const double f = fwd->outputs[0].logprobs[kPrompt.size() - 1 + t];
    EXPECT_NEAR(s.logprobs[t], f, 1e-6 * std::max(1.0, std::abs(f)));
  }
}

// compute_logprobs' top-k: at each prompt position, the k most likely next tokens and their
// logprobs are the trainer's log-softmax after that context, most likely first. The control: the
// distribution one position off gives other tokens or logprobs.
TEST_F(SamplingTest, TopKPromptLogprobsAreTheTrainersMostLikelyTokens) {
  constexpr int64_t k = 5;
  SampleRequest r = Request(7, 1);
  r.topk_prompt_logprobs = k;
  const SampleResult result = Run({r})[0];
  ASSERT_EQ(result.topk_prompt_logprobs.size(), kPrompt.size());
  EXPECT_TRUE(result.topk_prompt_logprobs[0].empty());
  // The trainer's k most likely (token, logprob) after the first `t` prompt tokens.
  auto trainer_topk = [this](size_t t) {
    const std::vector<double> logp =
        TrainerDistribution(std::vector<int64_t>(kPrompt.begin(), kPrompt.begin() + t));
    std::vector<std::pair<int64_t, double>> all;
    for (size_t v = 0; v < logp.size(); ++v) all.emplace_back(static_cast<int64_t>(v), logp[v]);
    std::stable_sort(all.begin(), all.end(),
                     [](const auto& x, const auto& y) { return x.second > y.second; });
    all.resize(k);
    return all;
  };
  size_t off_apart = 0;
  for (size_t t = 1; t < kPrompt.size(); ++t) {
    const auto& got = result.topk_prompt_logprobs[t];
    const auto want = trainer_topk(t);
    ASSERT_EQ(got.size(), static_cast<size_t>(k)) << "position " << t;
    for (int64_t j = 0; j < k; ++j) {
      EXPECT_EQ(got[j].first, want[j].first) << "position " << t << " rank " << j;
      EXPECT_NEAR(got[j].second, want[j].second, kFloat64Tol * std::abs(want[j].second))
          << "position " << t << " rank " << j;
    }
    if (t > 1) {
      const auto off = trainer_topk(t - 1);
      for (int64_t j = 0; j < k; ++j) {
        if (got[j].first != off[j].first ||
            std::abs(got[j].second - off[j].second) > kFloat64Tol * std::abs(off[j].second)) {
          ++off_apart;
          break;
        }
      }
    }
  }
  EXPECT_EQ(off_apart, kPrompt.size() - 2) << "the distribution one position off must not match";
}

// SDK 0.38's scoring fields, each against the trainer: target_prompt_logprobs equals the
// trainer's Forward with those ids as top-K cross_entropy targets ([T, K], -1 cells NaN, rows
// before the first asked id included); prompt_logprobs_last_n scores exactly the last n positions
// of the full answer; topk_sample_logprobs are, at each sampled position, the trainer's k most
// likely tokens after the prompt and the tokens before, the drawn (greedy) token first with its
// reported logprob bit for bit. The control: the same comparisons one position off fail.
TEST_F(SamplingTest, ScoringFieldsAreTheTrainersLogprobs) {
  const int64_t P = static_cast<int64_t>(kPrompt.size()), K = 3, k = 4, n = 3;
  SampleRequest r = Request(11, 6);
  r.params.temperature = 0;  // greedy: the drawn token heads its row
  r.prompt_logprobs = true;
  r.prompt_logprobs_last_n = n;
  r.topk_prompt_logprobs = 2;
  r.topk_sample_logprobs = k;
  r.target_prompt_k = K;
  r.target_prompt_ids.assign((P - 1) * K, -1);  // row 0 asks nothing: not scored
  for (int64_t i = 1; i < P - 1; ++i) {
    for (int64_t j = 0; j < K; ++j) r.target_prompt_ids[i * K + j] = (i * 37 + j * 11) % 128;
  }
  r.target_prompt_ids[2 * K + 1] = -1;
  SampleRequest full = Request(11, 6);
  full.prompt_logprobs = true;
  full.topk_prompt_logprobs = 2;
  const std::vector<SampleResult> results = Run({r, full});
  const SampleResult& got = results[0];

  // target_prompt_logprobs against Forward with [P - 1, K] targets (-1 sent as 0, then dropped).
  Datum d;
  d.tokens.assign(kPrompt.begin(), kPrompt.end() - 1);
  std::vector<int64_t> ids = r.target_prompt_ids;
  std::vector<float> w(ids.size(), 1.0f);
  for (int64_t& id : ids) id = std::max<int64_t>(id, 0);
  d.loss_fn_inputs["target_tokens"] = TensorData::Int64(ids);
  d.loss_fn_inputs["target_tokens"].shape = {P - 1, K};
  d.loss_fn_inputs["weights"] = TensorData::Float32(w);
  d.loss_fn_inputs["weights"].shape = {P - 1, K};
  auto fwd = runner_->Forward(model_, {d}, "cross_entropy", {});
  ASSERT_TRUE(fwd.ok()) << fwd.status().message();
  ASSERT_EQ(got.target_prompt_logprobs.size(), static_cast<size_t>((P - 1) * K));
  for (int64_t c = 0; c < (P - 1) * K; ++c) {
    if (r.target_prompt_ids[c] == -1) {
      EXPECT_TRUE(std::isnan(got.target_prompt_logprobs[c])) << "cell " << c;
      continue;
    }
    // Forward's logprobs are float32: within its rounding of the float64 value.
    const double f = fwd->outputs[0].logprobs[c];
    EXPECT_NEAR(got.target_prompt_logprobs[c], f, 1e-6 * std::max(1.0, std::abs(f))) << c;
    // And the float64 trainer: its logprob of that id after the first c / K + 1 tokens.
    const std::vector<double> dist =
        TrainerDistribution(std::vector<int64_t>(kPrompt.begin(), kPrompt.begin() + c / K + 1));
    const double want = dist[r.target_prompt_ids[c]];
    EXPECT_NEAR(got.target_prompt_logprobs[c], want, kFloat64Tol * std::abs(want)) << c;
    if (c / K + 2 < P) {  // the control: the next position's distribution
      const std::vector<double> off =
          TrainerDistribution(std::vector<int64_t>(kPrompt.begin(), kPrompt.begin() + c / K + 2));
      EXPECT_GT(std::abs(got.target_prompt_logprobs[c] - off[r.target_prompt_ids[c]]), 1e-6) << c;
    }
  }

  // prompt_logprobs_last_n: the last n of the full answer (their rows go through the head in
  // other groups, so to rounding); NaN and empty before.
  const SampleResult& whole = results[1];
  ASSERT_EQ(got.prompt_logprobs.size(), kPrompt.size());
  ASSERT_EQ(got.topk_prompt_logprobs.size(), kPrompt.size());
  for (int64_t t = 0; t < P; ++t) {
    if (t < P - n) {
      EXPECT_TRUE(std::isnan(got.prompt_logprobs[t])) << t;
      EXPECT_TRUE(got.topk_prompt_logprobs[t].empty()) << t;
    } else {
      EXPECT_NEAR(got.prompt_logprobs[t], whole.prompt_logprobs[t],
                  kFloat64Tol * std::abs(whole.prompt_logprobs[t]))
          << t;
      ASSERT_EQ(got.topk_prompt_logprobs[t].size(), 2u) << t;
      for (size_t j = 0; j < 2; ++j) {
        EXPECT_EQ(got.topk_prompt_logprobs[t][j].first, whole.topk_prompt_logprobs[t][j].first);
        EXPECT_NEAR(got.topk_prompt_logprobs[t][j].second, whole.topk_prompt_logprobs[t][j].second,
                    kFloat64Tol * std::abs(whole.topk_prompt_logprobs[t][j].second));
      }
    }
  }

  // topk_sample_logprobs: the trainer's k most likely after prompt + the tokens before.
  const SampledSequence& s = got.sequences[0];
  ASSERT_EQ(s.topk_logprobs.size(), s.tokens.size());
  size_t drawn_listed = 0, off_apart = 0;
  for (size_t i = 0; i < s.tokens.size(); ++i) {
    std::vector<int64_t> context = kPrompt;
    context.insert(context.end(), s.tokens.begin(), s.tokens.begin() + i);
    const std::vector<double> dist = TrainerDistribution(context);
    const TopLogprobs& row = s.topk_logprobs[i];
    ASSERT_EQ(row.size(), static_cast<size_t>(k));
    for (int64_t j = 0; j < k; ++j) {
      EXPECT_NEAR(row[j].second, dist[row[j].first], kFloat64Tol * std::abs(row[j].second));
      if (j > 0) {
        EXPECT_GE(row[j - 1].second, row[j].second);
      }
      if (row[j].first == s.tokens[i]) {
        EXPECT_EQ(row[j].second, s.logprobs[i]) << "token " << i;
        ++drawn_listed;
      }
    }
    // Nothing outside the row is more likely than its last entry.
    for (size_t v = 0; v < dist.size(); ++v) {
      bool listed = false;
      for (const auto& e : row) listed = listed || e.first == static_cast<int64_t>(v);
      if (!listed) {
        EXPECT_LE(dist[v], row.back().second + kFloat64Tol) << v;
      }
    }
    if (i > 0) {
      std::vector<int64_t> before(context.begin(), context.end() - 1);
      const std::vector<double> off = TrainerDistribution(before);
      if (std::abs(off[row[0].first] - row[0].second) > 1e-6) ++off_apart;
    }
  }
  EXPECT_EQ(drawn_listed, s.tokens.size()) << "a greedy token is its row's first";
  EXPECT_EQ(off_apart, s.tokens.size() - 1) << "the control one position off must not match";
}

// The control: a decoder that forgets the cached length in its positions (RoPE from 0 for the new
// token) gives logprobs the same comparison rejects.
TEST_F(SamplingTest, BrokenControlDecodeAtWrongPositionIsCaught) {
  const std::vector<int64_t> next = {42, 8};
  const int64_t P = static_cast<int64_t>(kPrompt.size());
  std::vector<at::Tensor> k_L, v_L;
  KvStep prefill;
  prefill.past = {0};
  prefill.extend = [&](int64_t, const at::Tensor& k, const at::Tensor& v) {
    k_L.push_back(k);
    v_L.push_back(v);
    return KvPacked{k, v, {0, P}};
  };
  TrainerHidden(kPrompt, &prefill);
  auto decode = [&](int64_t past) {
    KvStep step;
    step.past = {past};
    step.extend = [&](int64_t l, const at::Tensor& k, const at::Tensor& v) {
      return KvPacked{at::cat({k_L[l], k}), at::cat({v_L[l], v}), {0, P + 1}};
    };
    at::NoGradGuard no_grad;
    kernels::LogprobHeadParams head = Head(TrainerHidden({next[0]}, &step));
    head.targets_T =
        at::tensor(at::ArrayRef<int64_t>({next[1]}), at::kLong).to(head.hidden_TD.device());
    return kernels::TokenLogprobs(head).logp_T[0].item<double>();
  };
  const double want = TrainerLogprobs(Concat(kPrompt, next), P)[1];
  EXPECT_NEAR(decode(P), want, kFloat64Tol * std::abs(want));
  EXPECT_GT(std::abs(decode(0) - want), 1e-6) << "a position bug must be visible";
}

TEST_F(SamplingTest, GreedyIsTheArgmaxOfTheTrainerAtEveryStep) {
  SampleRequest r = Request(1, 10);
  r.params.temperature = 0;
  const SampledSequence greedy = Run({r})[0].sequences[0];
  SampleRequest hot = Request(1, 10);  // control: sampled at temperature 1
  hot.params.temperature = 1.5;
  const SampledSequence sampled = Run({hot})[0].sequences[0];
  auto argmax_steps = [&](const SampledSequence& s) {
    int agree = 0;
    std::vector<int64_t> context = kPrompt;
    for (int64_t token : s.tokens) {
      const std::vector<double> logp = TrainerDistribution(context);
      agree += std::max_element(logp.begin(), logp.end()) - logp.begin() == token;
      context.push_back(token);
    }
    return agree;
  };
  EXPECT_EQ(argmax_steps(greedy), 10);
  EXPECT_LT(argmax_steps(sampled), 10) << "the control must leave the argmax somewhere";
}

TEST_F(SamplingTest, SameSeedSameTokensWhateverElseIsInTheBatch) {
  SampleRequest a = Request(11, 16, 2);
  a.params.temperature = 0.9;
  a.params.top_k = 20;
  a.params.top_p = 0.9;
  const SampleResult alone = Run({a})[0];

  SampleRequest b = Request(5, 7, 3);
  b.prompt = {1, 2, 3};
  SampleRequest c = Request(6, 30);
  c.prompt = std::vector<int64_t>(40, 77);
  c.params.temperature = 0;
  const std::vector<SampleResult> mixed = Run({b, a, c});
  ASSERT_EQ(mixed[1].sequences.size(), 2u);
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(mixed[1].sequences[i].tokens, alone.sequences[i].tokens) << "sample " << i;
    ASSERT_EQ(mixed[1].sequences[i].logprobs.size(), alone.sequences[i].logprobs.size());
    // Prefilled packed with the other prompts and decoded beside other rows: float64 apart.
    for (size_t t = 0; t < alone.sequences[i].logprobs.size(); ++t) {
      EXPECT_NEAR(mixed[1].sequences[i].logprobs[t], alone.sequences[i].logprobs[t], kFloat64Tol)
          << "sample " << i << " token " << t;
    }
  }
  EXPECT_NE(alone.sequences[0].tokens, alone.sequences[1].tokens) << "samples draw apart";
  SampleRequest other = a;  // control: another seed, other tokens
  other.params.seed = 12;
  EXPECT_NE(Run({other})[0].sequences[0].tokens, alone.sequences[0].tokens);
}

// In float32 a sample's tokens and logprobs are the same to the bit whatever else the engine runs:
// prefilled packed with a 100-token prompt and decoded beside 70 other rows, so that the products
// span more than one of Gemv's 64-row tiles (before tiles, such a step left Gemv for the BLAS,
// whose rounding differs: tests/kernels/gemv_test.cc). Gemv runs on CPUs with AVX2 or AVX-512;
// elsewhere the BLAS takes every product and this is not promised.
TEST_F(SamplingTest, InFloat32ASampleIsTheSameToTheBitBesideManyRows) {
  if (!kernels::GemvRunsHere()) GTEST_SKIP() << "Gemv runs on CPUs with AVX2 or AVX-512 only";
  if (TestDevice() != "cpu") GTEST_SKIP() << "on a GPU cuBLAS picks kernels by batch size";
  runner_ = MakeRunner(dir_->Sub("model"), ComputeDType::kFloat32);
  ASSERT_NE(runner_, nullptr);
  ASSERT_NO_FATAL_FAILURE(TrainedLora(4, 9, 3, &model_, &policy_));
  SampleRequest a = Request(11, 12, 2);
  a.params.temperature = 0.9;
  const SampleResult alone = Run({a})[0];

  SampleRequest many = Request(5, 10, 70);
  SampleRequest long_prompt = Request(6, 4);
  long_prompt.prompt = std::vector<int64_t>(100, 77);
  const std::vector<SampleResult> mixed = Run({many, a, long_prompt});
  ASSERT_EQ(mixed[1].sequences.size(), 2u);
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(mixed[1].sequences[i].tokens, alone.sequences[i].tokens) << "sample " << i;
    EXPECT_EQ(mixed[1].sequences[i].logprobs, alone.sequences[i].logprobs) << "sample " << i;
  }
  // Control: the same request under the base model gives other logprobs, so the comparison
  // tells policies (and any rounding apart) from the same one.
  auto base = runner_->FreezePolicy("");
  ASSERT_TRUE(base.ok());
  EXPECT_NE(Run({a}, {}, {*base})[0].sequences[0].logprobs, alone.sequences[0].logprobs);
}

// A step starts admitted prompts in order while they fit its prefill budget (the first always, so
// a longer prompt runs alone), which bounds what a queued training call waits for; the others
// start in the next steps and sample what they would have. The control: the default budget
// starts all four in the first step.
TEST_F(SamplingTest, AStepPrefillsAtMostItsBudgetOfPromptTokens) {
  std::vector<SampleRequest> requests;
  for (int64_t length : {7, 12, 9, 30}) {
    SampleRequest r = Request(40 + length, 3);
    r.prompt = std::vector<int64_t>(length, 3 + length);
    requests.push_back(std::move(r));
  }
  auto first_tokens = [&](EngineLimits limits, std::vector<SampleResult>* results) {
    SampleEngine engine(limits);
    std::vector<int> first_step(requests.size(), 0);
    results->assign(requests.size(), {});
    int step = 1;
    for (size_t i = 0; i < requests.size(); ++i) {
      const absl::Status st = engine.Admit(
          policy_, requests[i],
          [results, i](const absl::StatusOr<SampleResult>& r) {
            EXPECT_TRUE(r.ok()) << r.status().message();
            if (r.ok()) (*results)[i] = *r;
          },
          [&first_step, &step, i](std::vector<SampleDelta>) {
            if (first_step[i] == 0) first_step[i] = step;
            return true;
          });
      EXPECT_TRUE(st.ok()) << st.message();
    }
    for (; engine.Step(); ++step) {
    }
    return first_step;
  };
  EngineLimits budget;
  budget.prefill_tokens_per_step = 20;
  std::vector<SampleResult> bounded, unbounded;
  // 7 + 12 fit 20 and 9 does not; then 9, and 30 does not fit what is left; then 30 alone.
  EXPECT_EQ(first_tokens(budget, &bounded), (std::vector<int>{1, 1, 2, 3}));
  EXPECT_EQ(first_tokens({}, &unbounded), (std::vector<int>{1, 1, 1, 1}));  // control
  for (size_t i = 0; i < requests.size(); ++i) {
    ASSERT_EQ(bounded[i].sequences.size(), 1u);
    ASSERT_EQ(unbounded[i].sequences.size(), 1u);
    EXPECT_EQ(bounded[i].sequences[0].tokens, unbounded[i].sequences[0].tokens) << i;
  }
}

// Continuous batching: a request admitted while another is three steps into its decode joins the
// running batch (its prompt prefilled beside the other's decode step) and both sample what they
// sample alone. The control: the joiner's request under the base model gives other logprobs.
TEST_F(SamplingTest, ARequestJoiningMidDecodeSamplesWhatItWouldAlone) {
  SampleRequest a = Request(21, 12, 2);
  a.params.temperature = 0.8;
  SampleRequest b = Request(22, 8);
  b.prompt = {9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 11};
  const SampleResult alone_a = Run({a})[0];
  const SampleResult alone_b = Run({b})[0];

  SampleEngine engine({});
  std::vector<SampleResult> together(2);
  auto keep = [&together](int i) {
    return [&together, i](const absl::StatusOr<SampleResult>& r) {
      EXPECT_TRUE(r.ok()) << r.status().message();
      if (r.ok()) together[i] = *r;
    };
  };
  ASSERT_TRUE(engine.Admit(policy_, a, keep(0)).ok());
  for (int step = 0; step < 3; ++step) ASSERT_TRUE(engine.Step());
  ASSERT_TRUE(together[0].sequences.empty()) << "a finished before b joined";
  ASSERT_TRUE(engine.Admit(policy_, b, keep(1)).ok());
  while (engine.Step()) {
  }
  const std::vector<std::pair<const SampleResult*, const SampleResult*>> pairs = {
      {&together[0], &alone_a}, {&together[1], &alone_b}};
  for (const auto& [got, want] : pairs) {
    ASSERT_EQ(got->sequences.size(), want->sequences.size());
    for (size_t i = 0; i < want->sequences.size(); ++i) {
      EXPECT_EQ(got->sequences[i].tokens, want->sequences[i].tokens) << i;
      ASSERT_EQ(got->sequences[i].logprobs.size(), want->sequences[i].logprobs.size());
      for (size_t t = 0; t < want->sequences[i].logprobs.size(); ++t) {
        EXPECT_NEAR(got->sequences[i].logprobs[t], want->sequences[i].logprobs[t], kFloat64Tol)
            << "sample " << i << " token " << t;
      }
    }
  }
  auto base = runner_->FreezePolicy("");
  ASSERT_TRUE(base.ok());
  const std::vector<double> under_base = Run({b}, {}, {*base})[0].sequences[0].logprobs;
  double apart = 0;
  for (size_t t = 0; t < under_base.size(); ++t) {
    apart = std::max(apart, std::abs(under_base[t] - alone_b.sequences[0].logprobs[t]));
  }
  EXPECT_GT(apart, kFloat64Tol);
}

// A decode step over the base model and two LoRA adapters of different ranks (attention, MLP and
// head adapted) runs one forward, each adapter on its own rows, and every sample gets what it
// gets alone: the same tokens, and the trainer's logprobs of its own policy. The control: the same
// request under the three policies gives logprobs apart, so rows given another's adapter would
// fail the identity.
TEST_F(SamplingTest, LoraAdaptersOfDifferentRanksDecodeInOneForward) {
  std::string other;
  std::shared_ptr<const Policy> rank8;
  ASSERT_NO_FATAL_FAILURE(TrainedLora(8, 10, 4, &other, &rank8));
  auto base = runner_->FreezePolicy("");
  ASSERT_TRUE(base.ok());
  const std::vector<std::shared_ptr<const Policy>> policies = {rank8, *base, policy_, rank8};

  std::vector<SampleRequest> requests;
  for (int i = 0; i < 4; ++i) requests.push_back(Request(30 + i, 8 + i, 2));
  int64_t mixed_forwards = 0;
  const std::vector<SampleResult> mixed = Run(requests, {}, policies, &mixed_forwards);
  // One forward per step: the longest request decodes max_tokens - 1 = 10 steps after prefill.
  EXPECT_EQ(mixed_forwards, 10);
  for (size_t i = 0; i < requests.size(); ++i) {
    int64_t alone_forwards = 0;
    const SampleResult alone = Run({requests[i]}, {}, {policies[i]}, &alone_forwards)[0];
    EXPECT_EQ(alone_forwards, requests[i].params.max_tokens - 1);
    ASSERT_EQ(mixed[i].sequences.size(), 2u);
    for (int k = 0; k < 2; ++k) {
      const SampledSequence& s = mixed[i].sequences[k];
      EXPECT_EQ(s.tokens, alone.sequences[k].tokens) << "request " << i << " sample " << k;
      const std::vector<double> want =
          TrainerLogprobs(Concat(kPrompt, s.tokens), kPrompt.size(), policies[i].get());
      ASSERT_EQ(want.size(), s.logprobs.size());
      for (size_t t = 0; t < want.size(); ++t) {
        EXPECT_NEAR(s.logprobs[t], want[t], kFloat64Tol * std::abs(want[t]))
            << "request " << i << " sample " << k << " token " << t;
      }
    }
  }
  // The control: one sequence scored by each policy.
  const std::vector<int64_t> seq = Concat(kPrompt, mixed[0].sequences[0].tokens);
  const std::vector<double> by8 = TrainerLogprobs(seq, kPrompt.size(), rank8.get());
  for (const Policy* p : {base->get(), policy_.get()}) {
    const std::vector<double> by = TrainerLogprobs(seq, kPrompt.size(), p);
    double apart = 0;
    for (size_t t = 0; t < by.size(); ++t) apart = std::max(apart, std::abs(by[t] - by8[t]));
    EXPECT_GT(apart, 1e-6) << "the adapters must change the logprobs";
  }
}

// Streaming: the deltas a request's Progress receives concatenate to exactly what its done gets,
// each step's tokens as soon as that step is over; a Progress that answers false ends the request
// with CANCELLED at that step and frees its place.
TEST_F(SamplingTest, ProgressDeltasConcatenateToTheResultAndFalseCancels) {
  SampleEngine engine({});
  std::vector<std::vector<int64_t>> streamed(2);
  std::vector<std::vector<double>> streamed_logprobs(2);
  std::vector<int> stops(2, 0);
  int calls = 0;
  std::optional<absl::StatusOr<SampleResult>> result;
  ASSERT_TRUE(engine
                  .Admit(
                      policy_, Request(21, 9, 2),
                      [&](const absl::StatusOr<SampleResult>& r) { result = r; },
                      [&](std::vector<SampleDelta> deltas) {
                        ++calls;
                        for (const SampleDelta& d : deltas) {
                          streamed[d.index].insert(streamed[d.index].end(), d.tokens.begin(),
                                                   d.tokens.end());
                          streamed_logprobs[d.index].insert(streamed_logprobs[d.index].end(),
                                                            d.logprobs.begin(), d.logprobs.end());
                          stops[d.index] += d.stop.has_value();
                        }
                        return true;
                      })
                  .ok());
  int steps = 0;
  while (engine.Step()) ++steps;
  ASSERT_TRUE(result.has_value() && result->ok());
  EXPECT_EQ(calls, steps + 1) << "one call per step that made progress";
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(streamed[i], (*result)->sequences[i].tokens);
    EXPECT_EQ(streamed_logprobs[i], (*result)->sequences[i].logprobs);
    EXPECT_EQ(stops[i], 1);
  }

  // A listener that has gone: the request ends at that step, long before max_tokens.
  SampleEngine cancelling({});
  std::optional<absl::StatusOr<SampleResult>> cancelled;
  int cancelled_calls = 0;
  ASSERT_TRUE(cancelling
                  .Admit(
                      policy_, Request(22, 200, 3),
                      [&](const absl::StatusOr<SampleResult>& r) { cancelled = r; },
                      [&](std::vector<SampleDelta>) { return ++cancelled_calls < 3; })
                  .ok());
  EXPECT_EQ(cancelling.running_sequences(), 3);
  int cancelled_steps = 0;
  while (cancelling.Step()) ++cancelled_steps;
  ASSERT_TRUE(cancelled.has_value());
  EXPECT_EQ(cancelled->status().code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(cancelled_calls, 3);
  EXPECT_EQ(cancelled_steps, 2) << "the step of the third call is the last";
  EXPECT_EQ(cancelling.running_sequences(), 0);
  EXPECT_EQ(cancelling.reserved_bytes(), 0);
}

// From logprobs: the distribution itself, and the one a temperature of 0.5 makes of it (the
// frequency tests' control).
std::pair<std::vector<double>, std::vector<double>> WarmAndCold(const std::vector<double>& logp) {
  std::vector<double> p(logp.size()), cold(logp.size());
  double cold_total = 0;
  for (size_t v = 0; v < logp.size(); ++v) {
    p[v] = std::exp(logp[v]);
    cold_total += cold[v] = std::exp(2 * logp[v]);
  }
  for (double& q : cold) q /= cold_total;
  return {p, cold};
}

// Pearson's chi-square over bins with an expected count of at least 5 (the rest pooled), against
// the critical value at p = 1e-3 (Wilson–Hilferty: df·(1 − 2/(9df) + z·sqrt(2/(9df)))³,
// z = 3.09). The seed is fixed, so the outcome is too.
double ChiSquare(const std::vector<int64_t>& counts, const std::vector<double>& p, int64_t n,
                 double* critical) {
  double chi = 0, pooled_obs = 0, pooled_exp = 0;
  int bins = 0;
  for (size_t v = 0; v < p.size(); ++v) {
    const double e = p[v] * n;
    if (e < 5) {
      pooled_obs += counts[v];
      pooled_exp += e;
      continue;
    }
    chi += (counts[v] - e) * (counts[v] - e) / e;
    ++bins;
  }
  if (pooled_exp > 0) {
    chi += (pooled_obs - pooled_exp) * (pooled_obs - pooled_exp) / pooled_exp;
    ++bins;
  }
  const double df = bins - 1;
  const double a = 2.0 / (9.0 * df);
  *critical = df * std::pow(1 - a + 3.09 * std::sqrt(a), 3);
  return chi;
}

TEST_F(SamplingTest, FrequenciesMatchTheSoftmax) {
  constexpr int64_t kN = 20000;
  SampleRequest r = Request(2024, 1, kN);
  const SampleResult result = Run({r}, EngineLimits{kN, int64_t{1} << 30})[0];
  std::vector<int64_t> counts(policy_->config.vocab_size, 0);
  for (const SampledSequence& s : result.sequences) ++counts.at(s.tokens[0]);
  const std::vector<double> logp = TrainerDistribution(kPrompt);
  const auto [p, p_cold] = WarmAndCold(logp);
  double critical = 0;
  const double chi = ChiSquare(counts, p, kN, &critical);
  EXPECT_LT(chi, critical) << "counts do not follow softmax(z)";
  // Control: the same counts against the temperature-0.5 distribution must fail.
  double critical_cold = 0;
  EXPECT_GT(ChiSquare(counts, p_cold, kN, &critical_cold), critical_cold);
}

// prompt_alt_tokens_k: k independent draws at every prompt position after the first. Over many
// requests their frequencies at one position follow the trainer's softmax there (the control: the
// temperature-0.5 distribution fails); each draw's logprob is the trainer's; temperature 0 draws
// the argmax; asking for them leaves the samples' own tokens as they were (a stream of their own).
TEST_F(SamplingTest, PromptAltTokensFollowTheModelAtEachPosition) {
  constexpr int64_t kRequests = 1000, k = 20;
  std::vector<SampleRequest> requests;
  for (int64_t i = 0; i < kRequests; ++i) {
    SampleRequest r = Request(5000 + i, 1);
    r.prompt = {kPrompt[0], kPrompt[1]};
    r.prompt_alt_tokens_k = k;
    requests.push_back(r);
  }
  const std::vector<SampleResult> results =
      Run(requests, EngineLimits{kRequests, int64_t{1} << 30});
  const std::vector<double> logp = TrainerDistribution({kPrompt[0]});
  std::vector<int64_t> counts(logp.size(), 0);
  for (const SampleResult& r : results) {
    ASSERT_EQ(r.prompt_alt_tokens.size(), static_cast<size_t>(k));
    for (int64_t j = 0; j < k; ++j) {
      const int64_t v = r.prompt_alt_tokens[j];
      ++counts.at(v);
      ASSERT_NEAR(r.prompt_alt_logprobs[j], logp[v], kFloat64Tol * std::abs(logp[v]));
    }
  }
  const auto [p, p_cold] = WarmAndCold(logp);
  double critical = 0, critical_cold = 0;
  EXPECT_LT(ChiSquare(counts, p, kRequests * k, &critical), critical);
  EXPECT_GT(ChiSquare(counts, p_cold, kRequests * k, &critical_cold), critical_cold);

  // Every position of a longer prompt, greedy: the trainer's argmax there, k times.
  SampleRequest greedy = Request(3, 4, 2);
  greedy.params.temperature = 0;
  greedy.prompt_alt_tokens_k = 3;
  SampleRequest plain = greedy;
  plain.prompt_alt_tokens_k = 0;
  const std::vector<SampleResult> both = Run({greedy, plain});
  const int64_t P = static_cast<int64_t>(kPrompt.size());
  ASSERT_EQ(both[0].prompt_alt_tokens.size(), static_cast<size_t>((P - 1) * 3));
  for (int64_t i = 0; i < P - 1; ++i) {
    const std::vector<double> d =
        TrainerDistribution(std::vector<int64_t>(kPrompt.begin(), kPrompt.begin() + i + 1));
    const int64_t argmax = std::max_element(d.begin(), d.end()) - d.begin();
    for (int64_t j = 0; j < 3; ++j) EXPECT_EQ(both[0].prompt_alt_tokens[i * 3 + j], argmax) << i;
  }
  SampleRequest seeded = Request(77, 5, 2), seeded_plain = Request(77, 5, 2);
  seeded.prompt_alt_tokens_k = 4;
  const std::vector<SampleResult> pair = Run({seeded, seeded_plain});
  for (int s = 0; s < 2; ++s) {
    EXPECT_EQ(pair[0].sequences[s].tokens, pair[1].sequences[s].tokens) << "sample " << s;
  }
  EXPECT_TRUE(pair[1].prompt_alt_tokens.empty());
}

// The same through a decode step: each sample's second token follows the model after the prompt
// and its own first token, so over many samples the second tokens' frequencies follow the
// marginal q(t2) = Σ_t1 p(t1 | prompt) · p(t2 | prompt, t1). The control: the marginal a decode
// step would give that sampled at temperature 0.5 (a temperature applied to the prefill's token
// only would be the bug) must fail.
TEST_F(SamplingTest, SecondTokenFrequenciesMatchTheModelAfterTheFirst) {
  constexpr int64_t kN = 20000;
  SampleRequest r = Request(2025, 2, kN);
  const SampleResult result = Run({r}, EngineLimits{kN, int64_t{1} << 30})[0];
  const int64_t V = policy_->config.vocab_size;
  std::vector<int64_t> counts(V, 0);
  for (const SampledSequence& s : result.sequences) {
    ASSERT_EQ(s.tokens.size(), 2u);
    ++counts.at(s.tokens[1]);
  }
  const std::vector<double> first = TrainerDistribution(kPrompt);
  std::vector<double> q(V, 0.0), q_cold(V, 0.0);
  for (int64_t t1 = 0; t1 < V; ++t1) {
    const std::vector<double> logp = TrainerDistribution(Concat(kPrompt, {t1}));
    double cold_total = 0;
    for (int64_t v = 0; v < V; ++v) cold_total += std::exp(2 * logp[v]);
    for (int64_t v = 0; v < V; ++v) {
      q[v] += std::exp(first[t1] + logp[v]);
      q_cold[v] += std::exp(first[t1]) * std::exp(2 * logp[v]) / cold_total;
    }
  }
  double critical = 0;
  const double chi = ChiSquare(counts, q, kN, &critical);
  EXPECT_LT(chi, critical) << "second tokens do not follow the model after the first";
  double critical_cold = 0;
  EXPECT_GT(ChiSquare(counts, q_cold, kN, &critical_cold), critical_cold);
  std::printf("[ chi-square ] second token: %.1f (critical %.1f); at temperature 0.5: %.1f\n", chi,
              critical, ChiSquare(counts, q_cold, kN, &critical_cold));
}

// Past --sample_max_sequences or --sample_kv_cache_mb the engine refuses with
// RESOURCE_EXHAUSTED (the front ends' 429), reserving nothing; the same request, retried once a
// running one has ended, runs and samples what it would have alone.
TEST_F(SamplingTest, AFullEngineRefusesAndTheRetryRunsOnceRoomIsFreed) {
  SampleRequest r;
  r.prompt = {4, 40, 9};
  r.num_samples = 2;
  r.params.max_tokens = 4;
  r.params.temperature = 0;
  const SampleResult alone = Run({r})[0];
  SampleRequest one = r;
  one.num_samples = 1;
  const int64_t need = SampleEngine::KvBytes(*policy_, r);
  for (const bool by_sequences : {true, false}) {
    SCOPED_TRACE(by_sequences ? "sequences" : "KV bytes");
    EngineLimits limits;
    limits.max_sequences = by_sequences ? 3 : 100;
    limits.kv_cache_bytes =
        by_sequences ? int64_t{1} << 30 : need + SampleEngine::KvBytes(*policy_, one);
    SampleEngine engine(limits);
    std::vector<SampleResult> results;
    auto keep = [&results](const absl::StatusOr<SampleResult>& res) {
      EXPECT_TRUE(res.ok()) << res.status().message();
      if (res.ok()) results.push_back(*res);
    };
    ASSERT_TRUE(engine.Admit(policy_, r, keep).ok());
    const int64_t reserved = engine.reserved_bytes();
    const absl::Status full = engine.Admit(policy_, r, keep);
    EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted) << full.message();
    EXPECT_NE(full.message().find("retry later"), std::string::npos) << full.message();
    EXPECT_EQ(engine.running_sequences(), 2);
    EXPECT_EQ(engine.reserved_bytes(), reserved);
    // Control: what still fits is admitted (the bound is the running total, not a second request).
    EXPECT_TRUE(engine.Admit(policy_, one, keep).ok());
    EXPECT_EQ(engine.running_sequences(), 3);
    while (engine.Step()) {
    }
    EXPECT_EQ(engine.running_sequences(), 0);
    EXPECT_EQ(engine.reserved_bytes(), 0);
    ASSERT_TRUE(engine.Admit(policy_, r, keep).ok()) << "the retry";
    while (engine.Step()) {
    }
    ASSERT_EQ(results.size(), 3u);
    EXPECT_EQ(results[2].sequences[0].tokens, alone.sequences[0].tokens);
    EXPECT_EQ(results[2].sequences[1].tokens, alone.sequences[1].tokens);
  }
}

// Issue 36: samples' KV caches and training calls reserve in one memory account. The account here
// holds the model and either a call or a sample, not both: while a sample is admitted a training
// call is RESOURCE_EXHAUSTED with nothing changed, and the same call runs once the sample is done.
// Before, each took memory the other did not see, and together they could pass the process's
// limit and wedge the server.
TEST_F(SamplingTest, SamplesAndTrainingCallsShareOneMemoryAccount) {
  if (TestDevice() != "cpu") GTEST_SKIP() << "training calls reserve memory on the CPU only";
  const std::string path = dir_->Sub("model");
  CreateModelOptions options;
  options.lora = LoraConfig{4, 8.0, true, true, true};
  SplitMix64 g(17);
  const std::vector<Datum> data = RandomData(g, {40, 30}, "cross_entropy", 128);
  SampleRequest r;
  r.prompt = {4, 40, 9};
  r.num_samples = 8;
  r.params.max_tokens = 60;
  // What each needs, from a runner whose account is large.
  int64_t model_bytes = 0, call_bytes = 0, policy_bytes = 0;
  {
    auto probe = MakeRunner(path);
    ASSERT_NE(probe, nullptr);
    auto id = probe->CreateModel(options);
    ASSERT_TRUE(id.ok()) << id.status();
    model_bytes = probe->memory_account()->reserved();
    auto frozen = probe->FreezePolicy(*id);
    ASSERT_TRUE(frozen.ok()) << frozen.status();
    policy_bytes = probe->memory_account()->reserved() - model_bytes;
    EXPECT_EQ(policy_bytes, (*frozen)->bytes) << "a sampler's copy is held in the account";
    CallShape shape;
    shape.tokens = 70;
    shape.compute_bytes = 8;
    shape.trainable_values = probe->GetInfo(*id)->trainable_parameters;
    shape.train_bytes = 8;
    call_bytes = CallBytes(TinyConfig("llama"), shape);
  }
  const int64_t kv_bytes = SampleEngine::KvBytes(*policy_, r);
  ASSERT_GT(model_bytes, 0);
  RunnerConfig rc;
  rc.base_model_path = path;
  rc.compute_dtype = ComputeDType::kFloat64;
  rc.device = TestDevice();
  rc.memory_budget_bytes = model_bytes + policy_bytes + std::max(call_bytes, kv_bytes) +
                           std::min(call_bytes, kv_bytes) / 2;
  auto small = ModelRunner::Create(rc);
  ASSERT_TRUE(small.ok()) << small.status();
  auto id = (*small)->CreateModel(options);
  ASSERT_TRUE(id.ok()) << id.status();
  auto policy = (*small)->FreezePolicy(*id);
  ASSERT_TRUE(policy.ok()) << policy.status();
  EngineLimits limits;
  limits.account = (*small)->memory_account();
  SampleEngine engine(limits);
  int answered = 0;
  ASSERT_TRUE(engine
                  .Admit(*policy, r,
                         [&](const absl::StatusOr<SampleResult>& res) {
                           EXPECT_TRUE(res.ok()) << res.status();
                           ++answered;
                         })
                  .ok());
  EXPECT_EQ((*small)->memory_account()->reserved(), model_bytes + policy_bytes + kv_bytes);
  const absl::StatusOr<ForwardBackwardResult> refused =
      (*small)->ForwardBackward(*id, data, "cross_entropy", {});
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();
  EXPECT_NE(refused.status().message().find("forward_backward: a call of 70 tokens"),
            std::string::npos)
      << refused.status();
  EXPECT_EQ((*small)->GetInfo(*id)->accumulated_tokens, 0) << "a refused call changed the model";
  while (engine.Step()) {
  }
  EXPECT_EQ(answered, 1);
  EXPECT_EQ((*small)->memory_account()->reserved(), model_bytes + policy_bytes)
      << "the sample gave its share back";
  *policy = nullptr;
  EXPECT_EQ((*small)->memory_account()->reserved(), model_bytes)
      << "the sampler's copy went with its last holder";
  const absl::StatusOr<ForwardBackwardResult> ran =
      (*small)->ForwardBackward(*id, data, "cross_entropy", {});
  ASSERT_TRUE(ran.ok()) << ran.status();
  EXPECT_GT((*small)->GetInfo(*id)->accumulated_tokens, 0);
  EXPECT_EQ((*small)->memory_account()->reserved(), model_bytes)
      << "a call holds memory only while it runs";
  ASSERT_TRUE((*small)->DeleteModel(*id).ok());
  EXPECT_EQ((*small)->memory_account()->reserved(), 0) << "a deleted model gave its share back";
}

TEST_F(SamplingTest, TopKAndTopPKeepOnlyTheMostLikely) {
  SampleRequest r = Request(3, 1, 2000);
  r.params.top_k = 5;
  const std::vector<double> logp = TrainerDistribution(kPrompt);
  std::vector<int64_t> order(logp.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return logp[a] > logp[b]; });
  std::map<int64_t, int> seen;
  const SampleResult top_k = Run({r}, EngineLimits{2000, int64_t{1} << 30})[0];
  for (const SampledSequence& s : top_k.sequences) ++seen[s.tokens[0]];
  EXPECT_EQ(seen.size(), 5u);
  for (const auto& [token, count] : seen) {
    EXPECT_NE(std::find(order.begin(), order.begin() + 5, token), order.begin() + 5) << token;
  }
  r.params.top_k = 0;
  r.params.top_p = 1e-6;  // the nucleus is the single most likely token
  const SampleResult top_p = Run({r}, EngineLimits{2000, int64_t{1} << 30})[0];
  for (const SampledSequence& s : top_p.sequences) ASSERT_EQ(s.tokens[0], order[0]);
}

TEST_F(SamplingTest, StopSequenceEndsTheSampleAndIsKept) {
  SampleRequest r = Request(1, 10);
  r.params.temperature = 0;
  const SampledSequence full = Run({r})[0].sequences[0];
  EXPECT_EQ(full.stop_reason, StopReason::kLength);
  r.params.stop = {{full.tokens[3], full.tokens[4]}, {128 - 1, 0}};
  const SampledSequence stopped = Run({r})[0].sequences[0];
  // Greedy may meet the pair earlier than position 3; it ends at the first occurrence.
  size_t end = 1;
  while (!(full.tokens[end - 1] == full.tokens[3] && full.tokens[end] == full.tokens[4])) ++end;
  EXPECT_EQ(stopped.stop_reason, StopReason::kStop);
  EXPECT_EQ(stopped.tokens,
            std::vector<int64_t>(full.tokens.begin(), full.tokens.begin() + end + 1));
}

// The index of the token with which `tokens` first decode to text containing one of `stops`, by
// the definition (the shortest prefix whose text contains one); -1 when none does.
int64_t FirstStopByDefinition(const std::vector<int64_t>& tokens,
                              const std::vector<std::string>& stops) {
  std::string text;
  for (size_t k = 0; k < tokens.size(); ++k) {
    text += TestTokenText(tokens[k]);
    for (const std::string& s : stops) {
      if (text.find(s) != std::string::npos) return static_cast<int64_t>(k);
    }
  }
  return -1;
}

// Tinker's string stops: a sample ends with the token whose text completes the first occurrence
// of a stop string in the sample's decoded text, and keeps that token.
TEST_F(SamplingTest, StopStringEndsTheSampleWhereItsTextFirstContainsIt) {
  SampleRequest r = Request(3, 24, /*n=*/3);
  const std::vector<SampledSequence> full = Run({r})[0].sequences;
  std::vector<std::string> stops;
  for (const SampledSequence& s : full) {
    ASSERT_EQ(s.stop_reason, StopReason::kLength);
    // The end of token 5's text and the start of token 6's: inside neither token alone, so a
    // matcher that looked at one token at a time (the broken control) would miss it.
    const std::string a = TestTokenText(s.tokens[5]), b = TestTokenText(s.tokens[6]);
    const std::string stop = a.substr(a.size() - 1) + b.substr(0, 2);
    ASSERT_EQ(a.find(stop), std::string::npos);
    ASSERT_EQ(b.find(stop), std::string::npos);
    stops.push_back(stop);
  }
  r.params.stop_strings = stops;
  const std::vector<SampledSequence> stopped = Run({r})[0].sequences;
  for (size_t i = 0; i < full.size(); ++i) {
    const int64_t end = FirstStopByDefinition(full[i].tokens, stops);
    ASSERT_GE(end, 0);
    ASSERT_LE(end, 6);
    EXPECT_EQ(stopped[i].stop_reason, StopReason::kStop) << i;
    EXPECT_EQ(stopped[i].tokens,
              std::vector<int64_t>(full[i].tokens.begin(), full[i].tokens.begin() + end + 1))
        << i;
    EXPECT_EQ(stopped[i].logprobs,
              std::vector<double>(full[i].logprobs.begin(), full[i].logprobs.begin() + end + 1));
  }
  // A string the samples never contain changes nothing.
  r.params.stop_strings = {"zz never"};
  const std::vector<SampledSequence> unstopped = Run({r})[0].sequences;
  for (size_t i = 0; i < full.size(); ++i) EXPECT_EQ(unstopped[i].tokens, full[i].tokens);
}

// The model's end-of-sequence tokens end a sample (kept, STOP) unless the request ignores them.
TEST_F(SamplingTest, EndOfSequenceTokensEndASampleUnlessIgnored) {
  SampleRequest r = Request(4, 16);
  r.params.temperature = 0;
  const SampledSequence full = Run({r})[0].sequences[0];
  ASSERT_EQ(full.stop_reason, StopReason::kLength);
  auto with_eos = std::make_shared<Policy>(*policy_);
  with_eos->config.eos_token_ids = {127, full.tokens[5]};  // 127: an id the sample may not emit
  size_t end = 0;
  while (full.tokens[end] != 127 && full.tokens[end] != full.tokens[5]) ++end;
  const SampledSequence stopped = Run({r}, {}, {with_eos})[0].sequences[0];
  EXPECT_EQ(stopped.stop_reason, StopReason::kStop);
  EXPECT_EQ(stopped.tokens,
            std::vector<int64_t>(full.tokens.begin(), full.tokens.begin() + end + 1));
  // Control: ignored, the same tokens run to max_tokens.
  r.params.ignore_eos = true;
  const SampledSequence ignored = Run({r}, {}, {with_eos})[0].sequences[0];
  EXPECT_EQ(ignored.stop_reason, StopReason::kLength);
  EXPECT_EQ(ignored.tokens, full.tokens);
}

TEST_F(SamplingTest, StopStringsNeedTheModelsTokenizer) {
  TempDir bare;
  std::unique_ptr<ModelRunner> runner = MakeRunner(WriteModel(bare, TinyConfig("llama"), 5));
  ASSERT_NE(runner, nullptr);
  EXPECT_FALSE(runner->limits().tokenizer);
  EXPECT_TRUE(runner_->limits().tokenizer);
  auto policy = runner->FreezePolicy("");
  ASSERT_TRUE(policy.ok()) << policy.status().message();
  SampleRequest r = Request(1, 4);
  r.params.stop_strings = {"ab"};
  SampleEngine engine(EngineLimits{});
  const absl::Status st = engine.Admit(*policy, r, [](const absl::StatusOr<SampleResult>&) {
    ADD_FAILURE() << "a refused request must not be answered";
  });
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("tokenizer"), absl::string_view::npos) << st.message();
}

// float32 and bf16 on the CPU: a sampled token's logprob is Forward's to the bit. Every path that
// computes a logprob (prefill, decode, Forward packed or alone, prompt logprobs) takes each sum in
// one order fixed by the token's position and the model's shapes (docs/kernels.md, "the reduction
// order"): the decode step's one-row products and in-place attention, the packed forward's
// products and attention, the sampler's whole logits row and the head's vocabulary chunks.
//
// Checked for samples decoded 1, 8 and 64 at a time after prompts of 1, 7 and 33 tokens, each
// scored by one Forward over all of its batch's sequences packed together, and for the prompts'
// own logprobs (compute_logprobs' path). Two controls show that the comparison sees the last bit:
// the sampler's former definition (its logits widened to float64, minus a float64 log-sum-exp)
// must differ from Forward's on some token, and each token scored one position later on most.
// On GPUs this is not yet promised (cuBLAS and flash attention choose their splits by shape), nor
// on CPUs without AVX2, where float32 products are the BLAS's (kernels/gemv.h).
// Two shapes: the tiny llama, and a qwen3 (q/k norms, tied head) whose head_dim of 16 takes the
// vector attention loop, whose hidden size fills Gemv's sixteen lanes four times, and whose 9,000
// tokens make the head fold two vocabulary chunks.
struct Precision {
  ComputeDType dtype;
  bool wide;
  std::string family = "llama";  // unless wide; a mixture of experts routes in the decode too
};

ModelConfig PrecisionConfig(const Precision& p) {
  if (!p.wide) return TinyConfig(p.family);
  ModelConfig c = TinyConfig("qwen3");
  c.hidden_size = 64;
  c.intermediate_size = 96;
  c.head_dim = 16;
  c.vocab_size = 9000;
  return c;
}

class SamplingPrecisionTest : public SamplingTest, public ::testing::WithParamInterface<Precision> {
 protected:
  void SetUp() override {
    if (TestDevice() != "cpu") GTEST_SKIP() << "the bitwise promise is the CPU's";
    if (!kernels::GemvRunsHere())
      GTEST_SKIP() << "the bitwise promise needs Gemv (AVX2 or AVX-512)";
    dir_ = std::make_unique<TempDir>();
    runner_ = MakeRunner(WriteModel(*dir_, PrecisionConfig(GetParam()), 5), GetParam().dtype);
    ASSERT_NE(runner_, nullptr);
    ASSERT_NO_FATAL_FAILURE(TrainedLora(4, 9, 3, &model_, &policy_));
  }

  // Forward's logprobs of each sequence's tokens after its first, the sequences packed in one call.
  std::vector<std::vector<double>> ForwardLogprobs(const std::vector<std::vector<int64_t>>& seqs,
                                                   const std::string& model) const {
    std::vector<Datum> data;
    for (const std::vector<int64_t>& sequence : seqs) {
      Datum& d = data.emplace_back();
      d.tokens.assign(sequence.begin(), sequence.end() - 1);
      d.loss_fn_inputs["target_tokens"] = TensorData::Int64({sequence.begin() + 1, sequence.end()});
      d.loss_fn_inputs["weights"] = TensorData::Float32(std::vector<float>(d.tokens.size(), 1.f));
    }
    auto fwd = runner_->Forward(model, data, "cross_entropy", {});
    EXPECT_TRUE(fwd.ok()) << fwd.status().message();
    std::vector<std::vector<double>> out;
    if (!fwd.ok()) return out;
    for (const auto& o : fwd->outputs) out.emplace_back(o.logprobs.begin(), o.logprobs.end());
    return out;
  }
  std::vector<double> ForwardLogprobs(const std::vector<int64_t>& sequence) const {
    return ForwardLogprobs({sequence}, model_)[0];
  }

  // The sampler's former logprob of each token after position `from`: the head's logits widened
  // to float64, minus their float64 log-sum-exp (the broken control).
  std::vector<double> WidenedLogprobs(const std::vector<int64_t>& sequence, size_t from,
                                      const Policy& policy) const {
    at::NoGradGuard no_grad;
    const std::vector<int64_t> inputs(sequence.begin(), sequence.end() - 1);
    const at::Tensor z = kernels::HeadLogits(Head(TrainerHidden(inputs, nullptr, &policy), &policy))
                             .to(at::kDouble)
                             .contiguous();
    const int64_t V = z.size(1);
    std::vector<double> out;
    for (size_t t = from - 1; t + 1 < sequence.size(); ++t) {
      const double* row = z.data_ptr<double>() + t * V;
      out.push_back(row[sequence[t + 1]] - LogSumExp(row, V));
    }
    return out;
  }

  // Samples `n` × 6 tokens after `prompt` from `policy` (frozen from `model`), with the prompt's
  // logprobs, and expects every logprob to be Forward's to the bit. Counts into `controls` the
  // tokens whose former and shifted scores differ from Forward's, and into `tokens` all checked.
  void ExpectForwardsBits(const std::string& model, const std::shared_ptr<const Policy>& policy,
                          const std::vector<int64_t>& prompt, int64_t n);

  size_t tokens_ = 0, widened_apart_ = 0, shifted_apart_ = 0, shifted_ = 0;
};

void SamplingPrecisionTest::ExpectForwardsBits(const std::string& model,
                                               const std::shared_ptr<const Policy>& policy,
                                               const std::vector<int64_t>& prompt, int64_t n) {
  SampleRequest r = Request(7, 6, n);
  r.prompt = prompt;
  r.prompt_logprobs = true;
  const SampleResult result = Run({r}, {}, {policy})[0];
  ASSERT_EQ(result.sequences.size(), static_cast<size_t>(n));
  const size_t P = prompt.size();
  std::vector<std::vector<int64_t>> seqs;
  for (const SampledSequence& s : result.sequences) seqs.push_back(Concat(prompt, s.tokens));
  const std::vector<std::vector<double>> f = ForwardLogprobs(seqs, model);
  ASSERT_EQ(f.size(), seqs.size());
  for (size_t i = 0; i < seqs.size(); ++i) {
    const SampledSequence& s = result.sequences[i];
    ASSERT_EQ(f[i].size(), seqs[i].size() - 1);
    ASSERT_EQ(s.logprobs.size(), s.tokens.size());
    const std::vector<double> widened = WidenedLogprobs(seqs[i], P, *policy);
    for (size_t t = 0; t < s.tokens.size(); ++t) {
      EXPECT_EQ(s.logprobs[t], f[i][P - 1 + t])
          << "prompt " << P << ", batch " << n << ", sample " << i << ", token " << t;
      widened_apart_ += widened[t] != f[i][P - 1 + t];
      if (P + t < f[i].size()) {
        shifted_apart_ += s.logprobs[t] != f[i][P + t];
        ++shifted_;
      }
      ++tokens_;
    }
  }
  // compute_logprobs' path: the prompt's own logprobs, position 0 having none.
  ASSERT_EQ(result.prompt_logprobs.size(), P);
  if (P > 1) {
    const std::vector<double> own = ForwardLogprobs({prompt}, model)[0];
    for (size_t t = 1; t < P; ++t) {
      EXPECT_EQ(result.prompt_logprobs[t], own[t - 1]) << "prompt " << P << " position " << t;
    }
  }
}

TEST_P(SamplingPrecisionTest, SampledLogprobsAreForwardsToTheBit) {
  std::vector<int64_t> long_prompt(33);
  for (size_t i = 0; i < long_prompt.size(); ++i) long_prompt[i] = (7 * i + 3) % 128;
  for (const std::vector<int64_t>& prompt : {std::vector<int64_t>{42}, kPrompt, long_prompt}) {
    for (int64_t n : {1, 8, 64}) ExpectForwardsBits(model_, policy_, prompt, n);
  }
  EXPECT_GT(widened_apart_, 0u) << "the comparison must see a last-bit difference";
  EXPECT_GT(shifted_apart_, shifted_ / 2) << "tokens scored in the wrong context must differ";
  std::printf(
      "[ precision ] %s: %zu tokens equal Forward's; the former definition differs on %zu\n",
      ComputeDTypeName(GetParam().dtype), tokens_, widened_apart_);
  // That the precision under test ran: the same policy trained in float64 scores the same
  // sequence otherwise.
  const std::vector<int64_t> sequence = Concat(kPrompt, {3, 9, 27});
  const std::vector<double> in_precision = ForwardLogprobs(sequence);
  runner_ = MakeRunner(dir_->Sub("model"), ComputeDType::kFloat64);
  ASSERT_NE(runner_, nullptr);
  ASSERT_NO_FATAL_FAILURE(TrainedLora(4, 9, 3, &model_, &policy_));
  const std::vector<double> exact = ForwardLogprobs(sequence);
  ASSERT_EQ(exact.size(), in_precision.size());
  double gap = 0;
  for (size_t t = 0; t < exact.size(); ++t) {
    gap = std::max(gap, std::abs(exact[t] - in_precision[t]));
  }
  EXPECT_GT(gap, 0.0) << "float64 and " << ComputeDTypeName(GetParam().dtype)
                      << " agree to the last bit";
}

// Adapters of ranks 4 and 8 and the base model decode in one forward, rows of each beside the
// others', and each sample's logprobs are its own model's Forward's to the bit. The base rows are
// scored by a fresh adapter's Forward (B = 0: every low-rank term is an exact zero).
TEST_P(SamplingPrecisionTest, SeveralAdaptersInOneDecodeAreEachForwardsToTheBit) {
  std::string rank8_model;
  std::shared_ptr<const Policy> rank8;
  ASSERT_NO_FATAL_FAILURE(TrainedLora(8, 10, 4, &rank8_model, &rank8));
  auto base = runner_->FreezePolicy("");
  ASSERT_TRUE(base.ok()) << base.status().message();
  const std::vector<std::shared_ptr<const Policy>> policies = {rank8, *base, policy_, rank8};
  CreateModelOptions fresh_options;
  fresh_options.lora = LoraConfig{2, 4.0, true, true, true};
  auto fresh = runner_->CreateModel(fresh_options);
  ASSERT_TRUE(fresh.ok()) << fresh.status().message();
  const std::vector<std::string> models = {rank8_model, *fresh, model_, rank8_model};
  std::vector<SampleRequest> requests;
  for (int i = 0; i < 4; ++i) requests.push_back(Request(30 + i, 8 + i, 3));
  int64_t forwards = 0;
  const std::vector<SampleResult> mixed = Run(requests, {}, policies, &forwards);
  EXPECT_EQ(forwards, 10) << "one decode forward per step serves every policy";
  size_t checked = 0;
  for (size_t i = 0; i < requests.size(); ++i) {
    std::vector<std::vector<int64_t>> seqs;
    for (const SampledSequence& s : mixed[i].sequences) seqs.push_back(Concat(kPrompt, s.tokens));
    const std::vector<std::vector<double>> f = ForwardLogprobs(seqs, models[i]);
    ASSERT_EQ(f.size(), seqs.size());
    for (size_t k = 0; k < seqs.size(); ++k) {
      const SampledSequence& s = mixed[i].sequences[k];
      for (size_t t = 0; t < s.tokens.size(); ++t, ++checked) {
        EXPECT_EQ(s.logprobs[t], f[k][kPrompt.size() - 1 + t])
            << "request " << i << " sample " << k << " token " << t;
      }
    }
  }
  EXPECT_GT(checked, 90u);
  // Control: another adapter's Forward scores the same tokens otherwise.
  const std::vector<int64_t> seq = Concat(kPrompt, mixed[0].sequences[0].tokens);
  const std::vector<double> by4 = ForwardLogprobs({seq}, model_)[0];
  EXPECT_NE(by4[kPrompt.size() - 1], mixed[0].sequences[0].logprobs[0]);
}

// A full fine-tune's policy holds every weight in the compute dtype: bitwise the cast that each
// use of the trainer's fp32 masters makes (half their memory under bf16, and a decode step casts
// nothing), and its samples' logprobs are Forward's to the bit.
TEST_P(SamplingPrecisionTest, AFullFineTunesPolicyHoldsTheTrainersWeightsInTheComputeDType) {
  CreateModelOptions options;
  options.lora.reset();
  options.loss_reduction = LossReduction::kSum;
  auto model = runner_->CreateModel(options);
  ASSERT_TRUE(model.ok()) << model.status().message();
  SplitMix64 g(3);
  ASSERT_TRUE(runner_
                  ->ForwardBackward(*model, RandomData(g, {9, 14}, "cross_entropy", 128),
                                    "cross_entropy", {})
                  .ok());
  AdamParams adam;
  adam.learning_rate = 1e-2;
  ASSERT_TRUE(runner_->OptimStep(*model, adam).ok());
  auto policy = runner_->FreezePolicy(*model);
  ASSERT_TRUE(policy.ok()) << policy.status().message();
  auto masters = runner_->Snapshot(*model, StateKind::kParams);
  ASSERT_TRUE(masters.ok()) << masters.status().message();

  const at::ScalarType dt =
      GetParam().dtype == ComputeDType::kBFloat16 ? at::kBFloat16 : at::kFloat;
  // Each frozen tensor against the trainer's masters; returns the bytes the tensors hold.
  auto expect_cast = [dt](const std::map<std::string, at::Tensor>& frozen,
                          const std::vector<NamedValues>& masters) {
    EXPECT_EQ(frozen.size(), masters.size());
    int64_t bytes = 0;
    size_t chopped_apart = 0;
    for (const NamedValues& v : masters) {
      auto it = frozen.find(v.name);
      if (it == frozen.end()) {
        ADD_FAILURE() << v.name << " is not frozen";
        continue;
      }
      const at::Tensor w = it->second.cpu();
      EXPECT_EQ(w.scalar_type(), dt) << v.name;
      bytes += static_cast<int64_t>(w.nbytes());
      // The masters are fp32, so their float64 snapshot converts back exactly.
      const at::Tensor master = at::tensor(v.values, at::kDouble).view(v.shape).to(at::kFloat);
      EXPECT_TRUE(at::equal(w, master.to(dt))) << v.name << " is not the trainer's cast";
      // Control: the same masters rounded toward zero (the low 16 bits cleared) must not pass.
      const at::Tensor chopped =
          at::bitwise_and(master.view(at::kInt), static_cast<int32_t>(0xFFFF0000u))
              .view(at::kFloat)
              .to(dt);
      chopped_apart += at::equal(w, chopped) ? 0 : 1;
    }
    EXPECT_GT(chopped_apart, masters.size() / 2) << "the comparison cannot tell roundings apart";
    return bytes;
  };
  EXPECT_EQ((*policy)->bytes, expect_cast((*policy)->weights.Named((*policy)->config), *masters));
  ExpectForwardsBits(*model, *policy, kPrompt, 8);

  // An adapter's policy likewise (SetUp's).
  auto adapter = runner_->Snapshot(model_, StateKind::kParams);
  ASSERT_TRUE(adapter.ok()) << adapter.status().message();
  ASSERT_TRUE(policy_->lora.has_value());
  EXPECT_EQ(policy_->bytes, expect_cast(policy_->lora->Parameters(), *adapter));
}

INSTANTIATE_TEST_SUITE_P(Dtypes, SamplingPrecisionTest,
                         ::testing::Values(Precision{ComputeDType::kFloat32, false},
                                           Precision{ComputeDType::kBFloat16, false},
                                           Precision{ComputeDType::kFloat32, true},
                                           Precision{ComputeDType::kBFloat16, true},
                                           Precision{ComputeDType::kFloat32, false, "qwen3_moe"},
                                           Precision{ComputeDType::kBFloat16, false, "qwen2_moe"},
                                           Precision{ComputeDType::kBFloat16, false, "mixtral"}),
                         [](const auto& info) {
                           return std::string(ComputeDTypeName(info.param.dtype)) +
                                  (info.param.wide ? "Wide" : "") +
                                  (info.param.family == "llama" ? "" : "_" + info.param.family);
                         });

TEST(SampleValidation, EachBadFieldIsNamed) {
  const ModelLimits model{128, 64};
  const SampleLimits limits;
  SampleRequest ok;
  ok.prompt = {1, 2, 3};
  ok.params.max_tokens = 4;
  EXPECT_TRUE(ValidateSampleRequest(ok, model, limits).ok());
  auto expect_for = [&](const ModelLimits& m, std::function<void(SampleRequest&)> edit,
                        const std::string& field) {
    SampleRequest r = ok;
    edit(r);
    const absl::Status st = ValidateSampleRequest(r, m, limits);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << field;
    EXPECT_NE(std::string(st.message()).find(field), std::string::npos) << st.message();
  };
  auto expect = [&](std::function<void(SampleRequest&)> edit, const std::string& field) {
    expect_for(model, std::move(edit), field);
  };
  expect([](SampleRequest& r) { r.prompt.clear(); }, "prompt");
  expect([](SampleRequest& r) { r.prompt[1] = 128; }, "prompt[1]");
  expect([](SampleRequest& r) { r.params.max_tokens = 0; }, "max_tokens");
  expect([](SampleRequest& r) { r.params.max_tokens = 62; }, "context");
  expect([](SampleRequest& r) { r.prompt.assign(65, 1); }, "prompt: has 65 tokens");
  expect([](SampleRequest& r) { r.prompt.assign(64, 1); }, "sampling_params.max_tokens");
  expect([](SampleRequest& r) { r.params.temperature = -0.5; }, "temperature");
  expect([](SampleRequest& r) { r.params.temperature = NAN; }, "temperature");
  expect([](SampleRequest& r) { r.params.top_p = 0; }, "top_p");
  expect([](SampleRequest& r) { r.params.top_p = 1.5; }, "top_p");
  expect([](SampleRequest& r) { r.num_samples = 0; }, "num_samples");
  expect([](SampleRequest& r) { r.num_samples = 65; }, "num_samples");
  expect([](SampleRequest& r) { r.topk_prompt_logprobs = 21; }, "topk_prompt_logprobs");
  expect([](SampleRequest& r) { r.topk_sample_logprobs = 21; }, "topk_sample_logprobs");
  expect([](SampleRequest& r) { r.topk_sample_logprobs = -1; }, "topk_sample_logprobs");
  expect([](SampleRequest& r) { r.prompt_alt_tokens_k = 21; },
         "prompt_alt_tokens_k: must be in [0, 20], got 21");
  expect(
      [](SampleRequest& r) {
        r.prompt = {1};
        r.prompt_alt_tokens_k = 2;
      },
      "prompt_alt_tokens_k: needs a prompt of at least 2 tokens");
  expect([](SampleRequest& r) { r.prompt_logprobs_last_n = 1; }, "needs prompt_logprobs");
  expect(
      [](SampleRequest& r) {
        r.prompt_logprobs = true;
        r.prompt_logprobs_last_n = 3;  // 3 tokens: at most 2
      },
      "prompt_logprobs_last_n: must be in [1, len(prompt) - 1 = 2], got 3");
  SampleRequest target = ok;
  target.target_prompt_k = 2;
  target.target_prompt_ids = {-1, 5, -1, -1};
  EXPECT_TRUE(ValidateSampleRequest(target, model, limits).ok());
  auto expect_target = [&](std::function<void(SampleRequest&)> edit, const std::string& field) {
    expect(
        [&](SampleRequest& r) {
          r.target_prompt_k = target.target_prompt_k;
          r.target_prompt_ids = target.target_prompt_ids;
          edit(r);
        },
        field);
  };
  expect_target([](SampleRequest& r) { r.target_prompt_ids.pop_back(); },
                "must be [len(prompt) - 1, K] = [2, 2], got 3 ids");
  expect_target([](SampleRequest& r) { r.target_prompt_ids[3] = 128; },
                "target_prompt_logprobs[1][1]: token id 128");
  expect_target([](SampleRequest& r) { r.target_prompt_ids[0] = -2; },
                "target_prompt_logprobs[0][0]");
  expect_target([](SampleRequest& r) { r.target_prompt_ids[1] = -1; }, "names no token id");
  expect_target(
      [](SampleRequest& r) {
        r.target_prompt_k = 21;
        r.target_prompt_ids.assign(42, 1);
      },
      "K = 21 ids per position must be in [1, 20]");
  expect([](SampleRequest& r) { r.params.stop = {{}}; }, "stop[0]");
  expect([](SampleRequest& r) { r.params.stop = {{5, -1}}; }, "stop[0][1]");
  // Stop strings: only with a tokenizer, non-empty, and bounded in number and length.
  expect([](SampleRequest& r) { r.params.stop_strings = {"x"}; }, "has none");
  const ModelLimits with_tokenizer{128, 64, /*tokenizer=*/true};
  SampleRequest strings = ok;
  strings.params.stop_strings = {"\n\nUser:", "x"};
  EXPECT_TRUE(ValidateSampleRequest(strings, with_tokenizer, limits).ok());
  expect_for(
      with_tokenizer,
      [](SampleRequest& r) {
        r.params.stop_strings = {"a", ""};
      },
      "stop[1]");
  expect_for(
      with_tokenizer, [](SampleRequest& r) { r.params.stop_strings.assign(33, "a"); },
      "at most 32");
  expect_for(
      with_tokenizer, [](SampleRequest& r) { r.params.stop_strings = {std::string(1025, 'a')}; },
      "longer than 1024");
}

}  // namespace
}  // namespace tinkerd::testing
