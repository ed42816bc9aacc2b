// A small counter-based generator (SplitMix64) so that "seed s" means the same numbers on every
// LibTorch version, platform and thread count. LibTorch's own generators changed across releases.
#pragma once

#include <cmath>
#include <cstdint>

#include "runner/util/hash.h"

namespace tinkerd {

class SplitMix64 {
 public:
  explicit SplitMix64(uint64_t seed) : state_(seed) {}

  uint64_t Next() {
    uint64_t z = (state_ += kGamma);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  // Moves on as `draws` calls of Next would: the state is a counter, so a stream can be split
  // into pieces generated apart.
  void Skip(uint64_t draws) { state_ += draws * kGamma; }
  static constexpr uint64_t kDrawsPerNormal = 2;  // Normal's two Uniforms
  // Uniform in [0, 1) with 53 random bits.
  double Uniform() { return static_cast<double>(Next() >> 11) * 0x1.0p-53; }
  double Uniform(double lo, double hi) { return lo + (hi - lo) * Uniform(); }
  // Standard normal by Box-Muller; one draw per call keeps the stream easy to reason about.
  double Normal() {
    double u1 = Uniform();
    double u2 = Uniform();
    if (u1 < 1e-300) u1 = 1e-300;
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  }

 private:
  static constexpr uint64_t kGamma = 0x9E3779B97F4A7C15ull;
  uint64_t state_;
};

// Derives independent streams from one seed and a name (e.g. a tensor name), order-independent.
inline uint64_t MixSeed(uint64_t seed, const char* name) {
  SplitMix64 g(seed ^ Fnv64(name));
  return g.Next();
}

}  // namespace tinkerd
