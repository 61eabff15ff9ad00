// Status and Result<T>: how every fallible epx call reports failure.
//
// No exception crosses the public API. A function that can fail on its input
// or on a peer returns `Status` or `Result<T>`; the message names the
// offending value and the limit it broke.
//
//   epx::Result<int> parse(std::string_view s);
//   epx::Status run() {
//     EPX_ASSIGN_OR_RETURN(int n, parse("42"));
//     if (n > 8) return epx::invalid_argument("n = {} is above the limit 8", n);
//     return epx::Status::ok();
//   }
#pragma once

#include <cstdlib>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include <fmt/format.h>

namespace epx {

enum class StatusCode : int {
  kOk = 0,
  kInvalidArgument,     // the caller's input is wrong; nothing was sent or changed
  kOutOfRange,          // a size or index is past a configured limit
  kFailedPrecondition,  // the object is not in a state to do this (e.g. stale handle)
  kResourceExhausted,   // a buffer is too small for what arrived
  kDeadlineExceeded,    // a peer did not arrive within the timeout
  kAborted,             // a peer failed, so this collective cannot complete
  kUnimplemented,       // the part exists in the API but is not built yet
  kInternal,            // an external library failed
  kNotFound,            // a named file or object does not exist
};

std::string_view status_code_name(StatusCode code);

// `text` safe to print on a terminal: every byte a terminal would act on is
// written as \xNN (control bytes but newline and tab, DEL, C1 controls, and
// bytes that are not valid UTF-8); everything else is kept. Printable text,
// this function's output included, comes back unchanged. Every Status
// message passes through it, so a file's bytes or a user's argument quoted
// in an error never reach the terminal raw.
std::string printable(std::string_view text);

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(printable(message)) {}

  static Status ok() { return Status(); }

  [[nodiscard]] bool is_ok() const { return code_ == StatusCode::kOk; }
  [[nodiscard]] StatusCode code() const { return code_; }
  [[nodiscard]] const std::string& message() const { return message_; }
  // "InvalidArgument: topk_idx[17][3] = 300 is outside [0, 256)".
  [[nodiscard]] std::string to_string() const;

  // Marks a status as deliberately dropped.
  void ignore() const {}

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

template <typename... Args>
Status make_status(StatusCode code, fmt::format_string<Args...> format, Args&&... args) {
  return Status(code, fmt::format(format, std::forward<Args>(args)...));
}
template <typename... Args>
Status invalid_argument(fmt::format_string<Args...> format, Args&&... args) {
  return make_status(StatusCode::kInvalidArgument, format, std::forward<Args>(args)...);
}
template <typename... Args>
Status out_of_range(fmt::format_string<Args...> format, Args&&... args) {
  return make_status(StatusCode::kOutOfRange, format, std::forward<Args>(args)...);
}
template <typename... Args>
Status failed_precondition(fmt::format_string<Args...> format, Args&&... args) {
  return make_status(StatusCode::kFailedPrecondition, format, std::forward<Args>(args)...);
}
template <typename... Args>
Status resource_exhausted(fmt::format_string<Args...> format, Args&&... args) {
  return make_status(StatusCode::kResourceExhausted, format, std::forward<Args>(args)...);
}
template <typename... Args>
Status deadline_exceeded(fmt::format_string<Args...> format, Args&&... args) {
  return make_status(StatusCode::kDeadlineExceeded, format, std::forward<Args>(args)...);
}
template <typename... Args>
Status aborted(fmt::format_string<Args...> format, Args&&... args) {
  return make_status(StatusCode::kAborted, format, std::forward<Args>(args)...);
}
template <typename... Args>
Status unimplemented(fmt::format_string<Args...> format, Args&&... args) {
  return make_status(StatusCode::kUnimplemented, format, std::forward<Args>(args)...);
}
template <typename... Args>
Status not_found(fmt::format_string<Args...> format, Args&&... args) {
  return make_status(StatusCode::kNotFound, format, std::forward<Args>(args)...);
}
template <typename... Args>
Status internal_error(fmt::format_string<Args...> format, Args&&... args) {
  return make_status(StatusCode::kInternal, format, std::forward<Args>(args)...);
}

// A value or the Status that explains why there is none.
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : value_(std::move(value)) {}  // NOLINT: implicit by design
  Result(Status status) : status_(std::move(status)) {  // NOLINT: implicit by design
    if (status_.is_ok()) status_ = Status(StatusCode::kInternal, "Result built from an OK status");
  }

  [[nodiscard]] bool is_ok() const { return value_.has_value(); }
  [[nodiscard]] const Status& status() const { return status_; }
  T& value() & { check(); return *value_; }
  const T& value() const& { check(); return *value_; }
  T&& value() && { check(); return std::move(*value_); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }

 private:
  void check() const;
  std::optional<T> value_;
  Status status_;
};

namespace detail {
[[noreturn]] void die_on_bad_result(const Status& status);
[[noreturn]] void check_failed(const char* file, int line, const std::string& what);
}  // namespace detail

template <typename T>
void Result<T>::check() const {
  if (!value_.has_value()) detail::die_on_bad_result(status_);
}

}  // namespace epx

#define EPX_CONCAT_INNER(a, b) a##b
#define EPX_CONCAT(a, b) EPX_CONCAT_INNER(a, b)

// Returns the status of `expr` from the enclosing function if it is not OK.
#define EPX_RETURN_IF_ERROR(expr)                       \
  do {                                                  \
    ::epx::Status epx_status_ = (expr);                 \
    if (!epx_status_.is_ok()) return epx_status_;       \
  } while (false)

// `EPX_ASSIGN_OR_RETURN(auto x, f());` unwraps a Result or returns its status.
#define EPX_ASSIGN_OR_RETURN(lhs, expr) \
  EPX_ASSIGN_OR_RETURN_IMPL(EPX_CONCAT(epx_result_, __LINE__), lhs, expr)
#define EPX_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                              \
  if (!tmp.is_ok()) return tmp.status();          \
  lhs = std::move(tmp).value()

// Invariant checks: a failure is a bug in epx, never bad input. They print
// both values and abort.
#define EPX_CHECK(cond)                                                        \
  do {                                                                         \
    if (!(cond)) ::epx::detail::check_failed(__FILE__, __LINE__, "EPX_CHECK(" #cond ")"); \
  } while (false)
#define EPX_CHECK_OP(a, op, b)                                                       \
  do {                                                                               \
    const auto& epx_a_ = (a);                                                        \
    const auto& epx_b_ = (b);                                                        \
    if (!(epx_a_ op epx_b_))                                                         \
      ::epx::detail::check_failed(__FILE__, __LINE__,                                \
                                  ::fmt::format("EPX_CHECK({} " #op " {}) with {} = {}, {} = {}", \
                                                #a, #b, #a, epx_a_, #b, epx_b_));    \
  } while (false)
#define EPX_CHECK_EQ(a, b) EPX_CHECK_OP(a, ==, b)
#define EPX_CHECK_NE(a, b) EPX_CHECK_OP(a, !=, b)
#define EPX_CHECK_LT(a, b) EPX_CHECK_OP(a, <, b)
#define EPX_CHECK_LE(a, b) EPX_CHECK_OP(a, <=, b)
#define EPX_CHECK_GE(a, b) EPX_CHECK_OP(a, >=, b)
