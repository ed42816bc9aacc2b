// The scheduler: one thread that owns the runner and applies each model's requests in seq_id
// order, sharing its time fairly between tenants.
//
// Per model: requests wait in an ordered queue until every earlier seq_id was applied (or time
// out with DEADLINE_EXCEEDED, the slot left open for a retry). Each result stays in a bounded
// cache keyed by seq_id, with the request's kind (which RPC) and a hash of its payload: a retry
// with the same key, kind and payload gets that result (or joins the one in flight) and is never
// applied twice; the same key with another kind or payload gets ALREADY_EXISTS. Past
// `max_pending_per_model` queued requests, or `max_pending_per_tenant` over a tenant's models,
// RESOURCE_EXHAUSTED (except for a model's next seq_id, which is always admitted so a full queue
// cannot deadlock).
//
// Fair share: tenants (the models' owners) take turns by the scheduler time their jobs used, not
// by calls or models. The next job is the runnable one of the tenant served least, counted from
// when it last became busy (start-time fair queueing: a tenant returning from idle starts level
// with the least-served busy tenant, so idle time is not banked); a tenant's models take turns
// within its share. So a tenant's many models or long calls cannot delay another tenant's call by
// more than the job running when it arrives: a job costs its own time, and the light tenant is
// then the least served.
//
// Shared runs: a joinable job (JobSpec::join) takes along other models' runnable joinable jobs of
// its group, each the least served tenant's next that fits, up to join_tokens tokens in all, and
// its group's Joiner runs them as one (forward_backward calls in one pass over the base). The
// run's time is charged to its jobs' tenants by their tokens; a light tenant's call then waits at
// most for the run in progress, and runs in the next one.
//
// It is also the registry of models: each model's id, owner (tenant) and queue. The registry
// changes on the scheduler thread alone, between jobs, so no job of a model runs while the model
// is created or deleted, and creations, deletions and requests are applied in one order.
//
// Thread-safety: every public method may be called from any thread (gRPC handlers). Completion
// callbacks run on the scheduler thread or, for immediate answers, on the caller's thread; they
// must not block.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/common/metrics.h"  // TenantUsage
#include "server/common/tenant_limits.h"
#include "tinkerd/v1/tinkerd.pb.h"

namespace tinkerd {

using JobResult = absl::StatusOr<v1::RetrieveResultResponse>;
using JobCallback = std::function<void(const JobResult&)>;

// One step of a job. A unary request finishes in one step; a stream yields (done = false) until
// its client closes it, letting other models run meanwhile.
struct JobStep {
  bool done = true;
  JobResult result = absl::UnknownError("unset");
};

// A job's part in a run shared with other models' jobs (JobSpec::join): what its group's joiner
// needs of it (a subclass), and its size in tokens.
struct JoinPart {
  virtual ~JoinPart() = default;
  int64_t tokens = 0;
};
// Runs the parts of several jobs of one group as one; one result per part, in order. On the
// scheduler thread.
using Joiner = std::function<std::vector<JobResult>(const std::vector<JoinPart*>&)>;

struct JobSpec {
  // With (model_id, seq_id), the retry key: `kind` names the RPC, so that the same seq_id sent
  // with another RPC is a conflict even when the two payloads serialize to the same bytes.
  std::string kind;
  uint64_t payload_hash = 0;
  // A stream's digest covers every datum, so it is known only once the job finished: when set,
  // it is called then and cached instead of payload_hash, and retries that joined the job while
  // it ran are compared with it at that point. Such a job is only admitted for a seq_id not used
  // yet (ABORTED otherwise): a caller checks Used() first and submits a retry with its final
  // payload_hash instead.
  std::function<uint64_t()> final_hash;
  std::function<JobStep()> run;   // on the scheduler thread
  std::function<bool()> ready;    // null: always ready; else polled before each step
  std::function<void()> on_drop;  // called if the job is dropped without finishing (optional)
  // Set: the job may run with other models' runnable jobs of the same join_group, through that
  // group's Joiner (SetJoiner), instead of through `run` (batched multi-adapter training).
  std::string join_group;
  std::shared_ptr<JoinPart> join;
};

struct SchedulerConfig {
  int max_pending_per_model = 64;
  int max_pending_per_tenant = 1024;
  int max_models_per_tenant = 0;  // 0: only the runner's --max_models bounds a tenant's models
  // Tenants whose own bounds (API keys file) replace the two above.
  TenantLimitTable tenant_limits;
  int result_cache_per_model = 256;
  absl::Duration order_timeout = absl::Seconds(60);
  // Background steps (decode steps) at least between two jobs while both have work.
  int steps_between_jobs = 1;
  // Sampling's share of the thread's time while both have work, in [0, 0.95]: after a job that
  // took d, steps go on until their own time reaches d · share / (1 − share) (so each side gets
  // its share, and a queued job waits that long plus one step at most), and for
  // steps_between_jobs steps in any case. The time is not banked: a runnable job finding no step
  // to run drops it. 0: steps_between_jobs alone.
  double sample_share = 0.5;
  // A shared run's budget: the job picked by fair share takes along the next runnable joinable
  // jobs of its group (other models', picked by fair share too) while their tokens sum to at
  // most this. 0: every job runs alone.
  int64_t join_tokens = 8192;
};

class Scheduler {
 public:
  explicit Scheduler(SchedulerConfig config);
  ~Scheduler();  // Stop()s

  void Start();
  // Stops taking requests (UNAVAILABLE), finishes every job that can run within `grace`, fails
  // the rest with UNAVAILABLE, and joins the thread.
  void Stop(absl::Duration grace);

  // On the scheduler thread, between jobs: `create` makes the model in the runner and returns its
  // id, which is then registered to `owner` with an empty queue; `done` gets the id or the error
  // (RESOURCE_EXHAUSTED, `create` not called, when `owner` holds max_models_per_tenant models).
  void CreateModel(std::string owner, std::function<absl::StatusOr<std::string>()> create,
                   std::function<void(const absl::StatusOr<std::string>&)> done);
  // On the scheduler thread, between jobs: the model leaves the registry (its queued requests,
  // open streams included, fail with NOT_FOUND), then `destroy` deletes it from the runner; `done`
  // gets destroy's status, or NOT_FOUND for a model not registered.
  void DeleteModel(std::string model_id, std::function<absl::Status()> destroy,
                   std::function<void(const absl::Status&)> done);
  // Both answer UNAVAILABLE (on the caller's thread) once the scheduler is stopping.

  bool HasModel(const std::string& model_id) const;
  // The owner of a registered model; nullopt when there is no such model.
  std::optional<std::string> Owner(const std::string& model_id) const;
  // The models `owner` owns.
  std::vector<std::string> Models(const std::string& owner) const;
  // The next seq_id the model will apply, or NOT_FOUND.
  absl::StatusOr<int64_t> NextSeqId(const std::string& model_id) const;
  // When the model last got a request (its creation, or a Submit for it), or NOT_FOUND.
  absl::StatusOr<absl::Time> LastRequest(const std::string& model_id) const;
  // Whether (model_id, seq_id) was applied already or is queued: a request for it is a retry
  // (or a conflict), not new work.
  bool Used(const std::string& model_id, int64_t seq_id) const;

  // Calls `done` exactly once with the job's result (or the reason it was not run).
  void Submit(const std::string& model_id, int64_t seq_id, JobSpec job, JobCallback done);
  // Wakes the thread to re-check `ready` predicates (a stream received data).
  void Wake();
  // Runs `op` on the scheduler thread before the next job; false (and `op` dropped) once stopping.
  bool RunBetweenJobs(std::function<void()> op);

  // Work that is no model's request: the sampler's steps. `step` runs on the scheduler thread and
  // returns whether it has more to do; while it has, the thread alternates: between two jobs,
  // steps_between_jobs steps, or as many as fill sample_share of the time, and steps back to back
  // when no job can run. So a queued job waits at most that long, and steps go on while jobs are
  // queued.
  // KickBackground() says there is work again (from any thread). Set before Start(); no step runs
  // once stopping.
  void SetBackground(std::function<bool()> step);
  // The Joiner of jobs whose join_group is `group`. Set before Start().
  void SetJoiner(std::string group, Joiner joiner);
  void KickBackground();

  // Requests queued or running, over all models (a gauge for /metrics).
  int64_t QueueDepth() const;
  // Every tenant's account so far, by owner (for /metrics; kept after its models are deleted, so
  // its counters only grow).
  TenantUsages Usage() const;
  // A finished result again, from the cache.
  JobResult Retrieve(const std::string& model_id, int64_t seq_id) const;

  // What the thread runs now, and since when: a job's step, a sampling step or a registry change.
  // `since` is InfiniteFuture while it waits for work. One item running long means no other can
  // start (StallWatch turns health NOT_SERVING on it).
  struct Running {
    absl::Time since = absl::InfiniteFuture();
    std::string what;
  };
  Running Current() const;

 private:
  struct Waiter {
    JobCallback done;
    // A retry that joined a job with a final_hash: answered with the result only if its payload
    // matches the job's final one. Unset for the original request and already-checked retries.
    std::optional<uint64_t> payload_hash;
  };
  struct Pending {
    JobSpec spec;
    std::vector<Waiter> waiters;
    absl::Time enqueued;
    bool running = false;
    bool started = false;  // its first step ran (a stream's job takes several)
  };
  struct Done {
    std::string kind;
    uint64_t payload_hash = 0;
    JobResult result;
  };
  struct Queue {
    int64_t next_seq = 1;
    std::map<int64_t, Pending> pending;
    std::map<int64_t, Done> done;  // bounded cache
    std::string owner;
    absl::Time last_request = absl::Now();
  };
  // A tenant's share: the scheduler time its jobs used (from its level when it became busy), and
  // the model it was served for last (its models take turns).
  struct Tenant {
    absl::Duration served;
    std::string last_model;
  };

  void Loop();
  // Under mu_: removes the model's queue, failing its requests with NOT_FOUND.
  void RemoveLocked(const std::string& model_id,
                    std::vector<std::pair<JobCallback, JobResult>>* calls)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Under mu_: the next runnable (model, job) by fair share (above), or nulls; with `eligible`,
  // among the jobs it accepts only. A companion pick (a job joining the run of one picked
  // before) raises its tenant to the level but leaves the level and the turn order as they are.
  std::pair<Queue*, Pending*> PickLocked(
      std::string* model,
      const std::function<bool(const std::string&, const Pending&)>& eligible = nullptr,
      bool companion = false) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Under mu_: the jobs that run with `first` (model `model`): none unless it is joinable.
  struct Picked {
    std::string model;
    Queue* queue;
    Pending* job;
  };
  std::vector<Picked> CompanionsLocked(const std::string& model, const Pending& first)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Under mu_: a finished job's result cached, its model advanced and its waiters answered.
  void FinishLocked(const Picked& p, const JobResult& result,
                    std::vector<std::pair<JobCallback, JobResult>>* calls)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Under mu_: `took` of scheduler time charged to the job's tenant.
  void ChargeLocked(const Picked& p, absl::Duration took, absl::Time began)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Under mu_: the requests queued for `owner`'s models.
  int PendingOfLocked(const std::string& owner) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Under mu_: fails out-of-order jobs that waited longer than order_timeout.
  void ExpireLocked(std::vector<std::pair<JobCallback, JobResult>>* calls)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const SchedulerConfig config_;
  mutable absl::Mutex mu_;
  std::map<std::string, Queue> queues_ ABSL_GUARDED_BY(mu_);  // the registry
  std::deque<std::function<void()>> between_jobs_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, Tenant> tenants_ ABSL_GUARDED_BY(mu_);  // by owner, while it has models
  TenantUsages usage_ ABSL_GUARDED_BY(mu_);
  // The service level of the tenant picked last: where a tenant returning from idle starts.
  absl::Duration level_ ABSL_GUARDED_BY(mu_);
  std::string last_owner_ ABSL_GUARDED_BY(mu_);
  bool accepting_ ABSL_GUARDED_BY(mu_) = true;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  absl::Time stop_deadline_ ABSL_GUARDED_BY(mu_) = absl::InfiniteFuture();
  bool wake_ ABSL_GUARDED_BY(mu_) = false;
  std::function<bool()> background_;
  std::map<std::string, Joiner> joiners_;  // by group; set before Start
  bool background_ready_ ABSL_GUARDED_BY(mu_) = false;
  int background_turns_ ABSL_GUARDED_BY(mu_) = 0;  // steps before the next job may wait
  // Step time left before a runnable job runs (sample_share).
  absl::Duration background_budget_ ABSL_GUARDED_BY(mu_);
  Running running_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;
};

}  // namespace tinkerd
