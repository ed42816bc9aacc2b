// server/http/edge_quota.h: body bytes and connections per API key and server-wide, each refusal
// naming its bound and taking nothing, and everything given back.
#include "server/http/edge_quota.h"

#include <gtest/gtest.h>

#include <string>

namespace tinkerd::http {
namespace {

EdgeQuotaConfig Small() {
  EdgeQuotaConfig c;
  c.body_bytes = 300;
  c.body_bytes_per_key = 200;
  c.connections_per_key = 2;
  return c;
}

TEST(EdgeQuota, BodiesAreBoundedPerKeyAndServerWideAndARefusalTakesNothing) {
  EdgeQuota q(Small());
  ASSERT_TRUE(q.TakeBody("a", 150).ok());
  const absl::Status per_key = q.TakeBody("a", 51);
  EXPECT_EQ(per_key.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(per_key.message().find("--http_body_mb_in_flight_per_key"), std::string::npos)
      << per_key;
  EXPECT_TRUE(q.TakeBody("a", 50).ok()) << "exactly at the key's bound fits";
  ASSERT_TRUE(q.TakeBody("b", 100).ok());
  const absl::Status server = q.TakeBody("c", 1);
  EXPECT_EQ(server.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(server.message().find("(--http_body_mb_in_flight)"), std::string::npos) << server;
  EXPECT_EQ(q.body_bytes(), 300) << "the refusals took nothing";
  q.ReturnBody("a", 150);
  EXPECT_TRUE(q.TakeBody("c", 150).ok());
  q.ReturnBody("a", 50);
  q.ReturnBody("b", 100);
  q.ReturnBody("c", 150);
  EXPECT_EQ(q.body_bytes(), 0);
}

TEST(EdgeQuota, ConnectionsAreBoundedPerKeyAndReturned) {
  EdgeQuota q(Small());
  ASSERT_TRUE(q.TakeConnection("a").ok());
  ASSERT_TRUE(q.TakeConnection("a").ok());
  const absl::Status third = q.TakeConnection("a");
  EXPECT_EQ(third.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(third.message().find("--http_connections_per_key"), std::string::npos) << third;
  EXPECT_EQ(q.connections("a"), 2);
  EXPECT_TRUE(q.TakeConnection("b").ok()) << "another key has its own bound";
  q.ReturnConnection("a");
  EXPECT_TRUE(q.TakeConnection("a").ok());
  q.ReturnConnection("a");
  q.ReturnConnection("a");
  q.ReturnConnection("b");
  EXPECT_EQ(q.connections("a"), 0);
  EXPECT_EQ(q.connections("b"), 0);
}

TEST(EdgeQuotaConfig, RefusesBoundsThatCouldNeverAdmitTheLargestBody) {
  EdgeQuotaConfig c = Small();
  EXPECT_TRUE(c.Validate(200).ok());
  EXPECT_FALSE(c.Validate(201).ok()) << "a 201-byte body could never be admitted";
  c.body_bytes = 199;
  EXPECT_FALSE(c.Validate(100).ok()) << "per key above the server's bound";
  c = Small();
  c.connections_per_key = 0;
  EXPECT_FALSE(c.Validate(100).ok());
}

}  // namespace
}  // namespace tinkerd::http
