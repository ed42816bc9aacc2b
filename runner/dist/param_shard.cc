#include "runner/dist/param_shard.h"

#include <ATen/core/grad_mode.h>
#include <c10/util/accumulate.h>

#include <algorithm>
#include <exception>
#include <utility>

#include "absl/strings/str_cat.h"
#include "runner/util/status_macros.h"

namespace tinkerd {
namespace {

std::vector<int64_t> Numels(const std::vector<at::Tensor>& tensors) {
  std::vector<int64_t> out;
  for (const at::Tensor& t : tensors) out.push_back(t.numel());
  return out;
}

}  // namespace

ShardedUnit::ShardedUnit(std::vector<std::string> n, const std::vector<at::Tensor>& whole,
                         int world_size, int rank, const at::TensorOptions& options)
    : names(std::move(n)),
      state(ShardLayout(Numels(whole), world_size, rank), options),
      param_C(at::empty({state.layout.owned()}, options)) {
  for (const at::Tensor& t : whole) shapes.push_back(t.sizes().vec());
  state.Scatter(whole, param_C);
}

ShardedUnit::ShardedUnit(std::vector<std::string> n, const std::vector<at::Tensor>& like,
                         int world_size, int rank)
    : names(std::move(n)), state(ShardLayout(Numels(like), world_size, rank)) {
  for (const at::Tensor& t : like) shapes.push_back(t.sizes().vec());
}

std::pair<int64_t, int64_t> ShardedUnit::StretchOf(size_t i) const {
  const ShardLayout& l = state.layout;
  for (const ShardLayout::Piece& p : l.Pieces(l.begin(l.rank()), l.end(l.rank()))) {
    if (p.tensor == i) return {p.tensor_offset, p.length};
  }
  return {0, 0};
}

at::Tensor ShardedUnit::PartOf(size_t i, const at::Tensor& whole) const {
  const auto [begin, length] = StretchOf(i);
  return whole.reshape({-1}).narrow(0, begin, length).clone();
}

absl::StatusOr<std::vector<at::Tensor>> ShardedUnit::Gather(Collectives& c,
                                                            const at::Tensor& slice_C) const {
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> whole;
  for (const auto& shape : shapes) whole.push_back(at::empty(shape, slice_C.options()));
  const ShardLayout& l = state.layout;
  WriteFlat(l, whole, l.begin(l.rank()), l.end(l.rank()), slice_C);
  RETURN_IF_ERROR(state.AllGather(c, whole));
  return whole;
}

absl::Status ShardedUnit::ReduceScatterInto(Collectives& c, const std::vector<at::Tensor>& grads,
                                            at::Tensor& into_C) const {
  at::Tensor sum_C;
  RETURN_IF_ERROR(state.ReduceScatter(c, grads, sum_C));
  at::NoGradGuard no_grad;
  into_C.add_(sum_C);
  return absl::OkStatus();
}

ParamShard::ParamShard(const BaseWeights& w, const ModelConfig& config, int world_size, int rank,
                       const at::TensorOptions& options)
    : ParamShard(w, config,
                 [&](std::vector<std::string> names, const std::vector<at::Tensor>& tensors) {
                   return ShardedUnit(std::move(names), tensors, world_size, rank, options);
                 }) {}

ParamShard ParamShard::Frozen(const BaseWeights& like, const ModelConfig& config, int world_size,
                              int rank) {
  return ParamShard(like, config,
                    [&](std::vector<std::string> names, const std::vector<at::Tensor>& tensors) {
                      return ShardedUnit(std::move(names), tensors, world_size, rank);
                    });
}

absl::Status ParamShard::Fill(std::map<std::string, at::Tensor> parts,
                              const at::TensorOptions& options) {
  at::NoGradGuard no_grad;
  for (ShardedUnit& u : units_) {
    std::vector<at::Tensor> mine;
    for (size_t i = 0; i < u.names.size(); ++i) {
      const auto it = parts.find(u.names[i]);
      if (it == parts.end() || !it->second.defined()) {
        return absl::InvalidArgumentError(absl::StrCat("weights: missing ", u.names[i]));
      }
      mine.push_back(it->second.reshape({-1}).to(options));
    }
    at::Tensor slice_C = mine.empty() ? at::empty({0}, options) : at::cat(mine);
    if (slice_C.numel() != u.state.layout.owned()) {
      return absl::InvalidArgumentError(
          absl::StrCat("weights: this rank's slice of ", u.names.front(), "'s unit holds ",
                       slice_C.numel(), " values, its layout ", u.state.layout.owned()));
    }
    u.param_C = std::move(slice_C);
    // The unit's parts are in its slice now: dropped, so the parts and the slices are held
    // together one unit at a time, not twice over.
    mine.clear();
    for (const std::string& name : u.names) parts.erase(name);
  }
  return absl::OkStatus();
}

absl::StatusOr<ParamShard> ParamShard::ReadFrozen(const ModelConfig& config,
                                                  std::map<std::string, at::Tensor> like,
                                                  const Reader& read, int world_size, int rank,
                                                  const at::TensorOptions& options) {
  ASSIGN_OR_RETURN(const BaseWeights shapes, BaseWeightsFromTensors(config, std::move(like)));
  ParamShard shard = Frozen(shapes, config, world_size, rank);
  auto stretch = [&shard](const std::string& name,
                          at::IntArrayRef shape) -> std::pair<int64_t, int64_t> {
    const auto at = shard.Find(name);
    // Not the model's (a rotary cache some exporters write): dropped, as a replica drops it.
    if (!at) return {0, 0};
    const ShardedUnit& unit = shard.units_[at->first];
    if (shape.vec() != unit.shapes[at->second]) return {0, -1};
    return unit.StretchOf(at->second);
  };
  ASSIGN_OR_RETURN(auto parts, read(stretch));
  RETURN_IF_ERROR(shard.Fill(std::move(parts), options));
  return shard;
}

std::optional<std::pair<size_t, size_t>> ParamShard::Find(const std::string& name) const {
  const auto it = where_.find(name);
  if (it == where_.end()) return std::nullopt;
  return it->second;
}

ParamShard ParamShard::Trainable(const at::TensorOptions& options) const {
  at::NoGradGuard no_grad;
  ParamShard out = *this;
  for (ShardedUnit& u : out.units_) {
    u.state = OptimizerShard(u.state.layout, options);
    u.param_C = u.param_C.to(options, /*non_blocking=*/false, /*copy=*/true);
  }
  return out;
}

int64_t ParamShard::bytes() const {
  int64_t n = 0;
  for (const ShardedUnit& u : units_) n += static_cast<int64_t>(u.param_C.nbytes());
  return n;
}

ParamShard::ParamShard(const BaseWeights& w, const ModelConfig& config, const MakeUnit& make)
    : tied_(config.tie_word_embeddings) {
  const bool tied = tied_;
  std::vector<std::string> names{"model.embed_tokens.weight", "model.norm.weight"};
  std::vector<at::Tensor> rest{w.embed_VD, w.final_norm_D};
  if (!tied) {
    names.emplace_back("lm_head.weight");
    rest.push_back(w.lm_head_VD);
  }
  units_.push_back(make(std::move(names), rest));
  for (size_t l = 0; l < w.layers.size(); ++l) {
    std::vector<std::string> layer_names;
    std::vector<at::Tensor> tensors;
    std::vector<size_t>& fields = fields_.emplace_back();
    const auto all = w.layers[l].All();
    const std::vector<std::string> field_names = w.layers[l].Names(config.moe.names);
    experts_.push_back(w.layers[l].experts.size());
    for (size_t f = 0; f < all.size(); ++f) {
      if (!all[f]->defined()) continue;
      layer_names.push_back(absl::StrCat("model.layers.", l, ".", field_names[f]));
      tensors.push_back(*all[f]);
      fields.push_back(f);
    }
    units_.push_back(make(std::move(layer_names), tensors));
  }
  for (size_t u = 0; u < units_.size(); ++u) {
    for (size_t i = 0; i < units_[u].names.size(); ++i) where_[units_[u].names[i]] = {u, i};
  }
}

int64_t ParamShard::values() const {
  int64_t n = 0;
  for (const ShardedUnit& u : units_) n += u.state.layout.total();
  return n;
}

int64_t ParamShard::LargestTensorValues() const {
  int64_t largest = 0;
  for (const ShardedUnit& u : units_) {
    for (const std::vector<int64_t>& shape : u.shapes) {
      largest = std::max(largest, c10::multiply_integers(shape));
    }
  }
  return largest;
}

int64_t ParamShard::GatheredValues(int layers) const {
  int64_t largest = 0;
  for (size_t u = 1; u < units_.size(); ++u) {
    largest = std::max(largest, units_[u].state.layout.total());
  }
  return units_[0].state.layout.total() + layers * largest;
}

absl::StatusOr<BaseWeights> ParamShard::GatherRest(Collectives& c) const {
  ASSIGN_OR_RETURN(std::vector<at::Tensor> rest, units_[0].Gather(c));
  BaseWeights w = Placeholders();
  w.embed_VD = rest[0];
  w.final_norm_D = rest[1];
  w.lm_head_VD = tied_ ? rest[0] : rest[2];
  return w;
}

BaseWeights ParamShard::Placeholders() const {
  BaseWeights w;
  for (size_t experts : experts_) w.layers.push_back(LayerWeights::Shaped(experts));
  return w;
}

absl::StatusOr<LayerWeights> ParamShard::GatherLayer(Collectives& c, int64_t layer) const {
  ASSIGN_OR_RETURN(std::vector<at::Tensor> tensors, units_.at(1 + layer).Gather(c));
  LayerWeights L = LayerWeights::Shaped(experts_.at(layer));
  const auto all = L.All();
  const std::vector<size_t>& fields = fields_.at(layer);
  for (size_t i = 0; i < fields.size(); ++i) *all[fields[i]] = std::move(tensors[i]);
  return L;
}

absl::StatusOr<BaseWeights> ParamShard::GatherWhole(Collectives& c, at::ScalarType dtype,
                                                    bool keep) const {
  at::NoGradGuard no_grad;
  // A gathered tensor is fresh (ShardedUnit::Gather), so one already in `dtype` is kept as is.
  // A cast that fails (no memory for the copy) drops what was kept, and the gathers go on: the
  // other ranks are in them.
  absl::Status kept;
  BaseWeights w;
  auto cast = [&](at::Tensor& t) {
    if (!keep || !t.defined()) return;
    try {
      t = t.to(dtype);
    } catch (const std::exception& e) {
      kept = absl::ResourceExhaustedError(
          absl::StrCat("no memory for the gathered copy of the model: ", e.what()));
      keep = false;
      w = BaseWeights();
    }
  };
  {
    ASSIGN_OR_RETURN(BaseWeights rest, GatherRest(c));
    if (keep) w = std::move(rest);
    cast(w.embed_VD);
    cast(w.final_norm_D);
    if (keep) w.lm_head_VD = tied_ ? w.embed_VD : w.lm_head_VD;
    cast(w.lm_head_VD);
  }
  for (size_t l = 0; l + 1 < units_.size(); ++l) {
    ASSIGN_OR_RETURN(LayerWeights L, GatherLayer(c, static_cast<int64_t>(l)));
    if (!keep) continue;
    for (at::Tensor* t : L.All()) cast(*t);
    if (keep) w.layers[l] = std::move(L);
  }
  RETURN_IF_ERROR(kept);
  return w;
}

std::vector<at::Tensor> ParamShard::RestTensors(const BaseWeights& w) const {
  if (tied_) return {w.embed_VD, w.final_norm_D};
  return {w.embed_VD, w.final_norm_D, w.lm_head_VD};
}

std::vector<at::Tensor> ParamShard::LayerTensors(int64_t layer, const LayerWeights& L) const {
  std::vector<at::Tensor> out;
  const auto all = L.All();
  for (size_t f : fields_.at(layer)) out.push_back(*all[f]);
  return out;
}

}  // namespace tinkerd
