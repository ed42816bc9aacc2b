// server/http/http_server.h on loopback with a handler of the test's own: an exception out of a
// handler is answered 500 and the server serves on (once, an unchecked JSON type in asample took
// the whole process down); a handler that answered before throwing keeps its answer; limits,
// refusals from the headers alone, transfer codings, HEAD and hang-ups while an answer is pending
// (issue 36, items 1, 5, 6, 7), and the edge's quota per API key and server-wide.
#include "server/http/http_server.h"

#include <gtest/gtest.h>
#include <httplib.h>

#include <atomic>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "runner/util/memory_account.h"
#include "tests/e2e/e2e_util.h"
#include "tests/e2e/raw_http_client.h"

namespace tinkerd::testing {
namespace {

using http::HttpServer;
using http::Request;
using http::Respond;
using http::Response;

TEST(HttpServer, AHandlerThatThrowsIsAnswered500AndTheServerServesOn) {
  auto server = HttpServer::Start({}, [](Request req, Respond respond) {
    if (req.path == "/throw") throw std::runtime_error("boom");
    if (req.path == "/answer-then-throw") {
      respond({201, "text/plain", "answered", {}});
      throw std::logic_error("late");
    }
    respond({200, "text/plain", "ok", {}});
  });
  ASSERT_TRUE(server.ok()) << server.status();
  httplib::Client cli("127.0.0.1", (*server)->port());
  for (int i = 0; i < 3; ++i) {
    auto thrown = cli.Get("/throw");
    ASSERT_TRUE(thrown) << "no answer: the server went down";
    EXPECT_EQ(thrown->status, 500);
    EXPECT_NE(thrown->body.find("internal error"), std::string::npos) << thrown->body;
    EXPECT_EQ(thrown->body.find("boom"), std::string::npos) << "internals stay in the log";
  }
  auto answered = cli.Get("/answer-then-throw");
  ASSERT_TRUE(answered);
  EXPECT_EQ(answered->status, 201);
  EXPECT_EQ(answered->body, "answered");
  auto ok = cli.Get("/fine");
  ASSERT_TRUE(ok);
  EXPECT_EQ(ok->status, 200);
}

TEST(HttpServer, OversizedBodiesAndHeadersAreRefusedWithABodyAndNeverReachTheHandler) {
  std::atomic<int> handled{0};
  http::HttpServerConfig config;
  config.max_body_bytes = 4096;
  config.max_json_body_bytes = 1000;
  auto server = HttpServer::Start(config, [&](Request req, Respond respond) {
    ++handled;
    respond({200, "text/plain", "path=" + req.path + " query=" + req.query, {}});
  });
  ASSERT_TRUE(server.ok()) << server.status();
  httplib::Client cli("127.0.0.1", (*server)->port());

  auto big = cli.Post("/api/v1/x", std::string(4097, 'a'), "application/json");
  ASSERT_TRUE(big);
  EXPECT_EQ(big->status, 413);
  EXPECT_NE(big->body.find("body: larger than the server's limit of 4096 bytes"), std::string::npos)
      << big->body;
  // A JSON body has the smaller limit (its DOM is several times its size); protobuf does not.
  auto json = cli.Post("/api/v1/x", "[" + std::string(1000, ' ') + "]", "application/json");
  ASSERT_TRUE(json);
  EXPECT_EQ(json->status, 413);
  EXPECT_NE(json->body.find("limit of 1000 bytes for a JSON body"), std::string::npos)
      << json->body;
  auto headers = cli.Get("/api/v1/x", {{"X-Padding", std::string(20 << 10, 'h')}});
  ASSERT_TRUE(headers);
  EXPECT_EQ(headers->status, 431);
  EXPECT_NE(headers->body.find("headers:"), std::string::npos) << headers->body;
  EXPECT_EQ(handled.load(), 0);

  // Controls: at the limit, and headers under 16 KiB, reach the handler; the query is kept apart.
  auto fits =
      cli.Post("/api/v1/x?limit=2&offset=4", std::string(4096, 'a'), "application/x-protobuf");
  ASSERT_TRUE(fits);
  EXPECT_EQ(fits->status, 200);
  EXPECT_EQ(fits->body, "path=/api/v1/x query=limit=2&offset=4");
  auto small = cli.Get("/api/v1/x", {{"X-Padding", std::string(8 << 10, 'h')}});
  ASSERT_TRUE(small);
  EXPECT_EQ(small->status, 200);
  EXPECT_EQ(handled.load(), 2);
}

// A request whose key is refused is answered from its headers: here a 50 MiB body is announced and
// not one byte of it sent, and the 401 still comes (before, the server waited for the whole body,
// buffering it, and only then looked at the key). The connection then drops what the client sends
// and closes. The control: an admitted request's body is read and reaches the handler.
TEST(HttpServer, ARequestRefusedByItsHeadersIsAnsweredBeforeItsBodyIsRead) {
  std::atomic<int> handled{0};
  auto server = HttpServer::Start(
      {},
      [&](Request req, Respond respond) {
        ++handled;
        respond({200, "text/plain", "got " + req.body, {}});
      },
      [](const Request& head) -> std::optional<Response> {
        if (head.api_key == "good") return std::nullopt;
        return Response{401, "application/json", R"({"detail":"X-API-Key: missing"})", {}};
      });
  ASSERT_TRUE(server.ok()) << server.status();
  RawClient refused((*server)->port());
  ASSERT_TRUE(refused.connected());
  ASSERT_TRUE(
      refused.Send("POST /api/v1/x HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                   "Content-Length: 52428800\r\n\r\n"));
  std::optional<RawClient::Answer> a = refused.Read();
  ASSERT_TRUE(a.has_value()) << "no answer before the body: the server waits for it";
  EXPECT_EQ(a->status, 401);
  EXPECT_EQ(a->headers["connection"], "close");
  EXPECT_EQ(a->body, R"({"detail":"X-API-Key: missing"})");
  ASSERT_TRUE(refused.Send(std::string(1 << 20, 'x')));  // dropped, not an error for the client
  EXPECT_TRUE(refused.ClosedByServer());
  EXPECT_EQ(handled.load(), 0);

  RawClient admitted((*server)->port());
  ASSERT_TRUE(
      admitted.Send("POST /api/v1/x HTTP/1.1\r\nHost: t\r\nX-API-Key: good\r\n"
                    "Content-Length: 5\r\n\r\nhello"));
  std::optional<RawClient::Answer> b = admitted.Read();
  ASSERT_TRUE(b.has_value());
  EXPECT_EQ(b->status, 200);
  EXPECT_EQ(b->body, "got hello");
  EXPECT_EQ(handled.load(), 1);
}

// RFC 9112 §6.1: a transfer coding the server does not know is 501, never ignored (the body
// would be read as chunked data while it is gzip). A lone chunked is read as usual.
TEST(HttpServer, TransferCodingsOtherThanALoneChunkedAre501) {
  std::atomic<int> handled{0};
  auto server = HttpServer::Start({}, [&](Request req, Respond respond) {
    ++handled;
    respond({200, "text/plain", req.body, {}});
  });
  ASSERT_TRUE(server.ok()) << server.status();
  for (const char* coding : {"gzip, chunked", "chunked, chunked", "deflate"}) {
    RawClient c((*server)->port());
    ASSERT_TRUE(c.Send(absl::StrCat("POST /x HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: ", coding,
                                    "\r\n\r\n5\r\nhello\r\n0\r\n\r\n")));
    std::optional<RawClient::Answer> a = c.Read();
    ASSERT_TRUE(a.has_value()) << coding;
    EXPECT_EQ(a->status, 501) << coding;
    EXPECT_NE(a->body.find("Transfer-Encoding"), std::string::npos) << a->body;
  }
  EXPECT_EQ(handled.load(), 0);
  RawClient c((*server)->port());
  ASSERT_TRUE(
      c.Send("POST /x HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: Chunked\r\n\r\n"
             "5\r\nhello\r\n0\r\n\r\n"));
  std::optional<RawClient::Answer> a = c.Read();
  ASSERT_TRUE(a.has_value());
  EXPECT_EQ(a->status, 200);
  EXPECT_EQ(a->body, "hello");
}

// HEAD is answered as its GET without the body, so that a keep-alive client's next answer starts
// where it should (before, the GET body followed the HEAD's headers and was read as the next
// status line).
TEST(HttpServer, HeadIsAnsweredWithoutABodyAndTheConnectionServesOn) {
  auto server = HttpServer::Start({}, [](Request req, Respond respond) {
    respond({200, "application/json", "{\"method\":\"" + req.method + "\"}", {}});
  });
  ASSERT_TRUE(server.ok()) << server.status();
  RawClient c((*server)->port());
  ASSERT_TRUE(c.Send("HEAD /x HTTP/1.1\r\nHost: t\r\n\r\nGET /x HTTP/1.1\r\nHost: t\r\n\r\n"));
  std::optional<RawClient::Answer> head = c.Read(/*head=*/true);
  ASSERT_TRUE(head.has_value());
  EXPECT_EQ(head->status, 200);
  const std::string get_body = R"({"method":"GET"})";
  EXPECT_EQ(head->headers["content-length"], std::to_string(get_body.size()));
  std::optional<RawClient::Answer> get = c.Read();
  ASSERT_TRUE(get.has_value()) << "the HEAD's answer carried a body";
  EXPECT_EQ(get->status, 200);
  EXPECT_EQ(get->body, get_body);
}

// Issue 36, item 5: a client that hangs up while its answer is pending (a parked long poll) frees
// its connection slot at once, not when the answer comes: with two slots, two parked clients that
// hung up leave room for a third, which is served; the parked answers, given later, go nowhere.
// Requests the handler keeps unanswered (parked) until the test answers them.
struct Parked {
  absl::Mutex mu;
  std::vector<Respond> responds ABSL_GUARDED_BY(mu);
  size_t want ABSL_GUARDED_BY(mu) = 0;
  bool Enough() const ABSL_SHARED_LOCKS_REQUIRED(mu) { return responds.size() >= want; }

  void Add(Respond respond) {
    absl::MutexLock lock(&mu);
    responds.push_back(std::move(respond));
  }
  void AwaitCount(size_t n) {
    absl::MutexLock lock(&mu);
    want = n;
    mu.Await(absl::Condition(this, &Parked::Enough));
  }
  // Answers every parked request with `r` and forgets them. A Respond must not outlive its server
  // (http_server.h): each test clears its parked requests before its server goes, however it ends.
  void AnswerAll(const Response& r) {
    absl::MutexLock lock(&mu);
    for (Respond& respond : responds) respond(r);
    responds.clear();
  }
};

TEST(HttpServer, AClientThatHangsUpWhileItsAnswerIsPendingFreesItsSlot) {
  Parked parked;
  http::HttpServerConfig config;
  config.max_connections = 2;
  auto server = HttpServer::Start(config, [&](Request req, Respond respond) {
    if (req.path == "/park") return parked.Add(std::move(respond));
    respond({200, "text/plain", "now", {}});
  });
  ASSERT_TRUE(server.ok()) << server.status();
  absl::Cleanup release = [&] { parked.AnswerAll({200, "text/plain", "late", {}}); };
  for (size_t i = 1; i <= 2; ++i) {
    RawClient c((*server)->port());
    ASSERT_TRUE(c.Send("GET /park HTTP/1.1\r\nHost: t\r\n\r\n"));
    parked.AwaitCount(i);
  }  // each client hangs up here, its answer still pending
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  while ((*server)->connections() > 0 && absl::Now() < deadline) std::this_thread::yield();
  EXPECT_EQ((*server)->connections(), 0) << "a hung-up client still holds its slot";
  RawClient third((*server)->port());
  ASSERT_TRUE(third.Send("GET /now HTTP/1.1\r\nHost: t\r\n\r\n"));
  const std::optional<RawClient::Answer> a = third.Read();
  ASSERT_TRUE(a.has_value()) << "the third client was turned away";
  EXPECT_EQ(a->body, "now");
}

std::string Post(const std::string& path, const std::string& key, size_t announced, size_t sent) {
  return absl::StrCat("POST ", path, " HTTP/1.1\r\nHost: t\r\nX-API-Key: ", key,
                      "\r\nContent-Type: application/octet-stream\r\nContent-Length: ", announced,
                      "\r\n\r\n", std::string(sent, 'x'));
}

// Issue 36: bodies in flight (parked here, unanswered) cannot pass one key's bound, nor every
// key's the server's. The request past a bound is answered 429 with Retry-After from its headers
// alone (its body is announced and never sent), naming the flag, and never reaches the handler;
// once the parked requests are answered, their bytes count no more.
TEST(HttpServer, BodiesInFlightAreBoundedPerKeyAndServerWideUntilAnswered) {
  Parked parked;
  std::atomic<int> handled{0};
  http::HttpServerConfig config;
  config.max_body_bytes = 1000;
  config.quota.body_bytes = 2500;
  config.quota.body_bytes_per_key = 2000;
  auto server = HttpServer::Start(config, [&](Request req, Respond respond) {
    ++handled;
    if (req.path == "/park") return parked.Add(std::move(respond));
    respond({200, "text/plain", absl::StrCat("got ", req.body.size()), {}});
  });
  ASSERT_TRUE(server.ok()) << server.status();
  absl::Cleanup release = [&] { parked.AnswerAll({200, "text/plain", "late", {}}); };
  const int port = (*server)->port();
  RawClient a1(port), a2(port), b1(port);
  ASSERT_TRUE(a1.Send(Post("/park", "a", 1000, 1000)));
  ASSERT_TRUE(a2.Send(Post("/park", "a", 1000, 1000)));
  parked.AwaitCount(2);

  RawClient a3(port);
  ASSERT_TRUE(a3.Send(Post("/park", "a", 1, 0)));
  std::optional<RawClient::Answer> over_key = a3.Read();
  ASSERT_TRUE(over_key.has_value()) << "no answer before the body: the server waits for it";
  EXPECT_EQ(over_key->status, 429);
  EXPECT_EQ(over_key->headers["retry-after"], "1");
  EXPECT_NE(over_key->body.find("--http_body_mb_in_flight_per_key"), std::string::npos)
      << over_key->body;

  ASSERT_TRUE(b1.Send(Post("/park", "b", 500, 500)));
  parked.AwaitCount(3);
  RawClient c1(port);
  ASSERT_TRUE(c1.Send(Post("/now", "c", 1, 0)));
  std::optional<RawClient::Answer> over_server = c1.Read();
  ASSERT_TRUE(over_server.has_value());
  EXPECT_EQ(over_server->status, 429);
  EXPECT_NE(over_server->body.find("(--http_body_mb_in_flight)"), std::string::npos)
      << over_server->body;
  EXPECT_EQ(handled.load(), 3) << "a refused request reached the handler";

  parked.AnswerAll({200, "text/plain", "done", {}});
  for (RawClient* c : {&a1, &a2, &b1}) {
    std::optional<RawClient::Answer> done = c->Read();
    ASSERT_TRUE(done.has_value());
    EXPECT_EQ(done->body, "done");
  }
  // Control: the same key and size as the refused one, now that nothing is in flight.
  RawClient c2(port);
  ASSERT_TRUE(c2.Send(Post("/now", "a", 1000, 1000)));
  std::optional<RawClient::Answer> fits = c2.Read();
  ASSERT_TRUE(fits.has_value());
  EXPECT_EQ(fits->status, 200);
  EXPECT_EQ(fits->body, "got 1000");
}

// A chunked body holds the limit it may grow to while it is read (its length is unknown), and
// only its own size once read: here, parked with a 1,000-byte chunked body, the server holds
// 1,000 bytes of the memory account where it held the 512 KiB limit, and the account's rest is
// there for the next request's body. The control: a body announced by its length holds the same.
TEST(HttpServer, AChunkedBodyHoldsItsOwnSizeOnceRead) {
  Parked parked;
  http::HttpServerConfig config;
  config.max_body_bytes = 512 << 10;
  config.account = MemoryAccount::Create(1 << 20, "the test's account");
  auto server = HttpServer::Start(config, [&](Request req, Respond respond) {
    if (req.body.size() != 1000) return respond({400, "text/plain", "wrong body", {}});
    parked.Add(std::move(respond));
  });
  ASSERT_TRUE(server.ok()) << server.status();
  absl::Cleanup release = [&] { parked.AnswerAll({200, "text/plain", "done", {}}); };
  const int port = (*server)->port();
  RawClient chunked(port), sized(port);
  ASSERT_TRUE(chunked.Send(
      absl::StrCat("POST /park HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n3e8\r\n",
                   std::string(1000, 'x'), "\r\n0\r\n\r\n")));
  parked.AwaitCount(1);
  EXPECT_EQ(config.account->reserved(), 1000);
  ASSERT_TRUE(sized.Send(Post("/park", "k", 1000, 1000)));
  parked.AwaitCount(2);
  EXPECT_EQ(config.account->reserved(), 2000);
  parked.AnswerAll({200, "text/plain", "done", {}});
  for (RawClient* c : {&chunked, &sized}) {
    std::optional<RawClient::Answer> done = c->Read();
    ASSERT_TRUE(done.has_value());
    EXPECT_EQ(done->body, "done");
  }
  WaitFor([&] { return config.account->reserved() == 0; }, "the bodies' memory given back");
}

// Issue 36: one key cannot hold more connections than its bound (each could park a long poll and
// hold a slot of the server's): the next is answered 429 and closed, while another key is served;
// a connection closed gives its place back.
TEST(HttpServer, OneKeyCannotHoldMoreConnectionsThanItsBound) {
  Parked parked;
  http::HttpServerConfig config;
  config.quota.connections_per_key = 2;
  auto server = HttpServer::Start(config, [&](Request req, Respond respond) {
    if (req.path == "/park") return parked.Add(std::move(respond));
    respond({200, "text/plain", "now", {}});
  });
  ASSERT_TRUE(server.ok()) << server.status();
  absl::Cleanup release = [&] { parked.AnswerAll({200, "text/plain", "late", {}}); };
  const int port = (*server)->port();
  auto get = [](const std::string& path, const std::string& key) {
    return absl::StrCat("GET ", path, " HTTP/1.1\r\nHost: t\r\nX-API-Key: ", key, "\r\n\r\n");
  };
  {
    RawClient a1(port), a2(port);
    ASSERT_TRUE(a1.Send(get("/park", "a")));
    ASSERT_TRUE(a2.Send(get("/park", "a")));
    parked.AwaitCount(2);
    RawClient a3(port);
    ASSERT_TRUE(a3.Send(get("/now", "a")));
    std::optional<RawClient::Answer> over = a3.Read();
    ASSERT_TRUE(over.has_value());
    EXPECT_EQ(over->status, 429);
    EXPECT_EQ(over->headers["connection"], "close");
    EXPECT_NE(over->body.find("--http_connections_per_key"), std::string::npos) << over->body;
    EXPECT_TRUE(a3.ClosedByServer());

    RawClient b(port);
    ASSERT_TRUE(b.Send(get("/now", "b")));
    std::optional<RawClient::Answer> other = b.Read();
    ASSERT_TRUE(other.has_value());
    EXPECT_EQ(other->status, 200) << "another key was refused";
  }  // every client hangs up
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  while ((*server)->connections() > 0 && absl::Now() < deadline) std::this_thread::yield();
  ASSERT_EQ((*server)->connections(), 0);
  RawClient again(port);
  ASSERT_TRUE(again.Send(get("/now", "a")));
  std::optional<RawClient::Answer> a = again.Read();
  ASSERT_TRUE(a.has_value());
  EXPECT_EQ(a->status, 200) << "a closed connection did not give its place back";
}

}  // namespace
}  // namespace tinkerd::testing
