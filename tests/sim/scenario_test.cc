// Scenario files: what they set, and errors that name the key and the problem.
#include <filesystem>
#include <fstream>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "epx/sim/scenario.h"
#include "observe/temp_dir.h"

namespace epx::sim {
namespace {

// A folder of this process's own: ctest runs these tests as concurrent
// processes, and a shared one let one test truncate another's profile.
std::string write_file(const std::string& name, const std::string& text) {
  static const epx::testing::TempDir dir;
  const std::string path = dir.file(name);
  std::ofstream(path) << text;
  return path;
}

const char* kProfile = R"(name = "test gpu"
[compute]
bf16_flops = 1e15
fp8_flops = 2e15
sms = 100
[memory]
hbm_bandwidth = 3e12
[nvlink]
bandwidth = 4e11
[nic]
bandwidth = 5e10
[comm]
sms = 20
)";

std::string scenario_with(const std::string& extra) {
  write_file("sim_profile.toml", kProfile);
  return "[hardware]\nprofile = \"sim_profile.toml\"\n[cluster]\nnodes = 2\ngpus_per_node = 4\n"
         "[model]\nlayers = 2\nexperts = 16\ntopk = 2\n[parallelism]\nep = 8\n" + extra;
}

TEST(SimScenario, ReadsTheProfileAndTheScenarioAndOverridesInOrder) {
  const std::string path = write_file("good.toml", scenario_with("[hardware.nic]\nbandwidth = 2.5e10\n"));
  auto s = load_scenario(path);
  ASSERT_TRUE(s.is_ok()) << s.status().message();
  EXPECT_EQ(s->hardware.name, "test gpu");
  EXPECT_DOUBLE_EQ(s->hardware.bf16_flops, 1e15);
  EXPECT_DOUBLE_EQ(s->hardware.nic_bandwidth, 2.5e10);  // the scenario overrides the profile
  EXPECT_EQ(s->hardware.comm_sms, 20);
  EXPECT_EQ(s->model.topk, 2);
  EXPECT_EQ(s->num_gpus(), 8);
  EXPECT_EQ(s->ep_groups_per_stage(), 1);
  ASSERT_TRUE(set_value(*s, "model.topk", "4").is_ok());
  EXPECT_EQ(s->model.topk, 4);
  ASSERT_TRUE(set_value(*s, "hardware.nvlink.efficiency", "0.5").is_ok());
  EXPECT_DOUBLE_EQ(s->hardware.nvlink_efficiency, 0.5);
  EXPECT_EQ(row_bytes("fp8", 7168).value(), 7168 + 56 * 4);
}

void expect_error(const std::string& extra, const std::string& needle) {
  const std::string path = write_file("bad.toml", scenario_with(extra));
  auto s = load_scenario(path);
  ASSERT_FALSE(s.is_ok()) << "accepted: " << extra;
  EXPECT_NE(s.status().message().find(needle), std::string::npos) << s.status().message();
  EXPECT_NE(s.status().message().find("bad.toml"), std::string::npos) << s.status().message();
}

TEST(SimScenario, BadFilesNameTheKeyAndTheProblem) {
  expect_error("[routing]\ndistribution = \"pareto\"\n",
               "routing.distribution = 'pareto' is not one of uniform, zipf, lognormal, trace");
  expect_error("[routing]\nsample_tokens = 0\n", "routing.sample_tokens = 0 is outside [1, 65536]");
  expect_error("[run]\nsteps = \"ten\"\n", "run.steps must be an integer");
  expect_error("[balancing]\ntopkk = 3\n", "unknown key 'balancing.topkk'");
  expect_error("[schedule]\noverlap = \"two_micro_batch\"\n", "needs an even parallelism.micro_batches (it is 1)");
  expect_error("[hardware.comm]\nsms = 100\n", "hardware.comm.sms = 100 is outside [0, hardware.compute.sms = 100)");
  expect_error("[hardware.nic]\nper_gpu = true\n", "hardware.nic.per_gpu must be an integer");
}

TEST(SimScenario, ShapeErrorsNameBothValues) {
  // Keys repeated in a file are a TOML error, so these replace values by text.
  const std::string path = write_file("shape.toml", scenario_with(""));
  auto s = load_scenario(path);
  ASSERT_TRUE(s.is_ok()) << s.status().message();
  Scenario t = *s;
  ASSERT_TRUE(set_value(t, "parallelism.ep", "3").is_ok());
  EXPECT_NE(t.validate().message().find("parallelism.ep x parallelism.pp_stages = 3 x 1 must divide the 8 GPUs"),
            std::string::npos)
      << t.validate().message();
  t = *s;
  ASSERT_TRUE(set_value(t, "model.topk", "17").is_ok());
  EXPECT_NE(t.validate().message().find("model.topk = 17 is outside [1, model.experts = 16]"), std::string::npos);
  EXPECT_NE(set_value(t, "model.topk", "x").message().find("model.topk = 'x' is not an integer"), std::string::npos);
  EXPECT_NE(set_value(t, "nope.key", "1").message().find("unknown key 'nope.key'"), std::string::npos);
  // combine_per_rank is epx's low-latency option only.
  t = *s;
  ASSERT_TRUE(set_value(t, "parallelism.combine_per_rank", "true").is_ok());
  EXPECT_NE(t.validate().message().find(
                "parallelism.combine_per_rank = true needs parallelism.dispatch = 'low_latency_epx', got 'two_hop'"),
            std::string::npos)
      << t.validate().message();
  ASSERT_TRUE(set_value(t, "parallelism.dispatch", "low_latency_epx").is_ok());
  EXPECT_TRUE(t.validate().is_ok()) << t.validate().message();
}

TEST(SimScenario, MissingProfileAndSyntaxErrorsSayWhere) {
  auto missing = load_scenario(write_file("noprof.toml", "[hardware]\nprofile = \"absent.toml\"\n"));
  ASSERT_FALSE(missing.is_ok());
  EXPECT_NE(missing.status().message().find("absent.toml': No such file or directory"), std::string::npos)
      << missing.status().message();
  EXPECT_NE(missing.status().message().find("hardware.profile in"), std::string::npos);
  auto syntax = load_scenario(write_file("syntax.toml", "[model\nlayers = 2\n"));
  ASSERT_FALSE(syntax.is_ok());
  EXPECT_NE(syntax.status().message().find("syntax.toml:1:"), std::string::npos) << syntax.status().message();
}

// Found by fuzz/sim_scenario_fuzz.cc: a profile naming /dev/zero was read
// without end, and one naming a directory parsed as an empty profile.
TEST(SimScenario, AProfileThatIsNotARegularFileIsRefused) {
  for (const char* profile : {"/dev/zero", "."}) {
    auto s = load_scenario(write_file("devprof.toml", fmt::format("[hardware]\nprofile = \"{}\"\n", profile)));
    ASSERT_FALSE(s.is_ok()) << profile;
    EXPECT_EQ(s.status().code(), StatusCode::kInvalidArgument) << s.status().message();
    EXPECT_NE(s.status().message().find(", not a regular file; epx reads only regular files here (hardware.profile in"), std::string::npos)
        << s.status().message();
  }
}

TEST(SimScenario, ParsesFromTextAsFromTheFile) {
  const std::string text = scenario_with("");
  auto from_file = load_scenario(write_file("text.toml", text));
  auto from_text = parse_scenario(text, write_file("other.toml", ""));
  ASSERT_TRUE(from_file.is_ok()) << from_file.status().message();
  ASSERT_TRUE(from_text.is_ok()) << from_text.status().message();
  EXPECT_EQ(from_text->hardware.sms, 100);
  EXPECT_EQ(from_text->cluster.gpus_per_node, from_file->cluster.gpus_per_node);
  EXPECT_EQ(from_text->model.experts, 16);
  auto bad = parse_scenario("[model\n", "text.toml");
  ASSERT_FALSE(bad.is_ok());
  EXPECT_NE(bad.status().message().find("text.toml:1:"), std::string::npos) << bad.status().message();
}

}  // namespace
}  // namespace epx::sim
