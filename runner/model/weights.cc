#include "runner/model/weights.h"

#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <set>

#include "absl/strings/str_cat.h"
#include "runner/model/safetensors.h"
#include "runner/util/status_macros.h"

namespace tinkerd {
namespace {

absl::StatusOr<at::ScalarType> ScalarTypeOf(const std::string& d) {
  if (d == "F32") return at::kFloat;
  if (d == "F64") return at::kDouble;
  if (d == "BF16") return at::kBFloat16;
  if (d == "F16") return at::kHalf;
  if (d == "I64") return at::kLong;
  if (d == "I32") return at::kInt;
  return absl::InvalidArgumentError(absl::StrCat("safetensors: unsupported dtype ", d));
}

}  // namespace

absl::StatusOr<std::pair<at::ScalarType, std::string>> StoredType(const std::string& name) {
  if (name == "float32") return std::make_pair(at::kFloat, std::string("F32"));
  if (name == "float64") return std::make_pair(at::kDouble, std::string("F64"));
  if (name == "bfloat16") return std::make_pair(at::kBFloat16, std::string("BF16"));
  if (name == "float16") return std::make_pair(at::kHalf, std::string("F16"));
  return absl::InvalidArgumentError(absl::StrCat("unsupported stored dtype ", name));
}

absl::StatusOr<TensorMap> LoadSafetensorsFile(const std::string& path, at::ScalarType float_dtype) {
  ASSIGN_OR_RETURN(std::string bytes, ReadFileToString(path));
  auto header = ParseSafetensors(bytes);
  if (!header.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", header.status().message()));
  }
  TensorMap out;
  for (const SafetensorsEntry& e : header->entries) {
    ASSIGN_OR_RETURN(at::ScalarType st, ScalarTypeOf(e.dtype));
    // Copy out of the file buffer (which dies with this function) before converting.
    at::Tensor t = at::empty(e.shape, at::TensorOptions().dtype(st));
    // An empty tensor's data_ptr may be null, and memcpy with null is undefined even for 0 bytes.
    if (e.end > e.begin) {
      std::memcpy(t.data_ptr(), bytes.data() + header->data_start + e.begin, e.end - e.begin);
    }
    if (at::isFloatingType(st)) t = t.to(float_dtype);
    out[e.name] = t;
  }
  return out;
}

absl::StatusOr<TensorMap> LoadSafetensorsDir(const std::string& dir, at::ScalarType float_dtype) {
  namespace fs = std::filesystem;
  const fs::path index = fs::path(dir) / "model.safetensors.index.json";
  const fs::path single = fs::path(dir) / "model.safetensors";
  std::error_code ec;
  if (fs::exists(index, ec)) {
    ASSIGN_OR_RETURN(std::string text, ReadFileToString(index.string()));
    auto j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded() || !j.contains("weight_map") || !j["weight_map"].is_object()) {
      return absl::InvalidArgumentError(
          absl::StrCat(index.string(), ": needs a 'weight_map' object"));
    }
    std::set<std::string> files;
    std::map<std::string, std::string> expected;
    for (auto it = j["weight_map"].begin(); it != j["weight_map"].end(); ++it) {
      if (!it->is_string()) return absl::InvalidArgumentError("weight_map values must be strings");
      const std::string f = it->get<std::string>();
      if (f.find('/') != std::string::npos || f.find("..") != std::string::npos) {
        return absl::InvalidArgumentError(absl::StrCat("weight_map: bad shard name ", f));
      }
      files.insert(f);
      expected[it.key()] = f;
    }
    TensorMap all;
    for (const std::string& f : files) {
      ASSIGN_OR_RETURN(TensorMap part,
                       LoadSafetensorsFile((fs::path(dir) / f).string(), float_dtype));
      for (auto& [name, t] : part) {
        if (!all.emplace(name, t).second) {
          return absl::InvalidArgumentError(
              absl::StrCat("tensor ", name, " appears in two shards"));
        }
      }
    }
    for (const auto& [name, f] : expected) {
      if (!all.count(name)) {
        return absl::InvalidArgumentError(
            absl::StrCat("index names ", name, " in ", f, " but the shard lacks it"));
      }
    }
    return all;
  }
  if (fs::exists(single, ec)) return LoadSafetensorsFile(single.string(), float_dtype);
  return absl::NotFoundError(
      absl::StrCat(dir, ": neither model.safetensors nor model.safetensors.index.json"));
}

absl::StatusOr<std::string> SerializeTensors(const TensorMap& tensors,
                                             const std::string& stored_dtype) {
  ASSIGN_OR_RETURN(auto stored, StoredType(stored_dtype));
  std::vector<at::Tensor> keep;  // owns the converted buffers while serializing
  std::vector<SafetensorsOutput> outs;
  for (const auto& [name, t] : tensors) {
    at::Tensor c = t.detach();
    std::string dtype;
    if (at::isFloatingType(c.scalar_type())) {
      c = c.to(stored.first);
      dtype = stored.second;
    } else if (c.scalar_type() == at::kLong) {
      dtype = "I64";
    } else if (c.scalar_type() == at::kInt) {
      dtype = "I32";
    } else {
      return absl::InvalidArgumentError(absl::StrCat("cannot save tensor ", name));
    }
    c = c.cpu().contiguous();
    keep.push_back(c);
    outs.push_back({name, dtype, c.sizes().vec(),
                    absl::string_view(static_cast<const char*>(c.data_ptr()), c.nbytes())});
  }
  return SerializeSafetensors(outs, {{"format", "pt"}});
}

absl::Status SaveSafetensorsFile(const std::string& path, const TensorMap& tensors,
                                 const std::string& stored_dtype) {
  ASSIGN_OR_RETURN(std::string bytes, SerializeTensors(tensors, stored_dtype));
  return WriteFileAtomically(path, bytes);
}

}  // namespace tinkerd
