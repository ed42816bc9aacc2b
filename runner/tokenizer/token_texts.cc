#include "runner/tokenizer/token_texts.h"

#include <array>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <unordered_map>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "runner/tokenizer/sentencepiece_pieces.h"

namespace tinkerd {
namespace {

using json = nlohmann::json;

absl::Status Unsupported(absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("tokenizer.json: ", what));
}

// GPT-2's byte-level alphabet: printable bytes stand for themselves, the other 68 for the code
// points 256, 257, ... in byte order. The inverse maps a code point back to its byte, or -1.
const std::unordered_map<uint32_t, uint8_t>& ByteLevelInverse() {
  static const auto* inverse = [] {
    auto* m = new std::unordered_map<uint32_t, uint8_t>;
    uint32_t next = 256;
    for (uint32_t b = 0; b < 256; ++b) {
      const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || b >= 174;
      (*m)[printable ? b : next++] = static_cast<uint8_t>(b);
    }
    return m;
  }();
  return *inverse;
}

// Decodes one UTF-8 code point at s[i], advancing i; malformed bytes come back as themselves.
uint32_t NextCodePoint(const std::string& s, size_t& i, size_t* length) {
  const auto c = static_cast<uint8_t>(s[i]);
  const size_t n = c < 0x80           ? 1
                   : (c >> 5) == 0x6  ? 2
                   : (c >> 4) == 0xE  ? 3
                   : (c >> 3) == 0x1E ? 4
                                      : 1;
  if (i + n > s.size()) {
    *length = 1;
    return c;
  }
  uint32_t cp = n == 1 ? c : c & (0xFF >> (n + 1));
  for (size_t k = 1; k < n; ++k) cp = (cp << 6) | (static_cast<uint8_t>(s[i + k]) & 0x3F);
  *length = n;
  return cp;
}

// A token's characters mapped back to bytes; a character outside the alphabet (an added token's
// text) stands for its own UTF-8 bytes, as Hugging Face's ByteLevel decoder treats it.
std::string ByteLevelDecode(const std::string& token) {
  const auto& inverse = ByteLevelInverse();
  std::string out;
  for (size_t i = 0; i < token.size();) {
    size_t n = 0;
    const uint32_t cp = NextCodePoint(token, i, &n);
    auto it = inverse.find(cp);
    if (it != inverse.end()) {
      out.push_back(static_cast<char>(it->second));
    } else {
      out.append(token, i, n);
    }
    i += n;
  }
  return out;
}

// "<0x0A>" → the byte 0x0A; anything else unchanged.
std::string ByteFallbackDecode(const std::string& token) {
  if (token.size() == 6 && token.rfind("<0x", 0) == 0 && token[5] == '>') {
    auto hex = [](char c) {
      return c >= '0' && c <= '9' ? c - '0' : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
    };
    const int hi = hex(token[3]), lo = hex(token[4]);
    if (hi >= 0 && lo >= 0) return std::string(1, static_cast<char>(hi * 16 + lo));
  }
  return token;
}

constexpr const char* kMetaspace = "\xE2\x96\x81";  // '▁'

// What one decoder step does to each token, and whether it strips the sequence's first space.
struct DecoderPlan {
  std::vector<std::function<std::string(const std::string&)>> per_token;
  bool strips_leading_space = false;
  std::vector<std::string> names;
};

// An integer field, or `fallback` when absent; nullopt for anything but an int64 (nlohmann's
// value() would convert a float, and a float beyond int64's range is undefined behaviour).
std::optional<int64_t> IntOr(const json& d, const char* key, int64_t fallback) {
  auto it = d.find(key);
  if (it == d.end()) return fallback;
  if (!it->is_number_integer() ||
      (it->is_number_unsigned() &&
       it->get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))) {
    return std::nullopt;
  }
  return it->get<int64_t>();
}

absl::Status PlanStep(const json& d, bool fused, DecoderPlan* plan) {
  if (!d.is_object() || !d.contains("type") || !d["type"].is_string()) {
    return Unsupported("a decoder without a type");
  }
  const std::string type = d["type"].get<std::string>();
  plan->names.push_back(type);
  if (type == "ByteLevel") {
    plan->per_token.push_back(ByteLevelDecode);
  } else if (type == "ByteFallback") {
    plan->per_token.push_back(ByteFallbackDecode);
  } else if (type == "Fuse") {
    // Joins the tokens; the bytes are the same, but a later Strip acts on the whole sequence.
  } else if (type == "Metaspace") {
    const std::string repl = d.value("replacement", std::string(kMetaspace));
    plan->per_token.push_back([repl](const std::string& t) {
      return absl::StrReplaceAll(t, {{repl, " "}});
    });
    const std::string scheme = d.value("prepend_scheme", std::string("always"));
    plan->strips_leading_space = d.value("add_prefix_space", true) && scheme != "never";
  } else if (type == "Replace") {
    if (!d.contains("pattern") || !d["pattern"].contains("String") ||
        !d["pattern"]["String"].is_string() || !d.contains("content") ||
        !d["content"].is_string()) {
      return Unsupported("a Replace decoder needs a String pattern (regex patterns are not read)");
    }
    const std::string from = d["pattern"]["String"].get<std::string>();
    const std::string to = d["content"].get<std::string>();
    plan->per_token.push_back([from, to](const std::string& t) {
      return absl::StrReplaceAll(t, {{from, to}});
    });
  } else if (type == "Strip") {
    const std::string content = d.value("content", std::string(" "));
    const std::optional<int64_t> start = IntOr(d, "start", 0), stop = IntOr(d, "stop", 0);
    if (!start || !stop) return Unsupported("a Strip decoder's start and stop must be integers");
    if (!fused || content != " " || *start > 1 || *stop != 0) {
      return Unsupported("only a Strip of one leading space after Fuse is read");
    }
    plan->strips_leading_space = *start == 1;
  } else {
    return Unsupported(absl::StrCat("decoder '", type,
                                    "' is not read (supported: ByteLevel, Metaspace, Sequence of "
                                    "Replace, ByteFallback, Fuse, Strip)"));
  }
  return absl::OkStatus();
}

absl::StatusOr<DecoderPlan> PlanDecoder(const json& decoder) {
  DecoderPlan plan;
  if (decoder.is_null()) return plan;
  if (decoder.value("type", std::string()) == "Sequence") {
    if (!decoder.contains("decoders") || !decoder["decoders"].is_array()) {
      return Unsupported("a Sequence decoder needs a 'decoders' list");
    }
    bool fused = false;
    for (const json& d : decoder["decoders"]) {
      if (auto st = PlanStep(d, fused, &plan); !st.ok()) return st;
      fused = fused || d.value("type", std::string()) == "Fuse";
    }
    return plan;
  }
  if (auto st = PlanStep(decoder, false, &plan); !st.ok()) return st;
  return plan;
}

// The tokens by id: the model's vocabulary, then the added tokens over it.
absl::StatusOr<std::vector<std::string>> TokensById(const json& j) {
  if (!j.contains("model") || !j["model"].is_object()) return Unsupported("no 'model'");
  const json& model = j["model"];
  const std::string type = model.value("type", std::string("BPE"));
  std::vector<std::string> tokens;
  auto put = [&](int64_t id, std::string text) -> absl::Status {
    if (id < 0 || id >= (int64_t{1} << 21)) {  // the largest vocabularies have ~256k
      return Unsupported(absl::StrCat("token id ", id, " is out of range"));
    }
    if (static_cast<size_t>(id) >= tokens.size()) tokens.resize(static_cast<size_t>(id) + 1);
    tokens[static_cast<size_t>(id)] = std::move(text);
    return absl::OkStatus();
  };
  if (!model.contains("vocab")) return Unsupported("the model has no 'vocab'");
  const json& vocab = model["vocab"];
  if (type == "BPE" || type == "WordLevel") {
    if (!vocab.is_object()) return Unsupported("a BPE vocab must be an object");
    for (const auto& [text, id] : vocab.items()) {
      if (!id.is_number_integer()) return Unsupported("vocab ids must be integers");
      if (auto st = put(id.get<int64_t>(), text); !st.ok()) return st;
    }
  } else if (type == "Unigram") {
    if (!vocab.is_array()) return Unsupported("a Unigram vocab must be a list");
    for (size_t id = 0; id < vocab.size(); ++id) {
      if (!vocab[id].is_array() || vocab[id].empty() || !vocab[id][0].is_string()) {
        return Unsupported("Unigram vocab entries must be [piece, score]");
      }
      if (auto st = put(static_cast<int64_t>(id), vocab[id][0].get<std::string>()); !st.ok()) {
        return st;
      }
    }
  } else {
    return Unsupported(
        absl::StrCat("model type '", type, "' is not read (BPE, Unigram, WordLevel)"));
  }
  if (j.contains("added_tokens") && j["added_tokens"].is_array()) {
    for (const json& t : j["added_tokens"]) {
      if (!t.is_object() || !t.contains("id") || !t["id"].is_number_integer() ||
          !t.contains("content") || !t["content"].is_string()) {
        return Unsupported("added_tokens entries need an integer 'id' and a string 'content'");
      }
      if (auto st = put(t["id"].get<int64_t>(), t["content"].get<std::string>()); !st.ok()) {
        return st;
      }
    }
  }
  return tokens;
}

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": cannot be read"));
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

}  // namespace

absl::StatusOr<TokenTexts> TokenTexts::FromTokenizerJson(std::string_view json_text) {
  const json j = json::parse(json_text.begin(), json_text.end(), nullptr, false);
  if (j.is_discarded() || !j.is_object()) return Unsupported("not a JSON object");
  try {
    absl::StatusOr<std::vector<std::string>> tokens = TokensById(j);
    if (!tokens.ok()) return tokens.status();
    absl::StatusOr<DecoderPlan> plan = PlanDecoder(j.contains("decoder") ? j["decoder"] : json());
    if (!plan.ok()) return plan.status();
    TokenTexts t;
    t.bytes_.reserve(tokens->size());
    for (std::string& token : *tokens) {
      for (const auto& step : plan->per_token) token = step(token);
      t.bytes_.push_back(std::move(token));
    }
    t.strips_leading_space_ = plan->strips_leading_space;
    t.description_ =
        absl::StrCat("tokenizer.json (", j["model"].value("type", "BPE"), ", decoder ",
                     plan->names.empty() ? "none" : absl::StrJoin(plan->names, "+"), ")");
    return t;
  } catch (const std::exception& e) {  // a value of the wrong JSON type
    return Unsupported(e.what());
  }
}

absl::StatusOr<TokenTexts> TokenTexts::FromSentencePiece(const std::string& path) {
  absl::StatusOr<std::string> bytes = ReadFile(path);
  if (!bytes.ok()) return bytes.status();
  return FromSentencePieceBytes(*bytes);
}

absl::StatusOr<TokenTexts> TokenTexts::FromSentencePieceBytes(std::string_view bytes) {
  absl::StatusOr<SentencePieceModel> model = ParseSentencePieceModel(bytes);
  if (!model.ok()) return model.status();
  TokenTexts t;
  for (const SentencePiecePiece& p : model->pieces) {
    // Control and unknown pieces read as their own text, as Hugging Face's decode (without
    // skip_special_tokens) writes them; unused ones as nothing.
    switch (p.kind) {
      case SentencePiecePiece::Kind::kByte:
        t.bytes_.push_back(ByteFallbackDecode(p.text));
        break;
      case SentencePiecePiece::Kind::kUnused:
        t.bytes_.emplace_back();
        break;
      default:
        t.bytes_.push_back(absl::StrReplaceAll(p.text, {{kMetaspace, " "}}));
    }
  }
  t.strips_leading_space_ = model->add_dummy_prefix;
  t.description_ = "tokenizer.model (SentencePiece)";
  return t;
}

absl::StatusOr<TokenTexts> TokenTexts::Load(const std::string& model_dir) {
  const std::filesystem::path dir(model_dir);
  std::error_code ec;
  if (std::filesystem::exists(dir / "tokenizer.json", ec)) {
    absl::StatusOr<std::string> text = ReadFile((dir / "tokenizer.json").string());
    if (!text.ok()) return text.status();
    return FromTokenizerJson(*text);
  }
  if (std::filesystem::exists(dir / "tokenizer.model", ec)) {
    return FromSentencePiece((dir / "tokenizer.model").string());
  }
  return absl::NotFoundError(absl::StrCat(model_dir, " has no tokenizer.json or tokenizer.model"));
}

const std::string& TokenTexts::Bytes(int64_t id) const {
  static const std::string* none = new std::string;
  return id >= 0 && id < size() ? bytes_[static_cast<size_t>(id)] : *none;
}

std::string TokenTexts::Decode(const std::vector<int64_t>& ids) const {
  std::string out;
  for (int64_t id : ids) out += Bytes(id);
  if (strips_leading_space_ && !out.empty() && out[0] == ' ') out.erase(0, 1);
  return out;
}

}  // namespace tinkerd
