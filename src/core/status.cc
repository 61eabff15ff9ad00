#include "epx/core/status.h"

#include <cstdio>

namespace epx {

std::string_view status_code_name(StatusCode code) {
  switch (code) {
    case StatusCode::kOk: return "OK";
    case StatusCode::kInvalidArgument: return "InvalidArgument";
    case StatusCode::kOutOfRange: return "OutOfRange";
    case StatusCode::kFailedPrecondition: return "FailedPrecondition";
    case StatusCode::kResourceExhausted: return "ResourceExhausted";
    case StatusCode::kDeadlineExceeded: return "DeadlineExceeded";
    case StatusCode::kAborted: return "Aborted";
    case StatusCode::kUnimplemented: return "Unimplemented";
    case StatusCode::kInternal: return "Internal";
    case StatusCode::kNotFound: return "NotFound";
  }
  return "Unknown";
}

namespace {

// The length of the valid UTF-8 sequence of a printable character at
// text[i], or 0: control bytes, DEL, C1 controls (U+0080..U+009F), stray or
// truncated sequences, overlong forms and surrogates are not.
std::size_t printable_length(std::string_view text, std::size_t i) {
  const auto byte = [&](std::size_t k) { return static_cast<unsigned char>(text[k]); };
  const unsigned char b = byte(i);
  if (b == '\n' || b == '\t') return 1;
  if (b < 0x20 || b == 0x7f) return 0;
  if (b < 0x80) return 1;
  std::size_t n = 0;
  unsigned char lo = 0x80, hi = 0xbf;  // the range of the second byte
  if (b >= 0xc2 && b <= 0xdf) {
    n = 2;
    if (b == 0xc2) lo = 0xa0;  // C1 controls
  } else if (b >= 0xe0 && b <= 0xef) {
    n = 3;
    if (b == 0xe0) lo = 0xa0;
    if (b == 0xed) hi = 0x9f;
  } else if (b >= 0xf0 && b <= 0xf4) {
    n = 4;
    if (b == 0xf0) lo = 0x90;
    if (b == 0xf4) hi = 0x8f;
  } else {
    return 0;
  }
  if (i + n > text.size() || byte(i + 1) < lo || byte(i + 1) > hi) return 0;
  for (std::size_t k = 2; k < n; ++k)
    if ((byte(i + k) & 0xc0) != 0x80) return 0;
  return n;
}

}  // namespace

std::string printable(std::string_view text) {
  std::size_t i = 0;
  while (i < text.size() && printable_length(text, i) > 0) i += printable_length(text, i);
  if (i == text.size()) return std::string(text);  // the usual case: nothing to escape
  std::string out(text.substr(0, i));
  while (i < text.size()) {
    const std::size_t n = printable_length(text, i);
    if (n > 0) {
      out.append(text.substr(i, n));
      i += n;
    } else {
      out += fmt::format("\\x{:02x}", static_cast<unsigned char>(text[i++]));
    }
  }
  return out;
}

std::string Status::to_string() const {
  if (is_ok()) return "OK";
  return fmt::format("{}: {}", status_code_name(code_), message_);
}

namespace detail {

void die_on_bad_result(const Status& status) {
  std::fprintf(stderr, "epx: value() on a failed Result: %s\n", status.to_string().c_str());
  std::abort();
}

void check_failed(const char* file, int line, const std::string& what) {
  std::fprintf(stderr, "epx: %s:%d: %s failed\n", file, line, what.c_str());
  std::abort();
}

}  // namespace detail
}  // namespace epx
