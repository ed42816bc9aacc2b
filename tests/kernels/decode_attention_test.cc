// kernels/decode_attention against a float64 reference that packs each sequence's pieces and takes
// the full softmax of its one query, and against kernels::Attention (the trainer's kernel) on the
// packed keys; pieces shared between sequences, strided, empty and of every length.
#include "kernels/decode_attention.h"

#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include <cmath>
#include <utility>
#include <vector>

#include "kernels/attention.h"
#include "tests/kernels/kernel_test_util.h"

namespace tinkerd::testing {
namespace {

using kernels::DecodeAttentionParams;

// Float64: each output sums at most L = 70 softmax terms and each score d products, so the
// relative error is a small multiple of (L + d) · 2^-53 ≈ 1e-14; 1e-12 leaves margin.
constexpr double kF64Tol = 1e-12;

// Sequence s's keys: the pieces packed, [L, K, d].
at::Tensor Pack(const std::vector<at::Tensor>& pieces) {
  return at::cat(pieces).to(at::kDouble);
}

// The query's softmax over all of its visible keys, per head; `window_error` widens the window
// (the broken control).
at::Tensor Reference(const DecodeAttentionParams& p, int64_t window_error = 0) {
  const at::Tensor q = p.q_SHd.to(at::kCPU, at::kDouble);
  const int64_t S = q.size(0), H = q.size(1), d = q.size(2);
  at::Tensor out = at::empty({S, H, d}, q.options());
  for (int64_t s = 0; s < S; ++s) {
    const at::Tensor k = Pack(p.k_pieces[s]).cpu(), v = Pack(p.v_pieces[s]).cpu();
    const int64_t L = k.size(0), G = H / k.size(1);
    const int64_t window = p.window > 0 ? p.window + window_error : 0;
    const int64_t first = window > 0 ? std::max<int64_t>(0, L - window) : 0;
    for (int64_t h = 0; h < H; ++h) {
      const at::Tensor kh = k.narrow(0, first, L - first).select(1, h / G);
      const at::Tensor vh = v.narrow(0, first, L - first).select(1, h / G);
      const at::Tensor w = at::softmax(at::mv(kh, q[s][h]) / std::sqrt(static_cast<double>(d)), 0);
      out[s][h].copy_(at::mv(vh.t(), w));
    }
  }
  return out;
}

// Five sequences of six query heads on three kv heads: three samples of one prompt (its piece
// shared), with own pieces of 1, 2 and 30 rows, the last narrowed from a larger cache; a sequence
// with only a prompt; one with an empty piece in the middle.
DecodeAttentionParams MakeCase(int64_t d, int64_t window, at::ScalarType dt, at::Device dev,
                               uint64_t seed, int64_t H = 6, int64_t K = 3) {
  auto rows = [&](int64_t n, uint64_t salt) {
    return Randn({n, K, d}, seed + salt).to(dt).to(dev);
  };
  const at::Tensor prompt_k = rows(40, 1), prompt_v = rows(40, 2);
  const at::Tensor cache_k = rows(64, 3), cache_v = rows(64, 4);  // a sample's preallocated rows
  DecodeAttentionParams p;
  p.q_SHd = Randn({5, H, d}, seed).to(dt).to(dev);
  p.window = window;
  p.k_pieces = {{prompt_k, rows(1, 5)},
                {prompt_k, rows(2, 6)},
                {prompt_k, cache_k.narrow(0, 0, 30)},
                {rows(7, 7)},
                {rows(3, 8), rows(0, 9), rows(9, 10)}};
  p.v_pieces = {{prompt_v, rows(1, 11)},
                {prompt_v, rows(2, 12)},
                {prompt_v, cache_v.narrow(0, 0, 30)},
                {rows(7, 13)},
                {rows(3, 14), rows(0, 15), rows(9, 16)}};
  return p;
}

// kernels::Attention with one query per sequence on the packed pieces.
at::Tensor TrainerAttention(const DecodeAttentionParams& p) {
  kernels::AttentionParams a;
  a.q_THd = p.q_SHd;
  a.cu_seqlens_q = {0};
  a.cu_seqlens_k = {0};
  std::vector<at::Tensor> k, v;
  for (size_t s = 0; s < p.k_pieces.size(); ++s) {
    k.push_back(at::cat(p.k_pieces[s]));
    v.push_back(at::cat(p.v_pieces[s]));
    a.cu_seqlens_q.push_back(static_cast<int64_t>(s) + 1);
    a.cu_seqlens_k.push_back(a.cu_seqlens_k.back() + k.back().size(0));
  }
  a.k_UKd = at::cat(k);
  a.v_UKd = at::cat(v);
  a.window = p.window;
  return kernels::Attention(a);
}

TEST(DecodeAttention, MatchesFullSoftmaxAndTheTrainerKernelFloat64) {
  // d = 8 takes the sixteen-lane dot product's remainder loop only, d = 16 its lanes only, d = 21
  // both. Pieces of more than four rows also take the prefetching branch.
  for (int64_t d : {8, 16, 21}) {
    for (int64_t window : {0, 5, 35}) {
      const DecodeAttentionParams p = MakeCase(d, window, at::kDouble, at::kCPU, 21);
      const at::Tensor out = kernels::DecodeAttention(p);
      EXPECT_LT(RelErr(out, Reference(p)), kF64Tol) << "d " << d << " window " << window;
      EXPECT_LT(RelErr(out, TrainerAttention(p)), kF64Tol) << "d " << d << " window " << window;
    }
  }
}

TEST(DecodeAttention, BrokenControlsAreDetected) {
  // The comparison must see a window off by one and a query that misses its newest key.
  const DecodeAttentionParams p = MakeCase(8, 5, at::kDouble, at::kCPU, 22);
  const at::Tensor out = kernels::DecodeAttention(p);
  EXPECT_GT(RelErr(out, Reference(p, /*window_error=*/1)), 1e3 * kF64Tol);
  DecodeAttentionParams stale = p;
  stale.k_pieces[0].back() = stale.k_pieces[0].back().narrow(0, 0, 0);
  stale.v_pieces[0].back() = stale.v_pieces[0].back().narrow(0, 0, 0);
  EXPECT_GT(RelErr(kernels::DecodeAttention(stale), Reference(p)), 1e3 * kF64Tol);
}

TEST(DecodeAttention, DevicePathMatchesTheReference) {
  // On the CPU the loop in float32 and bfloat16 (fp32 accumulation); on a GPU the packed path.
  // Inputs are rounded to the dtype first, so the float64 reference sees the same values.
  const at::Device dev = KernelDevice();
  for (at::ScalarType dt : {at::kFloat, at::kBFloat16}) {
    const DecodeAttentionParams p = MakeCase(64, 0, dt, dev, 23);
    const at::Tensor out = kernels::DecodeAttention(p);
    // float32 also with d = 21: the vector dot product's remainder (the bound below holds for
    // any d <= 64).
    if (dt == at::kFloat) {
      const DecodeAttentionParams odd = MakeCase(21, 0, dt, dev, 24);
      EXPECT_LT(RelErr(kernels::DecodeAttention(odd), Reference(odd)), 2e-5) << "d 21";
    }
    // float32: a score sums d = 64 products and the output L <= 70 weighted rows, each rounding
    // at 2^-24 relative: (64 + 70) · 6e-8 ≈ 8e-6 of the largest value; 2e-5 leaves margin.
    // bfloat16: the fp32 result is rounded to bf16 once, 2^-9 ≈ 2e-3 relative; 4e-3 with margin.
    // A GPU's flash kernel also rounds the softmax weights to bf16: attention_test's 2e-2.
    const double tol = dt == at::kFloat ? 2e-5 : dev.is_cpu() ? 4e-3 : 2e-2;
    EXPECT_LT(RelErr(out, Reference(p)), tol) << at::toString(dt);
    EXPECT_EQ(out.scalar_type(), dt);
  }
}

TEST(DecodeAttention, FloatVectorPathMatchesTheReference) {
  // Float with d a multiple of 16 up to 128 takes the vector-register loop: every such d here, with
  // and without windows; query heads (6) not a multiple of the four taken at a time.
  for (int64_t d : {16, 32, 48, 64, 96, 128}) {
    for (int64_t window : {0, 5, 35}) {
      const DecodeAttentionParams p = MakeCase(d, window, at::kFloat, at::kCPU, 28);
      // As DevicePathMatchesTheReference: (d + L) · 2^-24 of the largest value, with d <= 128
      // and L <= 70 below 1.2e-5 (Exp's weights are within 2 ulps, inside that count).
      EXPECT_LT(RelErr(kernels::DecodeAttention(p), Reference(p)), 2e-5)
          << "d " << d << " window " << window;
    }
  }
  // More query heads per kv head than the output pass holds at once (16 / (d / 16)): 8 on one kv
  // head at d = 128 (four passes of two), 7 at d = 48 (five, then two).
  for (const auto& [d, H] : {std::pair<int64_t, int64_t>{128, 8}, {48, 7}}) {
    const DecodeAttentionParams p = MakeCase(d, 5, at::kFloat, at::kCPU, 32, H, 1);
    EXPECT_LT(RelErr(kernels::DecodeAttention(p), Reference(p)), 2e-5) << "d " << d << " H " << H;
  }
  // Values longer than the output pass finds in L2 (here 1,500 rows of 128 floats per kv head:
  // 768 KiB per task, if a task takes one kv head or all three) are asked for by that pass
  // itself: the same result, within (128 + 1,500) · 6e-8 = 1e-4.
  DecodeAttentionParams longer = MakeCase(128, 0, at::kFloat, at::kCPU, 29);
  longer.k_pieces[3] = {Randn({1500, 3, 128}, 30).to(at::kFloat)};
  longer.v_pieces[3] = {Randn({1500, 3, 128}, 31).to(at::kFloat)};
  const at::Tensor out = kernels::DecodeAttention(longer);
  EXPECT_LT(RelErr(out, Reference(longer)), 2e-4);
  // Control: a value row the kernel must read, changed, is seen.
  DecodeAttentionParams changed = longer;
  changed.v_pieces[3] = {longer.v_pieces[3][0].clone()};
  changed.v_pieces[3][0][1499].mul_(2);
  EXPECT_GT(RelErr(kernels::DecodeAttention(changed), Reference(longer)), 1e-3);
}

TEST(DecodeAttention, TaskShapeDoesNotChangeTheResult) {
  // With at least two sequences per thread a task reads a sequence's rows whole, all kv heads;
  // with fewer, one kv head each. The five sequences take the first on one thread and the second
  // on three; each head sums in one order either way, so the outputs must be bitwise equal.
  const int threads = at::get_num_threads();
  for (at::ScalarType dt : {at::kFloat, at::kDouble}) {
    for (int64_t d : {21, 64}) {
      const DecodeAttentionParams p = MakeCase(d, 0, dt, at::kCPU, 25);
      at::set_num_threads(1);
      const at::Tensor whole = kernels::DecodeAttention(p);
      at::set_num_threads(3);
      const at::Tensor per_head = kernels::DecodeAttention(p);
      at::set_num_threads(threads);
      EXPECT_TRUE(at::equal(whole, per_head)) << at::toString(dt) << " d " << d;
      // Control: the comparison sees one head's output changed in its last bit.
      at::Tensor nudged = per_head.clone();
      const double x = nudged[4][5][d - 1].item<double>();
      nudged[4][5][d - 1] = dt == at::kFloat
                                ? static_cast<double>(std::nextafter(static_cast<float>(x), 1e30f))
                                : std::nextafter(x, 1e300);
      EXPECT_FALSE(at::equal(whole, nudged)) << at::toString(dt) << " d " << d;
      EXPECT_LT(RelErr(whole, Reference(p)), dt == at::kFloat ? 2e-5 : kF64Tol);
    }
  }
}

TEST(DecodeAttention, LengthsReadTheFirstRowsOfWholeCaches) {
  // The engine passes a sample's preallocated cache whole and says how many of its rows are
  // filled: that must equal passing the filled rows alone.
  for (at::ScalarType dt : {at::kDouble, at::kFloat}) {
    const DecodeAttentionParams narrowed = MakeCase(21, 0, dt, at::kCPU, 26);
    DecodeAttentionParams whole = narrowed;
    whole.k_pieces[2].back() = narrowed.k_pieces[2].back()._base();
    whole.v_pieces[2].back() = narrowed.v_pieces[2].back()._base();
    ASSERT_EQ(whole.k_pieces[2].back().size(0), 64);
    whole.lengths = {41, 42, 70, 7, 12};
    const at::Tensor expected = kernels::DecodeAttention(narrowed);
    EXPECT_TRUE(at::equal(kernels::DecodeAttention(whole), expected)) << at::toString(dt);
    // Control: one more row of the whole cache is read, and seen.
    DecodeAttentionParams longer = whole;
    longer.lengths[2] = 71;
    EXPECT_FALSE(at::equal(kernels::DecodeAttention(longer), expected)) << at::toString(dt);
    // Lengths cut a piece short, or skip one, as the rows they leave out would be.
    DecodeAttentionParams cut = narrowed;
    cut.lengths = {41, 42, 70, 5, 3};
    DecodeAttentionParams explicit_rows = narrowed;
    explicit_rows.k_pieces[3] = {narrowed.k_pieces[3][0].narrow(0, 0, 5)};
    explicit_rows.v_pieces[3] = {narrowed.v_pieces[3][0].narrow(0, 0, 5)};
    explicit_rows.k_pieces[4] = {narrowed.k_pieces[4][0]};
    explicit_rows.v_pieces[4] = {narrowed.v_pieces[4][0]};
    EXPECT_TRUE(at::equal(kernels::DecodeAttention(cut), kernels::DecodeAttention(explicit_rows)));
    if (dt == at::kDouble) {
      EXPECT_LT(RelErr(kernels::DecodeAttention(whole), Reference(narrowed)), kF64Tol);
    }
  }
  // More than the pieces hold, or a list of lengths of the wrong size, is refused.
  DecodeAttentionParams bad = MakeCase(8, 0, at::kDouble, at::kCPU, 27);
  bad.lengths = {41, 42, 71, 7, 12};
  EXPECT_THROW(kernels::DecodeAttention(bad), c10::Error);
  bad.lengths = {41, 42, 70, 7};
  EXPECT_THROW(kernels::DecodeAttention(bad), c10::Error);
}

// A packed forward (training, a prefill) attends each query row as a decode step at its position
// does, to the bit: every row of AttentionForwardRows against DecodeAttention with the row's keys
// in two pieces, for float (the vector loop at head_dim 16, the generic one at 8) and bf16, with
// and without a window. Its lse is the tiled forward's to rounding. Control: in float the tiled
// forward's output differs from the decode step's in some bit.
TEST(DecodeAttention, PackedRowsAreDecodeStepsToTheBit) {
  for (at::ScalarType dt : {at::kFloat, at::kBFloat16}) {
    for (int64_t d : {8, 16}) {
      for (int64_t window : {0, 9}) {
        const std::vector<int64_t> lengths = {37, 20};
        const int64_t T = 57, H = 4, K = 2;
        kernels::AttentionParams a;
        a.q_THd = Randn({T, H, d}, 80).to(dt);
        a.k_UKd = Randn({T, K, d}, 81).to(dt);
        a.v_UKd = Randn({T, K, d}, 82).to(dt);
        a.cu_seqlens_q = a.cu_seqlens_k = {0, 37, 57};
        a.window = window;
        const kernels::AttentionForward rows = kernels::AttentionForwardRows(a);
        const kernels::AttentionForward tiled = kernels::AttentionForwardTiled(a);
        // lse: both sum at most 37 exponentials in fp32, 37 · 2^-24 ≈ 2e-6 relative; 1e-5.
        EXPECT_LT(RelErr(rows.lse_HT, tiled.lse_HT), 1e-5) << dt << " d=" << d;
        DecodeAttentionParams p;
        p.window = window;
        std::vector<at::Tensor> queries;
        for (int64_t s = 0, row = 0; s < 2; ++s) {
          for (int64_t i = 0; i < lengths[s]; ++i, ++row) {
            queries.push_back(a.q_THd[row]);
            const int64_t k0 = s == 0 ? 0 : 37, half = (i + 1) / 2;
            p.k_pieces.push_back(
                {a.k_UKd.narrow(0, k0, half), a.k_UKd.narrow(0, k0 + half, i + 1 - half)});
            p.v_pieces.push_back(
                {a.v_UKd.narrow(0, k0, half), a.v_UKd.narrow(0, k0 + half, i + 1 - half)});
            // An empty first piece (row 0 of a sequence) is skipped; DecodeAttention reads the
            // rest.
            if (half == 0) {
              p.k_pieces.back().erase(p.k_pieces.back().begin());
              p.v_pieces.back().erase(p.v_pieces.back().begin());
            }
          }
        }
        p.q_SHd = at::stack(queries);
        const at::Tensor decoded = kernels::DecodeAttention(p);
        EXPECT_TRUE(at::equal(rows.o_THd, decoded)) << dt << " d=" << d << " window=" << window;
        // (In bf16 the outputs' rounding to 8 bits may hide the tiles' order; float shows it.)
        if (dt == at::kFloat) {
          EXPECT_FALSE(at::equal(tiled.o_THd, decoded)) << "d=" << d << " window=" << window;
        }
      }
    }
  }
}

TEST(DecodeAttention, RefusesMismatchedPieces) {
  DecodeAttentionParams p = MakeCase(8, 0, at::kDouble, at::kCPU, 24);
  p.v_pieces.pop_back();  // one sequence without values
  EXPECT_THROW(kernels::DecodeAttention(p), c10::Error);
  p = MakeCase(8, 0, at::kDouble, at::kCPU, 24);
  p.k_pieces[3] = {p.k_pieces[3][0].narrow(0, 0, 0)};  // no keys at all
  p.v_pieces[3] = {p.v_pieces[3][0].narrow(0, 0, 0)};
  EXPECT_THROW(kernels::DecodeAttention(p), c10::Error);
}

}  // namespace
}  // namespace tinkerd::testing
