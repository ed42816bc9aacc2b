#include "runner/sample/choose_rows.h"

#include <algorithm>
#include <type_traits>

#include "kernels/parallel.h"

namespace tinkerd {

namespace {

// One row's choice is a pass or two of exp over the vocabulary; at a decode batch of 64 the rows
// took a tenth of the step on one thread. Float rows are widened to double by their own task.
template <typename Z>
void ChooseRows(const Z* z_SV, int64_t V, std::vector<RowChoice>& rows) {
  kernels::ParallelFor(0, static_cast<int64_t>(rows.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<double> wide_V(std::is_same_v<Z, double> ? 0 : V);
    for (int64_t s = begin; s < end; ++s) {
      const double* z_V;
      if constexpr (std::is_same_v<Z, double>) {
        z_V = z_SV + s * V;
      } else {
        std::copy(z_SV + s * V, z_SV + (s + 1) * V, wide_V.begin());
        z_V = wide_V.data();
      }
      RowChoice& row = rows[s];
      const double lse = LogSumExp(z_V, V);
      row.choice = ChooseToken(z_V, V, lse, *row.params, row.rng);
      if (row.topk > 0) row.choice.top = MostLikely(z_V, V, lse, row.topk);
    }
  });
}

}  // namespace

void ChooseTokens(const double* z_SV, int64_t V, std::vector<RowChoice>& rows) {
  ChooseRows(z_SV, V, rows);
}

void ChooseTokens(const float* z_SV, int64_t V, std::vector<RowChoice>& rows) {
  ChooseRows(z_SV, V, rows);
}

}  // namespace tinkerd
