// tinkerd: the training server. With no --base_model it serves the embedded default model.
//   tinkerd --listen=127.0.0.1:50051 --base_model=/models/Qwen3-0.6B
//   tinkerd --base_model=student=/models/Qwen3-0.6B --base_model=teacher=/models/Qwen3-8B
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "runner/dist/c10d_collectives.h"
#include "runner/dist/dist_config.h"
#include "runner/util/cpu_environment.h"
#include "runner/util/log.h"
#include "runner/util/memory_limit.h"
#include "server/core/replicated_runner.h"
#include "server/core/scheduler.h"
#include "server/server.h"

ABSL_FLAG(std::string, listen, "127.0.0.1:50051",
          "address:port to serve gRPC on (port 0: any free port)");
ABSL_FLAG(std::string, base_model, "",
          "[NAME=]DIR: a Hugging Face model directory, served as NAME (default DIR); empty: the "
          "embedded default model. Given again: another base served beside the first, in one "
          "memory budget (world size 1 only); clients name a base in create_model and "
          "create_sampling_client, the first the default");
ABSL_FLAG(std::string, compute_dtype, "float32",
          "float32, float64, bfloat16 or float16 (base weights in it; fp32 master weights, "
          "gradients and Adam moments)");
ABSL_FLAG(bool, activation_checkpointing, false,
          "recompute each decoder layer in backward: activation memory of one layer");
ABSL_FLAG(std::string, device, "cpu",
          "cpu, cuda or cuda:N; with several ranks, cuda means cuda:LOCAL_RANK");
ABSL_FLAG(int64_t, micro_batch_tokens, 4096, "token budget of one packed micro-batch");
ABSL_FLAG(int, threads, 0, "LibTorch intra-op threads (0: LibTorch's default)");
ABSL_FLAG(int, max_models, 64, "models resident at once");
ABSL_FLAG(int64_t, max_model_mb, 0,
          "largest trainable state (parameters, gradients, AdamW moments) one model may hold, "
          "MiB (0: only the memory budget limits it)");
ABSL_FLAG(int64_t, memory_budget_mb, 0,
          "memory models' state, training calls and samples' KV caches may hold together, MiB "
          "(0: three quarters of what the process may still use once the base model is loaded)");
ABSL_FLAG(int, max_message_mb, 256, "largest request or response, MiB");
ABSL_FLAG(int, max_pending_per_model, 64, "queued requests per model before RESOURCE_EXHAUSTED");
ABSL_FLAG(int, max_pending_per_tenant, 1024,
          "queued requests over a tenant's models before RESOURCE_EXHAUSTED");
ABSL_FLAG(int64_t, join_tokens, 8192,
          "tokens of queued forward_backward calls of several LoRA models that may run in one "
          "shared pass over the base, each getting what it would alone (0: each call alone)");
ABSL_FLAG(bool, join_optim_steps, false,
          "queued optim_steps of several models share one multi-tensor AdamW (fewer kernel "
          "launches on a GPU; slower on small CPUs, where steps alone overlap the RPCs)");
ABSL_FLAG(int, max_models_per_tenant, 0,
          "models one tenant may hold (0: only --max_models bounds them)");
ABSL_FLAG(int, max_samples_per_tenant, 0,
          "samples one tenant may have running at once (0: only --sample_max_sequences bounds "
          "them); past it RESOURCE_EXHAUSTED");
ABSL_FLAG(int, result_cache_per_model, 256, "finished results kept per model for retries");
ABSL_FLAG(int, order_timeout_s, 60, "how long a request waits for an earlier seq_id");
ABSL_FLAG(int, shutdown_grace_s, 30, "on SIGTERM, time allowed for accepted work to finish");
ABSL_FLAG(int, stall_timeout_s, 1800,
          "health turns NOT_SERVING (gRPC health, /readyz, /healthz) while one call or sampling "
          "step has run longer than this; set it above the longest call you run, saves and loads "
          "of the largest checkpoint included (0: never)");
ABSL_FLAG(std::string, checkpoint_root, "/tmp/tinkerd-checkpoints",
          "directory holding tinker://<model_id>/<kind>/<name> checkpoints (kind weights, "
          "sampler_weights or external_weights) "
          "(shared storage when ranks run on several machines)");
ABSL_FLAG(std::string, api_keys_file, "",
          "file of 'tenant key' lines; empty: no authentication (fine on loopback only)");
ABSL_FLAG(std::string, tls_cert, "", "PEM server certificate (enables TLS)");
ABSL_FLAG(std::string, tls_key, "", "PEM server private key");
ABSL_FLAG(std::string, tls_client_ca, "", "PEM CA for client certificates (enables mutual TLS)");
ABSL_FLAG(int, metrics_port, -1,
          "serve Prometheus /metrics, /healthz and /readyz over HTTP on this port (-1: off)");
ABSL_FLAG(std::string, metrics_host, "127.0.0.1", "address the metrics endpoint binds to");
ABSL_FLAG(std::string, http_listen, "",
          "HOST:PORT of the Tinker HTTP API (/api/v1/..., what the Tinker Python SDK speaks); "
          "empty: off; port 0 picks a free port");
ABSL_FLAG(int, http_threads, 2, "threads serving the HTTP API (long polls take no thread)");
ABSL_FLAG(std::string, served_model_name, "",
          "the first base model's name (create_model's base_model); default: its NAME= in "
          "--base_model, else --base_model as given (or the embedded model's name)");
ABSL_FLAG(int, http_long_poll_s, 30,
          "how long retrieve_future waits for a result before answering try_again (< 45, the "
          "SDK's timeout)");
ABSL_FLAG(int, http_future_keep_s, 600, "how long a finished future's result stays retrievable");
ABSL_FLAG(int64_t, http_peek_bytes, 1 << 20,
          "a result this large or larger is first announced by its size to a client that allows "
          "it (retrieve_future's allow_metadata_only), which then fetches it within its budget of "
          "bytes in flight; 0: results are always sent whole");
ABSL_FLAG(int, http_session_idle_s, 0,
          "a Tinker session without a heartbeat for this long ends and its models are deleted "
          "(checkpoints stay); 0: never (the SDK heartbeats every 10 s)");
ABSL_FLAG(int, http_archive_url_ttl_s, 900,
          "how long a checkpoint's download URL (get_checkpoint_archive_url) works");
ABSL_FLAG(int, http_archive_downloads, 8,
          "checkpoint downloads streaming at once; past them a download answers 503 with "
          "Retry-After");
ABSL_FLAG(int64_t, http_body_mb_in_flight, 0,
          "HTTP request bodies being read or handled at once, every API key's together, MiB "
          "(0: four times --max_message_mb); past it a request is answered 429 before its body "
          "is read");
ABSL_FLAG(int64_t, http_body_mb_in_flight_per_key, 0,
          "the same for one API key, MiB (0: twice --max_message_mb)");
ABSL_FLAG(int, http_connections_per_key, 2048,
          "HTTP connections one API key may hold (each parks at most one long poll); past it "
          "429");
ABSL_FLAG(std::string, http_public_url, "",
          "this server's URL as clients reach it (say https://tinkerd.example.org behind a proxy "
          "that ends TLS), the start of checkpoint download URLs; empty: the request's Host");
ABSL_FLAG(int, sample_max_sequences, 256,
          "samples decoding at once, over all requests; past it Sample answers RESOURCE_EXHAUSTED");
ABSL_FLAG(int, sample_kv_cache_mb, 2048,
          "KV-cache memory reserved for running samples (prompt + num_samples * max_tokens per "
          "request); past it Sample answers RESOURCE_EXHAUSTED");
ABSL_FLAG(int64_t, sample_prefill_tokens_per_step, 8192,
          "prompt tokens that start prefilling in one decode step (one longer prompt runs alone); "
          "bounds a step, which a queued training call may wait for");
ABSL_FLAG(int, sampler_idle_s, 3600, "a sampler unused for this long is deleted");
ABSL_FLAG(int, sample_steps_between_jobs, 1,
          "decode steps at least between two training jobs while both have work (and as many "
          "as --sample_share gives)");
ABSL_FLAG(double, sample_share, tinkerd::SchedulerConfig{}.sample_share,
          "sampling's share of the time while sampling and training both have work, in [0, "
          "0.95]: after a training job, decode steps go on for its time x share / (1 - share) "
          "(and --sample_steps_between_jobs steps at least); 0: the step count alone");
ABSL_FLAG(int64_t, sampler_mb_per_tenant, 8192,
          "memory a tenant's samplers may hold beyond the base model (a LoRA sampler its adapter, "
          "a full fine-tune's or a merged export's its weights); a new sampler evicts the "
          "tenant's least recently used ones to fit");
ABSL_FLAG(int, nproc, 1,
          "data-parallel ranks to spawn on this machine (ignored when WORLD_SIZE is set, e.g. by "
          "torchrun, Slurm or Kubernetes)");
ABSL_FLAG(std::string, shard, "none",
          "data parallel: what each rank holds of a model's training state: none (a whole "
          "replica), optimizer (the parameters, and 1/N of the gradient sums and AdamW moments) or "
          "full (1/N of a full fine-tune's parameters as well, each layer gathered while it "
          "runs)");
ABSL_FLAG(bool, shard_base, false,
          "data parallel, with --shard=full: hold 1/N of the frozen base model on each rank as "
          "well, each layer gathered while it runs (LoRA on a base no one device holds); each "
          "sampler forward on it gathers the base too (one all-gather of it per decode step)");
ABSL_FLAG(bool, prefetch_layers, true,
          "with --shard=full: gather each micro-batch's next layer while this one computes (on "
          "a process group of its own), holding one layer more whole; CPU runs only for now");
ABSL_FLAG(int, expert_parallel, 1,
          "data parallel: groups of this many ranks split each routed layer's experts of a "
          "mixture-of-experts model, tokens travelling to their experts by all-to-all (must "
          "divide the ranks and the experts per layer; with --shard=none)");
ABSL_FLAG(int, collective_timeout_s, 600,
          "data parallel: a collective that takes longer fails and the server turns NOT_SERVING; "
          "must exceed the longest call's compute time");
ABSL_FLAG(int, heartbeat_s, 2, "data parallel: rank 0 pings idle ranks this often");

namespace {

// --nproc N without a launcher: this process becomes rank 0 and starts ranks 1..N-1 as copies of
// itself with torchrun's environment, exactly as an external launcher would.
std::vector<pid_t> SpawnLocalRanks(int nproc, char** argv) {
  const int port = tinkerd::FreeLoopbackPort();
  std::vector<pid_t> children;
  for (int rank = 1; rank < nproc; ++rank) {
    pid_t pid = fork();
    if (pid == 0) {
      tinkerd::SetLocalRankEnvironment(rank, nproc, port);
      execv("/proc/self/exe", argv);
      _exit(127);
    }
    children.push_back(pid);
  }
  tinkerd::SetLocalRankEnvironment(0, nproc, port);
  return children;
}

// Every value of --base_model, in order: absl keeps only the last of a repeated flag.
std::vector<std::string> BaseModelFlags(int argc, char** argv) {
  std::vector<std::string> out;
  for (int i = 1; i < argc; ++i) {
    absl::string_view arg = argv[i];
    if (arg == "--") break;
    if (!absl::ConsumePrefix(&arg, "--")) absl::ConsumePrefix(&arg, "-");
    if (!absl::ConsumePrefix(&arg, "base_model")) continue;
    if (absl::ConsumePrefix(&arg, "=")) {
      out.emplace_back(arg);
    } else if (arg.empty() && i + 1 < argc) {
      out.emplace_back(argv[++i]);
    }
  }
  return out;
}

// "NAME=DIR" as {NAME, DIR}; a value that is a directory itself, has no '=' or a '/' before it
// (a path such as runs/lr=1e-4), as {"", value}.
std::pair<std::string, std::string> SplitNamedBase(const std::string& value) {
  const size_t eq = value.find('=');
  std::error_code ec;
  if (eq == std::string::npos || eq == 0 || value.substr(0, eq).find('/') != std::string::npos ||
      std::filesystem::is_directory(value, ec)) {
    return {"", value};
  }
  return {value.substr(0, eq), value.substr(eq + 1)};
}

// The bases --base_model names, {name, directory} (name empty: the directory's), checked before
// anything loads: none is an empty directory, no two share a name, several only in one process.
absl::StatusOr<std::vector<std::pair<std::string, std::string>>> BasesOfFlags(int argc,
                                                                              char** argv) {
  std::vector<std::string> values = BaseModelFlags(argc, argv);
  // Where argv has none, the flag may still come from --flagfile or --fromenv: one base then.
  if (values.empty() || values.back() != absl::GetFlag(FLAGS_base_model)) {
    if (values.size() > 1) {
      return absl::InvalidArgumentError(
          "--base_model: given several times on the command line and once more elsewhere "
          "(--flagfile, --fromenv); give every base on the command line");
    }
    values = {absl::GetFlag(FLAGS_base_model)};
  }
  std::vector<std::pair<std::string, std::string>> bases;
  std::set<std::string> names;
  for (const std::string& value : values) {
    if (value.empty() && values.size() == 1) break;  // the embedded model
    auto [name, dir] = SplitNamedBase(value);
    if (dir.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--base_model: '", value, "' names no model directory"));
    }
    // The name it is served under: the first's may be --served_model_name.
    std::string served = name.empty() ? dir : name;
    if (bases.empty() && !absl::GetFlag(FLAGS_served_model_name).empty()) {
      served = absl::GetFlag(FLAGS_served_model_name);
    }
    if (!names.insert(served).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("--base_model: two bases are served as '", served, "'"));
    }
    bases.emplace_back(std::move(name), std::move(dir));
  }
  if (bases.empty()) bases.emplace_back("", tinkerd::kEmbeddedDefaultModel);
  if (bases.size() > 1 && absl::GetFlag(FLAGS_nproc) > 1) {
    return absl::InvalidArgumentError(
        "--base_model: several base models serve in one process only, not with --nproc > 1");
  }
  return bases;
}

}  // namespace

int main(int argc, char** argv) {
  tinkerd::PrepareCpuEnvironment(argv);  // first: it may re-execute the program
  const int arenas = tinkerd::CapMallocArenasUnderAddressSpaceLimit();
  absl::SetProgramUsageMessage("tinkerd: a Tinker-style training server over gRPC");
  absl::ParseCommandLine(argc, argv);
  const auto bases = BasesOfFlags(argc, argv);  // {name, directory}
  if (!bases.ok()) {
    std::fprintf(stderr, "tinkerd: %s\n", std::string(bases.status().message()).c_str());
    return 2;
  }
  std::vector<pid_t> children;
  if (absl::GetFlag(FLAGS_nproc) > 1 && std::getenv("WORLD_SIZE") == nullptr) {
    children = SpawnLocalRanks(absl::GetFlag(FLAGS_nproc), argv);
  }
  auto dist = tinkerd::DistConfigFromEnv();
  if (!dist.ok()) {
    std::fprintf(stderr, "tinkerd: %s\n", std::string(dist.status().message()).c_str());
    return 2;
  }
  dist->timeout = std::chrono::seconds(absl::GetFlag(FLAGS_collective_timeout_s));
  tinkerd::InitLogging(dist->rank);
  if (arenas > 0) {
    TLOG_INFO("RLIMIT_AS is set: malloc arenas capped at {} (MALLOC_ARENA_MAX overrides)", arenas);
  }
  // Signals are taken synchronously by sigwait below; block them before any thread starts so
  // that no gRPC or LibTorch thread receives them.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  tinkerd::RunnerConfig rc;
  rc.base_model_path = bases->front().second;
  if (bases->size() > 1 && dist->world_size > 1) {
    std::fprintf(stderr,
                 "tinkerd: --base_model: several base models serve in one process only (world "
                 "size 1)\n");
    return 2;
  }
  const auto dtype = tinkerd::ParseComputeDType(absl::GetFlag(FLAGS_compute_dtype));
  if (!dtype.ok()) {
    std::fprintf(stderr, "tinkerd: --compute_dtype: %s\n",
                 std::string(dtype.status().message()).c_str());
    return 2;
  }
  rc.compute_dtype = *dtype;
  rc.activation_checkpointing = absl::GetFlag(FLAGS_activation_checkpointing);
  rc.micro_batch_tokens = absl::GetFlag(FLAGS_micro_batch_tokens);
  rc.num_threads = absl::GetFlag(FLAGS_threads);
  rc.max_models = absl::GetFlag(FLAGS_max_models);
  rc.max_model_bytes = absl::GetFlag(FLAGS_max_model_mb) << 20;
  rc.memory_budget_bytes = absl::GetFlag(FLAGS_memory_budget_mb) << 20;
  rc.device = absl::GetFlag(FLAGS_device);
  const auto shard = tinkerd::ParseShardMode(absl::GetFlag(FLAGS_shard));
  if (!shard.ok()) {
    std::fprintf(stderr, "tinkerd: --shard: %s\n", std::string(shard.status().message()).c_str());
    return 2;
  }
  rc.shard = *shard;
  rc.shard_base = absl::GetFlag(FLAGS_shard_base);
  rc.prefetch_layers = absl::GetFlag(FLAGS_prefetch_layers);
  rc.expert_parallel = absl::GetFlag(FLAGS_expert_parallel);
  auto device = tinkerd::ParseDevice(rc.device);
  if (!device.ok()) {
    std::fprintf(stderr, "tinkerd: --device: %s\n", std::string(device.status().message()).c_str());
    return 2;
  }
  // One GPU per rank: "cuda" alone means this rank's local GPU.
  if (rc.device == "cuda" && dist->world_size > 1) {
    rc.device = "cuda:" + std::to_string(dist->local_rank);
  }
  if (dist->world_size > 1) {
    tinkerd::C10dOptions copts;
    copts.cuda_gradients = device->cuda;
    auto collectives = tinkerd::MakeC10dCollectives(*dist, copts);
    if (!collectives.ok()) {
      TLOG_ERROR("cannot join the job: {}", std::string(collectives.status().message()));
      return 1;
    }
    rc.collectives = *collectives;
  }
  auto runner = tinkerd::ModelRunner::Create(rc);
  if (!runner.ok()) {
    TLOG_ERROR("cannot start: {}", std::string(runner.status().message()));
    return 1;
  }
  if (dist->rank != 0) {
    // Ranks other than 0 serve no RPCs: they replay rank 0's commands until it shuts them down
    // (signals stay blocked: rank 0 decides when the job ends).
    absl::Status st = tinkerd::ReplicatedRunner::FollowerLoop(runner->get(), rc.collectives.get());
    return st.ok() ? 0 : 1;
  }
  tinkerd::ServerConfig sc;
  sc.listen_address = absl::GetFlag(FLAGS_listen);
  sc.max_message_bytes = absl::GetFlag(FLAGS_max_message_mb) << 20;
  sc.shutdown_grace = absl::Seconds(absl::GetFlag(FLAGS_shutdown_grace_s));
  sc.stall_timeout = absl::Seconds(absl::GetFlag(FLAGS_stall_timeout_s));
  sc.scheduler.max_pending_per_model = absl::GetFlag(FLAGS_max_pending_per_model);
  sc.scheduler.max_pending_per_tenant = absl::GetFlag(FLAGS_max_pending_per_tenant);
  sc.scheduler.max_models_per_tenant = absl::GetFlag(FLAGS_max_models_per_tenant);
  sc.sampling.max_samples_per_tenant = absl::GetFlag(FLAGS_max_samples_per_tenant);
  sc.scheduler.result_cache_per_model = absl::GetFlag(FLAGS_result_cache_per_model);
  sc.scheduler.order_timeout = absl::Seconds(absl::GetFlag(FLAGS_order_timeout_s));
  sc.scheduler.steps_between_jobs = absl::GetFlag(FLAGS_sample_steps_between_jobs);
  sc.scheduler.sample_share = absl::GetFlag(FLAGS_sample_share);
  sc.scheduler.join_tokens = absl::GetFlag(FLAGS_join_tokens);
  sc.join_optim_steps = absl::GetFlag(FLAGS_join_optim_steps);
  sc.heartbeat_interval = absl::Seconds(absl::GetFlag(FLAGS_heartbeat_s));
  sc.checkpoint_root = absl::GetFlag(FLAGS_checkpoint_root);
  sc.metrics_port = absl::GetFlag(FLAGS_metrics_port);
  sc.metrics_host = absl::GetFlag(FLAGS_metrics_host);
  sc.tls_cert_file = absl::GetFlag(FLAGS_tls_cert);
  sc.tls_key_file = absl::GetFlag(FLAGS_tls_key);
  sc.tls_client_ca_file = absl::GetFlag(FLAGS_tls_client_ca);
  sc.tinker_http.listen = absl::GetFlag(FLAGS_http_listen);
  sc.tinker_http.threads = absl::GetFlag(FLAGS_http_threads);
  sc.tinker_http.served_model_name = !absl::GetFlag(FLAGS_served_model_name).empty()
                                         ? absl::GetFlag(FLAGS_served_model_name)
                                     : !bases->front().first.empty() ? bases->front().first
                                                                     : rc.base_model_path;
  sc.tinker_http.max_body_bytes = sc.max_message_bytes;
  const int64_t in_flight_mb = absl::GetFlag(FLAGS_http_body_mb_in_flight);
  const int64_t per_key_mb = absl::GetFlag(FLAGS_http_body_mb_in_flight_per_key);
  sc.tinker_http.quota.body_bytes =
      in_flight_mb > 0 ? in_flight_mb << 20 : int64_t{4} * sc.max_message_bytes;
  sc.tinker_http.quota.body_bytes_per_key =
      per_key_mb > 0 ? per_key_mb << 20 : int64_t{2} * sc.max_message_bytes;
  sc.tinker_http.quota.connections_per_key = absl::GetFlag(FLAGS_http_connections_per_key);
  sc.tinker_http.futures.long_poll = absl::Seconds(absl::GetFlag(FLAGS_http_long_poll_s));
  sc.tinker_http.futures.keep = absl::Seconds(absl::GetFlag(FLAGS_http_future_keep_s));
  sc.tinker_http.peek_bytes = absl::GetFlag(FLAGS_http_peek_bytes);
  sc.tinker_http.session_idle = absl::Seconds(absl::GetFlag(FLAGS_http_session_idle_s));
  sc.tinker_http.archive.url_ttl = absl::Seconds(absl::GetFlag(FLAGS_http_archive_url_ttl_s));
  sc.tinker_http.archive.max_downloads = absl::GetFlag(FLAGS_http_archive_downloads);
  sc.tinker_http.archive.public_url = absl::GetFlag(FLAGS_http_public_url);
  sc.sampling.engine.max_sequences = absl::GetFlag(FLAGS_sample_max_sequences);
  sc.sampling.engine.kv_cache_bytes = int64_t{absl::GetFlag(FLAGS_sample_kv_cache_mb)} << 20;
  sc.sampling.engine.prefill_tokens_per_step = absl::GetFlag(FLAGS_sample_prefill_tokens_per_step);
  sc.sampling.sampler_idle = absl::Seconds(absl::GetFlag(FLAGS_sampler_idle_s));
  sc.sampling.max_sampler_bytes_per_tenant =
      std::max<int64_t>(0, absl::GetFlag(FLAGS_sampler_mb_per_tenant)) << 20;
  if (!absl::GetFlag(FLAGS_api_keys_file).empty()) {
    auto keys = tinkerd::ApiKeys::LoadFile(absl::GetFlag(FLAGS_api_keys_file));
    if (!keys.ok()) {
      TLOG_ERROR("cannot start: {}", std::string(keys.status().message()));
      return 1;
    }
    sc.api_keys = *keys;
  }
  // The other bases reserve in the first's account: one budget for every base, model and sample.
  std::vector<tinkerd::ServedRunner> more;
  for (size_t i = 1; i < bases->size(); ++i) {
    const auto& [name, dir] = (*bases)[i];
    tinkerd::RunnerConfig other = rc;
    other.base_model_path = dir;
    other.account = (*runner)->memory_account();
    auto r = tinkerd::ModelRunner::Create(other);
    if (!r.ok()) {
      TLOG_ERROR("cannot start: base model {}: {}", dir, std::string(r.status().message()));
      return 1;
    }
    more.push_back({name.empty() ? dir : name, *std::move(r)});
  }
  auto server = tinkerd::TinkerdServer::Start(sc, std::move(*runner), std::move(more));
  if (!server.ok()) {
    TLOG_ERROR("cannot start: {}", std::string(server.status().message()));
    return 1;
  }
  // Scripts read this line to learn the port when --listen asked for port 0.
  std::printf("tinkerd listening on port %d\n", (*server)->port());
  if ((*server)->tinker_http_port() > 0) {
    std::printf("tinkerd http listening on port %d\n", (*server)->tinker_http_port());
  }
  if ((*server)->metrics_port() > 0) {
    std::printf("tinkerd metrics listening on port %d\n", (*server)->metrics_port());
  }
  std::fflush(stdout);
  int sig = 0;
  sigwait(&signals, &sig);
  TLOG_INFO("received {}", sig == SIGTERM ? "SIGTERM" : "SIGINT");
  (*server)->Shutdown();
  int exit_code = 0;
  for (pid_t child : children) {
    int status = 0;
    waitpid(child, &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) exit_code = 1;
  }
  return exit_code;
}
