// One decode step of attention: every sequence has a single query (its newest token, at position
// L − 1) and L keys held in pieces, read where they lie: a prompt's keys, shared by all of its
// samples, then the sample's own. Nothing is copied into a packed [U, K, d] tensor, which would
// cost a copy of the whole KV cache per layer and step.
// For query head h reading kv head h / (H / K), and the keys k_0 … k_{L−1} of the pieces in order:
//   S_j = scale · q·k_j   for L − 1 − j < window (every j when window = 0)
//   o   = Σ_j softmax(S)_j · v_j
// The same function as kernels/attention.h with Lq = 1 and the pieces packed; inference only.
// Scores, softmax and the accumulator are fp32 (fp64 for fp64 inputs); the output has the
// inputs' dtype.
//
// Its order of operations is the definition every CPU path shares (docs/kernels.md, "the
// reduction order"): q is scaled first; each score is q·k in sixteen partial sums over d, added
// pairwise; the softmax subtracts the maximum over all visible scores and sums the exponentials
// in sixteen lanes from the first visible key (float; one running sum otherwise); the output sums
// the weighted values key by key in position order, then divides by the sum. Nothing depends on
// the other sequences, the batch or the threads, so AttentionForwardRows below, the trainer's and
// a prefill's forward, computes each query exactly as a decode step does.
//
// Shape suffixes: S sequences, H query heads, K kv heads, d head_dim, n a piece's rows.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

#include "kernels/attention.h"

namespace tinkerd::kernels {

struct DecodeAttentionParams {
  at::Tensor q_SHd;
  // Per sequence, its keys and values in position order, each piece [n, K, d] (rows of K·d
  // contiguous elements; a narrowed cache is fine). One piece may serve several sequences.
  std::vector<std::vector<at::Tensor>> k_pieces, v_pieces;
  // Per sequence, how many keys it has: the first lengths[s] rows of its pieces, the rest unread
  // (a sample's preallocated cache passed whole). Empty: every row of every piece.
  std::vector<int64_t> lengths;
  int64_t window = 0;  // 0: every key is visible
  double scale = 0;    // 0: 1/sqrt(d)
};

// o_SHd. On the CPU a loop over (sequence, kv head) that reads the pieces in place; on other
// devices the pieces are packed and kernels::Attention runs with one query per sequence.
at::Tensor DecodeAttention(const DecodeAttentionParams& p);

// The packed function of kernels/attention.h on the CPU, each query row attended as a decode
// step at its position would attend it (above), with each row's lse_HT for the tiled backward.
// Takes parameters kernels::Attention has checked.
AttentionForward AttentionForwardRows(const AttentionParams& p);

}  // namespace tinkerd::kernels
