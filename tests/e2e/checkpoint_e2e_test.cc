// Checkpoints through the real server process: resume after a restart is bitwise, and paths,
// listing, deletion and exports behave over the wire.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>

#include "client/client.h"
#include "tests/e2e/e2e_util.h"

namespace tinkerd::testing {
namespace {

struct Proc {
  pid_t pid = -1;
  int port = 0;
};

Proc Start(const std::string& model, const std::string& root) {
  int out[2];
  EXPECT_EQ(pipe(out), 0);
  Proc p;
  const std::string tinkerd = BuiltBinary(TINKERD_BINARY);
  p.pid = fork();
  if (p.pid == 0) {
    dup2(out[1], STDOUT_FILENO);
    close(out[0]);
    const std::string a1 = "--base_model=" + model, a2 = "--checkpoint_root=" + root;
    // One thread: bitwise equality across processes must not depend on how a sum was split.
    execl(tinkerd.c_str(), "tinkerd", "--listen=127.0.0.1:0", "--threads=1", a1.c_str(), a2.c_str(),
          static_cast<char*>(nullptr));
    _exit(127);
  }
  close(out[1]);
  FILE* f = fdopen(out[0], "r");
  char line[512];
  while (fgets(line, sizeof(line), f) != nullptr) {
    if (sscanf(line, "tinkerd listening on port %d", &p.port) == 1) break;
  }
  return p;
}

void Stop(Proc& p) {
  kill(p.pid, SIGTERM);
  int status = 0;
  waitpid(p.pid, &status, 0);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
}

std::unique_ptr<v1::Tinkerd::Stub> Stub(const Proc& p) {
  return v1::Tinkerd::NewStub(grpc::CreateChannel("127.0.0.1:" + std::to_string(p.port),
                                                  grpc::InsecureChannelCredentials()));
}

// One step: forward_backward on batch k (seq), optim_step (seq+1). Returns the loss.
double TrainStep(v1::Tinkerd::Stub& stub, const std::string& model, int64_t& seq, int k) {
  SplitMix64 g(500 + k);
  v1::ForwardBackwardOutput out;
  grpc::ClientContext c1;
  EXPECT_TRUE(stub.ForwardBackward(
                      &c1,
                      MakeRequest(model, seq++, RandomData(g, {11, 4, 19}, "cross_entropy", 128)),
                      &out)
                  .ok());
  grpc::ClientContext c2;
  v1::OptimStepRequest req;
  req.set_model_id(model);
  req.set_seq_id(seq++);
  req.mutable_adam_params()->set_learning_rate(1e-2);
  v1::OptimStepResponse os;
  EXPECT_TRUE(stub.OptimStep(&c2, req, &os).ok());
  return out.metrics().at("loss:sum");
}

std::string ProbeLogprobs(v1::Tinkerd::Stub& stub, const std::string& model, int64_t& seq) {
  SplitMix64 g(77);
  auto req = MakeRequest(model, seq++, RandomData(g, {25}, "cross_entropy", 128));
  grpc::ClientContext ctx;
  v1::ForwardBackwardOutput out;
  EXPECT_TRUE(stub.Forward(&ctx, req, &out).ok());
  return out.outputs(0).logprobs().data();
}

std::string Create(v1::Tinkerd::Stub& stub) {
  grpc::ClientContext ctx;
  v1::CreateModelRequest req;
  req.set_seed(8);
  req.mutable_lora()->set_rank(4);
  req.mutable_lora()->set_train_attn(true);
  req.mutable_lora()->set_train_mlp(true);
  v1::ModelInfo info;
  EXPECT_TRUE(stub.CreateModel(&ctx, req, &info).ok());
  return info.model_id();
}

TEST(CheckpointE2E, ResumeAfterServerRestartIsBitwise) {
  TempDir dir;
  const std::string model = WriteModel(dir, TinyConfig("llama"));
  const int N = 2, M = 2;
  std::vector<double> want, got;
  std::string want_probe, got_probe;
  {
    Proc p = Start(model, dir.Sub("root-a"));
    auto stub = Stub(p);
    const std::string id = Create(*stub);
    int64_t seq = 1;
    for (int k = 0; k < N + M; ++k) want.push_back(TrainStep(*stub, id, seq, k));
    want_probe = ProbeLogprobs(*stub, id, seq);
    Stop(p);
  }
  std::string saved;
  {
    Proc p = Start(model, dir.Sub("root-b"));
    auto stub = Stub(p);
    const std::string id = Create(*stub);
    int64_t seq = 1;
    for (int k = 0; k < N; ++k) got.push_back(TrainStep(*stub, id, seq, k));
    grpc::ClientContext ctx;
    v1::SaveStateRequest req;
    req.set_model_id(id);
    req.set_seq_id(seq++);
    req.set_name("half");
    v1::SaveStateResponse resp;
    ASSERT_TRUE(stub->SaveState(&ctx, req, &resp).ok());
    saved = resp.path();
    EXPECT_EQ(saved, "tinker://" + id + "/weights/half");
    Stop(p);  // the process is gone; only the checkpoint remains
  }
  {
    Proc p = Start(model, dir.Sub("root-b"));
    auto stub = Stub(p);
    grpc::ClientContext ctx;
    v1::CreateModelFromStateRequest req;
    req.set_path(saved);
    req.set_with_optimizer(true);
    v1::ModelInfo info;
    grpc::Status st = stub->CreateModelFromState(&ctx, req, &info);
    ASSERT_TRUE(st.ok()) << st.error_message();
    EXPECT_EQ(info.step(), N);
    int64_t seq = 1;
    for (int k = N; k < N + M; ++k) got.push_back(TrainStep(*stub, info.model_id(), seq, k));
    got_probe = ProbeLogprobs(*stub, info.model_id(), seq);
    Stop(p);
  }
  EXPECT_EQ(got, want);
  EXPECT_EQ(got_probe, want_probe);  // the weights compute bit-identical logprobs
}

TEST(CheckpointE2E, PathsListDeleteAndRefusals) {
  LiveServer live;
  const std::string model = live.CreateModel();
  SplitMix64 g(2);
  v1::ForwardBackwardOutput out;
  ASSERT_TRUE(
      live.FwdBwd(MakeRequest(model, 1, RandomData(g, {6}, "cross_entropy", 128)), &out).ok());
  auto save = [&](int64_t seq, const std::string& name, bool include) {
    grpc::ClientContext ctx;
    v1::SaveStateRequest req;
    req.set_model_id(model);
    req.set_seq_id(seq);
    req.set_name(name);
    req.set_include_accumulated(include);
    v1::SaveStateResponse resp;
    return live.stub->SaveState(&ctx, req, &resp);
  };
  EXPECT_EQ(save(2, "x", false).error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(save(3, "../escape", true).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  ASSERT_TRUE(save(4, "with-grads", true).ok());
  EXPECT_EQ(save(5, "with-grads", true).error_code(), grpc::StatusCode::ALREADY_EXISTS);
  {
    grpc::ClientContext ctx;
    v1::SaveWeightsForSamplerRequest req;
    req.set_model_id(model);
    req.set_seq_id(6);
    req.set_name("adapter");
    v1::SaveWeightsForSamplerResponse resp;
    ASSERT_TRUE(live.stub->SaveWeightsForSampler(&ctx, req, &resp).ok());
    EXPECT_EQ(resp.path(), "tinker://" + model + "/sampler_weights/adapter");
  }
  {
    grpc::ClientContext ctx;
    v1::ListCheckpointsRequest req;
    req.set_model_id(model);
    v1::ListCheckpointsResponse resp;
    ASSERT_TRUE(live.stub->ListCheckpoints(&ctx, req, &resp).ok());
    ASSERT_EQ(resp.checkpoints_size(), 2);
    EXPECT_EQ(resp.checkpoints(0).kind(), "training");
    EXPECT_EQ(resp.checkpoints(1).kind(), "sampler");
  }
  for (const std::string& bad :
       std::vector<std::string>{"s3://bucket/x", "tinker://m/weights", "tinker://m/other/x",
                                "tinker://../weights/x", "tinker://m/weights/.hidden"}) {
    grpc::ClientContext ctx;
    v1::CreateModelFromStateRequest req;
    req.set_path(bad);
    v1::ModelInfo info;
    EXPECT_EQ(live.stub->CreateModelFromState(&ctx, req, &info).error_code(),
              grpc::StatusCode::INVALID_ARGUMENT)
        << bad;
  }
  {  // Sampler weights are not training state.
    grpc::ClientContext ctx;
    v1::CreateModelFromStateRequest req;
    req.set_path("tinker://" + model + "/sampler_weights/adapter");
    v1::ModelInfo info;
    EXPECT_EQ(live.stub->CreateModelFromState(&ctx, req, &info).error_code(),
              grpc::StatusCode::INVALID_ARGUMENT);
  }
  {
    grpc::ClientContext ctx;
    v1::DeleteCheckpointRequest req;
    req.set_path("tinker://" + model + "/weights/with-grads");
    v1::DeleteCheckpointResponse resp;
    EXPECT_TRUE(live.stub->DeleteCheckpoint(&ctx, req, &resp).ok());
    grpc::ClientContext again;
    EXPECT_EQ(live.stub->DeleteCheckpoint(&again, req, &resp).error_code(),
              grpc::StatusCode::NOT_FOUND);
  }
}

}  // namespace
}  // namespace tinkerd::testing
