// The one mapping from absl::Status to grpc::Status.
#pragma once

#include <grpcpp/support/status.h>

#include "absl/status/status.h"

namespace tinkerd {

grpc::Status ToGrpcStatus(const absl::Status& status);

}  // namespace tinkerd
