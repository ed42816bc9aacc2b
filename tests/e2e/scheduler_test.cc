// The scheduler's sharing between model requests (training) and background steps (the sampling
// engine's decode steps), on its real thread: a queued job waits at most one step (or
// steps_between_jobs), and steps go on while jobs are queued. And its fair share between tenants:
// a tenant's many models cannot delay another tenant's call; per-tenant queue limits.
#include "server/core/scheduler.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <map>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "tests/e2e/e2e_util.h"

namespace tinkerd::testing {
namespace {

// Registers model "m" of "tenant" on a started scheduler, and waits until it is.
void CreateModelM(Scheduler& scheduler) {
  absl::Notification created;
  scheduler.CreateModel(
      "tenant", [] { return absl::StatusOr<std::string>("m"); },
      [&](const absl::StatusOr<std::string>& id) {
        EXPECT_TRUE(id.ok());
        created.Notify();
      });
  created.WaitForNotification();
}

// Runs five jobs that become runnable at once, from inside a step, while steps always have more
// to do; returns the events from the moment they were queued: S a step began, J a job ran, Q every
// job was queued. `steps` before it: how many steps ran back to back while no job could run.
std::string JobsBesideSteps(int steps_between_jobs, size_t* steps_before) {
  SchedulerConfig config;
  config.steps_between_jobs = steps_between_jobs;
  config.sample_share = 0;  // the step count alone
  Scheduler scheduler(config);
  absl::Mutex mu;
  std::string events;  // S: a step began, J: a job ran, Q: every job was queued
  std::atomic<int> steps{0}, answered{0};
  auto submit = [&](int64_t seq) {
    JobSpec spec;
    spec.kind = "forward_backward";
    spec.run = [&] {
      absl::MutexLock lock(&mu);
      events += 'J';
      return JobStep{true, v1::RetrieveResultResponse()};
    };
    scheduler.Submit("m", seq, std::move(spec), [&](const JobResult& r) {
      EXPECT_TRUE(r.ok()) << r.status().message();
      ++answered;
    });
  };
  // Always more to do, like a decode batch that never drains. The step that `queue` marks makes
  // every job runnable at once, from inside a step, so that what follows is the scheduler's
  // choice alone and not a race with this thread.
  std::atomic<bool> queue{false};
  scheduler.SetBackground([&] {
    {
      absl::MutexLock lock(&mu);
      events += 'S';
      ++steps;
    }
    if (queue.exchange(false)) {
      submit(1);
      absl::MutexLock lock(&mu);
      events += 'Q';
    }
    return true;
  });
  scheduler.Start();
  CreateModelM(scheduler);
  // Seq_ids 2.. are held for 1, which a step submits.
  const int kJobs = 5;
  for (int64_t seq = 2; seq <= kJobs; ++seq) submit(seq);
  scheduler.KickBackground();
  // With no job runnable, steps run back to back.
  WaitFor([&] { return steps.load() >= 3; }, "steps while no job can run");
  queue = true;
  WaitFor([&] { return answered.load() == kJobs; }, "every job");
  const int at_end = steps.load();
  WaitFor([&] { return steps.load() > at_end; }, "a step after the jobs");
  scheduler.Stop(absl::Seconds(10));

  absl::MutexLock lock(&mu);
  const size_t q = events.find('Q');
  *steps_before = q;
  return q == std::string::npos ? events : events.substr(q + 1);
}

TEST(Scheduler, AQueuedJobWaitsAtMostOneStepAndStepsGoOnBetweenJobs) {
  size_t before = 0;
  const std::string events = JobsBesideSteps(1, &before);
  ASSERT_NE(before, std::string::npos) << events;
  // The first job runs at once; then jobs and steps alternate: each job waits for one step at
  // most, and a step runs between any two jobs while steps have work.
  EXPECT_EQ(events.substr(0, 10), "JSJSJSJSJS") << events;
  EXPECT_GE(before, 3u) << "steps ran back to back while no job could run";
}

TEST(Scheduler, StepsBetweenJobsGiveSamplingMoreTurns) {
  // --sample_steps_between_jobs=3: three steps between two jobs, never more.
  size_t before = 0;
  const std::string events = JobsBesideSteps(3, &before);
  ASSERT_NE(before, std::string::npos) << events;
  EXPECT_EQ(events.substr(0, 17), "JSSSJSSSJSSSJSSSJ") << events;
}

// --sample_share=0.5: after each job, steps go on for as long as the job took, so that sampling
// gets half the time while both have work (not one step per job, a few percent of the time when a
// job is long and a step short). Each job takes 20 ms and each step 1 ms of simulated work.
TEST(Scheduler, SampleShareGivesStepsTheirShareOfTheTime) {
  SchedulerConfig config;
  config.steps_between_jobs = 1;
  config.sample_share = 0.5;
  Scheduler scheduler(config);
  using Clock = std::chrono::steady_clock;
  absl::Mutex mu;
  struct Job {
    Clock::time_point began, ended;
    int steps_before = 0;  // steps begun since the previous job ended
  };
  std::vector<Job> jobs;
  int steps_since_job = 0;
  std::atomic<int> answered{0};
  constexpr int kJobs = 4;
  scheduler.SetBackground([&] {
    {
      absl::MutexLock lock(&mu);
      ++steps_since_job;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));  // a step's work
    return true;
  });
  scheduler.Start();
  CreateModelM(scheduler);
  scheduler.KickBackground();
  for (int64_t seq = 1; seq <= kJobs; ++seq) {
    JobSpec spec;
    spec.kind = "forward_backward";
    spec.run = [&] {
      Job job;
      job.began = Clock::now();
      std::this_thread::sleep_for(std::chrono::milliseconds(20));  // a job's work
      job.ended = Clock::now();
      absl::MutexLock lock(&mu);
      job.steps_before = steps_since_job;
      steps_since_job = 0;
      jobs.push_back(job);
      return JobStep{true, v1::RetrieveResultResponse()};
    };
    scheduler.Submit("m", seq, std::move(spec), [&](const JobResult& r) {
      EXPECT_TRUE(r.ok()) << r.status().message();
      ++answered;
    });
  }
  // Every job runs: steps that always have more to do do not hold jobs back for good.
  WaitFor([&] { return answered.load() == kJobs; }, "every job");
  scheduler.Stop(absl::Seconds(10));

  absl::MutexLock lock(&mu);
  ASSERT_EQ(jobs.size(), static_cast<size_t>(kJobs));
  for (size_t i = 1; i < jobs.size(); ++i) {
    // The gap is at least the previous job's time: the scheduler measured that job over a span
    // enclosing the one measured here, and let its steps run until at least as long after it.
    const auto gap = jobs[i].began - jobs[i - 1].ended;
    const auto took = jobs[i - 1].ended - jobs[i - 1].began;
    // One step per job (steps_between_jobs alone, sample_share 0) would fill 1 ms of it.
    EXPECT_GE(gap, took) << "job " << i << ": sampling got less than its half ("
                         << jobs[i].steps_before << " steps between the jobs)";
  }
}

// Models of tenants on one scheduler whose jobs record the order they ran in; the first job
// submitted holds the thread until Release(), so that everything queued meanwhile is ordered by
// the scheduler's choice alone.
class Tenants {
 public:
  // Joinable jobs (Submit's `tokens` > 0) run through a joiner that records each run's models.
  explicit Tenants(SchedulerConfig config = {}) : scheduler_(config) {
    scheduler_.SetJoiner("fb", [this](const std::vector<JoinPart*>& parts) {
      absl::MutexLock lock(&mu_);
      std::vector<std::string>& run = runs_.emplace_back();
      std::vector<JobResult> out;
      for (JoinPart* p : parts) {
        run.push_back(static_cast<Part*>(p)->model);
        order_.push_back(run.back());
        out.push_back(v1::RetrieveResultResponse());
      }
      return out;
    });
    scheduler_.Start();
  }
  ~Tenants() { scheduler_.Stop(absl::Seconds(10)); }

  void Create(const std::string& owner, const std::string& model) {
    absl::Notification created;
    scheduler_.CreateModel(
        owner, [model] { return absl::StatusOr<std::string>(model); },
        [&](const absl::StatusOr<std::string>& id) {
          EXPECT_TRUE(id.ok()) << id.status().message();
          created.Notify();
        });
    created.WaitForNotification();
  }

  // Queues (model, seq); returns the status it was answered with once it ran (or was refused).
  // `tokens` > 0: the job may join other models' jobs (JobSpec::join) with that many tokens.
  void Submit(const std::string& model, int64_t seq, bool gate = false, int64_t tokens = 0) {
    JobSpec spec;
    spec.kind = "forward_backward";
    spec.run = [this, model, gate] {
      if (gate) {
        running_.Notify();
        release_.WaitForNotification();
      }
      absl::MutexLock lock(&mu_);
      order_.push_back(model);
      runs_.push_back({model});
      return JobStep{true, v1::RetrieveResultResponse()};
    };
    if (tokens > 0) {
      auto part = std::make_shared<Part>();
      part->model = model;
      part->tokens = tokens;
      spec.join_group = "fb";
      spec.join = part;
    }
    scheduler_.Submit(model, seq, std::move(spec), [this](const JobResult& r) {
      absl::MutexLock lock(&mu_);
      answers_.push_back(r.status());
    });
  }
  void WaitRunning() { running_.WaitForNotification(); }
  void Release() { release_.Notify(); }
  void WaitAnswers(size_t n) {
    WaitFor(
        [&] {
          absl::MutexLock lock(&mu_);
          return answers_.size() >= n;
        },
        "answers");
  }
  std::vector<std::string> Order() {
    absl::MutexLock lock(&mu_);
    return order_;
  }
  std::vector<absl::Status> Answers() {
    absl::MutexLock lock(&mu_);
    return answers_;
  }
  TenantUsages Usage() const { return scheduler_.Usage(); }
  // The models of each run, in run order (a run alone holds one).
  std::vector<std::vector<std::string>> Runs() {
    absl::MutexLock lock(&mu_);
    return runs_;
  }

 private:
  struct Part : JoinPart {
    std::string model;
  };
  Scheduler scheduler_;
  absl::Notification running_, release_;
  absl::Mutex mu_;
  std::vector<std::string> order_ ABSL_GUARDED_BY(mu_);
  std::vector<std::vector<std::string>> runs_ ABSL_GUARDED_BY(mu_);
  std::vector<absl::Status> answers_ ABSL_GUARDED_BY(mu_);
};

// A greedy tenant with 32 calls queued over 8 models, and one light tenant's call queued after
// them: the light call runs right after the job that was running when it arrived, the bound of
// fair share by tenants (scheduler.h). The control: the same call from a ninth model of the
// greedy tenant waits its turn among that tenant's models, behind at least seven of its calls.
std::vector<std::string> GreedyThenLight(const std::string& light_owner) {
  Tenants t;
  for (int m = 0; m < 8; ++m) t.Create("greedy", absl::StrCat("g", m));
  t.Create(light_owner, "light");
  t.Submit("g0", 1, /*gate=*/true);
  t.WaitRunning();
  for (int m = 0; m < 8; ++m) {
    for (int64_t seq = m == 0 ? 2 : 1; seq <= 4; ++seq) t.Submit(absl::StrCat("g", m), seq);
  }
  t.Submit("light", 1);
  t.Release();
  t.WaitAnswers(33);
  for (const absl::Status& st : t.Answers()) EXPECT_TRUE(st.ok()) << st.message();
  return t.Order();
}

size_t Position(const std::vector<std::string>& order, const std::string& model) {
  return std::find(order.begin(), order.end(), model) - order.begin();
}

TEST(Scheduler, AGreedyTenantsManyModelsCannotDelayAnotherTenantsCall) {
  const std::vector<std::string> fair = GreedyThenLight("light tenant");
  ASSERT_EQ(fair.size(), 33u);
  EXPECT_EQ(fair[0], "g0");
  EXPECT_EQ(Position(fair, "light"), 1u) << "behind more than the job running when it came";
  // The greedy tenant's models take turns within its share: its first eight jobs after the gate
  // are eight different models.
  std::set<std::string> first_round(fair.begin() + 2, fair.begin() + 10);
  EXPECT_EQ(first_round.size(), 8u);
  const std::vector<std::string> same_tenant = GreedyThenLight("greedy");
  ASSERT_EQ(same_tenant.size(), 33u);
  EXPECT_GE(Position(same_tenant, "light"), 8u) << "control: one tenant's models share its turns";
}

// Joinable calls queued behind a running job share runs: each run within --join_tokens, at most
// one call per model, every call once and each model's in seq_id order; the light tenant's call
// is in the first run after the job running when it came, with the greedy tenant's calls beside
// it. The control: with join_tokens 0 every call runs alone.
std::vector<std::vector<std::string>> JoinedRuns(int64_t join_tokens) {
  SchedulerConfig config;
  config.join_tokens = join_tokens;
  Tenants t(config);
  for (int m = 0; m < 8; ++m) t.Create("greedy", absl::StrCat("g", m));
  t.Create("light tenant", "light");
  t.Submit("g0", 1, /*gate=*/true);
  t.WaitRunning();
  for (int m = 0; m < 8; ++m) {
    for (int64_t seq = m == 0 ? 2 : 1; seq <= 4; ++seq) {
      t.Submit(absl::StrCat("g", m), seq, false, /*tokens=*/64 + 16 * m);
    }
  }
  t.Submit("light", 1, false, /*tokens=*/64);
  t.Release();
  t.WaitAnswers(33);
  for (const absl::Status& st : t.Answers()) EXPECT_TRUE(st.ok()) << st.message();
  return t.Runs();
}

TEST(Scheduler, QueuedCallsOfSeveralModelsShareRunsWithinTheBudget) {
  const auto runs = JoinedRuns(/*join_tokens=*/400);
  std::map<std::string, int> calls;
  size_t shared = 0;
  for (size_t r = 0; r < runs.size(); ++r) {
    std::set<std::string> models(runs[r].begin(), runs[r].end());
    EXPECT_EQ(models.size(), runs[r].size()) << "run " << r << " holds a model twice";
    int64_t tokens = 0;
    for (const std::string& m : runs[r]) {
      ++calls[m];
      tokens += m == "light" ? 64 : 64 + 16 * (m[1] - '0');
    }
    if (runs[r].size() > 1) {
      ++shared;
      EXPECT_LE(tokens, 400) << "run " << r;
    }
  }
  EXPECT_EQ(calls["light"], 1);
  for (int m = 0; m < 8; ++m) EXPECT_EQ(calls[absl::StrCat("g", m)], 4) << "g" << m;
  EXPECT_GE(shared, 5u) << "33 joinable calls, 400 tokens a run: most runs are shared";
  ASSERT_GE(runs.size(), 2u);
  EXPECT_EQ(runs[0], std::vector<std::string>{"g0"});  // the gate, running when they came
  EXPECT_NE(std::find(runs[1].begin(), runs[1].end(), "light"), runs[1].end())
      << "the light call waited past the first run after the gate";
  EXPECT_GT(runs[1].size(), 1u);

  const auto alone = JoinedRuns(/*join_tokens=*/0);
  EXPECT_EQ(alone.size(), 33u) << "control: without a budget every call runs alone";
}

TEST(Scheduler, ATenantsQueuedCallsAreBoundedOverItsModels) {
  SchedulerConfig config;
  config.max_pending_per_tenant = 3;
  Tenants t(config);
  t.Create("a", "a1");
  t.Create("a", "a2");
  t.Create("b", "b1");
  t.Submit("a1", 1, /*gate=*/true);
  t.WaitRunning();
  t.Submit("a1", 2);
  t.Submit("a1", 3);  // a's three: the one running and two queued
  t.Submit("a2", 2);  // not a2's next: refused, the tenant is full
  t.Submit("a2", 1);  // a2's next is always admitted
  t.Submit("b1", 2);  // another tenant's queue is its own
  t.Submit("b1", 1);
  t.WaitAnswers(1);
  const std::vector<absl::Status> refused = t.Answers();
  ASSERT_EQ(refused.size(), 1u);
  EXPECT_EQ(refused[0].code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(refused[0].message().find("tenant"), std::string::npos) << refused[0].message();
  t.Release();
  t.WaitAnswers(7);
  int ok = 0;
  for (const absl::Status& st : t.Answers()) ok += st.ok();
  EXPECT_EQ(ok, 6);
  // Each tenant's account (/metrics): its jobs, the refusal, and the gate's time as a's.
  const TenantUsages usage = t.Usage();
  ASSERT_EQ(usage.count("a"), 1u);
  ASSERT_EQ(usage.count("b"), 1u);
  EXPECT_EQ(usage.at("a").jobs, 4);
  EXPECT_EQ(usage.at("a").rejected, 1);
  EXPECT_EQ(usage.at("b").jobs, 2);
  EXPECT_EQ(usage.at("b").rejected, 0);
  EXPECT_GT(usage.at("a").scheduler_seconds, usage.at("b").scheduler_seconds);
  EXPECT_GT(usage.at("b").queue_wait_seconds, 0.0) << "b's calls waited for the gate";
}

// A tenant's own bound on queued calls (the API keys file's max_pending) replaces the flag's for
// that tenant alone.
TEST(Scheduler, ATenantsOwnPendingBoundReplacesTheFlags) {
  SchedulerConfig config;
  config.max_pending_per_tenant = 100;
  config.tenant_limits["a"].max_pending = 2;
  Tenants t(config);
  t.Create("a", "a1");
  t.Create("b", "b1");
  t.Submit("a1", 1, /*gate=*/true);
  t.WaitRunning();
  t.Submit("a1", 2);  // a's two: the one running and one queued
  t.Submit("a1", 3);  // refused: a's own bound
  t.Submit("b1", 2);
  t.Submit("b1", 3);  // b has the flag's bound
  t.Submit("b1", 1);
  t.WaitAnswers(1);
  const std::vector<absl::Status> refused = t.Answers();
  ASSERT_EQ(refused.size(), 1u);
  EXPECT_EQ(refused[0].code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(refused[0].message().find("max_pending in the API keys file"), std::string::npos)
      << refused[0].message();
  t.Release();
  t.WaitAnswers(6);
  int ok = 0;
  for (const absl::Status& st : t.Answers()) ok += st.ok();
  EXPECT_EQ(ok, 5);
}

// --max_models_per_tenant: a tenant's models past the limit are refused before the runner is
// asked (RESOURCE_EXHAUSTED naming the flag); another tenant is not counted against it, and a
// deleted model makes room again.
TEST(Scheduler, ATenantsModelsAreBounded) {
  SchedulerConfig config;
  config.max_models_per_tenant = 2;
  Scheduler scheduler(config);
  scheduler.Start();
  int created = 0;
  auto create = [&](const std::string& owner, const std::string& model) {
    absl::Notification answered;
    absl::Status status;
    scheduler.CreateModel(
        owner,
        [&created, model] {
          ++created;
          return absl::StatusOr<std::string>(model);
        },
        [&](const absl::StatusOr<std::string>& id) {
          status = id.status();
          answered.Notify();
        });
    answered.WaitForNotification();
    return status;
  };
  EXPECT_TRUE(create("a", "a1").ok());
  EXPECT_TRUE(create("a", "a2").ok());
  const absl::Status third = create("a", "a3");
  EXPECT_EQ(third.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(third.message().find("--max_models_per_tenant"), std::string::npos) << third.message();
  EXPECT_EQ(created, 2) << "a refused model is never created";
  EXPECT_TRUE(create("b", "b1").ok());
  absl::Notification deleted;
  scheduler.DeleteModel(
      "a1", [] { return absl::OkStatus(); },
      [&](const absl::Status& st) {
        EXPECT_TRUE(st.ok()) << st.message();
        deleted.Notify();
      });
  deleted.WaitForNotification();
  EXPECT_TRUE(create("a", "a3").ok());
  EXPECT_EQ(scheduler.Usage().at("a").rejected, 1);
  scheduler.Stop(absl::Seconds(10));
}

}  // namespace
}  // namespace tinkerd::testing
