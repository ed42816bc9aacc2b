// The Tinker HTTP API (/api/v1/..., as the Tinker Python SDK speaks it) onto the shared
// operations (server/ops/ops.h): the same checks, queues, retry keys and runner as gRPC. This file
// turns JSON and Tinker's protobuf into tinkerd's requests and the answers back; it holds no
// training state of its own, only sessions (which tenant opened which) and futures.
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
#include <deque>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/common/auth.h"
#include "server/http/futures.h"
#include "server/http/http_server.h"
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
  // Starts ending idle sessions (when config.session_idle is set); once the server serves.
  void StartReaper();
  // Answers parked polls (503) and forgets every future; for shutdown, after the scheduler
  // stopped (so no result lands any more) and before the HTTP server goes.
  void Close() { futures_.Close(); }

 private:
  struct Session {
    std::string tenant;
    absl::Time created, last_heartbeat;
    std::vector<std::string> models;  // made in this session
  };
  using JsonHandler = void (TinkerApi::*)(const std::string& tenant, const Json& body,
                                          Respond respond);

  // Endpoints taking JSON.
  void ClientConfig(const std::string& tenant, const Json& body, Respond respond);
  void DynamicConfig(const std::string& tenant, const Json& body, Respond respond);
  void CreateSession(const std::string& tenant, const Json& body, Respond respond);
  void SessionHeartbeat(const std::string& tenant, const Json& body, Respond respond);
  void FinishSession(const std::string& tenant, const Json& body, Respond respond);
  void Telemetry(const std::string& tenant, const Json& body, Respond respond);
  void CreateModel(const std::string& tenant, const Json& body, Respond respond);
  void GetInfo(const std::string& tenant, const Json& body, Respond respond);
  void UnloadModel(const std::string& tenant, const Json& body, Respond respond);
  void OptimStep(const std::string& tenant, const Json& body, Respond respond);
  void SaveWeights(const std::string& tenant, const Json& body, Respond respond);
  void LoadWeights(const std::string& tenant, const Json& body, Respond respond);
  void SaveWeightsForSampler(const std::string& tenant, const Json& body, Respond respond);
  void WeightsInfo(const std::string& tenant, const Json& body, Respond respond);
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
  void GetSampler(const std::string& tenant, const std::string& sampler_id, Respond respond);
  // save_weights_for_sampler without a name: the model frozen at seq_id into a new sampler.
  void SaveWeightsForSession(const std::string& tenant, const std::string& request_id,
                             const std::string& model_id, int64_t seq_id, Respond respond);
  // The RestClient's views of models ("training runs") and their checkpoints:
  // GET training_runs, GET training_runs/{id}, GET training_runs/{id}/checkpoints,
  // DELETE training_runs/{id}/checkpoints/{weights|sampler_weights}/{name}.
  // GET training_runs/{id}/checkpoints/{kind}/{name}/archive answers a URL (ArchiveUrl).
  void TrainingRuns(const std::string& tenant, const Request& req, const std::string& endpoint,
                    Respond respond);
  // A checkpoint's download URL, {"url", "expires"}: GET archives/{token} on this server, valid
  // for the configured lifetime (ArchiveConfig), answers the checkpoint's files as a tar archive
  // streamed from disk.
  void ArchiveUrl(const std::string& tenant, const Request& req, const std::string& uri,
                  Respond respond);
  void Archive(const std::string& method, const std::string& token, Respond respond);
  // The RestClient's views of the tenant's sessions and checkpoints: GET sessions (the open
  // sessions' ids, newest first), GET sessions/{id} (the models and samplers made in it that
  // still exist), GET checkpoints (every checkpoint of every model the tenant has or had,
  // newest first). Listings are paged by the query's limit and offset (PageFromQuery).
  void Sessions(const std::string& tenant, const Page& page, const std::string& endpoint,
                Respond respond);
  void UserCheckpoints(const std::string& tenant, const Page& page, Respond respond);
  // A training run's JSON, or NOT_FOUND.
  absl::StatusOr<Json> TrainingRun(const std::string& tenant, const std::string& model_id);
  // Tinker's protobuf ForwardBackwardRequest (forward_only selects forward).
  void ForwardBackward(const std::string& tenant, const Request& req, Respond respond);

  // Starts an operation whose answer becomes future `request_id`, and answers the HTTP request:
  // with {"request_id"} once the operation was accepted (or answered by the operation itself),
  // or directly with the error when the scheduler refused it at once for a reason a resend can
  // fix or that must not overwrite the first call's future (duplicate, full, shutting down).
  // `encode` turns the operation's response into the future's result; `accepted` holds fields
  // added to the {"request_id"} answer; `topic` is the future's (Futures::PollFinished).
  // Who recognizes a resend: the scheduler, by the model's seq_id (kOperation: the call starts
  // again, and gets the first call's result, or is refused if its payload differs), or only the
  // future table (kFuture: the first call's future answers it, and the call is not started
  // again: calls without a place in a model's order, such as creations and samples).
  enum class Resend { kOperation, kFuture };
  template <typename Resp>
  void Submit(const std::string& tenant, const std::string& request_id, Resend resend,
              std::function<void(Done<Resp>)> start, std::function<Response(const Resp&)> encode,
              Respond respond, Json accepted = Json::object(), const std::string& topic = "");
  // The model a client's id names: tinkerd's own ids name themselves; newer SDKs also address a
  // model they made from a checkpoint as "<session_id>:train:<model_seq_id>".
  std::string Resolve(const std::string& tenant, const std::string& model_id);
  void Alias(const std::string& tenant, const std::string& session_id, int64_t model_seq_id,
             const std::string& model_id);
  // Ends the sessions idle past config.session_idle and deletes their models; then again later.
  void Reap();
  // The tenant's open session `id`, or null with `missing` set to the answer: 410 for one that
  // ended for want of heartbeats (SDK 0.38 then stops heartbeating), 404 otherwise.
  Session* FindSessionLocked(const std::string& tenant, const std::string& id, Response* missing)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // NOT_FOUND unless `session_id` is a session of `tenant`.
  absl::Status CheckSession(const std::string& tenant, const std::string& session_id);

  Ops* ops_;
  Sampling* sampling_;
  const ApiKeys keys_;
  const TinkerApiConfig config_;
  const std::function<void(absl::Duration, std::function<void()>)> after_;
  Futures futures_;
  absl::Mutex mu_;
  std::map<std::string, Session> sessions_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::string> aliases_ ABSL_GUARDED_BY(mu_);  // tenant \n alias -> id
  // Sessions ended for want of heartbeats (tenant \n id), the latest max_sessions: a heartbeat
  // for one is 410, which tells the SDK to stop, not 404.
  std::set<std::string> ended_ ABSL_GUARDED_BY(mu_);
  std::deque<std::string> ended_order_ ABSL_GUARDED_BY(mu_);
  // A create_sampling_session call, by tenant \n session_id:sampling_session_seq_id, so that a
  // resend finds its sampler: while it is made, the resend waits for the same answer.
  struct SamplingSession {
    std::string sampler_id;  // empty while it is made
    std::vector<Respond> waiting;
  };
  std::map<std::string, SamplingSession> sampling_sessions_ ABSL_GUARDED_BY(mu_);
  // The running samples' cancel flags, by tenant \n request_id: set by cancel_future, read by the
  // engine after each step (through the request's progress callback).
  std::map<std::string, std::shared_ptr<std::atomic<bool>>> cancels_ ABSL_GUARDED_BY(mu_);
  // Archive URLs given out, by token; each tenant's latest, so expired ones answer 410.
  struct ArchiveGrant {
    std::string tenant, uri;
    absl::Time expires;
  };
  std::map<std::string, ArchiveGrant> archives_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::deque<std::string>> archive_order_ ABSL_GUARDED_BY(mu_);  // by tenant
  // Archive downloads streaming now. Shared with each archive, whose last reference counts it
  // out: that may be the HTTP server's, which outlives this API.
  const std::shared_ptr<std::atomic<int>> archive_downloads_ =
      std::make_shared<std::atomic<int>>(0);
};

}  // namespace tinkerd::http
