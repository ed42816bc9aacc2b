#include "server/common/auth.h"

#include <fstream>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace tinkerd {

bool ConstantTimeEquals(const std::string& a, const std::string& b) {
  // Walk the longer length every time; fold every byte difference and the length difference in.
  const size_t n = std::max(a.size(), b.size());
  unsigned char diff = static_cast<unsigned char>(a.size() != b.size());
  for (size_t i = 0; i < n; ++i) {
    const unsigned char x = i < a.size() ? static_cast<unsigned char>(a[i]) : 0;
    const unsigned char y = i < b.size() ? static_cast<unsigned char>(b[i]) : 0;
    diff |= static_cast<unsigned char>(x ^ y);
  }
  return diff == 0;
}

namespace {

// One `name=value` of a keys file line into `limits`.
absl::Status ParseLimit(const std::string& field, TenantLimits* limits) {
  const size_t eq = field.find('=');
  const std::string name = field.substr(0, eq);
  std::optional<int>* slot = name == "max_models"    ? &limits->max_models
                             : name == "max_pending" ? &limits->max_pending
                             : name == "max_samples" ? &limits->max_samples
                                                     : nullptr;
  if (eq == std::string::npos || slot == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "'", field, "': expected max_models=N, max_pending=N or max_samples=N after the key"));
  }
  int value = 0;
  const int least = name == "max_pending" ? 1 : 0;
  if (!absl::SimpleAtoi(field.substr(eq + 1), &value) || value < least) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": must be an integer >= ", least, " (0: no bound)"));
  }
  if (slot->has_value()) return absl::InvalidArgumentError(absl::StrCat(name, ": given twice"));
  *slot = value;
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<ApiKeys> ApiKeys::LoadFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("api keys: cannot open ", path));
  ApiKeys keys;
  std::string line;
  int n = 0;
  while (std::getline(in, line)) {
    ++n;
    if (line.empty() || line[0] == '#') continue;
    std::istringstream fields(line);
    Entry e;
    if (!(fields >> e.tenant >> e.key)) {
      return absl::InvalidArgumentError(absl::StrCat(
          path, ":", n, ": expected 'tenant key [max_models=N] [max_pending=N] [max_samples=N]'"));
    }
    if (e.key.size() < 16) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ":", n, ": keys must be at least 16 characters"));
    }
    TenantLimits limits;
    for (std::string field; fields >> field;) {
      if (auto st = ParseLimit(field, &limits); !st.ok()) {
        return absl::InvalidArgumentError(absl::StrCat(path, ":", n, ": ", st.message()));
      }
    }
    // A tenant's limits hold for all its keys: a second line may repeat them or say nothing.
    if (limits != TenantLimits{}) {
      auto [it, added] = keys.limits_.emplace(e.tenant, limits);
      if (!added && it->second != limits) {
        return absl::InvalidArgumentError(absl::StrCat(path, ":", n, ": tenant ", e.tenant,
                                                       "'s limits differ from an earlier line's"));
      }
    }
    keys.entries_.push_back(std::move(e));
  }
  if (keys.entries_.empty()) return absl::InvalidArgumentError(absl::StrCat(path, ": no keys"));
  return keys;
}

absl::StatusOr<std::string> ApiKeys::TenantOf(const std::string& key) const {
  if (!enabled()) return std::string("default");
  // Compare against every key, always, so the time does not reveal which prefix matched.
  const std::string* tenant = nullptr;
  for (const Entry& e : entries_) {
    if (ConstantTimeEquals(e.key, key) && tenant == nullptr) tenant = &e.tenant;
  }
  if (tenant == nullptr) return absl::UnauthenticatedError("x-api-key: missing or unknown API key");
  return *tenant;
}

absl::StatusOr<int> ApiKeys::NumberOf(const std::string& key) const {
  if (!enabled()) return 0;
  int number = 0;
  for (size_t i = 0; i < entries_.size(); ++i) {
    if (ConstantTimeEquals(entries_[i].key, key) && number == 0) number = static_cast<int>(i) + 1;
  }
  if (number == 0) return absl::UnauthenticatedError("x-api-key: missing or unknown API key");
  return number;
}

absl::StatusOr<std::string> ApiKeys::Authenticate(const grpc::CallbackServerContext* ctx) const {
  if (!enabled()) return std::string("default");
  const auto& md = ctx->client_metadata();
  auto it = md.find("x-api-key");
  if (it == md.end()) return absl::UnauthenticatedError("x-api-key: missing API key");
  return TenantOf(std::string(it->second.data(), it->second.size()));
}

}  // namespace tinkerd
