// Sampling through the real server on loopback: the Sample and ComputeLogprobs RPCs against the
// Forward RPC, samplers frozen while training goes on, and the errors a client can cause.
#include <gtest/gtest.h>
#include <httplib.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <thread>

#include "server/common/status_map.h"
#include "tests/e2e/e2e_util.h"

namespace tinkerd::testing {
namespace {

const std::vector<int64_t> kPrompt = {4, 40, 9, 100, 27};

v1::SampleRequest SampleReq(const std::string& model, uint64_t seed, int max_tokens = 8) {
  v1::SampleRequest req;
  req.set_model_id(model);
  for (int64_t t : kPrompt)
    req.mutable_prompt()->add_chunks()->mutable_encoded_text()->add_tokens(t);
  req.set_num_samples(2);
  req.mutable_sampling_params()->set_max_tokens(max_tokens);
  req.mutable_sampling_params()->set_seed(seed);
  return req;
}

grpc::Status Sample(LiveServer& live, const v1::SampleRequest& req, v1::SampleResponse* out) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  return live.stub->Sample(&ctx, req, out);
}

grpc::Status CreateSampler(LiveServer& live, const v1::CreateSamplerRequest& req,
                           v1::SamplerInfo* out) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  return live.stub->CreateSampler(&ctx, req, out);
}

// The model's weights exported for sampling at `seq_id` (a PEFT adapter, or merged weights), and
// the export's path.
std::string Export(LiveServer& live, const std::string& model, int64_t seq_id, bool merged) {
  v1::SaveWeightsForSamplerRequest save;
  save.set_model_id(model);
  save.set_seq_id(seq_id);
  save.set_name(merged ? "merged" : "peft");
  save.set_merged(merged);
  v1::SaveWeightsForSamplerResponse saved;
  grpc::ClientContext ctx;
  const grpc::Status st = live.stub->SaveWeightsForSampler(&ctx, save, &saved);
  EXPECT_TRUE(st.ok()) << st.error_message();
  return saved.path();
}

// Stop strings over gRPC: a sample ends with the token whose text completes the first occurrence
// of the string (the test tokenizer's texts, tests/test_util.h), and keeps it, whether the sampler
// is the base model or an export loaded back (both layouts: the base's tokenizer is theirs); a
// model without a tokenizer refuses them naming the field.
TEST(SamplingE2E, StopStringsEndSamplesWhereTheirTextFirstAppears) {
  LiveServer live({}, 4096, ComputeDType::kFloat64, /*tokenizer=*/true);
  v1::SampleRequest req = SampleReq("", 0, 16);
  req.set_num_samples(1);
  req.mutable_sampling_params()->set_temperature(0);
  v1::SampleResponse full;
  ASSERT_TRUE(Sample(live, req, &full).ok());
  const auto& tokens = full.sequences(0).tokens();
  ASSERT_EQ(tokens.size(), 16);
  const std::string a = TestTokenText(tokens[4]), b = TestTokenText(tokens[5]);
  const std::string stop = a.substr(a.size() - 1) + b.substr(0, 2);  // spans two tokens
  std::string text;
  int end = -1;
  for (int k = 0; k < tokens.size() && end < 0; ++k) {
    text += TestTokenText(tokens[k]);
    if (text.find(stop) != std::string::npos) end = k;
  }
  ASSERT_GE(end, 0);
  req.mutable_sampling_params()->add_stop_strings(stop);
  v1::SampleResponse stopped;
  grpc::Status st = Sample(live, req, &stopped);
  ASSERT_TRUE(st.ok()) << st.error_message();
  EXPECT_EQ(stopped.sequences(0).stop_reason(), v1::STOP_REASON_STOP);
  EXPECT_EQ(std::vector<int64_t>(stopped.sequences(0).tokens().begin(),
                                 stopped.sequences(0).tokens().end()),
            std::vector<int64_t>(tokens.begin(), tokens.begin() + end + 1));

  // An untrained adapter's exports sample the base's tokens, and stop where it stops.
  const std::string model = live.CreateModel();
  for (bool merged : {false, true}) {
    v1::CreateSamplerRequest load;
    load.set_path(Export(live, model, merged ? 2 : 1, merged));
    v1::SamplerInfo loaded;
    ASSERT_TRUE(CreateSampler(live, load, &loaded).ok()) << load.path();
    v1::SampleRequest from_export = req;
    from_export.set_sampler_id(loaded.sampler_id());
    v1::SampleResponse exported;
    st = Sample(live, from_export, &exported);
    ASSERT_TRUE(st.ok()) << load.path() << ": " << st.error_message();
    EXPECT_EQ(exported.sequences(0).stop_reason(), v1::STOP_REASON_STOP) << load.path();
    EXPECT_EQ(std::vector<int64_t>(exported.sequences(0).tokens().begin(),
                                   exported.sequences(0).tokens().end()),
              std::vector<int64_t>(tokens.begin(), tokens.begin() + end + 1))
        << load.path();
  }

  LiveServer bare;
  v1::SampleResponse refused;
  st = Sample(bare, req, &refused);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(st.error_message().find("sampling_params.stop"), std::string::npos)
      << st.error_message();
}

// Forward's logprobs of `continuation` after kPrompt.
// `routes`: the datum's routed_experts, [T, R, k] flat (R·k = route_width), when non-empty.
std::vector<float> ForwardLogprobs(LiveServer& live, const std::string& model, int64_t seq,
                                   const std::vector<int64_t>& continuation,
                                   const std::vector<int64_t>& routes = {},
                                   std::vector<int64_t> route_shape = {}) {
  std::vector<int64_t> all = kPrompt;
  all.insert(all.end(), continuation.begin(), continuation.end());
  Datum d;
  d.tokens.assign(all.begin(), all.end() - 1);
  d.loss_fn_inputs["target_tokens"] = TensorData::Int64({all.begin() + 1, all.end()});
  d.loss_fn_inputs["weights"] = TensorData::Float32(std::vector<float>(d.tokens.size(), 1.f));
  if (!routes.empty()) {
    TensorData t = TensorData::Int64(routes);
    route_shape.insert(route_shape.begin(), static_cast<int64_t>(d.tokens.size()));
    t.shape = route_shape;
    d.loss_fn_inputs["routed_experts"] = t;
  }
  grpc::ClientContext ctx;
  v1::ForwardBackwardOutput out;
  const grpc::Status st = live.stub->Forward(&ctx, MakeRequest(model, seq, {d}), &out);
  EXPECT_TRUE(st.ok()) << st.error_message();
  std::vector<float> logp;
  if (out.outputs_size() == 1) {
    const std::string& bytes = out.outputs(0).logprobs().data();
    logp.resize(bytes.size() / 4);
    std::memcpy(logp.data(), bytes.data(), bytes.size());
  }
  return logp;
}

TEST(SamplingE2e, SampleAndComputeLogprobsAgreeWithForward) {
  LiveServer live;
  const std::string model = live.CreateModel();
  v1::SampleResponse resp;
  grpc::Status st = Sample(live, SampleReq(model, 5), &resp);
  ASSERT_TRUE(st.ok()) << st.error_message();
  ASSERT_EQ(resp.sequences_size(), 2);
  const v1::SampledSequence& s = resp.sequences(0);
  ASSERT_EQ(s.tokens_size(), 8);
  EXPECT_EQ(s.stop_reason(), v1::STOP_REASON_LENGTH);
  const std::vector<float> fwd =
      ForwardLogprobs(live, model, 1, {s.tokens().begin(), s.tokens().end()});
  ASSERT_EQ(fwd.size(), kPrompt.size() + 7);
  for (int t = 0; t < 8; ++t) {
    // float64 model, float32 on the Forward wire: within float32 rounding.
    EXPECT_NEAR(s.logprobs(t), fwd[kPrompt.size() - 1 + t],
                1e-6 * std::max(1.0, std::abs(s.logprobs(t))));
  }
  v1::ComputeLogprobsRequest lp;
  lp.set_model_id(model);
  *lp.mutable_prompt() = SampleReq(model, 0).prompt();
  v1::ComputeLogprobsResponse lp_out;
  grpc::ClientContext ctx;
  ASSERT_TRUE(live.stub->ComputeLogprobs(&ctx, lp, &lp_out).ok());
  ASSERT_EQ(lp_out.logprobs_size(), static_cast<int>(kPrompt.size()));
  EXPECT_TRUE(std::isnan(lp_out.logprobs(0)));
  for (size_t t = 1; t < kPrompt.size(); ++t) {
    EXPECT_NEAR(lp_out.logprobs(t), fwd[t - 1], 1e-6 * std::max(1.0, std::abs(double{fwd[t - 1]})));
  }
  // The same seed again: the same tokens.
  v1::SampleResponse again;
  ASSERT_TRUE(Sample(live, SampleReq(model, 5), &again).ok());
  EXPECT_EQ(again.sequences(1).tokens_size(), resp.sequences(1).tokens_size());
  for (int t = 0; t < resp.sequences(1).tokens_size(); ++t) {
    EXPECT_EQ(again.sequences(1).tokens(t), resp.sequences(1).tokens(t));
  }
}

// Router replay over gRPC on a mixture of experts: Sample returns every token's experts, and a
// Forward that sends them back as routed_experts computes the same logprobs, to the bit; a
// trajectory with a token moved to another expert does not. SampleStream and a dense model
// refuse the field by name.
TEST(SamplingE2e, SampledRoutesReplayThroughTheTrainer) {
  LiveServer live({}, 4096, ComputeDType::kFloat64, false, 0, "qwen3_moe");
  const std::string model = live.CreateModel();
  v1::SampleRequest req = SampleReq(model, 5);
  req.set_routed_experts(true);
  v1::SampleResponse resp;
  grpc::Status st = Sample(live, req, &resp);
  ASSERT_TRUE(st.ok()) << st.error_message();
  const ModelConfig config = TinyConfig("qwen3_moe");
  const int64_t width = config.moe.RoutedLayers() * config.moe.top_k;
  ASSERT_EQ(resp.prompt_routed_experts_size(), static_cast<int>(kPrompt.size() * width));
  const v1::SampledSequence& s = resp.sequences(0);
  ASSERT_EQ(s.routed_experts_size(), (s.tokens_size() - 1) * width);
  std::vector<int64_t> routes(resp.prompt_routed_experts().begin(),
                              resp.prompt_routed_experts().end());
  routes.insert(routes.end(), s.routed_experts().begin(), s.routed_experts().end());
  const std::vector<int64_t> tokens(s.tokens().begin(), s.tokens().end());
  const std::vector<int64_t> shape = {config.moe.RoutedLayers(), config.moe.top_k};
  const std::vector<float> own = ForwardLogprobs(live, model, 1, tokens);
  ASSERT_EQ(own.size(), kPrompt.size() + tokens.size() - 1);
  EXPECT_EQ(ForwardLogprobs(live, model, 2, tokens, routes, shape), own);
  std::vector<int64_t> moved = routes;
  const size_t at = (kPrompt.size() + 2) * width;  // the third sampled token's first choice
  for (int64_t e = 0; e < config.moe.num_experts; ++e) {
    if (std::find(moved.begin() + at, moved.begin() + at + width, e) ==
        moved.begin() + at + width) {
      moved[at] = e;
      break;
    }
  }
  EXPECT_NE(ForwardLogprobs(live, model, 3, tokens, moved, shape), own);

  grpc::ClientContext ctx;
  std::unique_ptr<grpc::ClientReader<v1::SampleStreamResponse>> stream =
      live.stub->SampleStream(&ctx, req);
  v1::SampleStreamResponse message;
  while (stream->Read(&message)) {
  }
  const grpc::Status refused = stream->Finish();
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(refused.error_message().find("routed_experts"), std::string::npos);

  LiveServer dense;
  v1::SampleRequest dense_req = SampleReq(dense.CreateModel(), 5);
  dense_req.set_routed_experts(true);
  st = Sample(dense, dense_req, &resp);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(st.error_message().find("routed_experts"), std::string::npos) << st.error_message();
}

TEST(SamplingE2e, ASamplerKeepsItsPolicyWhileTheModelTrains) {
  LiveServer live;
  const std::string model = live.CreateModel();
  grpc::ClientContext c1;
  v1::CreateSamplerRequest create;
  create.set_model_id(model);
  v1::SamplerInfo sampler;
  ASSERT_TRUE(live.stub->CreateSampler(&c1, create, &sampler).ok());
  EXPECT_EQ(sampler.step(), 0);
  v1::SampleRequest by_sampler = SampleReq("", 9);
  by_sampler.set_sampler_id(sampler.sampler_id());
  v1::SampleResponse before;
  ASSERT_TRUE(Sample(live, by_sampler, &before).ok());

  SplitMix64 g(4);
  v1::ForwardBackwardOutput fb;
  ASSERT_TRUE(
      live.FwdBwd(MakeRequest(model, 1, RandomData(g, {12, 9}, "cross_entropy", 128)), &fb).ok());
  v1::OptimStepResponse step;
  ASSERT_TRUE(live.Optim(model, 2, &step, 0.1).ok());

  v1::SampleResponse frozen, current;
  ASSERT_TRUE(Sample(live, by_sampler, &frozen).ok());
  ASSERT_TRUE(Sample(live, SampleReq(model, 9), &current).ok());
  // The sampler still samples the step-0 policy: the same tokens and logprobs, bitwise.
  for (int i = 0; i < 2; ++i) {
    ASSERT_EQ(frozen.sequences(i).logprobs_size(), before.sequences(i).logprobs_size());
    for (int t = 0; t < frozen.sequences(i).logprobs_size(); ++t) {
      EXPECT_EQ(frozen.sequences(i).tokens(t), before.sequences(i).tokens(t));
      EXPECT_EQ(frozen.sequences(i).logprobs(t), before.sequences(i).logprobs(t));
    }
  }
  // The model itself moved on (control: its logprobs differ from the frozen ones).
  EXPECT_NE(current.sequences(0).logprobs(0), before.sequences(0).logprobs(0));

  grpc::ClientContext c2;
  v1::SamplerRef ref;
  ref.set_sampler_id(sampler.sampler_id());
  v1::DeleteSamplerResponse deleted;
  ASSERT_TRUE(live.stub->DeleteSampler(&c2, ref, &deleted).ok());
  v1::SampleResponse gone;
  EXPECT_EQ(Sample(live, by_sampler, &gone).error_code(), grpc::StatusCode::NOT_FOUND);
}

TEST(SamplingE2e, AnOrderedSamplerFreezesAtItsSeqIdAndExportsSampleTheSame) {
  LiveServer live;
  const std::string model = live.CreateModel();
  // Sent before the step it must wait for: frozen in order, it sees the weights after seq 2.
  v1::CreateSamplerRequest ordered;
  ordered.set_model_id(model);
  ordered.set_seq_id(3);
  v1::SamplerInfo sampler;
  grpc::Status created;
  std::thread waiting([&] { created = CreateSampler(live, ordered, &sampler); });
  SplitMix64 g(7);
  v1::ForwardBackwardOutput fb;
  ASSERT_TRUE(
      live.FwdBwd(MakeRequest(model, 1, RandomData(g, {12, 9}, "cross_entropy", 128)), &fb).ok());
  v1::OptimStepResponse step;
  ASSERT_TRUE(live.Optim(model, 2, &step, 0.1).ok());
  waiting.join();
  ASSERT_TRUE(created.ok()) << created.error_message();
  EXPECT_EQ(sampler.step(), 1);  // frozen at once it would be 0
  v1::SamplerInfo retried;
  ASSERT_TRUE(CreateSampler(live, ordered, &retried).ok());
  EXPECT_EQ(retried.sampler_id(), sampler.sampler_id());  // a retry, not a second sampler

  // Both export layouts, loaded back as samplers, sample what the ordered sampler samples.
  std::vector<std::string> paths;
  for (bool merged : {false, true}) paths.push_back(Export(live, model, merged ? 5 : 4, merged));
  auto greedy = [&](const std::string& sampler_id) {
    v1::SampleRequest req = SampleReq("", 0);
    req.set_sampler_id(sampler_id);
    req.mutable_sampling_params()->set_temperature(0);
    v1::SampleResponse out;
    const grpc::Status st = Sample(live, req, &out);
    EXPECT_TRUE(st.ok()) << st.error_message();
    return out;
  };
  const v1::SampleResponse want = greedy(sampler.sampler_id());
  ASSERT_EQ(want.sequences_size(), 2);
  for (const std::string& path : paths) {
    v1::CreateSamplerRequest load;
    load.set_path(path);
    v1::SamplerInfo loaded;
    const grpc::Status st = CreateSampler(live, load, &loaded);
    ASSERT_TRUE(st.ok()) << path << ": " << st.error_message();
    EXPECT_EQ(loaded.path(), path);
    EXPECT_EQ(loaded.step(), 1);
    const v1::SampleResponse got = greedy(loaded.sampler_id());
    ASSERT_EQ(got.sequences_size(), 2);
    for (int t = 0; t < want.sequences(0).tokens_size(); ++t) {
      EXPECT_EQ(got.sequences(0).tokens(t), want.sequences(0).tokens(t)) << path;
      // The PEFT file stores the float64 adapter in float32: relative rounding 2^-24 on A and B
      // moves a logprob by far less than 1e-6.
      EXPECT_NEAR(got.sequences(0).logprobs(t), want.sequences(0).logprobs(t), 1e-6) << path;
    }
  }
  // Control: the base model samples another policy.
  const v1::SampleResponse base = greedy("");
  double diff = 0;
  for (int t = 0; t < base.sequences(0).logprobs_size(); ++t) {
    diff = std::max(diff, std::abs(base.sequences(0).logprobs(t) - want.sequences(0).logprobs(t)));
  }
  EXPECT_GT(diff, 1e-3);

  // What cannot be sampled is refused, naming the field.
  v1::CreateSamplerRequest bad;
  bad.set_path("tinker://" + model + "/weights/none");
  v1::SamplerInfo unused;
  grpc::Status st = CreateSampler(live, bad, &unused);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(st.error_message().find("path"), std::string::npos) << st.error_message();
  bad.set_path("tinker://" + model + "/sampler_weights/none");
  EXPECT_EQ(CreateSampler(live, bad, &unused).error_code(), grpc::StatusCode::NOT_FOUND);
  bad.set_model_id(model);
  EXPECT_EQ(CreateSampler(live, bad, &unused).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  bad.clear_path();
  bad.set_seq_id(-1);
  EXPECT_EQ(CreateSampler(live, bad, &unused).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
}

TEST(SamplingE2e, ATenantsSamplersStayWithinItsMemoryBudget) {
  int64_t adapter_bytes = 0;  // what one sampler of a rank-4 LoRA model holds (float64)
  {
    LiveServer probe;
    adapter_bytes =
        8 *
        static_cast<int64_t>(
            Flat(Snap(*probe.server->runner(), probe.CreateModel(), StateKind::kParams)).size());
  }
  ASSERT_GT(adapter_bytes, 0);
  ServerConfig sc;
  sc.sampling.max_sampler_bytes_per_tenant = adapter_bytes * 5 / 2;  // room for two
  LiveServer live(sc);
  v1::CreateSamplerRequest create;
  create.set_model_id(live.CreateModel());
  std::vector<std::string> samplers;
  for (int i = 0; i < 3; ++i) {
    v1::SamplerInfo info;
    const grpc::Status st = CreateSampler(live, create, &info);
    ASSERT_TRUE(st.ok()) << st.error_message();
    samplers.push_back(info.sampler_id());
  }
  auto sample = [&](const std::string& sampler) {
    v1::SampleRequest req = SampleReq("", 1, 2);
    req.set_sampler_id(sampler);
    v1::SampleResponse out;
    return Sample(live, req, &out).error_code();
  };
  EXPECT_EQ(sample(samplers[0]), grpc::StatusCode::NOT_FOUND) << "the budget held three";
  EXPECT_EQ(sample(samplers[1]), grpc::StatusCode::OK);
  EXPECT_EQ(sample(samplers[2]), grpc::StatusCode::OK);

  sc.sampling.max_sampler_bytes_per_tenant = adapter_bytes - 1;  // not even one
  LiveServer small(sc);
  create.set_model_id(small.CreateModel());
  v1::SamplerInfo info;
  const grpc::Status st = CreateSampler(small, create, &info);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_NE(st.error_message().find("--sampler_mb_per_tenant"), std::string::npos)
      << st.error_message();
}

// --max_samples_per_tenant: a request that would take a tenant past its samples in the engine is
// RESOURCE_EXHAUSTED naming the flag (retryable), and a finished request gives its share back.
TEST(SamplingE2e, ATenantsRunningSamplesAreBounded) {
  ServerConfig sc;
  sc.sampling.max_samples_per_tenant = 4;
  LiveServer live(sc);
  v1::SampleRequest req = SampleReq("", 1, 4);
  req.set_num_samples(5);
  v1::SampleResponse out;
  grpc::Status st = Sample(live, req, &out);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_NE(st.error_message().find("--max_samples_per_tenant"), std::string::npos)
      << st.error_message();
  req.set_num_samples(4);
  for (int i = 0; i < 2; ++i) {  // the second fits only if the first gave its share back
    st = Sample(live, req, &out);
    ASSERT_TRUE(st.ok()) << st.error_message();
    EXPECT_EQ(out.sequences_size(), 4);
  }
}

// A gauge's value from /metrics.
double Gauge(int port, const std::string& name) {
  httplib::Client c("127.0.0.1", port);
  auto res = c.Get("/metrics");
  if (!res || res->status != 200) return -1;
  const size_t at = res->body.find("\n" + name + " ");
  return at == std::string::npos ? -1 : std::stod(res->body.substr(at + name.size() + 2));
}

// A sampler unused for --sampler_idle_s is deleted, and its memory freed, while the server is
// idle: nothing but /metrics is asked between its creation and its expiry (before, expiry ran only
// inside sampler calls). The gauges follow samplers made and deleted.
TEST(SamplingE2e, AnIdleSamplerIsDeletedWithoutFurtherCalls) {
  ServerConfig sc;
  sc.metrics_port = 0;
  double one = 0;  // a LoRA sampler's bytes
  {
    LiveServer live(sc);  // the default idle time, an hour: nothing expires here
    const int port = live.server->metrics_port();
    EXPECT_EQ(Gauge(port, "tinkerd_samplers"), 0);
    v1::CreateSamplerRequest create;
    create.set_model_id(live.CreateModel());
    v1::SamplerInfo kept;
    ASSERT_TRUE(CreateSampler(live, create, &kept).ok());
    EXPECT_EQ(Gauge(port, "tinkerd_samplers"), 1);
    one = Gauge(port, "tinkerd_sampler_bytes");
    EXPECT_GT(one, 0) << "a LoRA sampler holds its adapter";
    grpc::ClientContext ctx;
    v1::SamplerRef del;
    del.set_sampler_id(kept.sampler_id());
    v1::DeleteSamplerResponse out;
    ASSERT_TRUE(live.stub->DeleteSampler(&ctx, del, &out).ok());
    EXPECT_EQ(Gauge(port, "tinkerd_samplers"), 0) << "deleted by the caller";
    EXPECT_EQ(Gauge(port, "tinkerd_sampler_bytes"), 0);
  }
  sc.sampling.sampler_idle = absl::Milliseconds(500);
  LiveServer live(sc);
  const int port = live.server->metrics_port();
  v1::CreateSamplerRequest create;
  create.set_model_id(live.CreateModel());
  v1::SamplerInfo idle;
  ASSERT_TRUE(CreateSampler(live, create, &idle).ok());
  WaitFor([&] { return Gauge(port, "tinkerd_samplers") == 0; }, "the idle sampler's expiry");
  EXPECT_EQ(Gauge(port, "tinkerd_sampler_bytes"), 0);
  // And it is gone for its owner too.
  v1::SampleRequest req = SampleReq("", 1, 2);
  req.set_sampler_id(idle.sampler_id());
  v1::SampleResponse out;
  EXPECT_EQ(Sample(live, req, &out).error_code(), grpc::StatusCode::NOT_FOUND);
}

// SampleStream's deltas concatenate to Sample's answer for the same request; a stream cancelled
// at any point (before its first message, after some) ends with its samples freed and nothing
// counted as sampled, and the reactor outlives none of its callbacks (this runs under ASan too).
TEST(SamplingE2e, SampleStreamIsTheSampleAndACancelledOneStops) {
  ServerConfig sc;
  sc.metrics_port = 0;
  LiveServer live(sc);
  const int port = live.server->metrics_port();
  const std::string model = live.CreateModel();
  v1::SampleRequest req = SampleReq(model, 31, 12);
  req.set_prompt_logprobs(true);
  v1::SampleResponse whole;
  ASSERT_TRUE(Sample(live, req, &whole).ok());

  std::vector<std::vector<int64_t>> tokens(2);
  std::vector<std::vector<double>> logprobs(2);
  std::vector<int> messages_with(2, 0);
  v1::SampleStreamResponse last;
  {
    grpc::ClientContext ctx;
    auto reader = live.stub->SampleStream(&ctx, req);
    v1::SampleStreamResponse m;
    while (reader->Read(&m)) {
      for (const v1::SampleDelta& d : m.deltas()) {
        ASSERT_TRUE(d.index() == 0 || d.index() == 1);
        tokens[d.index()].insert(tokens[d.index()].end(), d.tokens().begin(), d.tokens().end());
        logprobs[d.index()].insert(logprobs[d.index()].end(), d.logprobs().begin(),
                                   d.logprobs().end());
        ++messages_with[d.index()];
        EXPECT_EQ(d.stop_reason() != v1::STOP_REASON_UNSPECIFIED,
                  static_cast<int>(tokens[d.index()].size()) == 12);
      }
      last = m;
    }
    const grpc::Status st = reader->Finish();
    ASSERT_TRUE(st.ok()) << st.error_message();
  }
  for (int i = 0; i < 2; ++i) {
    EXPECT_GT(messages_with[i], 1) << "tokens arrive as they are decoded";
    EXPECT_EQ(tokens[i], std::vector<int64_t>(whole.sequences(i).tokens().begin(),
                                              whole.sequences(i).tokens().end()));
    ASSERT_EQ(logprobs[i].size(), 12u);
    for (int t = 0; t < 12; ++t) {
      // float64 model; the same tokens decoded in other batches: rounding apart.
      EXPECT_NEAR(logprobs[i][t], whole.sequences(i).logprobs(t), 1e-12);
    }
  }
  ASSERT_EQ(last.prompt_logprobs_size(), static_cast<int>(kPrompt.size()));
  EXPECT_TRUE(std::isnan(last.prompt_logprobs(0)));
  EXPECT_NEAR(last.prompt_logprobs(2), whole.prompt_logprobs(2), 1e-12);

  const double sampled = Gauge(port, "tinkerd_sampled_tokens_total");
  ASSERT_GE(sampled, 24);
  for (int reads = 0; reads < 6; ++reads) {
    // 32 samples of up to 250 tokens (the context is 256): hundreds of steps, so the cancel
    // arrives long before the end.
    v1::SampleRequest long_req = SampleReq(model, 40 + reads, 250);
    long_req.set_num_samples(32);
    grpc::ClientContext ctx;
    auto reader = live.stub->SampleStream(&ctx, long_req);
    v1::SampleStreamResponse m;
    for (int r = 0; r < reads; ++r) ASSERT_TRUE(reader->Read(&m));
    ctx.TryCancel();
    EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
    WaitFor([&] { return Gauge(port, "tinkerd_sample_sequences_running") == 0; },
            "the cancelled samples to be freed");
    EXPECT_EQ(Gauge(port, "tinkerd_sampled_tokens_total"), sampled) << reads << " reads";
  }
  v1::SampleRequest bad = req;
  bad.mutable_sampling_params()->set_max_tokens(0);
  grpc::ClientContext ctx;
  auto reader = live.stub->SampleStream(&ctx, bad);
  v1::SampleStreamResponse m;
  EXPECT_FALSE(reader->Read(&m));
  const grpc::Status st = reader->Finish();
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(st.error_message().find("max_tokens"), std::string::npos) << st.error_message();
}

TEST(SamplingE2e, BadRequestsAreNamedAndChangeNothing) {
  ServerConfig sc;
  sc.sampling.engine.max_sequences = 4;
  LiveServer live(sc);
  const std::string model = live.CreateModel();
  const std::vector<double> state = live.StateChecksum(model);
  struct Bad {
    std::function<void(v1::SampleRequest&)> edit;
    grpc::StatusCode code;
    std::string field;
  };
  const std::vector<Bad> cases = {
      {[](v1::SampleRequest& r) { r.mutable_sampling_params()->set_top_p(0); },
       grpc::StatusCode::INVALID_ARGUMENT, "top_p"},
      {[](v1::SampleRequest& r) { r.mutable_sampling_params()->set_temperature(-1); },
       grpc::StatusCode::INVALID_ARGUMENT, "temperature"},
      {[](v1::SampleRequest& r) { r.mutable_sampling_params()->set_max_tokens(0); },
       grpc::StatusCode::INVALID_ARGUMENT, "max_tokens"},
      {[](v1::SampleRequest& r) { r.mutable_sampling_params()->set_max_tokens(1000); },
       grpc::StatusCode::INVALID_ARGUMENT, "context"},
      {[](v1::SampleRequest& r) { r.mutable_prompt()->clear_chunks(); },
       grpc::StatusCode::INVALID_ARGUMENT, "prompt"},
      {[](v1::SampleRequest& r) { r.set_num_samples(5); }, grpc::StatusCode::INVALID_ARGUMENT,
       "sample_max_sequences"},
      {[](v1::SampleRequest& r) { r.set_sampler_id("sampler-nope"); }, grpc::StatusCode::NOT_FOUND,
       "sampler_id"},
      {[](v1::SampleRequest& r) { r.set_model_id("model-nope"); }, grpc::StatusCode::NOT_FOUND,
       "model_id"},
  };
  for (const Bad& bad : cases) {
    v1::SampleRequest req = SampleReq(model, 1);
    bad.edit(req);
    v1::SampleResponse out;
    const grpc::Status st = Sample(live, req, &out);
    EXPECT_EQ(st.error_code(), bad.code) << bad.field << ": " << st.error_message();
    EXPECT_NE(st.error_message().find(bad.field), std::string::npos) << st.error_message();
  }
  // A prompt longer than the context is the prompt's fault, in Sample and in ComputeLogprobs;
  // ComputeLogprobs scores a prompt of exactly the context (the limit sits where it should).
  const int64_t context = live.Info(model).max_context_length();
  ASSERT_GT(context, 0);
  auto logprobs = [&](int64_t length, v1::ComputeLogprobsResponse* out) {
    v1::ComputeLogprobsRequest lp;
    lp.set_model_id(model);
    for (int64_t t = 0; t < length; ++t) {
      lp.mutable_prompt()->add_chunks()->mutable_encoded_text()->add_tokens(t % 7);
    }
    grpc::ClientContext ctx;
    return live.stub->ComputeLogprobs(&ctx, lp, out);
  };
  v1::ComputeLogprobsResponse scored;
  const grpc::Status over = logprobs(context + 1, &scored);
  EXPECT_EQ(over.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << over.error_message();
  EXPECT_EQ(over.error_message().rfind("prompt: has ", 0), 0u) << over.error_message();
  const grpc::Status fits = logprobs(context, &scored);
  ASSERT_TRUE(fits.ok()) << fits.error_message();
  EXPECT_EQ(scored.logprobs_size(), context);
  v1::SampleRequest long_prompt = SampleReq(model, 1);
  long_prompt.mutable_prompt()->clear_chunks();
  for (int64_t t = 0; t <= context; ++t) {
    long_prompt.mutable_prompt()->add_chunks()->mutable_encoded_text()->add_tokens(t % 7);
  }
  v1::SampleResponse out;
  const grpc::Status too_long = Sample(live, long_prompt, &out);
  EXPECT_EQ(too_long.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(too_long.error_message().rfind("prompt: has ", 0), 0u) << too_long.error_message();

  EXPECT_EQ(live.StateChecksum(model), state);
  // And the server still samples.
  EXPECT_TRUE(Sample(live, SampleReq(model, 1), &out).ok());
}

// A sampler's copy of the weights is held in the memory account. Where a new one finds no room,
// the tenant's least recently used sampler goes to make it (as the per-tenant limits already
// made them go), rather than the new one being refused: an RL loop makes one every step. The
// budget here holds the model and one and a half copies.
TEST(SamplingE2e, ANewSamplerWithoutRoomEvictsTheTenantsLeastRecentlyUsedOne) {
  int64_t model_bytes = 0, copy_bytes = 0;
  {
    LiveServer probe;
    const std::string model = probe.CreateModel();
    model_bytes = probe.server->runner()->memory_account()->reserved();
    v1::CreateSamplerRequest req;
    req.set_model_id(model);
    v1::SamplerInfo info;
    ASSERT_TRUE(CreateSampler(probe, req, &info).ok());
    copy_bytes = probe.server->runner()->memory_account()->reserved() - model_bytes;
  }
  ASSERT_GT(copy_bytes, 0);
  LiveServer live({}, 4096, ComputeDType::kFloat64, false, model_bytes + copy_bytes * 3 / 2);
  const std::string model = live.CreateModel();
  v1::CreateSamplerRequest req;
  req.set_model_id(model);
  v1::SamplerInfo first, second;
  ASSERT_TRUE(CreateSampler(live, req, &first).ok());
  const grpc::Status made = CreateSampler(live, req, &second);
  ASSERT_TRUE(made.ok()) << made.error_message();
  EXPECT_EQ(live.server->runner()->memory_account()->reserved(), model_bytes + copy_bytes);
  auto remove = [&](const v1::SamplerInfo& sampler) {
    grpc::ClientContext ctx;
    v1::SamplerRef ref;
    ref.set_sampler_id(sampler.sampler_id());
    v1::DeleteSamplerResponse deleted;
    return live.stub->DeleteSampler(&ctx, ref, &deleted).error_code();
  };
  EXPECT_EQ(remove(first), grpc::StatusCode::NOT_FOUND) << "the first sampler was evicted";
  EXPECT_EQ(remove(second), grpc::StatusCode::OK);
  EXPECT_EQ(live.server->runner()->memory_account()->reserved(), model_bytes)
      << "a deleted sampler gave its copy back";
}

}  // namespace
}  // namespace tinkerd::testing
