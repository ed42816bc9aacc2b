#include "kernels/parallel.h"

#include <ATen/Parallel.h>
#include <omp.h>
#include <sched.h>

#include <algorithm>

namespace tinkerd::kernels {
namespace {

thread_local SpinningTeam* tl_team = nullptr;  // the innermost open Scope's team
thread_local bool tl_in_chunk = false;         // inside a team loop's chunk

// Lets the other hyperthread (or, in a VM, the host) have the core's issue slots while spinning.
inline void Pause() {
#if defined(__x86_64__)
  __builtin_ia32_pause();
#endif
}

// One turn of a wait loop. A spinning thread yields its core every 1,024 turns (~40 µs), so that
// a thread with work on it (an OpenMP region of an ATen op inside the step, a front end's thread)
// is not kept waiting for the scheduler's time slice.
inline void Spin(int64_t& turns) {
  Pause();
  if (++turns % 1024 == 0) sched_yield();
}

}  // namespace

struct SpinningTeam::Loop {
  const LoopBody* f;
  int64_t begin, end, chunk;
  std::atomic<int> unfinished;  // workers still to report
  std::mutex error_mu;
  std::exception_ptr error;

  // Thread `index`'s chunk, as at::parallel_for splits; an exception is kept for the caller.
  void RunChunk(int64_t index) {
    const int64_t first = begin + index * chunk;
    if (first >= end) return;
    tl_in_chunk = true;
    try {
      (*f)(first, std::min(end, first + chunk));
    } catch (...) {
      std::lock_guard<std::mutex> lock(error_mu);
      if (!error) error = std::current_exception();
    }
    tl_in_chunk = false;
  }
};

SpinningTeam::SpinningTeam(int threads) {
  for (int i = 1; i < threads; ++i) workers_.emplace_back([this, i] { Work(i); });
}

SpinningTeam::~SpinningTeam() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_.store(true);
  }
  wake_.notify_all();
  for (std::thread& t : workers_) t.join();
}

SpinningTeam::Scope::Scope(SpinningTeam& team) : team_(team), outer_(tl_team) {
  tl_team = &team;
  team.hot_.fetch_add(1);
  {
    // Through the mutex, so that a worker between its check and its wait does not miss the call.
    std::lock_guard<std::mutex> lock(team.mu_);
  }
  team.wake_.notify_all();
}

SpinningTeam::Scope::~Scope() {
  team_.hot_.fetch_sub(1);
  tl_team = outer_;
}

void SpinningTeam::Work(int index) {
  // An ATen op inside a chunk runs on this thread alone, rather than starting an OpenMP pool here.
  omp_set_num_threads(1);
  uint64_t seen = 0;
  for (;;) {
    uint64_t now = generation_.load(std::memory_order_acquire);
    for (int64_t turns = 0; now == seen; now = generation_.load(std::memory_order_acquire)) {
      if (stop_.load(std::memory_order_relaxed)) return;
      if (hot_.load(std::memory_order_relaxed) > 0) {
        Spin(turns);
        continue;
      }
      std::unique_lock<std::mutex> lock(mu_);
      wake_.wait(lock,
                 [&] { return stop_.load() || hot_.load() > 0 || generation_.load() != seen; });
    }
    seen = now;
    Loop* loop = loop_.load(std::memory_order_acquire);
    loop->RunChunk(index);
    // The caller may free the loop once the count reaches zero: nothing touches it after this.
    loop->unfinished.fetch_sub(1, std::memory_order_acq_rel);
  }
}

void SpinningTeam::Run(Loop& loop) {
  // One loop at a time: a second caller's loop would replace the first's under its workers.
  const std::lock_guard<std::mutex> one(run_mu_);
  loop.unfinished.store(static_cast<int>(workers_.size()), std::memory_order_relaxed);
  loop_.store(&loop, std::memory_order_release);
  // The caller's scope is open (ParallelFor takes the team from it), and opening it woke every
  // worker: they are spinning and see the new generation without the mutex.
  generation_.fetch_add(1, std::memory_order_acq_rel);
  loop.RunChunk(0);
  // The workers hold pointers into the loop and the caller's f until they report.
  for (int64_t turns = 0; loop.unfinished.load(std::memory_order_acquire) > 0;) Spin(turns);
  if (loop.error) std::rethrow_exception(loop.error);
}

void ParallelFor(int64_t begin, int64_t end, int64_t grain, const LoopBody& f) {
  if (begin >= end) return;
  if (tl_in_chunk) {  // a worker has no team of its own; LibTorch's would start a pool for it
    f(begin, end);
    return;
  }
  SpinningTeam* team = tl_team;
  if (team == nullptr) {
    at::parallel_for(begin, end, grain, f);
    return;
  }
  const int64_t n = end - begin, threads = team->threads();
  if (threads == 1 || n <= std::max<int64_t>(grain, 1)) {
    f(begin, end);
    return;
  }
  const int64_t used = grain > 0 ? std::min(threads, (n + grain - 1) / grain) : threads;
  SpinningTeam::Loop loop{&f, begin, end, (n + used - 1) / used, {0}, {}, {}};
  team->Run(loop);
}

}  // namespace tinkerd::kernels
