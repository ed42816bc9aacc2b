// Client input quoted in an error message, capped. An error travels in gRPC metadata, so an echoed
// 8 KB model_id would turn NOT_FOUND into a metadata-size error and hide the real answer.
#pragma once

#include <cstddef>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace tinkerd {

inline constexpr size_t kMaxEcho = 64;

inline std::string Echo(absl::string_view input) {
  if (input.size() <= kMaxEcho) return std::string(input);
  return absl::StrCat(input.substr(0, kMaxEcho), "... (", input.size(), " bytes)");
}

}  // namespace tinkerd
