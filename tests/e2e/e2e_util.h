// A real tinkerd server on a loopback port (in process) and helpers to talk to it.
#pragma once

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <chrono>
#include <cstdio>
#include <string>
#include <thread>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "server/core/convert.h"
#include "server/server.h"
#include "tests/built_binary.h"
#include "tests/test_util.h"
#include "tinkerd/v1/tinkerd.grpc.pb.h"

namespace tinkerd::testing {

// Polls `done` until it holds (a condition on the server's state), failing after 60 s.
template <typename F>
void WaitFor(F done, const char* what) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (!done()) {
    ASSERT_LT(std::chrono::steady_clock::now(), deadline) << "timed out waiting for " << what;
    std::this_thread::yield();
  }
}

// Σ of a counter's samples over its labels in a /metrics body.
inline int64_t CounterSum(const std::string& body, const std::string& name) {
  int64_t sum = 0;
  for (absl::string_view line : absl::StrSplit(body, '\n')) {
    if (!absl::StartsWith(line, name + "{")) continue;
    int64_t v = 0;
    if (absl::SimpleAtoi(line.substr(line.rfind(' ') + 1), &v)) sum += v;
  }
  return sum;
}

struct LiveServer {
  TempDir dir;
  std::string model_dir;
  std::unique_ptr<TinkerdServer> server;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::Tinkerd::Stub> stub;

  // `tokenizer`: the model directory gets tests/test_util.h's tokenizer.json (for stop strings).
  // `memory_budget_bytes`: the runner's memory account (0: the default).
  // `family`: the TinyConfig family of the served model.
  explicit LiveServer(ServerConfig sc = {}, int64_t micro_batch_tokens = 4096,
                      ComputeDType dt = ComputeDType::kFloat64, bool tokenizer = false,
                      int64_t memory_budget_bytes = 0, const std::string& family = "llama") {
    model_dir = WriteModel(dir, TinyConfig(family));
    if (tokenizer) WriteTokenizerJson(model_dir, TinyConfig(family).vocab_size);
    sc.listen_address = "127.0.0.1:0";
    sc.checkpoint_root = dir.Sub("checkpoints");
    auto runner =
        MakeRunner(model_dir, dt, micro_batch_tokens, ShardMode::kNone, memory_budget_bytes);
    auto s = TinkerdServer::Start(sc, std::move(runner));
    EXPECT_TRUE(s.ok()) << s.status().message();
    server = std::move(*s);
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(-1);
    args.SetMaxSendMessageSize(-1);
    channel = grpc::CreateCustomChannel("127.0.0.1:" + std::to_string(server->port()),
                                        grpc::InsecureChannelCredentials(), args);
    stub = v1::Tinkerd::NewStub(channel);
  }

  std::string CreateModel(const std::string& reduction = "token_mean", uint64_t seed = 3) {
    grpc::ClientContext ctx;
    v1::CreateModelRequest req;
    req.set_loss_reduction(reduction);
    req.set_seed(seed);
    req.mutable_lora()->set_rank(4);
    req.mutable_lora()->set_alpha(8);
    req.mutable_lora()->set_train_attn(true);
    req.mutable_lora()->set_train_mlp(true);
    req.mutable_lora()->set_train_unembed(true);
    v1::ModelInfo info;
    grpc::Status st = stub->CreateModel(&ctx, req, &info);
    EXPECT_TRUE(st.ok()) << st.error_message();
    return info.model_id();
  }

  grpc::Status FwdBwd(const v1::ForwardBackwardRequest& req, v1::ForwardBackwardOutput* out) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    return stub->ForwardBackward(&ctx, req, out);
  }

  grpc::Status Optim(const std::string& model, int64_t seq, v1::OptimStepResponse* out,
                     double lr = 1e-2) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    v1::OptimStepRequest req;
    req.set_model_id(model);
    req.set_seq_id(seq);
    req.mutable_adam_params()->set_learning_rate(lr);
    return stub->OptimStep(&ctx, req, out);
  }

  v1::ModelInfo Info(const std::string& model) {
    grpc::ClientContext ctx;
    v1::ModelRef ref;
    ref.set_model_id(model);
    v1::ModelInfo info;
    EXPECT_TRUE(stub->GetInfo(&ctx, ref, &info).ok());
    return info;
  }

  // Everything a request could change: parameters, gradients, moments, counters.
  std::vector<double> StateChecksum(const std::string& model) {
    std::vector<double> v;
    for (StateKind k : {StateKind::kParams, StateKind::kGrads, StateKind::kAdamExpAvg}) {
      auto s = Flat(Snap(*server->runner(), model, k));
      v.insert(v.end(), s.begin(), s.end());
    }
    const auto info = *server->runner()->GetInfo(model);
    v.push_back(static_cast<double>(info.accumulated_tokens));
    v.push_back(static_cast<double>(info.accumulated_sequences));
    v.push_back(static_cast<double>(info.step));
    return v;
  }
};

inline v1::Datum ToProto(const Datum& d) {
  v1::Datum out;
  auto* chunk = out.mutable_model_input()->add_chunks()->mutable_encoded_text();
  for (int64_t t : d.tokens) chunk->add_tokens(t);
  for (const auto& [key, t] : d.loss_fn_inputs) {
    v1::Tensor& pt = (*out.mutable_loss_fn_inputs())[key];
    if (t.dtype == TensorData::DType::kInt64) {
      pt.set_dtype(v1::INT64);
      pt.set_data(
          std::string(reinterpret_cast<const char*>(t.int64_data.data()), t.int64_data.size() * 8));
    } else {
      pt.set_dtype(v1::FLOAT32);
      pt.set_data(std::string(reinterpret_cast<const char*>(t.float32_data.data()),
                              t.float32_data.size() * 4));
    }
    // A 1-D tensor's shape is its length (the server reads an unset shape so); a [T, R, k] one
    // needs its own.
    if (t.shape.size() > 1) pt.mutable_shape()->Add(t.shape.begin(), t.shape.end());
  }
  return out;
}

inline v1::ForwardBackwardRequest MakeRequest(const std::string& model, int64_t seq,
                                              const std::vector<Datum>& data,
                                              const std::string& loss = "cross_entropy") {
  v1::ForwardBackwardRequest req;
  req.set_model_id(model);
  req.set_seq_id(seq);
  req.mutable_loss_fn()->set_name(loss);
  for (const Datum& d : data) *req.add_data() = ToProto(d);
  return req;
}

#ifdef TINKERCTL_BINARY
// Runs tinkerctl against `live` and returns (exit code, stdout and stderr).
inline std::pair<int, std::string> Ctl(const LiveServer& live, const std::string& args) {
  const std::string cmd = BuiltBinary(TINKERCTL_BINARY) +
                          " --target=127.0.0.1:" + std::to_string(live.server->port()) + " " +
                          args + " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  std::string out;
  char buf[512];
  while (fgets(buf, sizeof(buf), p) != nullptr) out += buf;
  const int status = pclose(p);
  return {WEXITSTATUS(status), out};
}
#endif

}  // namespace tinkerd::testing
