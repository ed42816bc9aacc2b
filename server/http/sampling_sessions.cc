#include "server/http/sampling_sessions.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace tinkerd::http {
namespace {

std::string Key(const std::string& tenant, const std::string& session_id, int64_t seq) {
  return absl::StrCat(tenant, "\n", session_id, ":", seq);
}

std::string SessionPrefix(const std::string& tenant, const std::string& session_id) {
  return tenant + '\n' + session_id + ':';
}

}  // namespace

SamplingSessions::Turn SamplingSessions::Begin(const std::string& tenant,
                                               const std::string& session_id, int64_t seq,
                                               uint64_t digest, Respond* respond,
                                               const std::function<bool(const std::string&)>& alive,
                                               std::string* sampler_id) {
  absl::MutexLock lock(&mu_);
  auto [it, added] = calls_.try_emplace(Key(tenant, session_id, seq));
  Call& call = it->second;
  if (added) call.digest = digest;
  if (call.digest != digest) return Turn::kConflict;
  if (!call.sampler_id.empty()) {
    if (alive(call.sampler_id)) {
      *sampler_id = call.sampler_id;
      return Turn::kAnswer;
    }
    call.sampler_id.clear();
  } else if (!call.waiting.empty()) {
    call.waiting.push_back(std::move(*respond));
    return Turn::kWait;
  }
  call.waiting.push_back(std::move(*respond));
  return Turn::kMake;
}

std::vector<Respond> SamplingSessions::Finish(const std::string& tenant,
                                              const std::string& session_id, int64_t seq,
                                              const std::string& sampler_id) {
  std::vector<Respond> waiting;
  absl::MutexLock lock(&mu_);
  auto it = calls_.find(Key(tenant, session_id, seq));
  if (it == calls_.end()) return waiting;
  waiting.swap(it->second.waiting);
  if (sampler_id.empty()) {
    calls_.erase(it);
  } else {
    it->second.sampler_id = sampler_id;
  }
  return waiting;
}

void SamplingSessions::Forget(const std::string& tenant, const std::string& session_id, int64_t seq,
                              const std::string& sampler_id) {
  absl::MutexLock lock(&mu_);
  auto it = calls_.find(Key(tenant, session_id, seq));
  if (it != calls_.end() && it->second.sampler_id == sampler_id) calls_.erase(it);
}

std::vector<std::string> SamplingSessions::Samplers(const std::string& tenant,
                                                    const std::string& session_id) const {
  const std::string prefix = SessionPrefix(tenant, session_id);
  std::vector<std::string> samplers;
  absl::MutexLock lock(&mu_);
  for (auto s = calls_.lower_bound(prefix); s != calls_.end() && absl::StartsWith(s->first, prefix);
       ++s) {
    if (!s->second.sampler_id.empty()) samplers.push_back(s->second.sampler_id);
  }
  return samplers;
}

std::vector<std::string> SamplingSessions::ForgetSession(const std::string& tenant,
                                                         const std::string& session_id) {
  const std::string prefix = SessionPrefix(tenant, session_id);
  std::vector<std::string> samplers;
  absl::MutexLock lock(&mu_);
  for (auto s = calls_.lower_bound(prefix);
       s != calls_.end() && absl::StartsWith(s->first, prefix);) {
    // One being made has callers waiting: it goes when it is answered.
    if (s->second.sampler_id.empty()) {
      ++s;
      continue;
    }
    samplers.push_back(s->second.sampler_id);
    s = calls_.erase(s);
  }
  return samplers;
}

}  // namespace tinkerd::http
