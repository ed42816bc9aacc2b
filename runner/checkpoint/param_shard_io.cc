#include "runner/checkpoint/param_shard_io.h"

#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <set>
#include <stdexcept>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "runner/model/weights.h"
#include "runner/util/status_macros.h"

namespace tinkerd {
namespace {

// Which of a unit's flat slices a file holds.
enum class Part { kParams, kExpAvg, kExpAvgSq, kGradSum };

const at::Tensor& SliceOf(const ShardedUnit& u, Part p) {
  switch (p) {
    case Part::kParams:
      return u.param_C;
    case Part::kExpAvg:
      return u.state.exp_avg_C;
    case Part::kExpAvgSq:
      return u.state.exp_avg_sq_C;
    case Part::kGradSum:
      return u.state.grad_sum_C;
  }
  return u.param_C;
}

// The gathers behind one file, a unit at a time in the order the file first needs each (its
// tensors by name, as SafetensorsWriter writes them), the same sequence on every rank. A gathered
// tensor is held until the writer takes it, and dropped then, so each unit is gathered once per
// file even where its tensors are not adjacent there (the rest's head and embedding sort first,
// its norm last), and a rank holds at most one unit whole. Rank 0 takes each tensor as the writer
// reaches it; whatever part of the sequence it did not run (its write stopped early), and the
// whole of it on the other ranks, Drain runs. A tensor the file holds under two names (an
// alias) is held until both are taken.
class GatherSequence {
 public:
  // `parts`: each part's name prefix in the file ("exp_avg." …) and slice; `aliases`: names the
  // file adds, each to the tensor of another name (the parameters' part).
  GatherSequence(Collectives& c, const ParamShard& shard,
                 const std::vector<std::pair<std::string, Part>>& parts,
                 const std::map<std::string, std::string>& aliases)
      : c_(c), shard_(shard) {
    for (const auto& [prefix, part] : parts) {
      for (size_t u = 0; u < shard.units().size(); ++u) {
        const ShardedUnit& unit = shard.units()[u];
        for (size_t i = 0; i < unit.names.size(); ++i) {
          entries_.emplace(prefix + unit.names[i], Entry{u, i, part});
        }
      }
    }
    for (const auto& [alias, name] : aliases) entries_.emplace(alias, entries_.at(name));
    for (const auto& [name, e] : entries_) {
      std::vector<int>& n = takes_[{e.unit, e.part}];
      n.resize(shard.units()[e.unit].names.size());
      ++n[e.index];
    }
    std::set<std::pair<size_t, Part>> seen;
    for (const auto& [name, e] : entries_) {
      if (seen.insert({e.unit, e.part}).second) order_.emplace_back(e.unit, e.part);
    }
  }

  // Shape-only stand-ins under the file's names (SaveSafetensorsFile's tensors; Take makes each).
  TensorMap Placeholders() const {
    TensorMap m;
    for (const auto& [name, e] : entries_) {
      m[name] = at::empty(shard_.units()[e.unit].shapes[e.index],
                          at::TensorOptions().dtype(at::kFloat).device(at::kMeta));
    }
    return m;
  }

  // The tensor `name` whole, once; throws when a gather fails or the writer strays from the
  // order.
  at::Tensor Take(const std::string& name) {
    const Entry& e = entries_.at(name);
    auto held = held_.find({e.unit, e.part});
    if (held == held_.end()) {
      if (next_ >= order_.size() || order_[next_] != std::pair{e.unit, e.part}) {
        throw std::logic_error(absl::StrCat(name, " out of the gathers' order"));
      }
      held = Next();
    }
    at::Tensor& slot = held->second[e.index];
    int& left = takes_.at({e.unit, e.part})[e.index];
    if (!slot.defined() || left == 0) throw std::logic_error(absl::StrCat(name, " taken twice"));
    if (--left > 0) return slot;  // its other name is still to come (nothing writes into it)
    return std::move(slot);
  }

  absl::Status Drain() {
    try {
      while (next_ < order_.size()) held_.erase(Next());
    } catch (const std::exception& e) {
      return absl::UnavailableError(e.what());
    }
    held_.clear();
    return absl::OkStatus();
  }

 private:
  struct Entry {
    size_t unit, index;
    Part part;
  };
  using Held = std::map<std::pair<size_t, Part>, std::vector<at::Tensor>>;
  Held::iterator Next() {
    const auto [unit, part] = order_[next_++];
    const ShardedUnit& u = shard_.units()[unit];
    // A unit the writer has taken every tensor of holds nothing: dropped before the next gather.
    for (auto it = held_.begin(); it != held_.end();) {
      const bool empty = std::none_of(it->second.begin(), it->second.end(),
                                      [](const at::Tensor& t) { return t.defined(); });
      it = empty ? held_.erase(it) : std::next(it);
    }
    absl::StatusOr<std::vector<at::Tensor>> whole = u.Gather(c_, SliceOf(u, part));
    if (!whole.ok()) throw std::runtime_error(std::string(whole.status().message()));
    return held_.insert_or_assign({unit, part}, *std::move(whole)).first;
  }

  Collectives& c_;
  const ParamShard& shard_;
  std::map<std::string, Entry> entries_;
  std::map<std::pair<size_t, Part>, std::vector<int>> takes_;  // names left to take, per tensor
  std::vector<std::pair<size_t, Part>> order_;
  size_t next_ = 0;
  Held held_;
};

// What a file of gathered tensors holds: GatherSequence's parts and aliases, and each tensor
// written as transform(name, tensor) when set.
struct FileSpec {
  std::vector<std::pair<std::string, Part>> parts;
  std::map<std::string, std::string> aliases = {};
  TensorTransform transform = nullptr;
};

// One file of gathered tensors, `path` (empty: gather only). Every rank runs all the gathers.
absl::StatusOr<FileDigest> WriteFile(Collectives& c, const ParamShard& shard, const FileSpec& spec,
                                     const std::string& dtype, const std::string& path) {
  GatherSequence gathers(c, shard, spec.parts, spec.aliases);
  absl::StatusOr<FileDigest> written = FileDigest{};  // what the ranks that only gather return
  if (!path.empty()) {
    try {
      written = SaveSafetensorsFile(path, gathers.Placeholders(), dtype,
                                    [&](const std::string& n, const at::Tensor&) {
                                      at::Tensor w = gathers.Take(n);
                                      return spec.transform ? spec.transform(n, w) : w;
                                    });
    } catch (const std::exception& e) {
      written = absl::InternalError(
          absl::StrCat(std::filesystem::path(path).filename().string(), ": ", e.what()));
    }
  }
  RETURN_IF_ERROR(gathers.Drain());
  return written;
}

std::string DtypeOf(const ParamShard& shard) {
  return shard.units().front().param_C.scalar_type() == at::kDouble ? "float64" : "float32";
}

}  // namespace

absl::Status WriteGatheredTrainingState(Collectives& c, const ModelState& t,
                                        const CheckpointMeta& meta, bool accumulated,
                                        const std::string& dir) {
  const ParamShard& shard = *t.sharded;
  std::vector<std::tuple<std::string, FileSpec>> files = {
      {"params.safetensors", {{{"", Part::kParams}}}},
      {"optimizer.safetensors", {{{"exp_avg.", Part::kExpAvg}, {"exp_avg_sq.", Part::kExpAvgSq}}}}};
  if (accumulated) files.push_back({"accumulators.safetensors", {{{"", Part::kGradSum}}}});
  TrainingManifest m;
  absl::Status first;  // rank 0's first failure; the gathers go on regardless
  for (const auto& [name, parts] : files) {
    const std::string path =
        first.ok() && !dir.empty() ? (std::filesystem::path(dir) / name).string() : "";
    absl::StatusOr<FileDigest> d = WriteFile(c, shard, parts, meta.training_dtype, path);
    if (d.ok()) {
      m.files[name] = *d;
    } else if (first.ok()) {
      first = absl::Status(d.status().code(), absl::StrCat("save_state: ", d.status().message()));
    }
  }
  RETURN_IF_ERROR(first);
  if (dir.empty()) return absl::OkStatus();
  return WriteManifest(t, meta, accumulated, std::move(m), dir);
}

namespace {

// A merged export whose weights are `shard`'s, gathered (`spec`), in `dtype`: rank 0 passes the
// directory it is committing, the others "".
absl::Status WriteGatheredExport(Collectives& c, const ModelState& t, const ParamShard& shard,
                                 const FileSpec& spec, const std::string& dtype,
                                 const ModelConfig& config, uint64_t base_fingerprint,
                                 const std::string& dir) {
  auto weights = [&](const std::string& path) { return WriteFile(c, shard, spec, dtype, path); };
  if (dir.empty()) return weights("").status();
  bool gathered = false;
  absl::Status st =
      WriteMergedExport(t, config, base_fingerprint, dir, [&](const std::string& file) {
        gathered = true;
        return weights(file);
      });
  // config.json could not be written: the others gather all the same.
  if (!gathered) RETURN_IF_ERROR(weights("").status());
  return st;
}

}  // namespace

absl::Status WriteGatheredMergedModel(Collectives& c, const ModelState& t,
                                      const ModelConfig& config, uint64_t base_fingerprint,
                                      const std::string& dir) {
  return WriteGatheredExport(c, t, *t.sharded, {{{"", Part::kParams}}}, DtypeOf(*t.sharded), config,
                             base_fingerprint, dir);
}

absl::Status WriteGatheredMergedLora(Collectives& c, const ModelState& t, const ParamShard& base,
                                     const ModelConfig& config, uint64_t base_fingerprint,
                                     const std::string& dir) {
  at::NoGradGuard no_grad;
  LoraMerge m = MergeOf(*t.lora, config);
  FileSpec spec{{{"", Part::kParams}}};
  if (m.adds_head) spec.aliases["lm_head.weight"] = "model.embed_tokens.weight";
  spec.transform = std::move(m.merge);
  const std::string dtype =
      t.params.begin()->second.scalar_type() == at::kDouble ? "float64" : "float32";
  return WriteGatheredExport(c, t, base, spec, dtype, m.config, base_fingerprint, dir);
}

ReadSlices SlicesOf(const ModelState& t) {
  const ParamShard& shard = *t.sharded;
  ReadSlices r;
  r.fraction = 1.0 / shard.units().front().state.layout.world_size();
  r.largest_values = shard.LargestTensorValues();
  r.take = [&shard](const std::string& name, const at::Tensor& whole) {
    const auto at = shard.Find(name);
    if (!at) return at::Tensor();
    const ShardedUnit& u = shard.units()[at->first];
    if (whole.sizes().vec() != u.shapes[at->second]) return at::Tensor();
    return u.PartOf(at->second, whole);
  };
  return r;
}

absl::Status CheckShardedCompatible(const ModelState& t, const LoadedState& s) {
  if (s.options.lora) {
    return absl::FailedPreconditionError(
        absl::StrCat("checkpoint holds a LoRA adapter; model ", t.id, " is a full fine-tune"));
  }
  size_t n = 0;
  for (const ShardedUnit& u : t.sharded->units()) {
    for (size_t i = 0; i < u.names.size(); ++i, ++n) {
      for (const auto* m : {&s.params, &s.exp_avg, &s.exp_avg_sq, &s.grad_sum}) {
        auto it = m->find(u.names[i]);
        // Read in parts, a tensor of another shape came back undefined (SlicesOf).
        const bool fits = it != m->end() && it->second.defined() &&
                          (s.sliced || it->second.sizes().vec() == u.shapes[i]);
        if (!fits && (m != &s.grad_sum || it != m->end())) {
          return absl::FailedPreconditionError(
              absl::StrCat("checkpoint lacks ", u.names[i], " or its shape differs"));
        }
      }
    }
  }
  if (s.params.size() != n) {
    return absl::FailedPreconditionError("checkpoint holds tensors this model does not have");
  }
  return absl::OkStatus();
}

namespace {

// A read in parts (SlicesOf): each tensor's part straight into its place in the slices; zeros
// where nothing was read.
void PutParts(ShardedUnit& u, const LoadedState& s, bool with_optimizer) {
  const ShardLayout& layout = u.state.layout;
  for (const ShardLayout::Piece& p :
       layout.Pieces(layout.begin(layout.rank()), layout.end(layout.rank()))) {
    auto put = [&](const std::map<std::string, at::Tensor>& from, bool read, at::Tensor& to_C) {
      const auto it = from.find(u.names[p.tensor]);
      at::Tensor into = to_C.narrow(0, p.offset, p.length);
      if (read && it != from.end()) {
        into.copy_(it->second);
      } else {
        into.zero_();
      }
    };
    put(s.params, true, u.param_C);
    put(s.exp_avg, with_optimizer, u.state.exp_avg_C);
    put(s.exp_avg_sq, with_optimizer, u.state.exp_avg_sq_C);
    put(s.grad_sum, true, u.state.grad_sum_C);
  }
}

// A whole read: this rank's slices of the whole tensors.
void PutWhole(ShardedUnit& u, const LoadedState& s, bool with_optimizer) {
  std::vector<at::Tensor> params, avg, avg_sq, sums;  // whole, in the unit's order
  for (const std::string& name : u.names) {
    const at::Tensor& p = s.params.at(name);
    params.push_back(p);
    avg.push_back(with_optimizer ? s.exp_avg.at(name) : at::zeros_like(p));
    avg_sq.push_back(with_optimizer ? s.exp_avg_sq.at(name) : at::zeros_like(p));
    auto g = s.grad_sum.find(name);
    sums.push_back(g != s.grad_sum.end() ? g->second : at::zeros_like(p));
  }
  u.state.Scatter(params, u.param_C);
  u.state.Scatter(avg, u.state.exp_avg_C);
  u.state.Scatter(avg_sq, u.state.exp_avg_sq_C);
  u.state.Scatter(sums, u.state.grad_sum_C);
}

}  // namespace

void ScatterLoadedState(ModelState& t, const LoadedState& s, bool with_optimizer) {
  at::NoGradGuard no_grad;
  for (ShardedUnit& u : t.sharded->units()) {
    if (s.sliced) {
      PutParts(u, s, with_optimizer);
    } else {
      PutWhole(u, s, with_optimizer);
    }
  }
  t.step = with_optimizer ? s.step : 0;
  t.skipped_steps = with_optimizer ? s.skipped_steps : 0;
  t.accumulated_tokens = s.grad_sum.empty() ? 0 : s.accumulated_tokens;
  t.accumulated_sequences = s.grad_sum.empty() ? 0 : s.accumulated_sequences;
}

}  // namespace tinkerd
