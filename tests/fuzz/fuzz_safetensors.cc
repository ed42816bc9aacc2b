// Fuzzes the safetensors parser (ParseSafetensors) on arbitrary file bytes.
// Properties, besides no crash and no out-of-bounds read (ASan):
//   - an accepted file's tensors lie inside the data section, sorted, non-overlapping, each with
//     exactly shape × dtype-size bytes;
//   - serializing the accepted tensors (SerializeSafetensors) and parsing the result gives back the
//     same names, dtypes, shapes, bytes and metadata.
#include <cstddef>
#include <cstdint>
#include <map>
#include <tuple>

#include "runner/model/safetensors.h"
#include "tests/fuzz/fuzz_check.h"

using tinkerd::SafetensorsEntry;
using tinkerd::SafetensorsHeader;

namespace {

// name -> (dtype, shape, bytes)
using Contents = std::map<std::string, std::tuple<std::string, std::vector<int64_t>, std::string>>;

Contents Read(absl::string_view file, const SafetensorsHeader& h) {
  Contents out;
  for (const SafetensorsEntry& e : h.entries) {
    out[e.name] = {e.dtype, e.shape,
                   std::string(file.substr(h.data_start + e.begin, e.end - e.begin))};
  }
  return out;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* bytes, size_t size) {
  const absl::string_view file(reinterpret_cast<const char*>(bytes), size);
  auto h = tinkerd::ParseSafetensors(file);
  if (!h.ok()) {
    FUZZ_CHECK(h.status().code() == absl::StatusCode::kInvalidArgument, "unexpected error code");
    return 0;
  }
  FUZZ_CHECK(h->data_start >= 8 && h->data_start <= size, "data section starts outside the file");
  const uint64_t data_size = size - h->data_start;
  uint64_t prev_end = 0;
  for (const SafetensorsEntry& e : h->entries) {
    FUZZ_CHECK(e.begin <= e.end && e.end <= data_size, "a tensor outside the data section");
    FUZZ_CHECK(e.begin >= prev_end, "tensors overlap or are not sorted");
    prev_end = e.end;
    uint64_t numel = 1;
    for (int64_t d : e.shape) {
      FUZZ_CHECK(d >= 0, "negative dimension");
      numel *= static_cast<uint64_t>(d);
    }
    const int64_t esize = tinkerd::SafetensorsDTypeSize(e.dtype);
    FUZZ_CHECK(esize > 0, "unknown dtype accepted");
    FUZZ_CHECK(e.end - e.begin == numel * static_cast<uint64_t>(esize),
               "byte size != shape x dtype");
  }

  // Round trip.
  const Contents before = Read(file, *h);
  std::vector<tinkerd::SafetensorsOutput> outs;
  for (const auto& [name, c] : before) {
    outs.push_back({name, std::get<0>(c), std::get<1>(c), std::get<2>(c)});
  }
  auto written = tinkerd::SerializeSafetensors(outs, h->metadata);
  FUZZ_CHECK(written.ok(), "accepted tensors could not be written back");
  auto again = tinkerd::ParseSafetensors(*written);
  FUZZ_CHECK(again.ok(), "a written file does not parse");
  FUZZ_CHECK(Read(*written, *again) == before, "tensors changed in the round trip");
  FUZZ_CHECK(again->metadata == h->metadata, "metadata changed in the round trip");
  return 0;
}
