// Typed configuration of the gRPC front end; set from flags in tinkerd_main.cc, logged at start.
#pragma once

#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "server/common/auth.h"
#include "server/core/scheduler.h"
#include "server/http/tinker_api_config.h"
#include "server/ops/sampling.h"

namespace tinkerd {

struct ServerConfig {
  std::string listen_address = "127.0.0.1:50051";  // port 0 picks a free port
  int max_message_bytes = 256 << 20;  // larger requests get RESOURCE_EXHAUSTED from gRPC
  absl::Duration shutdown_grace = absl::Seconds(30);
  // Health is NOT_SERVING while the scheduler's thread has run one item longer than this (zero:
  // never); see server/core/stall_watch.h.
  absl::Duration stall_timeout = absl::Seconds(1800);
  // Data parallel only: how often rank 0 pings the other ranks when idle. Must stay well below
  // the collective timeout, or idle ranks would time out waiting for the next command.
  absl::Duration heartbeat_interval = absl::Seconds(2);
  // Queued optim_steps of several models share one multi-tensor AdamW (runner/joint_call.h):
  // fewer kernel launches on a GPU; on a 2-vCPU CPU 1.5x slower than steps alone, whose work
  // overlaps the RPCs' (bench/RESULTS.md), hence off by default.
  bool join_optim_steps = false;
  // Where tinker://<model_id>/{weights,sampler_weights,external_weights}/<name> checkpoints are
  // stored.
  std::string checkpoint_root = "/tmp/tinkerd-checkpoints";
  // Prometheus /metrics, /healthz, /readyz over HTTP on this port (-1: off; 0: any free port).
  int metrics_port = -1;
  std::string metrics_host = "127.0.0.1";
  SchedulerConfig scheduler;
  ApiKeys api_keys = ApiKeys::Disabled();
  // TLS when cert and key are set (PEM files); mutual TLS when client_ca is set too.
  std::string tls_cert_file, tls_key_file, tls_client_ca_file;
  // The Tinker HTTP API beside gRPC (off unless tinker_http.listen is set).
  http::TinkerApiConfig tinker_http;
  // Sampling: the engine's bounds and the samplers' lifetime.
  SamplingConfig sampling;

  absl::Status Validate() const;
  std::string DebugString() const;
};

}  // namespace tinkerd
