// The Tinker API's sessions: which tenant opened which, when it last sent a heartbeat, and the
// models made in it, so that a session that stops heartbeating can be ended and its models
// deleted (TinkerApi::Reap). Sessions ended that way are remembered (the latest max_sessions):
// a heartbeat for one is 410, which tells the SDK (0.38) to stop, not 404.
//
// Thread-safety: each method takes the table's own lock and calls nothing outside it.
#pragma once

#include <cstddef>
#include <deque>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/http/http_server.h"

namespace tinkerd::http {

class Sessions {
 public:
  // `idle`: how long a session may go without a heartbeat (for the 410's message).
  Sessions(size_t max_sessions, absl::Duration idle) : max_sessions_(max_sessions), idle_(idle) {}

  // A new session of `tenant`, or nullopt when max_sessions are open.
  std::optional<std::string> Create(const std::string& tenant);
  // Notes a heartbeat of the tenant's session `id`; false, with `missing` set to the answer, when
  // there is no such open session: 410 for one that ended for want of heartbeats, 404 otherwise.
  bool Heartbeat(const std::string& tenant, const std::string& id, Response* missing);
  // NOT_FOUND unless `id` is an open session of `tenant`.
  absl::Status Check(const std::string& tenant, const std::string& id) const;
  // Whether session `id` is open, whoever's it is.
  bool IsOpen(const std::string& id) const;
  // Notes that `model_id` was made in session `id` (nothing once it ended).
  void AddModel(const std::string& id, const std::string& model_id);
  // The ids of the tenant's open sessions, newest first.
  std::vector<std::string> Ids(const std::string& tenant) const;
  // The models made in the tenant's session `id`; nullopt and `missing` as for Heartbeat.
  std::optional<std::vector<std::string>> Models(const std::string& tenant, const std::string& id,
                                                 Response* missing) const;

  struct Ended {
    std::string id, tenant;
    std::vector<std::string> models;
  };
  // Ends the sessions whose last heartbeat is before `cutoff`, and returns them.
  std::vector<Ended> EndIdle(absl::Time cutoff);

 private:
  struct Session {
    std::string tenant;
    absl::Time created, last_heartbeat;
    std::vector<std::string> models;  // made in this session
  };
  // The tenant's open session `id`, or null with `missing` set (see Heartbeat).
  const Session* FindLocked(const std::string& tenant, const std::string& id,
                            Response* missing) const ABSL_SHARED_LOCKS_REQUIRED(mu_);

  const size_t max_sessions_;
  const absl::Duration idle_;
  mutable absl::Mutex mu_;
  std::map<std::string, Session> sessions_ ABSL_GUARDED_BY(mu_);
  // Sessions ended for want of heartbeats (tenant \n id), the latest max_sessions_.
  std::set<std::string> ended_ ABSL_GUARDED_BY(mu_);
  std::deque<std::string> ended_order_ ABSL_GUARDED_BY(mu_);
};

}  // namespace tinkerd::http
