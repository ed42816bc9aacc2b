// Splits one call's datums into packed micro-batches under a token budget.
#pragma once

#include <cstdint>
#include <vector>

namespace tinkerd {

// Each micro-batch is a list of datum indices (ascending). Every micro-batch holds at most
// `token_budget` tokens, except that a datum longer than the budget runs alone. Token counts are
// balanced with Karmarkar–Karp using the fewest micro-batches that fit. Deterministic.
std::vector<std::vector<int>> PlanMicroBatches(const std::vector<int64_t>& lengths,
                                               int64_t token_budget);

}  // namespace tinkerd
