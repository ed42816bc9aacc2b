#include "runner/tokenizer/sentencepiece_pieces.h"

#include <cstdint>
#include <cstring>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace tinkerd {
namespace {

absl::Status Malformed(absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("tokenizer.model: ", what));
}

// A bounds-checked reader of protobuf's wire format.
class Wire {
 public:
  explicit Wire(std::string_view bytes) : rest_(bytes) {}
  bool done() const { return rest_.empty(); }

  absl::StatusOr<uint64_t> Varint() {
    uint64_t v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      if (rest_.empty()) return Malformed("a varint runs past the end");
      const auto b = static_cast<uint8_t>(rest_[0]);
      rest_.remove_prefix(1);
      v |= static_cast<uint64_t>(b & 0x7F) << shift;
      if ((b & 0x80) == 0) return v;
    }
    return Malformed("a varint is longer than 10 bytes");
  }
  absl::StatusOr<std::string_view> Bytes(uint64_t n) {
    if (n > rest_.size()) return Malformed("a field runs past the end");
    const std::string_view out = rest_.substr(0, n);
    rest_.remove_prefix(n);
    return out;
  }
  // The next field's number and, for a length-delimited one, its payload; others are skipped.
  absl::Status Next(uint64_t* field, int* wire_type, std::string_view* payload, uint64_t* varint) {
    absl::StatusOr<uint64_t> tag = Varint();
    if (!tag.ok()) return tag.status();
    *field = *tag >> 3;
    *wire_type = static_cast<int>(*tag & 7);
    switch (*wire_type) {
      case 0: {
        absl::StatusOr<uint64_t> v = Varint();
        if (!v.ok()) return v.status();
        *varint = *v;
        return absl::OkStatus();
      }
      case 1:
        return Bytes(8).status();
      case 5:
        return Bytes(4).status();
      case 2: {
        absl::StatusOr<uint64_t> n = Varint();
        if (!n.ok()) return n.status();
        absl::StatusOr<std::string_view> b = Bytes(*n);
        if (!b.ok()) return b.status();
        *payload = *b;
        return absl::OkStatus();
      }
      default:
        return Malformed(absl::StrCat("unsupported wire type ", *wire_type));
    }
  }

 private:
  std::string_view rest_;
};

absl::StatusOr<SentencePiecePiece> ParsePiece(std::string_view bytes) {
  SentencePiecePiece p;
  Wire w(bytes);
  while (!w.done()) {
    uint64_t field = 0, varint = 0;
    int type = 0;
    std::string_view payload;
    if (auto st = w.Next(&field, &type, &payload, &varint); !st.ok()) return st;
    if (field == 1 && type == 2) p.text = std::string(payload);
    if (field == 3 && type == 0) {
      if (varint < 1 || varint > 6) return Malformed(absl::StrCat("piece type ", varint));
      p.kind = static_cast<SentencePiecePiece::Kind>(varint);
    }
  }
  return p;
}

}  // namespace

absl::StatusOr<SentencePieceModel> ParseSentencePieceModel(std::string_view bytes) {
  SentencePieceModel m;
  Wire w(bytes);
  while (!w.done()) {
    uint64_t field = 0, varint = 0;
    int type = 0;
    std::string_view payload;
    if (auto st = w.Next(&field, &type, &payload, &varint); !st.ok()) return st;
    if (field == 1 && type == 2) {
      absl::StatusOr<SentencePiecePiece> piece = ParsePiece(payload);
      if (!piece.ok()) return piece.status();
      m.pieces.push_back(*std::move(piece));
    } else if (field == 3 && type == 2) {
      Wire spec(payload);
      while (!spec.done()) {
        uint64_t f = 0, v = 0;
        int t = 0;
        std::string_view p;
        if (auto st = spec.Next(&f, &t, &p, &v); !st.ok()) return st;
        if (f == 3 && t == 0) m.add_dummy_prefix = v != 0;
      }
    }
  }
  if (m.pieces.empty()) return Malformed("no pieces");
  return m;
}

}  // namespace tinkerd
