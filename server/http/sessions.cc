#include "server/http/sessions.h"

#include <algorithm>
#include <functional>

#include "absl/strings/str_cat.h"
#include "runner/util/echo.h"
#include "server/http/tinker_json.h"

namespace tinkerd::http {

std::optional<std::string> Sessions::Create(const std::string& tenant) {
  std::string id = "session-" + RandomHex();
  absl::MutexLock lock(&mu_);
  if (sessions_.size() >= max_sessions_) return std::nullopt;
  const absl::Time now = absl::Now();
  sessions_[id] = Session{tenant, now, now, {}};
  return id;
}

bool Sessions::Heartbeat(const std::string& tenant, const std::string& id, Response* missing) {
  absl::MutexLock lock(&mu_);
  if (FindLocked(tenant, id, missing) == nullptr) return false;
  sessions_.at(id).last_heartbeat = absl::Now();
  return true;
}

absl::Status Sessions::Check(const std::string& tenant, const std::string& id) const {
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(id);
  if (it == sessions_.end() || it->second.tenant != tenant) {
    return absl::NotFoundError(absl::StrCat("session_id: no session '", Echo(id), "'"));
  }
  return absl::OkStatus();
}

bool Sessions::IsOpen(const std::string& id) const {
  absl::MutexLock lock(&mu_);
  return sessions_.count(id) > 0;
}

void Sessions::AddModel(const std::string& id, const std::string& model_id) {
  absl::MutexLock lock(&mu_);
  if (auto it = sessions_.find(id); it != sessions_.end()) it->second.models.push_back(model_id);
}

std::vector<std::string> Sessions::Ids(const std::string& tenant) const {
  std::vector<std::pair<absl::Time, std::string>> open;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [id, session] : sessions_) {
      if (session.tenant == tenant) open.emplace_back(session.created, id);
    }
  }
  std::sort(open.begin(), open.end(), std::greater<>());  // newest first
  std::vector<std::string> ids;
  for (auto& [created, id] : open) ids.push_back(std::move(id));
  return ids;
}

std::optional<std::vector<std::string>> Sessions::Models(const std::string& tenant,
                                                         const std::string& id,
                                                         Response* missing) const {
  absl::MutexLock lock(&mu_);
  const Session* session = FindLocked(tenant, id, missing);
  if (session == nullptr) return std::nullopt;
  return session->models;
}

std::vector<Sessions::Ended> Sessions::EndIdle(absl::Time cutoff) {
  std::vector<Ended> ended;
  absl::MutexLock lock(&mu_);
  for (auto it = sessions_.begin(); it != sessions_.end();) {
    if (it->second.last_heartbeat >= cutoff) {
      ++it;
      continue;
    }
    ended_.insert(it->second.tenant + '\n' + it->first);
    ended_order_.push_back(it->second.tenant + '\n' + it->first);
    if (ended_order_.size() > max_sessions_) {
      ended_.erase(ended_order_.front());
      ended_order_.pop_front();
    }
    ended.push_back(Ended{it->first, std::move(it->second.tenant), std::move(it->second.models)});
    it = sessions_.erase(it);
  }
  return ended;
}

const Sessions::Session* Sessions::FindLocked(const std::string& tenant, const std::string& id,
                                              Response* missing) const {
  auto it = sessions_.find(id);
  if (it != sessions_.end() && it->second.tenant == tenant) return &it->second;
  *missing = ended_.count(tenant + '\n' + id)
                 ? Error(410, absl::StrCat("session_id: session '", Echo(id),
                                           "' ended after no heartbeat for ",
                                           absl::FormatDuration(idle_), "; create a new session"))
                 : Error(404, absl::StrCat("session_id: no session '", Echo(id), "'"));
  return nullptr;
}

}  // namespace tinkerd::http
