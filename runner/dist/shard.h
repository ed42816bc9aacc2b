// Sharded optimizer state (--shard=optimizer, ZeRO-2's split): every rank keeps the whole
// trainable parameters, but only its 1/W of their gradient sums and AdamW moments.
//
// The trainable tensors of a model, flattened and concatenated in name order, form one index
// space of N elements. It is cut into W chunks of C = ceil(N / W) elements; rank r owns
// [r·C, min(N, (r+1)·C)). The last chunks may be short, or empty when N < W: uneven shards are
// padded with zeros wherever a collective needs equal sizes, and the padding is never read back.
// Shape suffixes: N the flat space, C one rank's chunk, K a bucket of a chunk, W ranks.
//
// Note [Reduce once, sharded]: each call's staged gradient is reduce-scattered into the owners'
// shards when the call commits, so every rank's contribution is added to its owner exactly once
// and never reduced again; optim_step then reduces nothing but the squared norm.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "runner/dist/collectives.h"

namespace tinkerd {

class ShardLayout {
 public:
  ShardLayout(std::vector<int64_t> numels, int world_size, int rank);

  int64_t total() const { return offsets_.back(); }  // N
  int64_t chunk() const { return chunk_; }           // C
  int world_size() const { return world_size_; }
  int rank() const { return rank_; }
  int64_t begin(int r) const;  // rank r's range [begin, end) in the flat space
  int64_t end(int r) const;
  int64_t owned() const { return end(rank_) - begin(rank_); }
  int64_t tensor_begin(size_t i) const { return offsets_[i]; }  // tensor i's range
  int64_t tensor_end(size_t i) const { return offsets_[i + 1]; }

  // The parts of [begin, end) that fall in each tensor: tensor index, offset inside that
  // (flattened) tensor, offset relative to `begin`, and length.
  struct Piece {
    size_t tensor;
    int64_t tensor_offset;
    int64_t offset;
    int64_t length;
  };
  std::vector<Piece> Pieces(int64_t begin, int64_t end) const;

 private:
  std::vector<int64_t> offsets_;  // tensor i is [offsets_[i], offsets_[i+1])
  int world_size_, rank_;
  int64_t chunk_;
};

// Copies elements [begin, end) of the flat space of `tensors` into out_K (K = end - begin); an
// undefined tensor (a gradient no micro-batch reached) leaves its part of out_K as it was.
void ReadFlat(const ShardLayout& layout, const std::vector<at::Tensor>& tensors, int64_t begin,
              int64_t end, at::Tensor out_K);
// Copies in_K into elements [begin, end) of the flat space of `tensors`.
void WriteFlat(const ShardLayout& layout, const std::vector<at::Tensor>& tensors, int64_t begin,
               int64_t end, const at::Tensor& in_K);

// One rank's shard of a model's optimizer state: flat slices [begin(rank), end(rank)) of the
// gradient sums and moments, fp32 or wider like the unsharded ones (DESIGN.md §3).
struct OptimizerShard {
  explicit OptimizerShard(ShardLayout l, const at::TensorOptions& options);
  // The layout alone, for frozen tensors (a sharded base's): no sums or moments, so that only
  // AllGather and the layout's own functions apply.
  explicit OptimizerShard(ShardLayout l) : layout(std::move(l)) {}
  ShardLayout layout;
  at::Tensor grad_sum_C, exp_avg_C, exp_avg_sq_C;

  // out_C = this rank's slice of the sum over ranks of `staged` (every rank's whole, unreduced
  // gradient of one call, in the layout's tensor order), in buckets of at most 64 MiB.
  absl::Status ReduceScatter(Collectives& c, const std::vector<at::Tensor>& staged,
                             at::Tensor& out_C) const;
  // Writes every rank's slice of `tensors` into every rank's `tensors` (after each rank stepped
  // its own slice of the parameters), in their dtype.
  absl::Status AllGather(Collectives& c, const std::vector<at::Tensor>& tensors) const;
  // Sets a flat vector of the shard from whole tensors (a checkpoint's), in the layout's order.
  void Scatter(const std::vector<at::Tensor>& whole, at::Tensor& flat_C) const;
  // Views of this rank's slices of `tensors`, one per piece (AdamW on the owned parameters).
  std::vector<at::Tensor> Views(const std::vector<at::Tensor>& tensors) const;
  // Views of a flat vector of the shard, cut as Views cuts the tensors.
  std::vector<at::Tensor> Cut(const at::Tensor& flat_C) const;
};

}  // namespace tinkerd
