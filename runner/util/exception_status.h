// How an exception caught at a runner entry point becomes a Status. An allocation that fails, on
// the host or on a GPU, is RESOURCE_EXHAUSTED: the request was too big for the memory left, the
// model and every other model are as they were, and the client may retry later or send less. A
// collective that failed where no Status can be returned (inside autograd) is thrown as a
// CollectiveFailure and becomes UNAVAILABLE, as a failed collective is everywhere else: the ranks
// no longer agree on where they are, and the job stops serving. Anything else is INTERNAL.
#pragma once

#include <exception>
#include <stdexcept>

#include "absl/status/status.h"

namespace tinkerd {

class CollectiveFailure : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Throws `st` (not OK): a CollectiveFailure when it is UNAVAILABLE, else a std::runtime_error.
[[noreturn]] void ThrowStatus(const absl::Status& st);

// `e` must be non-null; `what` names the entry point ("forward_backward").
absl::Status ExceptionStatus(const char* what, std::exception_ptr e);

}  // namespace tinkerd
