#include "server/common/worker.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace tinkerd {

Worker::Worker(int max_queued) : max_queued_(max_queued), thread_([this] { Loop(); }) {}

Worker::~Worker() {
  Stop();
}

absl::Status Worker::Submit(std::function<void()> run, std::function<void()> cancel) {
  absl::MutexLock lock(&mu_);
  if (stopping_) return absl::UnavailableError("server is shutting down");
  if (queue_.size() >= max_queued_) {
    return absl::ResourceExhaustedError(
        absl::StrCat(queue_.size(), " items already wait; retry later"));
  }
  queue_.push_back({std::move(run), std::move(cancel)});
  return absl::OkStatus();
}

void Worker::Stop() {
  std::deque<Item> cancelled;
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    cancelled.swap(queue_);
  }
  for (Item& item : cancelled) item.cancel();
  if (thread_.joinable()) thread_.join();
}

void Worker::Loop() {
  for (;;) {
    Item item;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(this, &Worker::Ready));
      if (queue_.empty()) return;  // stopping
      item = std::move(queue_.front());
      queue_.pop_front();
    }
    item.run();
  }
}

}  // namespace tinkerd
