// sft_example: supervised fine-tuning through a running tinkerd, start to finish.
//
// It trains a LoRA adapter on the synthetic task of tools/train_demo.cc (continue an arithmetic
// sequence of token ids) and shows the client's one idea worth copying: requests are futures, so
// a step's forward_backward and optim_step are both sent before waiting for either.
//
//   sft_example --target 127.0.0.1:50051      # with tinkerd already listening there
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "client/client.h"
#include "runner/util/rng.h"  // header-only, no LibTorch

ABSL_FLAG(std::string, target, "127.0.0.1:50051", "server address host:port");
ABSL_FLAG(int, steps, 40, "optimizer steps");
ABSL_FLAG(int, batch, 16, "sequences per step");
ABSL_FLAG(int, seq_len, 48, "tokens per sequence");
ABSL_FLAG(double, lr, 5e-3, "learning rate");

namespace {

namespace v1 = tinkerd::v1;
using tinkerd::client::Connection;
using tinkerd::client::TrainingClient;

int Fail(const char* what, const absl::Status& status) {
  std::fprintf(stderr, "%s: %s\n", what, status.ToString().c_str());
  return 1;
}

// A sequence t_k = (start + k·stride) mod 64 + 64: learnable from context, random per sequence.
// The model reads tokens[0..len) and is scored on predicting tokens[1..len].
v1::Datum ArithmeticSequence(tinkerd::SplitMix64& g, int len) {
  const int start = static_cast<int>(g.Next() % 64), stride = 1 + static_cast<int>(g.Next() % 5);
  std::vector<int64_t> seq(len + 1);
  for (int k = 0; k <= len; ++k) seq[k] = 64 + (start + k * stride) % 64;
  std::vector<float> weights(len, 1.0f);
  weights[0] = weights[1] = 0.0f;  // the first two tokens define the sequence; nothing to learn
  return tinkerd::client::MakeDatum(
      {seq.begin(), seq.end() - 1},
      {{"target_tokens", tinkerd::client::Int64Tensor({seq.begin() + 1, seq.end()})},
       {"weights", tinkerd::client::Float32Tensor(weights)}});
}

// The training loop. Returns the exit status: 0 iff the loss fell.
int Train(TrainingClient& model) {
  const int steps = absl::GetFlag(FLAGS_steps), batch_size = absl::GetFlag(FLAGS_batch);
  const int seq_len = absl::GetFlag(FLAGS_seq_len);
  v1::LossFn loss;
  loss.set_name("cross_entropy");
  v1::AdamParams adam;
  adam.set_learning_rate(absl::GetFlag(FLAGS_lr));  // other fields unset: Tinker's defaults

  tinkerd::SplitMix64 g(42);
  double first = 0, last = 0;
  for (int step = 1; step <= steps; ++step) {
    std::vector<v1::Datum> batch;
    for (int i = 0; i < batch_size; ++i) batch.push_back(ArithmeticSequence(g, seq_len));
    const auto t0 = std::chrono::steady_clock::now();

    // Pipelining: both requests leave now, before we wait on either. They carry consecutive
    // seq_ids and the server applies a model's requests in seq_id order, so the optimizer step
    // still sees exactly this batch's gradient — we just skip a round trip per step.
    auto fb = model.ForwardBackward(std::move(batch), loss);
    auto os = model.OptimStep(adam);

    auto fb_result = fb.get();
    auto os_result = os.get();
    if (!fb_result.ok()) return Fail("forward_backward", fb_result.status());
    if (!os_result.ok()) return Fail("optim_step", os_result.status());

    const double secs =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    // loss:sum is summed over valid tokens; divide by their count for a per-token figure.
    const double loss_per_token =
        fb_result->metrics().at("loss:sum") / fb_result->metrics().at("num_tokens:sum");
    if (step == 1) first = loss_per_token;
    last = loss_per_token;
    std::printf("step %3d  loss/token %.4f  grad_norm %.3f  %6.0f tokens/s\n", step, loss_per_token,
                os_result->grad_norm(), batch_size * seq_len / secs);
  }
  std::printf("loss/token went from %.4f to %.4f\n", first, last);
  return last < first ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  tinkerd::client::ClientOptions options;
  options.target = absl::GetFlag(FLAGS_target);
  auto conn = Connection::Create(options);  // connects lazily; the first call finds the server

  auto serving = conn->Health();
  if (!serving.ok()) return Fail("health", serving.status());
  if (!*serving) return Fail("health", absl::UnavailableError("server is not serving"));

  v1::CreateModelRequest create;
  create.mutable_lora()->set_rank(16);
  create.mutable_lora()->set_alpha(32);
  create.mutable_lora()->set_train_attn(true);
  create.mutable_lora()->set_train_mlp(true);  // train_unembed stays false
  auto info = conn->CreateModel(create);
  if (!info.ok()) return Fail("create_model", info.status());
  std::printf("model %s: %s, LoRA rank 16, %lld trainable parameters\n", info->model_id().c_str(),
              info->architecture().c_str(), static_cast<long long>(info->trainable_parameters()));

  // A fresh model expects seq_id 1 (Attach's default); to resume an existing model, pass its
  // GetInfo().next_seq_id() instead.
  std::unique_ptr<TrainingClient> model = conn->Attach(info->model_id());
  const int exit_code = Train(*model);

  if (auto status = conn->DeleteModel(info->model_id()); !status.ok()) {
    Fail("delete_model", status);  // reported, but the exit status is about training
  }
  return exit_code;
}
