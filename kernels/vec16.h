// Sixteen floats as one value of GCC's vector extension: one AVX-512 register, two AVX2 or four
// SSE registers on the other clones (kernels/cpu_clones.h). Sums of sixteen partial sums are
// always added in one order: lanes j and j + 8, then j and j + 4, then (0 + 2) + (1 + 3).
// Shuffles, not memcpy, split the halves: a value whose address is taken is kept in memory, and
// GCC then zeroed and reloaded a kernel's accumulators through the stack on every call.
// __builtin_shufflevector needs GCC 12 or newer (Debian 12's), or clang.
#pragma once

namespace tinkerd::kernels {

using V16 = float __attribute__((vector_size(64)));
// Reads a V16 from any float address (GCC's idiom for an unaligned load).
using V16u = float __attribute__((vector_size(64), aligned(4), may_alias));
using V8 = float __attribute__((vector_size(32)));
using V4 = float __attribute__((vector_size(16)));

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

}  // namespace tinkerd::kernels
