#include "server/http/tinker_api.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <optional>
#include <random>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "runner/util/echo.h"
#include "runner/util/log.h"
#include "server/common/status_map.h"
#include "server/http/tinker_convert.h"
#include "server/http/tinker_json.h"
#include "tinker_public/tinker_public.pb.h"

namespace tinkerd::http {

using Json = TinkerApi::Json;

namespace {

constexpr char kApiPrefix[] = "/api/v1/";

}  // namespace

absl::Status TinkerApiConfig::Validate() const {
  if (listen.empty()) return absl::OkStatus();
  if (threads < 1) return absl::InvalidArgumentError("http: threads must be >= 1");
  if (served_model_name.empty())
    return absl::InvalidArgumentError("http: served model name is empty");
  if (futures.long_poll <= absl::ZeroDuration() || futures.long_poll >= absl::Seconds(45)) {
    // The SDK gives up on a poll after 45 s and backs off for up to 30 s.
    return absl::InvalidArgumentError("http: long poll must be in (0, 45) s");
  }
  if (max_body_bytes < 1024) return absl::InvalidArgumentError("http: max body < 1 KiB");
  if (peek_bytes < 0) return absl::InvalidArgumentError("http: peek bytes must be >= 0");
  if (archive.url_ttl <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("http: archive URL lifetime must be > 0");
  }
  if (archive.max_downloads < 1) {
    return absl::InvalidArgumentError("http: archive downloads must be >= 1");
  }
  if (!archive.public_url.empty() && !absl::StartsWith(archive.public_url, "http://") &&
      !absl::StartsWith(archive.public_url, "https://")) {
    return absl::InvalidArgumentError(
        "http: public URL must start with http:// or https:// (say, https://tinkerd.example.org)");
  }
  return absl::OkStatus();
}

std::string TinkerApiConfig::DebugString() const {
  if (listen.empty()) return "http=off";
  return absl::StrFormat(
      "http=%s http_threads=%d served_model_name=%s long_poll=%s keep=%s peek_bytes=%d "
      "session_idle=%s archive_url_ttl=%s archive_downloads=%d public_url=%s",
      listen, threads, served_model_name, absl::FormatDuration(futures.long_poll),
      absl::FormatDuration(futures.keep), peek_bytes,
      session_idle > absl::ZeroDuration() ? absl::FormatDuration(session_idle) : "off",
      absl::FormatDuration(archive.url_ttl), archive.max_downloads,
      archive.public_url.empty() ? "(from Host)" : archive.public_url);
}

TinkerApi::TinkerApi(Ops* ops, Sampling* sampling, ApiKeys keys, TinkerApiConfig config,
                     std::function<void(absl::Duration, std::function<void()>)> after)
    : ops_(ops),
      sampling_(sampling),
      keys_(std::move(keys)),
      config_(std::move(config)),
      after_(std::move(after)),
      futures_(config_.futures, after_) {}

void TinkerApi::StartReaper() {
  if (config_.session_idle <= absl::ZeroDuration()) return;
  after_(std::max(config_.session_idle / 4, absl::Milliseconds(50)), [this] { Reap(); });
}

void TinkerApi::Reap() {
  const absl::Time cutoff = absl::Now() - config_.session_idle;
  std::vector<std::pair<std::string, Session>> ended;
  std::vector<std::pair<std::string, std::string>> samplers;  // tenant, sampler_id
  {
    absl::MutexLock lock(&mu_);
    for (auto it = sessions_.begin(); it != sessions_.end();) {
      if (it->second.last_heartbeat < cutoff) {
        for (auto a = aliases_.lower_bound(it->second.tenant + '\n' + it->first + ':');
             a != aliases_.end() &&
             absl::StartsWith(a->first, it->second.tenant + '\n' + it->first + ':');) {
          a = aliases_.erase(a);
        }
        const std::string prefix = it->second.tenant + '\n' + it->first + ':';
        for (auto a = sampling_sessions_.lower_bound(prefix);
             a != sampling_sessions_.end() && absl::StartsWith(a->first, prefix);) {
          // One being made has callers waiting: it goes when it is answered.
          if (a->second.sampler_id.empty()) {
            ++a;
            continue;
          }
          samplers.emplace_back(it->second.tenant, a->second.sampler_id);
          a = sampling_sessions_.erase(a);
        }
        ended_.insert(it->second.tenant + '\n' + it->first);
        ended_order_.push_back(it->second.tenant + '\n' + it->first);
        if (ended_order_.size() > config_.max_sessions) {
          ended_.erase(ended_order_.front());
          ended_order_.pop_front();
        }
        ended.emplace_back(it->first, std::move(it->second));
        it = sessions_.erase(it);
      } else {
        ++it;
      }
    }
  }
  // Samplers first: their memory counts against the tenant's budget, and once the models are
  // gone nothing of the session is left. Samples already running finish on the policy they hold.
  for (const auto& [tenant, sampler] : samplers) {
    sampling_->DeleteSampler(tenant, sampler).IgnoreError();
  }
  for (auto& [id, session] : ended) {
    TLOG_INFO("http: session {} sent no heartbeat for {}: ended, its {} model(s) deleted", id,
              absl::FormatDuration(config_.session_idle), session.models.size());
    for (const std::string& model : session.models) {
      ops_->DeleteModel(session.tenant, model,
                        [](const absl::StatusOr<v1::DeleteModelResponse>&) {});
    }
  }
  StartReaper();
}

void TinkerApi::Handle(Request req, Respond respond) {
  const size_t at = req.path.find(kApiPrefix);  // base_url may carry a path prefix
  const std::string endpoint =
      at == std::string::npos ? "" : req.path.substr(at + sizeof(kApiPrefix) - 1);
  static const std::map<std::string, JsonHandler> kPost = {
      {"client/config", &TinkerApi::ClientConfig},
      {"client/dynamic_config", &TinkerApi::DynamicConfig},
      {"create_session", &TinkerApi::CreateSession},
      {"session_heartbeat", &TinkerApi::SessionHeartbeat},
      {"telemetry", &TinkerApi::Telemetry},
      {"create_model", &TinkerApi::CreateModel},
      {"get_info", &TinkerApi::GetInfo},
      {"unload_model", &TinkerApi::UnloadModel},
      {"optim_step", &TinkerApi::OptimStep},
      {"save_weights", &TinkerApi::SaveWeights},
      {"load_weights", &TinkerApi::LoadWeights},
      {"save_weights_for_sampler", &TinkerApi::SaveWeightsForSampler},
      {"weights_info", &TinkerApi::WeightsInfo},
      {"retrieve_future", &TinkerApi::RetrieveFuture},
      {"retrieve_futures", &TinkerApi::RetrieveFutures},
      {"asample", &TinkerApi::ASample},
      {"cancel_future", &TinkerApi::CancelFuture},
      {"create_sampling_session", &TinkerApi::CreateSamplingSession},
  };
  const bool finish_session =
      absl::StartsWith(endpoint, "sessions/") && absl::EndsWith(endpoint, "/finish");
  const bool sessions =
      !finish_session && (endpoint == "sessions" || absl::StartsWith(endpoint, "sessions/"));
  const bool runs = endpoint == "training_runs" || absl::StartsWith(endpoint, "training_runs/");
  const bool archive = absl::StartsWith(endpoint, "archives/");
  const bool known = kPost.count(endpoint) || endpoint == "forward_backward" || runs ||
                     endpoint == "healthz" || endpoint == "get_server_capabilities" ||
                     endpoint == "checkpoints" || finish_session || sessions ||
                     absl::StartsWith(endpoint, "samplers/") || archive;
  // Counted by route: never a client's text (an unknown path, an id inside a path) as a label.
  std::string route = known ? endpoint : "unknown";
  if (finish_session) route = "sessions/finish";
  if (sessions) route = endpoint == "sessions" ? "sessions" : "sessions/session";
  if (absl::StartsWith(endpoint, "samplers/")) route = "samplers";
  if (archive) route = "archives";
  if (runs) {
    route = absl::StrContains(endpoint, "/checkpoints") ? "training_runs/checkpoints"
            : endpoint == "training_runs"               ? "training_runs"
                                                        : "training_runs/run";
  }
  if (Metrics* metrics = ops_->metrics()) {
    respond = [metrics, route, t0 = absl::Now(), respond = std::move(respond)](Response r) {
      metrics->ObserveHttp(route, r.status, absl::ToDoubleSeconds(absl::Now() - t0));
      respond(std::move(r));
    };
  }
  if (!known) {
    return respond(Error(404, absl::StrCat("no endpoint ", Echo(req.method), " ", Echo(req.path))));
  }
  if (endpoint == "healthz") return respond(JsonResponse(Json{{"status", "ok"}}));
  // An archive URL is its own credential: whoever holds it downloads without a key, as with a
  // signed URL.
  if (archive) {
    return Archive(req.method, endpoint.substr(sizeof("archives/") - 1), std::move(respond));
  }

  auto tenant =
      keys_.enabled() ? keys_.TenantOf(req.api_key) : absl::StatusOr<std::string>("default");
  if (!tenant.ok()) {
    return respond(Error(
        401, req.api_key.empty() ? "X-API-Key: missing" : "X-API-Key: not a key of this server"));
  }
  if (!req.content_encoding.empty()) {
    return respond(Error(415, absl::StrCat("Content-Encoding: '", Echo(req.content_encoding),
                                           "' is not supported; send the body uncompressed")));
  }

  if (runs) return TrainingRuns(*tenant, req, endpoint, std::move(respond));
  if (sessions || endpoint == "checkpoints") {
    // Paths under a session that this server does not serve (project, trace_export) are unknown
    // whatever the method.
    if (sessions && std::count(endpoint.begin(), endpoint.end(), '/') > 1) {
      return respond(
          Error(404, absl::StrCat("no endpoint ", Echo(req.method), " ", Echo(req.path))));
    }
    if (req.method != "GET") return respond(Error(405, absl::StrCat(endpoint, ": use GET")));
    auto page = PageFromQuery(req.query);  // access_scope too, for a single item
    if (!page.ok()) return respond(Error(page.status()));
    if (sessions) return Sessions(*tenant, *page, endpoint, std::move(respond));
    return UserCheckpoints(*tenant, *page, std::move(respond));
  }
  const bool get = endpoint == "get_server_capabilities" || absl::StartsWith(endpoint, "samplers/");
  if (req.method != (get ? "GET" : "POST")) {
    return respond(Error(405, absl::StrCat(endpoint, ": use ", get ? "GET" : "POST")));
  }
  if (endpoint == "get_server_capabilities") {
    return respond(JsonResponse(
        Json{{"supported_models",
              Json::array({Json{{"model_name", config_.served_model_name},
                                {"max_context_length", ops_->limits().max_context_length}}})}}));
  }
  if (absl::StartsWith(endpoint, "samplers/")) {
    return GetSampler(*tenant, endpoint.substr(sizeof("samplers/") - 1), std::move(respond));
  }
  if (endpoint == "forward_backward") {
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
  Json body = req.body.empty() ? Json::object() : Json::parse(req.body, nullptr, false);
  if (body.is_discarded() || !body.is_object()) {
    return respond(Error(400, "body: not a JSON object"));
  }
  if (finish_session) return FinishSession(*tenant, body, std::move(respond));
  (this->*kPost.at(endpoint))(*tenant, body, std::move(respond));
}

template <typename Resp>
void TinkerApi::Submit(const std::string& tenant, const std::string& request_id, Resend resend,
                       std::function<void(Done<Resp>)> start,
                       std::function<Response(const Resp&)> encode, Respond respond, Json accepted,
                       const std::string& topic) {
  accepted["request_id"] = request_id;
  // The future is reserved before the call starts: a call answered 429 never ran, and of two
  // racing resends of a sample only one starts it.
  const Futures::Opened opened = futures_.Open(tenant, request_id, topic);
  if (opened == Futures::Opened::kFull) {
    return respond(Error(429, "too many unfinished futures; retry later"));
  }
  if (opened == Futures::Opened::kExists && resend == Resend::kFuture) {
    return respond(JsonResponse(accepted));
  }
  // The operation may answer before `start` returns (a refusal, or a retry's cached result):
  // such an answer is held here and decided on below; a later one finishes the future.
  struct Submission {
    absl::Mutex mu;
    bool started = false;
    std::optional<absl::StatusOr<Resp>> immediate;
  };
  auto sub = std::make_shared<Submission>();
  auto finish = [this, tenant, request_id, encode](const absl::StatusOr<Resp>& r) {
    futures_.Finish(tenant, request_id, r.ok() ? encode(*r) : FutureError(r.status()), !r.ok());
  };
  try {
    start([sub, finish](absl::StatusOr<Resp> r) {
      absl::MutexLock lock(&sub->mu);
      if (!sub->started) {
        sub->immediate = std::move(r);
        return;
      }
      finish(r);
    });
  } catch (...) {
    // The HTTP server answers 500; a resend must find no future that nothing will finish.
    if (opened == Futures::Opened::kNew) futures_.Drop(tenant, request_id);
    throw;
  }
  absl::MutexLock lock(&sub->mu);
  sub->started = true;
  if (sub->immediate && !sub->immediate->ok()) {
    const absl::StatusCode code = sub->immediate->status().code();
    if (code == absl::StatusCode::kAlreadyExists || code == absl::StatusCode::kResourceExhausted ||
        code == absl::StatusCode::kUnavailable) {
      // A resend can fix these, or they concern another call's future: not this future's answer.
      if (opened == Futures::Opened::kNew) futures_.Drop(tenant, request_id);
      return respond(Error(sub->immediate->status()));
    }
  }
  if (sub->immediate) finish(*sub->immediate);
  respond(JsonResponse(accepted));
}

// The instances tinker_sampling.cc uses.
template void TinkerApi::Submit<v1::SamplerInfo>(const std::string&, const std::string&, Resend,
                                                 std::function<void(Done<v1::SamplerInfo>)>,
                                                 std::function<Response(const v1::SamplerInfo&)>,
                                                 Respond, Json, const std::string&);
template void TinkerApi::Submit<v1::SampleResponse>(
    const std::string&, const std::string&, Resend, std::function<void(Done<v1::SampleResponse>)>,
    std::function<Response(const v1::SampleResponse&)>, Respond, Json, const std::string&);

std::string TinkerApi::Resolve(const std::string& tenant, const std::string& model_id) {
  absl::MutexLock lock(&mu_);
  auto it = aliases_.find(tenant + '\n' + model_id);
  return it == aliases_.end() ? model_id : it->second;
}

void TinkerApi::Alias(const std::string& tenant, const std::string& session_id,
                      int64_t model_seq_id, const std::string& model_id) {
  absl::MutexLock lock(&mu_);
  aliases_[absl::StrCat(tenant, "\n", session_id, ":train:", model_seq_id)] = model_id;
  if (auto it = sessions_.find(session_id); it != sessions_.end()) {
    it->second.models.push_back(model_id);
  }
}

absl::Status TinkerApi::CheckSession(const std::string& tenant, const std::string& session_id) {
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(session_id);
  if (it == sessions_.end() || it->second.tenant != tenant) {
    return absl::NotFoundError(absl::StrCat("session_id: no session '", Echo(session_id), "'"));
  }
  return absl::OkStatus();
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
      // A chunk must fit the body limit with room for protobuf framing.
      {"fwdbwd_max_chunk_bytes_count", std::min<int64_t>(5'000'000, config_.max_body_bytes / 2)},
  }));
}

void TinkerApi::DynamicConfig(const std::string&, const Json&, Respond respond) {
  // sample_cancel_enabled: an SDK (0.38) that abandons a sample tells the server
  // (cancel_future), which stops decoding it.
  respond(JsonResponse(Json{{"refresh_interval_sec", 300}, {"sample_cancel_enabled", true}}));
}

void TinkerApi::CreateSession(const std::string& tenant, const Json& body, Respond respond) {
  Fields f(body);
  f.OptStr("sdk_version");
  f.Obj("user_metadata");
  if (!f.status().ok()) return respond(Error(f.status()));
  std::string id = "session-" + RandomHex();
  {
    absl::MutexLock lock(&mu_);
    if (sessions_.size() >= config_.max_sessions) {
      return respond(Error(429, "too many open sessions; retry later"));
    }
    const absl::Time now = absl::Now();
    sessions_[id] = Session{tenant, now, now, {}};
  }
  respond(JsonResponse(Json{{"type", "create_session"}, {"session_id", id}}));
}

void TinkerApi::SessionHeartbeat(const std::string& tenant, const Json& body, Respond respond) {
  Fields f(body);
  const std::string id = f.Str("session_id");
  if (!f.status().ok()) return respond(Error(f.status()));
  Response missing;
  {
    absl::MutexLock lock(&mu_);
    Session* session = FindSessionLocked(tenant, id, &missing);
    if (session != nullptr) session->last_heartbeat = absl::Now();
  }
  // Answered outside mu_: a response runs the metrics and the connection's write.
  respond(missing.status != 200 ? std::move(missing)
                                : JsonResponse(Json{{"type", "session_heartbeat"}}));
}

TinkerApi::Session* TinkerApi::FindSessionLocked(const std::string& tenant, const std::string& id,
                                                 Response* missing) {
  auto it = sessions_.find(id);
  if (it != sessions_.end() && it->second.tenant == tenant) return &it->second;
  *missing =
      ended_.count(tenant + '\n' + id)
          ? Error(410, absl::StrCat(
                           "session_id: session '", Echo(id), "' ended after no heartbeat for ",
                           absl::FormatDuration(config_.session_idle), "; create a new session"))
          : Error(404, absl::StrCat("session_id: no session '", Echo(id), "'"));
  return nullptr;
}

void TinkerApi::FinishSession(const std::string&, const Json&, Respond respond) {
  // The session's models stay until unloaded: their checkpoints and gradients are the user's.
  respond(JsonResponse(Json::object()));
}

void TinkerApi::Telemetry(const std::string&, const Json&, Respond respond) {
  // Accepted and dropped: anything else makes the SDK resend every second.
  respond(JsonResponse(Json{{"status", "accepted"}}));
}

void TinkerApi::CreateModel(const std::string& tenant, const Json& body, Respond respond) {
  Fields f(body);
  const std::string session_id = f.Str("session_id");
  const int64_t model_seq_id = f.Int("model_seq_id");
  const std::string base_model = f.Str("base_model");
  const Json* lora = f.Obj("lora_config");
  if (const Json* optimizer = f.Obj("optimizer_config")) {  // sent by newer SDKs
    Fields o(*optimizer);
    const std::string type = o.OptStr("type").value_or("adamw");
    if (!o.status().ok()) {
      return respond(Error(400, absl::StrCat("optimizer_config.", o.status().message())));
    }
    if (type != "adamw") {
      return respond(Error(400, absl::StrCat("optimizer_config.type: this server trains with "
                                             "AdamW only, not '",
                                             Echo(type), "'")));
    }
  }
  v1::CreateModelRequest req;
  // Tinker's losses are sums over tokens: the optimizer divides by nothing.
  req.set_loss_reduction("sum");
  if (lora != nullptr) {
    Fields l(*lora);
    const int64_t rank = l.Int("rank");
    req.set_seed(static_cast<uint64_t>(l.OptInt("seed").value_or(0)));
    req.mutable_lora()->set_rank(rank);
    req.mutable_lora()->set_train_attn(l.OptBool("train_attn").value_or(true));
    req.mutable_lora()->set_train_mlp(l.OptBool("train_mlp").value_or(true));
    req.mutable_lora()->set_train_unembed(l.OptBool("train_unembed").value_or(true));
    if (!l.status().ok()) {
      return respond(Error(400, absl::StrCat("lora_config.", l.status().message())));
    }
  }
  if (!f.status().ok()) return respond(Error(f.status()));
  if (base_model != config_.served_model_name) {
    return respond(
        Error(400, absl::StrCat("base_model: this server trains '", config_.served_model_name,
                                "', not '", Echo(base_model), "'")));
  }
  if (auto st = CheckSession(tenant, session_id); !st.ok()) return respond(Error(st));
  // A retry of a creation is answered with the first one's future: creations have no seq_id
  // in the scheduler to catch them.
  const std::string request_id = absl::StrCat("create:", session_id, ":", model_seq_id);
  Ops* ops = ops_;
  Submit<v1::ModelInfo>(
      tenant, request_id, Resend::kFuture,
      [ops, tenant, req](Done<v1::ModelInfo> done) {
        ops->CreateModel(tenant, req, std::move(done));
      },
      [this, tenant, session_id, model_seq_id](const v1::ModelInfo& m) {
        Alias(tenant, session_id, model_seq_id, m.model_id());
        return JsonResponse(Json{{"type", "create_model"}, {"model_id", m.model_id()}});
      },
      std::move(respond));
}

void TinkerApi::GetInfo(const std::string& tenant, const Json& body, Respond respond) {
  Fields f(body);
  const std::string model_id = f.Str("model_id");
  if (!f.status().ok()) return respond(Error(f.status()));
  auto info = ops_->GetInfo(tenant, Resolve(tenant, model_id));
  if (!info.ok()) return respond(Error(info.status()));
  Json out{{"type", "get_info"},
           {"model_id", model_id},
           {"model_data",
            Json{{"arch", info->architecture()}, {"model_name", config_.served_model_name}}},
           {"is_lora", info->is_lora()},
           {"model_name", config_.served_model_name}};
  if (info->is_lora()) out["lora_rank"] = info->lora().rank();
  respond(JsonResponse(out));
}

void TinkerApi::UnloadModel(const std::string& tenant, const Json& body, Respond respond) {
  Fields f(body);
  const std::string model_id = f.Str("model_id");
  if (!f.status().ok()) return respond(Error(f.status()));
  const std::string request_id = absl::StrCat("unload:", model_id);
  Ops* ops = ops_;
  Submit<v1::DeleteModelResponse>(
      tenant, request_id, Resend::kFuture,
      [ops, tenant, id = Resolve(tenant, model_id)](Done<v1::DeleteModelResponse> done) {
        ops->DeleteModel(tenant, id, std::move(done));
      },
      [model_id](const v1::DeleteModelResponse&) {
        return JsonResponse(Json{{"type", "unload_model"}, {"model_id", model_id}});
      },
      std::move(respond));
}

void TinkerApi::ForwardBackward(const std::string& tenant, const Request& req, Respond respond) {
  tinker_public::ForwardBackwardRequest in;
  if (!in.ParseFromString(req.body)) {
    return respond(Error(400, "body: not a tinker_public.ForwardBackwardRequest"));
  }
  const std::string model_id = Resolve(tenant, in.model_id());
  const int64_t seq_id = in.seq_id();
  const std::string request_id = absl::StrCat(in.model_id(), ":", seq_id);
  const bool forward_only = in.forward_only();
  const std::string kind = forward_only ? "Forward" : "ForwardBackward";
  auto converted = FwdBwdFromTinker(&in);
  Ops* ops = ops_;
  if (!converted.ok()) {
    // The slot is taken with the error, so the client's later calls are not held up.
    const uint64_t hash = Fnv64(req.body, kFnv64Basis);
    return Submit<v1::RetrieveResultResponse>(
        tenant, request_id, Resend::kOperation,
        [ops, tenant, model_id, seq_id, kind, hash,
         st = converted.status()](Done<v1::RetrieveResultResponse> done) {
          ops->Refuse(tenant, model_id, seq_id, kind, hash, st, std::move(done));
        },
        [](const v1::RetrieveResultResponse&) { return Response(); }, std::move(respond));
  }
  auto request = std::make_shared<v1::ForwardBackwardRequest>(std::move(converted->request));
  request->set_model_id(model_id);
  request->set_seq_id(seq_id);
  const std::string loss_fn = request->loss_fn().name();
  Submit<v1::ForwardBackwardOutput>(
      tenant, request_id, Resend::kOperation,
      [ops, tenant, request, forward_only](Done<v1::ForwardBackwardOutput> done) {
        ops->ForwardBackward(tenant, request.get(), !forward_only, std::move(done));
      },
      [loss_fn](const v1::ForwardBackwardOutput& r) {
        tinker_public::ForwardBackwardOutput out;
        FwdBwdOutputToTinker(r, loss_fn, &out);
        return Response{200, "application/x-protobuf", out.SerializeAsString(), {}};
      },
      std::move(respond));
}

void TinkerApi::OptimStep(const std::string& tenant, const Json& body, Respond respond) {
  Fields f(body);
  v1::OptimStepRequest req;
  req.set_model_id(f.Str("model_id"));
  req.set_seq_id(f.Int("seq_id"));
  if (const Json* adam = f.Obj("adam_params")) {
    Fields a(*adam);
    v1::AdamParams* p = req.mutable_adam_params();
    if (auto v = a.OptNum("learning_rate")) p->set_learning_rate(*v);
    if (auto v = a.OptNum("beta1")) p->set_beta1(*v);
    if (auto v = a.OptNum("beta2")) p->set_beta2(*v);
    if (auto v = a.OptNum("eps")) p->set_eps(*v);
    if (auto v = a.OptNum("weight_decay")) p->set_weight_decay(*v);
    if (auto v = a.OptNum("grad_clip_norm")) p->set_grad_clip_norm(*v);
    if (!a.status().ok()) {
      return respond(Error(400, absl::StrCat("adam_params.", a.status().message())));
    }
  }
  if (!f.status().ok()) return respond(Error(f.status()));
  const std::string request_id = absl::StrCat(req.model_id(), ":", req.seq_id());
  req.set_model_id(Resolve(tenant, req.model_id()));
  Ops* ops = ops_;
  Submit<v1::OptimStepResponse>(
      tenant, request_id, Resend::kOperation,
      [ops, tenant, req](Done<v1::OptimStepResponse> done) {
        ops->OptimStep(tenant, req, std::move(done));
      },
      [](const v1::OptimStepResponse& r) {
        Json metrics = Json::object();
        for (const auto& [k, v] : r.metrics()) metrics[k] = v;
        return JsonResponse(Json{{"type", "optim_step"}, {"metrics", metrics}});
      },
      std::move(respond));
}

void TinkerApi::SaveWeights(const std::string& tenant, const Json& body, Respond respond) {
  Fields f(body);
  v1::SaveStateRequest req;
  req.set_model_id(f.Str("model_id"));
  req.set_seq_id(f.Int("seq_id"));
  req.set_name(f.Str("path"));
  req.set_overwrite(f.OptBool("overwrite").value_or(false));
  f.OptInt("ttl_seconds");  // checkpoints live until deleted
  // Tinker's save_state never refuses for pending gradients: they are saved with the weights.
  req.set_include_accumulated(true);
  if (!f.status().ok()) return respond(Error(f.status()));
  const std::string request_id = absl::StrCat(req.model_id(), ":", req.seq_id());
  req.set_model_id(Resolve(tenant, req.model_id()));
  Ops* ops = ops_;
  Submit<v1::SaveStateResponse>(
      tenant, request_id, Resend::kOperation,
      [ops, tenant, req](Done<v1::SaveStateResponse> done) {
        ops->SaveState(tenant, req, std::move(done));
      },
      [](const v1::SaveStateResponse& r) {
        return JsonResponse(Json{{"type", "save_weights"}, {"path", r.path()}});
      },
      std::move(respond));
}

void TinkerApi::LoadWeights(const std::string& tenant, const Json& body, Respond respond) {
  Fields f(body);
  const std::string path = f.Str("path");
  const bool optimizer = f.OptBool("optimizer").value_or(false);
  const std::optional<std::string> model_id = f.OptStr("model_id");
  Ops* ops = ops_;
  if (!model_id) {
    // The session form: a new model made from the checkpoint (create_training_client_from_state).
    const std::string session_id = f.Str("session_id");
    const int64_t model_seq_id = f.Int("model_seq_id");
    if (!f.status().ok()) return respond(Error(f.status()));
    if (auto st = CheckSession(tenant, session_id); !st.ok()) return respond(Error(st));
    const std::string request_id = absl::StrCat("create:", session_id, ":", model_seq_id);
    v1::CreateModelFromStateRequest req;
    req.set_path(path);
    req.set_with_optimizer(optimizer);
    return Submit<v1::ModelInfo>(
        tenant, request_id, Resend::kFuture,
        [ops, tenant, req](Done<v1::ModelInfo> done) {
          ops->CreateModelFromState(tenant, req, std::move(done));
        },
        [this, tenant, session_id, model_seq_id, path](const v1::ModelInfo& m) {
          Alias(tenant, session_id, model_seq_id, m.model_id());
          return JsonResponse(
              Json{{"type", "load_weights"}, {"model_id", m.model_id()}, {"path", path}});
        },
        std::move(respond));
  }
  v1::LoadStateRequest req;
  req.set_model_id(Resolve(tenant, *model_id));
  req.set_seq_id(f.Int("seq_id"));
  req.set_path(path);
  req.set_with_optimizer(optimizer);
  if (!f.status().ok()) return respond(Error(f.status()));
  Submit<v1::LoadStateResponse>(
      tenant, absl::StrCat(*model_id, ":", req.seq_id()), Resend::kOperation,
      [ops, tenant, req](Done<v1::LoadStateResponse> done) {
        ops->LoadState(tenant, req, std::move(done));
      },
      [model_id = *model_id](const v1::LoadStateResponse& r) {
        return JsonResponse(
            Json{{"type", "load_weights"}, {"model_id", model_id}, {"path", r.path()}});
      },
      std::move(respond));
}

void TinkerApi::SaveWeightsForSampler(const std::string& tenant, const Json& body,
                                      Respond respond) {
  Fields f(body);
  v1::SaveWeightsForSamplerRequest req;
  req.set_model_id(f.Str("model_id"));
  req.set_seq_id(f.Int("seq_id"));
  const std::optional<std::string> name = f.OptStr("path");
  if (!f.status().ok()) return respond(Error(f.status()));
  const std::string request_id = absl::StrCat(req.model_id(), ":", req.seq_id());
  req.set_model_id(Resolve(tenant, req.model_id()));
  Ops* ops = ops_;
  if (!name) {
    return SaveWeightsForSession(tenant, request_id, req.model_id(), req.seq_id(),
                                 std::move(respond));
  }
  req.set_name(*name);
  Submit<v1::SaveWeightsForSamplerResponse>(
      tenant, request_id, Resend::kOperation,
      [ops, tenant, req](Done<v1::SaveWeightsForSamplerResponse> done) {
        ops->SaveWeightsForSampler(tenant, req, std::move(done));
      },
      [](const v1::SaveWeightsForSamplerResponse& r) {
        return JsonResponse(Json{{"type", "save_weights_for_sampler"}, {"path", r.path()}});
      },
      std::move(respond));
}

void TinkerApi::WeightsInfo(const std::string& tenant, const Json& body, Respond respond) {
  Fields f(body);
  const std::string path = f.Str("tinker_path");
  if (!f.status().ok()) return respond(Error(f.status()));
  auto info = ops_->CheckpointInfo(tenant, path);
  if (!info.ok()) return respond(Error(info.status()));
  Json out{{"base_model", config_.served_model_name}, {"is_lora", info->is_lora()}};
  if (info->is_lora()) {
    out["lora_rank"] = info->lora().rank();
    out["train_attn"] = info->lora().train_attn();
    out["train_mlp"] = info->lora().train_mlp();
    out["train_unembed"] = info->lora().train_unembed();
  }
  respond(JsonResponse(out));
}

namespace {

Json CheckpointJson(const CheckpointEntry& c) {
  // checkpoint_id is what follows the model id in the path: "weights/<name>".
  const std::string id = c.path.substr(c.path.find('/', sizeof("tinker://") - 1) + 1);
  return Json{{"checkpoint_id", id},   {"checkpoint_type", c.kind},  {"time", IsoTime(c.time)},
              {"tinker_path", c.path}, {"size_bytes", c.size_bytes}, {"public", false}};
}

// The page of `items` that `page` asks for, as {key: [...], "cursor"}.
Json Paged(const Page& page, const char* key, Json items) {
  const int64_t total = static_cast<int64_t>(items.size());
  const int64_t from = std::min(page.offset, total);
  const int64_t limit = page.limit.value_or(std::max<int64_t>(total, 1));
  Json slice = Json::array();
  for (int64_t i = from; i < std::min(total, from + limit); ++i) {
    slice.push_back(std::move(items[static_cast<size_t>(i)]));
  }
  return Json{{key, std::move(slice)},
              {"cursor", {{"offset", page.offset}, {"limit", limit}, {"total_count", total}}}};
}

}  // namespace

absl::StatusOr<Json> TinkerApi::TrainingRun(const std::string& tenant,
                                            const std::string& model_id) {
  auto info = ops_->GetInfo(tenant, model_id);
  if (!info.ok()) return info.status();
  auto checkpoints = ops_->Checkpoints(tenant, model_id);
  if (!checkpoints.ok()) return checkpoints.status();
  auto last_request = ops_->LastRequest(tenant, model_id);
  if (!last_request.ok()) return last_request.status();
  Json run{{"training_run_id", model_id}, {"base_model", config_.served_model_name},
           {"model_owner", tenant},       {"is_lora", info->is_lora()},
           {"corrupted", false},          {"last_request_time", IsoTime(*last_request)}};
  if (info->is_lora()) run["lora_rank"] = info->lora().rank();
  for (const char* kind : {"training", "sampler"}) {
    const CheckpointEntry* last = nullptr;
    for (const CheckpointEntry& c : *checkpoints) {
      if (c.kind == kind && (last == nullptr || c.time >= last->time)) last = &c;
    }
    if (last != nullptr) {
      run[std::string(kind) == "training" ? "last_checkpoint" : "last_sampler_checkpoint"] =
          CheckpointJson(*last);
    }
  }
  return run;
}

void TinkerApi::TrainingRuns(const std::string& tenant, const Request& req,
                             const std::string& endpoint, Respond respond) {
  const std::string& method = req.method;
  const std::vector<std::string> parts = absl::StrSplit(endpoint, '/');
  // parts: training_runs [id [checkpoints [kind name [archive]]]]
  if (parts.size() == 6 && parts[2] == "checkpoints" && parts[5] == "archive") {
    if (method != "GET") return respond(Error(405, absl::StrCat(endpoint, ": use GET")));
    return ArchiveUrl(
        tenant, req,
        absl::StrCat("tinker://", Resolve(tenant, parts[1]), "/", parts[3], "/", parts[4]),
        std::move(respond));
  }
  const bool del = parts.size() == 5 && parts[2] == "checkpoints";
  const bool get = parts.size() <= 3 && (parts.size() < 3 || parts[2] == "checkpoints");
  if (!del && !get) return respond(Error(404, absl::StrCat("no endpoint ", Echo(endpoint))));
  if (method != (del ? "DELETE" : "GET")) {
    return respond(Error(405, absl::StrCat(endpoint, ": use ", del ? "DELETE" : "GET")));
  }
  auto page = PageFromQuery(req.query);  // access_scope too, for a single run
  if (!page.ok()) return respond(Error(page.status()));
  if (parts.size() == 1) {
    Json runs = Json::array();
    const v1::ListModelsResponse models = ops_->ListModels(tenant);
    for (const v1::ModelInfo& m : models.models()) {
      if (auto run = TrainingRun(tenant, m.model_id()); run.ok()) runs.push_back(*run);
    }
    return respond(JsonResponse(Paged(*page, "training_runs", std::move(runs))));
  }
  const std::string model_id = Resolve(tenant, parts[1]);
  if (parts.size() == 2) {
    auto run = TrainingRun(tenant, model_id);
    return respond(run.ok() ? JsonResponse(*run) : Error(run.status()));
  }
  if (get) {
    auto checkpoints = ops_->Checkpoints(tenant, model_id);
    if (!checkpoints.ok()) return respond(Error(checkpoints.status()));
    Json list = Json::array();
    for (const CheckpointEntry& c : *checkpoints) list.push_back(CheckpointJson(c));
    return respond(JsonResponse(Json{{"checkpoints", list}}));
  }
  const absl::Status st = ops_->DeleteCheckpoint(
      tenant, absl::StrCat("tinker://", model_id, "/", parts[3], "/", parts[4]));
  respond(st.ok() ? JsonResponse(Json::object()) : Error(st));
}

void TinkerApi::Sessions(const std::string& tenant, const Page& page, const std::string& endpoint,
                         Respond respond) {
  if (endpoint == "sessions") {
    std::vector<std::pair<absl::Time, std::string>> open;
    {
      absl::MutexLock lock(&mu_);
      for (const auto& [id, session] : sessions_) {
        if (session.tenant == tenant) open.emplace_back(session.created, id);
      }
    }
    std::sort(open.begin(), open.end(), std::greater<>());  // newest first
    Json ids = Json::array();
    for (const auto& [created, id] : open) ids.push_back(id);
    return respond(JsonResponse(Paged(page, "sessions", std::move(ids))));
  }
  const std::string id = endpoint.substr(sizeof("sessions/") - 1);
  std::vector<std::string> models, samplers;
  Response missing;
  {
    absl::MutexLock lock(&mu_);
    const Session* session = FindSessionLocked(tenant, id, &missing);
    if (session != nullptr) models = session->models;
    const std::string prefix = tenant + '\n' + id + ':';
    for (auto s = sampling_sessions_.lower_bound(prefix);
         s != sampling_sessions_.end() && absl::StartsWith(s->first, prefix); ++s) {
      if (!s->second.sampler_id.empty()) samplers.push_back(s->second.sampler_id);
    }
  }
  if (missing.status != 200) return respond(std::move(missing));
  // Only what still exists: unloaded models and deleted or evicted samplers are left out.
  Json run_ids = Json::array(), sampler_ids = Json::array();
  for (const std::string& m : models) {
    if (ops_->GetInfo(tenant, m).ok()) run_ids.push_back(m);
  }
  for (const std::string& s : samplers) {
    if (sampling_->GetSampler(tenant, s).ok()) sampler_ids.push_back(s);
  }
  respond(JsonResponse(Json{{"training_run_ids", run_ids}, {"sampler_ids", sampler_ids}}));
}

void TinkerApi::UserCheckpoints(const std::string& tenant, const Page& page, Respond respond) {
  std::vector<CheckpointEntry> all;
  for (const std::string& model : ops_->CheckpointedModels(tenant)) {
    auto checkpoints = ops_->Checkpoints(tenant, model);
    if (!checkpoints.ok()) continue;  // the folder went meanwhile
    all.insert(all.end(), checkpoints->begin(), checkpoints->end());
  }
  // Newest first, as the SDK documents; ties by path, so that pages do not overlap.
  std::sort(all.begin(), all.end(), [](const CheckpointEntry& a, const CheckpointEntry& b) {
    return a.time != b.time ? a.time > b.time : a.path < b.path;
  });
  Json list = Json::array();
  for (const CheckpointEntry& c : all) list.push_back(CheckpointJson(c));
  respond(JsonResponse(Paged(page, "checkpoints", std::move(list))));
}

void TinkerApi::RetrieveFutures(const std::string& tenant, const Json& body, Respond respond) {
  Fields f(body);
  const Json* target = f.Obj("target");
  const int64_t prev_cursor = f.OptInt("prev_cursor").value_or(0);
  const std::optional<double> timeout = f.OptNum("timeout");
  if (!f.status().ok()) return respond(Error(f.status()));
  if (target == nullptr) return respond(Error(400, "target: required"));
  Fields t(*target);
  const std::string type = t.OptStr("type").value_or("sampling_session");
  const std::string session = t.Str("sampling_session_id");
  const int64_t clone = t.OptInt("cloned_sampler_id").value_or(0);
  if (!t.status().ok()) return respond(Error(400, absl::StrCat("target.", t.status().message())));
  if (type != "sampling_session") {
    return respond(Error(
        400, absl::StrCat("target.type: must be \"sampling_session\", not '", Echo(type), "'")));
  }
  if (clone < 0) return respond(Error(400, "target.cloned_sampler_id: must be >= 0"));
  if (prev_cursor < 0) return respond(Error(400, "prev_cursor: must be >= 0"));
  if (timeout && !(*timeout >= 0 && std::isfinite(*timeout))) {
    return respond(Error(400, "timeout: must be a finite number of seconds >= 0, or null"));
  }
  // Results stay until they expire (FuturesConfig::keep) whatever the client reports: a result
  // it fetched is small next to what a resend of its request would cost.
  if (auto it = body.find("retrieved_request_ids"); it != body.end() && !it->is_null()) {
    const bool strings = it->is_array() && std::all_of(it->begin(), it->end(), [](const Json& id) {
                           return id.is_string();
                         });
    if (!strings) return respond(Error(400, "retrieved_request_ids: must be a list of strings"));
  }
  const absl::Duration wait =
      timeout ? absl::Seconds(*timeout) : absl::InfiniteDuration();  // clamped to the long poll
  futures_.PollFinished(tenant, SampleTopic(session, clone), prev_cursor, wait, std::move(respond));
}

void TinkerApi::RetrieveFuture(const std::string& tenant, const Json& body, Respond respond) {
  Fields f(body);
  const std::string request_id = f.Str("request_id");
  const bool peek = f.OptBool("allow_metadata_only").value_or(false);
  if (!f.status().ok()) return respond(Error(f.status()));
  futures_.Poll(tenant, request_id, std::move(respond), peek ? config_.peek_bytes : 0);
}

}  // namespace tinkerd::http
