#include "server/http/http_server.h"

#include <sys/socket.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/ssl.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/strand.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <boost/beast/ssl.hpp>
#include <cerrno>
#include <new>
#include <thread>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "runner/util/log.h"
#include "server/common/status_map.h"
#include "server/http/tar_body.h"

namespace tinkerd::http {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace bhttp = boost::beast::http;
using tcp = asio::ip::tcp;

namespace {

constexpr size_t kMaxHeaderBytes = 16 << 10;

// Transfer-Encoding names the codings applied to the body, last one applied last; the server
// decodes chunked alone (RFC 9112 §6.1: an unknown coding is 501).
bool IsLoneChunked(absl::string_view te) {
  return absl::AsciiStrToLower(absl::StripAsciiWhitespace(te)) == "chunked";
}

std::string ErrorBody(const std::string& detail) {
  // Only fixed texts and library messages reach here: no JSON escaping needed beyond quotes.
  std::string d;
  for (char c : detail) d += (c == '"' || c == '\\') ? ' ' : c;
  return absl::StrCat("{\"detail\":\"", d, "\"}");
}

}  // namespace

struct HttpServer::Impl {
  HttpServerConfig config;
  Handler handler;
  Admit admit;
  std::optional<EdgeQuota> quota;
  // Before io: connections still queued in io when it is destroyed count themselves out here.
  std::atomic<int> connections{0};
  std::atomic<bool> stopped{false};
  int port = 0;
  asio::io_context io;
  std::optional<asio::ssl::context> tls;  // set: every connection speaks TLS
  tcp::acceptor acceptor{io};
  std::optional<asio::executor_work_guard<asio::io_context::executor_type>> work;
  std::vector<std::thread> threads;

  void Accept();
};

namespace {

// One client connection; Stream is a beast::tcp_stream, or an ssl_stream over one.
template <typename Stream>
class Connection : public std::enable_shared_from_this<Connection<Stream>> {
 public:
  template <typename... Args>
  Connection(HttpServer::Impl* server, Args&&... args)
      : stream_(std::forward<Args>(args)...), server_(server) {
    server_->connections.fetch_add(1);
  }
  ~Connection() { Uncount(); }

  void Start() {
    if constexpr (std::is_same_v<Stream, beast::tcp_stream>) {
      Read();
    } else {
      Lowest().expires_after(absl::ToChronoSeconds(server_->config.idle_timeout));
      stream_.async_handshake(asio::ssl::stream_base::server,
                              [self = this->shared_from_this()](beast::error_code ec) {
                                if (ec) return self->Close();  // not TLS, or an untrusted client
                                self->Read();
                              });
    }
  }

  void Read() {
    parser_.emplace();
    SetBodyLimit(/*json=*/false);
    parser_->body_limit(static_cast<uint64_t>(body_limit_));
    parser_->header_limit(kMaxHeaderBytes);
    Lowest().expires_after(absl::ToChronoSeconds(server_->config.idle_timeout));
    bhttp::async_read_header(
        stream_, buffer_, *parser_,
        beast::bind_front_handler(&Connection::OnHeader, this->shared_from_this()));
  }

  // Writes `r` on this connection's strand; then reads the next request or closes.
  void Answer(Response r) {
    asio::post(stream_.get_executor(), [self = this->shared_from_this(),
                                        r = std::move(r)]() mutable { self->Write(std::move(r)); });
  }

 private:
  // The headers are in: refuse what can be refused without the body, else read it.
  void OnHeader(beast::error_code ec, size_t) {
    if (ec) return OnRead(ec, 0);
    auto& msg = parser_->get();
    version_ = msg.version();
    head_ = msg.method() == bhttp::verb::head;
    const auto te = msg[bhttp::field::transfer_encoding];
    if (!te.empty() && !IsLoneChunked(absl::string_view(te.data(), te.size()))) {
      keep_alive_ = false;  // the body's framing is unknown: nothing after it can be read
      return Write({501,
                    "application/json",
                    ErrorBody("Transfer-Encoding: only chunked is supported (no other coding)"),
                    {}});
    }
    Request head = RequestOf(msg);
    // A JSON body becomes a DOM several times its size: it gets the smaller limit.
    SetBodyLimit(head.content_type == "application/json");
    parser_->body_limit(static_cast<uint64_t>(body_limit_));
    if (server_->admit) {
      std::optional<Response> refused = server_->admit(head);
      if (refused) {
        keep_alive_ = false;
        discard_body_ = !parser_->is_done();
        return Write(*std::move(refused));
      }
    }
    // The parser checked Content-Length against the limit it had when it read the headers.
    if (const auto length = parser_->content_length();
        length && *length > static_cast<uint64_t>(body_limit_)) {
      keep_alive_ = false;
      discard_body_ = true;
      return Write(TooLarge());
    }
    if (absl::Status held = Hold(head.api_key); !held.ok()) {
      keep_alive_ = false;
      discard_body_ = !parser_->is_done();
      return Write({429,
                    "application/json",
                    ErrorBody(std::string(held.message())),
                    {{"Retry-After", "1"}}});
    }
    bhttp::async_read(stream_, buffer_, *parser_,
                      beast::bind_front_handler(&Connection::OnRead, this->shared_from_this()));
  }

  // Counts this connection for `key` (its latest request's) and takes the body's bytes from the
  // edge's quota: Content-Length, or for a chunked body the limit it may grow to.
  absl::Status Hold(const std::string& key) {
    EdgeQuota& quota = *server_->quota;
    if (!keyed_ || key != key_) {
      if (keyed_) quota.ReturnConnection(key_);
      keyed_ = false;
      if (absl::Status st = quota.TakeConnection(key); !st.ok()) return st;
      key_ = key;
      keyed_ = true;
    }
    const auto length = parser_->content_length();
    const int64_t bytes = parser_->is_done() ? 0
                          : length           ? static_cast<int64_t>(*length)
                                             : body_limit_;
    if (bytes == 0) return absl::OkStatus();
    if (absl::Status st = quota.TakeBody(key_, bytes); !st.ok()) return st;
    body_held_ = bytes;
    if (server_->config.account != nullptr) {
      absl::StatusOr<Reservation> memory = server_->config.account->Reserve(
          bytes, "body: the request's bytes in flight", "; retry shortly");
      if (!memory.ok()) {
        ReturnBody();
        return memory.status();
      }
      body_memory_ = *std::move(memory);
    }
    return absl::OkStatus();
  }

  // A chunked body held the limit it could grow to while it was read; once read, it holds its size,
  // so that its JSON's DOM and other requests' bodies get the rest. The quota's part is given back
  // at once; the account's is taken again at the smaller size, which a concurrent request may
  // have taken meanwhile: then this one holds nothing there (it is being answered anyway).
  void FitHeldBodyTo(int64_t bytes) {
    if (body_held_ <= bytes) return;
    server_->quota->ReturnBody(key_, body_held_ - bytes);
    body_held_ = bytes;
    if (body_memory_.bytes() > bytes) {
      body_memory_ = Reservation();
      if (server_->config.account != nullptr && bytes > 0) {
        absl::StatusOr<Reservation> memory = server_->config.account->Reserve(
            bytes, "body: the request's bytes in flight", "; retry shortly");
        if (memory.ok()) body_memory_ = *std::move(memory);
      }
    }
  }

  // The request is answered (or the connection gone): its body no longer counts.
  void ReturnBody() {
    if (body_held_ > 0) server_->quota->ReturnBody(key_, body_held_);
    body_held_ = 0;
    body_memory_ = Reservation();
  }

  // A JSON body becomes a DOM several times its size: it gets the smaller limit. And none may be
  // larger than the memory account holds for bodies: such a body would be refused 429 for ever.
  void SetBodyLimit(bool json) {
    const HttpServerConfig& c = server_->config;
    body_limit_ = c.max_body_bytes;
    body_limit_why_ = "";
    if (json && c.max_json_body_bytes < body_limit_) {
      body_limit_ = c.max_json_body_bytes;
      body_limit_why_ = " for a JSON body";
    }
    if (c.account != nullptr && c.account->capacity() < body_limit_) {
      body_limit_ = c.account->capacity();
      body_limit_why_ = " (what its memory budget holds for request bodies)";
    }
  }

  Response TooLarge() const {
    return {413,
            "application/json",
            ErrorBody(absl::StrCat("body: larger than the server's limit of ", body_limit_,
                                   " bytes", body_limit_why_)),
            {}};
  }

  // A request's line and headers; the caller moves the body in.
  Request RequestOf(const bhttp::request<bhttp::string_body>& msg) const {
    Request req;
    // HEAD is served as its GET; Write then leaves the body out.
    req.method = head_ ? "GET" : std::string(msg.method_string());
    const auto target = msg.target();
    const size_t mark = target.find('?');
    req.path = std::string(target.substr(0, mark));
    if (mark != target.npos) req.query = std::string(target.substr(mark + 1));
    const auto type = msg[bhttp::field::content_type];
    const auto encoding = msg[bhttp::field::content_encoding];
    absl::string_view type_view(type.data(), type.size());
    type_view = type_view.substr(0, type_view.find(';'));
    req.content_type = absl::AsciiStrToLower(absl::StripAsciiWhitespace(type_view));
    req.content_encoding = absl::AsciiStrToLower(
        absl::StripAsciiWhitespace(absl::string_view(encoding.data(), encoding.size())));
    if (req.content_encoding == "identity") req.content_encoding.clear();
    req.api_key = std::string(msg["X-API-Key"]);
    req.idempotency_key = std::string(msg["X-Idempotency-Key"]);
    req.host = std::string(msg[bhttp::field::host]);
    req.tls = !std::is_same_v<Stream, beast::tcp_stream>;
    return req;
  }

  void OnRead(beast::error_code ec, size_t) {
    if (ec == bhttp::error::end_of_stream || ec == beast::error::timeout ||
        ec == asio::error::operation_aborted || ec == asio::error::connection_reset ||
        ec == asio::error::eof) {
      return Close();
    }
    keep_alive_ = false;  // after an error the stream position is unknown
    if (ec == bhttp::error::body_limit) return Write(TooLarge());
    if (ec == bhttp::error::header_limit) {
      return Write({431, "application/json", ErrorBody("headers: larger than 16 KiB"), {}});
    }
    if (ec) {
      return Write({400,
                    "application/json",
                    ErrorBody(absl::StrCat("malformed HTTP request: ", ec.message())),
                    {}});
    }
    Lowest().expires_never();
    auto& msg = parser_->get();
    keep_alive_ = msg.keep_alive();
    Request req = RequestOf(msg);
    req.body = std::move(msg.body());
    FitHeldBodyTo(static_cast<int64_t>(req.body.size()));
    auto once = std::make_shared<std::atomic<bool>>(false);
    Respond respond = [self = this->shared_from_this(), once](Response r) {
      if (once->exchange(true)) return;
      self->Answer(std::move(r));
    };
    // While the answer is pending (a parked long poll, say), a client that hangs up is seen at
    // once and its slot freed, rather than when the answer comes.
    WatchForHangUp();
    // No exception leaves the front end: one escaping here would end the process, every
    // tenant's connections with it.
    try {
      server_->handler(std::move(req), respond);
    } catch (const std::bad_alloc&) {
      // Memory ran out outside every account (the request's own decoding, say): this request
      // fails, retryably, and the server serves on.
      TLOG_WARN("http: memory ran out while handling a request");
      try {
        respond({HttpStatus(absl::StatusCode::kResourceExhausted),
                 "application/json",
                 ErrorBody("the server ran out of memory while handling this request; retry "
                           "shortly"),
                 {{"Retry-After", "1"}}});
      } catch (...) {
        Close();  // no answer could be made either: the client sees the connection end
      }
    } catch (const std::exception& e) {
      TLOG_ERROR("http: a handler threw: {}", e.what());
      respond(
          {500, "application/json", ErrorBody("internal error while handling the request"), {}});
    } catch (...) {
      TLOG_ERROR("http: a handler threw a non-exception");
      respond(
          {500, "application/json", ErrorBody("internal error while handling the request"), {}});
    }
  }

  // The status line and headers every answer carries; the body is the caller's.
  template <typename Body>
  void Head(bhttp::response<Body>& m, Response& r) {
    m.version(version_);
    m.result(static_cast<unsigned>(r.status));
    m.set(bhttp::field::server, "tinkerd");
    m.set(bhttp::field::content_type, r.content_type);
    for (auto& [k, v] : r.headers) m.set(k, v);
    m.keep_alive(keep_alive_ && !server_->stopped.load());
  }

  // Waits for the socket to turn readable while an answer is pending: end of stream or an error
  // means the client hung up, and the connection closes now (its answer, when it comes, is
  // dropped). Bytes of a pipelined next request are left for Read. The wait may also end with
  // nothing to read (asio may complete it speculatively): the peek never blocks, and then the
  // watch starts again.
  void WatchForHangUp() {
    watching_ = true;
    Lowest().socket().async_wait(
        tcp::socket::wait_read, [self = this->shared_from_this()](beast::error_code ec) {
          if (ec == asio::error::operation_aborted || !self->watching_) return;
          if (ec) {
            self->watching_ = false;
            return self->Close();
          }
          char byte;
          const ssize_t n =
              ::recv(self->Lowest().socket().native_handle(), &byte, 1, MSG_PEEK | MSG_DONTWAIT);
          if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
            return self->WatchForHangUp();  // nothing there after all
          }
          self->watching_ = false;
          if (n <= 0) self->Close();  // end of stream, or a reset
        });
  }

  void Write(Response r) {
    ReturnBody();
    if (!Lowest().socket().is_open()) return;  // the client hung up while its answer was pending
    if (watching_) {
      watching_ = false;
      beast::error_code ignored;
      Lowest().socket().cancel(ignored);  // the watch; nothing else is pending while it is
    }
    if (head_) return WriteHead(std::move(r));
    if (r.tar != nullptr) return WriteTar(std::move(r));
    response_ = {};
    Head(response_, r);
    response_.body() = std::move(r.body);
    response_.prepare_payload();
    Lowest().expires_after(absl::ToChronoSeconds(server_->config.idle_timeout));
    bhttp::async_write(stream_, response_,
                       beast::bind_front_handler(&Connection::OnWrite, this->shared_from_this()));
  }

  void WriteTar(Response r) {
    auto& m = tar_response_.emplace();
    Head(m, r);
    m.body() = std::move(r.tar);
    m.prepare_payload();
    // One deadline for the whole transfer: the idle timeout plus a second per 64 KiB, so a
    // large archive is not cut for its size on a slow link, and a reader that stalls is still
    // dropped (the handler caps how many downloads run at once).
    const uint64_t blocks = TarSize(*m.body()) >> 16;
    Lowest().expires_after(absl::ToChronoSeconds(server_->config.idle_timeout) +
                           std::chrono::seconds(blocks));
    bhttp::async_write(stream_, m, [self = this->shared_from_this()](beast::error_code ec, size_t) {
      const bool keep = !ec && self->tar_response_->keep_alive();
      self->tar_response_.reset();
      if (!keep) return self->Close();
      self->Read();
    });
  }

  // A HEAD's answer: the GET's status and headers, Content-Length the GET body's, and no body.
  void WriteHead(Response r) {
    auto& m = head_response_.emplace();
    Head(m, r);
    m.content_length(r.tar != nullptr ? TarSize(*r.tar) : r.body.size());
    Lowest().expires_after(absl::ToChronoSeconds(server_->config.idle_timeout));
    auto sr = std::make_shared<bhttp::response_serializer<bhttp::empty_body>>(m);
    // The serializer is told the body is empty; a Content-Length header that says otherwise is
    // what HEAD means, so the header is written as is.
    bhttp::async_write_header(stream_, *sr,
                              [self = this->shared_from_this(), sr](beast::error_code ec, size_t) {
                                self->head_ = false;
                                const bool keep = !ec && self->head_response_->keep_alive();
                                self->head_response_.reset();
                                if (!keep) return self->Close();
                                self->Read();
                              });
  }

  void OnWrite(beast::error_code ec, size_t) {
    if (ec) return Close();
    if (discard_body_) return Discard();
    if (!response_.keep_alive()) return Close();
    Read();
  }

  // After an answer given before the body was read: read what the client still sends and drop
  // it, a buffer at a time (never held), so that the client reads its answer rather than a reset,
  // then close. Bounded by the body limit and the idle timeout.
  void Discard() {
    Lowest().expires_after(absl::ToChronoSeconds(server_->config.idle_timeout));
    Lowest().socket().shutdown(tcp::socket::shutdown_send, ignored_);
    Lowest().async_read_some(
        asio::buffer(drain_), [self = this->shared_from_this()](beast::error_code ec, size_t n) {
          self->drained_ += n;
          if (ec || self->drained_ > static_cast<uint64_t>(self->server_->config.max_body_bytes)) {
            return self->Close();
          }
          self->Discard();
        });
  }

  // Without TLS's close_notify: every response carries its length, so a cut is detectable. The
  // slot is free from here, though a pending answer may keep this object a while.
  void Close() {
    beast::error_code ignored;
    Lowest().socket().shutdown(tcp::socket::shutdown_send, ignored);
    Lowest().close();
    Uncount();
  }

  void Uncount() {
    ReturnBody();
    if (keyed_) server_->quota->ReturnConnection(key_);
    keyed_ = false;
    if (counted_) server_->connections.fetch_sub(1);
    counted_ = false;
  }

  beast::tcp_stream& Lowest() { return beast::get_lowest_layer(stream_); }

  Stream stream_;
  HttpServer::Impl* server_;
  beast::flat_buffer buffer_;
  std::optional<bhttp::request_parser<bhttp::string_body>> parser_;
  bhttp::response<bhttp::string_body> response_;
  std::optional<bhttp::response<TarBody>> tar_response_;
  std::optional<bhttp::response<bhttp::empty_body>> head_response_;
  int64_t body_limit_ = 0;  // the request's: the JSON one or the general one, or the account's
  const char* body_limit_why_ = "";
  bool keep_alive_ = true;
  bool counted_ = true;        // holds one of the server's connection slots
  bool keyed_ = false;         // counted in the quota for key_
  std::string key_;            // X-API-Key of the latest request
  int64_t body_held_ = 0;      // of the quota, for the request being read or handled
  Reservation body_memory_;    // the same bytes in the memory account, when there is one
  bool watching_ = false;      // WatchForHangUp's wait is pending
  bool head_ = false;          // the request being answered is a HEAD
  bool discard_body_ = false;  // answered before its body was read: drop the body, then close
  std::array<char, 64 << 10> drain_;
  uint64_t drained_ = 0;
  beast::error_code ignored_;
  unsigned version_ = 11;
};

}  // namespace

void HttpServer::Impl::Accept() {
  acceptor.async_accept(asio::make_strand(io), [this](beast::error_code ec, tcp::socket socket) {
    if (ec == asio::error::operation_aborted || stopped.load()) return;
    if (!ec) {
      beast::error_code ignored;
      if (connections.load() >= config.max_connections) {
        socket.close(ignored);  // the client sees a reset and retries later
        return Accept();
      }
      // Small answers (a future's id, try_again) must not wait out Nagle's delay.
      socket.set_option(tcp::no_delay(true), ignored);
      // A connection that cannot be set up (memory ran out) is dropped; accepting goes on.
      try {
        if (tls) {
          using TlsStream = beast::ssl_stream<beast::tcp_stream>;
          std::make_shared<Connection<TlsStream>>(this, std::move(socket), *tls)->Start();
        } else {
          std::make_shared<Connection<beast::tcp_stream>>(this, std::move(socket))->Start();
        }
      } catch (const std::exception& e) {
        TLOG_ERROR("http: a connection could not be set up and was dropped: {}", e.what());
      }
    }
    Accept();
  });
}

HttpServer::HttpServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

absl::StatusOr<std::unique_ptr<HttpServer>> HttpServer::Start(HttpServerConfig config,
                                                              Handler handler, Admit admit) {
  if (config.threads < 1) return absl::InvalidArgumentError("http: threads must be >= 1");
  if (absl::Status st = config.quota.Validate(config.max_body_bytes); !st.ok()) return st;
  auto impl = std::make_unique<Impl>();
  impl->quota.emplace(config.quota);
  impl->config = std::move(config);
  impl->handler = std::move(handler);
  impl->admit = std::move(admit);
  beast::error_code ec;
  if (!impl->config.tls_cert_file.empty()) {
    impl->tls.emplace(asio::ssl::context::tls_server);
    impl->tls->set_options(asio::ssl::context::default_workarounds | asio::ssl::context::no_sslv2 |
                           asio::ssl::context::no_sslv3 | asio::ssl::context::no_tlsv1 |
                           asio::ssl::context::no_tlsv1_1);
    impl->tls->use_certificate_chain_file(impl->config.tls_cert_file, ec);
    if (!ec)
      impl->tls->use_private_key_file(impl->config.tls_key_file, asio::ssl::context::pem, ec);
    if (!ec && !impl->config.tls_client_ca_file.empty()) {
      impl->tls->load_verify_file(impl->config.tls_client_ca_file, ec);
      impl->tls->set_verify_mode(asio::ssl::verify_peer | asio::ssl::verify_fail_if_no_peer_cert);
    }
    if (ec) {
      return absl::InvalidArgumentError(
          absl::StrCat("http: cannot use the TLS certificate, key or client CA: ", ec.message()));
    }
  }
  const auto address = asio::ip::make_address(impl->config.host, ec);
  if (ec) {
    return absl::InvalidArgumentError(
        absl::StrCat("http: '", impl->config.host, "' is not an IP address"));
  }
  const tcp::endpoint endpoint(address, static_cast<uint16_t>(impl->config.port));
  impl->acceptor.open(endpoint.protocol(), ec);
  if (!ec) impl->acceptor.set_option(asio::socket_base::reuse_address(true), ec);
  if (!ec) impl->acceptor.bind(endpoint, ec);
  if (!ec) impl->acceptor.listen(asio::socket_base::max_listen_connections, ec);
  if (ec) {
    return absl::UnavailableError(absl::StrCat("http: cannot listen on ", impl->config.host, ":",
                                               impl->config.port, ": ", ec.message()));
  }
  impl->port = impl->acceptor.local_endpoint().port();
  impl->work.emplace(impl->io.get_executor());
  impl->Accept();
  for (int i = 0; i < impl->config.threads; ++i) {
    impl->threads.emplace_back([io = &impl->io] {
      // An exception out of a completion handler (an allocation failing while a body is read,
      // say) unwinds out of run(): the connection it belonged to is dropped with its handler, and
      // the thread serves on. Left alone, it would end the process and every tenant's work.
      for (;;) {
        try {
          io->run();
          return;
        } catch (const std::exception& e) {
          TLOG_ERROR("http: a connection failed and was dropped: {}", e.what());
        } catch (...) {
          TLOG_ERROR("http: a connection failed and was dropped");
        }
      }
    });
  }
  return std::unique_ptr<HttpServer>(new HttpServer(std::move(impl)));
}

int HttpServer::port() const {
  return impl_->port;
}

int HttpServer::connections() const {
  return impl_->connections.load();
}

void HttpServer::After(absl::Duration delay, std::function<void()> fn) {
  if (impl_->stopped.load()) return;
  auto timer = std::make_shared<asio::steady_timer>(impl_->io, absl::ToChronoNanoseconds(delay));
  timer->async_wait([timer, fn = std::move(fn)](beast::error_code ec) {
    if (!ec) fn();
  });
}

void HttpServer::Stop() {
  if (impl_->stopped.exchange(true)) return;
  asio::post(impl_->io, [impl = impl_.get()] {
    beast::error_code ignored;
    impl->acceptor.close(ignored);
  });
  impl_->work.reset();
  impl_->io.stop();
  for (auto& t : impl_->threads) t.join();
  impl_->threads.clear();
}

HttpServer::~HttpServer() {
  Stop();
}

}  // namespace tinkerd::http
