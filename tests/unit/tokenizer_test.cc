// runner/tokenizer: what token ids decode to (tokenizer.json and SentencePiece models), and stop
// strings matched on the decoded text as a sample grows. The SentencePiece side is checked
// against libsentencepiece's own decoder (tests/unit/sentencepiece_tool.cc, run as a command) on
// a model it trains in the test; the stop-string matcher against its definition (the shortest
// prefix whose decoded text contains a stop string).
#include <gtest/gtest.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "runner/tokenizer/stop_strings.h"
#include "runner/tokenizer/tiny_tokenizer.h"
#include "runner/tokenizer/token_texts.h"
#include "tests/built_binary.h"

namespace tinkerd {
namespace {

// GPT-2 byte-level tokens: 'Ġ' (U+0120) is the space byte, 'Ċ' (U+010A) the newline, and 'Ã©'
// (U+00C3 U+00A9) the two bytes of 'é'; ids 6 and 7 are added tokens.
constexpr const char* kByteLevelJson = R"({
  "version": "1.0",
  "added_tokens": [{"id": 6, "content": "<|endoftext|>", "special": true},
                   {"id": 7, "content": "<|im_end|>", "special": true}],
  "model": {"type": "BPE", "vocab": {"Hello": 0, "\u0120world": 1, "\u010a": 2, "\u0120": 3,
            "!": 4, "\u00c3\u00a9": 5}, "merges": []},
  "decoder": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true}
})";

// Llama 2 / Mistral 7B's tokenizer.json style: '▁' pieces, <0xNN> byte fallback, and the leading
// space of the sequence stripped after Fuse.
constexpr const char* kSentencePieceStyleJson = R"({
  "added_tokens": [{"id": 0, "content": "<unk>"}, {"id": 1, "content": "<s>"},
                   {"id": 2, "content": "</s>"}],
  "model": {"type": "BPE", "byte_fallback": true, "merges": [],
            "vocab": {"<unk>": 0, "<s>": 1, "</s>": 2, "<0x0A>": 3, "\u2581Hello": 4,
                      "\u2581world": 5, "<0xC3>": 6, "<0xA9>": 7, "!": 8, "lo": 9}},
  "decoder": {"type": "Sequence", "decoders": [
      {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
      {"type": "ByteFallback"}, {"type": "Fuse"},
      {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}
})";

TokenTexts Texts(const char* json) {
  absl::StatusOr<TokenTexts> t = TokenTexts::FromTokenizerJson(json);
  EXPECT_TRUE(t.ok()) << t.status().message();
  return t.ok() ? *std::move(t) : TokenTexts();
}

TEST(TokenTexts, ByteLevelTokensMapBackToTheirBytes) {
  const TokenTexts t = Texts(kByteLevelJson);
  EXPECT_EQ(t.size(), 8);
  EXPECT_EQ(t.Bytes(0), "Hello");
  EXPECT_EQ(t.Bytes(1), " world");
  EXPECT_EQ(t.Bytes(2), "\n");
  EXPECT_EQ(t.Bytes(5), "\xC3\xA9");  // é
  EXPECT_EQ(t.Bytes(6), "<|endoftext|>");
  EXPECT_EQ(t.Bytes(99), "");  // past the tokenizer: a padded embedding row
  EXPECT_EQ(t.Decode({0, 1, 4, 2, 7}), "Hello world!\n<|im_end|>");
  EXPECT_FALSE(t.strips_leading_space());
  EXPECT_EQ(t.description(), "tokenizer.json (BPE, decoder ByteLevel)");
}

TEST(TokenTexts, EveryByteHasOneByteLevelCharacter) {
  // GPT-2's alphabet, derived independently of the implementation: printable bytes are their own
  // character; the rest, in byte order, take U+0100, U+0101, ...
  std::string vocab;
  int next = 256;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || b >= 174;
    const int cp = printable ? b : next++;
    std::string utf8;
    if (cp < 0x80) {
      utf8 = std::string(1, static_cast<char>(cp));
    } else {
      utf8 = {static_cast<char>(0xC0 | (cp >> 6)), static_cast<char>(0x80 | (cp & 0x3F))};
    }
    nlohmann::json key = utf8;
    vocab += (b ? "," : "") + key.dump() + ":" + std::to_string(b);
  }
  const std::string json = R"({"model": {"type": "BPE", "vocab": {)" + vocab +
                           R"(}, "merges": []}, "decoder": {"type": "ByteLevel"}})";
  absl::StatusOr<TokenTexts> t = TokenTexts::FromTokenizerJson(json);
  ASSERT_TRUE(t.ok()) << t.status().message();
  for (int b = 0; b < 256; ++b) {
    EXPECT_EQ(t->Bytes(b), std::string(1, static_cast<char>(b))) << "byte " << b;
  }
  EXPECT_EQ(next, 256 + 68);  // 68 bytes are not printable
}

TEST(TokenTexts, SentencePieceStyleJsonDecodesAsItsDecoderSays) {
  const TokenTexts t = Texts(kSentencePieceStyleJson);
  EXPECT_EQ(t.Bytes(4), " Hello");
  EXPECT_EQ(t.Bytes(3), "\n");
  EXPECT_EQ(t.Bytes(6) + t.Bytes(7), "\xC3\xA9");
  EXPECT_TRUE(t.strips_leading_space());
  EXPECT_EQ(t.Decode({4, 5, 8, 3}), "Hello world!\n");
  EXPECT_EQ(t.Decode({1, 4}), "<s> Hello");  // only the sequence's first character is stripped
  const TokenTexts metaspace = Texts(R"({"model": {"type": "Unigram",
      "vocab": [["<unk>", 0], ["\u2581Hi", -1.0], ["\u2581there", -2.0]]},
      "decoder": {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "always"}})");
  EXPECT_EQ(metaspace.Decode({1, 2}), "Hi there");
  EXPECT_TRUE(metaspace.strips_leading_space());
}

TEST(TokenTexts, WhatIsNotReadIsRefusedByName) {
  struct Case {
    const char* json;
    const char* expect;
  };
  const Case cases[] = {
      {"not json", "not a JSON object"},
      {R"({"decoder": null})", "model"},
      {R"({"model": {"type": "WordPiece", "vocab": {"a": 0}}, "decoder": null})", "WordPiece"},
      {R"({"model": {"type": "BPE", "vocab": {"a": 0}}, "decoder": {"type": "WordPiece"}})",
       "WordPiece"},
      {R"({"model": {"type": "BPE", "vocab": {"a": 0}}, "decoder": {"type": "Sequence",
          "decoders": [{"type": "Replace", "pattern": {"Regex": " +"}, "content": " "}]}})",
       "Replace"},
      {R"({"model": {"type": "BPE", "vocab": {"a": 0}}, "decoder": {"type": "Strip",
          "content": " ", "start": 1, "stop": 0}})",
       "Strip"},
      {R"({"model": {"type": "BPE", "vocab": {"a": -4}}})", "out of range"},
  };
  for (const Case& c : cases) {
    absl::StatusOr<TokenTexts> t = TokenTexts::FromTokenizerJson(c.json);
    EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument) << c.json;
    EXPECT_NE(t.status().message().find(c.expect), absl::string_view::npos)
        << c.json << " -> " << t.status().message();
  }
}

// Runs the sentencepiece_tool command; its standard output, or nullopt when it failed.
std::optional<std::string> SentencePieceTool(const std::string& args) {
  FILE* pipe =
      ::popen((testing::BuiltBinary(TINKERD_SENTENCEPIECE_TOOL) + " " + args).c_str(), "r");
  if (pipe == nullptr) return std::nullopt;
  std::string out;
  char buf[4096];
  size_t n = 0;
  while ((n = std::fread(buf, 1, sizeof buf, pipe)) > 0) out.append(buf, n);
  if (::pclose(pipe) != 0) return std::nullopt;
  return out;
}

// libsentencepiece's decoding of `ids`: the tool prints it hex-encoded.
std::string DecodeWithSentencePiece(const std::string& model, const std::vector<int64_t>& ids) {
  std::string args = "decode " + model;
  for (int64_t id : ids) args += " " + std::to_string(id);
  const std::optional<std::string> hex = SentencePieceTool(args);
  if (!hex) return "<sentencepiece_tool failed>";
  std::string out;
  for (size_t i = 0; i + 1 < hex->size(); i += 2) {
    out.push_back(static_cast<char>(std::stoi(hex->substr(i, 2), nullptr, 16)));
  }
  return out;
}

std::filesystem::path TempDir(const std::string& tag) {
  const auto dir = std::filesystem::temp_directory_path() /
                   ("tinkerd-tokenizer-" + tag + "-" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

TEST(TokenTexts, LoadPrefersTokenizerJsonAndSaysWhenThereIsNone) {
  const auto dir = TempDir("load");
  EXPECT_EQ(TokenTexts::Load(dir.string()).status().code(), absl::StatusCode::kNotFound);
  std::ofstream(dir / "tokenizer.json") << kByteLevelJson;
  std::ofstream(dir / "tokenizer.model") << "not a sentencepiece model";
  absl::StatusOr<TokenTexts> t = TokenTexts::Load(dir.string());
  ASSERT_TRUE(t.ok()) << t.status().message();
  EXPECT_EQ(t->Bytes(1), " world");
  std::filesystem::remove(dir / "tokenizer.json");
  EXPECT_EQ(TokenTexts::Load(dir.string()).status().code(), absl::StatusCode::kInvalidArgument);
  std::filesystem::remove_all(dir);
}

// The tokenizer tiny models are written with: what it says each id is, its tokenizer.json says.
TEST(TinyTokenizer, TokenTextsReadsWhatItWrote) {
  const auto dir = TempDir("tiny");
  EXPECT_EQ(WriteTinyTokenizer(dir.string(), 100).code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(WriteTinyTokenizer(dir.string(), 512).ok());
  absl::StatusOr<TokenTexts> t = TokenTexts::Load(dir.string());
  ASSERT_TRUE(t.ok()) << t.status().message();
  ASSERT_EQ(t->size(), 512);
  for (int64_t id = 0; id < 512; ++id) ASSERT_EQ(t->Bytes(id), TinyTokenText(id, 512)) << id;
  EXPECT_EQ(t->Bytes(256), " a");
  EXPECT_EQ(t->Bytes(256 + 26), "aa");
  EXPECT_EQ(t->Bytes(511), "<|endoftext|>");
  EXPECT_TRUE(std::filesystem::exists(dir / "tokenizer_config.json"));
  std::filesystem::remove_all(dir);
}

// A SentencePiece model trained here: tinkerd's concatenation of piece bytes must decode every
// sequence of normal pieces as libsentencepiece does, and byte pieces to their bytes.
TEST(TokenTexts, SentencePieceDecodesAsLibsentencepiece) {
  const auto dir = TempDir("spm");
  {
    std::ofstream text(dir / "corpus.txt");
    for (int i = 0; i < 40; ++i) {
      text << "The quick brown fox jumps over the lazy dog number " << i << ".\n"
           << "User: what is " << i << " plus " << i * 7 << "? Assistant: it is " << i * 8
           << ", café.\n";
    }
  }
  const std::string prefix = (dir / "sp").string();
  ASSERT_TRUE(SentencePieceTool("train " + (dir / "corpus.txt").string() + " " + prefix + " 400"))
      << "training a SentencePiece model failed";
  const std::string model = prefix + ".model";
  absl::StatusOr<TokenTexts> t = TokenTexts::FromSentencePiece(model);
  ASSERT_TRUE(t.ok()) << t.status().message();
  ASSERT_EQ(t->size(), 400);
  EXPECT_TRUE(t->strips_leading_space());  // SentencePiece's default add_dummy_prefix
  // With byte fallback, ids 3..258 are the bytes 0x00..0xFF, after <unk>, <s> and </s>.
  for (int b = 0; b < 256; ++b) ASSERT_EQ(t->Bytes(3 + b), std::string(1, static_cast<char>(b)));
  std::mt19937 rng(7);
  std::uniform_int_distribution<int> normal(259, 399), length(1, 12);
  // One tool run per sequence: 60 random ones, some long.
  for (int trial = 0; trial < 60; ++trial) {
    std::vector<int64_t> ids(static_cast<size_t>(length(rng) * (trial % 4 == 0 ? 8 : 1)));
    for (int64_t& id : ids) id = normal(rng);
    ASSERT_EQ(t->Decode(ids), DecodeWithSentencePiece(model, ids)) << "trial " << trial;
  }
  // Bytes that form 'é' decode to it, as libsentencepiece decodes them.
  EXPECT_EQ(t->Decode({3 + 0xC3, 3 + 0xA9}), DecodeWithSentencePiece(model, {3 + 0xC3, 3 + 0xA9}));
  EXPECT_EQ(t->Decode({3 + 0xC3, 3 + 0xA9}), "\xC3\xA9");
  // A truncated file is refused, wherever it was cut, never read past its end.
  std::ifstream in(model, std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  int refused = 0;
  for (size_t cut = 1; cut < bytes.size(); cut += 1 + bytes.size() / 97) {
    std::ofstream(dir / "cut.model", std::ios::binary) << bytes.substr(0, cut);
    const auto r = TokenTexts::FromSentencePiece((dir / "cut.model").string());
    EXPECT_TRUE(r.ok() || r.status().code() == absl::StatusCode::kInvalidArgument);
    refused += !r.ok();
  }
  EXPECT_GT(refused, 50);
  std::filesystem::remove_all(dir);
}

// The index of the token at which `ids` first decodes to text containing a stop string, by the
// definition: the shortest prefix whose Decode contains one. -1 when none does.
int64_t FirstStopByDefinition(const TokenTexts& t, const std::vector<int64_t>& ids,
                              const std::vector<std::string>& stops) {
  for (size_t k = 1; k <= ids.size(); ++k) {
    const std::string text = t.Decode(std::vector<int64_t>(ids.begin(), ids.begin() + k));
    for (const std::string& s : stops) {
      if (text.find(s) != std::string::npos) return static_cast<int64_t>(k) - 1;
    }
  }
  return -1;
}

int64_t FirstStop(const TokenTexts& t, const std::vector<int64_t>& ids,
                  const std::vector<std::string>& stops) {
  StopStrings m(&t, &stops);
  for (size_t k = 0; k < ids.size(); ++k) {
    if (m.Append(ids[k])) return static_cast<int64_t>(k);
  }
  return -1;
}

TEST(StopStrings, MatchesAcrossTokensAndInsideMultiByteCharacters) {
  const TokenTexts bl = Texts(kByteLevelJson);
  // "lo wo" spans "Hello" and " world": neither token holds it alone.
  ASSERT_EQ(bl.Bytes(0).find("lo wo"), std::string::npos);
  ASSERT_EQ(bl.Bytes(1).find("lo wo"), std::string::npos);
  EXPECT_EQ(FirstStop(bl, {0, 1, 4}, {"lo wo"}), 1);
  EXPECT_EQ(FirstStop(bl, {0, 1, 4}, {"orl"}), 1);            // inside one token
  EXPECT_EQ(FirstStop(bl, {0, 1, 4, 2}, {"xyz", "!\n"}), 3);  // the second of two stops
  EXPECT_EQ(FirstStop(bl, {0, 1, 4}, {"xyz"}), -1);
  EXPECT_EQ(FirstStop(bl, {3, 1}, {"  world"}), 1);  // no leading space is stripped here
  EXPECT_EQ(FirstStop(bl, {0, 6, 1}, {"<|endoftext|> w"}), 2);
  const TokenTexts sp = Texts(kSentencePieceStyleJson);
  // 'é' arrives as two byte pieces: only the second completes it.
  EXPECT_EQ(FirstStop(sp, {4, 6, 7}, {"\xC3\xA9"}), 2);
  // The decoder strips the first piece's space: " Hello" is not in "Hello world".
  EXPECT_EQ(FirstStop(sp, {4, 5}, {" Hello"}), -1);
  EXPECT_EQ(FirstStop(sp, {4, 5}, {"Hello w"}), 1);
  EXPECT_EQ(FirstStop(sp, {4, 4}, {" Hello"}), 1);  // the second " Hello" keeps its space
  // A first token that decodes to nothing does not move the stripped space to the second
  // (found by tests/fuzz/fuzz_tokenizer).
  const TokenTexts empty_first = Texts(R"({"added_tokens": [{"id": 2, "content": ""}],
      "model": {"type": "BPE", "merges": [], "vocab": {"<unk>": 0, "\u2581Hello": 1}},
      "decoder": {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "first"}})");
  EXPECT_EQ(empty_first.Decode({2, 1}), "Hello");
  EXPECT_EQ(FirstStop(empty_first, {2, 1, 1}, {" Hello"}), 2);
  EXPECT_EQ(FirstStop(empty_first, {2, 1}, {"Hello"}), 1);
}

// Random samples and stop strings cut from their own text (so most match, often across tokens,
// late in long samples): the matcher, which keeps only a bounded tail, agrees with the definition.
TEST(StopStrings, AgreesWithTheDefinitionOnRandomSamples) {
  for (const char* json : {kByteLevelJson, kSentencePieceStyleJson}) {
    const TokenTexts t = Texts(json);
    std::mt19937 rng(11);
    std::uniform_int_distribution<int64_t> id(0, t.size() - 1);
    int matched = 0, across = 0;
    for (int trial = 0; trial < 400; ++trial) {
      std::vector<int64_t> ids(static_cast<size_t>(1 + rng() % 200));
      for (int64_t& x : ids) x = id(rng);
      const std::string text = t.Decode(ids);
      std::vector<std::string> stops;
      for (int k = 0; k < 3; ++k) {
        if (text.empty()) break;
        const size_t at = rng() % text.size(), len = 1 + rng() % 12;
        stops.push_back(text.substr(at, len));
      }
      if (trial % 5 == 0) stops.push_back("never \x01 here");
      if (stops.empty()) continue;
      const int64_t want = FirstStopByDefinition(t, ids, stops);
      ASSERT_EQ(FirstStop(t, ids, stops), want) << "trial " << trial;
      if (want >= 0) {
        ++matched;
        bool inside_one = false;
        for (const std::string& s : stops) {
          inside_one =
              inside_one || t.Bytes(ids[static_cast<size_t>(want)]).find(s) != std::string::npos;
        }
        across += !inside_one;
      }
    }
    EXPECT_GT(matched, 300);
    EXPECT_GT(across, 100) << "the trials must exercise matches across token boundaries";
  }
}

}  // namespace
}  // namespace tinkerd
