// server/http/http_server.h on loopback with a handler of the test's own: an exception out of a
// handler is answered 500 and the server serves on (once, an unchecked JSON type in asample took
// the whole process down); a handler that answered before throwing keeps its answer.
#include "server/http/http_server.h"

#include <gtest/gtest.h>
#include <httplib.h>

#include <atomic>
#include <stdexcept>
#include <string>

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
  auto headers = cli.Get("/api/v1/x", {{"X-Padding", std::string(20 << 10, 'h')}});
  ASSERT_TRUE(headers);
  EXPECT_EQ(headers->status, 431);
  EXPECT_NE(headers->body.find("headers:"), std::string::npos) << headers->body;
  EXPECT_EQ(handled.load(), 0);

  // Controls: at the limit, and headers under 16 KiB, reach the handler; the query is kept apart.
  auto fits = cli.Post("/api/v1/x?limit=2&offset=4", std::string(4096, 'a'), "application/json");
  ASSERT_TRUE(fits);
  EXPECT_EQ(fits->status, 200);
  EXPECT_EQ(fits->body, "path=/api/v1/x query=limit=2&offset=4");
  auto small = cli.Get("/api/v1/x", {{"X-Padding", std::string(8 << 10, 'h')}});
  ASSERT_TRUE(small);
  EXPECT_EQ(small->status, 200);
  EXPECT_EQ(handled.load(), 2);
}

}  // namespace
}  // namespace tinkerd::testing
