#include "server/http/sessions.h"

#include <algorithm>
#include <functional>
#include <tuple>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "runner/util/echo.h"
#include "server/http/tinker_json.h"

namespace tinkerd::http {
namespace {

bool Matches(const SessionSummary& s, const SessionQuery& q) {
  if (q.session_id || q.display_words) {
    // With both, a session matching either one matches (Tinker's rule).
    bool named = false;
    if (q.display_words && s.display_name) {
      const std::string name = absl::AsciiStrToLower(*s.display_name);
      named = std::all_of(q.display_words->begin(), q.display_words->end(),
                          [&](const std::string& w) { return absl::StrContains(name, w); });
    }
    if (!named && !(q.session_id && *q.session_id == s.id)) return false;
  }
  if (q.project_ids && std::find(q.project_ids->begin(), q.project_ids->end(), s.project_id) ==
                           q.project_ids->end()) {
    return false;
  }
  for (const auto& [key, value] : q.user_metadata) {
    auto it = s.user_metadata.find(key);
    if (it == s.user_metadata.end() || it->second != value) return false;
  }
  if (q.statuses) {
    return std::any_of(q.statuses->begin(), q.statuses->end(), [&](const SessionQuery::Status& st) {
      return st.type == s.status.type &&
             (!st.reasons || std::find(st.reasons->begin(), st.reasons->end(), s.status.reason) !=
                                 st.reasons->end());
    });
  }
  return true;
}

}  // namespace

std::optional<std::string> Sessions::Create(SessionSummary session) {
  session.id = "session-" + RandomHex();
  const absl::Time now = absl::Now();
  session.status = SessionStatus{};
  absl::MutexLock lock(&mu_);
  if (sessions_.size() >= max_sessions_) return std::nullopt;
  // Whole milliseconds, as the time's RFC 3339 form (and so a search cursor) carries it, and one
  // later than the last session's at least: creation order is the time order, with no ties.
  session.created = std::max(absl::FromUnixMillis(absl::ToUnixMillis(now)),
                             last_created_ + absl::Milliseconds(1));
  last_created_ = session.created;
  std::string id = session.id;
  sessions_[id] = Session{std::move(session), now};
  return id;
}

bool Sessions::Heartbeat(const std::string& tenant, const std::string& id, Response* missing) {
  absl::MutexLock lock(&mu_);
  const Session* session = FindLocked(tenant, id, missing);
  if (session == nullptr) return false;
  // 410 is what stops the SDK's heartbeat loop: the session is over for its client.
  if (absl::Status finished = Unfinished(session->summary); !finished.ok()) {
    *missing = Error(410, std::string(finished.message()));
    return false;
  }
  sessions_.at(id).last_heartbeat = absl::Now();
  return true;
}

bool Sessions::Finish(const std::string& tenant, const std::string& id, const std::string& reason,
                      const std::string& detail) {
  absl::MutexLock lock(&mu_);
  SessionSummary* s = nullptr;
  if (auto it = sessions_.find(id); it != sessions_.end()) s = &it->second.summary;
  if (auto it = ended_.find(id); it != ended_.end()) s = &it->second;
  if (s == nullptr || s->tenant != tenant) return false;
  // First-wins: an ended session's "cancelled" gives way to the client's own account.
  if (s->status.type != "client_finished")
    s->status = SessionStatus{"client_finished", reason, detail};
  return true;
}

absl::Status Sessions::Check(const std::string& tenant, const std::string& id) const {
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(id);
  if (it == sessions_.end() || it->second.summary.tenant != tenant) {
    return absl::NotFoundError(absl::StrCat("session_id: no session '", Echo(id), "'"));
  }
  return Unfinished(it->second.summary);
}

absl::Status Sessions::Unfinished(const SessionSummary& s) {
  if (s.status.type != "client_finished") return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat("session_id: session '", Echo(s.id), "' was finished by its client (",
                   s.status.reason, "); it takes no further operations: create a new session"));
}

bool Sessions::IsOpen(const std::string& id) const {
  absl::MutexLock lock(&mu_);
  return sessions_.count(id) > 0;
}

void Sessions::AddModel(const std::string& id, const std::string& model_id) {
  absl::MutexLock lock(&mu_);
  if (auto it = sessions_.find(id); it != sessions_.end()) {
    std::vector<std::string>& models = it->second.summary.models;
    // A resent copy_weights names its model again.
    if (std::find(models.begin(), models.end(), model_id) == models.end()) {
      models.push_back(model_id);
    }
    model_session_[model_id] = id;
  }
}

void Sessions::ForgetModel(const std::string& model_id) {
  absl::MutexLock lock(&mu_);
  model_session_.erase(model_id);
}

absl::Status Sessions::CheckModel(const std::string& model_id) const {
  absl::MutexLock lock(&mu_);
  auto it = model_session_.find(model_id);
  if (it == model_session_.end()) return absl::OkStatus();
  if (auto open = sessions_.find(it->second); open != sessions_.end()) {
    return Unfinished(open->second.summary);
  }
  if (auto ended = ended_.find(it->second); ended != ended_.end()) return Unfinished(ended->second);
  return absl::OkStatus();
}

std::vector<std::string> Sessions::Ids(const std::string& tenant) const {
  std::vector<std::pair<absl::Time, std::string>> open;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [id, session] : sessions_) {
      if (session.summary.tenant == tenant) open.emplace_back(session.summary.created, id);
    }
  }
  std::sort(open.begin(), open.end(), std::greater<>());  // newest first
  std::vector<std::string> ids;
  for (auto& [created, id] : open) ids.push_back(std::move(id));
  return ids;
}

std::optional<SessionSummary> Sessions::Get(const std::string& tenant, const std::string& id,
                                            Response* missing) const {
  absl::MutexLock lock(&mu_);
  const Session* session = FindLocked(tenant, id, missing);
  if (session == nullptr) return std::nullopt;
  return session->summary;
}

std::vector<SessionSummary> Sessions::Search(const std::string& tenant, const SessionQuery& query,
                                             bool* more) const {
  absl::MutexLock lock(&mu_);
  // Only the page is copied: the matches are ranked by pointer, newest first.
  std::vector<const SessionSummary*> matches;
  auto consider = [&](const SessionSummary& s) {
    if (s.tenant != tenant) return;
    if (query.after && std::make_pair(s.created, s.id) >= *query.after) return;
    if (Matches(s, query)) matches.push_back(&s);
  };
  for (const auto& [id, session] : sessions_) consider(session.summary);
  for (const auto& [id, summary] : ended_) consider(summary);
  const size_t page = std::min(matches.size(), static_cast<size_t>(query.limit));
  std::partial_sort(matches.begin(), matches.begin() + page, matches.end(),
                    [](const SessionSummary* a, const SessionSummary* b) {
                      return std::tie(a->created, a->id) > std::tie(b->created, b->id);
                    });
  *more = matches.size() > page;
  std::vector<SessionSummary> found;
  for (size_t i = 0; i < page; ++i) found.push_back(*matches[i]);
  return found;
}

std::vector<Sessions::Ended> Sessions::EndIdle(absl::Time cutoff) {
  std::vector<Ended> ended;
  absl::MutexLock lock(&mu_);
  for (auto it = sessions_.begin(); it != sessions_.end();) {
    if (it->second.last_heartbeat >= cutoff) {
      ++it;
      continue;
    }
    SessionSummary& s = it->second.summary;
    if (s.status.type == "active") {
      s.status = SessionStatus{"cancelled", "",
                               absl::StrCat("no heartbeat for ", absl::FormatDuration(idle_))};
    }
    ended.push_back(Ended{it->first, s.tenant, s.models});
    ended_order_.push_back(it->first);
    ended_[it->first] = std::move(s);
    if (ended_order_.size() > std::min(max_sessions_, kMaxEnded)) {
      auto forgotten = ended_.find(ended_order_.front());
      for (const std::string& model : forgotten->second.models) {
        // Only where the model still counts as this session's (a copy may have moved it since).
        auto entry = model_session_.find(model);
        if (entry != model_session_.end() && entry->second == forgotten->first) {
          model_session_.erase(entry);
        }
      }
      ended_.erase(forgotten);
      ended_order_.pop_front();
    }
    it = sessions_.erase(it);
  }
  return ended;
}

const Sessions::Session* Sessions::FindLocked(const std::string& tenant, const std::string& id,
                                              Response* missing) const {
  auto it = sessions_.find(id);
  if (it != sessions_.end() && it->second.summary.tenant == tenant) return &it->second;
  auto gone = ended_.find(id);
  *missing = gone != ended_.end() && gone->second.tenant == tenant
                 ? Error(410, absl::StrCat("session_id: session '", Echo(id),
                                           "' ended after no heartbeat for ",
                                           absl::FormatDuration(idle_), "; create a new session"))
                 : Error(404, absl::StrCat("session_id: no session '", Echo(id), "'"));
  return nullptr;
}

}  // namespace tinkerd::http
