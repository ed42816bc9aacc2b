#include "runner/sample/choose.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

namespace tinkerd {

double LogSumExpFromExps(const double* e, int64_t V, double m) {
  if (!std::isfinite(m)) return m;
  // Eight partial sums (v mod 8), then added pairwise.
  double part[8] = {};
  int64_t v = 0;
  for (; v + 8 <= V; v += 8) {
    for (int j = 0; j < 8; ++j) part[j] += e[v + j];
  }
  for (; v < V; ++v) part[0] += e[v];
  for (int w = 4; w > 0; w /= 2) {
    for (int j = 0; j < w; ++j) part[j] += part[j + w];
  }
  return m + std::log(part[0]);
}

Choice ChooseToken(const double* z, int64_t V, double lse, const SamplingParams& params,
                   SplitMix64& rng) {
  auto chosen = [&](int64_t v) { return Choice{v, z[v] - lse}; };
  if (params.temperature == 0) {
    return chosen(std::max_element(z, z + V) - z);
  }
  const double inv_t = 1.0 / params.temperature;
  const bool truncate = (params.top_k > 0 && params.top_k < V) || params.top_p < 1;
  if (!truncate) {
    // Every token, in index order: no sort over the vocabulary.
    double m = -std::numeric_limits<double>::infinity();
    for (int64_t v = 0; v < V; ++v) m = std::max(m, z[v] * inv_t);
    std::vector<double> w(V);
    double total = 0;
    for (int64_t v = 0; v < V; ++v) total += w[v] = std::exp(z[v] * inv_t - m);
    const double u = rng.Uniform() * total;
    double cum = 0;
    for (int64_t v = 0; v < V; ++v) {
      cum += w[v];
      if (u < cum && w[v] > 0) return chosen(v);
    }
    // u fell past the last positive weight by rounding: the last token that had any mass.
    for (int64_t v = V - 1; v >= 0; --v) {
      if (w[v] > 0) return chosen(v);
    }
    return chosen(0);
  }
  // Most likely first, ties by index: the order the kept set and the inverse CDF use.
  std::vector<int64_t> order(V);
  std::iota(order.begin(), order.end(), 0);
  auto before = [z](int64_t a, int64_t b) { return z[a] > z[b] || (z[a] == z[b] && a < b); };
  const int64_t k = params.top_k > 0 ? std::min(params.top_k, V) : V;
  std::partial_sort(order.begin(), order.begin() + k, order.end(), before);
  order.resize(k);
  const double m = z[order[0]] * inv_t;
  std::vector<double> w(k);
  double total = 0;
  for (int64_t i = 0; i < k; ++i) total += w[i] = std::exp(z[order[i]] * inv_t - m);
  int64_t kept = k;
  if (params.top_p < 1) {
    double cum = 0;
    for (int64_t i = 0; i < k; ++i) {
      cum += w[i];
      if (cum >= params.top_p * total) {
        kept = i + 1;
        break;
      }
    }
    total = std::accumulate(w.begin(), w.begin() + kept, 0.0);
  }
  const double u = rng.Uniform() * total;
  double cum = 0;
  for (int64_t i = 0; i < kept; ++i) {
    cum += w[i];
    if (u < cum) return chosen(order[i]);
  }
  return chosen(order[kept - 1]);
}

}  // namespace tinkerd
