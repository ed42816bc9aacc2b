#include "server/server.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/server_builder.h>

#include <filesystem>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "runner/checkpoint/store.h"
#include "runner/model/safetensors.h"
#include "runner/util/log.h"
#include "runner/util/status_macros.h"

namespace tinkerd {

absl::Status ServerConfig::Validate() const {
  if (listen_address.empty()) return absl::InvalidArgumentError("server: listen address is empty");
  if (stall_timeout < absl::ZeroDuration())
    return absl::InvalidArgumentError("server: stall_timeout < 0");
  if (max_message_bytes < 1024)
    return absl::InvalidArgumentError("server: max_message_bytes < 1 KiB");
  if (scheduler.max_pending_per_model < 1)
    return absl::InvalidArgumentError("server: max_pending_per_model < 1");
  if (scheduler.max_pending_per_tenant < 1)
    return absl::InvalidArgumentError("server: max_pending_per_tenant < 1");
  if (scheduler.max_models_per_tenant < 0)
    return absl::InvalidArgumentError("server: max_models_per_tenant < 0");
  if (sampling.max_samples_per_tenant < 0)
    return absl::InvalidArgumentError("server: max_samples_per_tenant < 0");
  if (scheduler.result_cache_per_model < 1)
    return absl::InvalidArgumentError("server: result_cache_per_model < 1");
  if (scheduler.order_timeout <= absl::ZeroDuration())
    return absl::InvalidArgumentError("server: order_timeout <= 0");
  if (scheduler.steps_between_jobs < 1)
    return absl::InvalidArgumentError("server: sample_steps_between_jobs < 1");
  // Up to 0.95: a queued job then waits at most 19 times the previous job's time.
  if (!(scheduler.sample_share >= 0 && scheduler.sample_share <= 0.95))
    return absl::InvalidArgumentError("server: sample_share must be in [0, 0.95]");
  if (scheduler.join_tokens < 0) return absl::InvalidArgumentError("server: join_tokens < 0");
  if (auto st = tinker_http.Validate(); !st.ok()) return st;
  if (sampling.engine.max_sequences < 1 || sampling.engine.kv_cache_bytes < 1)
    return absl::InvalidArgumentError("server: sample_max_sequences and sample_kv_cache_mb >= 1");
  if (sampling.engine.prefill_tokens_per_step < 1)
    return absl::InvalidArgumentError("server: sample_prefill_tokens_per_step < 1");
  if (sampling.sampler_idle <= absl::ZeroDuration())
    return absl::InvalidArgumentError("server: sampler_idle_s <= 0");
  if (sampling.max_sampler_bytes_per_tenant < 1)
    return absl::InvalidArgumentError("server: sampler_mb_per_tenant < 1");
  return absl::OkStatus();
}

std::string ServerConfig::DebugString() const {
  return absl::StrFormat(
      "listen=%s max_message_bytes=%d shutdown_grace=%s stall_timeout=%s "
      "max_pending_per_model=%d "
      "max_pending_per_tenant=%d max_models_per_tenant=%d max_samples_per_tenant=%d "
      "result_cache_per_model=%d order_timeout=%s checkpoint_root=%s "
      "auth=%s tls=%s %s "
      "sample_max_sequences=%d sample_kv_cache_bytes=%d sampler_idle=%s "
      "sampler_bytes_per_tenant=%d sample_steps_between_jobs=%d sample_share=%g "
      "sample_prefill_tokens_per_step=%d join_tokens=%d join_optim_steps=%v",
      listen_address, max_message_bytes, absl::FormatDuration(shutdown_grace),
      stall_timeout == absl::ZeroDuration() ? "off" : absl::FormatDuration(stall_timeout),
      scheduler.max_pending_per_model, scheduler.max_pending_per_tenant,
      scheduler.max_models_per_tenant, sampling.max_samples_per_tenant,
      scheduler.result_cache_per_model, absl::FormatDuration(scheduler.order_timeout),
      checkpoint_root, api_keys.enabled() ? "api_keys" : "off",
      tls_cert_file.empty() ? "off" : (tls_client_ca_file.empty() ? "tls" : "mtls"),
      tinker_http.DebugString(), sampling.engine.max_sequences, sampling.engine.kv_cache_bytes,
      absl::FormatDuration(sampling.sampler_idle), sampling.max_sampler_bytes_per_tenant,
      scheduler.steps_between_jobs, scheduler.sample_share, sampling.engine.prefill_tokens_per_step,
      scheduler.join_tokens, join_optim_steps);
}

namespace {

// Where a client's get_tokenizer() loads what the server matches stop strings with: the base's
// directory, when it has a tokenizer.
std::string TokenizerId(const ModelRunner& runner) {
  if (!runner.limits().tokenizer) return "";
  const std::string& base = runner.config().base_model_path;
  std::error_code ec;
  const std::filesystem::path dir = std::filesystem::absolute(base, ec);
  return ec ? base : dir.lexically_normal().string();
}

// What the account holds free at start-up, where the bases other than the first hold their
// weights for good.
int64_t Unheld(const MemoryAccount& account) {
  return account.capacity() - account.reserved();
}

}  // namespace

absl::StatusOr<std::unique_ptr<TinkerdServer>> TinkerdServer::Start(
    const ServerConfig& config, std::unique_ptr<ModelRunner> runner,
    std::vector<ServedRunner> more) {
  if (auto st = config.Validate(); !st.ok()) return st;
  std::unique_ptr<TinkerdServer> s(new TinkerdServer());
  s->config_ = config;
  s->runner_ = std::move(runner);
  s->replicated_ =
      std::make_unique<ReplicatedRunner>(s->runner_.get(), s->runner_->config().collectives);
  std::vector<Bases::Served> served;
  const std::string& first_name = config.tinker_http.served_model_name;
  served.push_back({{first_name.empty() ? s->runner_->config().base_model_path : first_name,
                     config.tinker_http.tokenizer_id.empty() ? TokenizerId(*s->runner_)
                                                             : config.tinker_http.tokenizer_id,
                     s->runner_->limits()},
                    s->replicated_.get()});
  s->more_ = std::move(more);
  for (const ServedRunner& m : s->more_) {
    if (m.runner->memory_account() != s->runner_->memory_account()) {
      return absl::InvalidArgumentError(
          absl::StrCat("server: base model '", m.name,
                       "' keeps its own memory account; several bases share the first's "
                       "(RunnerConfig::account)"));
    }
    s->more_replicated_.push_back(
        std::make_unique<ReplicatedRunner>(m.runner.get(), m.runner->config().collectives));
    served.push_back(
        {{m.name, TokenizerId(*m.runner), m.runner->limits()}, s->more_replicated_.back().get()});
  }
  ASSIGN_OR_RETURN(s->bases_, Bases::Create(std::move(served)));
  for (const Bases::Served& base : s->bases_->all()) {
    TLOG_INFO("base model '{}'{}: {} (tokenizer: {})", base.base.name,
              base.base.index == 0 ? " (the default)" : "",
              base.runner->local()->config().base_model_path,
              base.base.tokenizer_id.empty() ? "none" : base.base.tokenizer_id);
  }
  // Saves killed mid-way (SIGKILL, a crash) left temporaries and unreferenced versions behind.
  SweepCheckpointLeftovers(config.checkpoint_root);
  SchedulerConfig scheduler_config = config.scheduler;
  scheduler_config.tenant_limits = config.api_keys.limits();
  s->scheduler_ = std::make_unique<Scheduler>(scheduler_config);
  s->metrics_ = std::make_unique<Metrics>();
  // The account where what a front end holds in host memory is reserved: queued training calls'
  // requests, HTTP bodies and their DOMs. The runner's on the CPU in a single process; none on a
  // GPU (the account is the device's) or under data parallelism (rank 0 alone holds these, and
  // every rank must admit the same models).
  const absl::StatusOr<DeviceSpec> device = ParseDevice(s->runner_->config().device);
  const std::shared_ptr<MemoryAccount> host_account =
      s->replicated_->world_size() == 1 && device.ok() && !device->cuda
          ? s->runner_->memory_account()
          : nullptr;
  s->ops_ = std::make_unique<Ops>(s->bases_.get(), s->scheduler_.get(), config.checkpoint_root,
                                  s->metrics_.get(), host_account, config.join_optim_steps);
  SamplingConfig sampling_config = config.sampling;
  sampling_config.tenant_limits = config.api_keys.limits();
  // Samples' KV caches and training share one account: neither can take what the other holds.
  // Under data parallelism rank 0 samples alone, and its samples keep to --sample_kv_cache_mb
  // outside the account: every rank must admit the same models.
  if (s->replicated_->world_size() == 1) {
    sampling_config.engine.account = s->runner_->memory_account();
    // Samples hold at most half the account, however many a tenant sends: the other half stays
    // for models and training calls, so a flood of samples delays training, never starves it.
    // Half of what the other bases' weights leave of it: they hold theirs for the server's life.
    const int64_t half = Unheld(*sampling_config.engine.account) / 2;
    if (sampling_config.engine.kv_cache_bytes > half) {
      TLOG_INFO(
          "samples' KV caches: at most {} MiB, half the memory budget the bases leave (below "
          "--sample_kv_cache_mb={})",
          half >> 20, sampling_config.engine.kv_cache_bytes >> 20);
      sampling_config.engine.kv_cache_bytes = half;
    }
  }
  s->sampling_ = std::make_unique<Sampling>(s->ops_.get(), s->bases_.get(), s->scheduler_.get(),
                                            sampling_config);
  s->service_ =
      std::make_unique<TinkerdService>(s->ops_.get(), s->sampling_.get(), config.api_keys);

  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  std::shared_ptr<grpc::ServerCredentials> creds = grpc::InsecureServerCredentials();
  if (!config.tls_cert_file.empty() || !config.tls_key_file.empty()) {
    grpc::SslServerCredentialsOptions ssl(
        config.tls_client_ca_file.empty()
            ? GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE
            : GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
    auto cert = ReadFileToString(config.tls_cert_file);
    auto key = ReadFileToString(config.tls_key_file);
    if (!cert.ok() || !key.ok()) {
      return absl::InvalidArgumentError("tls: cannot read the certificate or key file");
    }
    ssl.pem_key_cert_pairs.push_back({*key, *cert});
    if (!config.tls_client_ca_file.empty()) {
      auto ca = ReadFileToString(config.tls_client_ca_file);
      if (!ca.ok()) return absl::InvalidArgumentError("tls: cannot read the client CA file");
      ssl.pem_root_certs = *ca;
    }
    creds = grpc::SslServerCredentials(ssl);
  }
  const bool loopback = config.listen_address.rfind("127.", 0) == 0 ||
                        config.listen_address.rfind("localhost:", 0) == 0 ||
                        config.listen_address.rfind("[::1]:", 0) == 0;
  if (!loopback && !config.api_keys.enabled()) {
    TLOG_WARN(
        "listening on {} without API keys: anyone who can reach it can train and read models; "
        "pass --api_keys_file",
        config.listen_address);
  }
  builder.AddListeningPort(config.listen_address, creds, &s->port_);
  builder.SetMaxReceiveMessageSize(config.max_message_bytes);
  builder.SetMaxSendMessageSize(config.max_message_bytes);
  builder.RegisterService(s->service_.get());
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> interceptors;
  interceptors.push_back(s->metrics_->InterceptorFactory());
  builder.experimental().SetInterceptorCreators(std::move(interceptors));
  s->server_ = builder.BuildAndStart();
  if (!s->server_ || s->port_ == 0) {
    return absl::UnavailableError(absl::StrCat("cannot listen on ", config.listen_address));
  }
  s->scheduler_->Start();
  TinkerdServer* raw = s.get();
  s->replicated_->set_on_broken([raw](const absl::Status&) {  // under the replicas' lock
    raw->broken_ = true;
    raw->UpdateHealth();
  });
  if (config.metrics_port >= 0) {
    s->http_ = std::make_unique<MetricsHttpServer>(
        s->metrics_.get(), [raw] { return raw->scheduler_->QueueDepth(); },
        [raw] { return raw->serving_.load(); },
        [raw] {
          absl::MutexLock lock(&raw->health_mu_);
          return raw->stalled_what_;
        },
        [raw] { return raw->scheduler_->Usage(); });
    if (!s->http_->Start(config.metrics_host, config.metrics_port)) {
      return absl::UnavailableError(
          absl::StrCat("cannot serve metrics on port ", config.metrics_port));
    }
    TLOG_INFO("metrics on http://{}:{}/metrics", config.metrics_host, s->http_->port());
  }
  if (!config.tinker_http.listen.empty()) {
    const std::string& listen = config.tinker_http.listen;
    const size_t colon = listen.rfind(':');
    int port = -1;
    if (colon != std::string::npos && !absl::SimpleAtoi(listen.substr(colon + 1), &port)) port = -1;
    if (port < 0 || port > 65535) {
      return absl::InvalidArgumentError(
          absl::StrCat("http: listen address '", listen, "' is not HOST:PORT"));
    }
    std::string host = listen.substr(0, colon);
    if (host.size() > 2 && host.front() == '[') host = host.substr(1, host.size() - 2);
    if (host == "localhost") host = "127.0.0.1";
    http::TinkerApiConfig api = config.tinker_http;
    // HTTP bodies and their parsed JSON hold at most a quarter of the account: with samples held
    // to half, a flood of either leaves training a quarter at least.
    if (host_account != nullptr) {
      api.account = MemoryAccount::CreateShare(
          host_account, Unheld(*host_account) / 4,
          "the quarter of the memory budget for HTTP bodies and their parsed JSON");
    }
    s->tinker_api_ =
        std::make_unique<http::TinkerApi>(s->ops_.get(), s->sampling_.get(), config.api_keys, api,
                                          [raw](absl::Duration delay, std::function<void()> fn) {
                                            raw->tinker_http_->After(delay, std::move(fn));
                                          });
    http::HttpServerConfig hc;
    hc.host = host;
    hc.port = port;
    hc.threads = config.tinker_http.threads;
    hc.max_body_bytes = config.tinker_http.max_body_bytes;
    hc.quota = config.tinker_http.quota;
    hc.account = api.account;                 // bodies in flight, beside their DOMs
    hc.tls_cert_file = config.tls_cert_file;  // the same certificate and clients as gRPC
    hc.tls_key_file = config.tls_key_file;
    hc.tls_client_ca_file = config.tls_client_ca_file;
    http::TinkerApi* tinker = s->tinker_api_.get();
    auto server = http::HttpServer::Start(
        hc,
        [tinker](http::Request req, http::Respond respond) {
          tinker->Handle(std::move(req), std::move(respond));
        },
        [tinker](const http::Request& head) { return tinker->Admit(head); });
    if (!server.ok()) return server.status();
    s->tinker_http_ = *std::move(server);
    s->tinker_api_->StartReaper();
    if (host != "127.0.0.1" && host != "::1" && !config.api_keys.enabled()) {
      TLOG_WARN("Tinker HTTP API on {} without API keys: pass --api_keys_file", listen);
    }
    TLOG_INFO("Tinker HTTP API on {}://{}:{}/api/v1/",
              config.tls_cert_file.empty() ? "http" : "https", host, s->tinker_http_->port());
  }
  if (s->replicated_->world_size() > 1) {
    s->heartbeat_ = std::thread([raw] {
      absl::MutexLock lock(&raw->heartbeat_mu_);
      while (!raw->heartbeat_mu_.AwaitWithTimeout(absl::Condition(&raw->heartbeat_stop_),
                                                  raw->config_.heartbeat_interval)) {
        raw->heartbeat_mu_.Unlock();
        (void)raw->replicated_->Ping();
        raw->heartbeat_mu_.Lock();
      }
    });
  }
  if (config.stall_timeout > absl::ZeroDuration()) {
    s->stall_watch_ = std::make_unique<StallWatch>([raw] { return raw->scheduler_->Current(); },
                                                   config.stall_timeout,
                                                   [raw](bool stalled, const std::string& what) {
                                                     {
                                                       absl::MutexLock lock(&raw->health_mu_);
                                                       raw->stalled_what_ = stalled ? what : "";
                                                     }
                                                     raw->stalled_ = stalled;
                                                     raw->UpdateHealth();
                                                   });
  }
  s->started_ = true;
  s->UpdateHealth();
  TLOG_INFO("tinkerd serving on port {} | {}", s->port_, config.DebugString());
  return s;
}

void TinkerdServer::Shutdown() {
  if (shut_down_) return;
  shut_down_ = true;
  TLOG_INFO("shutting down: not serving; finishing accepted work (grace {})",
            absl::FormatDuration(config_.shutdown_grace));
  stopping_ = true;
  UpdateHealth();
  // Order matters: the RPCs in flight wait on the scheduler, so it keeps running while gRPC
  // stops accepting and waits for them; then the scheduler is stopped.
  // Samples still running then fail UNAVAILABLE (the scheduler no longer steps them).
  std::thread drain([this] {
    scheduler_->Stop(config_.shutdown_grace);
    sampling_->Stop();
  });
  server_->Shutdown(std::chrono::system_clock::now() +
                    absl::ToChronoSeconds(config_.shutdown_grace));
  drain.join();
  server_->Wait();
  stall_watch_.reset();
  if (heartbeat_.joinable()) {
    {
      absl::MutexLock lock(&heartbeat_mu_);
      heartbeat_stop_ = true;
    }
    heartbeat_.join();
  }
  // The HTTP API kept serving polls while the scheduler drained; now nothing finishes any more.
  if (tinker_api_) tinker_api_->Close();
  if (tinker_http_) tinker_http_->Stop();
  replicated_->Shutdown();  // the other ranks exit after the last request
  if (http_) http_->Stop();
  TLOG_INFO("shut down");
}

void TinkerdServer::UpdateHealth() {
  absl::MutexLock lock(&health_mu_);
  const bool serving = started_ && !stopping_ && !stalled_ && !broken_;
  if (serving == serving_) return;
  serving_ = serving;
  server_->GetHealthCheckService()->SetServingStatus(serving);
}

TinkerdServer::~TinkerdServer() {
  if (server_) Shutdown();
}

}  // namespace tinkerd
