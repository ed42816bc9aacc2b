#include "runner/model/weights.h"

#include <c10/util/accumulate.h>

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

absl::StatusOr<TensorMap> LoadSafetensorsFile(const std::string& path, at::ScalarType float_dtype,
                                              FileDigest* digest, const TensorFilter& keep,
                                              const TensorTransform& take) {
  ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsReader> file,
                   SafetensorsReader::Open(path, /*digest=*/digest != nullptr));
  TensorMap out;
  for (const SafetensorsEntry& e : file->header().entries) {
    if (keep && !keep(e.name)) continue;
    ASSIGN_OR_RETURN(at::ScalarType st, ScalarTypeOf(e.dtype));
    // Straight from the file into the tensor: only one tensor is ever held in a second dtype.
    at::Tensor t = at::empty(e.shape, at::TensorOptions().dtype(st));
    RETURN_IF_ERROR(file->Read(e, static_cast<char*>(t.data_ptr())));
    if (at::isFloatingType(st)) t = t.to(float_dtype);
    out[e.name] = take ? take(e.name, t) : t;
  }
  ASSIGN_OR_RETURN(FileDigest whole, file->Finish());
  if (digest != nullptr) *digest = whole;
  return out;
}

namespace {

// Every tensor of a model directory (that `keep` keeps), from `read` of each of its files.
absl::StatusOr<TensorMap> ReadModelDir(
    const std::string& dir, const TensorFilter& keep,
    const std::function<absl::StatusOr<TensorMap>(const std::string& path)>& read) {
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
      ASSIGN_OR_RETURN(TensorMap part, read((fs::path(dir) / f).string()));
      for (auto& [name, t] : part) {
        if (!all.emplace(name, t).second) {
          return absl::InvalidArgumentError(
              absl::StrCat("tensor ", name, " appears in two shards"));
        }
      }
    }
    for (const auto& [name, f] : expected) {
      if ((!keep || keep(name)) && !all.count(name)) {
        return absl::InvalidArgumentError(
            absl::StrCat("index names ", name, " in ", f, " but the shard lacks it"));
      }
    }
    return all;
  }
  if (fs::exists(single, ec)) return read(single.string());
  return absl::NotFoundError(
      absl::StrCat(dir, ": neither model.safetensors nor model.safetensors.index.json"));
}

}  // namespace

absl::StatusOr<TensorMap> LoadSafetensorsDir(const std::string& dir, at::ScalarType float_dtype,
                                             const TensorFilter& keep,
                                             const TensorTransform& take) {
  return ReadModelDir(dir, keep, [&](const std::string& path) {
    return LoadSafetensorsFile(path, float_dtype, /*digest=*/nullptr, keep, take);
  });
}

namespace {

// Every tensor of a model directory, as `each` makes it from its entry, its stored scalar type and
// its file (to read from, in the entries' order).
absl::StatusOr<TensorMap> EachEntry(
    const std::string& dir,
    const std::function<absl::StatusOr<at::Tensor>(
        SafetensorsReader& file, const SafetensorsEntry& e, at::ScalarType st)>& each) {
  return ReadModelDir(dir, nullptr, [&](const std::string& path) -> absl::StatusOr<TensorMap> {
    ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsReader> file,
                     SafetensorsReader::Open(path, /*digest=*/false));
    TensorMap out;
    for (const SafetensorsEntry& e : file->header().entries) {
      ASSIGN_OR_RETURN(at::ScalarType st, ScalarTypeOf(e.dtype));
      ASSIGN_OR_RETURN(out[e.name], each(*file, e, st));
    }
    return out;
  });
}

}  // namespace

absl::StatusOr<TensorMap> LoadSafetensorsDirStretches(const std::string& dir,
                                                      at::ScalarType float_dtype,
                                                      const Stretch& stretch) {
  return EachEntry(
      dir,
      [&](SafetensorsReader& file, const SafetensorsEntry& e,
          at::ScalarType st) -> absl::StatusOr<at::Tensor> {
        const auto [begin, length] = stretch(e.name, e.shape);
        if (length < 0) return at::Tensor();
        if (begin < 0 || begin + length > c10::multiply_integers(e.shape)) {
          return absl::InternalError(absl::StrCat("a stretch past the end of tensor ", e.name));
        }
        at::Tensor t = at::empty({length}, at::TensorOptions().dtype(st));
        const uint64_t size = at::elementSize(st);
        RETURN_IF_ERROR(file.ReadPart(e, static_cast<uint64_t>(begin) * size,
                                      static_cast<uint64_t>(length) * size,
                                      static_cast<char*>(t.data_ptr())));
        return at::isFloatingType(st) ? t.to(float_dtype) : t;
      });
}

absl::StatusOr<TensorMap> SafetensorsDirShapes(const std::string& dir, at::ScalarType float_dtype) {
  return EachEntry(dir,
                   [&](SafetensorsReader&, const SafetensorsEntry& e,
                       at::ScalarType st) -> absl::StatusOr<at::Tensor> {
                     return at::empty(e.shape, at::TensorOptions(at::kMeta).dtype(
                                                   at::isFloatingType(st) ? float_dtype : st));
                   });
}

absl::StatusOr<FileDigest> SaveSafetensorsFile(const std::string& path, const TensorMap& tensors,
                                               const std::string& stored_dtype,
                                               const TensorTransform& transform) {
  ASSIGN_OR_RETURN(auto stored, StoredType(stored_dtype));
  std::vector<SafetensorsSpec> specs;
  for (const auto& [name, t] : tensors) {
    std::string dtype;
    if (at::isFloatingType(t.scalar_type())) {
      dtype = stored.second;
    } else if (t.scalar_type() == at::kLong) {
      dtype = "I64";
    } else if (t.scalar_type() == at::kInt) {
      dtype = "I32";
    } else {
      return absl::InvalidArgumentError(absl::StrCat("cannot save tensor ", name));
    }
    specs.push_back({name, dtype, t.sizes().vec()});
  }
  ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsWriter> file,
                   SafetensorsWriter::Open(path, std::move(specs), {{"format", "pt"}}));
  for (const SafetensorsSpec& spec : file->order()) {
    // One tensor at a time in the stored dtype on the CPU: the file is never held whole.
    const at::Tensor& t = tensors.at(spec.name);
    at::Tensor c = (transform ? transform(spec.name, t) : t).detach();
    if (c.sizes() != t.sizes()) {
      return absl::InternalError(
          absl::StrCat("saving ", spec.name, ": its transform changed its shape"));
    }
    if (at::isFloatingType(c.scalar_type())) c = c.to(stored.first);
    c = c.cpu().contiguous();
    RETURN_IF_ERROR(
        file->Append(absl::string_view(static_cast<const char*>(c.data_ptr()), c.nbytes())));
  }
  return file->Commit();
}

}  // namespace tinkerd
