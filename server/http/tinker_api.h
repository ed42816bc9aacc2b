// The Tinker HTTP API (/api/v1/..., as the Tinker Python SDK speaks it) onto the shared
// operations (server/ops/ops.h): the same checks, queues, retry keys and runner as gRPC. This file
// turns JSON and Tinker's protobuf into tinkerd's requests and the answers back; it holds no
// training state of its own, only the small tables below, each its own piece with its own lock:
// the route table (router.h), futures (futures.h, future_call.h), sessions (sessions.h), model
// aliases (aliases.h), sampling sessions (sampling_sessions.h), sample cancels
// (sample_cancels.h) and archive URLs (archive_grants.h). No piece calls another while it holds
// its lock, so there is no lock order between them; the handlers here hold none.
//
// Ids: Tinker model ids are tinkerd's model ids. A call that returns a future answers
// {"request_id"} at once; request_id is "<model_id>:<seq_id>" for a model's ordered calls (so a
// retried call finds its first future), "create:<session_id>:<model_seq_id>" for create_model
// and "unload:<model_id>" for unload_model.
//
// Errors: a request that cannot be read (body, content type, a field) is answered at once with
// a 4xx and {"detail"} naming the field. A duplicate seq_id with another payload is 400 (the SDK
// retries 409), a full queue 429, shutting down 503. Anything the operation itself refuses
// becomes the future's {"error", "category"}, which the SDK raises without retrying.
#pragma once

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "server/common/auth.h"
#include "server/http/aliases.h"
#include "server/http/archive_grants.h"
#include "server/http/copies.h"
#include "server/http/future_call.h"
#include "server/http/futures.h"
#include "server/http/http_server.h"
#include "server/http/router.h"
#include "server/http/sample_cancels.h"
#include "server/http/sampling_sessions.h"
#include "server/http/sessions.h"
#include "server/http/tinker_api_config.h"
#include "server/http/tinker_convert.h"
#include "server/ops/ops.h"
#include "server/ops/sampling.h"

namespace tinkerd::http {

class TinkerApi {
 public:
  using Json = nlohmann::json;

  // `after` runs a function later on the HTTP threads (for long polls).
  TinkerApi(Ops* ops, Sampling* sampling, ApiKeys keys, TinkerApiConfig config,
            std::function<void(absl::Duration, std::function<void()>)> after);

  // The HTTP server's handler.
  void Handle(Request req, Respond respond);
  // HttpServer's Admit: a request whose key is missing or unknown is answered 401 from its
  // headers, before its body is read (Handle answers the same for a request that got past).
  std::optional<Response> Admit(const Request& head) const;
  // Starts ending idle sessions (when config.session_idle is set) and deleting expired checkpoints
  // (once a minute); once the server serves.
  void StartReaper();
  // Answers parked polls (503) and forgets every future; for shutdown, after the scheduler
  // stopped (so no result lands any more) and before the HTTP server goes.
  void Close() { futures_.Close(); }

 private:
  // The endpoints that take a JSON object by POST, for the router.
  std::map<std::string, Router::JsonHandler> JsonPosts();

  // Endpoints taking JSON (tinker_api.cc, and as noted).
  void ClientConfig(const std::string& tenant, const Json& body, Respond respond);
  void DynamicConfig(const std::string& tenant, const Json& body, Respond respond);
  void Telemetry(const std::string& tenant, const Json& body, Respond respond);
  // Sessions (tinker_sessions.cc).
  void CreateSession(const std::string& tenant, const Json& body, Respond respond);
  void SessionHeartbeat(const std::string& tenant, const Json& body, Respond respond);
  void FinishSession(const std::string& tenant, const std::string& endpoint, const Json& body,
                     Respond respond);
  void SearchSessions(const std::string& tenant, const Json& body, Respond respond);
  void CopyWeights(const std::string& tenant, const std::string& idempotency_key, const Json& body,
                   Respond respond);
  // A search result as Tinker's SessionSummary, with the checkpoints its models still have.
  Json SessionSummaryJson(const SessionSummary& s);
  // Ends the sessions idle past config.session_idle and deletes their models and samplers; then
  // again later.
  void Reap();
  // Deletes the checkpoints whose ttl ran out (Ops::ExpireCheckpoints); then again in a minute.
  void ExpireCheckpoints();
  // Training (tinker_training.cc).
  void CreateModel(const std::string& tenant, const Json& body, Respond respond);
  void GetInfo(const std::string& tenant, const Json& body, Respond respond);
  void UnloadModel(const std::string& tenant, const Json& body, Respond respond);
  void OptimStep(const std::string& tenant, const Json& body, Respond respond);
  void SaveWeights(const std::string& tenant, const Json& body, Respond respond);
  void LoadWeights(const std::string& tenant, const Json& body, Respond respond);
  void SaveWeightsForSampler(const std::string& tenant, const Json& body, Respond respond);
  // save_weights_external: the model's weights for download, in Hugging Face layout (a LoRA
  // model's PEFT adapter, a full fine-tune's merged weights), under external_weights/.
  void SaveWeightsExternal(const std::string& tenant, const Json& body, Respond respond);
  // Answers an ordered call the edge refuses (`error`) through its future, its seq_id taken with
  // the error (Ops::Refuse): the client has used that seq_id, and the model's later calls would
  // otherwise wait for it until --order_timeout_s.
  void RefuseOrdered(const std::string& tenant, const CallKey& key, const std::string& model_id,
                     int64_t seq_id, const std::string& kind, absl::Status error, Respond respond);
  void WeightsInfo(const std::string& tenant, const Json& body, Respond respond);
  // Tinker's protobuf ForwardBackwardRequest (forward_only selects forward).
  void ForwardBackward(const std::string& tenant, const Request& req, Respond respond);
  // Notes a model made in a session: its alias "<session_id>:train:<model_seq_id>", and the
  // session's models (deleted with it when it ends for want of heartbeats).
  void AddSessionModel(const std::string& tenant, const std::string& session_id,
                       int64_t model_seq_id, const std::string& model_id);
  // Futures (tinker_futures.cc).
  void RetrieveFuture(const std::string& tenant, const Json& body, Respond respond);
  // Newer SDKs' long poll for the finished samples of one sampling session (and clone).
  void RetrieveFutures(const std::string& tenant, const Json& body, Respond respond);
  // The topic of a sampling session's sample futures (Futures::PollFinished): the SDK polls per
  // session and clone, a clone numbering its seq_ids from clone · 10^9.
  static std::string SampleTopic(const std::string& session, int64_t clone) {
    return absl::StrCat(session, "#", clone);
  }
  // Sampling (tinker_sampling.cc). A Tinker sampling session is a tinkerd sampler.
  void CreateSamplingSession(const std::string& tenant, const Json& body, Respond respond);
  void ASample(const std::string& tenant, const Json& body, Respond respond);
  // Newer SDKs' cancel of an abandoned sample: the engine ends it after its step under way, and
  // its future fails CANCELLED. {"cancelled": false} when it had finished (or is not a sample).
  void CancelFuture(const std::string& tenant, const Json& body, Respond respond);
  void JoinSamplingSession(const std::string& tenant, const Json& body, Respond respond);
  void ApiKey(const std::string& tenant, const Request& req, Respond respond);
  void GetSampler(const std::string& tenant, const std::string& sampler_id, Respond respond);
  // save_weights_for_sampler without a name: the model frozen at seq_id into a new sampler.
  void SaveWeightsForSession(const std::string& tenant, const CallKey& key,
                             const std::string& model_id, int64_t seq_id, bool inflight,
                             Respond respond);
  // The RestClient's views (tinker_listings.cc) of models ("training runs") and their
  // checkpoints: GET training_runs, GET training_runs/{id}, GET training_runs/{id}/checkpoints,
  // DELETE training_runs/{id}/checkpoints/{weights|sampler_weights}/{name}.
  // GET training_runs/{id}/checkpoints/{kind}/{name}/archive answers a URL (ArchiveUrl).
  void TrainingRuns(const std::string& tenant, const Request& req, const std::string& endpoint,
                    Respond respond);
  // The tenant's sessions and checkpoints: GET sessions (the open sessions' ids, newest first),
  // GET sessions/{id} (the models and samplers made in it that still exist), GET checkpoints
  // (every checkpoint of every model the tenant has or had, newest first). Listings are paged by
  // the query's limit and offset (PageFromQuery).
  void ListSessions(const std::string& tenant, const Page& page, const std::string& endpoint,
                    Respond respond);
  void UserCheckpoints(const std::string& tenant, const Page& page, Respond respond);
  // A training run's JSON, or NOT_FOUND.
  absl::StatusOr<Json> TrainingRun(const std::string& tenant, const std::string& model_id);
  // Checkpoint downloads (tinker_archive.cc). A checkpoint's download URL, {"url", "expires"}:
  // GET archives/{token} on this server, valid for the configured lifetime (ArchiveConfig),
  // answers the checkpoint's files as a tar archive streamed from disk.
  void ArchiveUrl(const std::string& tenant, const Request& req, const std::string& uri,
                  Respond respond);
  void Archive(const std::string& method, const std::string& token, Respond respond);
  // An external_weights checkpoint's files, each with its download URL (as ArchiveUrl's, for the
  // file alone): {"urls": {file: url}, "expires"}.
  void FileUrls(const std::string& tenant, const Request& req, const std::string& uri,
                Respond respond);
  // A download URL for `grant` (a new token for it).
  absl::StatusOr<std::string> GrantUrl(const Request& req, ArchiveGrant grant);

  Ops* ops_;
  Sampling* sampling_;
  const ApiKeys keys_;
  const TinkerApiConfig config_;
  const std::function<void(absl::Duration, std::function<void()>)> after_;
  const Router router_;
  Futures futures_;
  Sessions sessions_;
  Aliases aliases_;
  SamplingSessions sampling_sessions_;
  SampleCancels cancels_;
  Copies copies_{4096};
  ArchiveGrants archives_;
  // Archive downloads streaming now. Shared with each archive, whose last reference counts it
  // out: that may be the HTTP server's, which outlives this API.
  const std::shared_ptr<std::atomic<int>> archive_downloads_ =
      std::make_shared<std::atomic<int>>(0);
};

}  // namespace tinkerd::http
