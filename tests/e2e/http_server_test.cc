// server/http/http_server.h on loopback with a handler of the test's own: an exception out of a
// handler is answered 500 and the server serves on (once, an unchecked JSON type in asample took
// the whole process down); a handler that answered before throwing keeps its answer.
#include "server/http/http_server.h"

#include <gtest/gtest.h>
#include <httplib.h>

#include <stdexcept>

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

}  // namespace
}  // namespace tinkerd::testing
