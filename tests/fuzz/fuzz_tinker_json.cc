// Fuzzes the Tinker HTTP API's asample body as its handler reads it (and the same bytes as a
// listing's query string, PageFromQuery): arbitrary bytes parsed as JSON as the server parses
// them (ParseJsonBody, checked against json::parse), the request's own fields read (Fields), then
// its prompt and sampling_params decoded (PromptFromTinker, SamplingParamsFromTinker). Properties,
// besides no crash, no exception (one, from an unchecked field type, once ended the server) and no
// sanitizer report:
//   - every refusal is INVALID_ARGUMENT whose message begins with the field it names;
//   - an accepted prompt is one chunk holding the tokens of every input chunk, in order;
//   - accepted params keep max_tokens, every stop id as a stop sequence of its own, and every stop
//     string (a string or a list of them) as it was;
//   - an accepted target_prompt_logprobs is INT64 [rows, K] within the bounds given, each cell an
//     id it sent (dense) or -1 where a sparse one lists nothing, and the layout kept for the
//     answer has rows + 1 row pointers.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/strings/match.h"
#include "server/http/json_body.h"
#include "server/http/json_fields.h"
#include "server/http/tinker_convert.h"
#include "tests/fuzz/fuzz_check.h"

namespace {

using Json = nlohmann::json;

void CheckRefusal(const absl::Status& s, const char* field) {
  FUZZ_CHECK(s.code() == absl::StatusCode::kInvalidArgument,
             "a refusal that is not a client error");
  FUZZ_CHECK(absl::StartsWith(s.message(), field), "a refusal that does not name its field");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* bytes, size_t size) {
  // The same bytes as a listing's query string (GET training_runs?limit=..&offset=..).
  auto page =
      tinkerd::http::PageFromQuery(absl::string_view(reinterpret_cast<const char*>(bytes), size));
  if (page.ok()) {
    FUZZ_CHECK(page->offset >= 0, "a negative offset accepted");
    FUZZ_CHECK(!page->limit || (*page->limit >= 1 && *page->limit <= tinkerd::http::kMaxPageLimit),
               "a limit out of range accepted");
  } else {
    FUZZ_CHECK(page.status().code() == absl::StatusCode::kInvalidArgument, "a page refusal");
    FUZZ_CHECK(absl::StartsWith(page.status().message(), "limit") ||
                   absl::StartsWith(page.status().message(), "offset") ||
                   absl::StartsWith(page.status().message(), "access_scope"),
               "a page refusal that does not name its parameter");
  }

  // The server's streaming parse (json_body.h) against nlohmann's own: what it accepts is the
  // same DOM, charged at least a JSON value per value; what it refuses names the body, and only
  // for depth or density does it refuse an object that parses.
  const absl::string_view text(reinterpret_cast<const char*>(bytes), size);
  int64_t charged = 0;
  const absl::StatusOr<tinkerd::http::JsonDom> streamed =
      tinkerd::http::ParseJsonBody(text, [&](int64_t n) {
        FUZZ_CHECK(n > 0, "a charge of nothing");
        charged += n;
        return absl::OkStatus();
      });
  const Json reference = Json::parse(bytes, bytes + size, nullptr, /*allow_exceptions=*/false);
  const bool object = !reference.is_discarded() && reference.is_object();
  if (streamed.ok()) {
    FUZZ_CHECK(object && **streamed == reference, "the streamed DOM differs from json::parse's");
    FUZZ_CHECK(charged >= static_cast<int64_t>(sizeof(Json)), "a DOM built without a charge");
    // The DOM's bound, charged ahead by at most half again (and a first step of 16 KiB).
    const int64_t bound = tinkerd::http::kJsonBytesPerTextByte * static_cast<int64_t>(size) +
                          tinkerd::http::kJsonFixedBytes;
    FUZZ_CHECK(charged <= bound * 3 / 2 + (16 << 10), "a DOM charged past its text's bound");
  } else {
    FUZZ_CHECK(streamed.status().code() == absl::StatusCode::kInvalidArgument &&
                   absl::StartsWith(streamed.status().message(), "body: "),
               "a body refusal that does not name the body");
    FUZZ_CHECK(!object || absl::StartsWith(streamed.status().message(), "body: nested deeper") ||
                   absl::StartsWith(streamed.status().message(), "body: its JSON would take"),
               "an object refused for no stated reason");
  }
  if (!streamed.ok()) return 0;
  const Json& body = **streamed;
  tinkerd::http::Fields f(body);
  f.OptStr("sampling_session_id");
  f.OptInt("seq_id");
  f.OptStr("base_model");
  f.OptStr("model_path");
  f.OptInt("num_samples");
  f.OptBool("prompt_logprobs");
  f.OptInt("topk_prompt_logprobs");
  const Json* prompt = f.Obj("prompt");
  const Json* params = f.Obj("sampling_params");
  const Json* target = f.Obj("target_prompt_logprobs");
  if (!f.status().ok()) {
    FUZZ_CHECK(f.status().code() == absl::StatusCode::kInvalidArgument, "a field refusal");
    return 0;
  }

  tinkerd::v1::ModelInput input;
  if (absl::Status s = tinkerd::http::PromptFromTinker(prompt, &input); !s.ok()) {
    CheckRefusal(s, "prompt");
  } else {
    std::vector<int64_t> want;
    for (const Json& chunk : prompt->at("chunks")) {
      for (const Json& t : chunk.at("tokens")) want.push_back(t.get<int64_t>());
    }
    FUZZ_CHECK(input.chunks_size() == 1, "a prompt is one chunk");
    const auto& got = input.chunks(0).encoded_text().tokens();
    FUZZ_CHECK(std::vector<int64_t>(got.begin(), got.end()) == want, "prompt tokens changed");
  }

  if (target != nullptr) {
    constexpr int64_t kRows = 64, kK = 20;
    tinkerd::v1::Tensor ids;
    tinkerd::http::TargetLayout layout;
    if (absl::Status s = tinkerd::http::TargetPromptFromTinker(*target, kRows, kK, &ids, &layout);
        !s.ok()) {
      CheckRefusal(s, "target_prompt_logprobs");
    } else {
      FUZZ_CHECK(ids.dtype() == tinkerd::v1::INT64 && ids.shape_size() == 2, "target: INT64 2-D");
      const int64_t rows = ids.shape(0), k = ids.shape(1);
      FUZZ_CHECK(rows >= 1 && rows <= kRows && k >= 1 && k <= kK, "target: shape out of bounds");
      FUZZ_CHECK(ids.data().size() == static_cast<size_t>(rows * k) * sizeof(int64_t),
                 "target: ids do not fill the shape");
      FUZZ_CHECK(layout.rows == rows && layout.k == k, "target: layout lost the shape");
      if (layout.sparse) {
        FUZZ_CHECK(layout.crow.size() == static_cast<size_t>(rows + 1), "target: row pointers");
      } else {
        const Json& data = target->at("data");
        for (int64_t c = 0; c < rows * k; ++c) {
          int64_t v;
          std::memcpy(&v, ids.data().data() + c * sizeof(int64_t), sizeof(v));
          FUZZ_CHECK(v == data[static_cast<size_t>(c)].get<int64_t>(), "target: an id changed");
        }
      }
    }
  }

  tinkerd::v1::SamplingParams sp;
  if (absl::Status s = tinkerd::http::SamplingParamsFromTinker(params, &sp); !s.ok()) {
    CheckRefusal(s, "sampling_params");
  } else {
    const int64_t max_tokens = params->at("max_tokens").get<int64_t>();
    FUZZ_CHECK(sp.max_tokens() == (max_tokens < -1 ? -1 : max_tokens), "max_tokens changed");
    const auto stop = params->find("stop");
    const bool none = stop == params->end() || stop->is_null();
    if (!none && stop->is_string()) {
      FUZZ_CHECK(sp.stop_size() == 0 && sp.stop_strings_size() == 1 &&
                     sp.stop_strings(0) == stop->get<std::string>(),
                 "a stop string lost or changed");
    } else if (!none && !stop->empty() && (*stop)[0].is_string()) {
      FUZZ_CHECK(sp.stop_size() == 0 && static_cast<size_t>(sp.stop_strings_size()) == stop->size(),
                 "a stop string lost or added");
      for (int i = 0; i < sp.stop_strings_size(); ++i) {
        FUZZ_CHECK(sp.stop_strings(i) == (*stop)[static_cast<size_t>(i)].get<std::string>(),
                   "a stop string changed");
      }
    } else {
      FUZZ_CHECK(sp.ignore_eos() == (!none && stop->empty()), "stop: [] must turn off EOS");
      const size_t stops = none ? 0 : stop->size();
      FUZZ_CHECK(static_cast<size_t>(sp.stop_size()) == stops && sp.stop_strings_size() == 0,
                 "a stop id lost or added");
      for (int i = 0; i < sp.stop_size(); ++i) {
        FUZZ_CHECK(sp.stop(i).tokens_size() == 1 &&
                       sp.stop(i).tokens(0) == (*stop)[static_cast<size_t>(i)].get<int64_t>(),
                   "a stop id changed");
      }
    }
  }
  return 0;
}
