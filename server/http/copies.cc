#include "server/http/copies.h"

#include <utility>

namespace tinkerd::http {

absl::StatusOr<std::string> Copies::Once(const std::string& tenant, const std::string& key,
                                         uint64_t digest,
                                         const std::function<absl::StatusOr<std::string>()>& copy) {
  if (key.empty()) return copy();
  const std::string id = tenant + '\n' + key;
  absl::MutexLock lock(&mu_);
  if (auto it = made_.find(id); it != made_.end()) {
    if (it->second.digest != digest) {
      return absl::InvalidArgumentError(
          "X-Idempotency-Key: already used by a different copy_weights request; a resend must "
          "repeat its request as it was");
    }
    return it->second.path;
  }
  absl::StatusOr<std::string> path = copy();
  if (!path.ok()) return path;
  made_[id] = Made{digest, *path};
  order_.push_back(id);
  if (order_.size() > capacity_) {
    made_.erase(order_.front());
    order_.pop_front();
  }
  return path;
}

}  // namespace tinkerd::http
