// OpenBLAS maps a buffer for each BLAS call running at once (and one per OpenMP worker of a
// threaded call) the first time that many run, keeps it for the life of the process, and retries a
// mapping that fails forever (the allocation loop of its driver/others/memory.c). So under a memory
// limit reached later, the first call that needs a new buffer spins at 100% CPU and holds the
// runner's thread: every model queued behind it, health still SERVING (issue 36). The runner
// therefore has them mapped at start-up, while memory is plentiful; later calls reuse them, and a
// limit reached afterwards fails an allocation that is accounted and answered instead.
#pragma once

namespace tinkerd {

// Runs the BLAS calls that map OpenBLAS's buffers: a threaded sgemm and dgemm on this thread (its
// buffer and each worker's), then one of each per intra-op thread at once (a buffer each). Returns
// the calls made: 0 where the BLAS is not OpenBLAS, or where this process already mapped them for
// as many threads. Call after the intra-op thread count is set.
int PreallocateBlasBuffers();

}  // namespace tinkerd
