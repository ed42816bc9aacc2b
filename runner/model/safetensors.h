// The safetensors container format, without LibTorch: an 8-byte little-endian header length N,
// N bytes of JSON {name: {dtype, shape, data_offsets: [begin, end)}, "__metadata__": {...}}, then
// the data section (offsets are relative to its start). The parser checks every offset and size,
// so a truncated or hostile file is an InvalidArgument, never an out-of-bounds read.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

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

absl::StatusOr<std::string> ReadFileToString(const std::string& path);
// Writes to path.tmp, fsyncs, renames: readers never see a partial file.
absl::Status WriteFileAtomically(const std::string& path, absl::string_view bytes);

}  // namespace tinkerd
