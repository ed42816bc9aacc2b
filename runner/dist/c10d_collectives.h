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
  // Gradients: DDP's mean all-reduce (each rank divides by world_size, then SUM), followed by the
  // multiplication by world_size that turns the mean back into the sum our semantics need.
  // Tests set this false to show that forgetting the factor is detected (a broken control).
  bool undo_mean_with_world_size = true;
  // The model lives on a CUDA device: gradients are reduced over NCCL where LibTorch has it (a
  // second process group on the same store), else over Gloo through host memory.
  bool cuda_gradients = false;
};

// Blocks until every rank joined (or the timeout passed).
absl::StatusOr<std::shared_ptr<Collectives>> MakeC10dCollectives(const DistConfig& config,
                                                                 C10dOptions options = {});

}  // namespace tinkerd
