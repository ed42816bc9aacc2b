// server/common/worker.h: the loader thread's bounded queue answers why it refuses (full: retry
// later; stopping: unavailable), and a stop cancels what waits instead of running it.
#include "server/common/worker.h"

#include <gtest/gtest.h>

#include <thread>

#include "absl/synchronization/notification.h"

namespace tinkerd::testing {
namespace {

TEST(Worker, RefusesWhenFullThenWhenStoppingAndCancelsWhatWaits) {
  Worker worker(/*max_queued=*/1);
  absl::Notification started, release, cancelled;
  int ran = 0, cancels = 0;
  // The first item holds the thread, so what follows waits in the queue.
  ASSERT_TRUE(worker
                  .Submit(
                      [&] {
                        started.Notify();
                        release.WaitForNotification();
                        ++ran;
                      },
                      [&] { ++cancels; })
                  .ok());
  started.WaitForNotification();
  // From here on the held item must be released before the test returns (the worker's
  // destructor joins it), so failures are EXPECTs and waits have deadlines.
  EXPECT_TRUE(worker
                  .Submit([&] { ++ran; },
                          [&] {
                            ++cancels;
                            cancelled.Notify();
                          })
                  .ok());
  const absl::Status full = worker.Submit([&] { ++ran; }, [&] { ++cancels; });
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted) << full;

  std::thread stopper([&] { worker.Stop(); });
  // Stop has begun once the waiting item is cancelled.
  EXPECT_TRUE(cancelled.WaitForNotificationWithTimeout(absl::Seconds(60)));
  const absl::Status stopping = worker.Submit([&] { ++ran; }, [&] { ++cancels; });
  EXPECT_EQ(stopping.code(), absl::StatusCode::kUnavailable) << stopping;
  release.Notify();
  stopper.join();
  EXPECT_EQ(ran, 1) << "only the item that had started runs";
  EXPECT_EQ(cancels, 1) << "only the item that waited is cancelled";
}

}  // namespace
}  // namespace tinkerd::testing
