// Where this process sits in a data-parallel job, read from torchrun's environment variables
// (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), which Slurm and Kubernetes launchers
// set the same way.
#pragma once

#include <chrono>
#include <string>

#include "absl/status/statusor.h"

namespace tinkerd {

struct DistConfig {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  // Every collective fails after this long instead of hanging (a dead or stuck rank).
  std::chrono::milliseconds timeout{std::chrono::seconds(120)};
  // Size of one gradient all-reduce bucket; large models issue a few big collectives, not one
  // per tensor.
  int64_t bucket_bytes = 25 << 20;

  std::string DebugString() const;
};

// A TCP port on 127.0.0.1 that is free right now (for MASTER_PORT of local jobs and tests).
int FreeLoopbackPort();

// Sets torchrun's variables for rank `rank` of a job of `world_size` ranks on this host, with its
// rendezvous on 127.0.0.1:`master_port` (a process starting local ranks, before each exec).
void SetLocalRankEnvironment(int rank, int world_size, int master_port);

// InvalidArgument when a variable is malformed or inconsistent (RANK >= WORLD_SIZE, ...).
// Without WORLD_SIZE: a single process.
absl::StatusOr<DistConfig> DistConfigFromEnv();

}  // namespace tinkerd
