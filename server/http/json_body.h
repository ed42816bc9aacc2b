// A request's JSON body as a DOM (nlohmann::json), built by a streaming parse that knows what each
// value it adds will cost before adding it. A DOM can take dozens of times its text: 8 MiB of
// nested arrays ("[[1],[1],...") once took 308 MB, so a body at the default size limit could ask
// for ~10 GB. Here, at every point of the parse, the DOM's bytes stay within
// kJsonBytesPerTextByte per byte of text read so far (plus kJsonFixedBytes); the densest body of
// this API stays within that, a denser one is refused as soon as it is (after a few KiB of
// nested arrays), and every byte is first offered to `charge`, which holds it in the server's
// memory account. Torch- and gRPC-free, so the request fuzzer drives it.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>

#include <nlohmann/json.hpp>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace tinkerd::http {

// The deepest any request body of the Tinker API nests is 5 levels (asample's
// {prompt: {chunks: [{tokens: [...]}]}}); 16 leaves room for fields to come.
inline constexpr int kMaxJsonDepth = 16;
// The densest body of this API is an array of one-digit integers (a prompt's tokens): "1," is 2
// bytes of text and charged 48 (an array element, json_body.cc), 24 bytes per byte.
inline constexpr int64_t kJsonBytesPerTextByte = 24;
// On top: a small body's objects (an empty object is 2 bytes of text and 112 charged).
inline constexpr int64_t kJsonFixedBytes = int64_t{64} << 10;

// Offered the bytes the DOM is about to grow by, ahead of them (in steps of 16 KiB or more); a
// refusal ends the parse with its status, and the DOM built so far is freed.
using JsonCharge = std::function<absl::Status(int64_t bytes)>;

// Frees a DOM leaves first. nlohmann's own teardown first moves every element of an array into a
// vector of its own, an allocation as large as the array (120 MB for a prompt of 7.5M tokens)
// made in a destructor: where memory has run out, that allocation throws and ends the process.
// Emptying each container before its parent takes none. Recursive: for DOMs of bounded depth,
// as ParseJsonBody's are (kMaxJsonDepth).
void FreeJson(nlohmann::json& dom);
struct JsonDeleter {
  void operator()(nlohmann::json* dom) const {
    FreeJson(*dom);
    delete dom;
  }
};
using JsonDom = std::unique_ptr<nlohmann::json, JsonDeleter>;

// `text` as a JSON object. INVALID_ARGUMENT whose message starts with "body" when it is not JSON,
// not an object, nests deeper than kMaxJsonDepth or would take more than its text allows;
// otherwise what `charge` refused with. Exactly the DOM nlohmann::json::parse builds, duplicate
// keys included (the last one wins).
absl::StatusOr<JsonDom> ParseJsonBody(absl::string_view text, const JsonCharge& charge);

}  // namespace tinkerd::http
