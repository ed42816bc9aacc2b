// TINKERD_CPU_CLONES: GCC builds the function it marks for AVX-512 (x86-64-v4), for AVX2 with FMA
// (x86-64-v3) and for baseline x86-64, and the loader picks the widest the CPU runs, once per
// process. A build for baseline x86-64 alone runs the hot loops of the CPU kernels in SSE2
// without FMA. A machine always takes the same path, so results do not change from step to step
// or with the batch; they may differ between machines in the last bits (FMA rounds once where
// SSE2 rounds twice). Clang cannot clone templates and gets the baseline build.
#pragma once

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define TINKERD_CPU_CLONES \
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define TINKERD_CPU_CLONES
#endif

// TINKERD_AVX2: a function built for AVX2 with FMA alone, for a kernel that picks it at run time on
// such a CPU (kernels/gemv.cc). GCC only, as the clones: under clang both stay baseline x86-64, so
// that a kernel's builds for the two kinds still round alike.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define TINKERD_AVX2 __attribute__((target("arch=x86-64-v3")))
#else
#define TINKERD_AVX2
#endif
