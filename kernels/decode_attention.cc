#include "kernels/decode_attention.h"

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

#include "kernels/attention.h"
#include "kernels/cpu_clones.h"
#include "kernels/parallel.h"
#include "kernels/vec16.h"

namespace tinkerd::kernels {
namespace {

void Check(const DecodeAttentionParams& p) {
  TORCH_CHECK(p.q_SHd.dim() == 3, "decode attention: q must be [sequences, heads, head_dim]");
  const int64_t S = p.q_SHd.size(0), H = p.q_SHd.size(1), d = p.q_SHd.size(2);
  TORCH_CHECK(
      static_cast<int64_t>(p.k_pieces.size()) == S && p.v_pieces.size() == p.k_pieces.size(),
      "decode attention: one list of key and of value pieces per sequence");
  TORCH_CHECK(p.lengths.empty() || static_cast<int64_t>(p.lengths.size()) == S,
              "decode attention: lengths must give every sequence's or none");
  TORCH_CHECK(p.window >= 0, "decode attention: negative window");
  int64_t K = 0;
  for (int64_t s = 0; s < S; ++s) {
    TORCH_CHECK(p.k_pieces[s].size() == p.v_pieces[s].size(), "decode attention: sequence ", s,
                " has unlike key and value pieces");
    int64_t L = 0;
    for (size_t i = 0; i < p.k_pieces[s].size(); ++i) {
      const at::Tensor& k = p.k_pieces[s][i];
      const at::Tensor& v = p.v_pieces[s][i];
      TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes() && k.size(2) == d && k.size(1) > 0 &&
                      H % k.size(1) == 0,
                  "decode attention: sequence ", s, " piece ", i,
                  ": keys and values must both be [n, K, d] with K dividing the query heads");
      TORCH_CHECK(K == 0 || k.size(1) == K, "decode attention: pieces differ in kv heads");
      K = k.size(1);
      for (const at::Tensor* t : {&k, &v}) {
        TORCH_CHECK(t->scalar_type() == p.q_SHd.scalar_type() && t->device() == p.q_SHd.device(),
                    "decode attention: pieces must have the query's dtype and device");
      }
      L += k.size(0);
    }
    if (!p.lengths.empty()) {
      TORCH_CHECK(p.lengths[s] >= 0 && p.lengths[s] <= L, "decode attention: sequence ", s,
                  " has length ", p.lengths[s], ", outside [0, ", L, "], its pieces' rows");
      L = p.lengths[s];
    }
    TORCH_CHECK(L > 0, "decode attention: sequence ", s, " has no keys");
  }
}

// Of sequence s's keys, those not in its first `read` rows.
int64_t Remaining(const DecodeAttentionParams& p, size_t s, int64_t read) {
  return p.lengths.empty() ? std::numeric_limits<int64_t>::max() : p.lengths[s] - read;
}

// Every sequence's pieces packed, and kernels::Attention with one query per sequence.
at::Tensor Packed(const DecodeAttentionParams& p) {
  AttentionParams a;
  a.q_THd = p.q_SHd;
  a.cu_seqlens_q = {0};
  a.cu_seqlens_k = {0};
  std::vector<at::Tensor> keys, values;
  for (size_t s = 0; s < p.k_pieces.size(); ++s) {
    int64_t L = 0;
    for (size_t i = 0; i < p.k_pieces[s].size(); ++i) {
      const int64_t n = std::min(p.k_pieces[s][i].size(0), Remaining(p, s, L));
      keys.push_back(p.k_pieces[s][i].narrow(0, 0, n));
      values.push_back(p.v_pieces[s][i].narrow(0, 0, n));
      L += n;
    }
    a.cu_seqlens_q.push_back(a.cu_seqlens_q.back() + 1);
    a.cu_seqlens_k.push_back(a.cu_seqlens_k.back() + L);
  }
  a.k_UKd = at::cat(keys);
  a.v_UKd = at::cat(values);
  a.window = p.window;
  a.scale = p.scale;
  return Attention(a);
}

// A piece's rows: key (r, kv head, i) at k[r·k_row + kv·d + i], values alike.
template <typename T>
struct Piece {
  const T* k;
  const T* v;
  int64_t n, k_row, v_row;
};

// Rows may be strided (a narrowed cache), the K·d elements of a row may not.
at::Tensor RowsDense(const at::Tensor& t) {
  const bool dense = t.size(0) == 0 || (t.stride(2) == 1 && t.stride(1) == t.size(2));
  return dense ? t : t.contiguous();
}

// The loop below is most of a decode step's time outside the matmuls: see cpu_clones.h.

// q·k in sixteen independent partial sums, added pairwise: the compiler may keep them in vector
// registers, which a single running sum would forbid (it cannot reorder floating-point additions).
template <typename T, typename A>
inline A Dot(const A* __restrict q, const T* __restrict k, int64_t d) {
  A part[16] = {};
  int64_t i = 0;
  for (; i + 16 <= d; i += 16) {
    for (int64_t j = 0; j < 16; ++j) part[j] += q[i + j] * static_cast<A>(k[i + j]);
  }
  for (; i < d; ++i) part[0] += q[i] * static_cast<A>(k[i]);
  for (int64_t w = 8; w > 0; w /= 2) {
    for (int64_t j = 0; j < w; ++j) part[j] += part[j + w];
  }
  return part[0];
}

// The same sums in the same order for float, written in vector types: GCC kept the generic loop's
// sixteen sums in memory and added them one at a time, which took more of the loop than the
// products did.
template <>
inline float Dot<float, float>(const float* __restrict q, const float* __restrict k, int64_t d) {
  V16 part = {};
  int64_t i = 0;
  for (; i + 16 <= d; i += 16) {
    part += *reinterpret_cast<const V16u*>(q + i) * *reinterpret_cast<const V16u*>(k + i);
  }
  for (; i < d; ++i) part[0] += q[i] * k[i];
  return Total(part);
}

// A task reads its kv heads' elements of each cached row, rows K · d apart. When that was one
// head's d elements, the hardware prefetcher did not run ahead of the stride, and the loop waited
// on memory for most of its time. Asking for the row kAhead rows on took the batch-64 decode (128
// tokens) from about 800 to 1,130 tokens/s on a 2-vCPU EPYC; 2 rows ahead gave 976, 8 rows 1,030
// (bench/RESULTS.md).
constexpr int64_t kAhead = 4;

template <typename T>
inline void Prefetch(const T* row, int64_t d) {
  for (int64_t i = 0; i < d; i += 64 / sizeof(T)) __builtin_prefetch(row + i);
}

// o += w · v, sixteen lanes at a time for the same reason.
template <typename T, typename A>
inline void Axpy(A w, const T* __restrict v, A* __restrict o, int64_t d) {
  int64_t i = 0;
  for (; i + 16 <= d; i += 16) {
    for (int64_t j = 0; j < 16; ++j) o[i + j] += w * static_cast<A>(v[i + j]);
  }
  for (; i < d; ++i) o[i] += w * static_cast<A>(v[i]);
}

// One task: the G query heads of one sequence that read each of its kv heads [kv0, kv0 + nkv),
// over its visible keys [first, first + visible). q_Nd is already scaled, N = nkv · G heads;
// scores holds N · visible, o N · d, sum N; lse_N, when set, gets each head's log Σ exp(score).
template <typename T, typename A>
struct Task {
  const A* q_Nd;
  const std::vector<Piece<T>>* pieces;
  int64_t G, d, kv0, nkv, first, visible;
  A* scores;
  A* o;
  A* sum;
  T* out_Nd;
  A* lse_N;
};

template <typename T, typename A>
TINKERD_CPU_CLONES void Attend(const Task<T, A>& t) {
  const int64_t G = t.G, d = t.d, visible = t.visible, N = t.nkv * G, span = t.nkv * d;
  // Scores, laid out [N, visible]; then each head's softmax in place.
  int64_t j = 0;
  for (const Piece<T>& piece : *t.pieces) {
    for (int64_t r = std::max<int64_t>(0, t.first - j); r < piece.n; ++r) {
      const T* row = piece.k + r * piece.k_row + t.kv0 * d;
      if (r + kAhead < piece.n) Prefetch(row + kAhead * piece.k_row, span);
      for (int64_t kv = 0, h = 0; kv < t.nkv; ++kv) {
        for (int64_t g = 0; g < G; ++g, ++h) {
          t.scores[h * visible + j + r - t.first] = Dot(&t.q_Nd[h * d], row + kv * d, d);
        }
      }
    }
    j += piece.n;
  }
  for (int64_t h = 0; h < N; ++h) {
    A* scores = &t.scores[h * visible];
    const A top = *std::max_element(scores, scores + visible);
    t.sum[h] = 0;
    for (int64_t c = 0; c < visible; ++c) t.sum[h] += (scores[c] = std::exp(scores[c] - top));
    if (t.lse_N != nullptr) t.lse_N[h] = top + std::log(t.sum[h]);
  }
  std::fill(t.o, t.o + N * d, A(0));
  j = 0;
  for (const Piece<T>& piece : *t.pieces) {
    for (int64_t r = std::max<int64_t>(0, t.first - j); r < piece.n; ++r) {
      const T* row = piece.v + r * piece.v_row + t.kv0 * d;
      if (r + kAhead < piece.n) Prefetch(row + kAhead * piece.v_row, span);
      for (int64_t kv = 0, h = 0; kv < t.nkv; ++kv) {
        for (int64_t g = 0; g < G; ++g, ++h) {
          Axpy(t.scores[h * visible + j + r - t.first], row + kv * d, &t.o[h * d], d);
        }
      }
    }
    j += piece.n;
  }
  for (int64_t h = 0; h < N; ++h) {
    for (int64_t i = 0; i < d; ++i) t.out_Nd[h * d + i] = static_cast<T>(t.o[h * d + i] / t.sum[h]);
  }
}

// Attend for float with head dims of D16 sixteens (16 to 128), in vector registers:
// - scores: per row, four heads at a time, each q·k in sixteen lanes (Dot's sums), the four
//   totals taken at once (Total4, bitwise four Totals);
// - softmax: the exponentials sixteen at a time (Exp), summed in sixteen lanes;
// - output: per kv head, up to 16 / D16 of its query heads at a time, their accumulators held in
//   registers over all the rows, each element summed over the rows in order as Axpy sums.
// Attend's loops, compiled for float, called libm's expf per score and kept the accumulators in
// memory. The loop waits on memory most of its time: a decode step reads the whole cache.

// Values of at most this many bytes per task are asked for into L2 while the scores pass reads
// the keys, kAhead rows ahead, so that two streams of rows are in flight instead of one, and the
// output pass finds them there (a core's L2 holds 1-2 MiB). On a 2-vCPU Xeon a batch-64 layer of
// 160-token caches took 0.90-0.95 ms before, 0.77-0.94 after, over four alternating runs
// (bench/RESULTS.md, stop 31). Longer values are asked for by the output pass itself,
// kAheadValues rows ahead.
constexpr int64_t kValuesAlongside = int64_t{512} << 10;
constexpr int64_t kAheadValues = 8;

template <typename T, int D16>
TINKERD_CPU_CLONES void AttendFloat(const Task<T, float>& t) {
  constexpr int64_t d = 16 * D16;
  const int64_t G = t.G, visible = t.visible, N = t.nkv * G, span = t.nkv * d;
  const bool alongside = visible * span * static_cast<int64_t>(sizeof(T)) <= kValuesAlongside;
  const V16 zero = {};
  int64_t j = 0;
  for (const Piece<T>& piece : *t.pieces) {
    for (int64_t r = std::max<int64_t>(0, t.first - j); r < piece.n; ++r) {
      const T* row = piece.k + r * piece.k_row + t.kv0 * d;
      if (r + kAhead < piece.n) {
        Prefetch(row + kAhead * piece.k_row, span);
        if (alongside) {
          const T* values = piece.v + (r + kAhead) * piece.v_row + t.kv0 * d;
          for (int64_t i = 0; i < span; i += 64 / sizeof(T)) __builtin_prefetch(values + i, 0, 2);
        }
      }
      const int64_t c = j + r - t.first;
      for (int64_t h0 = 0; h0 < N; h0 += 4) {
        V16 acc[4] = {};
#pragma GCC unroll 8
        for (int i = 0; i < D16; ++i) {
#pragma GCC unroll 4
          for (int g = 0; g < 4; ++g) {
            const int64_t h = std::min<int64_t>(h0 + g, N - 1);  // past N: computed, not stored
            V16 k16;
            Widen(row + h / G * d + 16 * i, 16, k16);
            acc[g] += *reinterpret_cast<const V16u*>(t.q_Nd + h * d + 16 * i) * k16;
          }
        }
        const V4 sums = Total4(acc[0], acc[1], acc[2], acc[3]);
        for (int64_t g = 0; g < 4 && h0 + g < N; ++g) t.scores[(h0 + g) * visible + c] = sums[g];
      }
    }
    j += piece.n;
  }
  const float inf = std::numeric_limits<float>::infinity();
  const int64_t whole = visible / 16 * 16, rest = visible - whole;
  for (int64_t h = 0; h < N; ++h) {
    float* scores = &t.scores[h * visible];
    V16 top16 = zero - inf;
    for (int64_t c = 0; c < whole; c += 16) {
      const V16 x = *reinterpret_cast<const V16u*>(scores + c);
      top16 = x > top16 ? x : top16;
    }
    float top = -inf;
    for (int64_t l = 0; l < 16; ++l) top = std::max(top, top16[l]);
    for (int64_t c = whole; c < visible; ++c) top = std::max(top, scores[c]);
    V16 sum16 = {};
    for (int64_t c = 0; c < whole; c += 16) {
      V16 x = *reinterpret_cast<const V16u*>(scores + c) - top;
      Exp(x);
      *reinterpret_cast<V16u*>(scores + c) = x;
      sum16 += x;
    }
    if (rest > 0) {  // the last visible mod 16, padded with −∞, whose exponentials are 0
      V16 x = zero - inf;
      std::memcpy(&x, scores + whole, rest * sizeof(float));
      x -= top;
      Exp(x);
      std::memcpy(scores + whole, &x, rest * sizeof(float));
      sum16 += x;
    }
    t.sum[h] = Total(sum16);
    if (t.lse_N != nullptr) t.lse_N[h] = top + std::log(t.sum[h]);
  }
  constexpr int64_t kHeads = 16 / D16;
  for (int64_t kv = 0; kv < t.nkv; ++kv) {
    for (int64_t g0 = 0; g0 < G; g0 += kHeads) {
      const int64_t heads = std::min(kHeads, G - g0), h0 = kv * G + g0;
      V16 acc[kHeads][D16] = {};
      j = 0;
      for (const Piece<T>& piece : *t.pieces) {
        for (int64_t r = std::max<int64_t>(0, t.first - j); r < piece.n; ++r) {
          const T* row = piece.v + r * piece.v_row + (t.kv0 + kv) * d;
          if (!alongside && r + kAheadValues < piece.n) {
            // The first pass asks for every kv head's elements of the row, the rest find them
            // in cache.
            const T* ahead = piece.v + (r + kAheadValues) * piece.v_row + t.kv0 * d;
            if (kv == 0 && g0 == 0) {
              Prefetch(ahead, span);
            } else {
              Prefetch(ahead + kv * d, d);
            }
          }
          const float* w = &t.scores[h0 * visible + j + r - t.first];
          V16 v[D16];
#pragma GCC unroll 8
          for (int i = 0; i < D16; ++i) Widen(row + 16 * i, 16, v[i]);
#pragma GCC unroll 16
          for (int64_t g = 0; g < kHeads; ++g) {
            if (g >= heads) break;
            const float wg = w[g * visible];
#pragma GCC unroll 8
            for (int i = 0; i < D16; ++i) acc[g][i] += wg * v[i];
          }
        }
        j += piece.n;
      }
#pragma GCC unroll 16
      for (int64_t g = 0; g < kHeads; ++g) {
        if (g >= heads) break;
#pragma GCC unroll 8
        for (int i = 0; i < D16; ++i) {
          const V16 out = acc[g][i] / t.sum[h0 + g];
          T* dst = t.out_Nd + (h0 + g) * d + 16 * i;
          if constexpr (std::is_same_v<T, float>) {
            *reinterpret_cast<V16u*>(dst) = out;
          } else {
            for (int l = 0; l < 16; ++l) dst[l] = static_cast<T>(out[l]);
          }
        }
      }
    }
  }
}

template <typename T>
using AttendFloatFn = void (*)(const Task<T, float>&);

// kAttendFloat<T>[D16 − 1] is AttendFloat<T, D16>.
template <typename T>
constexpr std::array<AttendFloatFn<T>, 8> kAttendFloat = {
    &AttendFloat<T, 1>, &AttendFloat<T, 2>, &AttendFloat<T, 3>, &AttendFloat<T, 4>,
    &AttendFloat<T, 5>, &AttendFloat<T, 6>, &AttendFloat<T, 7>, &AttendFloat<T, 8>};

// Every query row s of q_SHd over its own pieces' first lengths[s] keys (its position is
// lengths[s] − 1), the window counted back from there. lse_SH, when set, gets each head's lse.
template <typename T>
void Cpu(const at::Tensor& q_SHd, int64_t K, const std::vector<std::vector<Piece<T>>>& pieces,
         const std::vector<int64_t>& lengths, int64_t window, double scale, at::Tensor& out_SHd,
         at::opmath_type<T>* lse_SH) {
  using A = at::opmath_type<T>;
  const int64_t S = q_SHd.size(0), H = q_SHd.size(1), d = q_SHd.size(2), G = H / K;
  // A task per sequence reads its cached rows whole, K · d contiguous elements each; a task per
  // (sequence, kv head) reads d of every K · d, and the batch-64 decode ran about 15% slower that
  // way (bench/RESULTS.md). Per kv head only when the sequences are too few to keep every thread
  // busy. Each head's sums run in the same order either way.
  const int64_t nkv = S >= 2 * at::get_num_threads() ? K : 1;
  // Float and bf16 take the vector registers where d is a multiple of 16 they hold (up to 128).
  [[maybe_unused]] const bool vector = d % 16 == 0 && d / 16 >= 1 && d / 16 <= 8;
  const T* q_all = q_SHd.data_ptr<T>();
  T* out_all = out_SHd.data_ptr<T>();
  ParallelFor(0, S * (K / nkv), 1, [&](int64_t begin, int64_t end) {
    std::vector<A> q(nkv * G * d), o(nkv * G * d), scores, sum(nkv * G);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / (K / nkv), kv0 = task % (K / nkv) * nkv, L = lengths[s];
      const int64_t first = window > 0 ? std::max<int64_t>(0, L - window) : 0;
      const T* q_Nd = q_all + (s * H + kv0 * G) * d;
      for (int64_t i = 0; i < nkv * G * d; ++i) {
        q[i] = static_cast<A>(q_Nd[i]) * static_cast<A>(scale);
      }
      scores.resize(nkv * G * (L - first));
      const Task<T, A> t{q.data(),
                         &pieces[s],
                         G,
                         d,
                         kv0,
                         nkv,
                         first,
                         L - first,
                         scores.data(),
                         o.data(),
                         sum.data(),
                         out_all + (s * H + kv0 * G) * d,
                         lse_SH != nullptr ? lse_SH + s * H + kv0 * G : nullptr};
      if constexpr (std::is_same_v<T, float> || std::is_same_v<T, at::BFloat16>) {
        if (vector) {
          kAttendFloat<T>[d / 16 - 1](t);
          continue;
        }
      }
      Attend<T, A>(t);
    }
  });
}

// Each sequence's pieces, cut to its length.
template <typename T>
void Decode(const DecodeAttentionParams& p, double scale, at::Tensor& out_SHd) {
  const int64_t S = p.q_SHd.size(0);
  std::vector<at::Tensor> held;  // keeps RowsDense copies alive
  std::vector<std::vector<Piece<T>>> pieces(S);
  std::vector<int64_t> lengths(S, 0);
  for (int64_t s = 0; s < S; ++s) {
    for (size_t i = 0; i < p.k_pieces[s].size(); ++i) {
      const int64_t n = std::min(p.k_pieces[s][i].size(0), Remaining(p, s, lengths[s]));
      if (n == 0) continue;
      const at::Tensor k = RowsDense(p.k_pieces[s][i]), v = RowsDense(p.v_pieces[s][i]);
      held.push_back(k);
      held.push_back(v);
      pieces[s].push_back({k.data_ptr<T>(), v.data_ptr<T>(), n, k.stride(0), v.stride(0)});
      lengths[s] += n;
    }
  }
  Cpu<T>(p.q_SHd.contiguous(), p.k_pieces[0][0].size(1), pieces, lengths, p.window, scale, out_SHd,
         nullptr);
}

// Query i of a packed sequence, at position p, as a decode step would attend with the sequence's
// first p + 1 keys as one piece.
template <typename T>
void Rows(const AttentionParams& p, double scale, const at::Tensor& q, const at::Tensor& k,
          const at::Tensor& v, at::Tensor& out_THd, at::Tensor& lse_TH) {
  const int64_t rows = q.size(0), row = k.size(1) * k.size(2);  // row: a key's K·d elements
  std::vector<std::vector<Piece<T>>> pieces(rows);
  std::vector<int64_t> lengths(rows);
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  for (size_t s = 0; s + 1 < p.cu_seqlens_q.size(); ++s) {
    const int64_t q0 = p.cu_seqlens_q[s], Lq = p.cu_seqlens_q[s + 1] - q0;
    const int64_t k0 = p.cu_seqlens_k[s], Lk = p.cu_seqlens_k[s + 1] - k0;
    for (int64_t i = 0; i < Lq; ++i) {
      const int64_t n = Lk - Lq + i + 1;
      pieces[q0 + i].push_back({kp + k0 * row, vp + k0 * row, n, row, row});
      lengths[q0 + i] = n;
    }
  }
  Cpu<T>(q, k.size(1), pieces, lengths, p.window, scale, out_THd,
         lse_TH.data_ptr<at::opmath_type<T>>());
}

}  // namespace

at::Tensor DecodeAttention(const DecodeAttentionParams& p) {
  Check(p);
  if (p.q_SHd.size(0) == 0) return at::empty_like(p.q_SHd);
  if (!p.q_SHd.device().is_cpu()) return Packed(p);
  const double scale =
      p.scale > 0 ? p.scale : 1.0 / std::sqrt(static_cast<double>(p.q_SHd.size(2)));
  at::Tensor out_SHd = at::empty(p.q_SHd.sizes(), p.q_SHd.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, p.q_SHd.scalar_type(),
                                  "decode_attention", [&] { Decode<scalar_t>(p, scale, out_SHd); });
  return out_SHd;
}

AttentionForward AttentionForwardRows(const AttentionParams& p) {
  TORCH_CHECK(p.q_THd.device().is_cpu() && p.k_UKd.device().is_cpu() && p.v_UKd.device().is_cpu(),
              "attention rows: CPU only");
  const at::Tensor q = p.q_THd.contiguous(), k = p.k_UKd.contiguous(), v = p.v_UKd.contiguous();
  const double scale = p.scale > 0 ? p.scale : 1.0 / std::sqrt(static_cast<double>(q.size(2)));
  at::Tensor o_THd = at::empty_like(q);
  at::Tensor lse_TH =
      at::empty({q.size(0), q.size(1)}, q.options().dtype(at::toOpMathType(q.scalar_type())));
  if (q.size(0) > 0) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "attention_rows",
                                    [&] { Rows<scalar_t>(p, scale, q, k, v, o_THd, lse_TH); });
  }
  return {o_THd, lse_TH.t().contiguous()};
}

}  // namespace tinkerd::kernels
