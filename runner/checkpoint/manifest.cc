#include "runner/checkpoint/manifest.h"

#include <cmath>
#include <limits>
#include <nlohmann/json.hpp>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "runner/util/status_macros.h"

namespace tinkerd {
namespace {

using json = nlohmann::json;

absl::Status Malformed(absl::string_view field, absl::string_view why) {
  return absl::DataLossError(absl::StrCat("manifest.json: \"", field, "\" ", why));
}

// Typed field readers: the manifest is untrusted input, so each checks presence and JSON type
// instead of letting nlohmann convert (a float step, say, would silently truncate).
absl::StatusOr<const json*> Field(const json& obj, const char* key) {
  auto it = obj.find(key);
  if (it == obj.end()) return Malformed(key, "is missing");
  return &*it;
}

absl::StatusOr<int64_t> NonNegative(const json& obj, const char* key) {
  ASSIGN_OR_RETURN(const json* v, Field(obj, key));
  if (v->is_number_unsigned() && v->get<uint64_t>() <= std::numeric_limits<int64_t>::max()) {
    return static_cast<int64_t>(v->get<uint64_t>());
  }
  if (v->is_number_integer() && v->get<int64_t>() >= 0) return v->get<int64_t>();
  return Malformed(key, "must be a non-negative integer");
}

absl::StatusOr<std::string> String(const json& obj, const char* key) {
  ASSIGN_OR_RETURN(const json* v, Field(obj, key));
  if (!v->is_string()) return Malformed(key, "must be a string");
  return v->get<std::string>();
}

absl::StatusOr<uint64_t> U64String(const json& obj, const char* key) {
  ASSIGN_OR_RETURN(std::string s, String(obj, key));
  uint64_t out = 0;
  // SimpleAtoi accepts a sign and surrounding spaces; the writer emits neither.
  if (s.empty() || s.find_first_not_of("0123456789") != std::string::npos ||
      !absl::SimpleAtoi(s, &out)) {
    return Malformed(key, "must be a decimal unsigned 64-bit integer in a string");
  }
  return out;
}

absl::StatusOr<bool> Bool(const json& obj, const char* key) {
  ASSIGN_OR_RETURN(const json* v, Field(obj, key));
  if (!v->is_boolean()) return Malformed(key, "must be true or false");
  return v->get<bool>();
}

absl::StatusOr<LoraConfig> ParseLora(const json& l) {
  if (!l.is_object()) return Malformed("lora", "must be null or an object");
  LoraConfig c;
  ASSIGN_OR_RETURN(c.rank, NonNegative(l, "rank"));
  if (c.rank == 0) return Malformed("lora.rank", "must be positive");
  ASSIGN_OR_RETURN(const json* alpha, Field(l, "alpha"));
  if (!alpha->is_number() || !std::isfinite(alpha->get<double>()) || alpha->get<double>() <= 0) {
    return Malformed("lora.alpha", "must be a positive finite number");
  }
  c.alpha = alpha->get<double>();
  ASSIGN_OR_RETURN(c.train_attn, Bool(l, "train_attn"));
  ASSIGN_OR_RETURN(c.train_mlp, Bool(l, "train_mlp"));
  ASSIGN_OR_RETURN(c.train_unembed, Bool(l, "train_unembed"));
  return c;
}

absl::StatusOr<TrainingManifest> FromJson(const json& m) {
  TrainingManifest out;
  ASSIGN_OR_RETURN(out.model_id, String(m, "model_id"));
  ASSIGN_OR_RETURN(out.step, NonNegative(m, "step"));
  ASSIGN_OR_RETURN(out.skipped_steps, NonNegative(m, "skipped_steps"));
  ASSIGN_OR_RETURN(out.last_seq_id, NonNegative(m, "last_seq_id"));
  ASSIGN_OR_RETURN(std::string reduction, String(m, "loss_reduction"));
  auto mode = ParseLossReduction(reduction);
  if (!mode.ok()) return Malformed("loss_reduction", mode.status().message());
  out.options.loss_reduction = *mode;
  ASSIGN_OR_RETURN(out.options.seed, U64String(m, "seed"));
  ASSIGN_OR_RETURN(out.training_dtype, String(m, "training_dtype"));
  if (out.training_dtype != "float32" && out.training_dtype != "float64") {
    return Malformed("training_dtype", "must be \"float32\" or \"float64\"");
  }
  ASSIGN_OR_RETURN(out.base_model, String(m, "base_model"));
  ASSIGN_OR_RETURN(out.base_fingerprint, U64String(m, "base_fingerprint"));
  ASSIGN_OR_RETURN(const json* lora, Field(m, "lora"));
  if (lora->is_null()) {
    out.options.lora.reset();
  } else {
    ASSIGN_OR_RETURN(out.options.lora, ParseLora(*lora));
  }
  if (auto it = m.find("accumulated"); it != m.end()) {
    if (!it->is_object()) return Malformed("accumulated", "must be an object");
    Accumulated a;
    ASSIGN_OR_RETURN(a.tokens, NonNegative(*it, "tokens"));
    ASSIGN_OR_RETURN(a.sequences, NonNegative(*it, "sequences"));
    out.accumulated = a;
  }
  if (m.contains("shards")) {
    ASSIGN_OR_RETURN(const int64_t shards, NonNegative(m, "shards"));
    if (shards < 1 || shards > kMaxCheckpointShards) {
      return Malformed("shards", absl::StrCat("must be 1 to ", kMaxCheckpointShards));
    }
    out.shards = static_cast<int>(shards);
  }
  ASSIGN_OR_RETURN(const json* files, Field(m, "files"));
  if (!files->is_object()) return Malformed("files", "must be an object");
  for (const auto& [name, f] : files->items()) {
    // Names are looked up, never opened as given, but a path here means a forged manifest.
    if (name.empty() || name.find('/') != std::string::npos || name == "." || name == "..") {
      return Malformed("files", absl::StrCat("holds \"", name, "\", not a plain file name"));
    }
    if (!f.is_object()) return Malformed("files", "entries must be objects");
    FileDigest d;
    ASSIGN_OR_RETURN(int64_t bytes, NonNegative(f, "bytes"));
    d.bytes = static_cast<uint64_t>(bytes);
    ASSIGN_OR_RETURN(d.fnv64, U64String(f, "fnv64"));
    out.files[name] = d;
  }
  return out;
}

}  // namespace

std::string TrainingManifestToJson(const TrainingManifest& t) {
  json m;
  m["format"] = "tinkerd-checkpoint";
  m["format_version"] = kCheckpointFormatVersion;
  m["kind"] = "training";
  m["model_id"] = t.model_id;
  m["step"] = t.step;
  m["skipped_steps"] = t.skipped_steps;
  m["last_seq_id"] = t.last_seq_id;
  m["loss_reduction"] = std::string(LossReductionName(t.options.loss_reduction));
  m["seed"] = std::to_string(t.options.seed);
  m["rng"] = "the runner draws no random numbers after initialization; the seed is the RNG state";
  m["training_dtype"] = t.training_dtype;
  m["base_model"] = t.base_model;
  m["base_fingerprint"] = std::to_string(t.base_fingerprint);
  if (t.options.lora) {
    const LoraConfig& l = *t.options.lora;
    m["lora"] = {{"rank", l.rank},
                 {"alpha", l.alpha},
                 {"train_attn", l.train_attn},
                 {"train_mlp", l.train_mlp},
                 {"train_unembed", l.train_unembed}};
  } else {
    m["lora"] = nullptr;
  }
  if (t.accumulated) {
    m["accumulated"] = {{"tokens", t.accumulated->tokens}, {"sequences", t.accumulated->sequences}};
  }
  if (t.shards > 0) m["shards"] = t.shards;
  json files = json::object();
  for (const auto& [name, d] : t.files) {
    files[name] = {{"bytes", d.bytes}, {"fnv64", std::to_string(d.fnv64)}};
  }
  m["files"] = files;
  // Non-ASCII bytes that are not UTF-8 (a model_id is client text) are replaced, not thrown on.
  return m.dump(2, ' ', false, json::error_handler_t::replace);
}

absl::StatusOr<TrainingManifest> ParseTrainingManifest(absl::string_view text) {
  json m = json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
  if (m.is_discarded() || !m.is_object()) {
    return absl::DataLossError("manifest.json is not JSON object text");
  }
  auto format = m.find("format");
  if (format == m.end() || *format != "tinkerd-checkpoint") {
    return absl::DataLossError("manifest.json is not a tinkerd checkpoint manifest");
  }
  auto kind = m.find("kind");
  if (kind != m.end() && *kind == "sampler") {
    return absl::InvalidArgumentError("this is a sampler export, not training state");
  }
  if (kind == m.end() || *kind != "training") {
    return Malformed("kind", "must be \"training\"");
  }
  auto version = m.find("format_version");
  if (version == m.end() || *version != kCheckpointFormatVersion) {
    return absl::FailedPreconditionError(
        absl::StrCat("manifest.json: format version ",
                     version == m.end() ? std::string("(none)") : version->dump(),
                     " is not supported (this build reads ", kCheckpointFormatVersion, ")"));
  }
  return FromJson(m);
}

}  // namespace tinkerd
