// What the Tinker HTTP API's handlers share: JSON answers (a result, an error with {"detail"}, a
// failed future), the reader of request fields (json_fields.h), random ids.
#pragma once

#include <cstdint>
#include <optional>
#include <random>
#include <string>

#include <nlohmann/json.hpp>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/time.h"
#include "server/common/status_map.h"
#include "server/http/http_server.h"
#include "server/http/json_fields.h"

namespace tinkerd::http {

inline Response JsonResponse(const nlohmann::json& j, int status = 200) {
  return Response{status,
                  "application/json",
                  j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace),
                  {}};
}

inline Response Error(int status, const std::string& detail) {
  return JsonResponse(nlohmann::json{{"detail", detail}}, status);
}

inline Response Error(const absl::Status& st) {
  return Error(HttpStatus(st.code()), std::string(st.message()));
}

// RFC 3339 in UTC with milliseconds, as Tinker's JSON carries times.
inline std::string IsoTime(absl::Time t) {
  return absl::FormatTime("%Y-%m-%dT%H:%M:%E3SZ", t, absl::UTCTimeZone());
}

// 64 random bits in hex: ids of sessions and of requests without a retry key.
inline std::string RandomHex() {
  static thread_local std::mt19937_64 rng{std::random_device{}()};
  return absl::StrFormat("%016x", rng());
}

// A failed future: the SDK raises it as RequestFailedError without retrying.
inline Response FutureError(const absl::Status& st) {
  return JsonResponse(nlohmann::json{{"error", std::string(st.message())},
                                     {"category", TinkerCategory(st.code())}});
}

}  // namespace tinkerd::http
