#include "server/http/aliases.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace tinkerd::http {

std::string Aliases::Resolve(const std::string& tenant, const std::string& model_id) const {
  absl::MutexLock lock(&mu_);
  auto it = models_.find(tenant + '\n' + model_id);
  return it == models_.end() ? model_id : it->second;
}

void Aliases::Add(const std::string& tenant, const std::string& session_id, int64_t model_seq_id,
                  const std::string& model_id) {
  absl::MutexLock lock(&mu_);
  models_[absl::StrCat(tenant, "\n", session_id, ":train:", model_seq_id)] = model_id;
}

void Aliases::ForgetSession(const std::string& tenant, const std::string& session_id) {
  const std::string prefix = tenant + '\n' + session_id + ':';
  absl::MutexLock lock(&mu_);
  for (auto a = models_.lower_bound(prefix);
       a != models_.end() && absl::StartsWith(a->first, prefix);) {
    a = models_.erase(a);
  }
}

}  // namespace tinkerd::http
