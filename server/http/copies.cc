#include "server/http/copies.h"

#include <utility>

namespace tinkerd::http {

absl::StatusOr<std::string> Copies::Once(const std::string& tenant, const std::string& key,
                                         uint64_t digest,
                                         const std::function<absl::StatusOr<std::string>()>& copy) {
  if (key.empty()) return copy();
  const std::string id = tenant + '\n' + key;
  {
    absl::MutexLock lock(&mu_);
    for (;;) {
      auto it = made_.find(id);
      if (it == made_.end()) break;
      if (it->second.digest != digest) {
        return absl::InvalidArgumentError(
            "X-Idempotency-Key: already used by a different copy_weights request; a resend must "
            "repeat its request as it was");
      }
      if (!it->second.pending) return it->second.path;
      copied_.Wait(&mu_);  // the first request with this key is copying
    }
    made_[id] = Made{digest, "", /*pending=*/true};
  }
  absl::StatusOr<std::string> path = copy();
  absl::MutexLock lock(&mu_);
  if (path.ok()) {
    made_[id] = Made{digest, *path, /*pending=*/false};
    order_.push_back(id);
    if (order_.size() > capacity_) {
      made_.erase(order_.front());
      order_.pop_front();
    }
  } else {
    made_.erase(id);  // a resend tries again
  }
  copied_.SignalAll();
  return path;
}

}  // namespace tinkerd::http
