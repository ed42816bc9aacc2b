#include "runner/util/blas_buffers.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <atomic>
#include <mutex>
#include <thread>
#include <vector>

#include "kernels/parallel.h"
#include "runner/util/cpu_environment.h"

namespace tinkerd {

int PreallocateBlasBuffers() {
  if (BlasCore().empty()) return 0;
  // The buffers last as long as the process: once for each larger thread count is enough (a test
  // process makes hundreds of runners).
  static std::mutex mu;
  static int64_t mapped_for_threads = 0;
  std::lock_guard<std::mutex> lock(mu);
  if (at::get_num_threads() <= mapped_for_threads) return 0;
  mapped_for_threads = at::get_num_threads();
  // 512 x 512 x 512 is past OpenBLAS's small-matrix path, which maps no buffer, and past the size
  // it splits over its threads.
  constexpr int64_t kSide = 512;
  const int64_t threads = at::get_num_threads();
  int calls = 0;
  for (const at::ScalarType dtype : {at::kFloat, at::kDouble}) {
    const at::Tensor a = at::ones({kSide, kSide}, at::TensorOptions().dtype(dtype));
    at::Tensor c = at::empty({kSide, kSide}, a.options());
    at::mm_out(c, a, a);
    ++calls;
    // One call per intra-op thread, started together so that they overlap and each maps a buffer
    // of its own (inside a parallel region OpenBLAS runs each call on its caller alone).
    std::vector<at::Tensor> outs(threads);
    for (at::Tensor& o : outs) o = at::empty({kSide, kSide}, a.options());
    std::atomic<int64_t> arrived{0};
    kernels::ParallelFor(0, threads, 1, [&](int64_t begin, int64_t end) {
      arrived += end - begin;
      while (arrived.load() < threads) std::this_thread::yield();
      for (int64_t i = begin; i < end; ++i) at::mm_out(outs[i], a, a);
    });
    calls += static_cast<int>(threads);
  }
  return calls;
}

}  // namespace tinkerd
