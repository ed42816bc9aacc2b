#include "kernels/decode_attention.h"

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>

#include "kernels/attention.h"

namespace tinkerd::kernels {
namespace {

void Check(const DecodeAttentionParams& p) {
  TORCH_CHECK(p.q_SHd.dim() == 3, "decode attention: q must be [sequences, heads, head_dim]");
  const int64_t S = p.q_SHd.size(0), H = p.q_SHd.size(1), d = p.q_SHd.size(2);
  TORCH_CHECK(
      static_cast<int64_t>(p.k_pieces.size()) == S && p.v_pieces.size() == p.k_pieces.size(),
      "decode attention: one list of key and of value pieces per sequence");
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
    TORCH_CHECK(L > 0, "decode attention: sequence ", s, " has no keys");
  }
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
      keys.push_back(p.k_pieces[s][i]);
      values.push_back(p.v_pieces[s][i]);
      L += p.k_pieces[s][i].size(0);
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

// q·k in eight independent partial sums: the compiler may keep them in one vector register,
// which a single running sum would forbid (it cannot reorder floating-point additions).
template <typename T, typename A>
A Dot(const A* q, const T* k, int64_t d) {
  A part[8] = {};
  int64_t i = 0;
  for (; i + 8 <= d; i += 8) {
    for (int64_t j = 0; j < 8; ++j) part[j] += q[i + j] * static_cast<A>(k[i + j]);
  }
  A sum = 0;
  for (; i < d; ++i) sum += q[i] * static_cast<A>(k[i]);
  for (A x : part) sum += x;
  return sum;
}

template <typename T>
void Cpu(const DecodeAttentionParams& p, double scale, at::Tensor& out_SHd) {
  using A = at::opmath_type<T>;
  const int64_t S = p.q_SHd.size(0), H = p.q_SHd.size(1), d = p.q_SHd.size(2);
  const int64_t K = p.k_pieces[0][0].size(1), G = H / K;
  const at::Tensor q_SHd = p.q_SHd.contiguous();
  std::vector<at::Tensor> held;  // keeps RowsDense copies alive
  std::vector<std::vector<Piece<T>>> pieces(S);
  std::vector<int64_t> lengths(S, 0);
  for (int64_t s = 0; s < S; ++s) {
    for (size_t i = 0; i < p.k_pieces[s].size(); ++i) {
      const at::Tensor k = RowsDense(p.k_pieces[s][i]), v = RowsDense(p.v_pieces[s][i]);
      held.push_back(k);
      held.push_back(v);
      if (k.size(0) == 0) continue;
      pieces[s].push_back({k.data_ptr<T>(), v.data_ptr<T>(), k.size(0), k.stride(0), v.stride(0)});
      lengths[s] += k.size(0);
    }
  }
  const T* q_all = q_SHd.data_ptr<T>();
  T* out_all = out_SHd.data_ptr<T>();
  // One task: the G query heads of one sequence that read one kv head.
  at::parallel_for(0, S * K, 1, [&](int64_t begin, int64_t end) {
    std::vector<A> q(G * d), o(G * d), scores, sum(G);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / K, kv = task % K, L = lengths[s];
      const int64_t first = p.window > 0 ? std::max<int64_t>(0, L - p.window) : 0;
      const int64_t visible = L - first;
      const T* q_Gd = q_all + (s * H + kv * G) * d;
      for (int64_t i = 0; i < G * d; ++i) q[i] = static_cast<A>(q_Gd[i]) * static_cast<A>(scale);
      scores.resize(G * visible);
      // Scores, laid out [G, visible]; then each head's softmax in place.
      int64_t j = 0;
      for (const Piece<T>& piece : pieces[s]) {
        for (int64_t r = std::max<int64_t>(0, first - j); r < piece.n; ++r) {
          const T* k = piece.k + r * piece.k_row + kv * d;
          for (int64_t g = 0; g < G; ++g)
            scores[g * visible + j + r - first] = Dot(&q[g * d], k, d);
        }
        j += piece.n;
      }
      for (int64_t g = 0; g < G; ++g) {
        A* row = &scores[g * visible];
        const A top = *std::max_element(row, row + visible);
        sum[g] = 0;
        for (int64_t c = 0; c < visible; ++c) sum[g] += (row[c] = std::exp(row[c] - top));
      }
      std::fill(o.begin(), o.end(), A(0));
      j = 0;
      for (const Piece<T>& piece : pieces[s]) {
        for (int64_t r = std::max<int64_t>(0, first - j); r < piece.n; ++r) {
          const T* v = piece.v + r * piece.v_row + kv * d;
          for (int64_t g = 0; g < G; ++g) {
            const A w = scores[g * visible + j + r - first];
            A* o_d = &o[g * d];
            for (int64_t i = 0; i < d; ++i) o_d[i] += w * static_cast<A>(v[i]);
          }
        }
        j += piece.n;
      }
      T* out_Gd = out_all + (s * H + kv * G) * d;
      for (int64_t g = 0; g < G; ++g) {
        for (int64_t i = 0; i < d; ++i) out_Gd[g * d + i] = static_cast<T>(o[g * d + i] / sum[g]);
      }
    }
  });
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
                                  "decode_attention", [&] { Cpu<scalar_t>(p, scale, out_SHd); });
  return out_SHd;
}

}  // namespace tinkerd::kernels
