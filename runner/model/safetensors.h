// The safetensors container format, without LibTorch: an 8-byte little-endian header length N,
// N bytes of JSON {name: {dtype, shape, data_offsets: [begin, end)}, "__metadata__": {...}}, then
// the data section (offsets are relative to its start). The parser checks every offset and size,
// so a truncated or hostile file is an InvalidArgument, never an out-of-bounds read.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "runner/util/hash.h"

namespace tinkerd {

struct SafetensorsEntry {
  std::string name;
  std::string dtype;  // "F32", "BF16", "F16", "F64", "I64", "I32"
  std::vector<int64_t> shape;
  uint64_t begin = 0;  // byte offsets into the data section
  uint64_t end = 0;
};

struct SafetensorsHeader {
  std::vector<SafetensorsEntry> entries;  // sorted by begin offset
  std::map<std::string, std::string> metadata;
  uint64_t data_start = 0;  // offset of the data section in the file
};

// Bytes per element of a safetensors dtype, or 0 if unknown.
int64_t SafetensorsDTypeSize(absl::string_view dtype);

// Parses and checks the header of a whole file held in memory.
absl::StatusOr<SafetensorsHeader> ParseSafetensors(absl::string_view file_bytes);

struct SafetensorsOutput {
  std::string name;
  std::string dtype;
  std::vector<int64_t> shape;
  absl::string_view bytes;  // little-endian, row-major; size must equal numel × dtype size
};

// Serializes tensors (sorted by name) into one safetensors byte string.
absl::StatusOr<std::string> SerializeSafetensors(
    const std::vector<SafetensorsOutput>& tensors,
    const std::map<std::string, std::string>& metadata);

// A file's size and the FNV-64 of its bytes (runner/util/hash.h): what a checkpoint's manifest
// records of each file.
struct FileDigest {
  uint64_t bytes = 0;
  uint64_t fnv64 = 0;
  bool operator==(const FileDigest&) const = default;
};

// What the header says of a tensor to be written.
struct SafetensorsSpec {
  std::string name;
  std::string dtype;
  std::vector<int64_t> shape;
};

// A safetensors file written a piece at a time, so that no copy of the whole file is held (a
// checkpoint's optimizer file is twice the model's parameters): the header first, then each
// tensor's bytes in order(), then Commit() makes the file visible at once (path.tmp, fsync,
// rename) and returns its digest, computed from the bytes as they were written. Destroyed
// uncommitted, it removes path.tmp.
class SafetensorsWriter {
 public:
  static absl::StatusOr<std::unique_ptr<SafetensorsWriter>> Open(
      const std::string& path, std::vector<SafetensorsSpec> tensors,
      const std::map<std::string, std::string>& metadata);
  ~SafetensorsWriter();

  // The tensors in the order their bytes go in (by name).
  const std::vector<SafetensorsSpec>& order() const { return tensors_; }
  // The next bytes of the data section: order()'s tensors back to back, in pieces of any size.
  absl::Status Append(absl::string_view bytes);
  // INVALID_ARGUMENT unless exactly the data section was appended.
  absl::StatusOr<FileDigest> Commit();

 private:
  SafetensorsWriter(std::string path, int fd, std::vector<SafetensorsSpec> tensors,
                    uint64_t data_bytes)
      : path_(std::move(path)), fd_(fd), tensors_(std::move(tensors)), data_bytes_(data_bytes) {}
  absl::Status Write(absl::string_view bytes);

  const std::string path_;  // the final name; the bytes go to path_.tmp
  int fd_;
  const std::vector<SafetensorsSpec> tensors_;
  const uint64_t data_bytes_;  // what the header's offsets promise
  uint64_t appended_ = 0;
  FileDigest digest_{0, kFnv64Basis};  // of every byte written so far, header included
};

// A safetensors file read a piece at a time into buffers the caller owns, every byte hashed in
// file order on the way, so that a checkpoint is verified against its manifest without a copy of
// the whole file in memory.
class SafetensorsReader {
 public:
  // Reads and checks the header (ParseSafetensors' checks, against the file's size). `digest`:
  // whether to hash what is read (a base model's files, with no digest to meet, are not).
  static absl::StatusOr<std::unique_ptr<SafetensorsReader>> Open(const std::string& path,
                                                                 bool digest = true);
  ~SafetensorsReader();

  const SafetensorsHeader& header() const { return header_; }
  // The bytes of `e`, one of header().entries taken in their order, into `out` (e.end - e.begin
  // bytes). Bytes between tensors are read and hashed on the way (skipped, unread, without
  // `digest`).
  absl::Status Read(const SafetensorsEntry& e, char* out);
  // Bytes [offset, offset + n) of `e`'s, as Read (a sharded base's rank reads its part of each
  // tensor alone).
  absl::Status ReadPart(const SafetensorsEntry& e, uint64_t offset, uint64_t n, char* out);
  // Reads (and hashes) what is left; the digest of the whole file (its fnv64 0 without `digest`).
  absl::StatusOr<FileDigest> Finish();

 private:
  SafetensorsReader(std::string path, int fd, bool hash)
      : path_(std::move(path)), fd_(fd), hash_(hash) {}
  // The next `n` bytes of the file into `out` (null: read and hashed only).
  absl::Status Next(uint64_t n, char* out);

  const std::string path_;
  int fd_;
  const bool hash_;
  uint64_t size_ = 0;
  SafetensorsHeader header_;
  FileDigest digest_{0, kFnv64Basis};  // of every byte read so far
};

absl::StatusOr<std::string> ReadFileToString(const std::string& path);
// Writes to path.tmp, fsyncs, renames: readers never see a partial file.
absl::Status WriteFileAtomically(const std::string& path, absl::string_view bytes);

}  // namespace tinkerd
