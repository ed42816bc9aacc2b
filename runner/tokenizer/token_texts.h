// What each token id of a model's tokenizer decodes to, as bytes: the one part of a tokenizer the
// server needs, to match stop strings against the text a sample decodes to (Tinker stops a sample
// once its decoded text contains a stop string). Torch-free.
//
// Decoding a sequence of ids is the concatenation of their bytes, for the decoders read here:
// byte-level BPE (Llama 3, Qwen, Mistral's newer checkpoints) maps every character of a token
// back to a byte; SentencePiece-style pieces (Llama 2, Mistral 7B, Gemma) turn '▁' into a space
// and <0xNN> pieces into the byte NN. The one exception is the leading space such a decoder
// strips from a sequence's first piece (`strips_leading_space`). Hugging Face's optional
// "clean-up of tokenization spaces" is not applied: stop strings match the raw decoded text.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace tinkerd {

class TokenTexts {
 public:
  // From a model directory: tokenizer.json if present, else tokenizer.model (SentencePiece).
  // NOT_FOUND when it has neither; INVALID_ARGUMENT naming what is not supported (a WordPiece
  // decoder, say), so the caller can say why stop strings are refused.
  static absl::StatusOr<TokenTexts> Load(const std::string& model_dir);
  // Hugging Face `tokenizers` JSON: a BPE, Unigram or WordLevel model, its added tokens, and a
  // ByteLevel, Metaspace or Sequence(Replace, ByteFallback, Fuse, Strip) decoder.
  static absl::StatusOr<TokenTexts> FromTokenizerJson(std::string_view json_text);
  // A SentencePiece model file (tokenizer.model): runner/tokenizer/sentencepiece_pieces.h.
  static absl::StatusOr<TokenTexts> FromSentencePiece(const std::string& path);
  // The same from the file's bytes.
  static absl::StatusOr<TokenTexts> FromSentencePieceBytes(std::string_view bytes);

  // The bytes of token `id`; empty for an id the tokenizer does not define (a model's embedding
  // table is often padded past its tokenizer's vocabulary).
  const std::string& Bytes(int64_t id) const;
  // The text of `ids` as a sequence, the leading space stripped where the decoder strips it.
  std::string Decode(const std::vector<int64_t>& ids) const;
  int64_t size() const { return static_cast<int64_t>(bytes_.size()); }
  bool strips_leading_space() const { return strips_leading_space_; }
  // What was read, for logs and get_info: "tokenizer.json (BPE, ByteLevel)".
  const std::string& description() const { return description_; }

 private:
  std::vector<std::string> bytes_;  // by id
  bool strips_leading_space_ = false;
  std::string description_;
};

}  // namespace tinkerd
