// What one tenant may hold at once, where the API keys file sets it for that tenant (a line's
// `max_models=N max_pending=N max_samples=N` after the key); every other tenant, and every field
// a tenant's lines leave out, takes the flag's bound: --max_models_per_tenant,
// --max_pending_per_tenant, --max_samples_per_tenant.
#pragma once

#include <map>
#include <optional>
#include <string>

namespace tinkerd {

struct TenantLimits {
  std::optional<int> max_models;   // models registered (0: no bound)
  std::optional<int> max_pending;  // queued calls over its models (>= 1)
  std::optional<int> max_samples;  // samples in the sampling engine (0: no bound)

  bool operator==(const TenantLimits&) const = default;
};

// By tenant; a tenant absent has no limits of its own.
using TenantLimitTable = std::map<std::string, TenantLimits>;

// `tenant`'s bound for `field` if the table sets one, else `flag`; `flag_name` or the keys file's
// field goes into `source` (for the refusal's message) when it is not null.
inline int LimitOf(const TenantLimitTable& table, const std::string& tenant,
                   std::optional<int> TenantLimits::*field, int flag, const char* flag_name,
                   const char* file_field, std::string* source = nullptr) {
  auto it = table.find(tenant);
  const bool own = it != table.end() && (it->second.*field).has_value();
  if (source != nullptr) {
    *source = own ? std::string(file_field) + " in the API keys file" : std::string(flag_name);
  }
  return own ? *(it->second.*field) : flag;
}

}  // namespace tinkerd
