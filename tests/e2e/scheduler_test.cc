// The scheduler's sharing between model requests (training) and background steps (the sampling
// engine's decode steps), on its real thread: a queued job waits at most one step, and steps go on
// while jobs are queued.
#include "server/scheduler.h"

#include <gtest/gtest.h>

#include <atomic>
#include <string>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "tests/e2e/e2e_util.h"

namespace tinkerd::testing {
namespace {

TEST(Scheduler, AQueuedJobWaitsAtMostOneStepAndStepsGoOnBetweenJobs) {
  Scheduler scheduler({});
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
  constexpr int kJobs = 5;
  for (int64_t seq = 2; seq <= kJobs; ++seq) submit(seq);
  scheduler.KickBackground();
  // With no job runnable, steps run back to back.
  WaitFor([&] { return steps.load() >= 3; }, "steps while no job can run");
  queue = true;
  WaitFor([&] { return answered.load() == kJobs; }, "every job");
  WaitFor([&] { return steps.load() >= 10; }, "steps after the jobs");
  scheduler.Stop(absl::Seconds(10));

  absl::MutexLock lock(&mu);
  const size_t q = events.find('Q');
  ASSERT_NE(q, std::string::npos);
  EXPECT_EQ(events.find('J'), q + 1) << events;
  // Then jobs and steps alternate: each job waits for one step at most, and a step runs between
  // any two jobs while steps have work.
  EXPECT_EQ(events.substr(q + 1, 2 * kJobs), "JSJSJSJSJS") << events;
  EXPECT_GE(q, 3u) << "steps ran back to back while no job could run: " << events;
}

}  // namespace
}  // namespace tinkerd::testing
