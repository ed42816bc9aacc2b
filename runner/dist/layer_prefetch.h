// Gathers a sharded model's decoder layers ahead of their use (--shard=full, --shard_base), so
// that the next layer's all-gather runs while this one computes.
//
// A micro-batch asks for its layers in an order known before it runs: its forward's 0..L-1, then,
// under a backward, its recompute's L-1..0 (a recompute may stop early: the layers below the
// first one with a gradient to make are not rerun). A thread of its own runs the gathers of that
// schedule in order, each at most `depth` ahead of the last one handed out, on a process group of
// their own (Collectives::Subgroup of every rank), so that the main thread's collectives (the
// backward's reduce-scatters, experts' exchanges) run meanwhile on theirs. Which gathers run
// depends only on the sequence of Takes, which every rank makes alike: every rank's gather group
// runs the same sequence, and a layer the schedule holds but no Take asks for is gathered and
// dropped, on every rank, rather than skipped on some.
//
// Memory: `depth` layers whole besides the one in use (runner/call_memory.h counts them).
//
// CPU only for now (ModelRunner makes no gather group on CUDA): with NCCL, each collective's
// stream waits on the caller's current stream, so two threads enqueueing on the default stream
// would chain the two groups in an order set by timing. A CUDA prefetch needs a stream of its
// own for the gathers and an event per handed-out layer.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

#include "runner/model/transformer.h"

namespace tinkerd {

class LayerPrefetch {
 public:
  // `gather(layer)` gathers a layer whole (on the gather group; it throws when the collective
  // fails), run on the prefetch thread with `device` current.
  LayerPrefetch(std::function<LayerWeights(int64_t layer)> gather, std::vector<int64_t> schedule,
                at::Device device, int depth = 1);
  // Runs every gather the Takes so far allow (a collective every rank runs), then ends the thread.
  ~LayerPrefetch();
  LayerPrefetch(const LayerPrefetch&) = delete;
  LayerPrefetch& operator=(const LayerPrefetch&) = delete;

  // The next layer of the schedule that is `layer`, whole; the ones before it are dropped.
  // Throws what its gather threw, or when the schedule holds no more `layer`.
  LayerWeights Take(int64_t layer);

  // A micro-batch's schedule: the forward's layers, then the backward's recompute.
  static std::vector<int64_t> Schedule(int64_t layers, bool backward);

 private:
  void Run(at::Device device);

  const std::function<LayerWeights(int64_t)> gather_;
  const std::vector<int64_t> schedule_;
  const size_t depth_;
  std::mutex mu_;
  std::condition_variable cv_;
  size_t next_ = 0;                       // the schedule's next entry to hand out
  bool ending_ = false;                   // no Take comes any more
  std::map<size_t, LayerWeights> ready_;  // gathered, not handed out yet
  size_t gathered_ = 0;                   // entries the thread has gathered
  std::exception_ptr failure_;            // the gather that failed (the thread ends there)
  size_t failed_at_ = 0;
  std::thread thread_;
};

}  // namespace tinkerd
