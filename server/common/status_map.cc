#include "server/common/status_map.h"

#include <string>

namespace tinkerd {
namespace {

// Exhaustive on purpose: no default, so a new absl code fails to compile (-Wswitch) here.
grpc::StatusCode Code(absl::StatusCode c) {
  switch (c) {
    case absl::StatusCode::kOk:
      return grpc::StatusCode::OK;
    case absl::StatusCode::kCancelled:
      return grpc::StatusCode::CANCELLED;
    case absl::StatusCode::kUnknown:
      return grpc::StatusCode::UNKNOWN;
    case absl::StatusCode::kInvalidArgument:
      return grpc::StatusCode::INVALID_ARGUMENT;
    case absl::StatusCode::kDeadlineExceeded:
      return grpc::StatusCode::DEADLINE_EXCEEDED;
    case absl::StatusCode::kNotFound:
      return grpc::StatusCode::NOT_FOUND;
    case absl::StatusCode::kAlreadyExists:
      return grpc::StatusCode::ALREADY_EXISTS;
    case absl::StatusCode::kPermissionDenied:
      return grpc::StatusCode::PERMISSION_DENIED;
    case absl::StatusCode::kResourceExhausted:
      return grpc::StatusCode::RESOURCE_EXHAUSTED;
    case absl::StatusCode::kFailedPrecondition:
      return grpc::StatusCode::FAILED_PRECONDITION;
    case absl::StatusCode::kAborted:
      return grpc::StatusCode::ABORTED;
    case absl::StatusCode::kOutOfRange:
      return grpc::StatusCode::OUT_OF_RANGE;
    case absl::StatusCode::kUnimplemented:
      return grpc::StatusCode::UNIMPLEMENTED;
    case absl::StatusCode::kInternal:
      return grpc::StatusCode::INTERNAL;
    case absl::StatusCode::kUnavailable:
      return grpc::StatusCode::UNAVAILABLE;
    case absl::StatusCode::kDataLoss:
      return grpc::StatusCode::DATA_LOSS;
    case absl::StatusCode::kUnauthenticated:
      return grpc::StatusCode::UNAUTHENTICATED;
    case absl::StatusCode::kDoNotUseReservedForFutureExpansionUseDefaultInSwitchInstead_:
      return grpc::StatusCode::UNKNOWN;
  }
  return grpc::StatusCode::UNKNOWN;  // an integer outside the enum
}

// Exhaustive like Code(): the HTTP status and whether the client is the cause.
struct HttpCode {
  int status;
  bool user;
};
HttpCode Http(absl::StatusCode c) {
  switch (c) {
    case absl::StatusCode::kOk:
      return {200, false};
    case absl::StatusCode::kCancelled:
      return {400, true};
    case absl::StatusCode::kUnknown:
      return {500, false};
    case absl::StatusCode::kInvalidArgument:
      return {400, true};
    case absl::StatusCode::kDeadlineExceeded:  // an earlier seq_id never came: retrying may help
      return {504, false};
    case absl::StatusCode::kNotFound:
      return {404, true};
    case absl::StatusCode::kAlreadyExists:  // 409 would be retried by the SDK, forever the same
      return {400, true};
    case absl::StatusCode::kPermissionDenied:
      return {403, true};
    case absl::StatusCode::kResourceExhausted:  // a full queue or memory budget: back off
      return {429, true};
    case absl::StatusCode::kFailedPrecondition:
      return {400, true};
    case absl::StatusCode::kAborted:
      return {503, false};
    case absl::StatusCode::kOutOfRange:
      return {400, true};
    case absl::StatusCode::kUnimplemented:  // deterministic: 501 would be retried like any 5xx
      return {400, true};
    case absl::StatusCode::kInternal:
      return {500, false};
    case absl::StatusCode::kUnavailable:
      return {503, false};
    case absl::StatusCode::kDataLoss:
      return {500, false};
    case absl::StatusCode::kUnauthenticated:
      return {401, true};
    case absl::StatusCode::kDoNotUseReservedForFutureExpansionUseDefaultInSwitchInstead_:
      return {500, false};
  }
  return {500, false};
}

}  // namespace

int HttpStatus(absl::StatusCode code) {
  return Http(code).status;
}

const char* TinkerCategory(absl::StatusCode code) {
  return Http(code).user ? "user" : "server";
}

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  // The message travels in metadata: a long one (input echoed somewhere uncapped) would replace
  // the answer with a metadata-size error. Messages quote input through Echo; this is the backstop.
  constexpr size_t kMaxMessage = 1024;
  std::string message(status.message().substr(0, kMaxMessage));
  if (status.message().size() > kMaxMessage) message += "... (truncated)";
  return grpc::Status(Code(status.code()), std::move(message));
}

}  // namespace tinkerd
