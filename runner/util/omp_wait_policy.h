// OpenMP workers that sleep between parallel regions instead of spinning, unless the operator
// chose a policy (OMP_WAIT_POLICY=ACTIVE keeps them spinning).
//
// Why: LibTorch's OpenMP workers spin for a while after each parallel region. tinkerd runs
// training, sampling and its front ends on threads of their own, and OpenBLAS keeps a pool of its
// own, so a spinning worker holds the core the next op needs. On the 2-core CI machine spinning
// made a prefill 4x slower (bench/RESULTS.md, stop 22).
#pragma once

namespace tinkerd {

// libgomp reads OMP_WAIT_POLICY once, while it is loaded, before main (setting it from the
// program, even in .preinit_array, comes too late). So when it is unset this sets it to PASSIVE
// and re-executes the program (/proc/self/exe with the same argv: the same pid, the new
// environment); with it set, returns at once. Call first in main, before any thread starts. Should
// the re-exec fail, it says so on stderr and returns: the program runs on, spinning.
void PreferPassiveOpenMpWaits(char** argv);

}  // namespace tinkerd
