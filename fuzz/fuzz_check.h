// What every fuzz target asserts about a reader's answer. A broken invariant
// prints both sides and aborts, which libFuzzer reports as a crash with the
// input that caused it.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

#include "epx/core/status.h"

#define EPX_FUZZ_CHECK(cond, ...)                                                            \
  do {                                                                                       \
    if (!(cond)) {                                                                           \
      std::fprintf(stderr, "%s:%d: fuzz invariant failed: %s\n", __FILE__, __LINE__, #cond); \
      ::epx::fuzz::print_context(__VA_ARGS__);                                               \
      std::abort();                                                                          \
    }                                                                                        \
  } while (0)

namespace epx::fuzz {

inline void print_context() {}
inline void print_context(const Status& s) { std::fprintf(stderr, "  status: %s\n", s.to_string().c_str()); }

inline std::string_view as_text(const uint8_t* data, size_t size) {
  return {reinterpret_cast<const char*>(data), size};
}

// A refused input is refused as the user's fault (InvalidArgument, or
// NotFound for a file it names), with a message that names `source`.
inline void check_refusal(const Status& s, std::string_view source) {
  EPX_FUZZ_CHECK(s.code() == StatusCode::kInvalidArgument || s.code() == StatusCode::kNotFound, s);
  EPX_FUZZ_CHECK(s.message().find(source) != std::string::npos, s);
}

}  // namespace epx::fuzz
