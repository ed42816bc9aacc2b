// The data-parallel hook of the runner. At world size 1 every operation is the identity; the DP
// build provides an implementation over c10d (Gloo for control and CPU, NCCL for CUDA gradients).
//
// Note [Reduce once]: gradients are reduced exactly once per optimizer step, in OptimStep, over
// the accumulated buffers. Never per call (an accumulated buffer reduced per call counts earlier
// calls again), never zeroed per call. Counters are global: summed over ranks once per call.
// Sharded optimizer state reduces per call instead, into the owners' shards, and never again: see
// Note [Reduce once, sharded] in shard.h.
#pragma once

#include <ATen/ATen.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace tinkerd {

class Collectives {
 public:
  virtual ~Collectives() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  // In place: each tensor becomes the sum over ranks. (A DDP-style mean all-reduce followed by
  // multiplication by world_size is the same sum; implementations may do either.)
  virtual absl::Status AllReduceSumGradients(std::vector<at::Tensor>& grads) = 0;
  // Sharded state (runner/dist/shard.h). out_K = row `rank` of the sum over ranks of in_WK
  // ([W, K]). Gradients: no mean and no world-size factor, the plain sum.
  virtual absl::Status ReduceScatterSum(const at::Tensor& in_WK, at::Tensor& out_K) = 0;
  // Row r of out_WK ([W, K]) = rank r's in_K.
  virtual absl::Status AllGather(const at::Tensor& in_K, at::Tensor& out_WK) = 0;
  // In place: each count becomes the sum over ranks.
  virtual absl::Status AllReduceSumCounts(std::vector<int64_t>& counts) = 0;
  // In place: true on every rank when true on all (a call commits only if every rank succeeded).
  virtual absl::Status AllAgree(bool& ok) = 0;
  // In place: each value becomes the sum over ranks (loss sums, in double).
  virtual absl::Status AllReduceSumDoubles(std::vector<double>& values) = 0;
  // Every rank's bytes, indexed by rank, on every rank (per-datum outputs back to rank 0).
  virtual absl::StatusOr<std::vector<std::string>> AllGatherBytes(const std::string& mine) = 0;
  // Rank `root`'s bytes on every rank (rank 0 dispatching requests to the others).
  virtual absl::Status BroadcastBytes(std::string& bytes, int root) = 0;
  // Rows of in_ND to every rank and from every rank (expert parallelism's dispatch): the first
  // send_rows[0] rows go to rank 0, the next send_rows[1] to rank 1, ...; the result holds
  // recv_rows[0] rows from rank 0, then recv_rows[1] from rank 1, ... (each rank's recv_rows[r]
  // is rank r's send_rows for it). Bits travel unchanged, in any dtype.
  virtual absl::StatusOr<at::Tensor> AllToAll(const at::Tensor& in_ND,
                                              const std::vector<int64_t>& send_rows,
                                              const std::vector<int64_t>& recv_rows) = 0;
  // The ranks `ranks` (ascending, this rank among them) as a world of their own, numbered by
  // their position in `ranks`. Every member calls it with the same list; a list made a group
  // again is another group (its k-th is every member's k-th).
  virtual absl::StatusOr<std::shared_ptr<Collectives>> Subgroup(const std::vector<int>& ranks) = 0;
};

// World size 1.
std::shared_ptr<Collectives> MakeLocalCollectives();

}  // namespace tinkerd
