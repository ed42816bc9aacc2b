#include "bench/trace.h"

#include <torch/csrc/autograd/profiler_kineto.h>

#include <algorithm>
#include <cstdint>
#include <exception>
#include <limits>
#include <set>
#include <utility>

#include "nlohmann/json.hpp"
#include "runner/model/safetensors.h"
#include "runner/util/exception_status.h"

namespace tinkerd::bench {
namespace {

// An event's start and duration in ns: LibTorch 1.13 gives them in µs, 2.1 and later in ns. Kept
// in integers: the starts are clock times near 1.8e18 ns, which a double holds only to 256 ns.
template <typename Event>
std::pair<uint64_t, uint64_t> SpanNs(const Event& e) {
  if constexpr (requires { e.startNs(); }) {
    return {e.startNs(), e.durationNs()};
  } else {
    return {e.startUs() * 1000, e.durationUs() * 1000};
  }
}

}  // namespace

absl::Status TraceStep(const std::string& path, bool cuda,
                       const std::function<absl::Status()>& step) {
  namespace impl = torch::profiler::impl;
  const impl::ProfilerConfig config(impl::ProfilerState::KINETO);
  std::set<impl::ActivityType> activities{impl::ActivityType::CPU};
  if (cuda) activities.insert(impl::ActivityType::CUDA);
  try {
    torch::autograd::profiler::prepareProfiler(config, activities);
    torch::autograd::profiler::enableProfiler(config, activities);
  } catch (const std::exception& e) {
    return absl::FailedPreconditionError(std::string("profiler: ") + e.what());
  }
  // Whatever the step does, the profiler is turned off again.
  absl::Status st;
  try {
    st = step();
  } catch (...) {
    st = ExceptionStatus("traced step", std::current_exception());
  }
  std::unique_ptr<torch::autograd::profiler::ProfilerResult> result;
  try {
    result = torch::autograd::profiler::disableProfiler();
  } catch (const std::exception& e) {
    if (st.ok()) st = absl::InternalError(std::string("profiler: ") + e.what());
  }
  if (!st.ok()) return st;
  uint64_t base = std::numeric_limits<uint64_t>::max();
  for (const auto& e : result->events()) base = std::min(base, SpanNs(e).first);
  nlohmann::json events = nlohmann::json::array();
  for (const auto& e : result->events()) {
    const bool device = e.deviceType() != c10::DeviceType::CPU;
    const auto [start, duration] = SpanNs(e);
    // A kernel's track is its stream; a CPU op's, its thread.
    const uint64_t track = device ? static_cast<uint64_t>(e.deviceResourceId()) : e.startThreadId();
    events.push_back({{"name", e.name()},
                      {"cat", device ? "kernel" : "cpu_op"},
                      {"ph", "X"},
                      {"ts", static_cast<double>(start - base) / 1e3},
                      {"dur", static_cast<double>(duration) / 1e3},
                      {"pid", device ? 1 : 0},
                      {"tid", track}});
  }
  return WriteFileAtomically(path,
                             nlohmann::json{{"traceEvents", std::move(events)}}.dump() + "\n");
}

}  // namespace tinkerd::bench
