#include "server/http/edge_quota.h"

#include "absl/strings/str_cat.h"

namespace tinkerd::http {

absl::Status EdgeQuotaConfig::Validate(int64_t max_body_bytes) const {
  if (body_bytes_per_key < 1 || body_bytes < body_bytes_per_key) {
    return absl::InvalidArgumentError(absl::StrCat(
        "http: request bodies in flight per key (", body_bytes_per_key,
        " bytes) must be at least 1 and at most those of the whole server (", body_bytes, ")"));
  }
  if (body_bytes_per_key < max_body_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("http: request bodies in flight per key (", body_bytes_per_key,
                     " bytes) must hold the largest body a request may send (", max_body_bytes,
                     "), else such a request could never be admitted"));
  }
  if (connections_per_key < 1) {
    return absl::InvalidArgumentError("http: connections per key must be >= 1");
  }
  return absl::OkStatus();
}

absl::Status EdgeQuota::TakeBody(const std::string& key, int64_t bytes) {
  absl::MutexLock lock(&mu_);
  Held& mine = held_[key];
  if (!key.empty() && mine.body_bytes + bytes > config_.body_bytes_per_key) {
    const int64_t held = mine.body_bytes;
    ForgetIfIdle(key);
    return absl::ResourceExhaustedError(absl::StrCat(
        "body: this API key's requests hold ", held, " bytes of bodies in flight; ", bytes,
        " more would pass its bound of ", config_.body_bytes_per_key,
        " (--http_body_mb_in_flight_per_key). Retry when earlier requests are answered"));
  }
  if (body_bytes_ + bytes > config_.body_bytes) {
    ForgetIfIdle(key);
    return absl::ResourceExhaustedError(
        absl::StrCat("body: the server holds ", body_bytes_, " bytes of request bodies in flight; ",
                     bytes, " more would pass its bound of ", config_.body_bytes,
                     " (--http_body_mb_in_flight). Retry shortly"));
  }
  mine.body_bytes += bytes;
  body_bytes_ += bytes;
  return absl::OkStatus();
}

void EdgeQuota::ReturnBody(const std::string& key, int64_t bytes) {
  absl::MutexLock lock(&mu_);
  auto it = held_.find(key);
  if (it == held_.end()) return;
  it->second.body_bytes -= bytes;
  body_bytes_ -= bytes;
  ForgetIfIdle(key);
}

absl::Status EdgeQuota::TakeConnection(const std::string& key) {
  absl::MutexLock lock(&mu_);
  Held& mine = held_[key];
  if (!key.empty() && mine.connections >= config_.connections_per_key) {
    return absl::ResourceExhaustedError(
        absl::StrCat("connections: this API key holds ", mine.connections,
                     " connections, its bound (--http_connections_per_key). Close idle "
                     "connections or retry when earlier requests are answered"));
  }
  ++mine.connections;
  return absl::OkStatus();
}

void EdgeQuota::ReturnConnection(const std::string& key) {
  absl::MutexLock lock(&mu_);
  auto it = held_.find(key);
  if (it == held_.end()) return;
  --it->second.connections;
  ForgetIfIdle(key);
}

int64_t EdgeQuota::body_bytes() const {
  absl::MutexLock lock(&mu_);
  return body_bytes_;
}

int EdgeQuota::connections(const std::string& key) const {
  absl::MutexLock lock(&mu_);
  auto it = held_.find(key);
  return it == held_.end() ? 0 : it->second.connections;
}

void EdgeQuota::ForgetIfIdle(const std::string& key) {
  auto it = held_.find(key);
  if (it != held_.end() && it->second.body_bytes == 0 && it->second.connections == 0) {
    held_.erase(it);
  }
}

}  // namespace tinkerd::http
