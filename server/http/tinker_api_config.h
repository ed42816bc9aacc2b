// Typed configuration of the Tinker HTTP API; set from flags in tinkerd_main.cc, logged at start.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "runner/util/memory_account.h"
#include "server/http/edge_quota.h"

namespace tinkerd::http {

struct FuturesConfig {
  absl::Duration long_poll = absl::Seconds(30);
  absl::Duration keep = absl::Minutes(10);
  size_t max_entries = 100000;  // finished ones are dropped oldest first past this
};

// Checkpoint downloads (RestClient.get_checkpoint_archive_url).
struct ArchiveConfig {
  // How long an archive URL works (the SDK assumes 15 minutes when told nothing).
  absl::Duration url_ttl = absl::Minutes(15);
  // Downloads streaming at once: each holds its files open, a connection and a 256 KiB chunk.
  int max_downloads = 8;
  // The server's URL as clients reach it, e.g. https://tinkerd.example.org behind a proxy that
  // ends TLS; archive URLs start with it. Empty: the request's Host and the connection's scheme.
  std::string public_url;
};

struct TinkerApiConfig {
  std::string listen;  // host:port; empty: the HTTP API is off
  int threads = 2;
  // The first (default) base model's name as clients give it (create_model's base_model) and see
  // it (get_server_capabilities); the others are named where they are served (ServedRunner).
  std::string served_model_name;
  // Set: the first base's get_info model_data.tokenizer_id, where a client's get_tokenizer()
  // loads its tokenizer; empty: its directory, when it has a tokenizer (server/core/bases.h).
  std::string tokenizer_id;
  int64_t max_body_bytes = 256 << 20;
  // The process's memory account (runner/util/memory_account.h), where a JSON body's DOM is held
  // while its request is read; null where it does not account host memory (a GPU's account, or
  // ranks that must admit alike): the DOM is then bounded by its text alone (json_body.h).
  std::shared_ptr<MemoryAccount> account;
  EdgeQuotaConfig quota;  // per API key and server-wide: bodies in flight, connections
  FuturesConfig futures;
  // A result of at least this many bytes is first answered {"status": "complete_metadata",
  // "response_payload_size"} to a retrieve_future that allows it: the SDK then waits until the
  // size fits its budget of response bytes in flight and polls again for the body. 0: off.
  int64_t peek_bytes = 1 << 20;
  size_t max_sessions = 100000;
  // A session not heartbeating for this long ends, and its models are deleted (their
  // unapplied gradients with them; checkpoints stay). Zero: sessions never expire.
  absl::Duration session_idle = absl::ZeroDuration();
  ArchiveConfig archive;

  absl::Status Validate() const;
  std::string DebugString() const;
};

}  // namespace tinkerd::http
