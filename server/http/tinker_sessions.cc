// The Tinker API's session endpoints (create_session, session_heartbeat, sessions/{id}/finish)
// and the reaper that ends the sessions that stop heartbeating (sessions.h holds the table).
#include <algorithm>
#include <optional>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "runner/util/log.h"
#include "server/http/tinker_api.h"
#include "server/http/tinker_convert.h"
#include "server/http/tinker_json.h"

namespace tinkerd::http {

using Json = TinkerApi::Json;

void TinkerApi::CreateSession(const std::string& tenant, const Json& body, Respond respond) {
  Fields f(body);
  f.OptStr("sdk_version");
  f.Obj("user_metadata");
  if (!f.status().ok()) return respond(Error(f.status()));
  const std::optional<std::string> id = sessions_.Create(tenant);
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

void TinkerApi::FinishSession(const std::string&, const Json&, Respond respond) {
  // The session's models stay until unloaded: their checkpoints and gradients are the user's.
  respond(JsonResponse(Json::object()));
}

void TinkerApi::StartReaper() {
  if (config_.session_idle <= absl::ZeroDuration()) return;
  after_(std::max(config_.session_idle / 4, absl::Milliseconds(50)), [this] { Reap(); });
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
