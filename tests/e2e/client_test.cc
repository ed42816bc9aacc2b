// The C++ client library and tinkerctl against the real server on a loopback port.
#include <cstdio>
#include <future>

#include "client/client.h"
#include "tests/e2e/e2e_util.h"

namespace tinkerd::testing {
namespace {

std::shared_ptr<client::Connection> Connect(const LiveServer& live) {
  client::ClientOptions o;
  o.target = "127.0.0.1:" + std::to_string(live.server->port());
  o.initial_backoff = std::chrono::milliseconds(10);
  o.max_attempts = 200;  // the retry test keeps the queue full for a while
  return client::Connection::Create(o);
}

v1::LossFn Loss(const std::string& name) {
  v1::LossFn l;
  l.set_name(name);
  return l;
}

TEST(Client, PipelinedCallsMatchTheInProcessRunner) {
  LiveServer live;
  auto conn = Connect(live);
  ASSERT_TRUE(*conn->Health());
  v1::CreateModelRequest req;
  req.set_seed(4);
  auto info = conn->CreateModel(req);
  ASSERT_TRUE(info.ok()) << info.status().message();
  auto tc = conn->Attach(info->model_id());
  auto local = MakeRunner(live.model_dir);
  CreateModelOptions o;
  o.seed = 4;
  const std::string local_id = *local->CreateModel(o);

  SplitMix64 g(1);
  std::vector<std::vector<Datum>> calls = {RandomData(g, {7, 19}, "cross_entropy", 128),
                                           RandomData(g, {3}, "cross_entropy", 128),
                                           RandomData(g, {25, 2, 9}, "cross_entropy", 128)};
  // Issue everything before waiting on anything, as Tinker users do.
  std::vector<std::future<absl::StatusOr<v1::ForwardBackwardOutput>>> fbs;
  for (const auto& c : calls) {
    std::vector<v1::Datum> wire;
    for (const Datum& d : c) wire.push_back(ToProto(d));
    fbs.push_back(tc->ForwardBackward(wire, Loss("cross_entropy")));
  }
  v1::AdamParams adam;
  adam.set_learning_rate(1e-2);
  auto step = tc->OptimStep(adam);
  for (size_t i = 0; i < calls.size(); ++i) {
    auto got = fbs[i].get();
    ASSERT_TRUE(got.ok()) << got.status().message();
    auto want = local->ForwardBackward(local_id, calls[i], "cross_entropy", {});
    EXPECT_EQ(got->metrics().at("loss:sum"), want->metrics.at("loss:sum"));
  }
  auto s = step.get();
  ASSERT_TRUE(s.ok()) << s.status().message();
  AdamParams p;
  p.learning_rate = 1e-2;
  EXPECT_EQ(s->grad_norm(), local->OptimStep(local_id, p)->grad_norm);
  EXPECT_EQ(Flat(Snap(*live.server->runner(), info->model_id(), StateKind::kParams)),
            Flat(Snap(*local, local_id, StateKind::kParams)));
  EXPECT_EQ(tc->next_seq_id(), 5);
}

TEST(Client, RetriesOnAFullQueueApplyEachRequestOnce) {
  ServerConfig sc;
  sc.scheduler.max_pending_per_model = 2;
  LiveServer live(sc);
  auto conn = Connect(live);
  auto info = conn->CreateModel(v1::CreateModelRequest());
  ASSERT_TRUE(info.ok());
  auto tc = conn->Attach(info->model_id());
  SplitMix64 g(2);
  std::vector<std::future<absl::StatusOr<v1::ForwardBackwardOutput>>> fbs;
  double want_tokens = 0;
  for (int i = 0; i < 8; ++i) {
    auto data = RandomData(g, {40, 30}, "cross_entropy", 128);
    std::vector<v1::Datum> wire;
    for (const Datum& d : data) {
      wire.push_back(ToProto(d));
      for (float w : d.loss_fn_inputs.at("weights").float32_data) want_tokens += (w != 0);
    }
    fbs.push_back(tc->ForwardBackward(wire, Loss("cross_entropy")));
  }
  for (auto& f : fbs) {
    auto r = f.get();
    EXPECT_TRUE(r.ok()) << r.status().message();
  }
  // Eight requests against a queue of two: several were refused and retried with their seq_id,
  // yet each was applied exactly once.
  auto after = conn->GetInfo(info->model_id());
  EXPECT_EQ(after->accumulated_tokens(), want_tokens);
  EXPECT_EQ(after->next_seq_id(), 9);
}

TEST(Client, TrajectoryStreamEqualsOneCall) {
  LiveServer live({}, /*micro_batch_tokens=*/16);
  auto conn = Connect(live);
  v1::CreateModelRequest req;
  req.set_loss_reduction("token_mean");
  auto a = conn->CreateModel(req);
  auto b = conn->CreateModel(req);
  auto ta = conn->Attach(a->model_id());
  auto tb = conn->Attach(b->model_id());
  SplitMix64 g(3);
  auto data = RandomData(g, {5, 13, 21, 2}, "dro", 128);
  v1::LossFn dro = Loss("dro");
  (*dro.mutable_config())["beta"] = 0.2;
  auto stream = ta->StreamForwardBackward(dro);
  std::vector<v1::Datum> wire;
  for (const Datum& d : data) {
    wire.push_back(ToProto(d));
    ASSERT_TRUE(stream->Write(wire.back()).ok());
  }
  auto streamed = stream->Finish();
  ASSERT_TRUE(streamed.ok()) << streamed.status().message();
  auto whole = tb->ForwardBackward(wire, dro).get();
  ASSERT_TRUE(whole.ok());
  EXPECT_NEAR(streamed->metrics().at("loss:sum"), whole->metrics().at("loss:sum"), 1e-10);
  const auto ga = Flat(Snap(*live.server->runner(), a->model_id(), StateKind::kGrads));
  const auto gb = Flat(Snap(*live.server->runner(), b->model_id(), StateKind::kGrads));
  EXPECT_LE(MaxAbsDiff(ga, gb), 1e-10 * MaxAbs(ga));
}

TEST(Tinkerctl, HealthCreateInfoListDelete) {
  LiveServer live;
  auto [hc, hout] = Ctl(live, "health");
  EXPECT_EQ(hc, 0) << hout;
  EXPECT_NE(hout.find("SERVING"), std::string::npos);
  auto [cc, cout] = Ctl(live, "create --lora_rank=8 --loss_reduction=sum");
  ASSERT_EQ(cc, 0) << cout;
  const size_t at = cout.find("model-");
  ASSERT_NE(at, std::string::npos) << cout;
  const std::string id = cout.substr(at, cout.find_first_not_of("model-0123456789abcdef", at) - at);
  auto [ic, iout] = Ctl(live, "info " + id);
  EXPECT_EQ(ic, 0) << iout;
  EXPECT_NE(iout.find("sum"), std::string::npos) << iout;
  EXPECT_EQ(live.server->runner()->GetInfo(id)->lora.rank, 8);
  auto [lc, lout] = Ctl(live, "list");
  EXPECT_NE(lout.find(id), std::string::npos) << lout;
  EXPECT_EQ(Ctl(live, "delete " + id).first, 0);
  EXPECT_EQ(Ctl(live, "info " + id).first, 1);  // NOT_FOUND now
  EXPECT_EQ(Ctl(live, "frobnicate").first, 2);  // usage error
}

}  // namespace
}  // namespace tinkerd::testing
