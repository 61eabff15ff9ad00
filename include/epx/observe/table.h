// format_table: rows of strings as an aligned plain-text table, for reports
// and command output.
//
//   std::cout << epx::format_table({"rank", "tokens", "phase"},
//                                  {{"0", "4096", "dispatch"}, {"1", "512", "combine"}});
//
//   rank  tokens  phase
//   ----  ------  --------
//      0    4096  dispatch
//      1     512  combine
//
// A column whose non-empty body cells are all numbers (as std::from_chars reads
// a double, optionally followed by '%' or 'x') is right-aligned, header
// included; other columns are left-aligned. Columns are two spaces apart, a
// dashed line sits under the header, lines have no trailing spaces and each
// ends with '\n'. Short rows are padded with empty cells. Widths count UTF-8
// code points, so "µs" is two wide.
#pragma once

#include <string>
#include <vector>

namespace epx {

[[nodiscard]] std::string format_table(const std::vector<std::string>& header,
                                       const std::vector<std::vector<std::string>>& rows);

}  // namespace epx
