// What the requests of one API key, and of every key together, may hold at the HTTP edge at once:
// body bytes (announced by Content-Length, or the body limit for a chunked body, from the moment
// the headers are read until the request is answered) and connections (a connection counts for
// the key of its latest request). Without it one tenant could fill the server's memory with bodies
// in flight, or its 8,192 connection slots with parked long polls, and turn every other tenant
// away. A request past a bound is answered 429 with Retry-After, before its body is read.
//
// Requests without a key (authentication off: every client is one tenant) have the server-wide
// bound alone. Parked polls need no bound of their own: HTTP/1.1 serves one request per connection
// at a time, so a key parks at most as many polls as it holds connections.
#pragma once

#include <cstdint>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"

namespace tinkerd::http {

struct EdgeQuotaConfig {
  int64_t body_bytes = int64_t{1} << 30;  // every key's together
  int64_t body_bytes_per_key = int64_t{512} << 20;
  int connections_per_key = 2048;
  // InvalidArgument unless 0 < per key <= server-wide for bodies, connections >= 1, and the
  // largest body a request may send fits within a key's bound (else such a request could never
  // be admitted).
  absl::Status Validate(int64_t max_body_bytes) const;
};

class EdgeQuota {
 public:
  explicit EdgeQuota(EdgeQuotaConfig config) : config_(config) {}

  // Takes `bytes` of body for `key`, or nothing and RESOURCE_EXHAUSTED naming the bound passed.
  absl::Status TakeBody(const std::string& key, int64_t bytes);
  void ReturnBody(const std::string& key, int64_t bytes);
  // Takes a connection for `key`, or nothing and RESOURCE_EXHAUSTED.
  absl::Status TakeConnection(const std::string& key);
  void ReturnConnection(const std::string& key);

  int64_t body_bytes() const;
  int connections(const std::string& key) const;

 private:
  struct Held {
    int64_t body_bytes = 0;
    int connections = 0;
  };
  void ForgetIfIdle(const std::string& key) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const EdgeQuotaConfig config_;
  mutable absl::Mutex mu_;
  int64_t body_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  // Keys holding something; a key is forgotten when it holds nothing, so the table is bounded by
  // the connections open.
  absl::flat_hash_map<std::string, Held> held_ ABSL_GUARDED_BY(mu_);
};

}  // namespace tinkerd::http
