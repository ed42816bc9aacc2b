// Fuzzes the checkpoint manifest parser (ParseTrainingManifest) on arbitrary text.
// Properties, besides no crash and no sanitizer report:
//   - a refusal is DATA_LOSS, INVALID_ARGUMENT or FAILED_PRECONDITION, with a reason;
//   - an accepted manifest has non-negative counters, a positive LoRA rank, a known dtype and
//     plain file names;
//   - writing it back (TrainingManifestToJson) and parsing again is a fixed point.
#include <cstddef>
#include <cstdint>

#include "runner/checkpoint/manifest.h"
#include "tests/fuzz/fuzz_check.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* bytes, size_t size) {
  const absl::string_view text(reinterpret_cast<const char*>(bytes), size);
  auto m = tinkerd::ParseTrainingManifest(text);
  if (!m.ok()) {
    const absl::StatusCode c = m.status().code();
    FUZZ_CHECK(c == absl::StatusCode::kDataLoss || c == absl::StatusCode::kInvalidArgument ||
                   c == absl::StatusCode::kFailedPrecondition,
               "unexpected error code");
    FUZZ_CHECK(!m.status().message().empty(), "a refusal without a reason");
    return 0;
  }
  FUZZ_CHECK(m->step >= 0 && m->skipped_steps >= 0 && m->last_seq_id >= 0, "negative counter");
  FUZZ_CHECK(!m->options.lora || m->options.lora->rank > 0, "non-positive LoRA rank");
  FUZZ_CHECK(m->training_dtype == "float32" || m->training_dtype == "float64", "unknown dtype");
  for (const auto& [name, digest] : m->files) {
    FUZZ_CHECK(!name.empty() && name.find('/') == std::string::npos && name != "..",
               "a file name that is a path");
  }
  const std::string written = tinkerd::TrainingManifestToJson(*m);
  auto again = tinkerd::ParseTrainingManifest(written);
  FUZZ_CHECK(again.ok(), "a written manifest does not parse");
  FUZZ_CHECK(tinkerd::TrainingManifestToJson(*again) == written, "not a fixed point");
  return 0;
}
