// The cost of the gRPC path: the same training steps (forward_backward + optim_step on the same
// batch) run in process on a ModelRunner and through a real tinkerd server on loopback with the
// C++ client. Both sides use the embedded default model and identical data, one after the other.
//   build/bench/grpc_overhead_bench --steps=10 --seqs=16 --len=128
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "bench/overhead_util.h"
#include "client/client.h"
#include "runner/model_runner.h"
#include "runner/util/cpu_environment.h"
#include "runner/util/log.h"
#include "server/server.h"

ABSL_FLAG(int, steps, 10, "timed steps (after one warm-up step)");
ABSL_FLAG(int, seqs, 16, "sequences per forward_backward");
ABSL_FLAG(int, len, 128, "tokens per sequence");
ABSL_FLAG(int, threads, 0, "LibTorch intra-op threads (0: LibTorch default)");

namespace {

using Clock = std::chrono::steady_clock;
using tinkerd::bench::EmbeddedRunner;
using tinkerd::bench::MakeBatch;
using tinkerd::bench::Median;

}  // namespace

int main(int argc, char** argv) {
  tinkerd::PrepareCpuEnvironment(argv);  // first: it may re-execute the program
  absl::ParseCommandLine(argc, argv);
  tinkerd::InitLogging(0, spdlog::level::warn);
  const int steps = absl::GetFlag(FLAGS_steps);
  const auto batch = MakeBatch(absl::GetFlag(FLAGS_seqs), absl::GetFlag(FLAGS_len), 512);
  tinkerd::AdamParams adam;

  // Both sides live for the whole run and their steps alternate, so machine drift (this VM's
  // speed varies by tens of percent over minutes) affects them alike.
  auto local_runner = EmbeddedRunner(absl::GetFlag(FLAGS_threads));
  const std::string local_id = *local_runner->CreateModel(tinkerd::CreateModelOptions{});
  tinkerd::ServerConfig sc;
  sc.listen_address = "127.0.0.1:0";
  auto server = tinkerd::TinkerdServer::Start(sc, EmbeddedRunner(absl::GetFlag(FLAGS_threads)));
  if (!server.ok()) return 1;
  tinkerd::client::ClientOptions co;
  co.target = "127.0.0.1:" + std::to_string((*server)->port());
  auto conn = tinkerd::client::Connection::Create(co);
  auto info = conn->CreateModel(tinkerd::v1::CreateModelRequest());
  auto tc = conn->Attach(info->model_id());
  std::vector<tinkerd::v1::Datum> wire;
  for (const auto& d : batch) {
    wire.push_back(tinkerd::client::MakeDatum(
        d.tokens, {{"target_tokens",
                    tinkerd::client::Int64Tensor(d.loss_fn_inputs.at("target_tokens").int64_data)},
                   {"weights",
                    tinkerd::client::Float32Tensor(d.loss_fn_inputs.at("weights").float32_data)}}));
  }
  tinkerd::v1::LossFn loss;
  loss.set_name("cross_entropy");
  std::vector<double> local, remote;
  for (int s = 0; s <= steps; ++s) {
    auto t0 = Clock::now();
    if (!local_runner->ForwardBackward(local_id, batch, "cross_entropy", {}).ok()) return 1;
    if (!local_runner->OptimStep(local_id, adam).ok()) return 1;
    const double l = std::chrono::duration<double>(Clock::now() - t0).count();
    t0 = Clock::now();
    auto fb = tc->ForwardBackward(wire, loss);
    auto os = tc->OptimStep(tinkerd::v1::AdamParams());
    if (!fb.get().ok() || !os.get().ok()) return 1;
    const double r = std::chrono::duration<double>(Clock::now() - t0).count();
    if (s > 0) {  // step 0 warms both up
      local.push_back(l);
      remote.push_back(r);
    }
  }
  (*server)->Shutdown();

  const double l = Median(local), r = Median(remote);
  const int tokens = absl::GetFlag(FLAGS_seqs) * absl::GetFlag(FLAGS_len);
  std::printf("batch: %d sequences x %d tokens; %d timed steps; median step\n",
              absl::GetFlag(FLAGS_seqs), absl::GetFlag(FLAGS_len), steps);
  std::printf("in-process: %.4f s (%.0f tokens/s)\n", l, tokens / l);
  std::printf("gRPC:       %.4f s (%.0f tokens/s)\n", r, tokens / r);
  std::printf("gRPC / in-process step time: %.3fx (overhead %.1f ms per step)\n", r / l,
              (r - l) * 1e3);
  std::printf(
      "{\"bench\":\"grpc_overhead\",\"local_step_s\":%.6f,\"grpc_step_s\":%.6f,\"ratio\":%.4f}\n",
      l, r, r / l);
  return 0;
}
