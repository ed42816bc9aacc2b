// The scheduler's sharing between model requests (training) and background steps (the sampling
// engine's decode steps), on its real thread: a queued job waits at most one step (or
// steps_between_jobs), and steps go on while jobs are queued.
#include "server/core/scheduler.h"

#include <gtest/gtest.h>

#include <atomic>
#include <string>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "tests/e2e/e2e_util.h"

namespace tinkerd::testing {
namespace {

// Runs five jobs that become runnable at once, from inside a step, while steps always have more
// to do; returns the events from the moment they were queued: S a step began, J a job ran, Q every
// job was queued. `steps` before it: how many steps ran back to back while no job could run.
std::string JobsBesideSteps(int steps_between_jobs, size_t* steps_before) {
  SchedulerConfig config;
  config.steps_between_jobs = steps_between_jobs;
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
  absl::Notification created;
  scheduler.CreateModel(
      "tenant", [] { return absl::StatusOr<std::string>("m"); },
      [&](const absl::StatusOr<std::string>& id) {
        EXPECT_TRUE(id.ok());
        created.Notify();
      });
  created.WaitForNotification();
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

}  // namespace
}  // namespace tinkerd::testing
