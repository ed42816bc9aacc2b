// Prometheus metrics: requests by RPC and code, latency histograms per RPC, queue depth, tokens
// processed, optimizer steps (and skipped ones), checkpoint durations, sampling requests and
// sampled tokens; per tenant (labels bounded by the tenants of the API keys file, never a client's
// text): tokens trained and sampled, and the scheduler's account (TenantUsage). Thread-safe. RPC
// counts and latencies come from a gRPC server interceptor, so no handler is instrumented by hand.
#pragma once

#include <grpcpp/support/server_interceptor.h>

#include <array>
#include <functional>
#include <map>
#include <memory>
#include <string>

#include "absl/synchronization/mutex.h"

namespace tinkerd {

// One tenant's account at the scheduler (server/core/scheduler.h): the time its jobs ran, how
// many ran, how long they waited in the queue before their first step, and how many requests its
// queue limits refused, and how many of its jobs ran in a run shared with other models' (a
// shared run's time is charged to its jobs by their tokens).
struct TenantUsage {
  double scheduler_seconds = 0;
  int64_t jobs = 0;
  int64_t shared_jobs = 0;
  double queue_wait_seconds = 0;
  int64_t rejected = 0;
};
using TenantUsages = std::map<std::string, TenantUsage>;

class Metrics {
 public:
  void ObserveRpc(const std::string& method, int code, double seconds);
  // A Tinker HTTP API request: `endpoint` is a known route (or "unknown"), `status` the HTTP one.
  void ObserveHttp(const std::string& endpoint, int status, double seconds);
  // Tokens a tenant's forward_backward calls trained on.
  void AddTokens(const std::string& tenant, int64_t n);
  void AddOptimStep(bool skipped);
  // A Sample or ComputeLogprobs request the engine admitted; then what it produced, if it
  // completed (not when it failed or was cancelled).
  void AddSampleRequest();
  void AddSampled(const std::string& tenant, int64_t sequences, int64_t tokens);
  // Samples in the engine: + when a request is offered to it, - when it is refused or has ended.
  void AddRunningSamples(int64_t delta);
  // The samplers held (frozen policies) and their memory beyond the base model's weights.
  void SetSamplers(int64_t count, int64_t bytes);
  void ObserveCheckpoint(const std::string& op, double seconds);
  // Text exposition format 0.0.4; `queue_depth` and `usage` are read at render time.
  std::string Render(int64_t queue_depth, bool serving, const TenantUsages& usage = {}) const;

  // An interceptor factory feeding ObserveRpc; register it on the ServerBuilder.
  std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> InterceptorFactory();

 private:
  static constexpr std::array<double, 12> kBuckets = {0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                                                      0.5,   1,    2.5,   5,    10,  30};
  struct Histogram {
    std::array<int64_t, kBuckets.size()> counts{};
    int64_t total = 0;
    double sum = 0;
  };
  mutable absl::Mutex mu_;
  std::map<std::pair<std::string, int>, int64_t> requests_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, Histogram> latency_ ABSL_GUARDED_BY(mu_);
  std::map<std::pair<std::string, int>, int64_t> http_requests_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, Histogram> http_latency_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, Histogram> checkpoint_ ABSL_GUARDED_BY(mu_);
  int64_t tokens_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t steps_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t skipped_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t sample_requests_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t sampled_sequences_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t sampled_tokens_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t sample_sequences_running_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t samplers_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t sampler_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<std::string, int64_t> tenant_tokens_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, int64_t> tenant_sampled_ ABSL_GUARDED_BY(mu_);
};

// GET /metrics, /healthz (200 while the process makes progress), /readyz (200 only while
// serving) on `port` (cpp-httplib, its own thread). Port 0 picks a free one; port() tells which.
class MetricsHttpServer {
 public:
  // `stalled`: what has run too long (StallWatch), or empty.
  MetricsHttpServer(Metrics* metrics, std::function<int64_t()> queue_depth,
                    std::function<bool()> serving, std::function<std::string()> stalled,
                    std::function<TenantUsages()> usage);
  ~MetricsHttpServer();
  bool Start(const std::string& host, int port);
  int port() const { return port_; }
  void Stop();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  int port_ = 0;
};

}  // namespace tinkerd
