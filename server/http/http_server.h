// An HTTP/1.1 server on Boost.Beast: keep-alive connections served asynchronously by a few
// threads, so that thousands of parked long polls (Tinker's retrieve_future) cost a socket and a
// timer each, never a thread. Requests are handed whole (body read, size-capped) to one handler,
// which answers exactly once, from any thread, whenever it is ready.
//
// Before a body is read: its headers pass Admit (the API key), then the edge's quota of
// connections and body bytes in flight per key (edge_quota.h; 429 past it); a transfer coding
// other than a lone `chunked` is 501. A HEAD request is handled as its GET and answered with the
// GET's status and headers (Content-Length included) and no body.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "runner/util/memory_account.h"
#include "server/http/edge_quota.h"

namespace tinkerd::http {

struct Request {
  std::string method;            // "GET", "POST", ...
  std::string path;              // the target without its query string
  std::string query;             // what follows '?' in the target, as sent (empty without)
  std::string content_type;      // without parameters, lower case
  std::string content_encoding;  // empty for identity
  std::string api_key;           // X-API-Key
  std::string idempotency_key;   // X-Idempotency-Key (copy_weights)
  std::string host;              // the Host header, as the client addressed the server
  bool tls = false;              // arrived over TLS
  std::string body;
};

// Files opened for a response to stream as one tar archive (server/http/tar_body.h).
struct TarArchive;

struct Response {
  int status = 200;
  std::string content_type = "application/json";
  std::string body;
  std::vector<std::pair<std::string, std::string>> headers;
  // When set, the body is this ustar archive, streamed from disk (`body` unused).
  std::shared_ptr<const TarArchive> tar = nullptr;
};

// Answers its request; the first call counts, later ones are ignored. Callable from any thread.
using Respond = std::function<void(Response)>;
// Should a handler throw, its request is answered 500 (unless it answered already) and the
// server goes on.
using Handler = std::function<void(Request, Respond)>;
// Looks at a request's headers (`body` empty) before its body is read: an answer refuses it
// there (a missing or unknown API key, say), so that no body is buffered for a request that will
// be refused anyway; the connection then reads the body only to discard it, and closes.
using Admit = std::function<std::optional<Response>(const Request&)>;

struct HttpServerConfig {
  std::string host = "127.0.0.1";
  int port = 0;  // 0: any free port
  int threads = 2;
  int64_t max_body_bytes = 256 << 20;
  // A body sent as application/json: parsed into a DOM of several times its size, where the bulky
  // bodies (forward_backward's) are protobuf. 16 MiB holds any asample or create call.
  int64_t max_json_body_bytes = 16 << 20;
  int max_connections = 8192;
  // Body bytes in flight and connections, per API key and for the whole server (edge_quota.h).
  EdgeQuotaConfig quota;
  // Where a body's bytes are also held while in flight (runner/util/memory_account.h): past its
  // room the request is 429 before its body is read. Null: the quota alone bounds them.
  std::shared_ptr<MemoryAccount> account;
  // How long a connection may sit between requests, or take to send one.
  absl::Duration idle_timeout = absl::Seconds(120);
  // PEM files: TLS when the certificate and key are set; clients must present a certificate
  // from client_ca when that is set too (mutual TLS). TLS 1.2 and later; HTTP/1.1 only.
  std::string tls_cert_file, tls_key_file, tls_client_ca_file;
};

class HttpServer {
 public:
  static absl::StatusOr<std::unique_ptr<HttpServer>> Start(HttpServerConfig config, Handler handler,
                                                           Admit admit = nullptr);
  ~HttpServer();  // Stop()s

  int port() const;
  // Open client connections: each holds a slot of max_connections until it closes (a client
  // hanging up while its answer is pending closes it at once).
  int connections() const;
  // Runs `fn` on a server thread after `delay`, unless the server stopped first.
  void After(absl::Duration delay, std::function<void()> fn);
  // Stops accepting, drops every connection and joins the threads. Answers given later are
  // discarded. The server's memory (and any connection a Respond still holds) lives until the
  // destructor, so a Respond may outlive Stop but not the server.
  void Stop();

  struct Impl;  // public only so that the connections in the .cc can name it

 private:
  explicit HttpServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace tinkerd::http
