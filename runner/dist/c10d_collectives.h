// Collectives over torch.distributed's c10d: rendezvous through a TCPStore on MASTER_ADDR:
// MASTER_PORT (rank 0 hosts it), a Gloo process group for control messages, counts and, on CPU,
// gradients; on CUDA, gradients go over NCCL (USE_C10D_NCCL builds). See Note [Reduce once] in
// collectives.h.
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "runner/dist/collectives.h"
#include "runner/dist/dist_config.h"

namespace tinkerd {

struct C10dOptions {
  // The model lives on a CUDA device: gradients are reduced over NCCL where LibTorch has it (a
  // second process group on the same store), else over Gloo through host memory.
  bool cuda_gradients = false;
};

// Blocks until every rank joined (or the timeout passed).
absl::StatusOr<std::shared_ptr<Collectives>> MakeC10dCollectives(const DistConfig& config,
                                                                 C10dOptions options = {});

}  // namespace tinkerd
