// Fuzzes the config.json parser (ParseModelConfig) on arbitrary text.
// Properties, besides no crash and no sanitizer report:
//   - a refusal is INVALID_ARGUMENT with a reason;
//   - an accepted config has the positive, consistent sizes the model code divides by;
//   - writing it back (ModelConfigToJson) and parsing again is a fixed point.
#include <cstddef>
#include <cstdint>

#include "runner/model/config.h"
#include "tests/fuzz/fuzz_check.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* bytes, size_t size) {
  const absl::string_view text(reinterpret_cast<const char*>(bytes), size);
  auto c = tinkerd::ParseModelConfig(text);
  if (!c.ok()) {
    FUZZ_CHECK(c.status().code() == absl::StatusCode::kInvalidArgument, "unexpected error code");
    FUZZ_CHECK(!c.status().message().empty(), "a refusal without a reason");
    return 0;
  }
  FUZZ_CHECK(c->vocab_size > 0 && c->hidden_size > 0 && c->intermediate_size > 0 &&
                 c->num_hidden_layers > 0 && c->head_dim > 0 && c->max_position_embeddings > 0,
             "a non-positive size");
  FUZZ_CHECK(c->num_key_value_heads > 0 && c->num_attention_heads % c->num_key_value_heads == 0,
             "query heads are not a multiple of key/value heads");
  FUZZ_CHECK(c->head_dim % 2 == 0, "RoPE needs an even head_dim");
  const std::string written = tinkerd::ModelConfigToJson(*c);
  auto again = tinkerd::ParseModelConfig(written);
  FUZZ_CHECK(again.ok(), "a written config does not parse");
  FUZZ_CHECK(tinkerd::ModelConfigToJson(*again) == written, "not a fixed point");
  return 0;
}
