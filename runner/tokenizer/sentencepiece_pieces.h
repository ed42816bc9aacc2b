// The pieces of a SentencePiece model file (tokenizer.model), read straight from its protobuf
// encoding. Not through libsentencepiece: Debian's build exports the protobuf-lite it embeds, and
// its symbols clash with libprotobuf's in a process that loads both (tinkerd's gRPC server does).
// Only what decoding needs is read:
//   ModelProto      { repeated SentencePiece pieces = 1; NormalizerSpec normalizer_spec = 3; }
//   SentencePiece   { string piece = 1; float score = 2; Type type = 3 [default NORMAL]; }
//   NormalizerSpec  { bool add_dummy_prefix = 3 [default true]; }
// Everything else is skipped by its wire type.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace tinkerd {

struct SentencePiecePiece {
  // SentencePiece's Type enum, by value.
  enum class Kind {
    kNormal = 1,
    kUnknown = 2,
    kControl = 3,
    kUserDefined = 4,
    kUnused = 5,
    kByte = 6
  };
  std::string text;  // as stored: '▁' for spaces, "<0x0A>" for a byte piece
  Kind kind = Kind::kNormal;
};

struct SentencePieceModel {
  std::vector<SentencePiecePiece> pieces;  // by id
  // The decoder drops the space a sequence's first piece starts with (add_dummy_prefix).
  bool add_dummy_prefix = true;
};

// INVALID_ARGUMENT when `bytes` are not a well-formed ModelProto with at least one piece.
absl::StatusOr<SentencePieceModel> ParseSentencePieceModel(std::string_view bytes);

}  // namespace tinkerd
