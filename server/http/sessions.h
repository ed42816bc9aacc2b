// The Tinker API's sessions: which tenant opened which, when, with what name and metadata, when
// it last sent a heartbeat, how it finished, and the models made in it, so that a session that
// stops heartbeating can be ended and its models deleted (TinkerApi::Reap), and so that sessions
// can be searched (sessions/search). Sessions ended that way are remembered (the latest
// max_sessions, at most kMaxEnded): a heartbeat for one is 410, which tells the SDK (0.38) to
// stop, not 404, and a search still finds them.
//
// Thread-safety: each method takes the table's own lock and calls nothing outside it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/http/http_server.h"

namespace tinkerd::http {

// Tinker's SessionStatus: "active", "client_finished" (reason "success", "errored" or
// "interrupted", as the client reported it) or "cancelled" (ended by this server for want of
// heartbeats). A client's finish is first-wins.
struct SessionStatus {
  std::string type = "active";
  std::string reason;  // client_finished only
  std::string detail;  // may be empty
};

// What a session was created with and what became of it (a search result).
struct SessionSummary {
  std::string id, tenant, project_id;
  absl::Time created;  // whole milliseconds, unique and increasing (Sessions::Create)
  std::optional<std::string> display_name;
  std::map<std::string, std::string> user_metadata;
  SessionStatus status;
  std::vector<std::string> models;  // made in this session
};

// A search (Tinker's SessionSearchRequest), already checked.
struct SessionQuery {
  std::optional<std::string> session_id;
  std::optional<std::vector<std::string>> display_words;  // lower-cased; each must appear
  std::optional<std::vector<std::string>> project_ids;
  std::map<std::string, std::string> user_metadata;  // every pair must hold
  struct Status {
    std::string type;
    std::optional<std::vector<std::string>> reasons;  // client_finished only
  };
  std::optional<std::vector<Status>> statuses;  // any one must hold
  int64_t limit = 50;
  // The previous page's last session (newest first): results start after it.
  std::optional<std::pair<absl::Time, std::string>> after;
};

class Sessions {
 public:
  // `idle`: how long a session may go without a heartbeat (for the 410's message).
  Sessions(size_t max_sessions, absl::Duration idle) : max_sessions_(max_sessions), idle_(idle) {}

  // A new session of `tenant` (`created` and `status` of `session` are set here), or nullopt
  // when max_sessions are open.
  std::optional<std::string> Create(SessionSummary session);
  // Notes a heartbeat of the tenant's session `id`; false, with `missing` set to the answer, when
  // there is no such open session: 410 for one that ended for want of heartbeats or that its
  // client finished, 404 otherwise.
  bool Heartbeat(const std::string& tenant, const std::string& id, Response* missing);
  // Records the client's finish of its session `id`, open or remembered, unless one was recorded
  // already; false when the tenant has no such session.
  bool Finish(const std::string& tenant, const std::string& id, const std::string& reason,
              const std::string& detail);
  // NOT_FOUND unless `id` is an open session of `tenant`; FAILED_PRECONDITION once its client
  // finished it (the SDK's close(): further operations against it are refused).
  absl::Status Check(const std::string& tenant, const std::string& id) const;
  // Whether session `id` is open, whoever's it is.
  bool IsOpen(const std::string& id) const;
  // Notes that `model_id` was made in session `id` (nothing once it ended).
  void AddModel(const std::string& id, const std::string& model_id);
  // FAILED_PRECONDITION when `model_id` was made in a session its client finished (the SDK's
  // close() rejects further operations against the session, its models' included).
  absl::Status CheckModel(const std::string& model_id) const;
  // The model was unloaded: CheckModel need not remember it.
  void ForgetModel(const std::string& model_id);
  // The ids of the tenant's open sessions, newest first.
  std::vector<std::string> Ids(const std::string& tenant) const;
  // The tenant's open session `id`; nullopt and `missing` as for Heartbeat.
  std::optional<SessionSummary> Get(const std::string& tenant, const std::string& id,
                                    Response* missing) const;
  // The tenant's sessions, open and remembered, that match `query`, newest first: at most
  // query.limit, and whether more follow.
  std::vector<SessionSummary> Search(const std::string& tenant, const SessionQuery& query,
                                     bool* more) const;

  struct Ended {
    std::string id, tenant;
    std::vector<std::string> models;
  };
  // Ends the sessions whose last heartbeat is before `cutoff`, and returns them.
  std::vector<Ended> EndIdle(absl::Time cutoff);

 private:
  static constexpr size_t kMaxEnded = 10000;
  struct Session {
    SessionSummary summary;
    absl::Time last_heartbeat;
  };
  // FAILED_PRECONDITION naming the session once its client finished it.
  static absl::Status Unfinished(const SessionSummary& s);
  // The tenant's open session `id`, or null with `missing` set (see Heartbeat).
  const Session* FindLocked(const std::string& tenant, const std::string& id,
                            Response* missing) const ABSL_SHARED_LOCKS_REQUIRED(mu_);

  // The session each model was made in, while the session is open or remembered.
  absl::flat_hash_map<std::string, std::string> model_session_ ABSL_GUARDED_BY(mu_);
  const size_t max_sessions_;
  const absl::Duration idle_;
  mutable absl::Mutex mu_;
  std::map<std::string, Session> sessions_ ABSL_GUARDED_BY(mu_);
  absl::Time last_created_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  // Sessions ended for want of heartbeats, the latest max_sessions_ (their ids oldest first).
  std::map<std::string, SessionSummary> ended_ ABSL_GUARDED_BY(mu_);
  std::deque<std::string> ended_order_ ABSL_GUARDED_BY(mu_);
};

}  // namespace tinkerd::http
