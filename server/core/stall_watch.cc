#include "server/core/stall_watch.h"

#include <algorithm>

#include "runner/util/log.h"

namespace tinkerd {

StallWatch::StallWatch(std::function<Scheduler::Running()> current, absl::Duration timeout,
                       std::function<void(bool, const std::string&)> on_change)
    : current_(std::move(current)), timeout_(timeout), on_change_(std::move(on_change)) {
  thread_ = std::thread([this] { Loop(); });
}

StallWatch::~StallWatch() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  thread_.join();
}

void StallWatch::Loop() {
  // A stall is seen within a tenth of the timeout after it begins (and at least once a second).
  const absl::Duration poll = std::clamp(timeout_ / 10, absl::Milliseconds(1), absl::Seconds(1));
  bool stalled = false;
  absl::Time stalled_since;
  std::string stalled_what;
  absl::MutexLock lock(&mu_);
  while (!mu_.AwaitWithTimeout(absl::Condition(&stop_), poll)) {
    const Scheduler::Running now = current_();
    if (!stalled && absl::Now() - now.since > timeout_) {
      stalled = true;
      stalled_since = now.since;
      stalled_what = now.what;
      TLOG_ERROR(
          "stalled: {} has run for {} (over --stall_timeout_s); nothing else can run meanwhile; "
          "health is NOT_SERVING until it returns",
          stalled_what,
          absl::FormatDuration(absl::Trunc(absl::Now() - now.since, absl::Seconds(1))));
      on_change_(true, stalled_what);
    } else if (stalled && now.since != stalled_since) {
      stalled = false;
      TLOG_WARN("no longer stalled: {} returned after {}; serving again", stalled_what,
                absl::FormatDuration(absl::Trunc(absl::Now() - stalled_since, absl::Seconds(1))));
      on_change_(false, stalled_what);
    }
  }
}

}  // namespace tinkerd
