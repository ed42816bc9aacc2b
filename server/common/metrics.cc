#include "server/common/metrics.h"

#include <httplib.h>

#include <chrono>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace tinkerd {
namespace {

// A label value in the exposition format: backslash, double quote and newline escaped.
std::string LabelValue(const std::string& v) {
  std::string out;
  for (char c : v) {
    if (c == '\\' || c == '"') out += '\\';
    if (c == '\n') {
      out += "\\n";
      continue;
    }
    out += c;
  }
  return out;
}

class RpcInterceptor final : public grpc::experimental::Interceptor {
 public:
  RpcInterceptor(Metrics* m, std::string method)
      : metrics_(m), method_(std::move(method)), start_(std::chrono::steady_clock::now()) {}
  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(
            grpc::experimental::InterceptionHookPoints::PRE_SEND_STATUS)) {
      const double s =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
      metrics_->ObserveRpc(method_, static_cast<int>(methods->GetSendStatus().error_code()), s);
    }
    methods->Proceed();
  }

 private:
  Metrics* metrics_;
  std::string method_;
  std::chrono::steady_clock::time_point start_;
};

class Factory final : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  explicit Factory(Metrics* m) : metrics_(m) {}
  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override {
    std::string method = info->method();
    const size_t slash = method.rfind('/');
    return new RpcInterceptor(metrics_,
                              slash == std::string::npos ? method : method.substr(slash + 1));
  }

 private:
  Metrics* metrics_;
};

const char* CodeName(int code) {
  static const char* kNames[] = {"OK",
                                 "CANCELLED",
                                 "UNKNOWN",
                                 "INVALID_ARGUMENT",
                                 "DEADLINE_EXCEEDED",
                                 "NOT_FOUND",
                                 "ALREADY_EXISTS",
                                 "PERMISSION_DENIED",
                                 "RESOURCE_EXHAUSTED",
                                 "FAILED_PRECONDITION",
                                 "ABORTED",
                                 "OUT_OF_RANGE",
                                 "UNIMPLEMENTED",
                                 "INTERNAL",
                                 "UNAVAILABLE",
                                 "DATA_LOSS",
                                 "UNAUTHENTICATED"};
  return code >= 0 && code <= 16 ? kNames[code] : "UNKNOWN";
}

}  // namespace

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>
Metrics::InterceptorFactory() {
  return std::make_unique<Factory>(this);
}

void Metrics::ObserveRpc(const std::string& method, int code, double seconds) {
  absl::MutexLock lock(&mu_);
  ++requests_[{method, code}];
  Histogram& h = latency_[method];
  for (size_t i = 0; i < kBuckets.size(); ++i) h.counts[i] += seconds <= kBuckets[i];
  ++h.total;
  h.sum += seconds;
}

void Metrics::ObserveHttp(const std::string& endpoint, int status, double seconds) {
  absl::MutexLock lock(&mu_);
  ++http_requests_[{endpoint, status}];
  Histogram& h = http_latency_[endpoint];
  for (size_t i = 0; i < kBuckets.size(); ++i) h.counts[i] += seconds <= kBuckets[i];
  ++h.total;
  h.sum += seconds;
}

void Metrics::AddTokens(const std::string& tenant, int64_t n) {
  absl::MutexLock lock(&mu_);
  tokens_ += n;
  tenant_tokens_[tenant] += n;
}

void Metrics::AddSampleRequest() {
  absl::MutexLock lock(&mu_);
  ++sample_requests_;
}

void Metrics::AddSampled(const std::string& tenant, int64_t sequences, int64_t tokens) {
  absl::MutexLock lock(&mu_);
  sampled_sequences_ += sequences;
  sampled_tokens_ += tokens;
  tenant_sampled_[tenant] += tokens;
}

void Metrics::AddRunningSamples(int64_t delta) {
  absl::MutexLock lock(&mu_);
  sample_sequences_running_ += delta;
}

void Metrics::SetSamplers(int64_t count, int64_t bytes) {
  absl::MutexLock lock(&mu_);
  samplers_ = count;
  sampler_bytes_ = bytes;
}

void Metrics::AddOptimStep(bool skipped) {
  absl::MutexLock lock(&mu_);
  ++steps_;
  skipped_ += skipped;
}

void Metrics::ObserveCheckpoint(const std::string& op, double seconds) {
  absl::MutexLock lock(&mu_);
  Histogram& h = checkpoint_[op];
  for (size_t i = 0; i < kBuckets.size(); ++i) h.counts[i] += seconds <= kBuckets[i];
  ++h.total;
  h.sum += seconds;
}

std::string Metrics::Render(int64_t queue_depth, bool serving, const TenantUsages& usage) const {
  absl::MutexLock lock(&mu_);
  std::string out;
  auto histogram = [&](const std::string& name, const std::string& label,
                       const std::map<std::string, Histogram>& hs) {
    absl::StrAppend(&out, "# TYPE ", name, " histogram\n");
    for (const auto& [key, h] : hs) {
      for (size_t i = 0; i < kBuckets.size(); ++i) {
        absl::StrAppend(&out, name, "_bucket{", label, "=\"", key, "\",le=\"", kBuckets[i], "\"} ",
                        h.counts[i], "\n");
      }
      absl::StrAppend(&out, name, "_bucket{", label, "=\"", key, "\",le=\"+Inf\"} ", h.total, "\n");
      absl::StrAppend(&out, name, "_sum{", label, "=\"", key, "\"} ",
                      absl::StrFormat("%.6f", h.sum), "\n");
      absl::StrAppend(&out, name, "_count{", label, "=\"", key, "\"} ", h.total, "\n");
    }
  };
  absl::StrAppend(&out, "# HELP tinkerd_requests_total RPCs answered, by method and gRPC code.\n",
                  "# TYPE tinkerd_requests_total counter\n");
  for (const auto& [key, n] : requests_) {
    absl::StrAppend(&out, "tinkerd_requests_total{method=\"", key.first, "\",code=\"",
                    CodeName(key.second), "\"} ", n, "\n");
  }
  absl::StrAppend(&out, "# HELP tinkerd_request_duration_seconds RPC latency, by method.\n");
  histogram("tinkerd_request_duration_seconds", "method", latency_);
  absl::StrAppend(&out,
                  "# HELP tinkerd_http_requests_total Tinker HTTP API requests answered, by "
                  "endpoint and HTTP status.\n# TYPE tinkerd_http_requests_total counter\n");
  for (const auto& [key, n] : http_requests_) {
    absl::StrAppend(&out, "tinkerd_http_requests_total{endpoint=\"", key.first, "\",status=\"",
                    key.second, "\"} ", n, "\n");
  }
  absl::StrAppend(&out,
                  "# HELP tinkerd_http_request_duration_seconds Tinker HTTP API latency "
                  "(a long poll's includes its wait), by endpoint.\n");
  histogram("tinkerd_http_request_duration_seconds", "endpoint", http_latency_);
  absl::StrAppend(&out, "# HELP tinkerd_checkpoint_duration_seconds Checkpoint save/load time.\n");
  histogram("tinkerd_checkpoint_duration_seconds", "op", checkpoint_);
  absl::StrAppend(&out, "# TYPE tinkerd_queue_depth gauge\ntinkerd_queue_depth ", queue_depth,
                  "\n");
  absl::StrAppend(&out,
                  "# TYPE tinkerd_tokens_processed_total counter\ntinkerd_tokens_processed_total ",
                  tokens_, "\n");
  absl::StrAppend(&out,
                  "# TYPE tinkerd_optimizer_steps_total counter\ntinkerd_optimizer_steps_total ",
                  steps_, "\n");
  absl::StrAppend(&out, "# TYPE tinkerd_skipped_steps_total counter\ntinkerd_skipped_steps_total ",
                  skipped_, "\n");
  absl::StrAppend(&out,
                  "# TYPE tinkerd_sample_requests_total counter\ntinkerd_sample_requests_total ",
                  sample_requests_, "\n");
  absl::StrAppend(
      &out, "# TYPE tinkerd_sampled_sequences_total counter\ntinkerd_sampled_sequences_total ",
      sampled_sequences_, "\n");
  absl::StrAppend(&out,
                  "# TYPE tinkerd_sampled_tokens_total counter\ntinkerd_sampled_tokens_total ",
                  sampled_tokens_, "\n");
  absl::StrAppend(
      &out,
      "# HELP tinkerd_sample_sequences_running Samples admitted and not ended.\n"
      "# TYPE tinkerd_sample_sequences_running gauge\ntinkerd_sample_sequences_running ",
      sample_sequences_running_, "\n");
  absl::StrAppend(&out,
                  "# HELP tinkerd_samplers Samplers held (frozen policies), every tenant's.\n"
                  "# TYPE tinkerd_samplers gauge\ntinkerd_samplers ",
                  samplers_, "\n");
  absl::StrAppend(&out,
                  "# HELP tinkerd_sampler_bytes Memory the samplers hold beyond the base model's "
                  "weights.\n# TYPE tinkerd_sampler_bytes gauge\ntinkerd_sampler_bytes ",
                  sampler_bytes_, "\n");
  absl::StrAppend(&out, "# TYPE tinkerd_serving gauge\ntinkerd_serving ", serving ? 1 : 0, "\n");
  // Per tenant. Tenant names come from the keys file; escaped as label values all the same.
  auto per_tenant = [&](const std::string& name, const std::string& help, const auto& values,
                        auto value) {
    absl::StrAppend(&out, "# HELP ", name, " ", help, "\n# TYPE ", name, " counter\n");
    for (const auto& [tenant, v] : values) {
      absl::StrAppend(&out, name, "{tenant=\"", LabelValue(tenant), "\"} ", value(v), "\n");
    }
  };
  auto count = [](int64_t v) { return absl::StrCat(v); };
  per_tenant("tinkerd_tenant_tokens_trained_total",
             "Tokens a tenant's forward_backward calls "
             "trained on.",
             tenant_tokens_, count);
  per_tenant("tinkerd_tenant_tokens_sampled_total", "Tokens sampled for a tenant.", tenant_sampled_,
             count);
  per_tenant("tinkerd_tenant_scheduler_seconds_total", "Scheduler time a tenant's jobs ran.", usage,
             [](const TenantUsage& u) { return absl::StrFormat("%.6f", u.scheduler_seconds); });
  per_tenant("tinkerd_tenant_jobs_total", "A tenant's requests the scheduler ran.", usage,
             [](const TenantUsage& u) { return absl::StrCat(u.jobs); });
  per_tenant("tinkerd_tenant_shared_jobs_total",
             "A tenant's forward(_backward) calls that ran in one pass with other models' calls.",
             usage, [](const TenantUsage& u) { return absl::StrCat(u.shared_jobs); });
  per_tenant("tinkerd_tenant_queue_wait_seconds_total",
             "Time a tenant's requests waited in the queue before they began.", usage,
             [](const TenantUsage& u) { return absl::StrFormat("%.6f", u.queue_wait_seconds); });
  per_tenant("tinkerd_tenant_rejected_total",
             "A tenant's requests refused by the queue limits (RESOURCE_EXHAUSTED).", usage,
             [](const TenantUsage& u) { return absl::StrCat(u.rejected); });
  return out;
}

struct MetricsHttpServer::Impl {
  httplib::Server http;
  std::thread thread;
};

MetricsHttpServer::MetricsHttpServer(Metrics* metrics, std::function<int64_t()> queue_depth,
                                     std::function<bool()> serving,
                                     std::function<std::string()> stalled,
                                     std::function<TenantUsages()> usage)
    : impl_(std::make_unique<Impl>()) {
  impl_->http.Get("/metrics", [metrics, queue_depth, serving, usage](const httplib::Request&,
                                                                     httplib::Response& res) {
    res.set_content(metrics->Render(queue_depth(), serving(), usage()),
                    "text/plain; version=0.0.4");
  });
  // A stalled server answers but cannot get work done: only a restart may help.
  impl_->http.Get("/healthz", [stalled](const httplib::Request&, httplib::Response& res) {
    const std::string what = stalled();
    res.status = what.empty() ? 200 : 503;
    res.set_content(what.empty() ? "ok\n" : "stalled: " + what + "\n", "text/plain");
  });
  impl_->http.Get("/readyz", [serving](const httplib::Request&, httplib::Response& res) {
    const bool ok = serving();
    res.status = ok ? 200 : 503;
    res.set_content(ok ? "ready\n" : "not serving\n", "text/plain");
  });
}

MetricsHttpServer::~MetricsHttpServer() {
  Stop();
}

bool MetricsHttpServer::Start(const std::string& host, int port) {
  port_ = port == 0 ? impl_->http.bind_to_any_port(host.c_str())
                    : (impl_->http.bind_to_port(host.c_str(), port) ? port : -1);
  if (port_ <= 0) return false;
  impl_->thread = std::thread([this] { impl_->http.listen_after_bind(); });
  return true;
}

void MetricsHttpServer::Stop() {
  if (impl_->thread.joinable()) {
    impl_->http.stop();
    impl_->thread.join();
  }
}

}  // namespace tinkerd
