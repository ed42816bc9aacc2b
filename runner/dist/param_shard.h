// Sharded parameters (--shard=full, FSDP's split) of a full fine-tune. The model is cut into
// units, each decoder layer one and the rest (embedding, final norm, untied head) another, and
// every rank keeps 1/W of each unit's flattened parameters and the same slices of their gradient
// sums and AdamW moments (a ShardLayout per unit, runner/dist/shard.h).
//
// A unit is gathered whole just before it runs and dropped after it (runner/model/transformer.h,
// LayerSource): a layer in the forward and again in its backward's recompute, the rest once per
// micro-batch. A layer's gradient is reduce-scattered into its owners' slices as soon as its
// backward has produced it, so a rank holds 1/W of the model, plus the rest and one layer whole
// while a micro-batch runs. Every gather and reduce-scatter is a collective: every rank must run
// the same units in the same order, so a call runs as many micro-batches on every rank
// (runner/train_step.cc pads the shorter ranks with empty ones).
//
// Shape suffixes: C one rank's slice of a unit.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "runner/dist/collectives.h"
#include "runner/dist/shard.h"
#include "runner/model/transformer.h"
#include "runner/model/weights.h"

namespace tinkerd {

struct ShardedUnit {
  // This rank's slices of `whole` (cast to `options`' dtype), which every rank passes alike.
  ShardedUnit(std::vector<std::string> names, const std::vector<at::Tensor>& whole, int world_size,
              int rank, const at::TensorOptions& options);
  // A frozen unit (a sharded base's): the layout of tensors shaped as `like` (their data unread),
  // no sums or moments, and param_C undefined until the loader sets it.
  ShardedUnit(std::vector<std::string> names, const std::vector<at::Tensor>& like, int world_size,
              int rank);

  std::vector<std::string> names;  // Hugging Face names, in the unit's order
  std::vector<std::vector<int64_t>> shapes;
  OptimizerShard state;  // the layout, and the slices of the gradient sums and moments
  at::Tensor param_C;    // the slice of the parameters (fp32 or wider, DESIGN.md §3)

  // The unit's tensors whole, fresh and contiguous, from every rank's slice of the parameters
  // (or of another flat vector of the unit: a sum's or a moment's slice).
  absl::StatusOr<std::vector<at::Tensor>> Gather(Collectives& c) const {
    return Gather(c, param_C);
  }
  absl::StatusOr<std::vector<at::Tensor>> Gather(Collectives& c, const at::Tensor& slice_C) const;
  // Adds to into_C this rank's slice of the sum over ranks of `grads` (whole, in the unit's
  // order; undefined: zero).
  absl::Status ReduceScatterInto(Collectives& c, const std::vector<at::Tensor>& grads,
                                 at::Tensor& into_C) const;
  // Where this rank's slice of the unit's flat space meets tensor i: one stretch of the tensor's
  // flat values, {begin, length}, or none (length 0).
  std::pair<int64_t, int64_t> StretchOf(size_t i) const;
  // This rank's part of tensor i (StretchOf), from the tensor whole, a copy.
  at::Tensor PartOf(size_t i, const at::Tensor& whole) const;
};

class ParamShard {
 public:
  // Every rank passes the same (replicated) weights and takes its slices of them.
  ParamShard(const BaseWeights& weights, const ModelConfig& config, int world_size, int rank,
             const at::TensorOptions& options);
  // The frozen base's layout (--shard_base): `like` gives each tensor's shape (meta tensors do),
  // every unit frozen (ShardedUnit's second constructor) until Fill sets its slice.
  static ParamShard Frozen(const BaseWeights& like, const ModelConfig& config, int world_size,
                           int rank);
  // Sets every unit's slice from the parts ShardedUnit::PartOf cut of each tensor, by name, on
  // `options`. INVALID_ARGUMENT when a part is missing or of another size.
  absl::Status Fill(std::map<std::string, at::Tensor> parts, const at::TensorOptions& options);
  // The frozen base sliced as it is read: `like` names and shapes every tensor (meta tensors:
  // SafetensorsDirShapes), and is checked against `config` before anything is read;
  // `read(stretch)` then reads this rank's part of each tensor alone (LoadSafetensorsDirStretches:
  // 1/W of the files, and no tensor whole), put on `options`.
  using Reader =
      std::function<absl::StatusOr<std::map<std::string, at::Tensor>>(const Stretch& stretch)>;
  static absl::StatusOr<ParamShard> ReadFrozen(const ModelConfig& config,
                                               std::map<std::string, at::Tensor> like,
                                               const Reader& read, int world_size, int rank,
                                               const at::TensorOptions& options);
  // A trainable copy of a frozen shard (a full fine-tune of the sharded base): the same layout,
  // its slices cast to `options`, with zero sums and moments.
  ParamShard Trainable(const at::TensorOptions& options) const;
  int64_t bytes() const;  // of this rank's slices

  // units()[0] is the rest, units()[1 + l] decoder layer l.
  const std::vector<ShardedUnit>& units() const { return units_; }
  std::vector<ShardedUnit>& units() { return units_; }
  // The unit and the index in it of the tensor `name` (Hugging Face's); nullopt: not the model's.
  std::optional<std::pair<size_t, size_t>> Find(const std::string& name) const;
  int64_t values() const;               // of the whole model
  int64_t LargestTensorValues() const;  // of its largest tensor
  // What a micro-batch holds whole at once: the rest and the largest layer, `layers` times (two
  // when the next one is prefetched).
  int64_t GatheredValues(int layers = 1) const;

  // The rest whole, as BaseWeights whose `layers` are placeholders (LayerWeights::Shaped: no
  // tensors, their experts' count) that LayerSource fills.
  absl::StatusOr<BaseWeights> GatherRest(Collectives& c) const;
  // BaseWeights with no tensors at all and those placeholder layers.
  BaseWeights Placeholders() const;
  absl::StatusOr<LayerWeights> GatherLayer(Collectives& c, int64_t layer) const;
  // The whole model in `dtype`, a unit at a time (every rank runs the same gathers); each unit is
  // cast as it arrives, so a rank holds the result and one unit in the training dtype. `keep`
  // false: the gathers only, and empty weights (the ranks that keep no copy).
  absl::StatusOr<BaseWeights> GatherWhole(Collectives& c, at::ScalarType dtype, bool keep) const;
  // Tensors of the rest (GatherRest's) and of a layer in their unit's order; undefined fields
  // (biases and q/k norms a model lacks) are left out, as the units leave them out.
  std::vector<at::Tensor> RestTensors(const BaseWeights& w) const;
  std::vector<at::Tensor> LayerTensors(int64_t layer, const LayerWeights& L) const;

 private:
  using MakeUnit = std::function<ShardedUnit(std::vector<std::string> names,
                                             const std::vector<at::Tensor>& tensors)>;
  ParamShard(const BaseWeights& weights, const ModelConfig& config, const MakeUnit& make);

  bool tied_;
  std::vector<ShardedUnit> units_;
  std::map<std::string, std::pair<size_t, size_t>> where_;  // Find's
  std::vector<std::vector<size_t>> fields_;  // per layer: the LayerWeights::All() it holds
  std::vector<size_t> experts_;              // per layer: its experts (0 unless it routes)
};

}  // namespace tinkerd
