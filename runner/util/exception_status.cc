#include "runner/util/exception_status.h"

#include <c10/util/Exception.h>

#include <new>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace tinkerd {

void ThrowStatus(const absl::Status& st) {
  if (st.code() == absl::StatusCode::kUnavailable)
    throw CollectiveFailure(std::string(st.message()));
  throw std::runtime_error(std::string(st.message()));
}

absl::Status ExceptionStatus(const char* what, std::exception_ptr e) {
  try {
    std::rethrow_exception(e);
  } catch (const CollectiveFailure& x) {
    return absl::UnavailableError(absl::StrCat(what, ": ", x.what()));
  } catch (const c10::OutOfMemoryError& x) {  // a GPU allocator out of memory
    return absl::ResourceExhaustedError(
        absl::StrCat(what, ": out of device memory: ", x.what_without_backtrace()));
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError(absl::StrCat(what, ": out of host memory"));
  } catch (const c10::Error& x) {
    // LibTorch's CPU allocator reports a failed allocation as a plain c10::Error (LibTorch 1.13)
    // or as OutOfMemoryError (2.x); the text is the only mark the older one leaves.
    const char* msg = x.what_without_backtrace();
    if (absl::StrContains(msg, "not enough memory") ||
        absl::StrContains(msg, "can't allocate memory")) {
      return absl::ResourceExhaustedError(absl::StrCat(what, ": out of host memory: ", msg));
    }
    return absl::InternalError(absl::StrCat(what, ": ", msg));
  } catch (const std::exception& x) {
    return absl::InternalError(absl::StrCat(what, ": ", x.what()));
  } catch (...) {
    return absl::InternalError(absl::StrCat(what, ": unknown exception"));
  }
}

}  // namespace tinkerd
