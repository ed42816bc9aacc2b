// Archive URLs given out (TinkerApi::ArchiveUrl), by token: each tenant's latest
// kMaxPerTenant, so that no tenant can push out another's. A token found here may still have
// expired: its caller answers that 410.
//
// Thread-safety: each method takes the table's own lock and calls nothing outside it.
#pragma once

#include <cstddef>
#include <deque>
#include <map>
#include <optional>
#include <string>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace tinkerd::http {

struct ArchiveGrant {
  std::string tenant, uri;
  absl::Time expires;
  std::string file;  // set: this one file of the checkpoint, as it is (no archive)
};

class ArchiveGrants {
 public:
  static constexpr size_t kMaxPerTenant = 256;

  void Add(const std::string& token, ArchiveGrant grant);
  std::optional<ArchiveGrant> Find(const std::string& token) const;

 private:
  mutable absl::Mutex mu_;
  std::map<std::string, ArchiveGrant> grants_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::deque<std::string>> order_ ABSL_GUARDED_BY(mu_);  // by tenant
};

}  // namespace tinkerd::http
