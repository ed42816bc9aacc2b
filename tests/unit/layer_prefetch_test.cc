// LayerPrefetch (runner/dist/layer_prefetch.h): a micro-batch's layers gathered ahead on a thread
// of their own, at most one ahead of the one in use, and which gathers run set by the Takes alone
// (what every rank makes alike), not by timing.
#include "runner/dist/layer_prefetch.h"

#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <vector>

namespace tinkerd::testing {
namespace {

// A gather that records which layers it was asked for, and on which thread; layer `fails` throws.
struct Recorder {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<int64_t> layers;
  std::vector<std::thread::id> threads;
  int64_t fails = -1;

  LayerWeights Gather(int64_t layer) {
    if (layer == fails) throw std::runtime_error("gather failed");
    LayerWeights w;
    w.input_norm_D = at::full({1}, static_cast<double>(layer), at::kDouble);
    std::lock_guard<std::mutex> lock(mu);
    layers.push_back(layer);
    threads.push_back(std::this_thread::get_id());
    cv.notify_all();
    return w;
  }
  // Waits (on the condition, not a clock) until `n` gathers have run.
  bool WaitFor(size_t n) {
    std::unique_lock<std::mutex> lock(mu);
    return cv.wait_for(lock, std::chrono::seconds(30), [&] { return layers.size() >= n; });
  }
  std::vector<int64_t> Layers() {
    std::lock_guard<std::mutex> lock(mu);
    return layers;
  }
};

double Marker(const LayerWeights& w) {
  return w.input_norm_D.item<double>();
}

TEST(LayerPrefetch, TheScheduleIsTheForwardThenTheRecompute) {
  EXPECT_EQ(LayerPrefetch::Schedule(3, true), (std::vector<int64_t>{0, 1, 2, 2, 1, 0}));
  EXPECT_EQ(LayerPrefetch::Schedule(3, false), (std::vector<int64_t>{0, 1, 2}));
}

// The next layer is gathered on the prefetch thread before it is asked for, and the one after it
// only once that one is handed out: two whole at once. A recompute that stops early (layers 1
// and 0 have nothing to recompute) leaves the one prefetched ahead of it gathered and dropped,
// and nothing more: the gathers are those the Takes allow, whatever the timing.
TEST(LayerPrefetch, GathersOneAheadOnItsOwnThread) {
  Recorder r;
  {
    LayerPrefetch p([&](int64_t l) { return r.Gather(l); }, LayerPrefetch::Schedule(4, true),
                    at::kCPU);
    ASSERT_TRUE(r.WaitFor(1));
    EXPECT_EQ(Marker(p.Take(0)), 0);
    ASSERT_TRUE(r.WaitFor(2)) << "layer 1 was not gathered ahead";
    EXPECT_EQ(r.Layers(), (std::vector<int64_t>{0, 1})) << "more than one ahead";
    for (int64_t l : {1, 2, 3, 3, 2}) EXPECT_EQ(Marker(p.Take(l)), l);
  }
  EXPECT_EQ(r.Layers(), (std::vector<int64_t>{0, 1, 2, 3, 3, 2, 1}));
  for (const std::thread::id& t : r.threads) EXPECT_NE(t, std::this_thread::get_id());
}

// A Take further on drops the entries before it; one past the schedule, or after a failed
// gather, throws (the failure's own error).
TEST(LayerPrefetch, SkipsForwardAndReportsFailures) {
  Recorder r;
  {
    LayerPrefetch p([&](int64_t l) { return r.Gather(l); }, {0, 1, 2, 3}, at::kCPU);
    EXPECT_EQ(Marker(p.Take(0)), 0);
    EXPECT_EQ(Marker(p.Take(2)), 2);
    EXPECT_EQ(Marker(p.Take(3)), 3);
    EXPECT_THROW(p.Take(0), std::logic_error);
  }
  EXPECT_EQ(r.Layers(), (std::vector<int64_t>{0, 1, 2, 3}));
  Recorder failing;
  failing.fails = 2;
  LayerPrefetch p([&](int64_t l) { return failing.Gather(l); }, {0, 1, 2, 3}, at::kCPU);
  EXPECT_EQ(Marker(p.Take(0)), 0);
  EXPECT_EQ(Marker(p.Take(1)), 1);
  try {
    p.Take(2);
    ADD_FAILURE() << "a failed gather was handed out";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "gather failed");
  }
  EXPECT_THROW(p.Take(3), std::runtime_error);
}

}  // namespace
}  // namespace tinkerd::testing
