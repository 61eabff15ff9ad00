#include "epx/observe/output_path.h"

#include <gtest/gtest.h>

#include <fstream>

#include "observe/temp_dir.h"

namespace epx {
namespace {

using epx::testing::read_file;
using epx::testing::TempDir;

TEST(OutputPath, AWritablePlaceIsAcceptedAndNothingIsLeft) {
  TempDir dir;
  EXPECT_TRUE(check_output_writable(dir.file("m.jsonl"), "--metrics").is_ok());
  EXPECT_TRUE(check_output_writable(dir.file("t.json"), "--trace", /*renamed_into_place=*/true).is_ok());
  EXPECT_TRUE(dir.names().empty());
  EXPECT_TRUE(check_output_writable("-", "--metrics").is_ok());
}

TEST(OutputPath, AnExistingFileIsNotChanged) {
  TempDir dir;
  const std::string path = dir.file("m.jsonl");
  std::ofstream(path) << "{\"step\":0}\n";
  EXPECT_TRUE(check_output_writable(path, "--metrics").is_ok());
  EXPECT_TRUE(check_output_writable(path, "--trace", /*renamed_into_place=*/true).is_ok());
  EXPECT_EQ(read_file(path), "{\"step\":0}\n");
  EXPECT_EQ(dir.names(), std::vector<std::string>{"m.jsonl"});
}

TEST(OutputPath, UnwritablePlacesNameTheFlagThePathAndTheReason) {
  TempDir dir;
  const std::string file = dir.file("a_file");
  std::ofstream(file) << "x";
  const Status under_file = check_output_writable(file + "/m.jsonl", "--metrics");
  EXPECT_EQ(under_file.code(), StatusCode::kNotFound);
  EXPECT_EQ(under_file.message(),
            "--metrics " + file + "/m.jsonl: cannot reach '" + file + "/m.jsonl': Not a directory");
  const Status missing = check_output_writable(dir.file("none/t.json"), "--trace");
  EXPECT_EQ(missing.code(), StatusCode::kNotFound);
  EXPECT_EQ(missing.message(), "--trace " + dir.file("none/t.json") + ": cannot create a file in '" +
                                   dir.file("none") + "': No such file or directory");
  const Status folder = check_output_writable(dir.path().string(), "--metrics");
  EXPECT_EQ(folder.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(folder.message(), "--metrics " + dir.path().string() + ": cannot write '" + dir.path().string() +
                                  "': Is a directory");
  EXPECT_EQ(dir.names(), std::vector<std::string>{"a_file"});
}

}  // namespace
}  // namespace epx
