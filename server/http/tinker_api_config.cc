#include "server/http/tinker_api_config.h"

#include "absl/strings/match.h"
#include "absl/strings/str_format.h"

namespace tinkerd::http {

absl::Status TinkerApiConfig::Validate() const {
  if (listen.empty()) return absl::OkStatus();
  if (threads < 1) return absl::InvalidArgumentError("http: threads must be >= 1");
  if (served_model_name.empty())
    return absl::InvalidArgumentError("http: served model name is empty");
  if (futures.long_poll <= absl::ZeroDuration() || futures.long_poll >= absl::Seconds(45)) {
    // The SDK gives up on a poll after 45 s and backs off for up to 30 s.
    return absl::InvalidArgumentError("http: long poll must be in (0, 45) s");
  }
  if (max_body_bytes < 1024) return absl::InvalidArgumentError("http: max body < 1 KiB");
  if (absl::Status st = quota.Validate(max_body_bytes); !st.ok()) return st;
  if (peek_bytes < 0) return absl::InvalidArgumentError("http: peek bytes must be >= 0");
  if (archive.url_ttl <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("http: archive URL lifetime must be > 0");
  }
  if (archive.max_downloads < 1) {
    return absl::InvalidArgumentError("http: archive downloads must be >= 1");
  }
  if (!archive.public_url.empty() && !absl::StartsWith(archive.public_url, "http://") &&
      !absl::StartsWith(archive.public_url, "https://")) {
    return absl::InvalidArgumentError(
        "http: public URL must start with http:// or https:// (say, https://tinkerd.example.org)");
  }
  return absl::OkStatus();
}

std::string TinkerApiConfig::DebugString() const {
  if (listen.empty()) return "http=off";
  return absl::StrFormat(
      "http=%s http_threads=%d served_model_name=%s long_poll=%s keep=%s peek_bytes=%d "
      "session_idle=%s archive_url_ttl=%s archive_downloads=%d public_url=%s "
      "body_bytes_in_flight=%d body_bytes_in_flight_per_key=%d connections_per_key=%d",
      listen, threads, served_model_name, absl::FormatDuration(futures.long_poll),
      absl::FormatDuration(futures.keep), peek_bytes,
      session_idle > absl::ZeroDuration() ? absl::FormatDuration(session_idle) : "off",
      absl::FormatDuration(archive.url_ttl), archive.max_downloads,
      archive.public_url.empty() ? "(from Host)" : archive.public_url, quota.body_bytes,
      quota.body_bytes_per_key, quota.connections_per_key);
}

}  // namespace tinkerd::http
