// Statuses to Python exceptions, in one place.
//
// Each StatusCode raises its class of epx.errors (docs/python.md, "Errors"):
// InvalidArgument -> epx.InvalidArgumentError (a ValueError), DeadlineExceeded
// -> epx.DeadlineExceededError (a TimeoutError), ...; the message is epx's.
#pragma once

#include <string>
#include <string_view>
#include <utility>

#include "epx/core/status.h"

namespace epx::py {

// Raises the exception of `status` (which must not be OK).
[[noreturn]] void throw_status(const Status& status);
// Raises epx.<class_name> (an exception class of epx/errors.py) with `message`.
[[noreturn]] void throw_error(std::string_view class_name, std::string_view message);

inline void check(const Status& status) {
  if (!status.is_ok()) throw_status(status);
}
template <typename T>
T unwrap(Result<T> result) {
  if (!result.is_ok()) throw_status(result.status());
  return std::move(result).value();
}

// As unwrap, for a value parsed from argument `name`: the error becomes
// epx.InvalidArgumentError "name: <epx's message>".
template <typename T>
T unwrap_arg(Result<T> result, std::string_view name) {
  if (!result.is_ok()) throw_error("InvalidArgumentError", std::string(name) + ": " + result.status().message());
  return std::move(result).value();
}

}  // namespace epx::py
