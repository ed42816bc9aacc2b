// One training step under LibTorch's profiler, written as a Chrome trace (chrome://tracing,
// Perfetto, or bench/trace_summary.py for a table). With a LibTorch built with Kineto (PyTorch's
// wheels) on a GPU it holds every kernel beside the CPU ops that launched it: what says whether a
// step that misses its MFU target waits on kernel launches, on a few slow kernels, or on copies.
// Debian's LibTorch has no Kineto and records the CPU ops alone.
#pragma once

#include <functional>
#include <string>

#include "absl/status/status.h"

namespace tinkerd::bench {

// Runs `step` with the profiler on (CPU ops, and CUDA kernels when `cuda`), then writes the events
// to `path`: {"traceEvents": [{"name", "cat": "cpu_op" | "kernel", "ph": "X", "ts", "dur" (µs),
// "pid", "tid"}, ...]}. The step's own error, or the profiler's, is returned.
absl::Status TraceStep(const std::string& path, bool cuda,
                       const std::function<absl::Status()>& step);

}  // namespace tinkerd::bench
