// One thread running submitted work in order, for slow work that must stall neither the
// scheduler's thread nor a front end's (reading a sampler export of several GB from disk).
// Bounded: past `max_queued` waiting items Submit refuses, so a client cannot queue without end.
#pragma once

#include <deque>
#include <functional>
#include <thread>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"

namespace tinkerd {

class Worker {
 public:
  explicit Worker(int max_queued);
  ~Worker();  // Stop()
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;

  // Queues `run`; `cancel` runs instead if the worker stops before `run` started. When Submit
  // refuses, neither runs: RESOURCE_EXHAUSTED while `max_queued` items wait (retry later),
  // UNAVAILABLE once the worker is stopping.
  absl::Status Submit(std::function<void()> run, std::function<void()> cancel);
  // Lets the running item finish, cancels the queued ones, and joins the thread.
  void Stop();

 private:
  struct Item {
    std::function<void()> run;
    std::function<void()> cancel;
  };
  void Loop();
  bool Ready() const ABSL_SHARED_LOCKS_REQUIRED(mu_) { return stopping_ || !queue_.empty(); }

  const size_t max_queued_;
  mutable absl::Mutex mu_;
  std::deque<Item> queue_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace tinkerd
