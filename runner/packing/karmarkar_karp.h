// Karmarkar–Karp (largest differencing) k-way partition of weighted items, as in seeds/002:
// balances token cost across micro-batches and, later, data-parallel ranks. Deterministic: equal
// inputs give equal partitions on every rank, which data parallelism relies on.
#pragma once

#include <cstdint>
#include <vector>

namespace tinkerd {

// Splits item indices [0, weights.size()) into exactly k groups (some may be empty when there are
// fewer items than groups). Each group's indices are sorted ascending; groups are ordered by their
// smallest index, empty groups last.
std::vector<std::vector<int>> KarmarkarKarpPartition(const std::vector<int64_t>& weights, int k);

}  // namespace tinkerd
