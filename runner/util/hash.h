// 64-bit FNV-1a: the one non-cryptographic hash of the project (checkpoint checksums, request
// payload keys, seed derivation). Stable across platforms and releases.
#pragma once

#include <cstdint>

#include "absl/strings/string_view.h"

namespace tinkerd {

inline constexpr uint64_t kFnv64Basis = 1469598103934665603ull;

// `h` continues an earlier hash: Fnv64(b, Fnv64(a)) == Fnv64(a + b).
inline uint64_t Fnv64(absl::string_view bytes, uint64_t h = kFnv64Basis) {
  for (unsigned char c : bytes) h = (h ^ c) * 1099511628211ull;
  return h;
}

}  // namespace tinkerd
