// Stops a sample once the text it decodes to contains a stop string (Tinker's SamplingParams.stop
// given as strings). Torch-free.
//
// UTF-8 is self-synchronizing, so the decoded text contains a string exactly when its bytes contain
// the string's bytes, and the match can be made on bytes as tokens arrive. A match that was not
// there before a token must end inside that token's bytes, so each token searches only the bytes
// it added plus the longest stop string's length before them: O(bytes · stops) per sample in all.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "runner/tokenizer/token_texts.h"

namespace tinkerd {

class StopStrings {
 public:
  // Both must outlive the matcher; `stops` are non-empty.
  StopStrings(const TokenTexts* texts, const std::vector<std::string>* stops);

  // Adds the next token of the sample; true once the text so far contains a stop string.
  bool Append(int64_t token);

 private:
  const TokenTexts* texts_;
  const std::vector<std::string>* stops_;
  size_t longest_ = 0;
  bool started_ = false;  // some token decoded to bytes
  std::string tail_;      // the last bytes decoded, at most longest_ - 1 between tokens
};

}  // namespace tinkerd
