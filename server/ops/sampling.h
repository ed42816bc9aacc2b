// Sampling's operations, for every front end: samplers (frozen policies owned by a tenant), Sample
// and ComputeLogprobs. Requests are checked in full here, then admitted to the engine
// (runner/sample/engine.h), whose steps the scheduler interleaves with training jobs, sharing the
// time while both have work (--sample_share): neither waits for the other for long.
// Under data parallelism rank 0 samples alone: the weights are the same on every rank and a
// decode step needs no collective, so the followers stay free of per-token commands.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "runner/sample/sample_types.h"
#include "server/common/tenant_limits.h"
#include "server/common/worker.h"
#include "server/ops/ops.h"
#include "tinkerd/v1/tinkerd.pb.h"

namespace tinkerd {

class SampleEngine;
class Scheduler;
struct Policy;

struct SamplingConfig {
  EngineLimits engine;
  SampleLimits request;
  int max_samplers_per_tenant = 32;
  // Samples a tenant may have in the engine at once (0: only the engine's own bound); past it a
  // request is RESOURCE_EXHAUSTED, for the client to retry.
  int max_samples_per_tenant = 0;
  // Tenants whose own bound (API keys file) replaces max_samples_per_tenant.
  TenantLimitTable tenant_limits;
  // Memory a tenant's samplers may hold beyond the base model's weights (a LoRA sampler holds its
  // adapter, a full fine-tune's or a merged export's its whole weights). A new sampler evicts the
  // tenant's least recently used ones until it fits; one larger than this alone is refused.
  int64_t max_sampler_bytes_per_tenant = int64_t{8} << 30;
  int max_queued_loads = 8;  // sampler exports waiting to be read; past it RESOURCE_EXHAUSTED
  absl::Duration sampler_idle = absl::Hours(1);  // unused this long: deleted
};

class Sampling {
 public:
  // Registers the engine's steps with the scheduler (before it starts). Rank 0 samples alone,
  // from copies the runner of a model's base freezes (gathered by every rank where a model is
  // sharded) or reads; one engine samples every base's policies. Ops answers for ownership and
  // checkpoint paths.
  Sampling(Ops* ops, const Bases* bases, Scheduler* scheduler, SamplingConfig config);
  ~Sampling();
  // Fails what is admitted and stops the idle expiry: call once the scheduler has stopped.
  void Stop();

  // Freezes the model's weights on the scheduler thread: between two jobs, or in the model's
  // order at req.seq_id (a retry gets the same sampler); or loads req.path's sampler export on
  // a thread of its own, so that neither training nor sampling waits for the disk. Errors of a
  // load name `path`.
  //
  // `inflight` (a model's freeze only): the sampler follows the model's later inflight freezes,
  // as Tinker's inflight sampling clients do. Every inflight sampler of the model samples the
  // policy of its latest inflight freeze, so a new one updates the earlier ones too (their
  // running samples finish on the policy they started with); snapshot samplers never change.
  void CreateSampler(const std::string& tenant, const v1::CreateSamplerRequest& req,
                     Done<v1::SamplerInfo> done, bool inflight = false);
  absl::StatusOr<v1::SamplerInfo> GetSampler(const std::string& tenant,
                                             const std::string& sampler_id);
  absl::Status DeleteSampler(const std::string& tenant, const std::string& sampler_id);
  // A copy of a sampling client joins the sampler: the next of its clients' numbers, 1, 2, ...
  // (the original client is 0), unique for the sampler's life. Each client numbers its requests
  // from 10^9 times it, so numbers stay below 10^9. NOT_FOUND for another tenant's sampler.
  absl::StatusOr<int64_t> JoinSampler(const std::string& tenant, const std::string& sampler_id);
  // With `progress`, the tokens also go to it as they are decoded (see SampleProgress);
  // `done` still gets the whole response.
  void Sample(const std::string& tenant, const v1::SampleRequest& req,
              Done<v1::SampleResponse> done, SampleProgress progress = nullptr);
  void ComputeLogprobs(const std::string& tenant, const v1::ComputeLogprobsRequest& req,
                       Done<v1::ComputeLogprobsResponse> done);

  const SampleLimits& request_limits() const { return config_.request; }
  // The base model a request samples through: its sampler's, its model's, or `base_model`'s
  // (empty: the default). NOT_FOUND for a sampler the tenant does not have, INVALID_ARGUMENT for
  // a name not served.
  absl::StatusOr<BaseModel> Target(const std::string& tenant, const std::string& sampler_id,
                                   const std::string& model_id, const std::string& base_model);

  // The request as the engine takes it: INVALID_ARGUMENT naming the field.
  static absl::StatusOr<SampleRequest> Decode(const v1::SampleRequest& req);

 private:
  struct Sampler {
    std::string owner;
    std::shared_ptr<const Policy> policy;
    v1::SamplerInfo info;
    absl::Time used;
    int64_t clients = 1;         // the original client's 0, then each JoinSampler's
    std::string inflight_model;  // set: follows this model's inflight freezes (CreateSampler)
    int base = 0;                // the index of its base (Bases)
  };
  // The base a sampler is made on: its model's; an export's (at `checkpoint_dir`) the one it was
  // made on (Bases::Made), else req.base_model's, as is a base's own sampler.
  absl::StatusOr<const Bases::Served*> BaseFor(const v1::CreateSamplerRequest& req,
                                               const std::string& checkpoint_dir) const;
  // TargetServed, for the limits a request is checked against before it is resolved.
  template <typename Request>
  absl::StatusOr<const Bases::Served*> LimitsBase(const std::string& tenant, const Request& req);
  // Target's, with the runner.
  absl::StatusOr<const Bases::Served*> TargetServed(const std::string& tenant,
                                                    const std::string& sampler_id,
                                                    const std::string& model_id,
                                                    const std::string& base_model);
  // Makes the policy (on the scheduler thread, or the loader's for an export) and registers it.
  absl::StatusOr<v1::SamplerInfo> Make(const std::string& tenant,
                                       const v1::CreateSamplerRequest& req,
                                       const std::string& checkpoint_dir, bool inflight = false);
  // Makes room for `bytes` more of `tenant`'s samplers: evicts its least recently used ones,
  // whose policies go to `freed` (for the caller to free once it releases mu_).
  absl::Status EvictFor(const std::string& tenant, int64_t bytes,
                        std::vector<std::shared_ptr<const Policy>>* freed)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The policy `sampler_id` / `model_id` names for `tenant`, else `base`'s, then `then` with it
  // (on the scheduler thread when a model is frozen for the request).
  void Resolve(const std::string& tenant, const std::string& sampler_id,
               const std::string& model_id, const Bases::Served& base,
               std::function<void(absl::StatusOr<std::shared_ptr<const Policy>>)> then);
  void StopExpirer();
  // Takes `samples` of the tenant's share of the engine, or says why not.
  absl::Status Reserve(const std::string& tenant, int64_t samples);
  void Release(const std::string& tenant, int64_t samples);
  void Run(const std::string& tenant, std::shared_ptr<const Policy> policy, SampleRequest request,
           std::function<void(const absl::StatusOr<SampleResult>&)> done,
           SampleProgress progress = nullptr);
  // Deletes the samplers unused for config_.sampler_idle; returns them, for the caller to free
  // (their weights) after it releases mu_.
  std::vector<std::shared_ptr<const Policy>> ExpireLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The samplers' gauges (count and bytes) to the metrics, after samplers_ changed.
  void PublishLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  Ops* ops_;
  const Bases* bases_;
  Scheduler* scheduler_;
  const SamplingConfig config_;
  std::unique_ptr<SampleEngine> engine_;
  // Each base's own policy, by its index; it fails only where sampling is not built (experts
  // spread over the ranks), which every request for it then reports.
  std::vector<absl::StatusOr<std::shared_ptr<const Policy>>> base_policies_;
  absl::Mutex mu_;
  std::map<std::string, Sampler> samplers_ ABSL_GUARDED_BY(mu_);
  // Samples each tenant has in the engine (config_.max_samples_per_tenant); its own lock, taken
  // alone, since the engine's completions run on the scheduler thread.
  absl::Mutex running_mu_;
  std::map<std::string, int64_t> running_ ABSL_GUARDED_BY(running_mu_);
  // Expires idle samplers every sampler_idle / 4 (50 ms to 1 min), so that an idle server frees
  // their memory too, not only at the next sampler call.
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread expirer_;
  Worker loader_;  // last: its thread uses the members above until it is joined
};

}  // namespace tinkerd
