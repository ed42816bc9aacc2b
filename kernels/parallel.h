// The CPU kernels' parallel loops, and a team of threads that stays awake between them.
//
// A loop is at::parallel_for by default: LibTorch's OpenMP team, whose workers spin a few tens of
// microseconds after a loop and then sleep (runner/util/cpu_environment.h says why no longer). A
// sampler's decode step runs about 34 loops with 50 to 180 µs of serial work between them, so the
// worker had gone to sleep before nearly every loop, and each loop waited for it to wake: about
// 85 µs a loop on a 2-vCPU VM, a tenth of a batch-64 step (bench/RESULTS.md, stop 32). Spinning
// longer in OpenMP itself took that time back from training and prefill, whose OpenBLAS threads
// then shared their cores with spinning workers.
//
// Inside a SpinningTeam::Scope the loops started on that thread run on the team instead: its
// workers spin, yielding the core now and then, until the scope ends, so a decode step wakes them
// once. Either way [begin, end) is split as at::parallel_for splits it (at most one contiguous
// chunk per thread, none of fewer than `grain` elements unless the range is); a kernel's results
// do not depend on the split. A loop started inside another's chunk runs on the calling thread.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace tinkerd::kernels {

using LoopBody = std::function<void(int64_t begin, int64_t end)>;

// f over [begin, end) in chunks, on the team of the innermost Scope open on this thread, else on
// LibTorch's threads. Exceptions from f reach the caller (the first, should several chunks throw).
void ParallelFor(int64_t begin, int64_t end, int64_t grain, const LoopBody& f);

class SpinningTeam {
 public:
  // `threads` counts the caller: a team of n starts n − 1 workers, asleep until a Scope opens.
  explicit SpinningTeam(int threads);
  ~SpinningTeam();
  SpinningTeam(const SpinningTeam&) = delete;
  SpinningTeam& operator=(const SpinningTeam&) = delete;

  int threads() const { return static_cast<int>(workers_.size()) + 1; }

  // While open, ParallelFor on the opening thread runs on the team, and the workers spin between
  // loops; closing it lets them sleep. Scopes nest; threads with scopes on one team take turns.
  class Scope {
   public:
    explicit Scope(SpinningTeam& team);
    ~Scope();
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    SpinningTeam& team_;
    SpinningTeam* outer_;
  };

 private:
  struct Loop;
  friend void ParallelFor(int64_t, int64_t, int64_t, const LoopBody&);

  void Run(Loop& loop);
  void Work(int index);

  std::vector<std::thread> workers_;
  std::atomic<uint64_t> generation_{0};  // one more per loop handed out
  std::atomic<int> hot_{0};              // open scopes: workers spin while positive
  std::atomic<bool> stop_{false};
  std::atomic<Loop*> loop_{nullptr};
  std::mutex run_mu_;  // held by the thread whose loop the workers run
  std::mutex mu_;      // with wake_: workers sleep until a scope opens or the team ends
  std::condition_variable wake_;
};

}  // namespace tinkerd::kernels
