// Fuzzes the tokenizer readers (runner/tokenizer: tokenizer.json and tokenizer.model) and the
// stop-string matcher. The first byte picks the reader ('m': a SentencePiece model, else JSON).
// Properties, besides no crash and no sanitizer report:
//   - a refusal is INVALID_ARGUMENT with a reason;
//   - on an accepted table, the matcher stops where the definition says (the shortest prefix of a
//     sample whose decoded text contains a stop string), for a sample and stops cut from the input.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "runner/tokenizer/stop_strings.h"
#include "runner/tokenizer/token_texts.h"
#include "tests/fuzz/fuzz_check.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* bytes, size_t size) {
  if (size == 0) return 0;
  const std::string_view rest(reinterpret_cast<const char*>(bytes) + 1, size - 1);
  absl::StatusOr<tinkerd::TokenTexts> t = bytes[0] == 'm'
                                              ? tinkerd::TokenTexts::FromSentencePieceBytes(rest)
                                              : tinkerd::TokenTexts::FromTokenizerJson(rest);
  if (!t.ok()) {
    FUZZ_CHECK(t.status().code() == absl::StatusCode::kInvalidArgument, "unexpected error code");
    FUZZ_CHECK(!t.status().message().empty(), "a refusal without a reason");
    return 0;
  }
  if (t->size() == 0) return 0;
  // A sample of up to 32 ids drawn from the input's bytes, and two stops cut from its text.
  std::vector<int64_t> ids;
  for (size_t i = 1; i < size && ids.size() < 32; i += 3) ids.push_back(bytes[i] % t->size());
  const std::string text = t->Decode(ids);
  std::vector<std::string> stops;
  if (!text.empty()) {
    stops.push_back(text.substr(size % text.size(), 1 + size % 7));
    stops.push_back(text.substr(text.size() / 2, 3));
  }
  stops.push_back("\x01never\x02");
  tinkerd::StopStrings matcher(&*t, &stops);
  int64_t got = -1;
  for (size_t k = 0; k < ids.size() && got < 0; ++k) {
    if (matcher.Append(ids[k])) got = static_cast<int64_t>(k);
  }
  int64_t want = -1;
  for (size_t k = 1; k <= ids.size() && want < 0; ++k) {
    const std::string prefix = t->Decode(std::vector<int64_t>(ids.begin(), ids.begin() + k));
    for (const std::string& s : stops) {
      if (prefix.find(s) != std::string::npos) want = static_cast<int64_t>(k) - 1;
    }
  }
  FUZZ_CHECK(got == want, "the matcher disagrees with the definition");
  return 0;
}
