#include "epx/observe/table.h"

#include <algorithm>
#include <charconv>

namespace epx {
namespace {

// UTF-8 code points: every byte that is not a continuation byte.
std::size_t display_width(const std::string& s) {
  return static_cast<std::size_t>(
      std::count_if(s.begin(), s.end(), [](char c) { return (static_cast<unsigned char>(c) & 0xC0) != 0x80; }));
}

// A number as std::from_chars reads a double ("-1.5", "3e-4", "inf"),
// optionally followed by '%' or 'x' ("12.5%", "1.49x").
bool is_number(const std::string& s) {
  if (s.empty()) return false;
  std::size_t end = s.size();
  if (s.back() == '%' || s.back() == 'x') --end;
  const char* first = s.data();
  if (end > 0 && *first == '+') ++first;  // from_chars takes no '+'
  double value = 0;
  const auto [ptr, ec] = std::from_chars(first, s.data() + end, value);
  return ec == std::errc() && ptr == s.data() + end && ptr != first;
}

void append_cell(std::string* line, const std::string& cell, std::size_t width, bool right) {
  const std::size_t pad = width - display_width(cell);
  if (right) line->append(pad, ' ');
  *line += cell;
  if (!right) line->append(pad, ' ');
}

}  // namespace

std::string format_table(const std::vector<std::string>& header,
                         const std::vector<std::vector<std::string>>& rows) {
  std::size_t num_columns = header.size();
  for (const auto& row : rows) num_columns = std::max(num_columns, row.size());
  static const std::string kEmpty;
  const auto cell = [&](const std::vector<std::string>& row, std::size_t c) -> const std::string& {
    return c < row.size() ? row[c] : kEmpty;
  };

  std::vector<std::size_t> width(num_columns, 0);
  std::vector<bool> right(num_columns, false);
  for (std::size_t c = 0; c < num_columns; ++c) {
    width[c] = display_width(cell(header, c));
    bool any_number = false, all_numbers = true;
    for (const auto& row : rows) {
      const std::string& s = cell(row, c);
      width[c] = std::max(width[c], display_width(s));
      if (s.empty()) continue;
      if (is_number(s)) {
        any_number = true;
      } else {
        all_numbers = false;
      }
    }
    right[c] = any_number && all_numbers;
  }

  std::string out;
  const auto emit = [&](const std::vector<std::string>& row) {
    std::string line;
    for (std::size_t c = 0; c < num_columns; ++c) {
      if (c > 0) line += "  ";
      append_cell(&line, cell(row, c), width[c], right[c]);
    }
    line.erase(line.find_last_not_of(' ') + 1);
    out += line;
    out += '\n';
  };
  emit(header);
  std::vector<std::string> rule(num_columns);
  for (std::size_t c = 0; c < num_columns; ++c) rule[c] = std::string(width[c], '-');
  emit(rule);
  for (const auto& row : rows) emit(row);
  return out;
}

}  // namespace epx
