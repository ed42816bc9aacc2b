#include "kernels/gemv.h"

#include <c10/core/GradMode.h>

#include <algorithm>
#include <array>
#include <cstring>

#include "kernels/cpu_clones.h"
#include "kernels/parallel.h"
#include "kernels/vec16.h"

namespace tinkerd::kernels {
namespace {

// Each lane's `acc += x * w` is one fused multiply-add (-ffp-contract=fast, kernels/CMakeLists.txt)
// in Block's AVX-512 and AVX2 builds and in HalvesBlock: part of the order gemv.h states.
//
// y[r][c] for R rows of x (ldx apart) and C rows of w (I apart), into y (ldy apart). R · C
// accumulators stay in registers: 4 × 4 takes 16 of AVX-512's 32, with the 4 weight vectors and
// one row of x beside them.
template <int R, int C>
TINKERD_CPU_CLONES void Block(const float* x, int64_t ldx, const float* w, int64_t I, float* y,
                              int64_t ldy) {
  V16 acc[R][C] = {};
  int64_t i = 0;
  for (; i + 16 <= I; i += 16) {
    V16 w16[C];
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) w16[c] = *reinterpret_cast<const V16u*>(w + c * I + i);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const V16 x16 = *reinterpret_cast<const V16u*>(x + r * ldx + i);
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) acc[r][c] += x16 * w16[c];
    }
  }
  if (i < I) {  // the last I mod 16 elements, zero-padded to sixteen
    V16 x16 = {}, w16 = {};
    // Unrolled, as every loop over acc: an index the compiler cannot resolve keeps acc in memory.
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      std::memcpy(&x16, x + r * ldx + i, (I - i) * sizeof(float));
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) {
        std::memcpy(&w16, w + c * I + i, (I - i) * sizeof(float));
        acc[r][c] += x16 * w16;
      }
    }
  }
  const V16 zero = {};
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    const V4 sums = Total4(acc[r][0], C > 1 ? acc[r][1 % C] : zero, C > 2 ? acc[r][2 % C] : zero,
                           C > 3 ? acc[r][3 % C] : zero);
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) y[r * ldy + c] = sums[c];
  }
}

// An empty asm statement that takes v in a vector register: the compiler must load it there.
__attribute__((always_inline)) inline void HoldInRegister(V8& v) {
#if defined(__x86_64__)
  asm("" : "+x"(v));
#endif
}

template <int R, int C>
TINKERD_AVX2 __attribute__((always_inline)) inline void Step8(const float* x, int64_t ldx,
                                                              const float* w, int64_t ldw,
                                                              V8 (&acc)[R][C]) {
  // HoldInRegister keeps each loaded vector in a register: GCC otherwise folds a load into every
  // multiply-add that reads it, R + R·C loads where R + C do.
  V8 w8[C];
#pragma GCC unroll 4
  for (int c = 0; c < C; ++c) {
    w8[c] = *reinterpret_cast<const V8u*>(w + c * ldw);
    HoldInRegister(w8[c]);
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    V8 x8 = *reinterpret_cast<const V8u*>(x + r * ldx);
    HoldInRegister(x8);
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) acc[r][c] += x8 * w8[c];
  }
}

// The same sums on a CPU with AVX2 (sixteen 8-float registers) instead of AVX-512 (thirty-two of
// 16): each V16 accumulator is held as its two halves, lanes 0-7 and 8-15, which sum the same
// elements in the same order, so a block's results are Block's to the bit. 3 × 2 accumulators
// take twelve registers, with two weight halves and one of x beside them; Block<4, 4> compiled
// for AVX2 spilled its 32 halves to the stack on every step (0.15x at::mm at 64 rows, against
// 1.0x for these; bench/gemv_bench on a 2-vCPU EPYC).
template <int R, int C>
TINKERD_AVX2 void HalvesBlock(const float* x, int64_t ldx, const float* w, int64_t I, float* y,
                              int64_t ldy) {
  V8 lo[R][C] = {}, hi[R][C] = {};
  int64_t i = 0;
  for (; i + 16 <= I; i += 16) {
    Step8<R, C>(x + i, ldx, w + i, I, lo);
    Step8<R, C>(x + i + 8, ldx, w + i + 8, I, hi);
  }
  if (i < I) {  // the last I mod 16 elements, zero-padded to sixteen as in Block
    float xs[R][16] = {}, ws[C][16] = {};
    for (int r = 0; r < R; ++r) std::memcpy(xs[r], x + r * ldx + i, (I - i) * sizeof(float));
    for (int c = 0; c < C; ++c) std::memcpy(ws[c], w + c * I + i, (I - i) * sizeof(float));
    Step8<R, C>(xs[0], 16, ws[0], 16, lo);
    Step8<R, C>(xs[0] + 8, 16, ws[0] + 8, 16, hi);
  }
  const V16 zero = {};
  V16 acc[C];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
      acc[c] = __builtin_shufflevector(lo[r][c], hi[r][c], 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,
                                       13, 14, 15);
    }
    const V4 sums = Total4(acc[0], C > 1 ? acc[1 % C] : zero, C > 2 ? acc[2 % C] : zero,
                           C > 3 ? acc[3 % C] : zero);
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) y[r * ldy + c] = sums[c];
  }
}

using BlockFn = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t);

template <int R>
constexpr std::array<BlockFn, 4> WideRow() {
  return {&Block<R, 1>, &Block<R, 2>, &Block<R, 3>, &Block<R, 4>};
}

// Up to 3 × 2: the larger ones would spill, and a tile never asks for them (kHalves' bounds are
// these, so every block a tile asks for is in the table by construction).
constexpr int kHalvesRows = 3, kHalvesCols = 2;

template <int R, int C>
constexpr BlockFn HalvesOrNone() {
  if constexpr (R <= kHalvesRows && C <= kHalvesCols) {
    return &HalvesBlock<R, C>;
  } else {
    return nullptr;
  }
}

template <int R>
constexpr std::array<BlockFn, 4> HalvesRow() {
  return {HalvesOrNone<R, 1>(), HalvesOrNone<R, 2>(), HalvesOrNone<R, 3>(), HalvesOrNone<R, 4>()};
}

// The blocks of one CPU kind: fn[R − 1][C − 1] multiplies R rows of x with C weight rows, and a
// tile is cut into blocks of up to rows × cols.
struct Blocks {
  int64_t rows, cols;
  std::array<std::array<BlockFn, 4>, 4> fn;
};

constexpr Blocks kWide = {4, 4, {WideRow<1>(), WideRow<2>(), WideRow<3>(), WideRow<4>()}};
constexpr Blocks kHalves = {
    kHalvesRows, kHalvesCols, {HalvesRow<1>(), HalvesRow<2>(), HalvesRow<3>(), HalvesRow<4>()}};

enum class Isa { kNone, kAvx2, kAvx512 };

Isa CpuIsa() {
  static const Isa isa = [] {
#if defined(__x86_64__)
    // The levels TINKERD_CPU_CLONES builds for, so that Block runs its fused build on either.
    __builtin_cpu_init();
    if (__builtin_cpu_supports("x86-64-v4")) return Isa::kAvx512;
    if (__builtin_cpu_supports("x86-64-v3")) return Isa::kAvx2;
#endif
    return Isa::kNone;
  }();
  return isa;
}

}  // namespace

bool GemvRunsHere() {
  return CpuIsa() != Isa::kNone;
}

bool GemvFits(const at::Tensor& x_NI, const at::Tensor& w_OI) {
  return GemvRunsHere() && x_NI.device().is_cpu() && w_OI.device().is_cpu() &&
         x_NI.scalar_type() == at::kFloat && w_OI.scalar_type() == at::kFloat && x_NI.dim() == 2 &&
         w_OI.dim() == 2 && x_NI.size(1) == w_OI.size(1);
}

bool GemvServes(const at::Tensor& x_NI, const at::Tensor& w_OI) {
  const bool grad = c10::GradMode::is_enabled() && (x_NI.requires_grad() || w_OI.requires_grad());
  return !grad && GemvFits(x_NI, w_OI);
}

at::Tensor Gemv(const GemvParams& p) {
  TORCH_CHECK(p.x_NI.dim() == 2 && p.w_OI.dim() == 2 && p.x_NI.size(1) == p.w_OI.size(1),
              "gemv: x [N, I] and w [O, I] do not match");
  TORCH_CHECK(p.x_NI.scalar_type() == at::kFloat && p.w_OI.scalar_type() == at::kFloat &&
                  p.x_NI.device().is_cpu() && p.w_OI.device().is_cpu(),
              "gemv: float32 on the CPU only");
  const at::Tensor x = p.x_NI.stride(1) == 1 ? p.x_NI : p.x_NI.contiguous();
  const at::Tensor w = p.w_OI.contiguous();
  const int64_t N = x.size(0), I = x.size(1), O = w.size(0), ldx = x.stride(0);
  at::Tensor y_NO = at::empty({N, O}, x.options());
  if (N == 0 || O == 0) return y_NO;
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y_NO.data_ptr<float>();
  // Tasks of whole column blocks, each at least 256 KiB of weights, so that a thread streams a
  // long run of rows.
  const Blocks& k = CpuIsa() == Isa::kAvx2 ? kHalves : kWide;
  const int64_t block_rows = k.rows, block_cols = k.cols;
  const int64_t blocks = (O + block_cols - 1) / block_cols;
  const int64_t grain =
      std::max<int64_t>(1, (int64_t{1} << 16) / (block_cols * std::max<int64_t>(I, 1)));
  for (int64_t n0 = 0; n0 < N; n0 += kGemvTileRows) {
    const int64_t n1 = std::min(N, n0 + kGemvTileRows);
    // While a block of weight rows is multiplied with the tile's groups of rows, each group asks
    // for its share of the next block's cache lines: the first group's loads found the block
    // in memory, not in cache, and waited on it (a fifth of the time at 64 rows, gemv_bench).
    const int64_t groups = (n1 - n0 + block_rows - 1) / block_rows;
    const int64_t lines = (block_cols * I + 15) / 16, share = (lines + groups - 1) / groups;
    ParallelFor(0, blocks, grain, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t o = b * block_cols, cols = std::min<int64_t>(block_cols, O - o);
        const float* next = wp + std::min(o + block_cols, O - 1) * I;
        const int64_t next_lines = b + 1 < b1 ? std::min(lines, ((O - o - cols) * I + 15) / 16) : 0;
        for (int64_t n = n0, g = 0; n < n1; n += block_rows, ++g) {
          for (int64_t l = g * share; l < std::min(next_lines, (g + 1) * share); ++l) {
            __builtin_prefetch(next + 16 * l);
          }
          const int64_t rows = std::min<int64_t>(block_rows, n1 - n);
          k.fn[rows - 1][cols - 1](xp + n * ldx, ldx, wp + o * I, I, yp + n * O + o, O);
        }
      }
    });
  }
  return y_NO;
}

at::Tensor LinearProduct(const at::Tensor& x_NI, const at::Tensor& w_OI) {
  return GemvServes(x_NI, w_OI) ? Gemv({x_NI, w_OI}) : at::mm(x_NI, w_OI.t());
}

}  // namespace tinkerd::kernels
