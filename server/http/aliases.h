// The other names of a model: a model made in a session (create_model, or load_weights making one
// from a checkpoint) is also "<session_id>:train:<model_seq_id>", which newer SDKs address it by.
// Per tenant; forgotten with the session (TinkerApi::Reap).
//
// Thread-safety: each method takes the table's own lock and calls nothing outside it.
#pragma once

#include <cstdint>
#include <map>
#include <string>

#include "absl/synchronization/mutex.h"

namespace tinkerd::http {

class Aliases {
 public:
  // The model a client's id names: tinkerd's own ids name themselves.
  std::string Resolve(const std::string& tenant, const std::string& model_id) const;
  void Add(const std::string& tenant, const std::string& session_id, int64_t model_seq_id,
           const std::string& model_id);
  // Forgets the aliases made in the tenant's session `session_id`.
  void ForgetSession(const std::string& tenant, const std::string& session_id);

 private:
  mutable absl::Mutex mu_;
  std::map<std::string, std::string> models_ ABSL_GUARDED_BY(mu_);  // tenant \n alias -> id
};

}  // namespace tinkerd::http
