// Sixteen floats as one value of GCC's vector extension: one AVX-512 register, two AVX2 or four
// SSE registers on the other clones (kernels/cpu_clones.h). Sums of sixteen partial sums are
// always added in one order: lanes j and j + 8, then j and j + 4, then (0 + 2) + (1 + 3).
// Shuffles, not memcpy, split the halves: a value whose address is taken is kept in memory, and
// GCC then zeroed and reloaded a kernel's accumulators through the stack on every call.
// __builtin_shufflevector needs GCC 12 or newer (Debian 12's), or clang.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace tinkerd::kernels {

using V16 = float __attribute__((vector_size(64)));
// Reads a V16 from any float address (GCC's idiom for an unaligned load).
using V16u = float __attribute__((vector_size(64), aligned(4), may_alias));
using V8 = float __attribute__((vector_size(32)));
using V8u = float __attribute__((vector_size(32), aligned(4), may_alias));
using V4 = float __attribute__((vector_size(16)));
using V16i = int32_t __attribute__((vector_size(64)));
// Eight doubles: one AVX-512 register.
using V8d = double __attribute__((vector_size(64)));
using V8l = int64_t __attribute__((vector_size(64)));

// Sixteen bf16 values as their bit patterns, from any address.
using V16h = uint16_t __attribute__((vector_size(32), aligned(2), may_alias));

// v = the n <= 16 elements at x widened to float, the rest zero (in place, as Exp). A bf16 value
// is the high half of its float, so sixteen widen at once by a shift.
template <typename T>
inline void Widen(const T* x, int64_t n, V16& v) {
  if constexpr (std::is_same_v<T, float>) {
    if (n == 16) {
      v = *reinterpret_cast<const V16u*>(x);
      return;
    }
    v = V16{};
    std::memcpy(&v, x, n * sizeof(float));
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    V16h bits = {};
    if (n == 16) {
      bits = *reinterpret_cast<const V16h*>(x);
    } else {
      std::memcpy(&bits, x, n * sizeof(uint16_t));
    }
    const V16i wide = __builtin_convertvector(bits, V16i) << 16;
    std::memcpy(&v, &wide, sizeof(v));
  } else {
    v = V16{};
    for (int64_t j = 0; j < n; ++j) v[j] = static_cast<float>(x[j]);
  }
}

inline float Total(const V16& v) {
  const V8 s8 = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const V4 s4 =
      __builtin_shufflevector(s8, s8, 0, 1, 2, 3) + __builtin_shufflevector(s8, s8, 4, 5, 6, 7);
  return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

// {Total(a), Total(b), Total(c), Total(d)}, bitwise, with the four sums' additions shared across
// lanes: a quarter of the instructions of four Totals.
inline V4 Total4(const V16& a, const V16& b, const V16& c, const V16& d) {
  // Lanes 0-7: a's j + (j + 8); 8-15: b's.
  const V16 ab =
      __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
      __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  const V16 cd =
      __builtin_shufflevector(c, d, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
      __builtin_shufflevector(c, d, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  // Lanes 4k..4k+3: column k's j + (j + 4).
  const V16 s4 =
      __builtin_shufflevector(ab, cd, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
      __builtin_shufflevector(ab, cd, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  // Lanes 2k, 2k+1: column k's 0 + 2 and 1 + 3; then their sum.
  const V8 s2 = __builtin_shufflevector(s4, s4, 0, 1, 4, 5, 8, 9, 12, 13) +
                __builtin_shufflevector(s4, s4, 2, 3, 6, 7, 10, 11, 14, 15);
  return __builtin_shufflevector(s2, s2, 0, 2, 4, 6) + __builtin_shufflevector(s2, s2, 1, 3, 5, 7);
}

// x = e^x in sixteen lanes (in place: a function returning a V16 has no stable ABI), for softmax
// arguments (x <= 0). Exact to a few ulp up to 88.37; above, where n reaches 128, +∞ (e^x itself
// overflows at 88.72). Below −87.33 (e^x under the smallest normal float) 0; NaN stays NaN. x =
// n·ln2 + r with |r| <= ln2/2 (ln2 in two parts, the first exact times any n here), then e^r by its
// Taylor series to r^7, whose remainder |r|^8/8! · e^|r| is below 8e-9 relative (0.13 ulp); the
// seven roundings of Horner's scheme bring the error to a few ulp at most (kernel_tests measure it
// against libm in float64). One pass of a softmax's exponentials: libm's scalar expf, called per
// score, took a decode step's attention more time than its products.
inline void Exp(V16& x) {
  constexpr float kLowest = -87.33654f;  // ln(2^-126)
  constexpr float kHighest = 88.72284f;  // ln(2^128): past it n would pass 128
  const V16 zero = {}, lowest = zero + kLowest, highest = zero + kHighest;
  // NaN compares false and takes the clamp, so that no NaN is converted to an integer below.
  V16 xc = x >= lowest ? x : lowest;
  xc = xc <= highest ? xc : highest;
  constexpr float kMagic = 12582912.0f;  // 1.5 · 2^23: adding it rounds to an integer
  const V16 n = (xc * 1.44269504f + kMagic) - kMagic;
  V16 r = xc - n * 0.693359375f;  // ln2's first nine bits: n · them is exact
  r = r - n * -2.12194440e-4f;    // the rest of ln2
  V16 p = 1.0f / 5040 + zero;
  p = p * r + 1.0f / 720;
  p = p * r + 1.0f / 120;
  p = p * r + 1.0f / 24;
  p = p * r + 1.0f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const V16i two_n = (__builtin_convertvector(n, V16i) + 127) << 23;
  const V16 y = p * __builtin_bit_cast(V16, two_n);
  x = x < lowest ? zero : (x == x ? y : x);
}

// x = e^x in eight double lanes, as the float Exp above: +∞ above 709.43 (n reaches 1024), 0 below
// −708.39 (e^x under the smallest normal double), NaN stays NaN. ln2 in two parts (the first's 32
// significant bits times any n here are exact), then the Taylor series of e^r to r^13, whose
// remainder is below 5e-18 relative (0.03 ulp) for |r| <= ln2/2; Horner's thirteen roundings leave
// a few ulp at most (kernel_tests measure it against long double). The sampler's log-sum-exp over a
// row of logits: ATen's took four passes over a step's [rows, vocabulary] logits and two copies of
// them.
inline void Exp(V8d& x) {
  constexpr double kLowest = -708.3964185322641;  // ln(2^-1022)
  constexpr double kHighest = 709.782712893384;   // ln(2^1024): past it n would pass 1024
  const V8d zero = {}, lowest = zero + kLowest, highest = zero + kHighest;
  V8d xc = x >= lowest ? x : lowest;  // NaN takes the clamp, as above
  xc = xc <= highest ? xc : highest;
  constexpr double kMagic = 6755399441055744.0;  // 1.5 · 2^52: adding it rounds to an integer
  const V8d n = (xc * 1.4426950408889634 + kMagic) - kMagic;
  V8d r = xc - n * 6.93147180369123816490e-01;
  r = r - n * 1.90821492927058770002e-10;
  constexpr double kInverseFactorials[] = {1.0 / 6227020800,
                                           1.0 / 479001600,
                                           1.0 / 39916800,
                                           1.0 / 3628800,
                                           1.0 / 362880,
                                           1.0 / 40320,
                                           1.0 / 5040,
                                           1.0 / 720,
                                           1.0 / 120,
                                           1.0 / 24,
                                           1.0 / 6,
                                           0.5,
                                           1.0,
                                           1.0};
  V8d p = zero + kInverseFactorials[0];
#pragma GCC unroll 13
  for (int k = 1; k < 14; ++k) p = p * r + kInverseFactorials[k];
  const V8l two_n = (__builtin_convertvector(n, V8l) + 1023) << 52;
  const V8d y = p * __builtin_bit_cast(V8d, two_n);
  x = x < lowest ? zero : (x == x ? y : x);
}

}  // namespace tinkerd::kernels
