// TinkerdServer: the gRPC server, its scheduler and health service around a ModelRunner per
// served base model. Used by the tinkerd binary and, in process on a loopback port, by the e2e
// tests.
#pragma once

#include <grpcpp/server.h>

#include <atomic>
#include <memory>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "runner/model_runner.h"
#include "server/common/metrics.h"
#include "server/core/bases.h"
#include "server/core/replicated_runner.h"
#include "server/core/scheduler.h"
#include "server/core/stall_watch.h"
#include "server/grpc/service.h"
#include "server/http/http_server.h"
#include "server/http/tinker_api.h"
#include "server/server_config.h"

namespace tinkerd {

// A base model served beside the first, under `name` (--base_model given again). Its runner
// reserves in the first's memory account (RunnerConfig::account).
struct ServedRunner {
  std::string name;
  std::unique_ptr<ModelRunner> runner;
};

class TinkerdServer {
 public:
  // `runner`: the first base model, the default, served as config.tinker_http.served_model_name
  // (else its path); `more`: the others (world size 1 only).
  static absl::StatusOr<std::unique_ptr<TinkerdServer>> Start(const ServerConfig& config,
                                                              std::unique_ptr<ModelRunner> runner,
                                                              std::vector<ServedRunner> more = {});
  ~TinkerdServer();  // Shutdown()

  int port() const { return port_; }
  // Graceful stop, as on SIGTERM: health turns NOT_SERVING, new requests are refused, requests
  // already accepted run to completion within the grace period, then everything stops.
  void Shutdown();
  ModelRunner* runner() const { return runner_.get(); }
  Scheduler* scheduler() const { return scheduler_.get(); }
  Ops* ops() const { return ops_.get(); }
  // False once a rank of a data-parallel job failed (health is NOT_SERVING then).
  bool healthy() const { return replicated_->healthy(); }
  // What health says: started, not stopping, not stalled (StallWatch) and no rank failed.
  bool serving() const { return serving_; }
  // The port of the Tinker HTTP API (0 when off).
  int tinker_http_port() const { return tinker_http_ ? tinker_http_->port() : 0; }
  // The HTTP port of /metrics, /healthz, /readyz (0 when off).
  int metrics_port() const { return http_ ? http_->port() : 0; }

 private:
  TinkerdServer() = default;
  // Sets gRPC health and /readyz from the conditions below (on any thread).
  void UpdateHealth();
  ServerConfig config_;
  std::unique_ptr<ModelRunner> runner_;
  std::unique_ptr<ReplicatedRunner> replicated_;
  std::vector<ServedRunner> more_;                                  // the other bases' runners,
  std::vector<std::unique_ptr<ReplicatedRunner>> more_replicated_;  // each at world size 1
  std::unique_ptr<Bases> bases_;
  std::unique_ptr<Metrics> metrics_;
  std::unique_ptr<MetricsHttpServer> http_;
  absl::Mutex health_mu_;
  std::atomic<bool> started_{false}, stopping_{false}, stalled_{false}, broken_{false};
  std::string stalled_what_ ABSL_GUARDED_BY(health_mu_);  // what runs too long; empty: nothing
  std::atomic<bool> serving_{false};                      // set by UpdateHealth alone
  std::unique_ptr<Scheduler> scheduler_;
  std::unique_ptr<StallWatch> stall_watch_;
  std::thread heartbeat_;
  absl::Mutex heartbeat_mu_;
  bool heartbeat_stop_ ABSL_GUARDED_BY(heartbeat_mu_) = false;
  std::unique_ptr<Ops> ops_;
  std::unique_ptr<Sampling> sampling_;
  std::unique_ptr<TinkerdService> service_;
  // The HTTP server before the API: the API (holding its parked polls' connections) goes first.
  std::unique_ptr<http::HttpServer> tinker_http_;
  std::unique_ptr<http::TinkerApi> tinker_api_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
  bool shut_down_ = false;
};

}  // namespace tinkerd
