#include "runner/packing/karmarkar_karp.h"

#include <algorithm>
#include <queue>

namespace tinkerd {
namespace {

struct Subset {
  int64_t sum = 0;
  std::vector<int> items;
};

// A partial solution: k subsets, kept sorted by sum descending (ties by first item).
struct State {
  std::vector<Subset> subsets;
  int min_item = 0;  // for deterministic tie-breaking in the heap

  int64_t Spread() const { return subsets.front().sum - subsets.back().sum; }
};

void SortDescending(std::vector<Subset>& s) {
  std::stable_sort(s.begin(), s.end(), [](const Subset& a, const Subset& b) {
    if (a.sum != b.sum) return a.sum > b.sum;
    const int fa = a.items.empty() ? INT32_MAX : a.items.front();
    const int fb = b.items.empty() ? INT32_MAX : b.items.front();
    return fa < fb;
  });
}

struct BySpread {
  bool operator()(const State* a, const State* b) const {
    if (a->Spread() != b->Spread()) return a->Spread() < b->Spread();  // largest spread first
    return a->min_item > b->min_item;
  }
};

}  // namespace

std::vector<std::vector<int>> KarmarkarKarpPartition(const std::vector<int64_t>& weights, int k) {
  if (k < 1) k = 1;
  std::vector<std::vector<int>> result(k);
  if (weights.empty()) return result;

  std::vector<State> pool;
  pool.reserve(2 * weights.size());
  std::priority_queue<State*, std::vector<State*>, BySpread> heap;
  for (size_t i = 0; i < weights.size(); ++i) {
    State s;
    s.subsets.resize(k);
    s.subsets[0].sum = weights[i];
    s.subsets[0].items = {static_cast<int>(i)};
    s.min_item = static_cast<int>(i);
    SortDescending(s.subsets);
    pool.push_back(std::move(s));
  }
  for (State& s : pool) heap.push(&s);
  // Merge the two most unbalanced partial solutions: pair the heaviest subset of one with the
  // lightest of the other, which cancels their spreads as much as possible.
  std::vector<State> merged;
  merged.reserve(weights.size());
  while (heap.size() > 1) {
    State* a = heap.top();
    heap.pop();
    State* b = heap.top();
    heap.pop();
    State m;
    m.subsets.resize(k);
    m.min_item = std::min(a->min_item, b->min_item);
    for (int j = 0; j < k; ++j) {
      const Subset& x = a->subsets[j];
      const Subset& y = b->subsets[k - 1 - j];
      m.subsets[j].sum = x.sum + y.sum;
      m.subsets[j].items = x.items;
      m.subsets[j].items.insert(m.subsets[j].items.end(), y.items.begin(), y.items.end());
    }
    SortDescending(m.subsets);
    merged.push_back(std::move(m));
    heap.push(&merged.back());
  }
  const State* final_state = heap.top();
  for (int j = 0; j < k; ++j) {
    result[j] = final_state->subsets[j].items;
    std::sort(result[j].begin(), result[j].end());
  }
  std::stable_sort(result.begin(), result.end(), [](const auto& a, const auto& b) {
    if (a.empty() != b.empty()) return b.empty();
    return !a.empty() && a.front() < b.front();
  });
  return result;
}

}  // namespace tinkerd
