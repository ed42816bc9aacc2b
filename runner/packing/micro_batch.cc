#include "runner/packing/micro_batch.h"

#include <algorithm>

#include "runner/packing/karmarkar_karp.h"

namespace tinkerd {

std::vector<std::vector<int>> PlanMicroBatches(const std::vector<int64_t>& lengths,
                                               int64_t token_budget) {
  std::vector<std::vector<int>> out;
  std::vector<int> rest;  // indices of datums that fit within the budget
  std::vector<int64_t> rest_len;
  int64_t rest_total = 0;
  for (size_t i = 0; i < lengths.size(); ++i) {
    if (lengths[i] > token_budget) {
      out.push_back({static_cast<int>(i)});
    } else {
      rest.push_back(static_cast<int>(i));
      rest_len.push_back(lengths[i]);
      rest_total += lengths[i];
    }
  }
  if (!rest.empty()) {
    // Start from the lower bound on the count and add micro-batches until KK's partition fits;
    // at k = rest.size() every datum is alone, which always fits.
    int k = static_cast<int>(std::max<int64_t>(1, (rest_total + token_budget - 1) / token_budget));
    for (;; ++k) {
      auto groups = KarmarkarKarpPartition(rest_len, k);
      bool fits = true;
      for (const auto& g : groups) {
        int64_t sum = 0;
        for (int j : g) sum += rest_len[j];
        if (sum > token_budget) fits = false;
      }
      if (fits || k >= static_cast<int>(rest.size())) {
        for (auto& g : groups) {
          if (g.empty()) continue;
          std::vector<int> mb;
          for (int j : g) mb.push_back(rest[j]);
          out.push_back(std::move(mb));
        }
        break;
      }
    }
  }
  std::sort(out.begin(), out.end(),
            [](const auto& a, const auto& b) { return a.front() < b.front(); });
  return out;
}

}  // namespace tinkerd
