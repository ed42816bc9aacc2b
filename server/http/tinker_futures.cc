// The Tinker API's future polls: retrieve_future (one future, futures.h) and retrieve_futures
// (newer SDKs' long poll for the finished samples of a sampling session).
#include <algorithm>
#include <cmath>
#include <optional>

#include "absl/strings/str_cat.h"
#include "runner/util/echo.h"
#include "server/http/tinker_api.h"
#include "server/http/tinker_convert.h"
#include "server/http/tinker_json.h"

namespace tinkerd::http {

using Json = TinkerApi::Json;

void TinkerApi::RetrieveFuture(const std::string& tenant, const Json& body, Respond respond) {
  Fields f(body);
  const std::string request_id = f.Str("request_id");
  const bool peek = f.OptBool("allow_metadata_only").value_or(false);
  if (!f.status().ok()) return respond(Error(f.status()));
  futures_.Poll(tenant, request_id, std::move(respond), peek ? config_.peek_bytes : 0);
}

void TinkerApi::RetrieveFutures(const std::string& tenant, const Json& body, Respond respond) {
  Fields f(body);
  const Json* target = f.Obj("target");
  const int64_t prev_cursor = f.OptInt("prev_cursor").value_or(0);
  const std::optional<double> timeout = f.OptNum("timeout");
  if (!f.status().ok()) return respond(Error(f.status()));
  if (target == nullptr) return respond(Error(400, "target: required"));
  Fields t(*target);
  const std::string type = t.OptStr("type").value_or("sampling_session");
  const std::string session = t.Str("sampling_session_id");
  const int64_t clone = t.OptInt("cloned_sampler_id").value_or(0);
  if (!t.status().ok()) return respond(Error(400, absl::StrCat("target.", t.status().message())));
  if (type != "sampling_session") {
    return respond(Error(
        400, absl::StrCat("target.type: must be \"sampling_session\", not '", Echo(type), "'")));
  }
  if (clone < 0) return respond(Error(400, "target.cloned_sampler_id: must be >= 0"));
  if (prev_cursor < 0) return respond(Error(400, "prev_cursor: must be >= 0"));
  if (timeout && !(*timeout >= 0 && std::isfinite(*timeout))) {
    return respond(Error(400, "timeout: must be a finite number of seconds >= 0, or null"));
  }
  // Results stay until they expire (FuturesConfig::keep) whatever the client reports: a result
  // it fetched is small next to what a resend of its request would cost.
  if (auto it = body.find("retrieved_request_ids"); it != body.end() && !it->is_null()) {
    const bool strings = it->is_array() && std::all_of(it->begin(), it->end(), [](const Json& id) {
                           return id.is_string();
                         });
    if (!strings) return respond(Error(400, "retrieved_request_ids: must be a list of strings"));
  }
  const absl::Duration wait =
      timeout ? absl::Seconds(*timeout) : absl::InfiniteDuration();  // clamped to the long poll
  futures_.PollFinished(tenant, SampleTopic(session, clone), prev_cursor, wait, std::move(respond));
}

}  // namespace tinkerd::http
