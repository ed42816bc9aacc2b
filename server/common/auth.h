// API keys and tenants. Each key belongs to a tenant; a tenant sees and touches only its own
// models and checkpoints. Keys come from a file of "tenant key" lines (# comments allowed) and
// are compared in constant time. Without a key file, authentication is off and every caller is
// the tenant "default" (allowed on loopback; tinkerd warns when binding elsewhere).
#pragma once

#include <grpcpp/server_context.h>

#include <string>
#include <vector>

#include "absl/status/statusor.h"

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

 private:
  struct Entry {
    std::string tenant;
    std::string key;
  };
  std::vector<Entry> entries_;
};

// Equality whose time depends only on the lengths, not on where the strings differ.
bool ConstantTimeEquals(const std::string& a, const std::string& b);

}  // namespace tinkerd
