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
#include "absl/synchronization/mutex.h"
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

// Starts the operation (`start`) whose answer becomes the tenant's future `request_id`, and
// answers the HTTP request. `encode` turns the operation's response into the future's result;
// `accepted` holds fields added to the {"request_id"} answer; `topic` is the future's
// (Futures::PollFinished).
template <typename Resp>
void CallIntoFuture(Futures* futures, const std::string& tenant, const std::string& request_id,
                    Resend resend, std::function<void(Done<Resp>)> start,
                    std::function<Response(const Resp&)> encode, Respond respond,
                    nlohmann::json accepted = nlohmann::json::object(),
                    const std::string& topic = "") {
  accepted["request_id"] = request_id;
  // The future is reserved before the call starts: a call answered 429 never ran, and of two
  // racing resends of a sample only one starts it.
  const Futures::Opened opened = futures->Open(tenant, request_id, topic);
  if (opened == Futures::Opened::kFull) {
    return respond(Error(429, "too many unfinished futures; retry later"));
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
