#include "epx/core/status.h"

#include <gtest/gtest.h>

namespace epx {
namespace {

Result<int> parse_small(int v) {
  if (v > 8) return invalid_argument("v = {} is above the limit 8", v);
  return v;
}

Status use(int v, int* out) {
  EPX_ASSIGN_OR_RETURN(*out, parse_small(v));
  EPX_RETURN_IF_ERROR(Status::ok());
  return Status::ok();
}

TEST(Status, OkAndErrors) {
  EXPECT_TRUE(Status::ok().is_ok());
  Status s = invalid_argument("topk_idx[{}][{}] = {} is outside [0, {})", 17, 3, 300, 256);
  EXPECT_FALSE(s.is_ok());
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s.to_string(), "InvalidArgument: topk_idx[17][3] = 300 is outside [0, 256)");
}

TEST(Status, MacrosPropagate) {
  int out = 0;
  EXPECT_TRUE(use(3, &out).is_ok());
  EXPECT_EQ(out, 3);
  Status s = use(9, &out);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "v = 9 is above the limit 8");
  EXPECT_EQ(out, 3);
}

TEST(Status, ResultFromOkStatusIsAnError) {
  Result<int> r(Status::ok());
  EXPECT_FALSE(r.is_ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInternal);
}

TEST(Status, PrintableEscapesWhatATerminalWouldActOn) {
  EXPECT_EQ(printable("plain text, tab\tand newline\n"), "plain text, tab\tand newline\n");
  EXPECT_EQ(printable("\x1b[31mred\x7f"), "\\x1b[31mred\\x7f");
  EXPECT_EQ(printable("caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80"), "caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80");  // UTF-8 kept
  EXPECT_EQ(printable("\xff\xc3"), "\\xff\\xc3");              // not UTF-8, and a cut sequence
  EXPECT_EQ(printable("\xc2\x9b"), "\\xc2\\x9b");              // U+009B, a C1 control (CSI)
  EXPECT_EQ(printable("\xc0\xaf \xed\xa0\x80"), "\\xc0\\xaf \\xed\\xa0\\x80");  // overlong, surrogate
  EXPECT_EQ(printable(std::string("a\0b", 3)), "a\\x00b");
  const std::string once = printable("\x01\x1b\xfe");
  EXPECT_EQ(printable(once), once);
}

TEST(Status, MessagesAreEscaped) {
  const Status s = invalid_argument("dtype '{}' is not f32 or bf16", "\x1b[2J");
  EXPECT_EQ(s.message(), "dtype '\\x1b[2J' is not f32 or bf16");
}

TEST(StatusDeathTest, CheckPrintsBothValues) {
  int a = 3, b = 4;
  EXPECT_DEATH(EPX_CHECK_EQ(a, b), "with a = 3, b = 4");
}

}  // namespace
}  // namespace epx
