// End to end: the real gRPC server on a loopback port, driven over the wire.
#include <google/protobuf/util/message_differencer.h>

#include <future>

#include "tests/e2e/e2e_util.h"

namespace tinkerd::testing {
namespace {

TEST(E2E, FullLoopEqualsInProcessRunner) {
  LiveServer live({}, /*micro_batch_tokens=*/24);
  const std::string model = live.CreateModel("seq_mean_token_mean", 5);
  auto local = MakeRunner(live.model_dir, ComputeDType::kFloat64, 24);
  CreateModelOptions o;
  o.loss_reduction = LossReduction::kSeqMeanTokenMean;
  o.seed = 5;
  o.lora = LoraConfig{4, 8, true, true, true};
  const std::string local_id = *local->CreateModel(o);

  SplitMix64 g(2);
  int64_t seq = 1;
  for (int step = 0; step < 2; ++step) {
    for (int call = 0; call < 3; ++call) {
      auto data = RandomData(g, {3 + call, 17, 6}, "ppo", 128);
      v1::ForwardBackwardOutput out;
      ASSERT_TRUE(live.FwdBwd(MakeRequest(model, seq++, data, "ppo"), &out).ok());
      auto want = local->ForwardBackward(local_id, data, "ppo", {});
      ASSERT_TRUE(want.ok());
      EXPECT_EQ(out.metrics().at("loss:sum"), want->metrics.at("loss:sum"));
      ASSERT_EQ(out.outputs_size(), 3);
      EXPECT_EQ(out.outputs(1).logprobs().data(), Float32ToProto(want->outputs[1].logprobs).data());
    }
    v1::OptimStepResponse os;
    ASSERT_TRUE(live.Optim(model, seq++, &os).ok());
    AdamParams p;
    p.learning_rate = 1e-2;
    auto want = local->OptimStep(local_id, p);
    ASSERT_TRUE(want.ok());
    EXPECT_EQ(os.grad_norm(), want->grad_norm);
    EXPECT_EQ(os.step(), step + 1);
  }
  EXPECT_EQ(Flat(Snap(*live.server->runner(), model, StateKind::kParams)),
            Flat(Snap(*local, local_id, StateKind::kParams)));
  EXPECT_EQ(live.Info(model).next_seq_id(), seq);
}

TEST(E2E, RetryIsAppliedOnceAndConflictIsRefused) {
  LiveServer live;
  const std::string model = live.CreateModel();
  SplitMix64 g(3);
  auto req = MakeRequest(model, 1, RandomData(g, {9, 4}, "cross_entropy", 128));
  v1::ForwardBackwardOutput first, retry;
  ASSERT_TRUE(live.FwdBwd(req, &first).ok());
  const auto after_first = live.StateChecksum(model);
  ASSERT_TRUE(live.FwdBwd(req, &retry).ok());
  EXPECT_TRUE(google::protobuf::util::MessageDifferencer::Equals(first, retry));
  EXPECT_EQ(live.StateChecksum(model), after_first);  // not applied twice
  EXPECT_EQ(live.Info(model).accumulated_tokens(), first.metrics().at("num_tokens:sum"));

  auto other = MakeRequest(model, 1, RandomData(g, {5}, "cross_entropy", 128));
  v1::ForwardBackwardOutput out;
  EXPECT_EQ(live.FwdBwd(other, &out).error_code(), grpc::StatusCode::ALREADY_EXISTS);
  EXPECT_EQ(live.StateChecksum(model), after_first);

  // RetrieveResult returns the cached result again.
  grpc::ClientContext ctx;
  v1::RetrieveResultRequest rr;
  rr.set_model_id(model);
  rr.set_seq_id(1);
  v1::RetrieveResultResponse got;
  ASSERT_TRUE(live.stub->RetrieveResult(&ctx, rr, &got).ok());
  EXPECT_TRUE(google::protobuf::util::MessageDifferencer::Equals(got.forward_backward(), first));
}

TEST(E2E, OutOfOrderSeqIdsAreAppliedInOrder) {
  LiveServer live;
  const std::string model = live.CreateModel();
  SplitMix64 g(4);
  // optim_step (seq 2) arrives first; it must wait for forward_backward (seq 1), or it would
  // take a zero-gradient step and report num_tokens 0.
  auto optim = std::async(std::launch::async, [&] {
    v1::OptimStepResponse os;
    grpc::Status st = live.Optim(model, 2, &os);
    return std::make_pair(st, os);
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  v1::ForwardBackwardOutput out;
  ASSERT_TRUE(
      live.FwdBwd(MakeRequest(model, 1, RandomData(g, {8}, "cross_entropy", 128)), &out).ok());
  auto [st, os] = optim.get();
  ASSERT_TRUE(st.ok()) << st.error_message();
  EXPECT_EQ(os.num_tokens(), out.metrics().at("num_tokens:sum"));
  EXPECT_EQ(os.step(), 1);
}

TEST(E2E, BadRequestsGetTheirCodeAndChangeNothing) {
  ServerConfig sc;
  sc.max_message_bytes = 1 << 20;
  LiveServer live(sc);
  const std::string model = live.CreateModel();
  SplitMix64 g(5);
  v1::ForwardBackwardOutput out;
  ASSERT_TRUE(
      live.FwdBwd(MakeRequest(model, 1, RandomData(g, {6}, "cross_entropy", 128)), &out).ok());
  const auto checksum = live.StateChecksum(model);
  int64_t seq = 2;

  struct Case {
    std::string name;
    grpc::StatusCode code;
    std::string expect;  // substring of the message
    std::function<void(v1::ForwardBackwardRequest&)> mutate;
    bool consumes_seq = true;
  };
  const std::vector<Case> cases = {
      {"unknown model", grpc::StatusCode::NOT_FOUND, "no model",
       [](auto& r) { r.set_model_id("model-999"); }, false},
      {"unknown loss", grpc::StatusCode::INVALID_ARGUMENT, "unknown loss",
       [](auto& r) { r.mutable_loss_fn()->set_name("mse"); }},
      {"unknown config key", grpc::StatusCode::INVALID_ARGUMENT, "clip_epsilon",
       [](auto& r) { (*r.mutable_loss_fn()->mutable_config())["clip_epsilon"] = 0.2; }},
      {"token out of vocab", grpc::StatusCode::INVALID_ARGUMENT, "data[0].model_input: token 128",
       [](auto& r) {
         r.mutable_data(0)
             ->mutable_model_input()
             ->mutable_chunks(0)
             ->mutable_encoded_text()
             ->set_tokens(0, 128);
       }},
      {"length mismatch", grpc::StatusCode::INVALID_ARGUMENT,
       "does not match model_input: want [7]",
       [](auto& r) {
         (*r.mutable_data(0)->mutable_loss_fn_inputs())["weights"].mutable_data()->resize(8);
       }},
      {"ragged bytes", grpc::StatusCode::INVALID_ARGUMENT, "not a whole number",
       [](auto& r) {
         (*r.mutable_data(0)->mutable_loss_fn_inputs())["weights"].mutable_data()->resize(5);
       }},
      {"nan weight", grpc::StatusCode::INVALID_ARGUMENT, "not finite",
       [](auto& r) {
         float nan = NAN;
         (*r.mutable_data(0)->mutable_loss_fn_inputs())["weights"].mutable_data()->replace(
             0, 4, reinterpret_cast<char*>(&nan), 4);
       }},
      {"empty batch", grpc::StatusCode::INVALID_ARGUMENT, "no datums",
       [](auto& r) { r.clear_data(); }},
      {"empty datum", grpc::StatusCode::INVALID_ARGUMENT, "model_input: empty",
       [](auto& r) { r.mutable_data(0)->clear_model_input(); }},
      {"over context", grpc::StatusCode::INVALID_ARGUMENT, "context length",
       [&](auto& r) {
         SplitMix64 gg(1);
         *r.mutable_data(0) = ToProto(RandomData(gg, {300}, "cross_entropy", 128)[0]);
       }},
      {"seq_id zero", grpc::StatusCode::INVALID_ARGUMENT, "seq_id",
       [](auto& r) { r.set_seq_id(0); }, false},
      {"over size limit", grpc::StatusCode::RESOURCE_EXHAUSTED, "",
       [](auto& r) {
         (*r.mutable_data(0)->mutable_loss_fn_inputs())["padding"].set_data(
             std::string(2 << 20, 'x'));
       },
       false},
  };
  for (const Case& c : cases) {
    auto req = MakeRequest(model, seq, RandomData(g, {7}, "cross_entropy", 128));
    c.mutate(req);
    grpc::Status st = live.FwdBwd(req, &out);
    EXPECT_EQ(st.error_code(), c.code) << c.name << ": " << st.error_message();
    EXPECT_NE(st.error_message().find(c.expect), std::string::npos)
        << c.name << ": " << st.error_message();
    EXPECT_EQ(live.StateChecksum(model), checksum) << c.name;
    if (c.consumes_seq) ++seq;
    EXPECT_EQ(live.Info(model).next_seq_id(), seq) << c.name;  // still serving, order intact
  }
  // Bad optimizer parameters too.
  v1::OptimStepRequest bad;
  bad.set_model_id(model);
  bad.set_seq_id(seq++);
  bad.mutable_adam_params()->set_beta1(1.5);
  grpc::ClientContext ctx;
  v1::OptimStepResponse os;
  EXPECT_EQ(live.stub->OptimStep(&ctx, bad, &os).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(live.StateChecksum(model), checksum);
  // And the model still trains.
  ASSERT_TRUE(live.Optim(model, seq++, &os).ok());
  EXPECT_EQ(os.step(), 1);
}

TEST(E2E, QueueOverflowIsResourceExhaustedAndGapsTimeOut) {
  ServerConfig sc;
  sc.scheduler.max_pending_per_model = 3;
  sc.scheduler.order_timeout = absl::Milliseconds(800);
  LiveServer live(sc);
  const std::string model = live.CreateModel();
  SplitMix64 g(6);
  auto data = RandomData(g, {5}, "cross_entropy", 128);
  // seq 1 never comes, so seq 2..4 queue up; seq 5 finds the queue full.
  std::vector<std::future<grpc::Status>> waiting;
  for (int64_t s = 2; s <= 4; ++s) {
    waiting.push_back(std::async(std::launch::async, [&, s] {
      v1::ForwardBackwardOutput out;
      return live.FwdBwd(MakeRequest(model, s, data), &out);
    }));
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  v1::ForwardBackwardOutput out;
  grpc::Status full = live.FwdBwd(MakeRequest(model, 5, data), &out);
  EXPECT_EQ(full.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << full.error_message();
  for (auto& w : waiting) {
    grpc::Status st = w.get();
    EXPECT_EQ(st.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
    EXPECT_NE(st.error_message().find("seq_id 1"), std::string::npos) << st.error_message();
  }
  EXPECT_EQ(live.Info(model).accumulated_tokens(), 0);
  // The slot stayed open: the missing request still works, then the rest in order.
  ASSERT_TRUE(live.FwdBwd(MakeRequest(model, 1, data), &out).ok());
  ASSERT_TRUE(live.FwdBwd(MakeRequest(model, 2, data), &out).ok());
}

TEST(E2E, ConcurrentClientsOnDifferentModelsBothComplete) {
  LiveServer live({}, 4096, ComputeDType::kFloat32);
  const std::string a = live.CreateModel("token_mean", 1);
  const std::string b = live.CreateModel("sum", 2);
  auto train = [&](const std::string& model, uint64_t seed) {
    SplitMix64 g(seed);
    int64_t seq = 1;
    for (int step = 0; step < 4; ++step) {
      v1::ForwardBackwardOutput out;
      grpc::Status st = live.FwdBwd(
          MakeRequest(model, seq++, RandomData(g, {12, 30}, "cross_entropy", 128)), &out);
      if (!st.ok()) return st;
      v1::OptimStepResponse os;
      st = live.Optim(model, seq++, &os, 1e-3);
      if (!st.ok()) return st;
    }
    return grpc::Status::OK;
  };
  auto fa = std::async(std::launch::async, train, a, 1);
  auto fb = std::async(std::launch::async, train, b, 2);
  EXPECT_TRUE(fa.get().ok());
  EXPECT_TRUE(fb.get().ok());
  EXPECT_EQ(live.Info(a).step(), 4);
  EXPECT_EQ(live.Info(b).step(), 4);
}

TEST(E2E, StreamOfTrajectoriesEqualsOneCall) {
  LiveServer live({}, /*micro_batch_tokens=*/20);
  const std::string streamed = live.CreateModel("seq_mean_token_sum", 9);
  const std::string whole = live.CreateModel("seq_mean_token_sum", 9);
  SplitMix64 g(7);
  auto data = RandomData(g, {11, 3, 25, 8, 14, 2}, "importance_sampling", 128);

  grpc::ClientContext ctx;
  v1::ForwardBackwardOutput streamed_out;
  auto writer = live.stub->StreamForwardBackward(&ctx, &streamed_out);
  v1::StreamForwardBackwardMessage header;
  header.mutable_header()->set_model_id(streamed);
  header.mutable_header()->set_seq_id(1);
  header.mutable_header()->mutable_loss_fn()->set_name("importance_sampling");
  ASSERT_TRUE(writer->Write(header));
  for (const Datum& d : data) {
    v1::StreamForwardBackwardMessage m;
    *m.mutable_datum() = ToProto(d);
    ASSERT_TRUE(writer->Write(m));
    std::this_thread::sleep_for(std::chrono::milliseconds(20));  // trajectories trickle in
  }
  writer->WritesDone();
  grpc::Status st = writer->Finish();
  ASSERT_TRUE(st.ok()) << st.error_message();

  v1::ForwardBackwardOutput whole_out;
  ASSERT_TRUE(live.FwdBwd(MakeRequest(whole, 1, data, "importance_sampling"), &whole_out).ok());
  EXPECT_EQ(streamed_out.outputs_size(), whole_out.outputs_size());
  EXPECT_NEAR(streamed_out.metrics().at("loss:sum"), whole_out.metrics().at("loss:sum"), 1e-10);
  EXPECT_EQ(streamed_out.metrics().at("num_sequences:sum"),
            whole_out.metrics().at("num_sequences:sum"));
  const auto a = Flat(Snap(*live.server->runner(), streamed, StateKind::kGrads));
  const auto b = Flat(Snap(*live.server->runner(), whole, StateKind::kGrads));
  // Different micro-batch groupings reorder float64 sums: see accumulation_test.cc's kRelTol.
  EXPECT_LE(MaxAbsDiff(a, b), 1e-10 * MaxAbs(a));
  EXPECT_EQ(live.Info(streamed).next_seq_id(), 2);
}

TEST(E2E, StreamWithABadDatumChangesNothing) {
  LiveServer live({}, 10);
  const std::string model = live.CreateModel();
  SplitMix64 g(8);
  auto data = RandomData(g, {12, 9, 7}, "cross_entropy", 128);
  data[2].tokens[0] = 500;  // out of vocab, after two datums already ran
  const auto before = live.StateChecksum(model);
  grpc::ClientContext ctx;
  v1::ForwardBackwardOutput out;
  auto writer = live.stub->StreamForwardBackward(&ctx, &out);
  v1::StreamForwardBackwardMessage header;
  header.mutable_header()->set_model_id(model);
  header.mutable_header()->set_seq_id(1);
  header.mutable_header()->mutable_loss_fn()->set_name("cross_entropy");
  writer->Write(header);
  for (const Datum& d : data) {
    v1::StreamForwardBackwardMessage m;
    *m.mutable_datum() = ToProto(d);
    writer->Write(m);
  }
  writer->WritesDone();
  grpc::Status st = writer->Finish();
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(st.error_message().find("stream datum 2"), std::string::npos) << st.error_message();
  EXPECT_EQ(live.StateChecksum(model), before);
  EXPECT_EQ(live.Info(model).next_seq_id(), 2);
}

}  // namespace
}  // namespace tinkerd::testing
