// Status plumbing shared by every module: early-return helpers for absl::Status and StatusOr.
#pragma once

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define TINKERD_CONCAT_INNER(a, b) a##b
#define TINKERD_CONCAT(a, b) TINKERD_CONCAT_INNER(a, b)

// Returns from the enclosing function when `expr` yields a non-OK absl::Status.
#define RETURN_IF_ERROR(expr)    \
  do {                           \
    ::absl::Status _st = (expr); \
    if (!_st.ok()) return _st;   \
  } while (0)

// `ASSIGN_OR_RETURN(auto x, MakeX());` binds the value or returns the error.
#define ASSIGN_OR_RETURN(lhs, rexpr) \
  ASSIGN_OR_RETURN_IMPL(TINKERD_CONCAT(_statusor_, __LINE__), lhs, rexpr)
#define ASSIGN_OR_RETURN_IMPL(tmp, lhs, rexpr) \
  auto tmp = (rexpr);                          \
  if (!tmp.ok()) return tmp.status();          \
  lhs = std::move(tmp).value()
