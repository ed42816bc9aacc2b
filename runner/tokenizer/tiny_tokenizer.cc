#include "runner/tokenizer/tiny_tokenizer.h"

#include <nlohmann/json.hpp>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "runner/model/safetensors.h"

namespace tinkerd {
namespace {

using json = nlohmann::json;

constexpr std::string_view kEndOfText = "<|endoftext|>";

// GPT-2's byte-level character of byte b, as UTF-8.
std::string ByteChar(int b) {
  static const std::vector<std::string>* chars = [] {
    auto* v = new std::vector<std::string>(256);
    int next = 256;
    for (int c = 0; c < 256; ++c) {
      const bool printable = (c >= 33 && c <= 126) || (c >= 161 && c <= 172) || c >= 174;
      const int cp = printable ? c : next++;
      (*v)[c] = cp < 0x80 ? std::string(1, static_cast<char>(cp))
                          : std::string{static_cast<char>(0xC0 | (cp >> 6)),
                                        static_cast<char>(0x80 | (cp & 0x3F))};
    }
    return v;
  }();
  return (*chars)[b];
}

// The merged tokens after the 256 bytes, as (left, right) texts: " a".." z", then "aa", "ab", ...
std::pair<std::string, std::string> Merge(int64_t j) {
  if (j < 26) return {" ", std::string(1, static_cast<char>('a' + j))};
  j -= 26;
  return {std::string(1, static_cast<char>('a' + (j / 26) % 26)),
          std::string(1, static_cast<char>('a' + j % 26))};
}

std::string Encoded(const std::string& text) {
  std::string out;
  for (unsigned char c : text) out += ByteChar(c);
  return out;
}

}  // namespace

std::string TinyTokenText(int64_t id, int64_t vocab) {
  if (id < 0 || id >= vocab) return "";
  if (id == vocab - 1) return std::string(kEndOfText);
  if (id < 256) return std::string(1, static_cast<char>(id));
  auto [left, right] = Merge(id - 256);
  return left + right;
}

absl::Status WriteTinyTokenizer(const std::string& dir, int64_t vocab) {
  if (vocab < 258 || vocab > 256 + 26 + 26 * 26 + 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("a tiny tokenizer has 258 to 959 tokens, not ", vocab));
  }
  json vocab_map = json::object();
  json merges = json::array();
  for (int64_t id = 0; id + 1 < vocab; ++id) {
    vocab_map[Encoded(TinyTokenText(id, vocab))] = id;
    if (id >= 256) {
      auto [left, right] = Merge(id - 256);
      merges.push_back(Encoded(left) + " " + Encoded(right));
    }
  }
  const json added = {{"id", vocab - 1}, {"content", kEndOfText}, {"single_word", false},
                      {"lstrip", false}, {"rstrip", false},       {"normalized", false},
                      {"special", true}};
  const json byte_level = {{"type", "ByteLevel"},
                           {"add_prefix_space", false},
                           {"trim_offsets", true},
                           {"use_regex", true}};
  const json tokenizer = {{"version", "1.0"},
                          {"truncation", nullptr},
                          {"padding", nullptr},
                          {"added_tokens", json::array({added})},
                          {"normalizer", nullptr},
                          {"pre_tokenizer", byte_level},
                          {"post_processor", nullptr},
                          {"decoder", byte_level},
                          {"model",
                           {{"type", "BPE"},
                            {"dropout", nullptr},
                            {"unk_token", nullptr},
                            {"continuing_subword_prefix", nullptr},
                            {"end_of_word_suffix", nullptr},
                            {"fuse_unk", false},
                            {"byte_fallback", false},
                            {"vocab", vocab_map},
                            {"merges", merges}}}};
  const json config = {{"tokenizer_class", "PreTrainedTokenizerFast"},
                       {"eos_token", kEndOfText},
                       {"clean_up_tokenization_spaces", false},
                       {"model_max_length", 1 << 20}};
  if (auto st = WriteFileAtomically(dir + "/tokenizer.json", tokenizer.dump()); !st.ok()) {
    return st;
  }
  return WriteFileAtomically(dir + "/tokenizer_config.json", config.dump(2));
}

}  // namespace tinkerd
