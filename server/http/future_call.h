// An operation whose answer becomes a future (futures.h): the HTTP request is answered with
// {"request_id"} once the operation was accepted (or answered by the operation itself), or
// directly with the error when the scheduler refused it at once for a reason a resend can fix or
// that must not overwrite the first call's future (duplicate, full, shutting down).
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "runner/util/hash.h"
#include "server/http/futures.h"
#include "server/http/http_server.h"
#include "server/http/tinker_json.h"
#include "server/ops/ops.h"

namespace tinkerd::http {

// Who recognizes a resend: the scheduler, by the model's seq_id (kOperation: the call starts
// again, and gets the first call's result, or is refused if its payload differs), or only the
// future table (kFuture: the first call's future answers it, and the call is not started again:
// calls without a place in a model's order, such as creations and samples).
enum class Resend { kOperation, kFuture };

// What names a call for its resends: its future's id, the digest of its kind and payload (a
// resend must match it; Digest below), and the request field that chose the id, which a
// different call reusing it is refused by (400 naming the field: never the first call's answer).
struct CallKey {
  std::string request_id;
  uint64_t digest = 0;
  std::string field;  // e.g. "seq_id", "model_seq_id"
};

// A call's digest: its kind (the endpoint, or a form of it) and its payload: a protobuf body's
// bytes as sent (Digest), or a JSON body dumped with its keys sorted (JsonDigest). The SDK resends
// a call as it was.
inline uint64_t Digest(absl::string_view kind, absl::string_view payload) {
  return Fnv64(payload, Fnv64("\n", Fnv64(kind)));
}
inline uint64_t JsonDigest(absl::string_view kind, const nlohmann::json& body) {
  const std::string dumped = body.dump();
  return Digest(kind, absl::string_view(dumped));
}

// Starts the operation (`start`) whose answer becomes the tenant's future `key.request_id`, and
// answers the HTTP request. `encode` turns the operation's response into the future's result;
// `accepted` holds fields added to the {"request_id"} answer; `topic` is the future's
// (Futures::PollFinished).
template <typename Resp>
void CallIntoFuture(Futures* futures, const std::string& tenant, const CallKey& key, Resend resend,
                    std::function<void(Done<Resp>)> start,
                    std::function<Response(const Resp&)> encode, Respond respond,
                    nlohmann::json accepted = nlohmann::json::object(),
                    const std::string& topic = "") {
  const std::string& request_id = key.request_id;
  accepted["request_id"] = request_id;
  // The future is reserved before the call starts: a call answered 429 never ran, and of two
  // racing resends of a sample only one starts it.
  const Futures::Opened opened = futures->Open(tenant, request_id, key.digest, topic);
  if (opened == Futures::Opened::kFull) {
    return respond(Error(429, "too many unfinished futures; retry later"));
  }
  if (opened == Futures::Opened::kConflict) {
    return respond(
        Error(400, absl::StrCat(key.field, ": already used by a different request (", request_id,
                                "); a resend must repeat its request as it was")));
  }
  if (opened == Futures::Opened::kExists && resend == Resend::kFuture) {
    return respond(JsonResponse(accepted));
  }
  // The operation may answer before `start` returns (a refusal, or a retry's cached result):
  // such an answer is held here and decided on below; a later one finishes the future.
  struct Submission {
    absl::Mutex mu;
    bool started = false;
    std::optional<absl::StatusOr<Resp>> immediate;
  };
  auto sub = std::make_shared<Submission>();
  auto finish = [futures, tenant, request_id, encode](const absl::StatusOr<Resp>& r) {
    futures->Finish(tenant, request_id, r.ok() ? encode(*r) : FutureError(r.status()), !r.ok());
  };
  try {
    start([sub, finish](absl::StatusOr<Resp> r) {
      absl::MutexLock lock(&sub->mu);
      if (!sub->started) {
        sub->immediate = std::move(r);
        return;
      }
      finish(r);
    });
  } catch (...) {
    // The HTTP server answers 500; a resend must find no future that nothing will finish.
    if (opened == Futures::Opened::kNew) futures->Drop(tenant, request_id);
    throw;
  }
  absl::MutexLock lock(&sub->mu);
  sub->started = true;
  if (sub->immediate && !sub->immediate->ok()) {
    const absl::StatusCode code = sub->immediate->status().code();
    if (code == absl::StatusCode::kAlreadyExists || code == absl::StatusCode::kResourceExhausted ||
        code == absl::StatusCode::kUnavailable) {
      // A resend can fix these, or they concern another call's future: not this future's answer.
      if (opened == Futures::Opened::kNew) futures->Drop(tenant, request_id);
      return respond(Error(sub->immediate->status()));
    }
  }
  if (sub->immediate) finish(*sub->immediate);
  respond(JsonResponse(accepted));
}

}  // namespace tinkerd::http
