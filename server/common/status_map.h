// The one mapping from absl::Status to each front end's codes: gRPC status codes, and HTTP
// statuses with the Tinker error category.
#pragma once

#include <grpcpp/support/status.h>

#include "absl/status/status.h"

namespace tinkerd {

grpc::Status ToGrpcStatus(const absl::Status& status);

// The HTTP status of an error answered directly. The Tinker SDK retries 408, 409, 429 and 5xx
// (for minutes), so only transient conditions map there; a duplicate seq_id is 400, never 409.
int HttpStatus(absl::StatusCode code);
// A failed future's category: "user" when resending the same request cannot succeed because of
// what it asked for, "server" otherwise.
const char* TinkerCategory(absl::StatusCode code);

}  // namespace tinkerd
