#include "runner/tokenizer/stop_strings.h"

#include <algorithm>

namespace tinkerd {

StopStrings::StopStrings(const TokenTexts* texts, const std::vector<std::string>* stops)
    : texts_(texts), stops_(stops) {
  for (const std::string& s : *stops_) longest_ = std::max(longest_, s.size());
}

bool StopStrings::Append(int64_t token) {
  const std::string& bytes = texts_->Bytes(token);
  const size_t kept = tail_.size();
  tail_ += bytes;
  // The decoder drops the text's leading space (SentencePiece's dummy prefix), wherever the first
  // byte came from: tokens before it may decode to nothing.
  if (!started_ && !tail_.empty()) {
    started_ = true;
    if (texts_->strips_leading_space() && tail_[0] == ' ') tail_.erase(0, 1);
  }
  const size_t added = tail_.size() - std::min(kept, tail_.size());
  for (const std::string& s : *stops_) {
    // A new match ends within the added bytes: it starts no earlier than this.
    const size_t from = tail_.size() >= added + s.size() ? tail_.size() - added - s.size() + 1 : 0;
    if (tail_.find(s, from) != std::string::npos) return true;
  }
  if (tail_.size() >= longest_) tail_.erase(0, tail_.size() - (longest_ - 1));
  return false;
}

}  // namespace tinkerd
