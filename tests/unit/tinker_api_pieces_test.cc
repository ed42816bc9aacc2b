// The Tinker API's small tables, each on its own: the router's routes and metric labels (never a
// client's text), sessions ended for want of heartbeats (410, not 404), aliases and sampling
// sessions forgotten with their session only, and archive URLs capped per tenant.
#include <gtest/gtest.h>

#include <atomic>
#include <map>
#include <optional>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/synchronization/notification.h"
#include "server/http/aliases.h"
#include "server/http/archive_grants.h"
#include "server/http/copies.h"
#include "server/http/router.h"
#include "server/http/sample_cancels.h"
#include "server/http/sampling_sessions.h"
#include "server/http/sessions.h"

namespace tinkerd::http {
namespace {

TEST(Router, NamesEachRouteAndLabelsItWithoutTheClientsText) {
  int called = 0;
  const Router router(
      {{"create_model", [&](const std::string&, const nlohmann::json&, Respond) { ++called; }},
       {"sessions/search", [](const std::string&, const nlohmann::json&, Respond) {}}});
  struct Case {
    std::string path;
    Router::Kind kind;
    std::string endpoint, label;
  };
  const std::vector<Case> cases = {
      {"/api/v1/create_model", Router::Kind::kJson, "create_model", "create_model"},
      {"/prefix/api/v1/create_model", Router::Kind::kJson, "create_model", "create_model"},
      {"/api/v1/forward_backward", Router::Kind::kForwardBackward, "forward_backward",
       "forward_backward"},
      {"/api/v1/healthz", Router::Kind::kHealthz, "healthz", "healthz"},
      {"/api/v1/archives/abc", Router::Kind::kArchive, "archives/abc", "archives"},
      {"/api/v1/training_runs", Router::Kind::kTrainingRuns, "training_runs", "training_runs"},
      {"/api/v1/training_runs/m-1", Router::Kind::kTrainingRuns, "training_runs/m-1",
       "training_runs/run"},
      {"/api/v1/training_runs/m-1/checkpoints", Router::Kind::kTrainingRuns,
       "training_runs/m-1/checkpoints", "training_runs/checkpoints"},
      {"/api/v1/sessions", Router::Kind::kSessions, "sessions", "sessions"},
      {"/api/v1/sessions/s-1", Router::Kind::kSessions, "sessions/s-1", "sessions/session"},
      {"/api/v1/sessions/search", Router::Kind::kJson, "sessions/search", "sessions/search"},
      {"/api/v1/sessions/s-1/finish", Router::Kind::kFinishSession, "sessions/s-1/finish",
       "sessions/finish"},
      {"/api/v1/checkpoints", Router::Kind::kCheckpoints, "checkpoints", "checkpoints"},
      {"/api/v1/copy_weights", Router::Kind::kCopyWeights, "copy_weights", "copy_weights"},
      {"/api/v1/get_server_capabilities", Router::Kind::kCapabilities, "get_server_capabilities",
       "get_server_capabilities"},
      {"/api/v1/samplers/x", Router::Kind::kSampler, "samplers/x", "samplers"},
      {"/api/v1/no_such_thing", Router::Kind::kUnknown, "no_such_thing", "unknown"},
      {"/elsewhere", Router::Kind::kUnknown, "", "unknown"},
  };
  for (const Case& c : cases) {
    const Router::Route r = router.Find(c.path);
    EXPECT_EQ(r.kind, c.kind) << c.path;
    EXPECT_EQ(r.endpoint, c.endpoint) << c.path;
    EXPECT_EQ(r.label, c.label) << c.path;
    EXPECT_EQ(r.handler != nullptr, c.kind == Router::Kind::kJson) << c.path;
  }
  (*router.Find("/api/v1/create_model").handler)("t", nlohmann::json::object(), nullptr);
  EXPECT_EQ(called, 1);
}

std::optional<std::string> Open(Sessions& sessions, const std::string& tenant,
                                std::optional<std::string> name = std::nullopt,
                                std::map<std::string, std::string> metadata = {},
                                const std::string& project = "default") {
  SessionSummary s;
  s.tenant = tenant;
  s.display_name = std::move(name);
  s.user_metadata = std::move(metadata);
  s.project_id = project;
  return sessions.Create(std::move(s));
}

TEST(Sessions, AnEndedSessionIs410AnUnknownOne404AndAnotherTenantsUnknown) {
  Sessions sessions(/*max_sessions=*/2, absl::Seconds(5));
  const auto a = Open(sessions, "alice");
  const auto b = Open(sessions, "alice");
  ASSERT_TRUE(a && b);
  EXPECT_FALSE(Open(sessions, "bob")) << "past max_sessions";
  Response missing;
  EXPECT_TRUE(sessions.Heartbeat("alice", *a, &missing));
  EXPECT_FALSE(sessions.Heartbeat("bob", *a, &missing));
  EXPECT_EQ(missing.status, 404);
  EXPECT_TRUE(sessions.Check("alice", *a).ok());
  EXPECT_TRUE(absl::IsNotFound(sessions.Check("bob", *a)));
  sessions.AddModel(*a, "model-1");

  const std::vector<Sessions::Ended> ended = sessions.EndIdle(absl::InfiniteFuture());
  ASSERT_EQ(ended.size(), 2u);
  EXPECT_FALSE(sessions.IsOpen(*a));
  for (const Sessions::Ended& e : ended) {
    EXPECT_EQ(e.tenant, "alice");
    EXPECT_EQ(e.models,
              e.id == *a ? std::vector<std::string>{"model-1"} : std::vector<std::string>{});
  }
  EXPECT_FALSE(sessions.Heartbeat("alice", *a, &missing));
  EXPECT_EQ(missing.status, 410);
  EXPECT_FALSE(sessions.Heartbeat("bob", *a, &missing));
  EXPECT_EQ(missing.status, 404) << "another tenant's ended session is unknown to bob";
  EXPECT_FALSE(sessions.Get("alice", "session-none", &missing));
  EXPECT_EQ(missing.status, 404);
  EXPECT_TRUE(Open(sessions, "bob")) << "an ended session no longer counts";
}

// The SDK's close(): "further operations against it will be rejected", and its heartbeat loop
// stops on a 410. Before, a finished session went on taking models until it was reaped.
TEST(Sessions, AFinishedSessionTakesNoFurtherOperationsAndItsHeartbeatIs410) {
  Sessions sessions(/*max_sessions=*/4, absl::Seconds(5));
  const auto done = Open(sessions, "alice");
  const auto other = Open(sessions, "alice");
  ASSERT_TRUE(done && other);
  sessions.AddModel(*done, "model-done");
  sessions.AddModel(*other, "model-other");
  ASSERT_TRUE(sessions.Finish("alice", *done, "success", ""));
  EXPECT_TRUE(absl::IsFailedPrecondition(sessions.CheckModel("model-done")));
  EXPECT_TRUE(sessions.CheckModel("model-other").ok());
  EXPECT_TRUE(sessions.CheckModel("model-of-no-session").ok());
  const absl::Status refused = sessions.Check("alice", *done);
  EXPECT_TRUE(absl::IsFailedPrecondition(refused)) << refused;
  EXPECT_NE(refused.message().find("finished by its client (success)"), std::string::npos)
      << refused;
  Response missing;
  EXPECT_FALSE(sessions.Heartbeat("alice", *done, &missing));
  EXPECT_EQ(missing.status, 410);
  // Controls: the tenant's other session goes on, and the finished one is still shown.
  EXPECT_TRUE(sessions.Check("alice", *other).ok());
  EXPECT_TRUE(sessions.Heartbeat("alice", *other, &missing));
  const std::optional<SessionSummary> shown = sessions.Get("alice", *done, &missing);
  ASSERT_TRUE(shown.has_value());
  EXPECT_EQ(shown->status.type, "client_finished");
}

std::vector<std::string> Names(const std::vector<SessionSummary>& found) {
  std::vector<std::string> out;
  for (const SessionSummary& s : found) out.push_back(s.display_name.value_or("-"));
  return out;
}

TEST(Sessions, SearchFiltersPagesNewestFirstAndKeepsEndedSessions) {
  Sessions sessions(/*max_sessions=*/8, absl::Seconds(5));
  const auto rl = Open(sessions, "alice", "RL Math run", {{"team", "a"}}, "p1");
  const auto chat = Open(sessions, "alice", "SFT chat", {{"team", "b"}});
  const auto plain = Open(sessions, "alice");
  ASSERT_TRUE(Open(sessions, "bob", "RL math", {{"team", "a"}}, "p1"));
  ASSERT_TRUE(rl && chat && plain);
  bool more = false;
  auto find = [&](SessionQuery q) { return Names(sessions.Search("alice", q, &more)); };
  SessionQuery q;
  q.display_words = std::vector<std::string>{"math", "rl"};
  EXPECT_EQ(find(q), std::vector<std::string>{"RL Math run"});
  q.session_id = *plain;  // with a name: either matches
  q.display_words = std::vector<std::string>{"chat"};
  EXPECT_EQ(find(q).size(), 2u);
  q = {};
  q.user_metadata = {{"team", "a"}};
  EXPECT_EQ(find(q), std::vector<std::string>{"RL Math run"}) << "bob's session stays his";
  q = {};
  q.project_ids = std::vector<std::string>{"p1"};
  EXPECT_EQ(find(q), std::vector<std::string>{"RL Math run"});

  ASSERT_TRUE(sessions.Finish("alice", *chat, "errored", "boom"));
  ASSERT_TRUE(sessions.Finish("alice", *chat, "success", ""));  // first-wins
  EXPECT_FALSE(sessions.Finish("bob", *chat, "success", ""));
  q = {};
  q.statuses = std::vector<SessionQuery::Status>{{"client_finished", {{"errored"}}}};
  EXPECT_EQ(find(q), std::vector<std::string>{"SFT chat"});
  q.statuses = std::vector<SessionQuery::Status>{{"client_finished", {{"success"}}}};
  EXPECT_TRUE(find(q).empty()) << "the second finish replaced the first";

  // Pages of one, each after the last: every session once, newest first.
  q = {};
  q.limit = 1;
  std::vector<SessionSummary> all;
  for (int page = 0; page < 5; ++page) {
    const std::vector<SessionSummary> found = sessions.Search("alice", q, &more);
    all.insert(all.end(), found.begin(), found.end());
    if (!more) break;
    q.after = std::make_pair(found.back().created, found.back().id);
  }
  ASSERT_EQ(all.size(), 3u);
  EXPECT_FALSE(more);
  for (size_t i = 1; i < all.size(); ++i) {
    EXPECT_GT(std::tie(all[i - 1].created, all[i - 1].id), std::tie(all[i].created, all[i].id));
  }

  // Reaped sessions are still found, cancelled, except the one its client had finished.
  sessions.EndIdle(absl::InfiniteFuture());
  q = {};
  q.statuses = std::vector<SessionQuery::Status>{{"cancelled", std::nullopt}};
  EXPECT_EQ(find(q).size(), 2u);
  q.statuses = std::vector<SessionQuery::Status>{{"client_finished", std::nullopt}};
  EXPECT_EQ(find(q), std::vector<std::string>{"SFT chat"});
  // A client that finishes after the server ended its session still has its say.
  EXPECT_TRUE(sessions.Finish("alice", *rl, "interrupted", ""));
  q.statuses = std::vector<SessionQuery::Status>{{"client_finished", {{"interrupted"}}}};
  EXPECT_EQ(find(q), std::vector<std::string>{"RL Math run"});
}

TEST(Copies, OneCopyPerTenantAndKeyAndARefusalForAnotherRequest) {
  Copies copies(/*capacity=*/2);
  int made = 0;
  auto copy = [&]() -> absl::StatusOr<std::string> { return "path-" + std::to_string(++made); };
  EXPECT_EQ(*copies.Once("alice", "k1", 7, copy), "path-1");
  EXPECT_EQ(*copies.Once("alice", "k1", 7, copy), "path-1") << "a resend gets the first copy";
  EXPECT_EQ(made, 1);
  EXPECT_TRUE(absl::IsInvalidArgument(copies.Once("alice", "k1", 8, copy).status()));
  EXPECT_EQ(*copies.Once("bob", "k1", 7, copy), "path-2") << "keys are the tenant's own";
  EXPECT_EQ(*copies.Once("alice", "", 7, copy), "path-3");
  EXPECT_EQ(*copies.Once("alice", "", 7, copy), "path-4") << "no key: every request copies";
  auto fail = []() -> absl::StatusOr<std::string> { return absl::NotFoundError("no checkpoint"); };
  EXPECT_TRUE(absl::IsNotFound(copies.Once("alice", "k2", 7, fail).status()));
  EXPECT_EQ(*copies.Once("alice", "k2", 7, copy), "path-5") << "a failure is not remembered";
  // Capacity 2: k1 (alice), then k1 (bob) and k2 came, so alice's k1 was forgotten.
  EXPECT_EQ(*copies.Once("alice", "k1", 9, copy), "path-6");
}

TEST(Copies, AResendWaitsForTheFirstCopyAndOtherKeysDoNot) {
  Copies copies(/*capacity=*/8);
  absl::Notification started, release;
  std::atomic<int> made{0};
  auto slow = [&]() -> absl::StatusOr<std::string> {
    ++made;
    started.Notify();
    release.WaitForNotification();
    return std::string("path-slow");
  };
  absl::StatusOr<std::string> first, resend;
  std::thread a([&] { first = copies.Once("alice", "k", 1, slow); });
  started.WaitForNotification();
  // While k's copy runs, another key copies at once (were it to wait, this would never return).
  EXPECT_EQ(*copies.Once("alice", "other", 1, [] { return absl::StatusOr<std::string>("p"); }),
            "p");
  std::thread b([&] { resend = copies.Once("alice", "k", 1, slow); });
  release.Notify();
  a.join();
  b.join();
  EXPECT_EQ(made.load(), 1);
  EXPECT_EQ(*first, "path-slow");
  EXPECT_EQ(*resend, "path-slow");
}

TEST(Aliases, ResolveWithinTheTenantAndAreForgottenWithTheirSessionOnly) {
  Aliases aliases;
  aliases.Add("alice", "s1", 0, "model-a");
  aliases.Add("alice", "s10", 0, "model-b");
  EXPECT_EQ(aliases.Resolve("alice", "s1:train:0"), "model-a");
  EXPECT_EQ(aliases.Resolve("bob", "s1:train:0"), "s1:train:0");
  EXPECT_EQ(aliases.Resolve("alice", "model-a"), "model-a");
  aliases.ForgetSession("alice", "s1");
  EXPECT_EQ(aliases.Resolve("alice", "s1:train:0"), "s1:train:0");
  EXPECT_EQ(aliases.Resolve("alice", "s10:train:0"), "model-b");
}

TEST(SamplingSessions, AResendWaitsThenGetsTheSamplerWhileItLives) {
  SamplingSessions calls;
  int answered = 0;
  Respond respond = [&](Response) { ++answered; };
  bool alive = true;
  auto is_alive = [&](const std::string&) { return alive; };
  std::string id;
  Respond first = respond, second = respond, third = respond;
  EXPECT_EQ(calls.Begin("t", "s", 1, 7, &first, is_alive, &id), SamplingSessions::Turn::kMake);
  EXPECT_EQ(calls.Begin("t", "s", 1, 7, &second, is_alive, &id), SamplingSessions::Turn::kWait);
  // Another body under the same key is refused, and takes nothing (its respond stays).
  Respond other = respond;
  EXPECT_EQ(calls.Begin("t", "s", 1, 8, &other, is_alive, &id), SamplingSessions::Turn::kConflict);
  EXPECT_TRUE(other != nullptr);
  EXPECT_TRUE(calls.Samplers("t", "s").empty()) << "not made yet";
  EXPECT_EQ(calls.ForgetSession("t", "s").size(), 0u) << "one being made stays";
  std::vector<Respond> waiting = calls.Finish("t", "s", 1, "sampler-1");
  EXPECT_EQ(waiting.size(), 2u);
  EXPECT_EQ(calls.Begin("t", "s", 1, 7, &third, is_alive, &id), SamplingSessions::Turn::kAnswer);
  EXPECT_EQ(id, "sampler-1");
  EXPECT_EQ(calls.Samplers("t", "s"), std::vector<std::string>{"sampler-1"});
  alive = false;  // evicted: made again
  EXPECT_EQ(calls.Begin("t", "s", 1, 7, &third, is_alive, &id), SamplingSessions::Turn::kMake);
  EXPECT_EQ(calls.Finish("t", "s", 1, "").size(), 1u) << "a failure is forgotten";
  EXPECT_EQ(calls.Begin("t", "s", 1, 7, &first, is_alive, &id), SamplingSessions::Turn::kMake);
  calls.Finish("t", "s", 1, "sampler-2");
  EXPECT_EQ(calls.ForgetSession("t", "s"), std::vector<std::string>{"sampler-2"});
  EXPECT_TRUE(calls.Samplers("t", "s").empty());
  EXPECT_EQ(answered, 0) << "the table never answers anyone itself";
}

TEST(SampleCancels, CancelSetsTheRunningSamplesFlagOnly) {
  SampleCancels cancels;
  const SampleCancels::Flag flag = cancels.Register("t", "sample:1");
  EXPECT_FALSE(cancels.Cancel("other", "sample:1"));
  EXPECT_TRUE(cancels.Cancel("t", "sample:1"));
  EXPECT_TRUE(flag->load());
  const SampleCancels::Flag resent = cancels.Register("t", "sample:1");
  cancels.Forget("t", "sample:1", flag);  // the first call's end leaves the resend's flag
  EXPECT_TRUE(cancels.Cancel("t", "sample:1"));
  cancels.Forget("t", "sample:1", resent);
  EXPECT_FALSE(cancels.Cancel("t", "sample:1"));
}

TEST(ArchiveGrants, EachTenantKeepsItsLatestOnly) {
  ArchiveGrants grants;
  const absl::Time expires = absl::Now();
  grants.Add("other", ArchiveGrant{"bob", "tinker://m/weights/x", expires, ""});
  for (size_t i = 0; i <= ArchiveGrants::kMaxPerTenant; ++i) {
    grants.Add("t" + std::to_string(i), ArchiveGrant{"alice", "tinker://m/weights/a", expires, ""});
  }
  EXPECT_FALSE(grants.Find("t0")) << "alice's oldest went";
  EXPECT_TRUE(grants.Find("t1"));
  ASSERT_TRUE(grants.Find("other")) << "bob's is not pushed out by alice's";
  EXPECT_EQ(grants.Find("other")->tenant, "bob");
}

}  // namespace
}  // namespace tinkerd::http
