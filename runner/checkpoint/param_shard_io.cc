#include "runner/checkpoint/param_shard_io.h"

#include <ATen/core/grad_mode.h>

#include <filesystem>
#include <map>
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

// The gathers behind one file, in the file's order (by name, as SafetensorsWriter writes), the
// same sequence on every rank. Rank 0 takes each tensor as the writer reaches it; whatever part
// of the sequence it did not run (its write stopped early), and the whole of it on the other
// ranks, Drain runs.
class GatherSequence {
 public:
  // `parts`: each part's name prefix in the file ("exp_avg." …) and slice.
  GatherSequence(Collectives& c, const ParamShard& shard,
                 const std::vector<std::pair<std::string, Part>>& parts)
      : c_(c), shard_(shard) {
    for (const auto& [prefix, part] : parts) {
      for (size_t u = 0; u < shard.units().size(); ++u) {
        const ShardedUnit& unit = shard.units()[u];
        for (size_t i = 0; i < unit.names.size(); ++i) {
          entries_.emplace(prefix + unit.names[i], Entry{u, i, part});
        }
      }
    }
    for (const auto& [name, e] : entries_) {
      if (order_.empty() || order_.back() != std::pair{e.unit, e.part})
        order_.emplace_back(e.unit, e.part);
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

  // The tensor `name` whole; throws when a gather fails or the writer strays from the order.
  at::Tensor Take(const std::string& name) {
    const Entry& e = entries_.at(name);
    if (next_ == 0 || order_[next_ - 1] != std::pair{e.unit, e.part}) {
      if (next_ >= order_.size() || order_[next_] != std::pair{e.unit, e.part}) {
        throw std::logic_error(absl::StrCat("save_state: ", name, " out of the gathers' order"));
      }
      Next();
    }
    return held_[e.index];
  }

  absl::Status Drain() {
    try {
      while (next_ < order_.size()) Next();
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
  void Next() {
    const auto [unit, part] = order_[next_++];
    const ShardedUnit& u = shard_.units()[unit];
    held_.clear();  // one unit whole at a time
    absl::StatusOr<std::vector<at::Tensor>> whole = u.Gather(c_, SliceOf(u, part));
    if (!whole.ok()) throw std::runtime_error(std::string(whole.status().message()));
    held_ = *std::move(whole);
  }

  Collectives& c_;
  const ParamShard& shard_;
  std::map<std::string, Entry> entries_;
  std::vector<std::pair<size_t, Part>> order_;
  size_t next_ = 0;
  std::vector<at::Tensor> held_;
};

// One file of gathered tensors; `dir` empty: gather only. Every rank runs all the gathers.
absl::StatusOr<FileDigest> WriteFile(Collectives& c, const ParamShard& shard,
                                     const std::vector<std::pair<std::string, Part>>& parts,
                                     const std::string& dtype, const std::string& dir,
                                     const std::string& name) {
  GatherSequence gathers(c, shard, parts);
  absl::StatusOr<FileDigest> written = FileDigest{};  // what the ranks that only gather return
  if (!dir.empty()) {
    try {
      written = SaveSafetensorsFile(
          (std::filesystem::path(dir) / name).string(), gathers.Placeholders(), dtype,
          [&](const std::string& n, const at::Tensor&) { return gathers.Take(n); });
    } catch (const std::exception& e) {
      written = absl::InternalError(absl::StrCat("save_state: ", name, ": ", e.what()));
    }
  }
  RETURN_IF_ERROR(gathers.Drain());
  return written;
}

}  // namespace

absl::Status WriteGatheredTrainingState(Collectives& c, const ModelState& t,
                                        const CheckpointMeta& meta, bool accumulated,
                                        const std::string& dir) {
  const ParamShard& shard = *t.sharded;
  std::vector<std::tuple<std::string, std::vector<std::pair<std::string, Part>>>> files = {
      {"params.safetensors", {{"", Part::kParams}}},
      {"optimizer.safetensors", {{"exp_avg.", Part::kExpAvg}, {"exp_avg_sq.", Part::kExpAvgSq}}}};
  if (accumulated) files.push_back({"accumulators.safetensors", {{"", Part::kGradSum}}});
  TrainingManifest m;
  absl::Status first;  // rank 0's first failure; the gathers go on regardless
  for (const auto& [name, parts] : files) {
    absl::StatusOr<FileDigest> d =
        WriteFile(c, shard, parts, meta.training_dtype, first.ok() ? dir : "", name);
    if (d.ok()) {
      m.files[name] = *d;
    } else if (first.ok()) {
      first = d.status();
    }
  }
  RETURN_IF_ERROR(first);
  if (dir.empty()) return absl::OkStatus();
  return WriteManifest(t, meta, accumulated, std::move(m), dir);
}

absl::Status CheckShardedCompatible(const ModelState& t, const LoadedState& s) {
  if (s.options.lora) {
    return absl::FailedPreconditionError(
        absl::StrCat("checkpoint holds a LoRA adapter; model ", t.id, " is a full fine-tune"));
  }
  size_t n = 0;
  for (const ShardedUnit& u : t.sharded->units()) {
    for (size_t i = 0; i < u.names.size(); ++i, ++n) {
      for (const auto* m : {&s.params, &s.exp_avg, &s.exp_avg_sq}) {
        auto it = m->find(u.names[i]);
        if (it == m->end() || it->second.sizes().vec() != u.shapes[i]) {
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

void ScatterLoadedState(ModelState& t, const LoadedState& s, bool with_optimizer) {
  at::NoGradGuard no_grad;
  for (ShardedUnit& u : t.sharded->units()) {
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
  t.step = with_optimizer ? s.step : 0;
  t.skipped_steps = with_optimizer ? s.skipped_steps : 0;
  t.accumulated_tokens = s.grad_sum.empty() ? 0 : s.accumulated_tokens;
  t.accumulated_sequences = s.grad_sum.empty() ? 0 : s.accumulated_sequences;
}

}  // namespace tinkerd
