#include "server/ops/sampling.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "runner/model_runner.h"
#include "runner/sample/engine.h"
#include "runner/util/echo.h"
#include "runner/util/log.h"
#include "runner/util/status_macros.h"
#include "server/core/convert.h"
#include "server/core/replicated_runner.h"
#include "server/core/scheduler.h"

namespace tinkerd {
namespace {

std::vector<int64_t> Tokens(const v1::ModelInput& input) {
  std::vector<int64_t> out;
  for (const v1::ModelInputChunk& c : input.chunks()) {
    out.insert(out.end(), c.encoded_text().tokens().begin(), c.encoded_text().tokens().end());
  }
  return out;
}

// target_prompt_logprobs' ids: INT64 [P - 1, K] (the sampler checks P - 1 and the ids).
absl::Status TargetIds(const v1::Tensor& t, SampleRequest& r) {
  auto bad = [](const std::string& why) {
    return absl::InvalidArgumentError(absl::StrCat("target_prompt_logprobs: ", why));
  };
  if (t.dtype() != v1::INT64) return bad("must be INT64 token ids");
  // Bounds that keep the product below 2^64; the sampler holds P and K to far less.
  if (t.shape_size() != 2 || t.shape(0) < 0 || t.shape(0) > (int64_t{1} << 40) || t.shape(1) < 1 ||
      t.shape(1) > (int64_t{1} << 20)) {
    return bad("must be [len(prompt) - 1, K], K >= 1");
  }
  if (t.data().size() % sizeof(int64_t) != 0 ||
      t.data().size() / sizeof(int64_t) !=
          static_cast<uint64_t>(t.shape(0)) * static_cast<uint64_t>(t.shape(1))) {
    return bad(absl::StrCat(t.data().size(), " bytes do not hold its shape [", t.shape(0), ", ",
                            t.shape(1), "] of INT64"));
  }
  r.target_prompt_k = t.shape(1);
  r.target_prompt_ids.resize(t.data().size() / sizeof(int64_t));
  if (!r.target_prompt_ids.empty()) {
    std::memcpy(r.target_prompt_ids.data(), t.data().data(), t.data().size());
  }
  return absl::OkStatus();
}

absl::Status CheckChunks(const v1::ModelInput& input) {
  for (int i = 0; i < input.chunks_size(); ++i) {
    if (!input.chunks(i).has_encoded_text()) {
      return absl::InvalidArgumentError(
          absl::StrCat("prompt.chunks[", i, "]: only encoded_text chunks are supported"));
    }
  }
  return absl::OkStatus();
}

v1::SampleResponse ToProto(const SampleResult& r) {
  v1::SampleResponse out;
  for (const SampledSequence& s : r.sequences) {
    v1::SampledSequence* seq = out.add_sequences();
    seq->mutable_tokens()->Add(s.tokens.begin(), s.tokens.end());
    seq->mutable_logprobs()->Add(s.logprobs.begin(), s.logprobs.end());
    seq->set_stop_reason(s.stop_reason == StopReason::kStop ? v1::STOP_REASON_STOP
                                                            : v1::STOP_REASON_LENGTH);
    for (const TopLogprobs& row : s.topk_logprobs)
      TopLogprobsToProto(row, seq->add_topk_logprobs());
    seq->mutable_routed_experts()->Add(s.routed_experts.begin(), s.routed_experts.end());
  }
  out.mutable_prompt_routed_experts()->Add(r.prompt_routed_experts.begin(),
                                           r.prompt_routed_experts.end());
  out.set_routed_layers(static_cast<int32_t>(r.routed_layers));
  out.set_experts_per_token(static_cast<int32_t>(r.experts_per_token));
  out.mutable_prompt_logprobs()->Add(r.prompt_logprobs.begin(), r.prompt_logprobs.end());
  for (const TopLogprobs& row : r.topk_prompt_logprobs) {
    TopLogprobsToProto(row, out.add_topk_prompt_logprobs());
  }
  out.mutable_target_prompt_logprobs()->Add(r.target_prompt_logprobs.begin(),
                                            r.target_prompt_logprobs.end());
  out.mutable_prompt_alt_tokens()->Add(r.prompt_alt_tokens.begin(), r.prompt_alt_tokens.end());
  out.mutable_prompt_alt_logprobs()->Add(r.prompt_alt_logprobs.begin(),
                                         r.prompt_alt_logprobs.end());
  return out;
}

}  // namespace

Sampling::Sampling(Ops* ops, const Bases* bases, Scheduler* scheduler, SamplingConfig config)
    : ops_(ops),
      bases_(bases),
      scheduler_(scheduler),
      config_(config),
      engine_(std::make_unique<SampleEngine>(config.engine)),
      loader_(config.max_queued_loads) {
  // A base's policy shares its tensors.
  for (const Bases::Served& base : bases_->all()) {
    base_policies_.push_back(base.runner->FreezePolicy(""));
  }
  scheduler_->SetBackground([this] { return engine_->Step(); });
  expirer_ = std::thread([this] {
    const absl::Duration every =
        std::clamp(config_.sampler_idle / 4, absl::Milliseconds(50), absl::Minutes(1));
    absl::MutexLock lock(&mu_);
    while (!mu_.AwaitWithTimeout(absl::Condition(&stopping_), every)) {
      std::vector<std::shared_ptr<const Policy>> expired = ExpireLocked();
      mu_.Unlock();
      expired.clear();  // the weights are freed outside the lock
      mu_.Lock();
    }
  });
}

Sampling::~Sampling() {
  StopExpirer();
}

void Sampling::StopExpirer() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  if (expirer_.joinable()) expirer_.join();
}

void Sampling::Stop() {
  StopExpirer();
  loader_.Stop();
  engine_->FailAll(absl::UnavailableError("server is shutting down"));
}

absl::StatusOr<SampleRequest> Sampling::Decode(const v1::SampleRequest& req) {
  RETURN_IF_ERROR(CheckChunks(req.prompt()));
  SampleRequest r;
  r.prompt = Tokens(req.prompt());
  r.num_samples = req.num_samples() == 0 ? 1 : req.num_samples();
  r.prompt_logprobs = req.prompt_logprobs();
  r.topk_prompt_logprobs = req.topk_prompt_logprobs();
  r.prompt_logprobs_last_n = req.prompt_logprobs_last_n();
  r.topk_sample_logprobs = req.topk_sample_logprobs();
  r.prompt_alt_tokens_k = req.prompt_alt_tokens_k();
  r.routed_experts = req.routed_experts();
  if (req.has_target_prompt_logprobs()) {
    RETURN_IF_ERROR(TargetIds(req.target_prompt_logprobs(), r));
  }
  const v1::SamplingParams& p = req.sampling_params();
  r.params.max_tokens = p.max_tokens();
  r.params.temperature = p.has_temperature() ? p.temperature() : 1.0;
  r.params.top_k = p.top_k();
  r.params.top_p = p.has_top_p() ? p.top_p() : 1.0;
  if (p.has_seed()) r.params.seed = p.seed();
  r.params.stop_strings.assign(p.stop_strings().begin(), p.stop_strings().end());
  r.params.ignore_eos = p.ignore_eos();
  for (const v1::EncodedTextChunk& stop : p.stop()) {
    r.params.stop.emplace_back(stop.tokens().begin(), stop.tokens().end());
  }
  return r;
}

std::vector<std::shared_ptr<const Policy>> Sampling::ExpireLocked() {
  const absl::Time now = absl::Now();
  std::vector<std::shared_ptr<const Policy>> expired;
  for (auto it = samplers_.begin(); it != samplers_.end();) {
    if (now - it->second.used <= config_.sampler_idle) {
      ++it;
      continue;
    }
    TLOG_INFO("sampling: {} unused for {}: deleted", it->first,
              absl::FormatDuration(config_.sampler_idle));
    expired.push_back(std::move(it->second.policy));
    it = samplers_.erase(it);
  }
  if (!expired.empty()) PublishLocked();
  return expired;
}

void Sampling::PublishLocked() {
  Metrics* metrics = ops_->metrics();
  if (metrics == nullptr) return;
  int64_t bytes = 0;
  for (const auto& [id, sampler] : samplers_) bytes += sampler.policy->bytes;
  metrics->SetSamplers(std::ssize(samplers_), bytes);
}

absl::StatusOr<v1::SamplerInfo> Sampling::Make(const std::string& tenant,
                                               const v1::CreateSamplerRequest& req,
                                               const std::string& checkpoint_dir, bool inflight) {
  ASSIGN_OR_RETURN(const Bases::Served* base, BaseFor(req, checkpoint_dir));
  ReplicatedRunner* runner = base->runner;
  auto make = [&] {
    return checkpoint_dir.empty() ? runner->FreezePolicy(req.model_id())
                                  : runner->LoadPolicy(checkpoint_dir);
  };
  absl::StatusOr<std::shared_ptr<const Policy>> policy = make();
  // The copy is reserved in the memory account before it is made: where there is no room, the
  // tenant's least recently used samplers go first, one at a time, as EvictFor would have made
  // them go for the new one (an RL loop makes a sampler every step). A policy that running
  // samples still hold frees its memory only once they finish. Under data parallelism policies
  // hold nothing in the account (Policy::memory), so deleting samplers would make no room there.
  while (runner->world_size() == 1 && !policy.ok() &&
         policy.status().code() == absl::StatusCode::kResourceExhausted) {
    std::shared_ptr<const Policy> evicted;
    {
      absl::MutexLock lock(&mu_);
      auto lru = samplers_.end();
      for (auto it = samplers_.begin(); it != samplers_.end(); ++it) {
        if (it->second.owner == tenant &&
            (lru == samplers_.end() || it->second.used < lru->second.used)) {
          lru = it;
        }
      }
      if (lru == samplers_.end()) break;
      TLOG_INFO(
          "sampling: {} is the least recently used sampler of its tenant: deleted to make room "
          "for a new one in the memory budget",
          lru->first);
      evicted = std::move(lru->second.policy);
      samplers_.erase(lru);
      PublishLocked();
    }
    evicted.reset();  // outside the lock: its tensors may be large
    policy = make();
  }
  if (!policy.ok()) {
    absl::Status st = ops_->HideCheckpointPaths(tenant, policy.status());
    if (checkpoint_dir.empty()) return st;
    return absl::Status(st.code(), absl::StrCat("path: ", st.message()));
  }
  ASSIGN_OR_RETURN(std::string id, ModelRunner::NewModelId());
  v1::SamplerInfo info;
  info.set_sampler_id(absl::StrReplaceAll(id, {{"model-", "sampler-"}}));
  info.set_model_id(req.model_id());
  info.set_path(req.path());
  info.set_step((*policy)->step);
  info.set_base_model(base->base.name);
  std::vector<std::shared_ptr<const Policy>> expired;  // freed once mu_ is released
  absl::MutexLock lock(&mu_);
  expired = ExpireLocked();
  RETURN_IF_ERROR(EvictFor(tenant, (*policy)->bytes, &expired));
  if (inflight) {
    // The model's inflight samplers all move to this freeze; their earlier policy is freed once
    // the samples running on it finish.
    for (auto& [id, sampler] : samplers_) {
      if (sampler.owner != tenant || sampler.inflight_model != req.model_id()) continue;
      expired.push_back(std::move(sampler.policy));
      sampler.policy = *policy;
      sampler.info.set_step((*policy)->step);
    }
  }
  Sampler& made = samplers_[info.sampler_id()];
  made.owner = tenant;
  made.policy = *std::move(policy);
  made.info = info;
  made.used = absl::Now();
  made.base = base->base.index;
  if (inflight) made.inflight_model = req.model_id();
  PublishLocked();
  return info;
}

absl::Status Sampling::EvictFor(const std::string& tenant, int64_t bytes,
                                std::vector<std::shared_ptr<const Policy>>* freed) {
  const int64_t budget = config_.max_sampler_bytes_per_tenant;
  if (bytes > budget) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the sampler needs ", bytes, " bytes beyond the base model, more than a tenant's ", budget,
        " for samplers (--sampler_mb_per_tenant); sample a LoRA model"));
  }
  // An RL loop makes a sampler every step and never deletes one: past the limits, the tenant's
  // least recently used samplers go (requests admitted from them still finish on their policy).
  std::vector<std::map<std::string, Sampler>::iterator> held;
  int64_t held_bytes = 0;
  for (auto it = samplers_.begin(); it != samplers_.end(); ++it) {
    if (it->second.owner != tenant) continue;
    held.push_back(it);
    held_bytes += it->second.policy->bytes;
  }
  std::sort(held.begin(), held.end(),
            [](const auto& a, const auto& b) { return a->second.used < b->second.used; });
  for (auto lru = held.begin(); lru != held.end(); ++lru) {
    const int64_t count = held.end() - lru;
    if (count < config_.max_samplers_per_tenant && held_bytes + bytes <= budget) break;
    TLOG_INFO(
        "sampling: {} is the least recently used of {} samplers ({} MiB) of its tenant: "
        "deleted",
        (*lru)->first, count, held_bytes >> 20);
    held_bytes -= (*lru)->second.policy->bytes;
    freed->push_back(std::move((*lru)->second.policy));
    samplers_.erase(*lru);
  }
  return absl::OkStatus();
}

void Sampling::CreateSampler(const std::string& tenant, const v1::CreateSamplerRequest& req,
                             Done<v1::SamplerInfo> done, bool inflight) {
  if (!req.path().empty() && !req.model_id().empty()) {
    return done(absl::InvalidArgumentError("path: give model_id or path, not both"));
  }
  if (inflight && req.model_id().empty()) {
    return done(absl::InvalidArgumentError(
        "kind: an inflight sampler follows a model's weights; it needs model_id, not a path"));
  }
  if (req.seq_id() < 0 || (req.seq_id() > 0 && req.model_id().empty())) {
    return done(absl::InvalidArgumentError(
        "seq_id: orders the freeze among a model's requests; it must be >= 0 and needs model_id"));
  }
  if (!req.model_id().empty()) {
    if (absl::Status st = ops_->CheckOwner(req.model_id(), tenant); !st.ok()) return done(st);
  }
  std::string dir;
  if (!req.path().empty()) {
    absl::StatusOr<CheckpointPath> path = ParseCheckpointPath(req.path());
    if (path.ok() && path->kind != "sampler_weights") {
      path = absl::InvalidArgumentError(absl::StrCat(
          "path: a ", path->kind, " checkpoint; sample from a sampler_weights export"));
    }
    if (!path.ok()) return done(path.status());
    dir = ops_->CheckpointDir(tenant, *path);
  }
  if (absl::StatusOr<const Bases::Served*> base = BaseFor(req, dir); !base.ok()) {
    return done(base.status());
  }
  if (req.seq_id() > 0) {
    JobSpec job;
    job.kind = inflight ? "CreateSampler inflight" : "CreateSampler";  // in the retry key
    job.payload_hash = PayloadHash(req);
    job.run = [this, tenant, req, inflight]() -> JobStep {
      absl::StatusOr<v1::SamplerInfo> info = Make(tenant, req, "", inflight);
      if (!info.ok()) return {true, info.status()};
      v1::RetrieveResultResponse out;
      *out.mutable_create_sampler() = *std::move(info);
      return {true, std::move(out)};
    };
    return scheduler_->Submit(req.model_id(), req.seq_id(), std::move(job),
                              [done](const JobResult& r) {
                                if (!r.ok()) return done(r.status());
                                done(r->create_sampler());
                              });
  }
  if (!dir.empty()) {
    // Reads only the base model's fixed fields, so it needs neither the scheduler nor a lock.
    absl::Status queued =
        loader_.Submit([this, tenant, req, dir, done] { done(Make(tenant, req, dir)); },
                       [done] { done(absl::UnavailableError("server is shutting down")); });
    if (absl::IsResourceExhausted(queued)) {
      done(absl::ResourceExhaustedError(
          "path: too many sampler exports are being loaded; retry later"));
    } else if (!queued.ok()) {
      done(queued);
    }
    return;
  }
  if (!scheduler_->RunBetweenJobs(
          [this, tenant, req, done, inflight] { done(Make(tenant, req, "", inflight)); })) {
    done(absl::UnavailableError("server is shutting down"));
  }
}

absl::StatusOr<v1::SamplerInfo> Sampling::GetSampler(const std::string& tenant,
                                                     const std::string& sampler_id) {
  std::vector<std::shared_ptr<const Policy>> expired;  // freed once mu_ is released
  absl::MutexLock lock(&mu_);
  expired = ExpireLocked();
  auto it = samplers_.find(sampler_id);
  if (it == samplers_.end() || it->second.owner != tenant) {
    return absl::NotFoundError(absl::StrCat("sampler_id: no sampler '", Echo(sampler_id), "'"));
  }
  return it->second.info;
}

absl::StatusOr<int64_t> Sampling::JoinSampler(const std::string& tenant,
                                              const std::string& sampler_id) {
  absl::MutexLock lock(&mu_);
  auto it = samplers_.find(sampler_id);
  if (it == samplers_.end() || it->second.owner != tenant) {
    return absl::NotFoundError(
        absl::StrCat("sampling_session_id: no sampler '", Echo(sampler_id), "'"));
  }
  constexpr int64_t kMaxClients = 1'000'000'000;  // request numbers client · 10^9 fit an int64
  if (it->second.clients >= kMaxClients) {
    return absl::ResourceExhaustedError(
        "sampling_session_id: 10^9 clients have joined this sampler; make a new sampling client");
  }
  it->second.used = absl::Now();
  return it->second.clients++;
}

absl::Status Sampling::DeleteSampler(const std::string& tenant, const std::string& sampler_id) {
  std::shared_ptr<const Policy> freed;  // freed once mu_ is released
  absl::MutexLock lock(&mu_);
  auto it = samplers_.find(sampler_id);
  if (it == samplers_.end() || it->second.owner != tenant) {
    return absl::NotFoundError(absl::StrCat("sampler_id: no sampler '", Echo(sampler_id), "'"));
  }
  freed = std::move(it->second.policy);
  samplers_.erase(it);  // requests already admitted keep their policy until they finish
  PublishLocked();
  return absl::OkStatus();
}

absl::StatusOr<const Bases::Served*> Sampling::BaseFor(const v1::CreateSamplerRequest& req,
                                                       const std::string& checkpoint_dir) const {
  if (!req.model_id().empty()) return &bases_->Of(req.model_id());
  if (!checkpoint_dir.empty()) {
    if (const Bases::Served* made = bases_->Made(checkpoint_dir)) return made;
  }
  return bases_->Named(req.base_model(), "base_model");
}

absl::StatusOr<const Bases::Served*> Sampling::TargetServed(const std::string& tenant,
                                                            const std::string& sampler_id,
                                                            const std::string& model_id,
                                                            const std::string& base_model) {
  if (!sampler_id.empty()) {
    absl::MutexLock lock(&mu_);
    auto it = samplers_.find(sampler_id);
    if (it == samplers_.end() || it->second.owner != tenant) {
      return absl::NotFoundError(absl::StrCat("sampler_id: no sampler '", Echo(sampler_id), "'"));
    }
    return &bases_->all()[it->second.base];
  }
  if (!model_id.empty()) {
    // Another tenant's model says nothing of its base: NOT_FOUND first, as for any op on it.
    RETURN_IF_ERROR(ops_->CheckOwner(model_id, tenant));
    return &bases_->Of(model_id);
  }
  return bases_->Named(base_model, "base_model");
}

template <typename Request>
absl::StatusOr<const Bases::Served*> Sampling::LimitsBase(const std::string& tenant,
                                                          const Request& req) {
  absl::StatusOr<const Bases::Served*> base =
      TargetServed(tenant, req.sampler_id(), req.model_id(), req.base_model());
  // A sampler or model not found is Resolve's to report, after the request's own checks, as it
  // always was: those checks take the first base's limits meanwhile (they reveal nothing).
  if (absl::IsNotFound(base.status())) return &bases_->first();
  return base;
}

absl::StatusOr<BaseModel> Sampling::Target(const std::string& tenant, const std::string& sampler_id,
                                           const std::string& model_id,
                                           const std::string& base_model) {
  ASSIGN_OR_RETURN(const Bases::Served* served,
                   TargetServed(tenant, sampler_id, model_id, base_model));
  return served->base;
}

void Sampling::Resolve(const std::string& tenant, const std::string& sampler_id,
                       const std::string& model_id, const Bases::Served& base,
                       std::function<void(absl::StatusOr<std::shared_ptr<const Policy>>)> then) {
  if (!sampler_id.empty()) {
    std::shared_ptr<const Policy> policy;
    std::vector<std::shared_ptr<const Policy>> expired;  // freed once mu_ is released
    {
      absl::MutexLock lock(&mu_);
      expired = ExpireLocked();
      auto it = samplers_.find(sampler_id);
      if (it != samplers_.end() && it->second.owner == tenant) {
        it->second.used = absl::Now();
        policy = it->second.policy;
      }
    }
    if (policy == nullptr) {
      return then(
          absl::NotFoundError(absl::StrCat("sampler_id: no sampler '", Echo(sampler_id), "'")));
    }
    return then(policy);
  }
  if (model_id.empty()) return then(base_policies_[base.base.index]);
  if (absl::Status st = ops_->CheckOwner(model_id, tenant); !st.ok()) return then(st);
  ReplicatedRunner* runner = base.runner;
  auto freeze = [runner, model_id, then] { then(runner->FreezePolicy(model_id)); };
  if (!scheduler_->RunBetweenJobs(freeze)) {
    then(absl::UnavailableError("server is shutting down"));
  }
}

absl::Status Sampling::Reserve(const std::string& tenant, int64_t samples) {
  std::string source;
  const int limit =
      LimitOf(config_.tenant_limits, tenant, &TenantLimits::max_samples,
              config_.max_samples_per_tenant, "--max_samples_per_tenant", "max_samples", &source);
  if (limit <= 0) return absl::OkStatus();
  absl::MutexLock lock(&running_mu_);
  int64_t& running = running_[tenant];
  if (running + samples > limit) {
    const int64_t held = running;
    if (running == 0) running_.erase(tenant);
    return absl::ResourceExhaustedError(absl::StrCat("this tenant has ", held, " samples running; ",
                                                     samples, " more would pass the limit of ",
                                                     limit, " (", source, "); retry later"));
  }
  running += samples;
  return absl::OkStatus();
}

void Sampling::Release(const std::string& tenant, int64_t samples) {
  if (LimitOf(config_.tenant_limits, tenant, &TenantLimits::max_samples,
              config_.max_samples_per_tenant, "", "") <= 0) {
    return;  // as Reserve: nothing was counted
  }
  absl::MutexLock lock(&running_mu_);
  auto it = running_.find(tenant);
  if (it == running_.end()) return;
  it->second -= samples;
  if (it->second <= 0) running_.erase(it);
}

void Sampling::Run(const std::string& tenant, std::shared_ptr<const Policy> policy,
                   SampleRequest request,
                   std::function<void(const absl::StatusOr<SampleResult>&)> done,
                   SampleProgress progress) {
  Metrics* metrics = ops_->metrics();
  const int64_t samples = request.num_samples;
  if (absl::Status st = Reserve(tenant, samples); !st.ok()) return done(st);
  auto counted = [this, metrics, done, samples, tenant](const absl::StatusOr<SampleResult>& r) {
    Release(tenant, samples);
    if (metrics != nullptr) {
      metrics->AddRunningSamples(-samples);
      if (r.ok()) {
        int64_t tokens = 0;
        for (const SampledSequence& s : r->sequences) tokens += std::ssize(s.tokens);
        metrics->AddSampled(tenant, std::ssize(r->sequences), tokens);
      }
    }
    done(r);
  };
  // Counted before it is offered: the engine may end it before Admit returns.
  if (metrics != nullptr) metrics->AddRunningSamples(samples);
  absl::Status admitted =
      engine_->Admit(std::move(policy), std::move(request), counted, std::move(progress));
  if (!admitted.ok()) {
    Release(tenant, samples);
    if (metrics != nullptr) metrics->AddRunningSamples(-samples);
    return done(admitted);
  }
  if (metrics != nullptr) metrics->AddSampleRequest();
  scheduler_->KickBackground();
}

void Sampling::Sample(const std::string& tenant, const v1::SampleRequest& req,
                      Done<v1::SampleResponse> done, SampleProgress progress) {
  absl::StatusOr<const Bases::Served*> base = LimitsBase(tenant, req);
  if (!base.ok()) return done(base.status());
  absl::StatusOr<SampleRequest> request = Decode(req);
  if (request.ok()) {
    absl::Status st = ValidateSampleRequest(*request, (*base)->base.limits, config_.request);
    if (!st.ok()) request = st;
  }
  if (!request.ok()) return done(request.status());
  Resolve(tenant, req.sampler_id(), req.model_id(), **base,
          [this, tenant, request = *std::move(request), done, progress](auto policy) mutable {
            if (!policy.ok()) return done(policy.status());
            Run(
                tenant, *std::move(policy), std::move(request),
                [done](const absl::StatusOr<SampleResult>& r) {
                  if (!r.ok()) return done(r.status());
                  done(ToProto(*r));
                },
                std::move(progress));
          });
}

void Sampling::ComputeLogprobs(const std::string& tenant, const v1::ComputeLogprobsRequest& req,
                               Done<v1::ComputeLogprobsResponse> done) {
  if (absl::Status st = CheckChunks(req.prompt()); !st.ok()) return done(st);
  SampleRequest request;
  request.prompt = Tokens(req.prompt());
  request.prompt_logprobs = true;
  // One greedy token: the prefill computes the prompt's logprobs; the token itself is dropped.
  request.params.max_tokens = 1;
  request.params.temperature = 0;
  absl::StatusOr<const Bases::Served*> base = LimitsBase(tenant, req);
  if (!base.ok()) return done(base.status());
  ModelLimits limits = (*base)->base.limits;
  if (absl::Status st = CheckPromptFits(std::ssize(request.prompt), limits); !st.ok()) {
    return done(st);
  }
  if (limits.max_context_length > 0) ++limits.max_context_length;  // the dropped token's room
  if (absl::Status st = ValidateSampleRequest(request, limits, config_.request); !st.ok()) {
    return done(st);
  }
  Resolve(tenant, req.sampler_id(), req.model_id(), **base,
          [this, tenant, request = std::move(request), done](auto policy) mutable {
            if (!policy.ok()) return done(policy.status());
            Run(tenant, *std::move(policy), std::move(request),
                [done](const absl::StatusOr<SampleResult>& r) {
                  if (!r.ok()) return done(r.status());
                  v1::ComputeLogprobsResponse out;
                  out.mutable_logprobs()->Add(r->prompt_logprobs.begin(), r->prompt_logprobs.end());
                  done(out);
                });
          });
}

}  // namespace tinkerd
