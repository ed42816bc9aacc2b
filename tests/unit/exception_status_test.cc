// Allocation failures caught at the runner's entry points are RESOURCE_EXHAUSTED (the client may
// retry or send less), everything else INTERNAL; the broken control is a plain c10::Error, which
// must not be taken for an allocation failure.
#include "runner/util/exception_status.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <new>
#include <stdexcept>

namespace tinkerd::testing {
namespace {

template <typename E>
absl::Status Caught(E e) {
  try {
    throw e;
  } catch (...) {
    return ExceptionStatus("forward_backward", std::current_exception());
  }
}

TEST(ExceptionStatus, AllocationFailuresAreResourceExhausted) {
  absl::Status st = Caught(std::bad_alloc());
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted) << st;
  EXPECT_NE(st.message().find("forward_backward"), std::string::npos) << st;

  st = Caught(c10::OutOfMemoryError({__func__, __FILE__, __LINE__}, "CUDA out of memory"));
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted) << st;
}

TEST(ExceptionStatus, AHostAllocationLargerThanTheAddressSpaceIsResourceExhausted) {
  // 2^62 bytes: no machine has them, so LibTorch's CPU allocator fails, whichever way this
  // LibTorch reports it (c10::Error with "not enough memory", OutOfMemoryError, or bad_alloc).
  absl::Status st;
  try {
    at::Tensor t = at::empty({int64_t{1} << 59}, at::kDouble);
    FAIL() << "allocated 2^62 bytes";
  } catch (...) {
    st = ExceptionStatus("create_model", std::current_exception());
  }
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted) << st;
}

TEST(ExceptionStatus, OtherErrorsAreInternal) {
  // Broken control: a LibTorch error that is not about memory.
  absl::Status st = Caught(c10::Error({__func__, __FILE__, __LINE__}, "shape mismatch"));
  EXPECT_EQ(st.code(), absl::StatusCode::kInternal) << st;
  EXPECT_NE(st.message().find("shape mismatch"), std::string::npos) << st;
  st = Caught(std::runtime_error("boom"));
  EXPECT_EQ(st.code(), absl::StatusCode::kInternal) << st;
}

}  // namespace
}  // namespace tinkerd::testing
