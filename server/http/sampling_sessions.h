// create_sampling_session calls, by (tenant, session_id, sampling_session_seq_id), so that a
// resend finds its sampler: while the sampler is made, a resend waits for the same answer; once
// it is made, a resend gets its id for as long as it samples. Forgotten with the session
// (TinkerApi::Reap), and a failure at once, so that a resend tries again.
//
// Thread-safety: each method takes the table's own lock. Begin asks `alive` (Sampling) under it:
// the lock order is this table's, then Sampling's, and Sampling never calls back.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "server/http/http_server.h"

namespace tinkerd::http {

class SamplingSessions {
 public:
  enum class Turn {
    kMake,      // the first call (or the first since one failed or was evicted): make the sampler
    kWait,      // one is being made: `respond` gets its answer
    kAnswer,    // made, and `alive`: the caller answers with `sampler_id`
    kConflict,  // the key was used by a call with another body (`digest`): refuse this one
  };
  // A call of create_sampling_session, `digest` its body's (future_call.h's Digest). For kMake
  // and kWait, `respond` is taken, to be answered by Finish's caller. A sampler made earlier that
  // `alive` says no longer samples (evicted, idle) is made again, as the first call made it,
  // rather than answered with an id that is gone.
  Turn Begin(const std::string& tenant, const std::string& session_id, int64_t seq, uint64_t digest,
             Respond* respond, const std::function<bool(const std::string&)>& alive,
             std::string* sampler_id);
  // The sampler of the call is made (`sampler_id`), or it failed (empty: forgotten). Returns the
  // calls waiting for the answer.
  std::vector<Respond> Finish(const std::string& tenant, const std::string& session_id, int64_t seq,
                              const std::string& sampler_id);
  // Forgets the call's sampler, if it is still `sampler_id`.
  void Forget(const std::string& tenant, const std::string& session_id, int64_t seq,
              const std::string& sampler_id);
  // The samplers made in the tenant's session `session_id`.
  std::vector<std::string> Samplers(const std::string& tenant, const std::string& session_id) const;
  // Forgets the session's samplers and returns them; one being made stays until it is answered.
  std::vector<std::string> ForgetSession(const std::string& tenant, const std::string& session_id);

 private:
  struct Call {
    std::string sampler_id;  // empty while it is made
    std::vector<Respond> waiting;
    uint64_t digest = 0;
  };

  mutable absl::Mutex mu_;
  std::map<std::string, Call> calls_ ABSL_GUARDED_BY(mu_);  // tenant \n session_id:seq
};

}  // namespace tinkerd::http
