#include "epx/observe/output_path.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <vector>

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

namespace epx {
namespace {

using epx::testing::TempDir;

Status apart(std::vector<CommandPath> inputs, std::vector<CommandPath> outputs) {
  return check_outputs_apart(inputs, outputs);
}

TEST(OutputsApart, AnOutputThatIsAnInputIsRefusedByInodeAndByPath) {
  TempDir dir;
  const std::string m = dir.file("m.jsonl");
  std::ofstream(m) << "{\"step\":0}\n";
  std::filesystem::create_symlink(m, dir.file("link.jsonl"));
  std::filesystem::create_hard_link(m, dir.file("hard.jsonl"));
  const Status same = apart({{"metrics", m, false}}, {{"--output", m, false}});
  EXPECT_EQ(same.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(same.message(), "--output '" + m + "' and metrics '" + m +
                                "' are the same file: the output would overwrite what this command reads; name "
                                "another --output (nothing was written)");
  for (const char* other : {"link.jsonl", "hard.jsonl"})
    EXPECT_FALSE(apart({{"metrics", m, false}}, {{"--output", dir.file(other), false}}).is_ok()) << other;
  const std::string dotted = (dir.path() / "." / "sub" / ".." / "m.jsonl").string();
  std::filesystem::create_directory(dir.path() / "sub");
  EXPECT_FALSE(apart({{"metrics", m, false}}, {{"--output", dotted, false}}).is_ok());
  EXPECT_TRUE(apart({{"metrics", m, false}}, {{"--output", dir.file("r.html"), false}}).is_ok());
  EXPECT_EQ(testing::read_file(m), "{\"step\":0}\n");
}

TEST(OutputsApart, TwoOutputsOfOnePathAreRefusedEvenBeforeTheyExist) {
  TempDir dir;
  const std::string f = dir.file("new.json");
  const Status s = apart({}, {{"--metrics", f, false}, {"--trace", f, false}});
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("are the same file: one output would overwrite the other"), std::string::npos)
      << s.message();
  EXPECT_TRUE(dir.names().empty());
  // "-" (stdout) and "" (none) take no part.
  EXPECT_TRUE(apart({{"--config", "-", false}}, {{"--metrics", "-", false}, {"--trace", "", false}}).is_ok());
}

TEST(OutputsApart, NoFileOutputInsideACheckpointFolderButSaveMayBeTheResumeFolder) {
  TempDir dir;
  const std::string ck = dir.file("ck");
  std::filesystem::create_directory(ck);
  const Status in_save = apart({}, {{"--metrics", ck + "/m.jsonl", false}, {"--save", ck, true}});
  EXPECT_EQ(in_save.message(), "--metrics '" + ck + "/m.jsonl' lies inside the --save folder '" + ck +
                                   "': a checkpoint folder holds only epx's checkpoints; name a --metrics outside "
                                   "it (nothing was written)");
  EXPECT_FALSE(apart({{"--resume", ck, true}}, {{"--trace", ck + "/sub/t.json", false}}).is_ok());
  const Status at_save = apart({}, {{"--save", dir.file("X"), true}, {"--metrics", dir.file("X"), false}});
  EXPECT_NE(at_save.message().find("is the --save folder"), std::string::npos) << at_save.message();
  EXPECT_TRUE(apart({{"--resume", ck, true}}, {{"--save", ck, true}}).is_ok());
  EXPECT_TRUE(apart({{"--resume", ck, true}}, {{"--metrics", dir.file("ck2/m.jsonl"), false}}).is_ok());
}

}  // namespace
}  // namespace epx
