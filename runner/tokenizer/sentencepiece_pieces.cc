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

// One field of a message: its number, wire type, and value (a varint, or a length-delimited
// payload; fixed-width values are skipped).
struct Field {
  uint64_t number = 0;
  int wire_type = 0;
  uint64_t varint = 0;
  std::string_view payload;
};

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
  absl::StatusOr<Field> Next() {
    Field f;
    absl::StatusOr<uint64_t> tag = Varint();
    if (!tag.ok()) return tag.status();
    f.number = *tag >> 3;
    f.wire_type = static_cast<int>(*tag & 7);
    absl::StatusOr<uint64_t> v;
    absl::StatusOr<std::string_view> skipped;
    switch (f.wire_type) {
      case 0:
        v = Varint();
        if (!v.ok()) return v.status();
        f.varint = *v;
        return f;
      case 1:
      case 5:
        skipped = Bytes(f.wire_type == 1 ? 8 : 4);
        if (!skipped.ok()) return skipped.status();
        return f;
      case 2:
        v = Varint();
        if (!v.ok()) return v.status();
        skipped = Bytes(*v);
        if (!skipped.ok()) return skipped.status();
        f.payload = *skipped;
        return f;
      default:
        return Malformed(absl::StrCat("unsupported wire type ", f.wire_type));
    }
  }

 private:
  std::string_view rest_;
};

// Calls visit(field) for every field of the message in `bytes`; the first error stops it.
template <class Visit>
absl::Status ForEachField(std::string_view bytes, Visit visit) {
  Wire w(bytes);
  while (!w.done()) {
    absl::StatusOr<Field> f = w.Next();
    if (!f.ok()) return f.status();
    if (absl::Status st = visit(*f); !st.ok()) return st;
  }
  return absl::OkStatus();
}

absl::StatusOr<SentencePiecePiece> ParsePiece(std::string_view bytes) {
  SentencePiecePiece p;
  absl::Status st = ForEachField(bytes, [&](const Field& f) {
    if (f.number == 1 && f.wire_type == 2) p.text = std::string(f.payload);
    if (f.number == 3 && f.wire_type == 0) {
      if (f.varint < 1 || f.varint > 6) return Malformed(absl::StrCat("piece type ", f.varint));
      p.kind = static_cast<SentencePiecePiece::Kind>(f.varint);
    }
    return absl::OkStatus();
  });
  if (!st.ok()) return st;
  return p;
}

}  // namespace

absl::StatusOr<SentencePieceModel> ParseSentencePieceModel(std::string_view bytes) {
  SentencePieceModel m;
  absl::Status st = ForEachField(bytes, [&](const Field& f) -> absl::Status {
    if (f.number == 1 && f.wire_type == 2) {
      absl::StatusOr<SentencePiecePiece> piece = ParsePiece(f.payload);
      if (!piece.ok()) return piece.status();
      m.pieces.push_back(*std::move(piece));
    } else if (f.number == 3 && f.wire_type == 2) {
      return ForEachField(f.payload, [&](const Field& spec) {
        if (spec.number == 3 && spec.wire_type == 0) m.add_dummy_prefix = spec.varint != 0;
        return absl::OkStatus();
      });
    }
    return absl::OkStatus();
  });
  if (!st.ok()) return st;
  if (m.pieces.empty()) return Malformed("no pieces");
  return m;
}

}  // namespace tinkerd
