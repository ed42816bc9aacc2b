#include "runner/sample/choose.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

#include "kernels/cpu_clones.h"
#include "kernels/vec16.h"

namespace tinkerd {

TINKERD_CPU_CLONES double LogSumExp(const double* z, int64_t V) {
  using kernels::V8d;
  const double inf = std::numeric_limits<double>::infinity();
  const int64_t whole = V / 8 * 8;
  const V8d zero = {};
  V8d top8 = zero - inf;
  for (int64_t v = 0; v < whole; v += 8) {
    V8d x;
    std::memcpy(&x, z + v, sizeof(x));
    top8 = x > top8 ? x : top8;
  }
  double m = -inf;
  for (int j = 0; j < 8; ++j) m = std::max(m, top8[j]);
  for (int64_t v = whole; v < V; ++v) m = std::max(m, z[v]);
  if (!std::isfinite(m)) return m;
  V8d part = {};
  for (int64_t v = 0; v < whole; v += 8) {
    V8d x;
    std::memcpy(&x, z + v, sizeof(x));
    x -= m;
    kernels::Exp(x);
    part += x;
  }
  if (whole < V) {  // the last V mod 8, padded with −∞, whose exponentials are 0
    V8d x = zero - inf;
    std::memcpy(&x, z + whole, (V - whole) * sizeof(double));
    x -= m;
    kernels::Exp(x);
    part += x;
  }
  for (int w = 4; w > 0; w /= 2) {
    for (int j = 0; j < w; ++j) part[j] += part[j + w];
  }
  return m + std::log(part[0]);
}

namespace {

// w_v = exp(z_v · inv_t − m), m = max_v z_v · inv_t, eight lanes at a time; returns Σ_v w_v, summed
// as LogSumExp sums. With libm's exp per logit the token choice of a temperature-1 step of 64 rows
// of 8,192 logits took 2.3-2.6 ms of one thread on a 2-vCPU Xeon; with these, 1.1-1.3 ms.
TINKERD_CPU_CLONES double ScaledExps(const double* z, int64_t V, double inv_t, double* w) {
  using kernels::V8d;
  double m = -std::numeric_limits<double>::infinity();
  for (int64_t v = 0; v < V; ++v) m = std::max(m, z[v] * inv_t);
  const int64_t whole = V / 8 * 8;
  V8d part = {};
  for (int64_t v = 0; v < whole; v += 8) {
    V8d x;
    std::memcpy(&x, z + v, sizeof(x));
    x = x * inv_t - m;
    kernels::Exp(x);
    std::memcpy(w + v, &x, sizeof(x));
    part += x;
  }
  if (whole < V) {  // the last V mod 8, padded with −∞, whose exponentials are 0
    V8d x = V8d{} - std::numeric_limits<double>::infinity();
    std::memcpy(&x, z + whole, (V - whole) * sizeof(double));
    x = x * inv_t - m;
    kernels::Exp(x);
    std::memcpy(w + whole, &x, (V - whole) * sizeof(double));
    part += x;
  }
  for (int h = 4; h > 0; h /= 2) {
    for (int j = 0; j < h; ++j) part[j] += part[j + h];
  }
  return part[0];
}

}  // namespace

void DrawIndependent(const double* z, int64_t V, double lse, double temperature, int64_t k,
                     SplitMix64& rng, std::pair<int64_t, double>* out) {
  if (temperature == 0) {
    const int64_t v = std::max_element(z, z + V) - z;
    for (int64_t j = 0; j < k; ++j) out[j] = {v, z[v] - lse};
    return;
  }
  // The cumulative weights once, then a binary search per draw: k draws cost one pass over the
  // row and k·log V, not k passes.
  std::vector<double> cum(V);
  ScaledExps(z, V, 1.0 / temperature, cum.data());
  for (int64_t v = 1; v < V; ++v) cum[v] += cum[v - 1];
  for (int64_t j = 0; j < k; ++j) {
    const double u = rng.Uniform() * cum[V - 1];
    // The first token whose cumulative weight exceeds u has weight > 0 (a zero weight leaves the
    // sum where it was, so u < cum[v] is first true at a token that added mass).
    int64_t v = std::upper_bound(cum.begin(), cum.end(), u) - cum.begin();
    v = std::min(v, V - 1);
    out[j] = {v, z[v] - lse};
  }
}

TopLogprobs MostLikely(const double* z, int64_t V, double lse, int64_t k) {
  k = std::min(k, V);
  std::vector<int64_t> order(V);
  std::iota(order.begin(), order.end(), 0);
  std::partial_sort(order.begin(), order.begin() + k, order.end(),
                    [z](int64_t a, int64_t b) { return z[a] > z[b] || (z[a] == z[b] && a < b); });
  TopLogprobs top(k);
  for (int64_t i = 0; i < k; ++i) top[i] = {order[i], z[order[i]] - lse};
  return top;
}

Choice ChooseToken(const double* z, int64_t V, double lse, const SamplingParams& params,
                   SplitMix64& rng) {
  auto chosen = [&](int64_t v) { return Choice{v, z[v] - lse, {}}; };
  if (params.temperature == 0) {
    return chosen(std::max_element(z, z + V) - z);
  }
  const double inv_t = 1.0 / params.temperature;
  const bool truncate = (params.top_k > 0 && params.top_k < V) || params.top_p < 1;
  if (!truncate) {
    // Every token, in index order: no sort over the vocabulary.
    std::vector<double> w(V);
    const double total = ScaledExps(z, V, inv_t, w.data());
    const double uniform = rng.Uniform();
    double u = uniform * total, cum = 0;
    for (int64_t v = 0; v < V; ++v) {
      cum += w[v];
      if (u < cum && w[v] > 0) return chosen(v);
    }
    // The walk's running sum (in index order) ended below the total (summed in lanes) by
    // rounding, and u fell between them: walk again against the sum the walk reaches, so that
    // no token takes that sliver of mass.
    u = uniform * cum;
    cum = 0;
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
