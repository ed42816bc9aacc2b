// API keys and tenants. Each key belongs to a tenant; a tenant sees and touches only its own
// models and checkpoints. Keys come from a file of "tenant key" lines (# comments allowed), each
// optionally followed by the tenant's own limits (tenant_limits.h: `max_models=4 max_pending=64
// max_samples=128`), and are compared in constant time. Without a key file, authentication is off
// and every caller is the tenant "default" (allowed on loopback; tinkerd warns when binding
// elsewhere).
#pragma once

#include <grpcpp/server_context.h>

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "server/common/tenant_limits.h"

namespace tinkerd {

class ApiKeys {
 public:
  static ApiKeys Disabled() { return ApiKeys(); }
  static absl::StatusOr<ApiKeys> LoadFile(const std::string& path);

  bool enabled() const { return !entries_.empty(); }
  // The caller's tenant from its "x-api-key" metadata; UNAUTHENTICATED when missing or unknown.
  absl::StatusOr<std::string> Authenticate(const grpc::CallbackServerContext* ctx) const;
  absl::StatusOr<std::string> TenantOf(const std::string& key) const;
  // The key's line among the file's keys, from 1 (0 with authentication off); UNAUTHENTICATED
  // as TenantOf.
  absl::StatusOr<int> NumberOf(const std::string& key) const;
  // The limits the file sets per tenant (a tenant's lines may repeat them, never contradict).
  const TenantLimitTable& limits() const { return limits_; }

 private:
  struct Entry {
    std::string tenant;
    std::string key;
  };
  std::vector<Entry> entries_;
  TenantLimitTable limits_;
};

// Equality whose time depends only on the lengths, not on where the strings differ.
bool ConstantTimeEquals(const std::string& a, const std::string& b);

}  // namespace tinkerd
