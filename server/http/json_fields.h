// Reads a JSON request's fields, keeping the first error, which names the field. Torch- and
// gRPC-free, so the request fuzzer can drive what uses it.
#pragma once

#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <type_traits>

#include <nlohmann/json.hpp>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace tinkerd::http {

// A JSON integer that is an int64: nlohmann keeps integers in [2^63, 2^64) as unsigned, and
// reading them as int64 would wrap them (2^64 - 1 to -1).
inline bool IsInt64(const nlohmann::json& v) {
  return v.is_number_integer() &&
         !(v.is_number_unsigned() &&
           v.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()));
}

// Reads a JSON object's fields, keeping the first error (which names the field). Absent and null
// are absence; an empty string is a value, which no identifier takes.
class Fields {
 public:
  explicit Fields(const nlohmann::json& j) : j_(j) {}

  // A required identifier (an id, a name, a path): a non-empty string.
  std::string Str(const char* name) { return Id(name, true).value_or(""); }
  // An optional identifier: absent or null is nullopt; "" is refused, never taken for absence.
  std::optional<std::string> OptId(const char* name) { return Id(name, false); }
  // Any string, "" included.
  std::optional<std::string> OptStr(const char* name) {
    return Get<std::string>(name, "a string", false);
  }
  int64_t Int(const char* name) { return OptInt(name, true).value_or(0); }
  std::optional<int64_t> OptInt(const char* name, bool required = false) {
    const nlohmann::json* v = Find(name, required);
    if (v == nullptr) return std::nullopt;
    if (!v->is_number_integer()) return Fail(name, "an integer");
    if (!IsInt64(*v)) return Fail(name, "an integer in [-2^63, 2^63)");
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
  std::optional<std::string> Id(const char* name, bool required) {
    std::optional<std::string> v = Get<std::string>(name, "a string", required);
    if (v && v->empty()) return Fail(name, "a non-empty string");
    return v;
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
