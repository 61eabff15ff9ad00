// Checks of the `epx` command's numeric flags. in_range(min, max) is CLI11's
// Range with plainer words: a value that is not a number of the flag's type
// is said to be so ("'four' is not an integer"), one outside the range names
// the range ("Value -1 not in range 0 to 18446744073709551615"), and an
// integer written with an exponent ("1e8") is accepted as the integer. Add
// them with ->transform() (CLI11's ->check() would drop that rewriting):
//   cmd->add_option("--ranks", o.num_ranks)->transform(in_range(1, 256));
#pragma once

#include <charconv>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <string>
#include <type_traits>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "epx/core/status.h"

namespace epx::app {

namespace cli_detail {

// The whole of `text` as a finite number, or false.
inline bool whole_number(const std::string& text, long double& value) {
  if (text.empty() || std::isspace(static_cast<unsigned char>(text[0]))) return false;
  char* end = nullptr;
  value = std::strtold(text.c_str(), &end);
  return end == text.c_str() + text.size() && std::isfinite(value);
}

template <typename T>
std::string check_range(std::string& input, T min, T max) {
  const std::string range = fmt::format("not in range {} to {}", min, max);
  if constexpr (std::is_integral_v<T>) {
    T value{};
    const auto [end, ec] = std::from_chars(input.data(), input.data() + input.size(), value);
    if (ec == std::errc() && end == input.data() + input.size())
      return value < min || value > max ? fmt::format("Value {} {}", input, range) : std::string();
    long double number = 0;
    if (!whole_number(input, number) || number != std::floor(number))
      return fmt::format("'{}' is not an integer", printable(input));
    if (number < static_cast<long double>(min) || number > static_cast<long double>(max))
      return fmt::format("Value {} {}", input, range);
    input = fmt::format("{}", static_cast<T>(number));  // "1e8" -> "100000000", which CLI11 converts
    return std::string();
  } else {
    long double number = 0;
    if (!whole_number(input, number)) return fmt::format("'{}' is not a number", printable(input));
    if (number < static_cast<long double>(min) || number > static_cast<long double>(max))
      return fmt::format("Value {} {}", input, range);
    return std::string();
  }
}

}  // namespace cli_detail

template <typename T>
CLI::Validator in_range(T min, T max) {
  CLI::Validator v([min, max](std::string& input) { return cli_detail::check_range(input, min, max); },
                   fmt::format("{} in [{} - {}]", std::is_integral_v<T> ? "INT" : "FLOAT", min, max));
  return v;
}

// Any value of the flag's type T at least `min`.
template <typename T>
CLI::Validator at_least(T min) {
  return in_range(min, std::numeric_limits<T>::max());
}

}  // namespace epx::app
