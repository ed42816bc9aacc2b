// Whether the server still makes progress. Everything the server does to a model or a sample runs
// on the scheduler's one thread, one item at a time, so an item that never returns (a kernel that
// spins, a collective that hangs, an allocator that retries forever) stops every tenant while the
// process looks alive. The watch polls the item running now and reports a stall once it has run
// longer than `timeout`, and the recovery if it returns after all; the server turns health
// NOT_SERVING in between, so that a load balancer stops sending work and an orchestrator can
// restart the process.
//
// `timeout` must exceed the longest call the server is meant to run (a forward_backward of the
// largest batch on the slowest device); it is --stall_timeout_s.
#pragma once

#include <functional>
#include <string>
#include <thread>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/core/scheduler.h"

namespace tinkerd {

class StallWatch {
 public:
  // `on_change(true, what)` once the running item (described by `what`) passes `timeout`;
  // `on_change(false, what)` when it has returned. Both on the watch's own thread.
  StallWatch(std::function<Scheduler::Running()> current, absl::Duration timeout,
             std::function<void(bool stalled, const std::string& what)> on_change);
  ~StallWatch();  // stops and joins the thread

 private:
  void Loop();

  const std::function<Scheduler::Running()> current_;
  const absl::Duration timeout_;
  const std::function<void(bool, const std::string&)> on_change_;
  absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace tinkerd
