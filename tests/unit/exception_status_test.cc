// Allocation failures caught at the runner's entry points are RESOURCE_EXHAUSTED (the client may
// retry or send less), a failed collective UNAVAILABLE (also when thrown from inside autograd's
// backward, as expert parallelism's exchange throws it), everything else INTERNAL; the broken
// controls are a plain c10::Error, which must not be taken for an allocation failure, and a
// status other than UNAVAILABLE thrown the same way.
#include "runner/util/exception_status.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

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

// An op whose backward fails as a collective does, with `st`.
struct FailingBackward : public torch::autograd::Function<FailingBackward> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            absl::StatusCode code) {
    ctx->saved_data["code"] = static_cast<int64_t>(code);
    return x * 2;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list) {
    ThrowStatus(absl::Status(static_cast<absl::StatusCode>(ctx->saved_data["code"].toInt()),
                             "all-to-all failed on rank 1: timed out"));
  }
};

absl::Status BackwardThrough(absl::StatusCode code) {
  const at::Tensor x = at::ones({3}, at::kDouble).requires_grad_(true);
  try {
    torch::autograd::grad({FailingBackward::apply(x, code).sum()}, {x});
  } catch (...) {
    return ExceptionStatus("forward_backward", std::current_exception());
  }
  return absl::OkStatus();
}

TEST(ExceptionStatus, AFailedCollectiveIsUnavailableEvenFromInsideABackward) {
  absl::Status st = Caught(CollectiveFailure("gather failed"));
  EXPECT_EQ(st.code(), absl::StatusCode::kUnavailable) << st;
  st = BackwardThrough(absl::StatusCode::kUnavailable);
  EXPECT_EQ(st.code(), absl::StatusCode::kUnavailable) << st;
  EXPECT_NE(st.message().find("all-to-all failed on rank 1"), std::string::npos) << st;
  // Broken control: any other status thrown the same way is not a collective's.
  st = BackwardThrough(absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(st.code(), absl::StatusCode::kInternal) << st;
}

}  // namespace
}  // namespace tinkerd::testing
