#include "epx/observe/chrome_trace.h"

#include <gtest/gtest.h>

#include <map>
#include <nlohmann/json.hpp>

#include "observe/temp_dir.h"

namespace epx {
namespace {

using epx::testing::read_file;
using epx::testing::TempDir;
using nlohmann::json;

std::vector<json> events_with_phase(const json& trace, const std::string& ph) {
  std::vector<json> out;
  for (const json& e : trace.at("traceEvents"))
    if (e.at("ph") == ph) out.push_back(e);
  return out;
}

// Two ranks, three spans, by hand: times relative to the earliest begin (1000 ns).
TEST(ChromeTrace, HandCheckedSpans) {
  TempDir dir;
  const std::vector<TraceSpan> spans = {
      {"dispatch", 0, 1000, 3500},   // ts 0, dur 2.5 us
      {"combine", 0, 4000, 4001},    // ts 3, dur 0.001 us
      {"dispatch", 1, 2000, 12000},  // ts 1, dur 10 us
  };
  const std::string path = dir.file("trace.json");
  ASSERT_TRUE(write_chrome_trace(spans, path).is_ok());
  const json trace = json::parse(read_file(path));

  const std::vector<json> x = events_with_phase(trace, "X");
  ASSERT_EQ(x.size(), 3u);
  const struct { const char* name; int tid; double ts, dur; } want[] = {
      {"dispatch", 0, 0.0, 2.5}, {"combine", 0, 3.0, 0.001}, {"dispatch", 1, 1.0, 10.0}};
  for (int i = 0; i < 3; ++i) {
    SCOPED_TRACE(i);
    EXPECT_EQ(x[i].at("name"), want[i].name);
    EXPECT_EQ(x[i].at("pid"), 0);
    EXPECT_EQ(x[i].at("tid"), want[i].tid);
    EXPECT_DOUBLE_EQ(x[i].at("ts").get<double>(), want[i].ts);
    EXPECT_DOUBLE_EQ(x[i].at("dur").get<double>(), want[i].dur);
  }

  std::map<std::string, std::string> names;  // "process" or "tid N" -> name
  for (const json& m : events_with_phase(trace, "M")) {
    EXPECT_EQ(m.at("pid"), 0);
    if (m.at("name") == "process_name") names["process"] = m.at("args").at("name");
    if (m.at("name") == "thread_name")
      names["tid " + std::to_string(m.at("tid").get<int>())] = m.at("args").at("name");
  }
  EXPECT_EQ(names, (std::map<std::string, std::string>{{"process", "epx"}, {"tid 0", "rank 0"}, {"tid 1", "rank 1"}}));
}

TEST(ChromeTrace, FromATracerWithOddNames) {
  TempDir dir;
  Tracer tracer;
  tracer.record({"quote \" and \\ backslash", 3, 50, 60});
  tracer.record({"tab\tnewline\n", 7, 40, 45});
  const std::string path = dir.file("t.json");
  ASSERT_TRUE(write_chrome_trace(tracer.spans(), path).is_ok());
  const json trace = json::parse(read_file(path));
  const std::vector<json> x = events_with_phase(trace, "X");
  ASSERT_EQ(x.size(), 2u);
  EXPECT_EQ(x[0].at("name"), "quote \" and \\ backslash");  // rank 3 sorts first
  EXPECT_EQ(x[0].at("tid"), 3);
  EXPECT_DOUBLE_EQ(x[0].at("ts").get<double>(), 0.01);
  EXPECT_EQ(x[1].at("name"), "tab\tnewline\n");
  EXPECT_DOUBLE_EQ(x[1].at("ts").get<double>(), 0.0);
}

TEST(ChromeTrace, NoSpansGiveAValidTrace) {
  TempDir dir;
  const std::string path = dir.file("empty.json");
  ASSERT_TRUE(write_chrome_trace({}, path).is_ok());
  const json trace = json::parse(read_file(path));
  EXPECT_TRUE(events_with_phase(trace, "X").empty());
  EXPECT_EQ(events_with_phase(trace, "M").size(), 1u);  // the process name
}

TEST(ChromeTrace, OverwritesAnOldTraceAndLeavesNoTemporaryFile) {
  TempDir dir;
  const std::string path = dir.file("trace.json");
  const std::vector<TraceSpan> a = {{"a", 0, 0, 10}};
  const std::vector<TraceSpan> b = {{"b", 0, 0, 10}, {"b", 1, 5, 10}};
  ASSERT_TRUE(write_chrome_trace(a, path).is_ok());
  ASSERT_TRUE(write_chrome_trace(b, path).is_ok());
  EXPECT_EQ(events_with_phase(json::parse(read_file(path)), "X").size(), 2u);
  EXPECT_EQ(dir.names(), std::vector<std::string>{"trace.json"});
}

TEST(ChromeTrace, MissingFolderIsNotFoundNamingThePath) {
  TempDir dir;
  const std::string path = dir.file("no/such/folder/trace.json");
  const Status s = write_chrome_trace(std::vector<TraceSpan>{{"a", 0, 0, 1}}, path);
  EXPECT_EQ(s.code(), StatusCode::kNotFound);
  EXPECT_NE(s.message().find(path), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("No such file or directory"), std::string::npos) << s.message();
  EXPECT_TRUE(dir.names().empty());
}

// The rename fails (the path is a folder) after the whole trace was written to
// the temporary file: nothing may be left behind.
TEST(ChromeTrace, FailedRenameLeavesNoFile) {
  TempDir dir;
  const std::string path = dir.file("a_folder");
  std::filesystem::create_directory(path);
  std::filesystem::create_directory(dir.file("a_folder/inside"));
  const Status s = write_chrome_trace(std::vector<TraceSpan>{{"a", 0, 0, 1}}, path);
  EXPECT_FALSE(s.is_ok());
  EXPECT_NE(s.message().find(path), std::string::npos) << s.message();
  EXPECT_EQ(dir.names(), std::vector<std::string>{"a_folder"});
  EXPECT_TRUE(std::filesystem::is_directory(path));
}

TEST(ChromeTrace, SpanEndingBeforeItBeginsIsRejectedAndNothingWritten) {
  TempDir dir;
  const std::string path = dir.file("trace.json");
  const Status s = write_chrome_trace(std::vector<TraceSpan>{{"ok", 0, 0, 1}, {"bad", 2, 10, 5}}, path);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "spans[1] 'bad' on rank 2 ends before it begins (begin_ns = 10, end_ns = 5)");
  EXPECT_TRUE(dir.names().empty());
}

}  // namespace
}  // namespace epx
