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

#include <sys/stat.h>

#include "absl/strings/str_cat.h"
#include "runner/util/hash.h"
#include "runner/util/status_macros.h"

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

namespace {

// The header's length from the file's first 8 bytes, checked against the file's size.
absl::StatusOr<uint64_t> HeaderLength(absl::string_view first8, uint64_t file_size) {
  if (first8.size() < 8) return Bad("file shorter than the 8-byte header length");
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(first8[i]);
  if (n > kMaxHeaderBytes) return Bad(absl::StrCat("header length ", n, " is implausibly large"));
  if (n > file_size - 8) return Bad("header length runs past the end of the file (truncated?)");
  return n;
}

// The header of a file of `file_size` bytes whose JSON is `header_text`.
absl::StatusOr<SafetensorsHeader> ParseHeader(absl::string_view header_text, uint64_t file_size) {
  json j = json::parse(header_text.begin(), header_text.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return Bad("header is not a JSON object");

  SafetensorsHeader h;
  h.data_start = 8 + header_text.size();
  const uint64_t data_size = file_size - h.data_start;
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

// The header's bytes (length, JSON padded so that the data section starts 8-byte aligned, as the
// reference implementation does: aligned data lets readers map tensors without copying) for
// `tensors` sorted by name, and the size of their data section.
absl::StatusOr<std::string> HeaderBytes(std::vector<SafetensorsSpec>* tensors,
                                        const std::map<std::string, std::string>& metadata,
                                        uint64_t* data_bytes) {
  std::sort(tensors->begin(), tensors->end(),
            [](const SafetensorsSpec& a, const SafetensorsSpec& b) { return a.name < b.name; });
  json header = json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  for (const SafetensorsSpec& t : *tensors) {
    const int64_t esize = SafetensorsDTypeSize(t.dtype);
    if (esize == 0) return Bad(absl::StrCat("cannot write dtype ", t.dtype));
    uint64_t numel = 1;
    for (int64_t d : t.shape) numel *= static_cast<uint64_t>(d);
    const uint64_t bytes = numel * static_cast<uint64_t>(esize);
    header[t.name] = {
        {"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string h = header.dump();
  while ((8 + h.size()) % 8 != 0) h.push_back(' ');
  std::string out;
  uint64_t n = h.size();
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((n >> (8 * i)) & 0xff));
  *data_bytes = offset;
  return out + h;
}

absl::Status Errno(absl::string_view what, const std::string& path) {
  return absl::InternalError(absl::StrCat(what, " ", path, ": ", std::strerror(errno)));
}

}  // namespace

absl::StatusOr<SafetensorsHeader> ParseSafetensors(absl::string_view file) {
  ASSIGN_OR_RETURN(const uint64_t n, HeaderLength(file.substr(0, 8), file.size()));
  return ParseHeader(file.substr(8, n), file.size());
}

absl::StatusOr<std::string> SerializeSafetensors(
    const std::vector<SafetensorsOutput>& tensors,
    const std::map<std::string, std::string>& metadata) {
  std::vector<SafetensorsSpec> specs;
  std::map<std::string, absl::string_view> bytes;
  for (const SafetensorsOutput& t : tensors) {
    specs.push_back({t.name, t.dtype, t.shape});
    bytes[t.name] = t.bytes;
  }
  uint64_t data_bytes = 0;
  ASSIGN_OR_RETURN(std::string out, HeaderBytes(&specs, metadata, &data_bytes));
  for (const SafetensorsOutput& t : tensors) {
    uint64_t numel = 1;
    for (int64_t d : t.shape) numel *= static_cast<uint64_t>(d);
    if (numel * SafetensorsDTypeSize(t.dtype) != t.bytes.size()) {
      return Bad(absl::StrCat("tensor '", t.name, "' has ", t.bytes.size(), " bytes, shape needs ",
                              numel * SafetensorsDTypeSize(t.dtype)));
    }
  }
  out.reserve(out.size() + data_bytes);
  for (const SafetensorsSpec& t : specs) out.append(bytes[t.name].data(), bytes[t.name].size());
  return out;
}

absl::StatusOr<std::unique_ptr<SafetensorsWriter>> SafetensorsWriter::Open(
    const std::string& path, std::vector<SafetensorsSpec> tensors,
    const std::map<std::string, std::string>& metadata) {
  uint64_t data_bytes = 0;
  ASSIGN_OR_RETURN(const std::string header, HeaderBytes(&tensors, metadata, &data_bytes));
  const std::string tmp = path + ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return Errno("open", tmp);
  std::unique_ptr<SafetensorsWriter> w(
      new SafetensorsWriter(path, fd, std::move(tensors), data_bytes));
  RETURN_IF_ERROR(w->Write(header));
  return w;
}

SafetensorsWriter::~SafetensorsWriter() {
  if (fd_ >= 0) {
    ::close(fd_);
    ::unlink((path_ + ".tmp").c_str());
  }
}

absl::Status SafetensorsWriter::Write(absl::string_view bytes) {
  const std::string tmp = path_ + ".tmp";
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t w = ::write(fd_, bytes.data() + done, bytes.size() - done);
    if (w < 0) {
      if (errno == EINTR) continue;
      return Errno("write", tmp);
    }
    done += static_cast<size_t>(w);
  }
  digest_.bytes += bytes.size();
  digest_.fnv64 = Fnv64(bytes, digest_.fnv64);
  return absl::OkStatus();
}

absl::Status SafetensorsWriter::Append(absl::string_view bytes) {
  if (appended_ + bytes.size() > data_bytes_) {
    return Bad(absl::StrCat("appending ", bytes.size(), " bytes past the ", data_bytes_,
                            " bytes the header promises"));
  }
  appended_ += bytes.size();
  return Write(bytes);
}

absl::StatusOr<FileDigest> SafetensorsWriter::Commit() {
  const std::string tmp = path_ + ".tmp";
  if (appended_ != data_bytes_) {
    return Bad(
        absl::StrCat(path_, ": ", appended_, " bytes appended, the header promises ", data_bytes_));
  }
  if (::fsync(fd_) != 0) return Errno("fsync", tmp);
  const int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0) {
    ::unlink(tmp.c_str());
    return Errno("close", tmp);
  }
  if (std::rename(tmp.c_str(), path_.c_str()) != 0) {
    const absl::Status st = Errno("rename", tmp);
    ::unlink(tmp.c_str());
    return st;
  }
  return digest_;
}

absl::StatusOr<std::unique_ptr<SafetensorsReader>> SafetensorsReader::Open(const std::string& path,
                                                                           bool digest) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return absl::NotFoundError(absl::StrCat("cannot open ", path));
  std::unique_ptr<SafetensorsReader> r(new SafetensorsReader(path, fd, digest));
  struct stat st;
  if (::fstat(fd, &st) != 0) return Errno("stat", path);
  r->size_ = static_cast<uint64_t>(st.st_size);
  std::string first8(std::min<uint64_t>(8, r->size_), '\0');
  RETURN_IF_ERROR(r->Next(first8.size(), first8.data()));
  absl::StatusOr<uint64_t> n = HeaderLength(first8, r->size_);
  if (n.ok()) {
    std::string text(*n, '\0');
    RETURN_IF_ERROR(r->Next(*n, text.data()));
    absl::StatusOr<SafetensorsHeader> header = ParseHeader(text, r->size_);
    if (header.ok()) {
      r->header_ = *std::move(header);
      return r;
    }
    n = header.status();
  }
  return absl::Status(n.status().code(), absl::StrCat(path, ": ", n.status().message()));
}

SafetensorsReader::~SafetensorsReader() {
  ::close(fd_);
}

absl::Status SafetensorsReader::Next(uint64_t n, char* out) {
  if (out == nullptr && !hash_ && n > 0) {
    // Nothing to hash: skipped. The header's checks keep every tensor within the file.
    if (::lseek(fd_, static_cast<off_t>(n), SEEK_CUR) < 0) {
      return absl::DataLossError(absl::StrCat("error seeking in ", path_));
    }
    digest_.bytes += n;
    return absl::OkStatus();
  }
  char scratch[1 << 16];
  while (n > 0) {
    char* dst = out != nullptr ? out : scratch;
    const size_t want = out != nullptr ? n : std::min<uint64_t>(n, sizeof(scratch));
    const ssize_t got = ::read(fd_, dst, want);
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) return absl::DataLossError(absl::StrCat("error reading ", path_));
    if (got == 0) return absl::DataLossError(absl::StrCat(path_, " ends early (truncated?)"));
    if (hash_)
      digest_.fnv64 = Fnv64(absl::string_view(dst, static_cast<size_t>(got)), digest_.fnv64);
    digest_.bytes += static_cast<uint64_t>(got);
    if (out != nullptr) out += got;
    n -= static_cast<uint64_t>(got);
  }
  return absl::OkStatus();
}

absl::Status SafetensorsReader::Read(const SafetensorsEntry& e, char* out) {
  return ReadPart(e, 0, e.end - e.begin, out);
}

absl::Status SafetensorsReader::ReadPart(const SafetensorsEntry& e, uint64_t offset, uint64_t n,
                                         char* out) {
  const uint64_t at = header_.data_start + e.begin + offset;
  if (at < digest_.bytes) {
    return absl::InternalError(absl::StrCat(path_, ": tensor '", e.name, "' read out of order"));
  }
  if (offset + n > e.end - e.begin) {
    return absl::InternalError(absl::StrCat(path_, ": a part past the end of '", e.name, "'"));
  }
  RETURN_IF_ERROR(Next(at - digest_.bytes, nullptr));
  return Next(n, out);
}

absl::StatusOr<FileDigest> SafetensorsReader::Finish() {
  if (!hash_) return FileDigest{size_, 0};  // nothing to hash: the rest need not be read
  RETURN_IF_ERROR(Next(size_ - digest_.bytes, nullptr));
  return digest_;
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
