#include "epx/observe/table.h"

#include <gtest/gtest.h>

namespace epx {
namespace {

TEST(Table, HandCheckedAlignment) {
  const std::string got = format_table({"rank", "tokens", "phase"},
                                       {{"0", "4096", "dispatch"}, {"12", "512", "combine"}});
  EXPECT_EQ(got,
            "rank  tokens  phase\n"
            "----  ------  --------\n"
            "   0    4096  dispatch\n"
            "  12     512  combine\n");
}

TEST(Table, NumberFormsAndMixedColumns) {
  // Column 1: numbers in several forms (right); column 2: one text cell makes it left.
  const std::string got = format_table({"name", "value", "note"},
                                       {{"a", "-1.5", "3"},
                                        {"bb", "1e-3", "n/a"},
                                        {"c", "12.5%", ""},
                                        {"d", "+7", "4"},
                                        {"e", "1.49x", "5"}});
  EXPECT_EQ(got,
            "name  value  note\n"
            "----  -----  ----\n"
            "a      -1.5  3\n"
            "bb     1e-3  n/a\n"
            "c     12.5%\n"
            "d        +7  4\n"
            "e     1.49x  5\n");
}

TEST(Table, ShortRowsWideHeaderAndUtf8) {
  const std::string got = format_table({"time µs", "x"}, {{"1"}, {"22", "yy", "extra"}});
  EXPECT_EQ(got,
            "time µs  x\n"
            "-------  --  -----\n"
            "      1\n"
            "     22  yy  extra\n");
}

TEST(Table, HeaderOnly) {
  EXPECT_EQ(format_table({"a", "bcd"}, {}), "a  bcd\n-  ---\n");
}

}  // namespace
}  // namespace epx
