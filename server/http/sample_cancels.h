// The running samples' cancel flags, by (tenant, request_id): set by cancel_future, read by the
// engine after each step (through the request's progress callback), which then ends the sample.
//
// Thread-safety: each method takes the table's own lock and calls nothing outside it.
#pragma once

#include <atomic>
#include <map>
#include <memory>
#include <string>

#include "absl/synchronization/mutex.h"

namespace tinkerd::http {

class SampleCancels {
 public:
  using Flag = std::shared_ptr<std::atomic<bool>>;
  // A new flag for the sample `request_id` (a resend's replaces the first call's).
  Flag Register(const std::string& tenant, const std::string& request_id);
  // The sample finished: forgets its flag, unless a resend registered another since.
  void Forget(const std::string& tenant, const std::string& request_id, const Flag& flag);
  // Sets the sample's flag; false when no such sample is running.
  bool Cancel(const std::string& tenant, const std::string& request_id);

 private:
  absl::Mutex mu_;
  std::map<std::string, Flag> flags_ ABSL_GUARDED_BY(mu_);  // tenant \n request_id
};

}  // namespace tinkerd::http
