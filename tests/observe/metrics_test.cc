#include "epx/observe/metrics.h"

#include <gtest/gtest.h>
#include <sys/resource.h>

#include <csignal>

#include <nlohmann/json.hpp>

#include "observe/temp_dir.h"

namespace epx {
namespace {

using epx::testing::read_file;
using epx::testing::TempDir;

TEST(Metrics, WritesOneParsableLinePerCall) {
  TempDir dir;
  const std::string path = dir.file("metrics.jsonl");
  Result<MetricsWriter> writer = MetricsWriter::open(path);
  ASSERT_TRUE(writer.is_ok()) << writer.status().to_string();
  ASSERT_TRUE(writer->write(R"({"step": 1, "loss": 0.5})").is_ok());
  // Flushed at once: readable while the writer is still open.
  EXPECT_EQ(read_file(path), "{\"step\": 1, \"loss\": 0.5}\n");
  ASSERT_TRUE(writer->write(R"({"step": 2, "loss": 0.25, "name": "a\nb"})").is_ok());
  EXPECT_EQ(writer->lines_written(), 2);

  std::istringstream lines(read_file(path));
  std::string line;
  std::vector<nlohmann::json> parsed;
  while (std::getline(lines, line)) parsed.push_back(nlohmann::json::parse(line));
  ASSERT_EQ(parsed.size(), 2u);
  EXPECT_EQ(parsed[1].at("step"), 2);
  EXPECT_EQ(parsed[1].at("name"), "a\nb");
}

TEST(Metrics, RejectsWhatIsNotOneJsonObject) {
  TempDir dir;
  const std::string path = dir.file("m.jsonl");
  MetricsWriter writer = std::move(MetricsWriter::open(path)).value();
  for (const char* bad : {"", "[1, 2]", "42", "{\"a\": 1", "{\"a\": 1}\n", "{\"a\":\n1}", "{\"a\": 1} {\"b\": 2}"}) {
    const Status s = writer.write(bad);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << "'" << bad << "'";
  }
  EXPECT_EQ(writer.write("[1]").message(), "a metrics line must be one JSON object; got '[1]'");
  EXPECT_EQ(read_file(path), "");
  EXPECT_EQ(writer.lines_written(), 0);
}

TEST(Metrics, AppendKeepsEarlierLinesAndTruncateDoesNot) {
  TempDir dir;
  const std::string path = dir.file("m.jsonl");
  {
    MetricsWriter w = std::move(MetricsWriter::open(path)).value();
    ASSERT_TRUE(w.write(R"({"step":1})").is_ok());
  }
  {
    MetricsWriter w = std::move(MetricsWriter::open(path, /*append=*/true)).value();
    ASSERT_TRUE(w.write(R"({"step":2})").is_ok());
  }
  EXPECT_EQ(read_file(path), "{\"step\":1}\n{\"step\":2}\n");
  {
    MetricsWriter w = std::move(MetricsWriter::open(path)).value();
    ASSERT_TRUE(w.write(R"({"step":3})").is_ok());
  }
  EXPECT_EQ(read_file(path), "{\"step\":3}\n");
}

TEST(Metrics, MovedWriterKeepsWritingAndClosedOneRefuses) {
  TempDir dir;
  const std::string path = dir.file("m.jsonl");
  MetricsWriter a = std::move(MetricsWriter::open(path)).value();
  ASSERT_TRUE(a.write(R"({"i":0})").is_ok());
  MetricsWriter b = std::move(a);
  ASSERT_TRUE(b.write(R"({"i":1})").is_ok());
  MetricsWriter c = std::move(MetricsWriter::open(dir.file("other.jsonl"))).value();
  c = std::move(b);  // closes other.jsonl, takes over m.jsonl
  ASSERT_TRUE(c.write(R"({"i":2})").is_ok());
  EXPECT_EQ(c.lines_written(), 3);
  ASSERT_TRUE(c.close().is_ok());
  EXPECT_EQ(c.write(R"({"i":3})").code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(read_file(path), "{\"i\":0}\n{\"i\":1}\n{\"i\":2}\n");
}

TEST(Metrics, DashIsStdout) {
  ::testing::internal::CaptureStdout();
  {
    MetricsWriter w = std::move(MetricsWriter::open("-")).value();
    ASSERT_TRUE(w.write(R"({"to":"stdout"})").is_ok());
  }
  EXPECT_EQ(::testing::internal::GetCapturedStdout(), "{\"to\":\"stdout\"}\n");
}

TEST(Metrics, UnopenablePathNamesThePathAndTheReason) {
  TempDir dir;
  const std::string path = dir.file("missing/m.jsonl");
  const Result<MetricsWriter> w = MetricsWriter::open(path);
  ASSERT_FALSE(w.is_ok());
  EXPECT_EQ(w.status().code(), StatusCode::kNotFound);
  EXPECT_EQ(w.status().message(), "cannot open the metrics file '" + path + "': No such file or directory");
  EXPECT_EQ(MetricsWriter::open("").status().code(), StatusCode::kInvalidArgument);
}

// A write that fails halfway (here: past RLIMIT_FSIZE, the same short write
// then error as a full disk) leaves the file at its last whole line.
TEST(Metrics, FailedWriteCutsTheFileBackToItsLastWholeLine) {
  TempDir dir;
  const std::string path = dir.file("m.jsonl");
  MetricsWriter writer = std::move(MetricsWriter::open(path)).value();
  ASSERT_TRUE(writer.write(R"({"step":0})").is_ok());
  const std::size_t whole = read_file(path).size();

  rlimit saved{};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &saved), 0);
  const auto old_handler = std::signal(SIGXFSZ, SIG_IGN);
  rlimit small = saved;
  small.rlim_cur = whole + 5;  // room for 5 bytes of the next line
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &small), 0);
  const Status s = writer.write(R"({"step":1,"loss":0.125})");
  ::setrlimit(RLIMIT_FSIZE, &saved);
  std::signal(SIGXFSZ, old_handler);

  ASSERT_FALSE(s.is_ok());
  EXPECT_EQ(s.message(), "cannot write the metrics file '" + path + "': File too large");
  EXPECT_EQ(read_file(path), "{\"step\":0}\n");
  EXPECT_EQ(writer.lines_written(), 1);
  EXPECT_EQ(writer.write(R"({"step":2})").code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(read_file(path), "{\"step\":0}\n");
}

TEST(Metrics, AppendKeepsWholeLinesAfterAFailedWrite) {
  TempDir dir;
  const std::string path = dir.file("m.jsonl");
  { ASSERT_TRUE(std::move(MetricsWriter::open(path)).value().write(R"({"run":1})").is_ok()); }
  MetricsWriter writer = std::move(MetricsWriter::open(path, /*append=*/true)).value();
  rlimit saved{};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &saved), 0);
  const auto old_handler = std::signal(SIGXFSZ, SIG_IGN);
  rlimit small = saved;
  small.rlim_cur = read_file(path).size() + 3;
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &small), 0);
  const Status s = writer.write(R"({"run":2,"step":0})");
  ::setrlimit(RLIMIT_FSIZE, &saved);
  std::signal(SIGXFSZ, old_handler);
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted) << s.to_string();
  EXPECT_EQ(read_file(path), "{\"run\":1}\n");
}

}  // namespace
}  // namespace epx
