#include "runner/checkpoint/state_io.h"

#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <set>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "runner/checkpoint/manifest.h"
#include "runner/checkpoint/store.h"
#include "runner/dist/shard.h"
#include "runner/model/safetensors.h"
#include "runner/model/weights.h"
#include "runner/util/status_macros.h"

namespace tinkerd {
namespace {

using json = nlohmann::json;
namespace fs = std::filesystem;

std::string Join(const std::string& dir, const std::string& f) {
  return (fs::path(dir) / f).string();
}

std::map<std::string, at::Tensor> Prefixed(const std::map<std::string, at::Tensor>& m,
                                           const std::string& p) {
  std::map<std::string, at::Tensor> out;
  for (const auto& [k, v] : m) out[p + k] = v;
  return out;
}

absl::Status DataLoss(const std::string& dir, const std::string& what) {
  return absl::DataLossError(absl::StrCat("checkpoint ", dir, ": ", what));
}

}  // namespace

uint64_t BaseFingerprint(const ModelConfig& config, const BaseWeights& base) {
  return BaseFingerprint(config, base.final_norm_D, FingerprintedEmbedding(base.embed_VD));
}

at::Tensor FingerprintedEmbedding(const at::Tensor& embed_VD) {
  return embed_VD.reshape(-1).narrow(0, 0, std::min<int64_t>(4096, embed_VD.numel())).clone();
}

uint64_t BaseFingerprint(const ModelConfig& config, const at::Tensor& final_norm_D,
                         const at::Tensor& embedding_head) {
  at::Tensor sample =
      at::cat({final_norm_D.to(at::kFloat).reshape(-1), embedding_head.to(at::kFloat)})
          .to(at::kCPU)
          .contiguous();
  std::string bytes = ModelConfigToJson(config);
  bytes.append(static_cast<const char*>(sample.data_ptr()), sample.nbytes());
  return Fnv64(bytes);
}

namespace {

// Writes `tensors` to dir/name and records the file's digest (of the bytes as they were written:
// reading the file back would only re-read them).
absl::StatusOr<FileDigest> SaveTensors(const std::string& dir, const std::string& name,
                                       const std::map<std::string, at::Tensor>& tensors,
                                       const std::string& dtype) {
  return SaveSafetensorsFile(Join(dir, name), tensors, dtype);
}

// params.safetensors, then (last: its presence marks the checkpoint complete) the manifest, which
// lists `files` besides the parameters.
absl::Status WriteParamsAndManifest(const ModelState& t, const CheckpointMeta& meta,
                                    bool accumulated, TrainingManifest m, const std::string& dir) {
  ASSIGN_OR_RETURN(m.files["params.safetensors"],
                   SaveTensors(dir, "params.safetensors", t.params, meta.training_dtype));
  return WriteManifest(t, meta, accumulated, std::move(m), dir);
}

std::string ShardFileName(const std::string& kind, int rank, int world_size) {
  return absl::StrCat(kind, "-", rank, "-of-", world_size, ".safetensors");
}

}  // namespace

absl::Status WriteManifest(const ModelState& t, const CheckpointMeta& meta, bool accumulated,
                           TrainingManifest m, const std::string& dir) {
  if (accumulated) m.accumulated = Accumulated{t.accumulated_tokens, t.accumulated_sequences};
  m.model_id = t.id;
  m.options = t.options;
  m.step = t.step;
  m.skipped_steps = t.skipped_steps;
  m.last_seq_id = meta.last_seq_id;
  m.training_dtype = meta.training_dtype;
  m.base_model = meta.base_model;
  m.base_fingerprint = meta.base_fingerprint;
  return WriteFileAtomically(Join(dir, "manifest.json"), TrainingManifestToJson(m));
}

absl::Status WriteTrainingState(const ModelState& t, const CheckpointMeta& meta,
                                const std::map<std::string, at::Tensor>* accumulated,
                                const std::string& dir) {
  TrainingManifest m;
  std::map<std::string, at::Tensor> moments = Prefixed(t.exp_avg, "exp_avg.");
  for (auto& [k, v] : Prefixed(t.exp_avg_sq, "exp_avg_sq.")) moments[k] = v;
  ASSIGN_OR_RETURN(m.files["optimizer.safetensors"],
                   SaveTensors(dir, "optimizer.safetensors", moments, meta.training_dtype));
  if (accumulated != nullptr) {
    ASSIGN_OR_RETURN(
        m.files["accumulators.safetensors"],
        SaveTensors(dir, "accumulators.safetensors", *accumulated, meta.training_dtype));
  }
  return WriteParamsAndManifest(t, meta, accumulated != nullptr, std::move(m), dir);
}

absl::StatusOr<std::map<std::string, FileDigest>> WriteStateShard(const OptimizerShard& shard,
                                                                  bool accumulated,
                                                                  const std::string& dtype,
                                                                  const std::string& dir) {
  const int r = shard.layout.rank(), w = shard.layout.world_size();
  std::map<std::string, FileDigest> files;
  const std::string optimizer = ShardFileName("optimizer", r, w);
  ASSIGN_OR_RETURN(
      files[optimizer],
      SaveTensors(dir, optimizer,
                  {{"exp_avg", shard.exp_avg_C}, {"exp_avg_sq", shard.exp_avg_sq_C}}, dtype));
  if (accumulated) {
    const std::string sums = ShardFileName("accumulators", r, w);
    ASSIGN_OR_RETURN(files[sums], SaveTensors(dir, sums, {{"grad_sum", shard.grad_sum_C}}, dtype));
  }
  return files;
}

absl::Status WriteShardedTrainingState(const ModelState& t, const CheckpointMeta& meta,
                                       bool accumulated, int world_size,
                                       const std::map<std::string, FileDigest>& shard_files,
                                       const std::string& dir) {
  TrainingManifest m;
  m.shards = world_size;
  m.files = shard_files;
  return WriteParamsAndManifest(t, meta, accumulated, std::move(m), dir);
}

namespace {

// A checkpoint's manifest, refused (FAILED_PRECONDITION) when it was trained on another base.
absl::StatusOr<TrainingManifest> ReadManifest(const std::string& dir, uint64_t base_fingerprint) {
  auto text = ReadFileToString(Join(dir, "manifest.json"));
  if (!text.ok()) return DataLoss(dir, "manifest.json is missing");
  auto m = ParseTrainingManifest(*text);
  if (!m.ok())
    return absl::Status(m.status().code(),
                        absl::StrCat("checkpoint ", dir, ": ", m.status().message()));
  if (m->base_fingerprint != base_fingerprint) {
    return absl::FailedPreconditionError(absl::StrCat(
        "checkpoint ", dir, " was trained on another base model (", m->base_model, ")"));
  }
  return m;
}

}  // namespace

absl::StatusOr<CreateModelOptions> ReadCheckpointOptions(const std::string& dir,
                                                         uint64_t base_fingerprint) {
  ASSIGN_OR_RETURN(TrainingManifest m, ReadManifest(dir, base_fingerprint));
  return m.options;
}

absl::StatusOr<LoadedState> ReadTrainingState(
    const std::string& dir, uint64_t base_fingerprint, at::ScalarType dtype,
    const std::function<absl::Status(int64_t bytes)>& admit, const ReadSlices* slices) {
  absl::StatusOr<TrainingManifest> m = ReadManifest(dir, base_fingerprint);
  if (!m.ok()) return m.status();
  // The tensors, in `dtype`, are as large as the files that hold them times the ratio of the two
  // dtypes; held twice at most: the slices of a sharded checkpoint beside the whole tensors they
  // are joined into, or (ApplyLoadedState) whole tensors beside the zeros a load without the
  // optimizer or the gradient sum puts in their place.
  ASSIGN_OR_RETURN(auto stored, StoredType(m->training_dtype));
  const double ratio = std::max(1.0, static_cast<double>(at::elementSize(dtype)) /
                                         static_cast<double>(at::elementSize(stored.first)));
  // A sharded model keeps its parts (`fraction` of the files) beside one whole tensor, read in the
  // stored dtype and converted; it puts them in place with no zeros beside them. From a
  // checkpoint of --shard=optimizer it also holds one key of one rank's file (a flat stretch of
  // every tensor), and beside it a tensor whole per key of the file (one may span two files).
  double held = 0;         // a forged manifest's sizes may overflow any integer
  double largest_key = 0;  // of a rank's file: an optimizer file holds two keys, the others one
  for (const auto& [name, digest] : m->files) {
    held +=
        (slices != nullptr ? slices->fraction : 2.0) * ratio * static_cast<double>(digest.bytes);
    if (name != "params.safetensors") {
      largest_key = std::max(largest_key, static_cast<double>(digest.bytes) /
                                              (name.rfind("optimizer", 0) == 0 ? 2 : 1));
    }
  }
  if (slices != nullptr) {
    held += static_cast<double>(slices->largest_values) *
            static_cast<double>(at::elementSize(stored.first) + at::elementSize(dtype));
    if (m->shards > 0) {
      // A key read in another dtype is held as stored and as converted at once
      // (LoadSafetensorsFile).
      const double converted = static_cast<double>(at::elementSize(dtype)) /
                               static_cast<double>(at::elementSize(stored.first));
      held += (stored.first == dtype ? 1.0 : 1.0 + converted) * largest_key +
              2.0 * static_cast<double>(slices->largest_values * at::elementSize(dtype));
    }
  }
  RETURN_IF_ERROR(admit(static_cast<int64_t>(std::min(held, 0x1p62))));
  LoadedState s;
  s.sliced = slices != nullptr;
  s.options = m->options;
  s.step = m->step;
  s.skipped_steps = m->skipped_steps;
  s.last_seq_id = m->last_seq_id;
  // Reads file `name` a tensor at a time, each kept as take(key, tensor) (null: whole).
  auto load =
      [&](const std::string& name,
          const TensorTransform& take) -> absl::StatusOr<std::map<std::string, at::Tensor>> {
    auto digest = m->files.find(name);
    if (digest == m->files.end())
      return DataLoss(dir, absl::StrCat(name, " is not in the manifest"));
    // Read once, a tensor at a time, and hashed on the way: the tensors are dropped unless the
    // whole file matches its digest.
    // A file of another size is refused before it is read: its tensors were not admitted.
    std::error_code ec;
    const uintmax_t size = fs::file_size(Join(dir, name), ec);
    if (ec) return DataLoss(dir, absl::StrCat(name, " is missing"));
    if (size != digest->second.bytes) {
      return DataLoss(dir,
                      absl::StrCat(name, " is corrupt or truncated (", size,
                                   " bytes where the manifest says ", digest->second.bytes, ")"));
    }
    FileDigest read;
    auto tensors = LoadSafetensorsFile(Join(dir, name), dtype, &read, nullptr, take);
    if (!tensors.ok() && tensors.status().code() == absl::StatusCode::kNotFound) {
      return DataLoss(dir, absl::StrCat(name, " is missing"));
    }
    if (!tensors.ok() || read != digest->second) {
      return DataLoss(dir, absl::StrCat(name, " is corrupt or truncated (size or checksum mismatch",
                                        tensors.ok() ? "" : ": ",
                                        tensors.ok() ? "" : tensors.status().message(), ")"));
    }
    return tensors;
  };
  // Read in parts: a parameter's (or its sum's) part by its name, a moment's by its parameter's
  // (optimizer files name it after "exp_avg." or "exp_avg_sq."). The parameters' whole shapes
  // are noted as they pass: a checkpoint of --shard=optimizer is cut by them.
  std::map<std::string, std::vector<int64_t>> shapes;
  TensorTransform part, moment_part;
  if (slices != nullptr) {
    part = [slices](const std::string& name, const at::Tensor& whole) {
      return slices->take(name, whole);
    };
    moment_part = [slices](const std::string& key, const at::Tensor& whole) {
      std::string param = key;
      for (const char* prefix : {"exp_avg_sq.", "exp_avg."}) {
        if (param.rfind(prefix, 0) == 0) {
          param = param.substr(std::strlen(prefix));
          break;
        }
      }
      return slices->take(param, whole);
    };
  }
  ASSIGN_OR_RETURN(s.params,
                   load(
                       "params.safetensors",
                       slices == nullptr ? TensorTransform()
                                         : [&](const std::string& name, const at::Tensor& whole) {
                                             shapes[name] = whole.sizes().vec();
                                             return part(name, whole);
                                           }));
  if (slices == nullptr) {
    for (const auto& [name, p] : s.params) shapes[name] = p.sizes().vec();
  }
  if (m->shards > 0) {
    // Rank r's file holds [begin(r), end(r)) of the flat space of the parameters in name order
    // (runner/dist/shard.h) under the world size it was saved at; concatenated, the files are the
    // whole flat vectors, cut back at the tensors here. So any world size loads it.
    std::vector<std::string> names;
    std::vector<int64_t> numels;
    for (const auto& [name, shape] : shapes) {
      names.push_back(name);
      int64_t n = 1;
      for (int64_t d : shape) n *= d;
      numels.push_back(n);
    }
    const ShardLayout layout(numels, m->shards, 0);
    // One kind's files, each read once: per key, the tensors by name, whole, or this rank's
    // parts of them (each file's stretch cut at the tensors as it is read, a tensor that spans
    // two files put together whole first).
    auto join = [&](const std::string& kind, const std::vector<std::string>& keys)
        -> absl::StatusOr<std::vector<std::map<std::string, at::Tensor>>> {
      std::vector<std::map<std::string, at::Tensor>> out(keys.size());
      std::vector<std::vector<at::Tensor>> flats(keys.size());  // whole reads: the files' stretches
      std::vector<at::Tensor> spanning(keys.size());  // parts: the tensor begun in an earlier file
      for (int r = 0; r < m->shards; ++r) {
        const std::string name = ShardFileName(kind, r, m->shards);
        const int64_t begin = layout.begin(r), owned = layout.end(r) - begin;
        std::vector<bool> seen(keys.size());
        TensorTransform cut = [&](const std::string& key, const at::Tensor& flat) -> at::Tensor {
          const size_t k = std::find(keys.begin(), keys.end(), key) - keys.begin();
          if (k == keys.size() || flat.dim() != 1 || flat.numel() != owned) return at::Tensor();
          seen[k] = true;
          if (slices == nullptr) {
            flats[k].push_back(flat);
            return at::Tensor();
          }
          for (const ShardLayout::Piece& p : layout.Pieces(begin, begin + owned)) {
            // Larger than any tensor of the model: refused (CheckShardedCompatible), never built.
            if (numels[p.tensor] > slices->largest_values) continue;
            at::Tensor piece = flat.narrow(0, p.offset, p.length);
            if (p.length < numels[p.tensor]) {
              if (p.tensor_offset == 0) spanning[k] = at::empty({numels[p.tensor]}, flat.options());
              if (!spanning[k].defined()) continue;  // begun in a file that lacked the key
              spanning[k].narrow(0, p.tensor_offset, p.length).copy_(piece);
              if (p.tensor_offset + p.length < numels[p.tensor]) continue;
              piece = std::move(spanning[k]);
              spanning[k] = at::Tensor();
            }
            at::Tensor kept = slices->take(names[p.tensor], piece.view(shapes[names[p.tensor]]));
            if (kept.defined()) out[k][names[p.tensor]] = std::move(kept);
          }
          return at::Tensor();
        };
        RETURN_IF_ERROR(load(name, cut).status());
        for (size_t k = 0; k < keys.size(); ++k) {
          if (!seen[k]) {
            return DataLoss(dir, absl::StrCat(name, " lacks ", keys[k], " of ", owned, " values"));
          }
        }
      }
      if (slices != nullptr) {
        // Empty tensors lie in no file's stretch.
        for (size_t i = 0; i < names.size(); ++i) {
          if (numels[i] != 0) continue;
          for (size_t k = 0; k < keys.size(); ++k) {
            at::Tensor kept = slices->take(names[i], at::empty(shapes[names[i]], at::dtype(dtype)));
            if (kept.defined()) out[k][names[i]] = std::move(kept);
          }
        }
        return out;
      }
      for (size_t k = 0; k < keys.size(); ++k) {
        const at::Tensor flat_N = at::cat(flats[k]);
        for (size_t i = 0; i < names.size(); ++i) {
          out[k][names[i]] =
              flat_N.narrow(0, layout.tensor_begin(i), numels[i]).view(shapes[names[i]]);
        }
      }
      return out;
    };
    ASSIGN_OR_RETURN(auto moments, join("optimizer", {"exp_avg", "exp_avg_sq"}));
    s.exp_avg = std::move(moments[0]);
    s.exp_avg_sq = std::move(moments[1]);
    if (m->accumulated) {
      ASSIGN_OR_RETURN(auto sums, join("accumulators", {"grad_sum"}));
      s.grad_sum = std::move(sums[0]);
    }
  } else {
    ASSIGN_OR_RETURN(auto moments, load("optimizer.safetensors", moment_part));
    for (auto& [k, v] : moments) {
      if (k.rfind("exp_avg_sq.", 0) == 0) {
        s.exp_avg_sq[k.substr(11)] = v;
      } else if (k.rfind("exp_avg.", 0) == 0) {
        s.exp_avg[k.substr(8)] = v;
      }
    }
    if (m->accumulated) {
      ASSIGN_OR_RETURN(s.grad_sum, load("accumulators.safetensors", part));
    }
  }
  if (m->accumulated) {
    s.accumulated_tokens = m->accumulated->tokens;
    s.accumulated_sequences = m->accumulated->sequences;
  }
  return s;
}

absl::Status CheckCompatible(const ModelState& t, const LoadedState& s) {
  auto describe = [](const std::optional<LoraConfig>& l) {
    return l ? absl::StrCat("LoRA rank ", l->rank, " (attn ", l->train_attn, ", mlp ", l->train_mlp,
                            ", unembed ", l->train_unembed, ")")
             : std::string("full fine-tuning");
  };
  const auto& a = t.options.lora;
  const auto& b = s.options.lora;
  const bool same = a.has_value() == b.has_value() &&
                    (!a || (a->rank == b->rank && a->train_attn == b->train_attn &&
                            a->train_mlp == b->train_mlp && a->train_unembed == b->train_unembed));
  if (!same) {
    return absl::FailedPreconditionError(
        absl::StrCat("checkpoint holds ", describe(b), "; model ", t.id, " is ", describe(a)));
  }
  for (const auto& [name, p] : t.params) {
    for (const auto* m : {&s.params, &s.exp_avg, &s.exp_avg_sq}) {
      auto it = m->find(name);
      if (it == m->end() || it->second.sizes() != p.sizes()) {
        return absl::FailedPreconditionError(
            absl::StrCat("checkpoint lacks ", name, " or its shape differs"));
      }
    }
  }
  if (s.params.size() != t.params.size()) {
    return absl::FailedPreconditionError("checkpoint holds tensors this model does not have");
  }
  return absl::OkStatus();
}

absl::Status WritePeftAdapter(const ModelState& t, const std::string& base_model,
                              uint64_t base_fingerprint, const std::string& dir) {
  if (!t.options.lora) {
    return absl::FailedPreconditionError(
        "a full fine-tune has no adapter; export it merged instead");
  }
  // PEFT's names: base_model.model.<module>.lora_{A,B}.weight.
  std::map<std::string, at::Tensor> tensors;
  std::set<std::string> targets;
  for (const auto& [name, p] : t.params) {
    const size_t dot = name.rfind('.');
    const std::string module = name.substr(0, dot);
    tensors[absl::StrCat("base_model.model.", module, ".", name.substr(dot + 1), ".weight")] = p;
    targets.insert(module.substr(module.rfind('.') + 1));
  }
  RETURN_IF_ERROR(
      SaveSafetensorsFile(Join(dir, "adapter_model.safetensors"), tensors, "float32").status());
  const LoraConfig& l = *t.options.lora;
  json cfg = {{"peft_type", "LORA"},
              {"task_type", "CAUSAL_LM"},
              {"r", l.rank},
              {"lora_alpha", l.alpha},
              {"lora_dropout", 0.0},
              {"bias", "none"},
              {"fan_in_fan_out", false},
              {"inference_mode", true},
              {"target_modules", std::vector<std::string>(targets.begin(), targets.end())},
              {"base_model_name_or_path", base_model}};
  RETURN_IF_ERROR(WriteFileAtomically(Join(dir, "adapter_config.json"), cfg.dump(2)));
  json m = {{"format", "tinkerd-checkpoint"},
            {"format_version", kCheckpointFormatVersion},
            {"kind", "sampler"},
            {"model_id", t.id},
            {"step", t.step},
            {"base_fingerprint", std::to_string(base_fingerprint)},
            {"layout", "peft"}};
  return WriteFileAtomically(Join(dir, "manifest.json"), m.dump(2));
}

LoraMerge MergeOf(const LoraAdapter& lora, const ModelConfig& config) {
  LoraMerge m;
  m.config = config;
  m.adds_head = config.tie_word_embeddings && lora.Find("lm_head") != nullptr;
  if (m.adds_head) m.config.tie_word_embeddings = false;
  const double scale = lora.scale();
  m.merge = [&lora, scale](const std::string& name, const at::Tensor& tensor) {
    if (name.size() < 7 || name.substr(name.size() - 7) != ".weight") return tensor;
    const LoraPair* p = lora.Find(name.substr(0, name.size() - 7));
    if (p == nullptr) return tensor;
    return tensor + at::mm(p->B_Or, p->A_rI).to(tensor.scalar_type()) * scale;
  };
  return m;
}

absl::Status WriteMergedModel(const ModelState& t, const ModelConfig& config,
                              const BaseWeights& base, uint64_t base_fingerprint,
                              const std::string& dir) {
  at::NoGradGuard no_grad;
  ModelConfig out = config;
  std::map<std::string, at::Tensor> w;
  TensorTransform merge;
  if (t.full) {
    w = t.full->Named(config);
  } else {
    LoraMerge m = MergeOf(*t.lora, config);
    w = base.Named(config);
    if (m.adds_head) w["lm_head.weight"] = base.lm_head_VD;
    out = std::move(m.config);
    merge = std::move(m.merge);
  }
  const std::string dtype =
      t.params.begin()->second.scalar_type() == at::kDouble ? "float64" : "float32";
  return WriteMergedExport(t, std::move(out), base_fingerprint, dir, [&](const std::string& file) {
    return SaveSafetensorsFile(file, w, dtype, merge);
  });
}

absl::Status WriteMergedExport(
    const ModelState& t, ModelConfig config, uint64_t base_fingerprint, const std::string& dir,
    const std::function<absl::StatusOr<FileDigest>(const std::string& file)>& weights) {
  config.torch_dtype = "float32";
  RETURN_IF_ERROR(WriteFileAtomically(Join(dir, "config.json"), ModelConfigToJson(config)));
  RETURN_IF_ERROR(weights(Join(dir, "model.safetensors")).status());
  json m = {{"format", "tinkerd-checkpoint"},
            {"format_version", kCheckpointFormatVersion},
            {"kind", "sampler"},
            {"model_id", t.id},
            {"step", t.step},
            {"base_fingerprint", std::to_string(base_fingerprint)},
            {"layout", "hf_merged"}};
  return WriteFileAtomically(Join(dir, "manifest.json"), m.dump(2));
}

namespace {

// PEFT's module names for each group LoraConfig switches on.
bool Targets(const std::set<std::string>& targets, const std::set<std::string>& group, bool* on) {
  size_t found = 0;
  for (const std::string& m : group) found += targets.count(m);
  *on = found > 0;
  return found == 0 || found == group.size();
}

// The MLP's linear modules by PEFT's short name: the dense layers' and the experts' (Mixtral
// names its experts' w1, w3 and w2).
std::set<std::string> MlpModules(const ModelConfig& config) {
  std::set<std::string> out;
  for (int64_t l = 0; l < config.num_hidden_layers; ++l) {
    if (config.Routes(l)) {
      out.insert({config.moe.names.gate, config.moe.names.up, config.moe.names.down});
    } else {
      out.insert({"gate_proj", "up_proj", "down_proj"});
    }
  }
  return out;
}

absl::StatusOr<LoraAdapter> ReadPeftAdapter(const std::string& dir, const ModelConfig& config,
                                            at::ScalarType dtype, at::Device device,
                                            const LoraAdapter::Keep& keep) {
  auto text = ReadFileToString(Join(dir, "adapter_config.json"));
  if (!text.ok()) return DataLoss(dir, "adapter_config.json is missing");
  const json c = json::parse(*text, nullptr, false);
  if (!c.is_object() || !c.value("r", json()).is_number_integer() ||
      !c.value("lora_alpha", json()).is_number() || !c.value("target_modules", json()).is_array()) {
    return DataLoss(dir, "adapter_config.json lacks r, lora_alpha or target_modules");
  }
  std::set<std::string> targets;
  for (const json& m : c["target_modules"]) {
    if (!m.is_string()) return DataLoss(dir, "adapter_config.json: target_modules not strings");
    targets.insert(m.get<std::string>());
  }
  LoraConfig lora;
  lora.rank = c["r"].get<int64_t>();
  lora.alpha = c["lora_alpha"].get<double>();
  // tinkerd adapts whole groups; an adapter of part of one was not made here.
  const std::set<std::string> mlp = MlpModules(config);
  if (!Targets(targets, {"q_proj", "k_proj", "v_proj", "o_proj"}, &lora.train_attn) ||
      !Targets(targets, mlp, &lora.train_mlp) ||
      !Targets(targets, {"lm_head"}, &lora.train_unembed) ||
      targets.size() != 4u * lora.train_attn + mlp.size() * lora.train_mlp + lora.train_unembed) {
    return absl::FailedPreconditionError(absl::StrCat(
        "checkpoint ", dir, ": its adapter targets modules this server does not adapt"));
  }
  if (absl::Status st = LoraAdapter::Validate(lora); !st.ok()) {
    return DataLoss(dir, absl::StrCat("adapter_config.json: ", st.message()));
  }
  ASSIGN_OR_RETURN(TensorMap tensors,
                   LoadSafetensorsFile(Join(dir, "adapter_model.safetensors"), dtype));
  ASSIGN_OR_RETURN(LoraAdapter adapter, LoraAdapter::Create(config, lora, 0, dtype, device, keep));
  at::NoGradGuard no_grad;
  const std::map<std::string, at::Tensor> params = adapter.Parameters();
  for (const auto& [name, p] : params) {
    const size_t dot = name.rfind('.');
    const std::string peft = absl::StrCat("base_model.model.", name.substr(0, dot), ".",
                                          name.substr(dot + 1), ".weight");
    auto it = tensors.find(peft);
    if (it == tensors.end() || it->second.sizes() != p.sizes()) {
      return absl::FailedPreconditionError(
          absl::StrCat("checkpoint ", dir, ": ", peft,
                       " is missing or its shape differs from this base model's"));
    }
    at::Tensor(p).copy_(it->second);
  }
  // Each tensor has a place here, or is another rank's (whose own read checks it there).
  int64_t others = 0;
  if (keep) {
    constexpr absl::string_view kPrefix = "base_model.model.";
    for (const auto& [name, t] : tensors) {
      const size_t lora_at = name.rfind(".lora_");
      if (!absl::StartsWith(name, kPrefix) || lora_at == std::string::npos) continue;
      others += !keep(name.substr(kPrefix.size(), lora_at - kPrefix.size()));
    }
  }
  if (static_cast<int64_t>(tensors.size()) - others != static_cast<int64_t>(params.size())) {
    return absl::FailedPreconditionError(absl::StrCat(
        "checkpoint ", dir, ": the adapter holds tensors this base model has no place for"));
  }
  return adapter.Frozen(dtype);
}

}  // namespace

absl::StatusOr<SamplerWeights> ReadSamplerWeights(const std::string& dir,
                                                  const ModelConfig& base_config,
                                                  uint64_t base_fingerprint, at::ScalarType dtype,
                                                  at::Device device,
                                                  const LoraAdapter::Keep& keep) {
  auto text = ReadFileToString(Join(dir, "manifest.json"));
  if (!text.ok()) return DataLoss(dir, "manifest.json is missing");
  const json m = json::parse(*text, nullptr, false);
  if (!m.is_object() || m.value("format", "") != "tinkerd-checkpoint") {
    return DataLoss(dir, "manifest.json is not a tinkerd checkpoint's");
  }
  if (m.value("kind", "") != "sampler") {
    return absl::InvalidArgumentError(
        absl::StrCat("checkpoint ", dir, " is training state, not weights for a sampler"));
  }
  SamplerWeights out;
  out.model_id = m.value("model_id", "");
  out.step = m.value("step", int64_t{0});
  out.config = base_config;
  const std::string layout = m.value("layout", "");
  if (layout == "peft") {
    // Exports made before the fingerprint was recorded are checked by their shapes alone.
    if (m.contains("base_fingerprint") &&
        m["base_fingerprint"] != json(std::to_string(base_fingerprint))) {
      return absl::FailedPreconditionError(
          absl::StrCat("checkpoint ", dir, " is an adapter of another base model"));
    }
    ASSIGN_OR_RETURN(out.lora, ReadPeftAdapter(dir, base_config, dtype, device, keep));
    return out;
  }
  if (layout != "hf_merged") return DataLoss(dir, absl::StrCat("unknown layout '", layout, "'"));
  auto config_text = ReadFileToString(Join(dir, "config.json"));
  if (!config_text.ok()) return DataLoss(dir, "config.json is missing");
  auto config = ParseModelConfig(*config_text);
  if (!config.ok()) return DataLoss(dir, absl::StrCat("config.json: ", config.status().message()));
  // The decoder (and its RoPE tables) is the base model's: only tying and the stored dtype may
  // differ.
  ModelConfig same = *config;
  same.tie_word_embeddings = base_config.tie_word_embeddings;
  same.torch_dtype = base_config.torch_dtype;
  if (ModelConfigToJson(same) != ModelConfigToJson(base_config)) {
    return absl::FailedPreconditionError(
        absl::StrCat("checkpoint ", dir, " has another architecture than the base model"));
  }
  out.config = *config;
  ASSIGN_OR_RETURN(TensorMap tensors, LoadSafetensorsDir(dir, dtype));
  for (auto& [name, t] : tensors) t = t.to(device);
  auto weights = BaseWeightsFromTensors(out.config, std::move(tensors));
  if (!weights.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("checkpoint ", dir, ": ", weights.status().message()));
  }
  out.weights = *std::move(weights);
  return out;
}

}  // namespace tinkerd
