// Two settings that the CPU libraries read once, while they are loaded, before main: so this sets
// them and re-executes the program (/proc/self/exe, same argv and pid, the new environment).
//
// OMP_WAIT_POLICY=PASSIVE with GOMP_SPINCOUNT=3000, unless the operator set either: LibTorch's
// OpenMP workers spin for 3 ms by default after each parallel region, and tinkerd runs training,
// sampling and its front ends on threads of their own, and OpenBLAS keeps a pool of its own, so a
// spinning worker holds the core the next op needs. On the 2-core CI machine spinning made a
// prefill 4x slower (bench/RESULTS.md, stop 22). Not sleeping at once matters too: a parallel
// loop waits for a sleeping worker to wake. (A sampler's decode step, whose loops have more serial
// work between them than this spin covers, runs them on a team of its own: kernels/parallel.h.)
// The spin count is libgomp's (the OpenMP runtime of LibTorch built with GCC); others ignore it.
//
// OPENBLAS_CORETYPE, unless the operator set it, only when OpenBLAS chose its generic Prescott
// (SSE3) kernels on a CPU with AVX: it does so on virtual machines whose CPU model it does not
// know, and runs sgemm about 3x slower there (bench/RESULTS.md, stop 24). The core is named from
// the CPU's own feature flags: Cooperlake (AVX-512 BF16), SkylakeX (AVX-512), Haswell (AVX2 and
// FMA), Sandybridge (AVX).
#pragma once

#include <string>

namespace tinkerd {

// Call first in main, before any thread starts. Returns when nothing needs to change; should the
// re-exec fail, it says so on stderr and returns: the program runs on as it is.
void PrepareCpuEnvironment(char** argv);

// The OpenBLAS kernels in use ("Cooperlake", "Prescott", ...), or "" when the BLAS is not OpenBLAS.
std::string BlasCore();

// Caps oneDNN, which takes LibTorch's bf16 products on the CPU, at AVX-512 BF16 instructions
// (ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16) unless the operator set ONEDNN_MAX_CPU_ISA. On CPUs with
// AMX (Sapphire Rapids and later) oneDNN otherwise chooses between its AMX and AVX-512 kernels by
// the product's shape, so that a row's bf16 result changes with the number of rows beside it and
// the sampler's logprobs stop being the trainer's (docs/sampling.md; bench/RESULTS.md, stop 49).
// oneDNN reads the variable when it first runs a product: call before any. Returns the cap in
// force ("AVX512_CORE_BF16", or the operator's value).
std::string CapOneDnnIsa();

}  // namespace tinkerd
