// The C++ client library and tinkerctl against the real server on a loopback port.
#include <cmath>
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

// |a − b| <= tol · max(1, |b|) at every position; NaN only where both are (prompt position 0).
bool Near(const std::vector<double>& a, const std::vector<double>& b, double tol) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::isnan(a[i]) || std::isnan(b[i])) {
      if (std::isnan(a[i]) != std::isnan(b[i])) return false;
    } else if (std::abs(a[i] - b[i]) > tol * std::max(1.0, std::abs(b[i]))) {
      return false;
    }
  }
  return true;
}

TEST(Client, SamplingClientSamplesTheWeightsOfItsPlaceInTheCallOrder) {
  LiveServer live;
  auto conn = Connect(live);
  v1::CreateModelRequest req;
  req.mutable_lora()->set_rank(4);
  req.mutable_lora()->set_train_unembed(true);
  auto info = conn->CreateModel(req);
  ASSERT_TRUE(info.ok()) << info.status().message();
  auto tc = conn->Attach(info->model_id());
  SplitMix64 g(5);
  v1::AdamParams adam;
  adam.set_learning_rate(5e-2);
  auto train = [&] {
    std::vector<v1::Datum> wire;
    for (const Datum& d : RandomData(g, {9, 14}, "cross_entropy", 128)) wire.push_back(ToProto(d));
    auto fb = tc->ForwardBackward(wire, Loss("cross_entropy"));  // takes its seq_id first
    return std::make_pair(std::move(fb), tc->OptimStep(adam));
  };
  // Sent without waiting: the sampler is the weights after the first step, not the second.
  auto first = train();
  auto frozen_future = tc->SaveWeightsAndGetSamplingClient();
  auto second = train();
  ASSERT_TRUE(second.second.get().ok());
  absl::StatusOr<client::SamplingClient> frozen = frozen_future.get();
  ASSERT_TRUE(frozen.ok()) << frozen.status().message();
  EXPECT_EQ(tc->next_seq_id(), 6);

  const std::vector<int64_t> prompt = {4, 40, 9, 100, 27};
  v1::SamplingParams params;
  params.set_max_tokens(6);
  params.set_seed(11);
  auto sampled = frozen->Sample(prompt, params, {.num_samples = 2, .prompt_logprobs = true}).get();
  ASSERT_TRUE(sampled.ok()) << sampled.status().message();
  ASSERT_EQ(sampled->sequences_size(), 2);
  const v1::SampledSequence& s = sampled->sequences(1);
  ASSERT_EQ(s.tokens_size(), 6);
  std::vector<int64_t> context = prompt;
  context.insert(context.end(), s.tokens().begin(), s.tokens().end() - 1);
  std::vector<double> sample_logp(prompt.size(), 0.0), scored(prompt.size(), 0.0);
  sample_logp.insert(sample_logp.end(), s.logprobs().begin(), s.logprobs().end() - 1);
  // ComputeLogprobs of the sample's own context, by the same frozen weights: the sample's
  // logprobs to rounding (float64 server).
  auto by_frozen = frozen->ComputeLogprobs(context).get();
  ASSERT_TRUE(by_frozen.ok()) << by_frozen.status().message();
  scored.insert(scored.end(), by_frozen->begin() + static_cast<int64_t>(prompt.size()),
                by_frozen->end());
  EXPECT_TRUE(Near(sample_logp, scored, 1e-12));
  EXPECT_TRUE(Near({sampled->prompt_logprobs().begin(), sampled->prompt_logprobs().end()},
                   {by_frozen->begin(), by_frozen->begin() + static_cast<int64_t>(prompt.size())},
                   1e-12));
  // Control: the model's current weights (one step further) score the same context otherwise.
  auto by_model = conn->Sampler("", info->model_id()).ComputeLogprobs(context).get();
  ASSERT_TRUE(by_model.ok());
  EXPECT_FALSE(Near(*by_model, *by_frozen, 1e-6));

  // The stream assembles the same answer, and a stream the caller stops ends CANCELLED.
  int messages = 0;
  auto streamed = frozen->SampleStream(prompt, params,
                                       [&](const v1::SampleStreamResponse&) {
                                         ++messages;
                                         return true;
                                       },
                                       {.num_samples = 2, .prompt_logprobs = true});
  ASSERT_TRUE(streamed.ok()) << streamed.status().message();
  EXPECT_GE(messages, 2);
  for (int i = 0; i < 2; ++i) {
    const v1::SampledSequence& a = streamed->sequences(i);
    const v1::SampledSequence& b = sampled->sequences(i);
    EXPECT_EQ(std::vector<int64_t>(a.tokens().begin(), a.tokens().end()),
              std::vector<int64_t>(b.tokens().begin(), b.tokens().end()));
    EXPECT_TRUE(Near({a.logprobs().begin(), a.logprobs().end()},
                     {b.logprobs().begin(), b.logprobs().end()}, 1e-12));
    EXPECT_EQ(a.stop_reason(), b.stop_reason());
  }
  EXPECT_EQ(streamed->prompt_logprobs_size(), static_cast<int>(prompt.size()));
  auto stopped =
      frozen->SampleStream(prompt, params, [](const v1::SampleStreamResponse&) { return false; });
  EXPECT_EQ(stopped.status().code(), absl::StatusCode::kCancelled);

  // A sampler checkpoint of the current weights samples like them (stored in float32).
  auto path = tc->SaveWeightsForSampler("c1").get();
  ASSERT_TRUE(path.ok()) << path.status().message();
  v1::CreateSamplerRequest from_path;
  from_path.set_path(*path);
  auto loaded = conn->CreateSampler(from_path);
  ASSERT_TRUE(loaded.ok()) << loaded.status().message();
  auto by_path = conn->Sampler(loaded->sampler_id()).ComputeLogprobs(context).get();
  ASSERT_TRUE(by_path.ok());
  EXPECT_TRUE(Near(*by_path, *by_model, 1e-4));
  EXPECT_FALSE(Near(*by_path, *by_frozen, 1e-4));

  // Deleted, a sampler is gone; the training state round-trips through the client too.
  ASSERT_TRUE(frozen->Delete().ok());
  EXPECT_EQ(frozen->Sample(prompt, params).get().status().code(), absl::StatusCode::kNotFound);
  auto state = tc->SaveState("s1").get();
  ASSERT_TRUE(state.ok()) << state.status().message();
  EXPECT_EQ(*state, "tinker://" + info->model_id() + "/weights/s1");
  auto reloaded = tc->LoadState(*state).get();
  EXPECT_TRUE(reloaded.ok()) << reloaded.status().message();
  EXPECT_EQ(conn->GetInfo(info->model_id())->next_seq_id(), tc->next_seq_id());
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
