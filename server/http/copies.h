// copy_weights' idempotency: the SDK sends one X-Idempotency-Key with a copy and every resend of
// it, and a resend must get the first copy's path, not a second copy. The latest `capacity` keys
// are remembered per server, with the digest of the request they came with.
//
// Thread-safety: the first request with a key copies without the table's lock; a resend racing it
// waits for its result, so two racing resends make one copy, and other keys never wait.
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
    bool pending;  // its copy is running
  };
  const size_t capacity_;
  absl::Mutex mu_;
  absl::CondVar copied_;
  std::map<std::string, Made> made_ ABSL_GUARDED_BY(mu_);  // tenant \n key
  std::deque<std::string> order_ ABSL_GUARDED_BY(mu_);     // the finished, oldest first
};

}  // namespace tinkerd::http
