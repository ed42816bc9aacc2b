// In-process training demo: a LoRA adapter on the embedded default model learns a small
// synthetic task (continue an arithmetic sequence of token ids modulo a small range), printing
// the loss per step. No server yet: this exercises the runner exactly as the server will.
#include <chrono>
#include <cstdio>
#include <filesystem>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "runner/model/tiny_model.h"
#include "runner/model_runner.h"
#include "runner/util/log.h"
#include "runner/util/rng.h"

ABSL_FLAG(int, steps, 30, "optimizer steps");
ABSL_FLAG(int, batch, 16, "sequences per step");
ABSL_FLAG(int, seq_len, 48, "tokens per sequence");
ABSL_FLAG(double, lr, 2e-3, "learning rate");
ABSL_FLAG(int, threads, 0, "LibTorch intra-op threads (0: default)");
ABSL_FLAG(std::string, model_dir, "",
          "base model directory; empty writes the default model to a temp dir");

namespace {

// A sequence t_k = (start + k·stride) mod 64 + 64: learnable from context, random per sequence.
tinkerd::Datum MakeDatum(tinkerd::SplitMix64& g, int len) {
  const int start = static_cast<int>(g.Next() % 64), stride = 1 + static_cast<int>(g.Next() % 5);
  std::vector<int64_t> seq(len + 1);
  for (int k = 0; k <= len; ++k) seq[k] = 64 + (start + k * stride) % 64;
  tinkerd::Datum d;
  d.tokens.assign(seq.begin(), seq.end() - 1);
  std::vector<float> w(len, 1.0f);
  w[0] = w[1] = 0.0f;  // the first two tokens define the sequence; nothing to learn there
  d.loss_fn_inputs["target_tokens"] = tinkerd::TensorData::Int64({seq.begin() + 1, seq.end()});
  d.loss_fn_inputs["weights"] = tinkerd::TensorData::Float32(w);
  return d;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  tinkerd::InitLogging(0);
  std::string dir = absl::GetFlag(FLAGS_model_dir);
  if (dir.empty()) {
    dir = (std::filesystem::temp_directory_path() / "tinkerd-demo-model").string();
    tinkerd::TinyModelSpec spec{tinkerd::DefaultDemoConfig()};
    if (auto st = tinkerd::WriteTinyModel(dir, spec); !st.ok()) {
      std::fprintf(stderr, "%s\n", std::string(st.message()).c_str());
      return 1;
    }
  }
  tinkerd::RunnerConfig rc;
  rc.base_model_path = dir;
  rc.num_threads = absl::GetFlag(FLAGS_threads);
  auto runner = tinkerd::ModelRunner::Create(rc);
  if (!runner.ok()) {
    std::fprintf(stderr, "%s\n", std::string(runner.status().message()).c_str());
    return 1;
  }
  tinkerd::CreateModelOptions opts;
  opts.lora = tinkerd::LoraConfig{16, 32, true, true, false};
  auto id = (*runner)->CreateModel(opts);
  if (!id.ok()) return 1;
  auto info = (*runner)->GetInfo(*id);
  std::printf("model %s: %s, LoRA rank 16, %lld trainable parameters\n", id->c_str(),
              info->architecture.c_str(), static_cast<long long>(info->trainable_parameters));
  tinkerd::SplitMix64 g(42);
  tinkerd::AdamParams adam;
  adam.learning_rate = absl::GetFlag(FLAGS_lr);
  double first = 0, last = 0;
  for (int step = 1; step <= absl::GetFlag(FLAGS_steps); ++step) {
    std::vector<tinkerd::Datum> batch;
    for (int i = 0; i < absl::GetFlag(FLAGS_batch); ++i)
      batch.push_back(MakeDatum(g, absl::GetFlag(FLAGS_seq_len)));
    const auto t0 = std::chrono::steady_clock::now();
    auto fb = (*runner)->ForwardBackward(*id, batch, "cross_entropy", {});
    if (!fb.ok()) {
      std::fprintf(stderr, "forward_backward: %s\n", std::string(fb.status().message()).c_str());
      return 1;
    }
    auto os = (*runner)->OptimStep(*id, adam);
    if (!os.ok()) {
      std::fprintf(stderr, "optim_step: %s\n", std::string(os.status().message()).c_str());
      return 1;
    }
    const double secs =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const double ntok = fb->metrics.at("num_tokens:sum");
    const double mean_loss = fb->metrics.at("loss:sum") / ntok;
    if (step == 1) first = mean_loss;
    last = mean_loss;
    std::printf("step %3d  loss/token %.4f  grad_norm %.3f  %6.0f tokens/s\n", step, mean_loss,
                os->grad_norm, batch.size() * absl::GetFlag(FLAGS_seq_len) / secs);
  }
  std::printf("loss/token went from %.4f to %.4f\n", first, last);
  return last < first ? 0 : 1;
}
