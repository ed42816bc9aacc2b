#include "server/http/sample_cancels.h"

#include "absl/strings/str_cat.h"

namespace tinkerd::http {

SampleCancels::Flag SampleCancels::Register(const std::string& tenant,
                                            const std::string& request_id) {
  auto flag = std::make_shared<std::atomic<bool>>(false);
  absl::MutexLock lock(&mu_);
  flags_[absl::StrCat(tenant, "\n", request_id)] = flag;
  return flag;
}

void SampleCancels::Forget(const std::string& tenant, const std::string& request_id,
                           const Flag& flag) {
  absl::MutexLock lock(&mu_);
  auto it = flags_.find(absl::StrCat(tenant, "\n", request_id));
  if (it != flags_.end() && it->second == flag) flags_.erase(it);
}

bool SampleCancels::Cancel(const std::string& tenant, const std::string& request_id) {
  absl::MutexLock lock(&mu_);
  auto it = flags_.find(absl::StrCat(tenant, "\n", request_id));
  if (it == flags_.end()) return false;
  it->second->store(true);
  return true;
}

}  // namespace tinkerd::http
