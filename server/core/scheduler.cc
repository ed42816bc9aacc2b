#include "server/core/scheduler.h"

#include <algorithm>
#include <set>

#include "absl/strings/str_cat.h"
#include "runner/util/echo.h"
#include "runner/util/log.h"

namespace tinkerd {

Scheduler::Scheduler(SchedulerConfig config) : config_(config) {}

Scheduler::~Scheduler() {
  Stop(absl::ZeroDuration());
}

void Scheduler::Start() {
  thread_ = std::thread([this] { Loop(); });
}

void Scheduler::Stop(absl::Duration grace) {
  {
    absl::MutexLock lock(&mu_);
    if (!stopping_) {
      accepting_ = false;
      stopping_ = true;
      stop_deadline_ = absl::Now() + grace;
    }
    wake_ = true;
  }
  if (thread_.joinable()) thread_.join();
}

void Scheduler::SetBackground(std::function<bool()> step) {
  background_ = std::move(step);
}

void Scheduler::SetJoiner(std::string group, Joiner joiner) {
  joiners_[std::move(group)] = std::move(joiner);
}

void Scheduler::KickBackground() {
  absl::MutexLock lock(&mu_);
  if (!background_) return;
  background_ready_ = wake_ = true;
}

bool Scheduler::RunBetweenJobs(std::function<void()> op) {
  absl::MutexLock lock(&mu_);
  if (!accepting_) return false;
  between_jobs_.push_back(std::move(op));
  wake_ = true;
  return true;
}

void Scheduler::CreateModel(std::string owner, std::function<absl::StatusOr<std::string>()> create,
                            std::function<void(const absl::StatusOr<std::string>&)> done) {
  auto op = [this, owner = std::move(owner), create = std::move(create), done] {
    std::string source;
    const int limit =
        LimitOf(config_.tenant_limits, owner, &TenantLimits::max_models,
                config_.max_models_per_tenant, "--max_models_per_tenant", "max_models", &source);
    if (const size_t held = Models(owner).size(); limit > 0 && held >= static_cast<size_t>(limit)) {
      {
        absl::MutexLock lock(&mu_);
        ++usage_[owner].rejected;
      }
      return done(absl::ResourceExhaustedError(
          absl::StrCat("this tenant has ", held, " models (the limit, ", source, "); delete one")));
    }
    absl::StatusOr<std::string> id = create();
    if (id.ok()) {
      absl::MutexLock lock(&mu_);
      queues_[*id].owner = owner;
    }
    done(id);
  };
  if (!RunBetweenJobs(std::move(op))) done(absl::UnavailableError("server is shutting down"));
}

void Scheduler::DeleteModel(std::string model_id, std::function<absl::Status()> destroy,
                            std::function<void(const absl::Status&)> done) {
  auto op = [this, model_id = std::move(model_id), destroy = std::move(destroy), done] {
    std::vector<std::pair<JobCallback, JobResult>> calls;
    bool found;
    {
      absl::MutexLock lock(&mu_);
      found = queues_.count(model_id) > 0;
      if (found) RemoveLocked(model_id, &calls);
    }
    for (auto& [cb, r] : calls) cb(r);
    done(found ? destroy()
               : absl::NotFoundError(absl::StrCat("model_id: no model '", Echo(model_id), "'")));
  };
  if (!RunBetweenJobs(std::move(op))) done(absl::UnavailableError("server is shutting down"));
}

void Scheduler::RemoveLocked(const std::string& model_id,
                             std::vector<std::pair<JobCallback, JobResult>>* calls) {
  auto it = queues_.find(model_id);
  if (it == queues_.end()) return;
  const absl::Status gone =
      absl::NotFoundError(absl::StrCat("model ", Echo(model_id), " was deleted"));
  // Between jobs none runs; a stream that yielded waiting for datums is dropped with the rest.
  for (auto& [seq, p] : it->second.pending) {
    for (auto& w : p.waiters) calls->emplace_back(std::move(w.done), gone);
    if (p.spec.on_drop) p.spec.on_drop();
  }
  const std::string owner = it->second.owner;
  queues_.erase(it);
  for (const auto& [id, q] : queues_) {
    if (q.owner == owner) return;
  }
  tenants_.erase(owner);
}

bool Scheduler::HasModel(const std::string& model_id) const {
  absl::MutexLock lock(&mu_);
  return queues_.count(model_id) > 0;
}

std::optional<std::string> Scheduler::Owner(const std::string& model_id) const {
  absl::MutexLock lock(&mu_);
  auto it = queues_.find(model_id);
  if (it == queues_.end()) return std::nullopt;
  return it->second.owner;
}

std::vector<std::string> Scheduler::Models(const std::string& owner) const {
  absl::MutexLock lock(&mu_);
  std::vector<std::string> out;
  for (const auto& [id, q] : queues_) {
    if (q.owner == owner) out.push_back(id);
  }
  return out;
}

absl::StatusOr<int64_t> Scheduler::NextSeqId(const std::string& model_id) const {
  absl::MutexLock lock(&mu_);
  auto it = queues_.find(model_id);
  if (it == queues_.end()) {
    return absl::NotFoundError(absl::StrCat("model_id: no model '", Echo(model_id), "'"));
  }
  return it->second.next_seq;
}

absl::StatusOr<absl::Time> Scheduler::LastRequest(const std::string& model_id) const {
  absl::MutexLock lock(&mu_);
  auto it = queues_.find(model_id);
  if (it == queues_.end()) {
    return absl::NotFoundError(absl::StrCat("model_id: no model '", Echo(model_id), "'"));
  }
  return it->second.last_request;
}

bool Scheduler::Used(const std::string& model_id, int64_t seq_id) const {
  absl::MutexLock lock(&mu_);
  auto it = queues_.find(model_id);
  if (it == queues_.end()) return false;
  const Queue& q = it->second;
  return seq_id < q.next_seq || q.pending.count(seq_id) > 0;
}

void Scheduler::Submit(const std::string& model_id, int64_t seq_id, JobSpec job, JobCallback done) {
  JobResult immediate = absl::UnknownError("unset");
  {
    absl::MutexLock lock(&mu_);
    auto it = queues_.find(model_id);
    if (seq_id < 1) {
      immediate = absl::InvalidArgumentError(absl::StrCat("seq_id: must be >= 1, got ", seq_id));
    } else if (it == queues_.end()) {
      immediate = absl::NotFoundError(absl::StrCat("model_id: no model '", Echo(model_id), "'"));
    } else {
      Queue& q = it->second;
      q.last_request = absl::Now();
      auto cached = q.done.find(seq_id);
      auto pending = q.pending.find(seq_id);
      auto conflict = [&](const std::string& used_for) {
        return absl::AlreadyExistsError(
            absl::StrCat("seq_id ", seq_id, " of model ", Echo(model_id),
                         " was already used for another request (", used_for,
                         "); a retry must resend the same RPC with the same payload"));
      };
      if ((cached != q.done.end() || pending != q.pending.end()) && job.final_hash) {
        // A stream whose digest is not known yet cannot be compared with the earlier use.
        immediate = absl::AbortedError(absl::StrCat("seq_id ", seq_id, " of model ", Echo(model_id),
                                                    " is used by another request still running"));
      } else if (cached != q.done.end()) {
        const Done& d = cached->second;
        immediate =
            d.kind == job.kind && d.payload_hash == job.payload_hash ? d.result : conflict(d.kind);
      } else if (pending != q.pending.end()) {
        const JobSpec& first = pending->second.spec;
        if (first.kind != job.kind ||
            (!first.final_hash && first.payload_hash != job.payload_hash)) {
          immediate = conflict(first.kind);
        } else {
          // A retry joins the original; against a stream, compared once the stream is complete.
          std::optional<uint64_t> check;
          if (first.final_hash) check = job.payload_hash;
          pending->second.waiters.push_back({std::move(done), check});
          return;
        }
      } else if (seq_id < q.next_seq) {
        immediate = absl::FailedPreconditionError(absl::StrCat(
            "seq_id ", seq_id, " of model ", Echo(model_id),
            " was applied already and its result has left the cache; next seq_id is ", q.next_seq));
      } else if (!accepting_) {
        immediate = absl::UnavailableError("server is shutting down");
      } else if (static_cast<int>(q.pending.size()) >= config_.max_pending_per_model &&
                 seq_id != q.next_seq) {
        // The next seq_id is always admitted: it can run at once, and refusing it while later
        // ones fill the queue would deadlock the model until they time out.
        immediate = absl::ResourceExhaustedError(
            absl::StrCat("model ", Echo(model_id), " has ", q.pending.size(),
                         " queued requests (the limit); retry later"));
        ++usage_[q.owner].rejected;
      } else if (std::string source;
                 seq_id != q.next_seq &&
                 PendingOfLocked(q.owner) >=
                     LimitOf(config_.tenant_limits, q.owner, &TenantLimits::max_pending,
                             config_.max_pending_per_tenant, "--max_pending_per_tenant",
                             "max_pending", &source)) {
        immediate = absl::ResourceExhaustedError(absl::StrCat(
            "this tenant has ", PendingOfLocked(q.owner),
            " queued requests over its models (the limit, ", source, "); retry later"));
        ++usage_[q.owner].rejected;
      } else {
        Pending p;
        p.spec = std::move(job);
        p.waiters.push_back({std::move(done), std::nullopt});
        p.enqueued = absl::Now();
        q.pending.emplace(seq_id, std::move(p));
        wake_ = true;
        return;
      }
    }
  }
  if (job.on_drop) job.on_drop();
  done(immediate);
}

TenantUsages Scheduler::Usage() const {
  absl::MutexLock lock(&mu_);
  return usage_;
}

int64_t Scheduler::QueueDepth() const {
  absl::MutexLock lock(&mu_);
  int64_t n = 0;
  for (const auto& [id, q] : queues_) n += static_cast<int64_t>(q.pending.size());
  return n;
}

Scheduler::Running Scheduler::Current() const {
  absl::MutexLock lock(&mu_);
  return running_;
}

void Scheduler::Wake() {
  absl::MutexLock lock(&mu_);
  wake_ = true;
}

JobResult Scheduler::Retrieve(const std::string& model_id, int64_t seq_id) const {
  absl::MutexLock lock(&mu_);
  auto it = queues_.find(model_id);
  if (it == queues_.end())
    return absl::NotFoundError(absl::StrCat("model_id: no model '", Echo(model_id), "'"));
  auto d = it->second.done.find(seq_id);
  if (d != it->second.done.end()) return d->second.result;
  if (seq_id >= it->second.next_seq) {
    return absl::FailedPreconditionError(absl::StrCat("seq_id ", seq_id, " has not finished yet"));
  }
  return absl::NotFoundError(absl::StrCat("seq_id ", seq_id, ": result no longer cached"));
}

int Scheduler::PendingOfLocked(const std::string& owner) const {
  int n = 0;
  for (const auto& [id, q] : queues_) {
    if (q.owner == owner) n += static_cast<int>(q.pending.size());
  }
  return n;
}

std::pair<Scheduler::Queue*, Scheduler::Pending*> Scheduler::PickLocked(
    std::string* model, const std::function<bool(const std::string&, const Pending&)>& eligible,
    bool companion) {
  // Per tenant with a runnable job: its first runnable model after the one served last (wrapping
  // to its first), and its service, a returning tenant's raised to the level.
  struct Candidate {
    const std::string* model;
    Queue* queue;
    Pending* job;
    absl::Duration served;
  };
  std::map<std::string, Candidate> runnable;
  for (auto& [id, q] : queues_) {
    auto head = q.pending.find(q.next_seq);
    if (head == q.pending.end()) continue;
    if (head->second.spec.ready && !head->second.spec.ready()) continue;
    if (eligible && !eligible(id, head->second)) continue;
    const Tenant& t = tenants_[q.owner];
    auto [it, first] = runnable.try_emplace(
        q.owner, Candidate{&id, &q, &head->second, std::max(t.served, level_)});
    if (!first && *it->second.model <= t.last_model && id > t.last_model) {
      it->second = Candidate{&id, &q, &head->second, it->second.served};
    }
  }
  if (runnable.empty()) return {nullptr, nullptr};
  // The least served; among equals, the first after the tenant picked last.
  auto best = runnable.end();
  auto start = runnable.upper_bound(last_owner_);
  for (size_t n = 0; n < runnable.size(); ++n, ++start) {
    if (start == runnable.end()) start = runnable.begin();
    if (best == runnable.end() || start->second.served < best->second.served) best = start;
  }
  Tenant& t = tenants_[best->first];
  t.served = best->second.served;
  t.last_model = *best->second.model;
  if (!companion) {
    level_ = t.served;
    last_owner_ = best->first;
  }
  *model = *best->second.model;
  return {best->second.queue, best->second.job};
}

std::vector<Scheduler::Picked> Scheduler::CompanionsLocked(const std::string& model,
                                                           const Pending& first) {
  std::vector<Picked> out;
  if (first.spec.join == nullptr || first.started || config_.join_tokens <= 0 ||
      !joiners_.count(first.spec.join_group)) {
    return out;
  }
  int64_t tokens = first.spec.join->tokens;
  std::set<std::string> taken{model};
  // Fair share among the companions too: each is the least served tenant's next joinable job
  // that fits, and is charged its part of the run.
  while (true) {
    std::string next;
    auto [q, job] = PickLocked(
        &next,
        [&](const std::string& id, const Pending& p) {
          return !taken.count(id) && !p.started && p.spec.join != nullptr &&
                 p.spec.join_group == first.spec.join_group &&
                 tokens + p.spec.join->tokens <= config_.join_tokens;
        },
        /*companion=*/true);
    if (job == nullptr) return out;
    tokens += job->spec.join->tokens;
    taken.insert(next);
    out.push_back({next, q, job});
  }
}

void Scheduler::ChargeLocked(const Picked& p, absl::Duration took, absl::Time began) {
  if (auto t = tenants_.find(p.queue->owner); t != tenants_.end()) t->second.served += took;
  TenantUsage& usage = usage_[p.queue->owner];
  usage.scheduler_seconds += absl::ToDoubleSeconds(took);
  if (!p.job->started) {
    p.job->started = true;
    ++usage.jobs;
    usage.queue_wait_seconds += absl::ToDoubleSeconds(began - p.job->enqueued);
  }
}

void Scheduler::FinishLocked(const Picked& p, const JobResult& result,
                             std::vector<std::pair<JobCallback, JobResult>>* calls) {
  Queue* q = p.queue;
  Pending* job = p.job;
  const int64_t seq = q->next_seq;
  // Cache the result, advance the model, answer every waiter (retries included).
  const uint64_t hash = job->spec.final_hash ? job->spec.final_hash() : job->spec.payload_hash;
  for (auto& w : job->waiters) {
    if (w.payload_hash && *w.payload_hash != hash) {
      calls->emplace_back(std::move(w.done), absl::AlreadyExistsError(absl::StrCat(
                                                 "seq_id ", seq, " of model ", p.model,
                                                 " was already used for another ", job->spec.kind,
                                                 "; a retry must resend the same payload")));
    } else {
      calls->emplace_back(std::move(w.done), result);
    }
  }
  q->done[seq] = {job->spec.kind, hash, result};
  while (static_cast<int>(q->done.size()) > config_.result_cache_per_model)
    q->done.erase(q->done.begin());
  q->pending.erase(seq);
  q->next_seq = seq + 1;
}

void Scheduler::ExpireLocked(std::vector<std::pair<JobCallback, JobResult>>* calls) {
  const absl::Time now = absl::Now();
  for (auto& [id, q] : queues_) {
    for (auto p = q.pending.begin(); p != q.pending.end();) {
      const bool blocked = p->first > q.next_seq;
      if (blocked && now - p->second.enqueued > config_.order_timeout) {
        const absl::Status st = absl::DeadlineExceededError(
            absl::StrCat("seq_id ", p->first, " of model ", id, " waited ",
                         absl::FormatDuration(config_.order_timeout), " for seq_id ", q.next_seq,
                         ", which never arrived; send it (or retry this request after it)"));
        for (auto& w : p->second.waiters) calls->emplace_back(std::move(w.done), st);
        if (p->second.spec.on_drop) p->second.spec.on_drop();
        p = q.pending.erase(p);
      } else {
        ++p;
      }
    }
  }
}

void Scheduler::Loop() {
  std::vector<std::pair<JobCallback, JobResult>> calls;
  absl::MutexLock lock(&mu_);
  while (true) {
    if (!between_jobs_.empty()) {  // registry changes first, in the order they were asked
      std::function<void()> op = std::move(between_jobs_.front());
      between_jobs_.pop_front();
      running_ = {absl::Now(),
                  "an operation between jobs (a model created or deleted, a sampler made)"};
      mu_.Unlock();
      for (auto& [cb, r] : calls) cb(r);
      calls.clear();
      op();
      mu_.Lock();
      running_ = {};
      continue;
    }
    ExpireLocked(&calls);
    std::string model;
    auto [q, job] = PickLocked(&model);
    const bool past_deadline = stopping_ && absl::Now() >= stop_deadline_;
    // A job that could run while no step had work takes the turn: sampling's time is not banked.
    if (job != nullptr && !background_ready_) background_budget_ = absl::ZeroDuration();
    const bool sampling_turn =
        job == nullptr || background_turns_ > 0 || background_budget_ > absl::ZeroDuration();
    if (background_ready_ && !stopping_ && sampling_turn) {
      background_ready_ = false;
      background_turns_ = std::max(0, background_turns_ - 1);
      running_ = {absl::Now(), "a sampling step"};
      mu_.Unlock();
      for (auto& [cb, r] : calls) cb(r);
      calls.clear();
      const absl::Time began = absl::Now();
      const bool more = background_();
      mu_.Lock();
      background_budget_ -= std::max(absl::ZeroDuration(), absl::Now() - began);
      running_ = {};
      background_ready_ = background_ready_ || more;
      continue;
    }
    if (job == nullptr || past_deadline) {
      if (stopping_ && (past_deadline || [&] {
            for (auto& [id, qq] : queues_) {
              if (qq.pending.count(qq.next_seq)) return false;  // a stream may still get data
            }
            return true;
          }())) {
        break;
      }
      if (!calls.empty()) {
        mu_.Unlock();
        for (auto& [cb, r] : calls) cb(r);
        calls.clear();
        mu_.Lock();
        continue;
      }
      // Poll at least every 50 ms so order timeouts and the stop deadline are noticed.
      mu_.AwaitWithTimeout(absl::Condition(&wake_), absl::Milliseconds(50));
      wake_ = false;
      continue;
    }
    std::vector<Picked> run_now{{model, q, job}};
    for (Picked& p : CompanionsLocked(model, *job)) run_now.push_back(std::move(p));
    for (const Picked& p : run_now) p.job->running = true;
    if (run_now.size() == 1) {
      running_ = {absl::Now(), absl::StrCat(job->spec.kind, " seq_id ", q->next_seq, " of model ",
                                            model, " (tenant ", q->owner, ")")};
    } else {
      running_ = {absl::Now(), absl::StrCat(job->spec.kind, " of ", run_now.size(),
                                            " models in one run, first model ", model, " seq_id ",
                                            q->next_seq, " (tenant ", q->owner, ")")};
    }
    std::function<JobStep()> run = job->spec.run;
    std::vector<JoinPart*> parts;
    const Joiner* joiner = nullptr;
    if (run_now.size() > 1) {
      joiner = &joiners_.at(job->spec.join_group);
      for (const Picked& p : run_now) parts.push_back(p.job->spec.join.get());
    }
    mu_.Unlock();
    for (auto& [cb, r] : calls) cb(r);
    calls.clear();
    const absl::Time began = absl::Now();
    std::vector<JobStep> steps;
    if (joiner == nullptr) {
      steps.push_back(run());
    } else {
      for (JobResult& r : (*joiner)(parts)) steps.push_back({true, std::move(r)});
    }
    const absl::Duration took = absl::Now() - began;
    mu_.Lock();
    running_ = {};
    // A shared run is charged to its jobs' tenants by their tokens.
    int64_t tokens = 0;
    for (JoinPart* part : parts) tokens += part->tokens;
    for (size_t i = 0; i < run_now.size(); ++i) {
      const double share =
          run_now.size() == 1 || tokens == 0
              ? 1.0 / static_cast<double>(run_now.size())
              : static_cast<double>(parts[i]->tokens) / static_cast<double>(tokens);
      ChargeLocked(run_now[i], took * share, began);
      if (run_now.size() > 1) ++usage_[run_now[i].queue->owner].shared_jobs;
      run_now[i].job->running = false;
    }
    background_turns_ = config_.steps_between_jobs;
    const double share = std::clamp(config_.sample_share, 0.0, 0.95);
    background_budget_ = took * (share / (1 - share));
    for (size_t i = 0; i < run_now.size(); ++i) {
      JobStep& step = i < steps.size() ? steps[i] : steps.emplace_back();
      if (step.done) FinishLocked(run_now[i], step.result, &calls);
    }
  }
  // Whatever could not run in time fails, so no client waits forever.
  for (auto& [id, q] : queues_) {
    for (auto& [seq, p] : q.pending) {
      for (auto& w : p.waiters)
        calls.emplace_back(std::move(w.done),
                           absl::UnavailableError("server shut down before this request ran"));
      if (p.spec.on_drop) p.spec.on_drop();
    }
    q.pending.clear();
  }
  mu_.Unlock();
  for (auto& [cb, r] : calls) cb(r);
  mu_.Lock();
  TLOG_INFO("scheduler stopped");
}

}  // namespace tinkerd
