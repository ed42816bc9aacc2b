// tinkerd: the training server. With no --base_model it serves the embedded default model.
//   tinkerd --listen=127.0.0.1:50051 --base_model=/models/Qwen3-0.6B
#include <csignal>
#include <cstdio>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "runner/util/log.h"
#include "server/server.h"

ABSL_FLAG(std::string, listen, "127.0.0.1:50051",
          "address:port to serve gRPC on (port 0: any free port)");
ABSL_FLAG(std::string, base_model, "",
          "Hugging Face model directory; empty: the embedded default model");
ABSL_FLAG(std::string, compute_dtype, "float32", "float32 or float64");
ABSL_FLAG(int64_t, micro_batch_tokens, 4096, "token budget of one packed micro-batch");
ABSL_FLAG(int, threads, 0, "LibTorch intra-op threads (0: LibTorch's default)");
ABSL_FLAG(int, max_models, 64, "models resident at once");
ABSL_FLAG(int, max_message_mb, 256, "largest request or response, MiB");
ABSL_FLAG(int, max_pending_per_model, 64, "queued requests per model before RESOURCE_EXHAUSTED");
ABSL_FLAG(int, result_cache_per_model, 256, "finished results kept per model for retries");
ABSL_FLAG(int, order_timeout_s, 60, "how long a request waits for an earlier seq_id");
ABSL_FLAG(int, shutdown_grace_s, 30, "on SIGTERM, time allowed for accepted work to finish");

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("tinkerd: a Tinker-style training server over gRPC");
  absl::ParseCommandLine(argc, argv);
  tinkerd::InitLogging(0);
  // Signals are taken synchronously by sigwait below; block them before any thread starts so
  // that no gRPC or LibTorch thread receives them.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  tinkerd::RunnerConfig rc;
  const std::string base = absl::GetFlag(FLAGS_base_model);
  rc.base_model_path = base.empty() ? tinkerd::kEmbeddedDefaultModel : base;
  const std::string dtype = absl::GetFlag(FLAGS_compute_dtype);
  if (dtype != "float32" && dtype != "float64") {
    std::fprintf(stderr, "tinkerd: --compute_dtype must be float32 or float64\n");
    return 2;
  }
  rc.compute_dtype =
      dtype == "float64" ? tinkerd::ComputeDType::kFloat64 : tinkerd::ComputeDType::kFloat32;
  rc.micro_batch_tokens = absl::GetFlag(FLAGS_micro_batch_tokens);
  rc.num_threads = absl::GetFlag(FLAGS_threads);
  rc.max_models = absl::GetFlag(FLAGS_max_models);
  auto runner = tinkerd::ModelRunner::Create(rc);
  if (!runner.ok()) {
    TLOG_ERROR("cannot start: {}", std::string(runner.status().message()));
    return 1;
  }
  tinkerd::ServerConfig sc;
  sc.listen_address = absl::GetFlag(FLAGS_listen);
  sc.max_message_bytes = absl::GetFlag(FLAGS_max_message_mb) << 20;
  sc.shutdown_grace = absl::Seconds(absl::GetFlag(FLAGS_shutdown_grace_s));
  sc.scheduler.max_pending_per_model = absl::GetFlag(FLAGS_max_pending_per_model);
  sc.scheduler.result_cache_per_model = absl::GetFlag(FLAGS_result_cache_per_model);
  sc.scheduler.order_timeout = absl::Seconds(absl::GetFlag(FLAGS_order_timeout_s));
  auto server = tinkerd::TinkerdServer::Start(sc, std::move(*runner));
  if (!server.ok()) {
    TLOG_ERROR("cannot start: {}", std::string(server.status().message()));
    return 1;
  }
  // Scripts read this line to learn the port when --listen asked for port 0.
  std::printf("tinkerd listening on port %d\n", (*server)->port());
  std::fflush(stdout);
  int sig = 0;
  sigwait(&signals, &sig);
  TLOG_INFO("received {}", sig == SIGTERM ? "SIGTERM" : "SIGINT");
  (*server)->Shutdown();
  return 0;
}
