// Reads a JSON request's fields, keeping the first error, which names the field. Torch- and
// gRPC-free, so the request fuzzer can drive what uses it.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <type_traits>

#include <nlohmann/json.hpp>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace tinkerd::http {

// Reads a JSON object's fields, keeping the first error (which names the field).
class Fields {
 public:
  explicit Fields(const nlohmann::json& j) : j_(j) {}

  std::string Str(const char* name) {
    return Get<std::string>(name, "a string", true).value_or("");
  }
  std::optional<std::string> OptStr(const char* name) {
    return Get<std::string>(name, "a string", false);
  }
  int64_t Int(const char* name) { return OptInt(name, true).value_or(0); }
  std::optional<int64_t> OptInt(const char* name, bool required = false) {
    const nlohmann::json* v = Find(name, required);
    if (v == nullptr) return std::nullopt;
    if (!v->is_number_integer()) return Fail(name, "an integer");
    return v->get<int64_t>();
  }
  std::optional<double> OptNum(const char* name) {
    const nlohmann::json* v = Find(name, false);
    if (v == nullptr) return std::nullopt;
    if (!v->is_number()) return Fail(name, "a number");
    return v->get<double>();
  }
  std::optional<bool> OptBool(const char* name) { return Get<bool>(name, "a boolean", false); }
  // An object field (absent or null: nullptr).
  const nlohmann::json* Obj(const char* name) {
    const nlohmann::json* v = Find(name, false);
    if (v != nullptr && !v->is_object()) {
      Fail(name, "an object");
      return nullptr;
    }
    return v;
  }

  const absl::Status& status() const { return status_; }

 private:
  const nlohmann::json* Find(const char* name, bool required) {
    auto it = j_.find(name);
    if (it == j_.end() || it->is_null()) {
      if (required && status_.ok()) {
        status_ = absl::InvalidArgumentError(absl::StrCat(name, ": required"));
      }
      return nullptr;
    }
    return &*it;
  }
  template <typename T>
  std::optional<T> Get(const char* name, const char* what, bool required) {
    const nlohmann::json* v = Find(name, required);
    if (v == nullptr) return std::nullopt;
    if constexpr (std::is_same_v<T, std::string>) {
      if (!v->is_string()) return Fail(name, what);
    } else {
      if (!v->is_boolean()) return Fail(name, what);
    }
    return v->get<T>();
  }
  std::nullopt_t Fail(const char* name, const char* what) {
    if (status_.ok()) {
      status_ = absl::InvalidArgumentError(absl::StrCat(name, ": must be ", what));
    }
    return std::nullopt;
  }

  const nlohmann::json& j_;
  absl::Status status_;
};

}  // namespace tinkerd::http
