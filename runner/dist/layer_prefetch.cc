#include "runner/dist/layer_prefetch.h"

#include <ATen/core/grad_mode.h>
#include <c10/core/DeviceGuard.h>

#include <algorithm>
#include <stdexcept>
#include <utility>

#include "absl/strings/str_cat.h"

namespace tinkerd {

LayerPrefetch::LayerPrefetch(std::function<LayerWeights(int64_t layer)> gather,
                             std::vector<int64_t> schedule, at::Device device, int depth)
    : gather_(std::move(gather)),
      schedule_(std::move(schedule)),
      depth_(static_cast<size_t>(std::max(1, depth))) {
  thread_ = std::thread([this, device] { Run(device); });
}

LayerPrefetch::~LayerPrefetch() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    ending_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

std::vector<int64_t> LayerPrefetch::Schedule(int64_t layers, bool backward) {
  std::vector<int64_t> out;
  for (int64_t l = 0; l < layers; ++l) out.push_back(l);
  for (int64_t l = layers - 1; backward && l >= 0; --l) out.push_back(l);
  return out;
}

void LayerPrefetch::Run(at::Device device) {
  c10::OptionalDeviceGuard on_device;
  if (!device.is_cpu()) on_device.reset_device(device);
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < schedule_.size(); ++i) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return i < next_ + depth_ || ending_; });
      // Ending: only what the Takes allowed runs, so that every rank ends after the same gathers.
      if (i >= next_ + depth_) return;
    }
    LayerWeights w;
    std::exception_ptr error;
    try {
      w = gather_(schedule_[i]);
    } catch (...) {
      error = std::current_exception();
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (error) {
        failure_ = error;
        failed_at_ = i;
      } else {
        ready_[i] = std::move(w);
        gathered_ = i + 1;
      }
    }
    cv_.notify_all();
    // A failed collective leaves the group unusable: the gathers after it would only time out.
    if (error) return;
  }
}

LayerWeights LayerPrefetch::Take(int64_t layer) {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    const size_t i = next_;
    if (i >= schedule_.size()) {
      throw std::logic_error(
          absl::StrCat("prefetch: layer ", layer, " asked for past the schedule"));
    }
    cv_.wait(lock, [&] { return gathered_ > i || failure_; });
    if (failure_ && failed_at_ <= i) std::rethrow_exception(failure_);
    auto it = ready_.find(i);
    LayerWeights w = std::move(it->second);
    ready_.erase(it);
    ++next_;
    cv_.notify_all();  // the thread may gather the next one now
    // Not asked for (a recompute that stopped early): dropped here, gathered on every rank alike.
    if (schedule_[i] == layer) return w;
  }
}

}  // namespace tinkerd
