#include "runner/sample/engine.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <optional>
#include <random>

#include "absl/strings/str_cat.h"
#include "kernels/gemv.h"
#include "kernels/logprob_head.h"
#include "kernels/parallel.h"
#include "runner/sample/choose.h"
#include "runner/sample/choose_rows.h"
#include "runner/tokenizer/stop_strings.h"
#include "runner/util/exception_status.h"
#include "runner/util/rng.h"
#include "runner/util/status_macros.h"

namespace tinkerd {

struct SampleEngine::Sample {
  SampledSequence out;
  SplitMix64 rng{0};
  std::vector<at::Tensor> k_LNKd, v_LNKd;   // per layer: keys and values of the fed-back tokens
  int64_t cached = 0;                       // of out.tokens, those in the cache (all but the last)
  size_t reported = 0;                      // of out.tokens, those handed to the job's Progress
  std::optional<StopStrings> stop_strings;  // when the request names any
  bool finished = false;
};

struct SampleEngine::Job {
  std::shared_ptr<const Policy> policy;
  SampleRequest request;
  Done done;
  Progress progress;
  int64_t bytes = 0;
  Reservation memory;  // `bytes` in the process's account, when the engine has one
  std::vector<at::Tensor> k_LPKd, v_LPKd;  // per layer: the prompt's, shared by the samples
  std::vector<Sample> samples;
  SplitMix64 alt_rng{0};  // prompt_alt_tokens_k's draws: a stream of their own
  SampleResult result;
  bool failed = false;

  int64_t prompt_length() const { return static_cast<int64_t>(request.prompt.size()); }
  bool finished() const {
    return failed ||
           std::all_of(samples.begin(), samples.end(), [](const Sample& s) { return s.finished; });
  }
};

namespace {

template <class F>
absl::Status Guard(const char* what, F&& f) {
  try {
    return f();
  } catch (...) {
    return ExceptionStatus(what, std::current_exception());
  }
}

const LoraAdapter* LoraOf(const Policy& p) {
  return p.lora ? &*p.lora : nullptr;
}

// What a forward runs on beyond its policy's weights: a sharded base's layers, gathered as it
// reaches them (Policy::gathered), or the exchanges that take its routed layers' rows to the ranks
// holding their experts (Policy::spread).
struct OnRanks {
  const LayerSource* layers = nullptr;
  const LeadSlots* lead = nullptr;
};

// Runs `forward` on the policy's base: its own weights, a sharded base gathered for this forward
// alone, or with the experts spread over ranks.
absl::Status OnBase(const Policy& p,
                    absl::FunctionRef<void(const BaseWeights& w, const OnRanks& at)> forward) {
  if (p.gathered != nullptr) {
    return (*p.gathered)([&](const BaseWeights& rest, const LayerSource& layers) {
      forward(rest, OnRanks{.layers = &layers});
    });
  }
  if (p.spread != nullptr) {
    return (*p.spread)([&](const LeadSlots& lead) { forward(p.weights, OnRanks{.lead = &lead}); });
  }
  forward(p.weights, OnRanks{});
  return absl::OkStatus();
}

// `w`: the policy's base weights as its forward holds them (OnBase).
kernels::LogprobHeadParams Head(const Policy& p, const BaseWeights& w,
                                const at::Tensor& hidden_TD) {
  kernels::LogprobHeadParams head;
  head.hidden_TD = hidden_TD;
  head.weight_VD = w.lm_head_VD;
  if (const LoraPair* pair = HeadAdapter(LoraOf(p))) {
    head.lora_A_rD = pair->A_rI;
    head.lora_B_Vr = pair->B_Or;
    head.lora_scale = p.lora->scale();
  }
  return head;
}

// Sets a choice's logprobs (the token's and its top-k's) to the head's: z_v − lse in the logits'
// accumulate type, lse folded as TokenLogprobs folds it (kernels::LogitsLse), so that a sampled
// token's logprob is the trainer's to the bit. The token was drawn from the same logits widened.
void HeadLogprobs(const at::Tensor& z_SV, const at::Tensor& lse_S, int64_t row, Choice& c) {
  AT_DISPATCH_FLOATING_TYPES(z_SV.scalar_type(), "head_logprobs", [&] {
    const scalar_t* z = z_SV.data_ptr<scalar_t>() + row * z_SV.stride(0);
    const scalar_t lse = lse_S.data_ptr<scalar_t>()[row];
    c.logprob = static_cast<double>(z[c.token] - lse);
    for (auto& [v, logprob] : c.top) logprob = static_cast<double>(z[v] - lse);
  });
}

// Rows of a decode step by policy: (policy, rows) runs in row order.
using Runs = std::vector<std::pair<const Policy*, int64_t>>;

// Next-token logits of each row by its run's head, each adapter on its own rows.
at::Tensor Logits(const Runs& runs, const BaseWeights& w, const at::Tensor& hidden_SD) {
  if (runs.size() == 1) return kernels::HeadLogits(Head(*runs.front().first, w, hidden_SD));
  kernels::LogprobHeadParams head;
  head.hidden_TD = hidden_SD;
  head.weight_VD = w.lm_head_VD;
  for (const auto& [policy, rows] : runs) {
    kernels::LoraRun& run = head.lora_runs.emplace_back();
    run.rows = rows;
    if (const LoraPair* pair = HeadAdapter(LoraOf(*policy))) {
      run.A_rI = pair->A_rI;
      run.B_Or = pair->B_Or;
      run.scale = policy->lora->scale();
    }
  }
  return kernels::HeadLogits(head);
}

// Whether two policies can decode in one forward: the same base tensors and numerics, whatever
// their adapters.
bool SharesBase(const Policy& a, const Policy& b) {
  return a.compute_dtype == b.compute_dtype && a.device == b.device && a.rope == b.rope &&
         a.gathered == b.gathered && a.spread == b.spread && a.weights.Shares(b.weights);
}

// Every row's experts in each routed layer of one forward (ForwardOptions::on_routes), on the host.
struct RouteLog {
  std::vector<at::Tensor> layers_Nk;  // by routed index

  void Attach(ForwardOptions& options) {
    options.on_routes = [this](int64_t routed, const at::Tensor& experts_Nk) {
      if (layers_Nk.size() <= static_cast<size_t>(routed)) layers_Nk.resize(routed + 1);
      layers_Nk[routed] = experts_Nk.cpu();
    };
  }
  at::Tensor Stacked() const { return at::stack(layers_Nk, 1).contiguous(); }  // [N, R, k]
};

// `runs`: the policy of each run of rows (Adapters::runs, in order), whose experts the exchanges
// of a spread model ask for.
ForwardOptions Options(const Policy& p, const KvStep* kv, const OnRanks& at,
                       const std::vector<const Policy*>& runs) {
  ForwardOptions o{.recompute_layers = false,
                   .compute_dtype = p.compute_dtype,
                   .rope = p.rope.get(),
                   .kv = kv,
                   .layers = at.layers};
  if (at.lead != nullptr) {
    std::vector<int64_t> keys;
    for (const Policy* run : runs) keys.push_back(ExpertsKey(*run));
    o.expert_slots_of = [lead = at.lead, keys](int64_t layer, size_t run) {
      return lead->of(layer, keys.at(run));
    };
  }
  return o;
}

at::Tensor Tokens(const std::vector<int64_t>& ids, at::Device device) {
  return at::tensor(at::ArrayRef<int64_t>(ids), at::kLong).to(device);
}

// Appends the chosen token and ends the sample on an end-of-sequence token (`eos`, unless the
// request ignores them), a stop sequence, a stop string or at max_tokens.
void Take(const SamplingParams& params, const std::vector<int64_t>& eos, const Choice& c,
          SampledSequence& out, bool& finished, std::optional<StopStrings>& stop_strings) {
  out.tokens.push_back(c.token);
  out.logprobs.push_back(c.logprob);
  if (!c.top.empty()) out.topk_logprobs.push_back(c.top);
  const bool at_eos = !params.ignore_eos && std::find(eos.begin(), eos.end(), c.token) != eos.end();
  if (at_eos || (stop_strings && stop_strings->Append(c.token))) {
    out.stop_reason = StopReason::kStop;
    finished = true;
    return;
  }
  for (const std::vector<int64_t>& stop : params.stop) {
    if (stop.size() <= out.tokens.size() &&
        std::equal(stop.rbegin(), stop.rend(), out.tokens.rbegin())) {
      out.stop_reason = StopReason::kStop;
      finished = true;
      return;
    }
  }
  if (static_cast<int64_t>(out.tokens.size()) >= params.max_tokens) {
    out.stop_reason = StopReason::kLength;
    finished = true;
  }
}

// Prompts prefilled in one packed forward hold at most this many tokens together (a longer prompt
// runs alone): it bounds a prefill's activations as --micro_batch_tokens bounds training's.
constexpr int64_t kPrefillTokens = 8192;

// target_prompt_logprobs: [P - 1, K] logprobs of the asked ids (row i at prompt position i + 1,
// from hidden row i), NaN where the id is -1, from one logprob head over the rows from the first
// that asks anything: its K targets per row ride in the head's one pass over the vocabulary.
std::vector<double> TargetPromptLogprobs(const Policy& pol, const BaseWeights& w,
                                         const SampleRequest& r, const at::Tensor& hidden_PD) {
  const int64_t rows = std::ssize(r.prompt) - 1, K = r.target_prompt_k;
  std::vector<double> out(rows * K, std::numeric_limits<double>::quiet_NaN());
  const auto asked = std::find_if(r.target_prompt_ids.begin(), r.target_prompt_ids.end(),
                                  [](int64_t id) { return id != -1; });
  const int64_t row0 = (asked - r.target_prompt_ids.begin()) / K;
  std::vector<int64_t> ids(r.target_prompt_ids.begin() + row0 * K, r.target_prompt_ids.end());
  for (int64_t& id : ids) id = std::max<int64_t>(id, 0);  // -1's logprob is computed, then dropped
  kernels::LogprobHeadParams head = Head(pol, w, hidden_PD.narrow(0, row0, rows - row0));
  head.targets_T = Tokens(ids, pol.device).view({rows - row0, K});
  const at::Tensor logp = kernels::TokenLogprobs(head).logp_T.to(at::kDouble).cpu().contiguous();
  const double* p = logp.data_ptr<double>();
  for (int64_t i = row0 * K; i < rows * K; ++i) {
    if (r.target_prompt_ids[i] != -1) out[i] = p[i - row0 * K];
  }
  return out;
}

}  // namespace

SampleEngine::SampleEngine(EngineLimits limits) : limits_(limits) {
  std::random_device rd;
  unseeded_ = (static_cast<uint64_t>(rd()) << 32) ^ rd();
}

SampleEngine::~SampleEngine() {
  FailAll(absl::UnavailableError("the sampler is shutting down"));
}

int64_t SampleEngine::KvBytes(const Policy& policy, const SampleRequest& r) {
  const ModelConfig& c = policy.config;
  const int64_t per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim *
                            static_cast<int64_t>(at::elementSize(policy.compute_dtype));
  const int64_t tokens =
      static_cast<int64_t>(r.prompt.size()) + r.num_samples * r.params.max_tokens;
  // Recorded routes: k int64 ids per token and routed layer, held until the result goes.
  const int64_t routes = r.routed_experts ? c.moe.RoutedLayers() * c.moe.top_k * 8 : 0;
  return (per_token + routes) * tokens;
}

absl::Status SampleEngine::Admit(std::shared_ptr<const Policy> policy, SampleRequest request,
                                 Done done, Progress progress) {
  ModelLimits matchable;
  matchable.tokenizer = policy->texts != nullptr;
  RETURN_IF_ERROR(CheckStopStringsMatchable(request.params.stop_strings.size(), matchable));
  auto job = std::make_unique<Job>();
  job->bytes = KvBytes(*policy, request);
  if (request.num_samples > limits_.max_sequences || job->bytes > limits_.kv_cache_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "request needs ", request.num_samples, " sequences and ", job->bytes,
        " bytes of KV cache; the server holds at most ", limits_.max_sequences, " and ",
        limits_.kv_cache_bytes, " (--sample_max_sequences, --sample_kv_cache_mb)"));
  }
  absl::MutexLock lock(&mu_);
  if (sequences_ + request.num_samples > limits_.max_sequences ||
      bytes_ + job->bytes > limits_.kv_cache_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat("sampler is full: ", sequences_,
                                                     " sequences running, ", bytes_,
                                                     " bytes of KV cache reserved; retry later"));
  }
  if (limits_.account != nullptr) {
    ASSIGN_OR_RETURN(job->memory,
                     limits_.account->Reserve(job->bytes, "sample: its KV cache", "; retry later"));
  }
  const uint64_t seed = request.params.seed ? *request.params.seed : unseeded_++;
  job->alt_rng = SplitMix64(SplitMix64(seed).Next());  // stream 0; the samples' are 1, 2, ...
  for (int64_t i = 0; i < request.num_samples; ++i) {
    Sample s;
    // Each sample its own stream: its tokens do not depend on what else is sampled.
    s.rng = SplitMix64(
        SplitMix64(seed ^ (0xD1B54A32D192ED03ull * static_cast<uint64_t>(i + 1))).Next());
    job->samples.push_back(std::move(s));
  }
  sequences_ += request.num_samples;
  bytes_ += job->bytes;
  job->policy = std::move(policy);
  job->request = std::move(request);
  if (!job->request.params.stop_strings.empty()) {
    for (Sample& s : job->samples) {
      s.stop_strings.emplace(job->policy->texts.get(), &job->request.params.stop_strings);
    }
  }
  job->done = std::move(done);
  job->progress = std::move(progress);
  admitted_.push_back(std::move(job));
  return absl::OkStatus();
}

void SampleEngine::Release(Job& job) {
  job.memory = Reservation();
  absl::MutexLock lock(&mu_);
  sequences_ -= job.request.num_samples;
  bytes_ -= job.bytes;
}

absl::Status SampleEngine::Prefill(const std::vector<Job*>& jobs) {
  const Policy& pol = *jobs.front()->policy;
  return OnBase(pol, [&](const BaseWeights& w, const OnRanks& at) {
    const int64_t layers = pol.config.num_hidden_layers;
    std::vector<int64_t> tokens, cu{0}, last;
    for (Job* job : jobs) {
      tokens.insert(tokens.end(), job->request.prompt.begin(), job->request.prompt.end());
      cu.push_back(cu.back() + job->prompt_length());
      last.push_back(cu.back() - 1);
      job->k_LPKd.resize(layers);
      job->v_LPKd.resize(layers);
    }
    KvStep kv;
    kv.past.assign(jobs.size(), 0);
    kv.extend = [&jobs, &cu](int64_t layer, const at::Tensor& k_TKd, const at::Tensor& v_TKd) {
      for (size_t i = 0; i < jobs.size(); ++i) {
        const int64_t P = cu[i + 1] - cu[i];
        // Copies when prompts share the batch: a job's cache then lives as long as the job.
        const bool alone = jobs.size() == 1;
        jobs[i]->k_LPKd[layer] = alone ? k_TKd : k_TKd.narrow(0, cu[i], P).clone();
        jobs[i]->v_LPKd[layer] = alone ? v_TKd : v_TKd.narrow(0, cu[i], P).clone();
      }
      return KvPacked{k_TKd, v_TKd, cu};
    };
    const PackedBatch batch{Tokens(tokens, pol.device), cu};
    ForwardOptions options = Options(pol, &kv, at, {&pol});
    const bool routes = std::any_of(jobs.begin(), jobs.end(),
                                    [](const Job* j) { return j->request.routed_experts; });
    RouteLog log;
    if (routes) log.Attach(options);
    const at::Tensor hidden_TD = ForwardHidden(pol.config, w, LoraOf(pol), batch, options);
    if (routes) {
      const at::Tensor all_TRk = log.Stacked();
      for (size_t i = 0; i < jobs.size(); ++i) {
        if (!jobs[i]->request.routed_experts) continue;
        const at::Tensor mine = all_TRk.narrow(0, cu[i], cu[i + 1] - cu[i]).contiguous();
        jobs[i]->result.prompt_routed_experts.assign(mine.data_ptr<int64_t>(),
                                                     mine.data_ptr<int64_t>() + mine.numel());
        jobs[i]->result.routed_layers = all_TRk.size(1);
        jobs[i]->result.experts_per_token = all_TRk.size(2);
      }
    }
    // Every prompt's next-token logits in one head: its last row.
    const at::Tensor logits_JV =
        kernels::HeadLogits(Head(pol, w, hidden_TD.index_select(0, Tokens(last, pol.device))))
            .cpu()
            .contiguous();
    const at::Tensor lse_J = kernels::LogitsLse(logits_JV);
    const at::Tensor z_JV = logits_JV.to(at::kDouble);
    const int64_t V = z_JV.size(1);
    for (size_t i = 0; i < jobs.size(); ++i) {
      const double lse = LogSumExp(z_JV.data_ptr<double>() + i * V, V);
      Begin(*jobs[i], w, hidden_TD.narrow(0, cu[i], cu[i + 1] - cu[i]),
            z_JV.data_ptr<double>() + i * V, V, lse,
            [&, i](Choice& c) { HeadLogprobs(logits_JV, lse_J, i, c); });
    }
  });
}

void SampleEngine::Begin(Job& job, const BaseWeights& w, const at::Tensor& hidden_PD,
                         const double* z_V, int64_t V, double lse,
                         absl::FunctionRef<void(Choice&)> score) {
  const Policy& pol = *job.policy;
  const SampleRequest& r = job.request;
  const int64_t P = job.prompt_length();
  const int64_t layers = pol.config.num_hidden_layers;
  // Positions first..P-1 are scored (hidden row t - 1 predicts prompt[t]); prompt_logprobs_last_n
  // leaves the earlier ones out.
  const int64_t first = r.prompt_logprobs_last_n > 0 ? P - r.prompt_logprobs_last_n : 1;
  if (r.prompt_logprobs) {
    job.result.prompt_logprobs.assign(std::min(first, P), std::numeric_limits<double>::quiet_NaN());
    if (first < P) {
      kernels::LogprobHeadParams head = Head(pol, w, hidden_PD.narrow(0, first - 1, P - first));
      head.targets_T = Tokens({r.prompt.begin() + first, r.prompt.end()}, pol.device);
      const at::Tensor logp = kernels::TokenLogprobs(head).logp_T.to(at::kDouble).cpu();
      const double* p = logp.data_ptr<double>();
      job.result.prompt_logprobs.insert(job.result.prompt_logprobs.end(), p, p + P - first);
    }
  }
  if (r.topk_prompt_logprobs > 0) {
    job.result.topk_prompt_logprobs.assign(P, {});
    constexpr int64_t kRows = 256;  // bounds the [rows, V] logits held at once
    for (int64_t t0 = first - 1; t0 + 1 < P; t0 += kRows) {
      const int64_t rows = std::min(kRows, P - 1 - t0);
      // The head's logprobs (HeadLogprobs' definition), the most likely first.
      const at::Tensor z = kernels::HeadLogits(Head(pol, w, hidden_PD.narrow(0, t0, rows))).cpu();
      auto [values, indices] =
          (z - kernels::LogitsLse(z).unsqueeze(1)).topk(r.topk_prompt_logprobs, 1);
      values = values.to(at::kDouble).contiguous();
      indices = indices.contiguous();
      for (int64_t i = 0; i < rows; ++i) {
        auto& entries = job.result.topk_prompt_logprobs[t0 + i + 1];
        for (int64_t j = 0; j < r.topk_prompt_logprobs; ++j) {
          entries.emplace_back(indices[i][j].item<int64_t>(), values[i][j].item<double>());
        }
      }
    }
  }
  if (r.target_prompt_k > 0) {
    job.result.target_prompt_logprobs = TargetPromptLogprobs(pol, w, r, hidden_PD);
  }
  if (r.prompt_alt_tokens_k > 0) {
    const int64_t k = r.prompt_alt_tokens_k;
    job.result.prompt_alt_tokens.resize((P - 1) * k);
    job.result.prompt_alt_logprobs.resize((P - 1) * k);
    std::vector<std::pair<int64_t, double>> drawn(k);
    constexpr int64_t kRows = 256;  // bounds the [rows, V] logits held at once
    for (int64_t t0 = 0; t0 + 1 < P; t0 += kRows) {
      const int64_t rows = std::min(kRows, P - 1 - t0);
      const at::Tensor logits =
          kernels::HeadLogits(Head(pol, w, hidden_PD.narrow(0, t0, rows))).cpu().contiguous();
      const at::Tensor lse = kernels::LogitsLse(logits);
      const at::Tensor z = logits.to(at::kDouble);
      for (int64_t i = 0; i < rows; ++i) {
        const double* row_V = z.data_ptr<double>() + i * V;
        DrawIndependent(row_V, V, LogSumExp(row_V, V), r.params.temperature, k, job.alt_rng,
                        drawn.data());
        for (int64_t j = 0; j < k; ++j) {
          Choice c{drawn[j].first, 0, {}};
          HeadLogprobs(logits, lse, i, c);  // the trainer's logprob of the drawn token
          job.result.prompt_alt_tokens[(t0 + i) * k + j] = c.token;
          job.result.prompt_alt_logprobs[(t0 + i) * k + j] = c.logprob;
        }
      }
    }
  }

  const at::TensorOptions cache =
      at::TensorOptions().dtype(job.k_LPKd[0].scalar_type()).device(pol.device);
  const int64_t K = pol.config.num_key_value_heads, d = pol.config.head_dim;
  for (Sample& s : job.samples) {
    Choice c = ChooseToken(z_V, V, lse, r.params, s.rng);
    if (r.topk_sample_logprobs > 0) c.top = MostLikely(z_V, V, lse, r.topk_sample_logprobs);
    score(c);
    Take(r.params, pol.config.eos_token_ids, c, s.out, s.finished, s.stop_strings);
    if (s.finished) continue;
    // The last token is never fed back: max_tokens - 1 rows suffice.
    for (int64_t l = 0; l < layers; ++l) {
      s.k_LNKd.push_back(at::empty({r.params.max_tokens - 1, K, d}, cache));
      s.v_LNKd.push_back(at::empty({r.params.max_tokens - 1, K, d}, cache));
    }
  }
}

absl::Status SampleEngine::Decode(const std::vector<std::pair<Job*, Sample*>>& batch) {
  const Policy& pol = *batch.front().first->policy;
  // The step's loops run on the team, which stays awake from one to the next (kernels/parallel.h):
  // on a CPU where Gemv takes the products; elsewhere its spinning would only take cores from
  // OpenBLAS's threads, or hold them through a GPU's step or through the collectives of a forward
  // on other ranks' weights or experts.
  std::optional<kernels::SpinningTeam::Scope> hot;
  if (pol.device.is_cpu() && kernels::GemvRunsHere() && pol.gathered == nullptr &&
      pol.spread == nullptr) {
    if (team_ == nullptr || team_->threads() != at::get_num_threads()) {
      team_ = std::make_unique<kernels::SpinningTeam>(at::get_num_threads());
    }
    hot.emplace(*team_);
  }
  const int64_t S = static_cast<int64_t>(batch.size());
  std::vector<int64_t> tokens, cu_q{0};
  KvStep kv;
  for (const auto& [job, s] : batch) {
    tokens.push_back(s->out.tokens.back());
    cu_q.push_back(cu_q.back() + 1);
    kv.past.push_back(job->prompt_length() + s->cached);
  }
  // Each sample reads its prompt's cache and its own in place: no per-step copy of either.
  kv.extend = [&batch, S](int64_t layer, const at::Tensor& k_SKd,
                          const at::Tensor& v_SKd) -> std::variant<KvPacked, KvPieces> {
    // On the host each new row is a memcpy: ATen's two views and copy_ per sample and layer
    // cost more than the row's bytes.
    const at::Tensor k = k_SKd.contiguous(), v = v_SKd.contiguous();
    const bool host = k.is_cpu() && v.is_cpu();
    const size_t row_bytes = static_cast<size_t>(k.stride(0)) * k.element_size();
    const bool rows_match = v.stride(0) == k.stride(0) && v.dtype() == k.dtype();
    KvPieces all;
    for (int64_t i = 0; i < S; ++i) {
      const auto& [job, s] = batch[i];
      at::Tensor& k_NKd = s->k_LNKd[layer];
      at::Tensor& v_NKd = s->v_LNKd[layer];
      const bool rows_alike = k_NKd.dtype() == k.dtype() && v_NKd.dtype() == v.dtype() &&
                              k_NKd.is_contiguous() && v_NKd.is_contiguous() &&
                              k_NKd.stride(0) == k.stride(0) && v_NKd.stride(0) == v.stride(0);
      if (host && rows_match && rows_alike) {
        std::memcpy(static_cast<char*>(k_NKd.data_ptr()) + s->cached * row_bytes,
                    static_cast<const char*>(k.data_ptr()) + i * row_bytes, row_bytes);
        std::memcpy(static_cast<char*>(v_NKd.data_ptr()) + s->cached * row_bytes,
                    static_cast<const char*>(v.data_ptr()) + i * row_bytes, row_bytes);
      } else {
        k_NKd[s->cached].copy_(k[i]);
        v_NKd[s->cached].copy_(v[i]);
      }
      // The sample's cache whole, its length saying which rows are filled: a view per sample,
      // layer and step cost more than the rows it narrowed to.
      all.k.push_back({job->k_LPKd[layer], k_NKd});
      all.v.push_back({job->v_LPKd[layer], v_NKd});
      all.lengths.push_back(job->prompt_length() + s->cached + 1);
    }
    return all;
  };
  // Each policy's adapter applies to its own rows; the base's products serve them all.
  Runs runs;
  for (const auto& [job, s] : batch) {
    if (runs.empty() || runs.back().first != job->policy.get()) runs.emplace_back(&*job->policy, 0);
    ++runs.back().second;
  }
  Adapters lora(runs.size() == 1 ? LoraOf(pol) : nullptr);
  for (const auto& [policy, rows] : runs) {
    if (runs.size() > 1) lora.runs.emplace_back(LoraOf(*policy), rows);
  }
  const bool routes = std::any_of(batch.begin(), batch.end(),
                                  [](const auto& b) { return b.first->request.routed_experts; });
  RouteLog log;
  const PackedBatch packed{Tokens(tokens, pol.device), cu_q};
  at::Tensor z_SV;
  std::vector<const Policy*> policies;
  for (const auto& [policy, rows] : runs) policies.push_back(policy);
  RETURN_IF_ERROR(OnBase(pol, [&](const BaseWeights& w, const OnRanks& at) {
    ForwardOptions options = Options(pol, &kv, at, policies);
    if (routes) log.Attach(options);
    const at::Tensor hidden_SD = ForwardHidden(pol.config, w, lora, packed, options);
    z_SV = Logits(runs, w, hidden_SD).cpu().contiguous();
  }));
  // Each fed-back token's experts, appended once the step is sure to be kept (below).
  const at::Tensor routes_SRk = routes ? log.Stacked() : at::Tensor();
  const int64_t V = z_SV.size(1);
  // Every token is chosen (on copies of the generators) before any sample changes, so a failure
  // here leaves the step undone and Step's retry of each policy alone decodes it once.
  std::vector<RowChoice> chosen(batch.size());
  for (int64_t i = 0; i < S; ++i) {
    chosen[i].params = &batch[i].first->request.params;
    chosen[i].topk = batch[i].first->request.topk_sample_logprobs;
    chosen[i].rng = batch[i].second->rng;
  }
  if (z_SV.scalar_type() == at::kFloat) {
    ChooseTokens(z_SV.data_ptr<float>(), V, chosen);
  } else {
    ChooseTokens(z_SV.to(at::kDouble).data_ptr<double>(), V, chosen);
  }
  const at::Tensor lse_S = kernels::LogitsLse(z_SV);
  for (int64_t i = 0; i < S; ++i) HeadLogprobs(z_SV, lse_S, i, chosen[i].choice);
  for (int64_t i = 0; i < S; ++i) {
    const auto& [job, s] = batch[i];
    if (job->request.routed_experts) {
      const int64_t width = routes_SRk.size(1) * routes_SRk.size(2);
      const int64_t* row = routes_SRk.data_ptr<int64_t>() + i * width;
      s->out.routed_experts.insert(s->out.routed_experts.end(), row, row + width);
    }
    ++s->cached;
    s->rng = chosen[i].rng;
    Take(job->request.params, job->policy->config.eos_token_ids, chosen[i].choice, s->out,
         s->finished, s->stop_strings);
  }
  return absl::OkStatus();
}

bool SampleEngine::Report(Job& job) {
  std::vector<SampleDelta> deltas;
  for (size_t i = 0; i < job.samples.size(); ++i) {
    Sample& s = job.samples[i];
    if (s.reported == s.out.tokens.size()) continue;
    SampleDelta d;
    d.index = static_cast<int64_t>(i);
    d.tokens.assign(s.out.tokens.begin() + s.reported, s.out.tokens.end());
    d.logprobs.assign(s.out.logprobs.begin() + s.reported, s.out.logprobs.end());
    if (!s.out.topk_logprobs.empty()) {
      d.topk_logprobs.assign(s.out.topk_logprobs.begin() + s.reported, s.out.topk_logprobs.end());
    }
    if (s.finished) d.stop = s.out.stop_reason;
    s.reported = s.out.tokens.size();
    deltas.push_back(std::move(d));
  }
  return deltas.empty() || job.progress(std::move(deltas));
}

bool SampleEngine::Step() {
  at::NoGradGuard no_grad;
  {
    // Admitted requests start in order while their prompts fit the step's prefill budget; the
    // first always starts, so a prompt longer than the budget runs alone.
    absl::MutexLock lock(&mu_);
    int64_t budget = limits_.prefill_tokens_per_step;
    for (bool first = true; !admitted_.empty(); first = false) {
      const int64_t tokens = admitted_.front()->prompt_length();
      if (!first && tokens > budget) break;
      budget -= tokens;
      running_.push_back(std::move(admitted_.front()));
      admitted_.pop_front();
    }
  }
  auto fail = [](Job& job, const absl::Status& st) {
    job.failed = true;
    job.result = {};
    job.done(st);
    job.done = nullptr;
  };
  // The prompts admitted since the last step: one packed forward per policy (up to
  // kPrefillTokens). Should a shared forward fail, each prompt is tried alone, so that one
  // request's failure (say, memory for a long prompt) is not another's.
  std::vector<std::vector<Job*>> prefills;
  std::map<const Policy*, std::pair<size_t, int64_t>> open;  // the policy's last prefill, tokens
  for (auto& job : running_) {
    if (!job->k_LPKd.empty() || job->failed) continue;
    auto it = open.find(job->policy.get());
    if (it != open.end() && it->second.second + job->prompt_length() <= kPrefillTokens) {
      prefills[it->second.first].push_back(job.get());
      it->second.second += job->prompt_length();
      continue;
    }
    open[job->policy.get()] = {prefills.size(), job->prompt_length()};
    prefills.push_back({job.get()});
  }
  for (const std::vector<Job*>& jobs : prefills) {
    if (Guard("sample prefill", [&] { return Prefill(jobs); }).ok()) continue;
    for (Job* job : jobs) {
      absl::Status st = Guard("sample prefill", [&] { return Prefill({job}); });
      if (!st.ok()) fail(*job, st);
    }
  }
  // One decode forward per base model over the running samples of every policy sharing it (LoRA
  // adapters of any rank), each policy's rows together. Should a shared forward fail, each policy
  // is tried alone, as prefill does.
  std::vector<const Policy*> policies;  // by first running sample
  std::map<const Policy*, std::vector<std::pair<Job*, Sample*>>> rows;
  for (auto& job : running_) {
    if (job->failed) continue;
    for (Sample& s : job->samples) {
      if (s.finished) continue;
      auto& mine = rows[job->policy.get()];
      if (mine.empty()) policies.push_back(job->policy.get());
      mine.emplace_back(job.get(), &s);
    }
  }
  std::vector<std::vector<const Policy*>> bases;
  for (const Policy* p : policies) {
    auto it = std::find_if(bases.begin(), bases.end(),
                           [p](const auto& base) { return SharesBase(*base.front(), *p); });
    if (it == bases.end()) {
      bases.push_back({p});
    } else {
      it->push_back(p);
    }
  }
  for (const std::vector<const Policy*>& base : bases) {
    std::vector<std::pair<Job*, Sample*>> batch;
    for (const Policy* p : base) batch.insert(batch.end(), rows[p].begin(), rows[p].end());
    ++decode_forwards_;
    absl::Status st = Guard("sample decode", [&] { return Decode(batch); });
    if (st.ok()) continue;
    for (const Policy* p : base) {
      if (base.size() > 1) st = Guard("sample decode", [&] { return Decode(rows[p]); });
      if (st.ok()) continue;
      for (auto& [job, s] : rows[p]) {
        if (!job->failed) fail(*job, st);
      }
    }
  }
  for (auto& job : running_) {
    if (job->failed || !job->progress || Report(*job)) continue;
    fail(*job, absl::CancelledError("sample: cancelled by the caller"));
  }
  // Answer and release what finished.
  std::vector<std::unique_ptr<Job>> still;
  for (auto& job : running_) {
    if (!job->finished()) {
      still.push_back(std::move(job));
      continue;
    }
    // Its memory is given back before its caller hears: a client that trains as soon as its
    // samples return finds the account as free as it will be.
    Release(*job);
    if (!job->failed) {
      for (Sample& s : job->samples) job->result.sequences.push_back(std::move(s.out));
      job->done(std::move(job->result));
    }
  }
  running_ = std::move(still);
  absl::MutexLock lock(&mu_);
  return !running_.empty() || !admitted_.empty();
}

void SampleEngine::FailAll(const absl::Status& status) {
  std::deque<std::unique_ptr<Job>> admitted;
  {
    absl::MutexLock lock(&mu_);
    admitted.swap(admitted_);
  }
  for (auto& job : admitted) {
    job->done(status);
    Release(*job);
  }
  for (auto& job : running_) {
    if (!job->failed) job->done(status);
    Release(*job);
  }
  running_.clear();
}

int64_t SampleEngine::running_sequences() const {
  absl::MutexLock lock(&mu_);
  return sequences_;
}

int64_t SampleEngine::reserved_bytes() const {
  absl::MutexLock lock(&mu_);
  return bytes_;
}

}  // namespace tinkerd
