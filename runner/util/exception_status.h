// How an exception caught at a runner entry point becomes a Status. An allocation that fails, on
// the host or on a GPU, is RESOURCE_EXHAUSTED: the request was too big for the memory left, the
// model and every other model are as they were, and the client may retry later or send less.
// Anything else is INTERNAL.
#pragma once

#include <exception>

#include "absl/status/status.h"

namespace tinkerd {

// `e` must be non-null; `what` names the entry point ("forward_backward").
absl::Status ExceptionStatus(const char* what, std::exception_ptr e);

}  // namespace tinkerd
