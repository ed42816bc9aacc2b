#include "bench/trace.h"

#include <torch/csrc/autograd/profiler_kineto.h>

#include <exception>
#include <fstream>
#include <set>

#include "nlohmann/json.hpp"

namespace tinkerd::bench {
namespace {

// LibTorch 1.13 gives an event's times in µs, 2.x in ns.
template <typename Event>
double StartUs(const Event& e) {
  if constexpr (requires { e.startNs(); }) {
    return static_cast<double>(e.startNs()) / 1e3;
  } else {
    return static_cast<double>(e.startUs());
  }
}

template <typename Event>
double DurationUs(const Event& e) {
  if constexpr (requires { e.durationNs(); }) {
    return static_cast<double>(e.durationNs()) / 1e3;
  } else {
    return static_cast<double>(e.durationUs());
  }
}

// A kernel's track: its stream where LibTorch says (2.x), else its device.
template <typename Event>
uint64_t DeviceTrack(const Event& e) {
  if constexpr (requires { e.deviceResourceId(); }) {
    return static_cast<uint64_t>(e.deviceResourceId());
  } else {
    return static_cast<uint64_t>(e.deviceIndex());
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
  const absl::Status st = step();  // a failed step still ends the profiler
  std::unique_ptr<torch::autograd::profiler::ProfilerResult> result;
  try {
    result = torch::autograd::profiler::disableProfiler();
  } catch (const std::exception& e) {
    return absl::InternalError(std::string("profiler: ") + e.what());
  }
  if (!st.ok()) return st;
  nlohmann::json events = nlohmann::json::array();
  for (const auto& e : result->events()) {
    const bool device = e.deviceType() != c10::DeviceType::CPU;
    events.push_back({{"name", e.name()},
                      {"cat", device ? "kernel" : "cpu_op"},
                      {"ph", "X"},
                      {"ts", StartUs(e)},
                      {"dur", DurationUs(e)},
                      {"pid", device ? 1 : 0},
                      {"tid", device ? DeviceTrack(e) : e.startThreadId()}});
  }
  std::ofstream out(path);
  out << nlohmann::json{{"traceEvents", events}}.dump() << "\n";
  if (!out.good()) return absl::InternalError("cannot write the trace to " + path);
  return absl::OkStatus();
}

}  // namespace tinkerd::bench
