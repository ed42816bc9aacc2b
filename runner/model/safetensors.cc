#include "runner/model/safetensors.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>

#include "absl/strings/str_cat.h"

namespace tinkerd {
namespace {

using json = nlohmann::json;

// Headers larger than this are refused; real checkpoints have headers of a few hundred KB.
constexpr uint64_t kMaxHeaderBytes = 100ull << 20;

absl::Status Bad(absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("safetensors: ", what));
}

}  // namespace

int64_t SafetensorsDTypeSize(absl::string_view d) {
  if (d == "F64" || d == "I64" || d == "U64") return 8;
  if (d == "F32" || d == "I32" || d == "U32") return 4;
  if (d == "BF16" || d == "F16" || d == "I16" || d == "U16") return 2;
  if (d == "I8" || d == "U8" || d == "BOOL") return 1;
  return 0;
}

absl::StatusOr<SafetensorsHeader> ParseSafetensors(absl::string_view file) {
  if (file.size() < 8) return Bad("file shorter than the 8-byte header length");
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(file[i]);
  if (n > kMaxHeaderBytes) return Bad(absl::StrCat("header length ", n, " is implausibly large"));
  if (n > file.size() - 8) return Bad("header length runs past the end of the file (truncated?)");
  const absl::string_view header_text = file.substr(8, n);
  json j = json::parse(header_text.begin(), header_text.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return Bad("header is not a JSON object");

  SafetensorsHeader h;
  h.data_start = 8 + n;
  const uint64_t data_size = file.size() - h.data_start;
  for (auto it = j.begin(); it != j.end(); ++it) {
    if (it.key() == "__metadata__") {
      if (!it->is_object()) return Bad("__metadata__ must be an object");
      for (auto m = it->begin(); m != it->end(); ++m) {
        if (!m->is_string()) return Bad("__metadata__ values must be strings");
        h.metadata[m.key()] = m->get<std::string>();
      }
      continue;
    }
    const json& t = *it;
    if (!t.is_object() || !t.contains("dtype") || !t["dtype"].is_string() || !t.contains("shape") ||
        !t["shape"].is_array() || !t.contains("data_offsets") || !t["data_offsets"].is_array() ||
        t["data_offsets"].size() != 2) {
      return Bad(absl::StrCat("tensor '", it.key(), "': needs dtype, shape and data_offsets"));
    }
    SafetensorsEntry e;
    e.name = it.key();
    e.dtype = t["dtype"].get<std::string>();
    int64_t esize = SafetensorsDTypeSize(e.dtype);
    if (esize == 0) return Bad(absl::StrCat("tensor '", e.name, "': unknown dtype ", e.dtype));
    uint64_t numel = 1;
    for (const json& d : t["shape"]) {
      if (!d.is_number_unsigned()) {
        return Bad(absl::StrCat("tensor '", e.name, "': shape entries must be non-negative ints"));
      }
      uint64_t v = d.get<uint64_t>();
      if (v > (1ull << 40) || (v != 0 && numel > (1ull << 50) / v)) {
        return Bad(absl::StrCat("tensor '", e.name, "': shape too large"));
      }
      e.shape.push_back(static_cast<int64_t>(v));
      numel *= v;
    }
    const json& off = t["data_offsets"];
    if (!off[0].is_number_unsigned() || !off[1].is_number_unsigned()) {
      return Bad(absl::StrCat("tensor '", e.name, "': data_offsets must be non-negative ints"));
    }
    e.begin = off[0].get<uint64_t>();
    e.end = off[1].get<uint64_t>();
    if (e.begin > e.end || e.end > data_size) {
      return Bad(absl::StrCat("tensor '", e.name, "': data_offsets [", e.begin, ", ", e.end,
                              ") outside the data section of ", data_size, " bytes"));
    }
    if (e.end - e.begin != numel * static_cast<uint64_t>(esize)) {
      return Bad(absl::StrCat("tensor '", e.name, "': ", e.end - e.begin,
                              " bytes do not match shape x dtype (", numel * esize, ")"));
    }
    h.entries.push_back(std::move(e));
  }
  std::sort(h.entries.begin(), h.entries.end(),
            [](const SafetensorsEntry& a, const SafetensorsEntry& b) {
              // (begin, end): an empty tensor at a tensor's start sorts first, whatever the order
              // the header listed them in, so acceptance does not depend on key order.
              return std::pair(a.begin, a.end) < std::pair(b.begin, b.end);
            });
  for (size_t i = 1; i < h.entries.size(); ++i) {
    if (h.entries[i].begin < h.entries[i - 1].end) {
      return Bad(absl::StrCat("tensors '", h.entries[i - 1].name, "' and '", h.entries[i].name,
                              "' overlap"));
    }
  }
  return h;
}

absl::StatusOr<std::string> SerializeSafetensors(
    const std::vector<SafetensorsOutput>& tensors,
    const std::map<std::string, std::string>& metadata) {
  std::vector<const SafetensorsOutput*> sorted;
  for (const auto& t : tensors) sorted.push_back(&t);
  std::sort(sorted.begin(), sorted.end(), [](auto* a, auto* b) { return a->name < b->name; });
  json header = json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  for (const auto* t : sorted) {
    int64_t esize = SafetensorsDTypeSize(t->dtype);
    if (esize == 0) return Bad(absl::StrCat("cannot write dtype ", t->dtype));
    uint64_t numel = 1;
    for (int64_t d : t->shape) numel *= static_cast<uint64_t>(d);
    if (numel * esize != t->bytes.size()) {
      return Bad(absl::StrCat("tensor '", t->name, "' has ", t->bytes.size(),
                              " bytes, shape needs ", numel * esize));
    }
    header[t->name] = {{"dtype", t->dtype},
                       {"shape", t->shape},
                       {"data_offsets", {offset, offset + t->bytes.size()}}};
    offset += t->bytes.size();
  }
  std::string h = header.dump();
  // Pad the header with spaces so the data section starts 8-byte aligned, as the reference
  // implementation does; aligned data lets readers map tensors without copying.
  while ((8 + h.size()) % 8 != 0) h.push_back(' ');
  std::string out;
  out.reserve(8 + h.size() + offset);
  uint64_t n = h.size();
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((n >> (8 * i)) & 0xff));
  out += h;
  for (const auto* t : sorted) out.append(t->bytes.data(), t->bytes.size());
  return out;
}

absl::StatusOr<std::string> ReadFileToString(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open ", path));
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) return absl::DataLossError(absl::StrCat("error reading ", path));
  return std::move(ss).str();
}

absl::Status WriteFileAtomically(const std::string& path, absl::string_view bytes) {
  const std::string tmp = path + ".tmp";
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return absl::InternalError(absl::StrCat("open ", tmp, ": ", std::strerror(errno)));
  size_t done = 0;
  while (done < bytes.size()) {
    ssize_t w = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (w < 0) {
      if (errno == EINTR) continue;
      int e = errno;
      ::close(fd);
      return absl::InternalError(absl::StrCat("write ", tmp, ": ", std::strerror(e)));
    }
    done += static_cast<size_t>(w);
  }
  if (::fsync(fd) != 0 || ::close(fd) != 0) {
    return absl::InternalError(absl::StrCat("fsync/close ", tmp, ": ", std::strerror(errno)));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    return absl::InternalError(absl::StrCat("rename ", tmp, ": ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

}  // namespace tinkerd
