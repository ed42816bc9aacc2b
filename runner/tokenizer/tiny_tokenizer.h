// A small byte-level BPE tokenizer in Hugging Face's layout (tokenizer.json and
// tokenizer_config.json), for the tiny models tests and the demo write: any text encodes (ids 0-255
// are the 256 bytes), merges make multi-byte tokens (" a" ... " z", then "aa", "ab", ...), and the
// last id is the end-of-text token. `transformers.AutoTokenizer` loads it, so a client's
// get_tokenizer() works against a server on such a model. Torch-free.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/status.h"

namespace tinkerd {

// The text (bytes) token `id` stands for, in a tokenizer of `vocab` tokens.
std::string TinyTokenText(int64_t id, int64_t vocab);

// Writes the tokenizer of `vocab` tokens (at least 258) into `dir`, which must exist.
absl::Status WriteTinyTokenizer(const std::string& dir, int64_t vocab);

}  // namespace tinkerd
