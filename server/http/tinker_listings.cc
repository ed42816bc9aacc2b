// The RestClient's views: training runs (models) and their checkpoints, the tenant's sessions,
// and all its checkpoints, as the SDK's RestClient lists them, paged by the query.
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "runner/util/echo.h"
#include "server/http/json_body.h"
#include "server/http/tinker_api.h"
#include "server/http/tinker_convert.h"
#include "server/http/tinker_json.h"

namespace tinkerd::http {

using Json = TinkerApi::Json;

namespace {

Json CheckpointJson(const CheckpointEntry& c) {
  // checkpoint_id is what follows the model id in the path: "weights/<name>".
  const std::string id = c.path.substr(c.path.find('/', sizeof("tinker://") - 1) + 1);
  return Json{{"checkpoint_id", id},
              {"checkpoint_type", c.kind},
              {"time", IsoTime(c.time)},
              {"tinker_path", c.path},
              {"size_bytes", c.size_bytes},
              {"public", false},
              {"expires_at", c.expires_at ? Json(IsoTime(*c.expires_at)) : Json(nullptr)}};
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
  Json run{{"training_run_id", model_id}, {"base_model", ops_->BaseOf(model_id).name},
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
  // parts: training_runs [id [checkpoints [kind name [archive | external_weights_urls | ttl]]]]
  const bool of_checkpoint = parts.size() == 6 && parts[2] == "checkpoints";
  // The checkpoint those parts name, the run id resolved through the tenant's aliases.
  auto checkpoint = [&] {
    return absl::StrCat("tinker://", aliases_.Resolve(tenant, parts[1]), "/", parts[3], "/",
                        parts[4]);
  };
  if (of_checkpoint && (parts[5] == "archive" || parts[5] == "external_weights_urls")) {
    if (method != "GET") return respond(Error(405, absl::StrCat(endpoint, ": use GET")));
    if (parts[5] == "archive") return ArchiveUrl(tenant, req, checkpoint(), std::move(respond));
    return FileUrls(tenant, req, checkpoint(), std::move(respond));
  }
  // RestClient.set_checkpoint_ttl_from_tinker_path: PUT .../checkpoints/<kind>/<name>/ttl
  // {"ttl_seconds": seconds from now, or null for never}.
  if (of_checkpoint && parts[5] == "ttl") {
    if (method != "PUT") return respond(Error(405, absl::StrCat(endpoint, ": use PUT")));
    // {"ttl_seconds": n} is a few bytes: a larger body is refused before its parse.
    if (req.body.size() > 1024) return respond(Error(413, "body: a ttl takes at most 1 KiB"));
    absl::StatusOr<JsonDom> body =
        ParseJsonBody(req.body.empty() ? "{}" : req.body, [](int64_t) { return absl::OkStatus(); });
    if (!body.ok()) return respond(Error(body.status()));
    const absl::StatusOr<std::optional<absl::Duration>> ttl = TtlFromTinker(**body);
    if (!ttl.ok()) return respond(Error(ttl.status()));
    const absl::Status st = ops_->SetCheckpointExpiry(
        tenant, checkpoint(), *ttl ? std::optional<absl::Time>(absl::Now() + **ttl) : std::nullopt);
    return respond(st.ok() ? JsonResponse(Json::object()) : Error(st));
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
  const std::string model_id = aliases_.Resolve(tenant, parts[1]);
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

void TinkerApi::ListSessions(const std::string& tenant, const Page& page,
                             const std::string& endpoint, Respond respond) {
  if (endpoint == "sessions") {
    Json ids = Json::array();
    for (const std::string& id : sessions_.Ids(tenant)) ids.push_back(id);
    return respond(JsonResponse(Paged(page, "sessions", std::move(ids))));
  }
  const std::string id = endpoint.substr(sizeof("sessions/") - 1);
  Response missing;
  const std::optional<SessionSummary> session = sessions_.Get(tenant, id, &missing);
  if (!session) return respond(std::move(missing));
  const std::vector<std::string> samplers = sampling_sessions_.Samplers(tenant, id);
  // Only what still exists: unloaded models and deleted or evicted samplers are left out.
  Json run_ids = Json::array(), sampler_ids = Json::array();
  for (const std::string& m : session->models) {
    if (ops_->GetInfo(tenant, m).ok()) run_ids.push_back(m);
  }
  for (const std::string& s : samplers) {
    if (sampling_->GetSampler(tenant, s).ok()) sampler_ids.push_back(s);
  }
  Json out{{"training_run_ids", run_ids},
           {"sampler_ids", sampler_ids},
           {"user_metadata", session->user_metadata}};
  if (session->display_name) out["display_name"] = *session->display_name;
  respond(JsonResponse(out));
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

}  // namespace tinkerd::http
