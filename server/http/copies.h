// copy_weights' idempotency: the SDK sends one X-Idempotency-Key with a copy and every resend of
// it, and a resend must get the first copy's path, not a second copy. The latest `capacity` keys
// are remembered per server, with the digest of the request they came with.
//
// Thread-safety: Once holds the table's lock while the copy runs, so two racing resends make one
// copy; copies are rare and take milliseconds (hard links).
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <string>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace tinkerd::http {

class Copies {
 public:
  explicit Copies(size_t capacity) : capacity_(capacity) {}

  // The path `copy` made for the tenant's `key` before, or `copy`'s own result, remembered when
  // it succeeds. An empty key remembers nothing. INVALID_ARGUMENT naming the header when the key
  // came with a different request (`digest`).
  absl::StatusOr<std::string> Once(const std::string& tenant, const std::string& key,
                                   uint64_t digest,
                                   const std::function<absl::StatusOr<std::string>()>& copy);

 private:
  struct Made {
    uint64_t digest;
    std::string path;
  };
  const size_t capacity_;
  absl::Mutex mu_;
  std::map<std::string, Made> made_ ABSL_GUARDED_BY(mu_);  // tenant \n key
  std::deque<std::string> order_ ABSL_GUARDED_BY(mu_);     // oldest first
};

}  // namespace tinkerd::http
