#include "runner/util/cpu_environment.h"

#include <dlfcn.h>
#include <strings.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace tinkerd {
namespace {

// The best OpenBLAS x86-64 kernels this CPU can run, from its feature flags; "" when unknown.
const char* CoreForThisCpu() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
                      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq");
  if (avx512 && __builtin_cpu_supports("avx512bf16")) return "Cooperlake";
  if (avx512) return "SkylakeX";
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return "Haswell";
  if (__builtin_cpu_supports("avx")) return "Sandybridge";
#endif
  return "";
}

// About 30 µs of spinning (libgomp counts about 100,000 spins a millisecond): loops that follow
// each other microseconds apart find the worker awake (a worker woken from sleep for each of a
// decode step's products took a batch-8 decode from 1,250 to 790 tokens/s, before decode steps had
// a team of their own); longer spins took training and prefill time from OpenBLAS's pool
// (bench/RESULTS.md, stop 28).
constexpr char kSpinCount[] = "3000";

}  // namespace

std::string BlasCore() {
  // Looked up, not linked: LibTorch brings whichever BLAS the system selected.
  using CoreName = char* (*)();
  auto name = reinterpret_cast<CoreName>(dlsym(RTLD_DEFAULT, "openblas_get_corename"));
  const char* core = name != nullptr ? name() : nullptr;
  return core != nullptr ? core : "";
}

std::string CapOneDnnIsa() {
  setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16", /*overwrite=*/0);
  return std::getenv("ONEDNN_MAX_CPU_ISA");
}

void PrepareCpuEnvironment(char** argv) {
  bool changed = false;
  if (std::getenv("OMP_WAIT_POLICY") == nullptr && std::getenv("GOMP_SPINCOUNT") == nullptr) {
    changed |= setenv("OMP_WAIT_POLICY", "PASSIVE", /*overwrite=*/0) == 0;
    changed |= setenv("GOMP_SPINCOUNT", kSpinCount, /*overwrite=*/0) == 0;
  }
  const char* better = CoreForThisCpu();
  if (std::getenv("OPENBLAS_CORETYPE") == nullptr && *better != '\0' &&
      strcasecmp(BlasCore().c_str(), "Prescott") == 0) {
    changed |= setenv("OPENBLAS_CORETYPE", better, /*overwrite=*/0) == 0;
  }
  if (!changed) return;
  execv("/proc/self/exe", argv);
  std::fprintf(
      stderr,
      "could not re-execute with OMP_WAIT_POLICY, GOMP_SPINCOUNT and OPENBLAS_CORETYPE set (%s)\n",
      std::strerror(errno));
}

}  // namespace tinkerd
