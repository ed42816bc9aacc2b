#include "server/http/archive_grants.h"

namespace tinkerd::http {

void ArchiveGrants::Add(const std::string& token, ArchiveGrant grant) {
  absl::MutexLock lock(&mu_);
  std::deque<std::string>& mine = order_[grant.tenant];
  grants_[token] = std::move(grant);
  mine.push_back(token);
  while (mine.size() > kMaxPerTenant) {
    grants_.erase(mine.front());
    mine.pop_front();
  }
}

std::optional<ArchiveGrant> ArchiveGrants::Find(const std::string& token) const {
  absl::MutexLock lock(&mu_);
  auto it = grants_.find(token);
  if (it == grants_.end()) return std::nullopt;
  return it->second;
}

}  // namespace tinkerd::http
