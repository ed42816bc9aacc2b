// Shared by the kernel tests: the device under test, random inputs, relative errors.
#pragma once

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <cstdlib>
#include <string>

namespace tinkerd::testing {

// The device the kernels run on: $TINKERD_TEST_DEVICE ("cuda", "cuda:1"), else the CPU. The
// float64 references always run on the CPU.
inline at::Device KernelDevice() {
  const char* d = std::getenv("TINKERD_TEST_DEVICE");
  return at::Device(d != nullptr && *d != '\0' ? d : "cpu");
}

// Deterministic normal values in float64 on the CPU.
inline at::Tensor Randn(at::IntArrayRef shape, uint64_t seed, double std = 1.0) {
  at::Generator g = at::detail::createCPUGenerator(seed);
  return at::normal(0.0, std, shape, g, at::TensorOptions().dtype(at::kDouble));
}

// max |a − b| / max(max |b|, tiny), on the CPU in float64.
inline double RelErr(const at::Tensor& a, const at::Tensor& b) {
  const at::Tensor a64 = a.detach().to(at::kCPU, at::kDouble);
  const at::Tensor b64 = b.detach().to(at::kCPU, at::kDouble);
  const double scale = std::max(b64.abs().max().item<double>(), 1e-300);
  return (a64 - b64).abs().max().item<double>() / scale;
}

}  // namespace tinkerd::testing
