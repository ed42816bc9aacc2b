// The Tinker API's session endpoints (create_session, session_heartbeat, sessions/{id}/finish,
// sessions/search) and the reaper that ends the sessions that stop heartbeating (sessions.h holds
// the table).
#include <algorithm>
#include <initializer_list>
#include <map>
#include <optional>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "runner/util/echo.h"
#include "runner/util/log.h"
#include "runner/util/status_macros.h"
#include "server/http/tinker_api.h"
#include "server/http/tinker_convert.h"
#include "server/http/tinker_json.h"

namespace tinkerd::http {

using Json = TinkerApi::Json;

namespace {

// What a session may carry, so that the sessions' metadata stays small: at most kMaxSessionText
// bytes of name, project and metadata in all, each of max_sessions open and 10,000 remembered ones
// (200 MB at the default 100,000 open sessions).
constexpr size_t kMaxDisplayName = 256, kMaxMetadataPairs = 32, kMaxMetadataKey = 128,
                 kMaxMetadataValue = 1024, kMaxSessionText = 2048;

// user_metadata as strings: Tinker's create_session takes any JSON values (a non-string is kept
// as its JSON text), its search and summaries speak strings. `strict`: only strings (a search).
absl::StatusOr<std::map<std::string, std::string>> Metadata(const Json* obj, bool strict) {
  std::map<std::string, std::string> out;
  if (obj == nullptr) return out;
  if (obj->size() > kMaxMetadataPairs) {
    return absl::InvalidArgumentError(
        absl::StrCat("user_metadata: at most ", kMaxMetadataPairs, " entries"));
  }
  for (const auto& [key, value] : obj->items()) {
    if (strict && !value.is_string()) {
      return absl::InvalidArgumentError(
          absl::StrCat("user_metadata.", Echo(key), ": must be a string"));
    }
    std::string text = value.is_string() ? value.get<std::string>() : value.dump();
    if (key.size() > kMaxMetadataKey || text.size() > kMaxMetadataValue) {
      return absl::InvalidArgumentError(absl::StrCat("user_metadata.", Echo(key),
                                                     ": keys take at most ", kMaxMetadataKey,
                                                     " bytes and values ", kMaxMetadataValue));
    }
    out[key] = std::move(text);
  }
  return out;
}

// A list of strings: absent or null is nullopt; otherwise 1 to `most` non-empty strings.
absl::StatusOr<std::optional<std::vector<std::string>>> Strings(const Json& body, const char* name,
                                                                size_t most) {
  auto it = body.find(name);
  if (it == body.end() || it->is_null()) return std::nullopt;
  if (!it->is_array() || it->empty() || it->size() > most) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": must be a list of 1 to ", most, " strings"));
  }
  std::vector<std::string> out;
  for (const Json& v : *it) {
    if (!v.is_string() || v.get<std::string>().empty()) {
      return absl::InvalidArgumentError(absl::StrCat(name, ": must hold non-empty strings"));
    }
    out.push_back(v.get<std::string>());
  }
  return out;
}

bool OneOf(const std::string& v, std::initializer_list<const char*> allowed) {
  return std::any_of(allowed.begin(), allowed.end(), [&](const char* a) { return v == a; });
}

// Tinker's SessionSearchRequest. `*none` is set when the owner named is not the caller: sessions
// are the tenant's own, so such a search finds nothing.
absl::StatusOr<SessionQuery> ParseSearch(const std::string& tenant, const Json& body, bool* none) {
  SessionQuery q;
  Fields f(body);
  q.session_id = f.OptId("session_id");
  const std::optional<std::string> name = f.OptStr("display_name");
  const std::optional<int64_t> limit = f.OptInt("limit");
  const Json* metadata = f.Obj("user_metadata");
  const Json* owner = f.Obj("owner");
  const Json* cursor = f.Obj("cursor");
  if (!f.status().ok()) return f.status();
  if (name) {
    q.display_words = absl::StrSplit(absl::AsciiStrToLower(*name), ' ', absl::SkipWhitespace());
    if (q.display_words->empty()) {
      return absl::InvalidArgumentError("display_name: must hold a word");
    }
  }
  if (limit) {
    if (*limit < 1 || *limit > 200) return absl::InvalidArgumentError("limit: must be in [1, 200]");
    q.limit = *limit;
  }
  ASSIGN_OR_RETURN(q.project_ids, Strings(body, "project_ids", 1000));
  ASSIGN_OR_RETURN(q.user_metadata, Metadata(metadata, /*strict=*/true));
  *none = false;
  if (owner != nullptr) {
    Fields o(*owner);
    const std::string type = o.Str("type");
    if (!o.status().ok())
      return absl::InvalidArgumentError(absl::StrCat("owner.", o.status().message()));
    if (!OneOf(type, {"own", "accessible", "user"})) {
      return absl::InvalidArgumentError("owner.type: must be own, accessible or user");
    }
    if (type == "user") {
      ASSIGN_OR_RETURN(std::optional<std::vector<std::string>> urns,
                       Strings(*owner, "owner_urns", 10));
      if (!urns) return absl::InvalidArgumentError("owner.owner_urns: required");
      *none = std::find(urns->begin(), urns->end(), tenant) == urns->end();
    }
  }
  if (auto it = body.find("statuses"); it != body.end() && !it->is_null()) {
    if (!it->is_array() || it->empty()) {
      return absl::InvalidArgumentError("statuses: must be a non-empty list");
    }
    q.statuses.emplace();
    for (const Json& s : *it) {
      if (!s.is_object()) return absl::InvalidArgumentError("statuses: must hold objects");
      Fields sf(s);
      SessionQuery::Status st{sf.Str("type"), std::nullopt};
      if (!sf.status().ok()) {
        return absl::InvalidArgumentError(absl::StrCat("statuses.", sf.status().message()));
      }
      if (!OneOf(st.type, {"active", "cancelled", "failed", "client_finished"})) {
        return absl::InvalidArgumentError(
            "statuses.type: must be active, cancelled, failed or client_finished");
      }
      ASSIGN_OR_RETURN(st.reasons, Strings(s, "reasons", 3));
      for (const std::string& r : st.reasons.value_or(std::vector<std::string>{})) {
        if (!OneOf(r, {"success", "errored", "interrupted"})) {
          return absl::InvalidArgumentError(
              "statuses.reasons: must be success, errored or interrupted");
        }
      }
      q.statuses->push_back(std::move(st));
    }
  }
  if (cursor != nullptr) {
    Fields c(*cursor);
    const std::string at = c.Str("last_created_at"), last = c.Str("last_session_id");
    if (!c.status().ok())
      return absl::InvalidArgumentError(absl::StrCat("cursor.", c.status().message()));
    absl::Time t;
    std::string err;
    if (!absl::ParseTime(absl::RFC3339_full, at, &t, &err)) {
      return absl::InvalidArgumentError(
          absl::StrCat("cursor.last_created_at: not an RFC 3339 time: ", Echo(at)));
    }
    q.after = std::make_pair(t, last);
  }
  return q;
}

Json StatusJson(const SessionStatus& s) {
  Json j{{"type", s.type}};
  if (s.type == "client_finished") j["reason"] = Json{{"type", s.reason}};
  if (s.type != "active") j["detail"] = s.detail.empty() ? Json() : Json(s.detail);
  return j;
}

}  // namespace

void TinkerApi::CreateSession(const std::string& tenant, const Json& body, Respond respond) {
  Fields f(body);
  f.OptStr("sdk_version");
  const Json* metadata = f.Obj("user_metadata");
  const std::optional<std::string> project = f.OptId("project_id");
  const std::optional<std::string> name = f.OptStr("display_name");
  if (!f.status().ok()) return respond(Error(f.status()));
  SessionSummary session;
  session.tenant = tenant;
  session.project_id = project.value_or("default");
  session.display_name = name;
  if (name && name->size() > kMaxDisplayName) {
    return respond(Error(400, absl::StrCat("display_name: at most ", kMaxDisplayName, " bytes")));
  }
  if (session.project_id.size() > kMaxMetadataKey) {
    return respond(Error(400, absl::StrCat("project_id: at most ", kMaxMetadataKey, " bytes")));
  }
  auto pairs = Metadata(metadata, /*strict=*/false);
  if (!pairs.ok()) return respond(Error(pairs.status()));
  size_t text = session.project_id.size() + (name ? name->size() : 0);
  for (const auto& [key, value] : *pairs) text += key.size() + value.size();
  if (text > kMaxSessionText) {
    return respond(
        Error(400, absl::StrCat("user_metadata: a session's display_name, project_id and "
                                "user_metadata take at most ",
                                kMaxSessionText, " bytes in all")));
  }
  session.user_metadata = std::move(*pairs);
  const std::optional<std::string> id = sessions_.Create(std::move(session));
  if (!id) return respond(Error(429, "too many open sessions; retry later"));
  respond(JsonResponse(Json{{"type", "create_session"}, {"session_id", *id}}));
}

void TinkerApi::SessionHeartbeat(const std::string& tenant, const Json& body, Respond respond) {
  Fields f(body);
  const std::string id = f.Str("session_id");
  if (!f.status().ok()) return respond(Error(f.status()));
  Response missing;
  if (!sessions_.Heartbeat(tenant, id, &missing)) return respond(std::move(missing));
  respond(JsonResponse(Json{{"type", "session_heartbeat"}}));
}

// The client's account of how its session ended, first-wins. From then on the session and its
// models take no further operations (Sessions::Check, CheckModel), but the models stay until
// unloaded or reaped: their checkpoints are the user's.
void TinkerApi::FinishSession(const std::string& tenant, const std::string& endpoint,
                              const Json& body, Respond respond) {
  const std::string id(absl::StripSuffix(absl::StripPrefix(endpoint, "sessions/"), "/finish"));
  Fields f(body);
  const Json* reason = f.Obj("reason");
  const std::optional<std::string> detail = f.OptStr("detail");
  if (!f.status().ok()) return respond(Error(f.status()));
  std::string type = "success";  // SDKs before 0.38 send no body
  if (reason != nullptr) {
    Fields r(*reason);
    type = r.Str("type");
    if (!r.status().ok()) return respond(Error(400, absl::StrCat("reason.", r.status().message())));
    if (!OneOf(type, {"success", "errored", "interrupted"})) {
      return respond(Error(400, "reason.type: must be success, errored or interrupted"));
    }
  }
  if (detail && detail->size() > kMaxMetadataValue) {
    return respond(Error(400, absl::StrCat("detail: at most ", kMaxMetadataValue, " bytes")));
  }
  // A session this server no longer knows (ended long ago, or before a restart) is finished as far
  // as anyone can tell: the client's close() succeeds.
  sessions_.Finish(tenant, id, type, detail.value_or(""));
  respond(JsonResponse(Json::object()));
}

Json TinkerApi::SessionSummaryJson(const SessionSummary& s) {
  int64_t count = 0, bytes = 0;
  for (const std::string& model : s.models) {
    auto checkpoints = ops_->Checkpoints(s.tenant, model);
    if (!checkpoints.ok()) continue;  // unloaded: its checkpoints went with it
    for (const CheckpointEntry& c : *checkpoints) {
      ++count;
      bytes += c.size_bytes;
    }
  }
  Json j{{"session_id", s.id},
         {"created_at", IsoTime(s.created)},
         {"owner", s.tenant},
         {"project_id", s.project_id},
         {"status", StatusJson(s.status)},
         {"checkpoints_count", count},
         {"checkpoint_storage_bytes", bytes},
         {"user_metadata", s.user_metadata}};
  if (s.display_name) j["display_name"] = *s.display_name;
  return j;
}

void TinkerApi::SearchSessions(const std::string& tenant, const Json& body, Respond respond) {
  bool none = false;
  absl::StatusOr<SessionQuery> query = ParseSearch(tenant, body, &none);
  if (!query.ok()) return respond(Error(query.status()));
  bool more = false;
  const std::vector<SessionSummary> found =
      none ? std::vector<SessionSummary>{} : sessions_.Search(tenant, *query, &more);
  Json page = Json::array();
  for (const SessionSummary& s : found) page.push_back(SessionSummaryJson(s));
  Json out{{"sessions", std::move(page)}};
  if (more) {
    out["next_cursor"] = Json{{"last_created_at", IsoTime(found.back().created)},
                              {"last_session_id", found.back().id}};
  }
  respond(JsonResponse(out));
}

void TinkerApi::StartReaper() {
  ExpireCheckpoints();
  if (config_.session_idle <= absl::ZeroDuration()) return;
  after_(std::max(config_.session_idle / 4, absl::Milliseconds(50)), [this] { Reap(); });
}

void TinkerApi::ExpireCheckpoints() {
  ops_->ExpireCheckpoints(absl::Now());
  after_(absl::Minutes(1), [this] { ExpireCheckpoints(); });
}

void TinkerApi::Reap() {
  const std::vector<Sessions::Ended> ended = sessions_.EndIdle(absl::Now() - config_.session_idle);
  std::vector<std::pair<std::string, std::string>> samplers;  // tenant, sampler_id
  for (const Sessions::Ended& session : ended) {
    aliases_.ForgetSession(session.tenant, session.id);
    for (std::string& sampler : sampling_sessions_.ForgetSession(session.tenant, session.id)) {
      samplers.emplace_back(session.tenant, std::move(sampler));
    }
  }
  // Samplers first: their memory counts against the tenant's budget, and once the models are
  // gone nothing of the session is left. Samples already running finish on the policy they hold.
  for (const auto& [tenant, sampler] : samplers) {
    sampling_->DeleteSampler(tenant, sampler).IgnoreError();
  }
  for (const Sessions::Ended& session : ended) {
    TLOG_INFO("http: session {} sent no heartbeat for {}: ended, its {} model(s) deleted",
              session.id, absl::FormatDuration(config_.session_idle), session.models.size());
    for (const std::string& model : session.models) {
      ops_->DeleteModel(session.tenant, model,
                        [](const absl::StatusOr<v1::DeleteModelResponse>&) {});
    }
  }
  StartReaper();
}

}  // namespace tinkerd::http
