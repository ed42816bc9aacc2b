// runner/util/blas_buffers.h: with OpenBLAS's buffers mapped at start-up, BLAS calls made after a
// memory limit is reached run; without, the first of them spins forever in OpenBLAS's allocation
// loop (issue 36, item 3: a server whose ForwardBackward never answered, at 100% CPU). Each case
// runs in a process of its own, the limit an address-space limit at what that process holds.
#include "runner/util/blas_buffers.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include "kernels/parallel.h"
#include "runner/util/cpu_environment.h"
#include "tests/test_util.h"

namespace tinkerd {
namespace {

// Maps the buffers (or not), then limits the address space to what the process holds and runs
// the calls the runner makes: threaded sgemm and dgemm, and one per intra-op thread at once.
// Exits 0 when they finish; SIGALRM ends a call that spins.
void MatmulsUnderALimit(bool preallocate) {
  if (preallocate) PreallocateBlasBuffers();
  const int64_t threads = at::get_num_threads();
  std::vector<at::Tensor> a, outs;
  for (const at::ScalarType dtype : {at::kFloat, at::kDouble}) {
    a.push_back(at::ones({512, 512}, at::TensorOptions().dtype(dtype)));
    for (int64_t i = 0; i <= threads; ++i)
      outs.push_back(at::empty({512, 512}, a.back().options()));
  }
  // LibTorch's team started before the limit (its threads' stacks are mappings too).
  kernels::ParallelFor(0, threads, 1, [](int64_t, int64_t) {});
  if (!testing::LimitAddressSpace(1 << 20)) _exit(2);
  alarm(5);
  for (size_t d = 0; d < a.size(); ++d) {
    at::mm_out(outs[d * (threads + 1)], a[d], a[d]);
    kernels::ParallelFor(0, threads, 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) at::mm_out(outs[d * (threads + 1) + 1 + i], a[d], a[d]);
    });
  }
  _exit(0);
}

TEST(BlasBuffersDeathTest, CallsAfterAMemoryLimitRunWhenTheBuffersWereMappedFirst) {
#if defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "a sanitizer's allocator maps memory of its own, which the limit refuses";
#endif
  if (BlasCore().empty()) GTEST_SKIP() << "the BLAS here is not OpenBLAS";
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(MatmulsUnderALimit(/*preallocate=*/true), ::testing::ExitedWithCode(0), "");
  // The broken control: the same calls, their buffers left to be mapped under the limit, do not
  // finish (OpenBLAS 0.3.21 spins until the alarm; another build might fail otherwise).
  EXPECT_EXIT(
      MatmulsUnderALimit(/*preallocate=*/false),
      [](int status) { return !(WIFEXITED(status) && WEXITSTATUS(status) == 0); }, "");
}

}  // namespace
}  // namespace tinkerd
