#include "server/http/tinker_api.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "runner/util/echo.h"
#include "server/http/json_body.h"
#include "server/http/tinker_json.h"

namespace tinkerd::http {

using Json = TinkerApi::Json;

TinkerApi::TinkerApi(Ops* ops, Sampling* sampling, ApiKeys keys, TinkerApiConfig config,
                     std::function<void(absl::Duration, std::function<void()>)> after)
    : ops_(ops),
      sampling_(sampling),
      keys_(std::move(keys)),
      config_(std::move(config)),
      after_(std::move(after)),
      router_(JsonPosts()),
      futures_(config_.futures, after_),
      sessions_(config_.max_sessions, config_.session_idle) {}

namespace {

Response Unauthorized(const std::string& api_key) {
  return Error(401, api_key.empty() ? "X-API-Key: missing" : "X-API-Key: not a key of this server");
}

}  // namespace

std::map<std::string, Router::JsonHandler> TinkerApi::JsonPosts() {
  using Method = void (TinkerApi::*)(const std::string& tenant, const Json& body, Respond respond);
  static const std::pair<const char*, Method> kPosts[] = {
      {"client/config", &TinkerApi::ClientConfig},
      {"client/dynamic_config", &TinkerApi::DynamicConfig},
      {"create_session", &TinkerApi::CreateSession},
      {"session_heartbeat", &TinkerApi::SessionHeartbeat},
      {"sessions/search", &TinkerApi::SearchSessions},
      {"telemetry", &TinkerApi::Telemetry},
      {"create_model", &TinkerApi::CreateModel},
      {"get_info", &TinkerApi::GetInfo},
      {"unload_model", &TinkerApi::UnloadModel},
      {"optim_step", &TinkerApi::OptimStep},
      {"save_weights", &TinkerApi::SaveWeights},
      {"load_weights", &TinkerApi::LoadWeights},
      {"save_weights_for_sampler", &TinkerApi::SaveWeightsForSampler},
      {"save_weights_external", &TinkerApi::SaveWeightsExternal},
      {"weights_info", &TinkerApi::WeightsInfo},
      {"retrieve_future", &TinkerApi::RetrieveFuture},
      {"retrieve_futures", &TinkerApi::RetrieveFutures},
      {"asample", &TinkerApi::ASample},
      {"cancel_future", &TinkerApi::CancelFuture},
      {"join_sampling_session", &TinkerApi::JoinSamplingSession},
      {"create_sampling_session", &TinkerApi::CreateSamplingSession},
  };
  std::map<std::string, Router::JsonHandler> posts;
  for (const auto& [endpoint, method] : kPosts) {
    posts[endpoint] = [this, method](const std::string& tenant, const Json& body, Respond respond) {
      (this->*method)(tenant, body, std::move(respond));
    };
  }
  return posts;
}

// `tinker auth login` checks a key with GET auth/apikey/me before storing it; `tinker auth logout`
// deletes it with DELETE, which this server leaves to its operator: keys are lines of
// --api_keys_file. There are no organizations or users here: the tenant names both.
void TinkerApi::ApiKey(const std::string& tenant, const Request& req, Respond respond) {
  if (req.method == "DELETE") {
    return respond(Error(501,
                         "auth/apikey/me: keys are lines of the server's --api_keys_file; "
                         "its operator removes one there"));
  }
  if (req.method != "GET") return respond(Error(405, "auth/apikey/me: use GET"));
  absl::StatusOr<int> number = keys_.NumberOf(req.api_key);
  if (!number.ok()) return respond(Unauthorized(req.api_key));
  respond(JsonResponse(
      Json{{"key_id", *number},
           {"name", tenant},
           {"note", "a key of --api_keys_file"},
           {"details", {{"org_details", {{"name", tenant}}}, {"user_details", {{"email", ""}}}}}}));
}

std::optional<Response> TinkerApi::Admit(const Request& head) const {
  const Router::Kind kind = router_.Find(head.path).kind;
  // Answered without a key (health, an archive URL, which is its own credential) or without a
  // body to read first (an unknown path): the handler answers them.
  if (kind == Router::Kind::kHealthz || kind == Router::Kind::kArchive ||
      kind == Router::Kind::kUnknown || !keys_.enabled() || keys_.TenantOf(head.api_key).ok()) {
    return std::nullopt;
  }
  return Unauthorized(head.api_key);
}

void TinkerApi::Handle(Request req, Respond respond) {
  const Router::Route route = router_.Find(req.path);
  const std::string& endpoint = route.endpoint;
  using Kind = Router::Kind;
  if (Metrics* metrics = ops_->metrics()) {
    respond = [metrics, label = route.label, t0 = absl::Now(),
               respond = std::move(respond)](Response r) {
      metrics->ObserveHttp(label, r.status, absl::ToDoubleSeconds(absl::Now() - t0));
      respond(std::move(r));
    };
  }
  if (route.kind == Kind::kUnknown) {
    return respond(Error(404, absl::StrCat("no endpoint ", Echo(req.method), " ", Echo(req.path))));
  }
  if (route.kind == Kind::kHealthz) return respond(JsonResponse(Json{{"status", "ok"}}));
  // An archive URL is its own credential: whoever holds it downloads without a key, as with a
  // signed URL.
  if (route.kind == Kind::kArchive) {
    return Archive(req.method, endpoint.substr(sizeof("archives/") - 1), std::move(respond));
  }

  auto tenant =
      keys_.enabled() ? keys_.TenantOf(req.api_key) : absl::StatusOr<std::string>("default");
  if (!tenant.ok()) return respond(Unauthorized(req.api_key));
  if (!req.content_encoding.empty()) {
    return respond(Error(415, absl::StrCat("Content-Encoding: '", Echo(req.content_encoding),
                                           "' is not supported; send the body uncompressed")));
  }

  if (route.kind == Kind::kApiKey) return ApiKey(*tenant, req, std::move(respond));
  if (route.kind == Kind::kTrainingRuns) {
    return TrainingRuns(*tenant, req, endpoint, std::move(respond));
  }
  if (route.kind == Kind::kSessions || route.kind == Kind::kCheckpoints) {
    // Paths under a session that this server does not serve (project, trace_export) are unknown
    // whatever the method.
    if (route.kind == Kind::kSessions && std::count(endpoint.begin(), endpoint.end(), '/') > 1) {
      return respond(
          Error(404, absl::StrCat("no endpoint ", Echo(req.method), " ", Echo(req.path))));
    }
    if (req.method != "GET") return respond(Error(405, absl::StrCat(endpoint, ": use GET")));
    auto page = PageFromQuery(req.query);  // access_scope too, for a single item
    if (!page.ok()) return respond(Error(page.status()));
    if (route.kind == Kind::kSessions) {
      return ListSessions(*tenant, *page, endpoint, std::move(respond));
    }
    return UserCheckpoints(*tenant, *page, std::move(respond));
  }
  const bool get = route.kind == Kind::kCapabilities || route.kind == Kind::kSampler;
  if (req.method != (get ? "GET" : "POST")) {
    return respond(Error(405, absl::StrCat(endpoint, ": use ", get ? "GET" : "POST")));
  }
  if (route.kind == Kind::kCapabilities) {
    Json models = Json::array();
    for (const BaseModel& base : ops_->BaseModels()) {
      models.push_back(
          Json{{"model_name", base.name}, {"max_context_length", base.limits.max_context_length}});
    }
    return respond(JsonResponse(Json{{"supported_models", std::move(models)}}));
  }
  if (route.kind == Kind::kSampler) {
    return GetSampler(*tenant, endpoint.substr(sizeof("samplers/") - 1), std::move(respond));
  }
  if (route.kind == Kind::kForwardBackward) {
    if (req.content_type != "application/x-protobuf") {
      return respond(Error(415,
                           "Content-Type: forward_backward takes application/x-protobuf "
                           "(a tinker_public.ForwardBackwardRequest)"));
    }
    return ForwardBackward(*tenant, req, std::move(respond));
  }
  if (req.content_type != "application/json" && !(req.content_type.empty() && req.body.empty())) {
    return respond(
        Error(415, absl::StrCat("Content-Type: ", endpoint, " takes application/json, not '",
                                Echo(req.content_type), "'")));
  }
  // The DOM is held in the memory account until the handler has read it (handlers read their
  // body before they return).
  std::vector<Reservation> held;
  int64_t charged = 0;
  bool never_fits = false;  // the DOM needs more than the account's whole capacity
  const auto charge = [&](int64_t bytes) -> absl::Status {
    if (config_.account == nullptr) return absl::OkStatus();
    if (charged + bytes + static_cast<int64_t>(req.body.size()) > config_.account->capacity()) {
      never_fits = true;
    }
    absl::StatusOr<Reservation> r = config_.account->Reserve(
        bytes, absl::StrCat(route.label, ": the request's JSON body"), "; retry shortly");
    if (!r.ok()) return r.status();
    charged += bytes;
    held.push_back(*std::move(r));
    return absl::OkStatus();
  };
  absl::StatusOr<JsonDom> parsed = req.body.empty()
                                       ? absl::StatusOr<JsonDom>(JsonDom(new Json(Json::object())))
                                       : ParseJsonBody(req.body, charge);
  if (!parsed.ok() && never_fits) {
    // Retried, it would be refused again: 413, not 429.
    return respond(Error(
        413, absl::StrCat("body: its JSON needs more than the ", config_.account->capacity() >> 20,
                          " MiB the server's memory budget holds for request "
                          "bodies; send it in smaller requests")));
  }
  if (!parsed.ok()) return respond(Error(parsed.status()));
  const Json& body = **parsed;
  if (route.kind == Kind::kFinishSession) {
    return FinishSession(*tenant, endpoint, body, std::move(respond));
  }
  if (route.kind == Kind::kCopyWeights) {
    return CopyWeights(*tenant, req.idempotency_key, body, std::move(respond));
  }
  (*route.handler)(*tenant, body, std::move(respond));
}

void TinkerApi::ClientConfig(const std::string&, const Json&, Respond respond) {
  respond(JsonResponse(Json{
      // pyqwest is an optional transport the SDK may not have installed; httpx always is.
      {"use_pyqwest_transport", false},
      {"pjwt_auth_enabled", false},
      {"proto_compress_fwdbwd", false},  // Content-Encoding is refused (415)
      {"parallel_fwdbwd_chunks", true},
      {"create_model_via_load_weights", false},
      // Newer SDKs (0.38) then learn which samples finished from one long poll per sampling
      // session (retrieve_futures) instead of one retrieve_future poll per sample.
      {"sample_use_retrieve_futures", true},
      // Custom losses run on the client (SDK 0.38: a forward, then cross_entropy with the
      // custom loss's gradient as weights); the server does not interpret traced graphs.
      {"custom_loss_server_side", false},
      // A copy of a sampling client (unpickled in another process) joins the session for its
      // seq_id range (join_sampling_session) rather than drawing one at random.
      {"sample_join_sampling_session", true},
      // A chunk must fit the body limit with room for protobuf framing.
      {"fwdbwd_max_chunk_bytes_count", std::min<int64_t>(5'000'000, config_.max_body_bytes / 2)},
  }));
}

void TinkerApi::DynamicConfig(const std::string&, const Json&, Respond respond) {
  // sample_cancel_enabled: an SDK (0.38) that abandons a sample tells the server
  // (cancel_future), which stops decoding it.
  respond(JsonResponse(Json{{"refresh_interval_sec", 300}, {"sample_cancel_enabled", true}}));
}

void TinkerApi::Telemetry(const std::string&, const Json&, Respond respond) {
  // Accepted and dropped: anything else makes the SDK resend every second.
  respond(JsonResponse(Json{{"status", "accepted"}}));
}

}  // namespace tinkerd::http
