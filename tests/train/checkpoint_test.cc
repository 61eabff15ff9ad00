// Checkpoints: the part-file and meta.json formats round-trip, their parsers
// reject every truncation, bit flip and absurd length without crashing, a
// save never touches a folder epx does not own, keeps `keep` step folders
// behind an atomic `latest`, and a resume refuses each corruption (naming the
// file and what differs) before any step runs.
#include "train/checkpoint.h"

#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "epx/train/checkpoint_lock.h"
#include "epx/train/trainer.h"
#include "observe/temp_dir.h"
#include "train/tiny_config.h"

namespace epx {
namespace {

namespace fs = std::filesystem;
using detail::CheckpointMeta;
using detail::PartFileHeader;
using detail::PartState;

PartState small_state() {
  PartState s;
  s.adam_steps = 7;
  s.params.push_back({"embed", {1, 2, 3}, {0.1f, 0.2f, 0.3f}, {4, 5, 6}});
  s.params.push_back({"layer0.router", {-1, 0.5f}, {0, 0}, {1, 1}});
  s.biases = {{0.25f, -0.25f}};
  return s;
}

PartFileHeader small_header() {
  return {.part = 1, .num_ranks = 2, .num_nodes = 1, .step = 12, .model_hash = detail::model_hash("m")};
}

std::string read_text(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

void write_text(const fs::path& p, const std::string& text) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out << text;
}

// Recomputes a rank file's header and payload checksums after an edit.
void reseal(std::vector<uint8_t>& bytes) {
  const uint64_t payload = XXH3_64bits(bytes.data() + 72, bytes.size() - 72);
  std::memcpy(bytes.data() + 56, &payload, 8);
  const uint64_t header = XXH3_64bits(bytes.data(), 64);
  std::memcpy(bytes.data() + 64, &header, 8);
}

TEST(CheckpointFormat, PartFileRoundTrips) {
  const std::vector<uint8_t> bytes = detail::serialize_part_file(small_header(), small_state());
  PartFileHeader h;
  PartState s;
  ASSERT_TRUE(detail::parse_part_file(bytes, "f", &h, &s).is_ok());
  EXPECT_EQ(h.part, 1);
  EXPECT_EQ(h.num_ranks, 2);
  EXPECT_EQ(h.step, 12);
  EXPECT_EQ(h.model_hash, detail::model_hash("m"));
  EXPECT_EQ(s.adam_steps, 7);
  ASSERT_EQ(s.params.size(), 2u);
  EXPECT_EQ(s.params[0].name, "embed");
  EXPECT_EQ(s.params[0].m, (std::vector<float>{0.1f, 0.2f, 0.3f}));
  EXPECT_EQ(s.params[1].value, (std::vector<float>{-1, 0.5f}));
  EXPECT_EQ(s.biases, (std::vector<std::vector<float>>{{0.25f, -0.25f}}));
}

// Empty value lists (a layer without biases, a parameter of no values) round-
// trip; reading one once passed a null pointer to memcpy (found by the
// checkpoint fuzz target; UBSan fails this test without the fix).
TEST(CheckpointFormat, EmptyValueListsRoundTrip) {
  PartState state;
  state.params.push_back({"empty", {}, {}, {}});
  state.biases = {{}, {1.0f}};
  const std::vector<uint8_t> bytes = detail::serialize_part_file(small_header(), state);
  PartFileHeader h;
  PartState s;
  ASSERT_TRUE(detail::parse_part_file(bytes, "f", &h, &s).is_ok());
  ASSERT_EQ(s.params.size(), 1u);
  EXPECT_TRUE(s.params[0].value.empty());
  EXPECT_EQ(s.biases, (std::vector<std::vector<float>>{{}, {1.0f}}));
  EXPECT_EQ(detail::serialize_part_file(h, s), bytes);
}

// The header's reserved word is 0 in format 2; another value is refused even
// with the checksums made right (the fuzz target found one accepted once).
TEST(CheckpointFormat, ANonZeroReservedWordIsRefused) {
  std::vector<uint8_t> bytes = detail::serialize_part_file(small_header(), small_state());
  bytes[28] = 1;
  reseal(bytes);
  PartFileHeader h;
  PartState s;
  const Status status = detail::parse_part_file(bytes, "f", &h, &s);
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("reserved word is 1, not 0"), std::string::npos) << status.message();
}

TEST(CheckpointFormat, EveryTruncationAndBitFlipIsAnError) {
  const std::vector<uint8_t> bytes = detail::serialize_part_file(small_header(), small_state());
  for (std::size_t n = 0; n < bytes.size(); ++n) {
    PartFileHeader h;
    PartState s;
    EXPECT_FALSE(detail::parse_part_file(std::span(bytes).first(n), "f", &h, &s).is_ok()) << "first " << n << " bytes";
  }
  for (std::size_t i = 0; i < bytes.size(); ++i) {
    std::vector<uint8_t> flipped = bytes;
    flipped[i] ^= 0x10;
    PartFileHeader h;
    PartState s;
    EXPECT_FALSE(detail::parse_part_file(flipped, "f", &h, &s).is_ok()) << "bit 4 of byte " << i;
  }
  std::vector<uint8_t> longer = bytes;
  longer.push_back(0);
  PartFileHeader h;
  PartState s;
  Status st = detail::parse_part_file(longer, "f", &h, &s);
  EXPECT_NE(st.message().find("appended or cut"), std::string::npos) << st.to_string();
}

// Lengths that claim more than the file holds fail before anything is sized,
// even with valid checksums.
TEST(CheckpointFormat, AbsurdLengthsAreRefusedWithValidChecksums) {
  const std::vector<uint8_t> good = detail::serialize_part_file(small_header(), small_state());
  struct Patch {
    std::size_t at;
    uint64_t value;
    int width;
    const char* expect;
  };
  // Payload: adam_steps (8) at 72, num_params (4) at 80, name length (4) at 84,
  // "embed" (5), the value count (8) at 93.
  for (const Patch& p : {Patch{80, 0xffffffffu, 4, "parameters cannot fit"}, Patch{84, 0xfffffff0u, 4, "limit 4096"},
                         Patch{93, uint64_t{1} << 61, 8, "claims 2305843009213693952 values"}}) {
    std::vector<uint8_t> bytes = good;
    std::memcpy(bytes.data() + p.at, &p.value, static_cast<std::size_t>(p.width));
    reseal(bytes);
    PartFileHeader h;
    PartState s;
    Status st = detail::parse_part_file(bytes, "f", &h, &s);
    EXPECT_FALSE(st.is_ok());
    EXPECT_NE(st.message().find(p.expect), std::string::npos) << st.to_string();
  }
}

// A short, deterministic mutation run (random bytes overwritten, inserted or
// cut): the parser never crashes and never accepts a changed file.
TEST(CheckpointFormat, RandomMutationsNeverCrashOrPass) {
  const std::vector<uint8_t> good = detail::serialize_part_file(small_header(), small_state());
  uint64_t seed = 12345;
  auto next = [&] { return (seed = seed * 6364136223846793005u + 1442695040888963407u) >> 33; };
  for (int i = 0; i < 3000; ++i) {
    std::vector<uint8_t> bytes = good;
    for (int edits = 1 + static_cast<int>(next() % 4); edits > 0; --edits) {
      const std::size_t at = next() % (bytes.size() + 1);
      switch (next() % 3) {
        case 0: if (at < bytes.size()) bytes[at] = static_cast<uint8_t>(next()); break;
        case 1: bytes.insert(bytes.begin() + static_cast<std::ptrdiff_t>(at), static_cast<uint8_t>(next())); break;
        default: if (at < bytes.size()) bytes.erase(bytes.begin() + static_cast<std::ptrdiff_t>(at)); break;
      }
    }
    if (bytes == good) continue;
    PartFileHeader h;
    PartState s;
    EXPECT_FALSE(detail::parse_part_file(bytes, "f", &h, &s).is_ok()) << "mutation " << i;
  }
}

CheckpointMeta small_meta() {
  CheckpointMeta m;
  m.step = 12;
  m.num_ranks = 2;
  m.num_nodes = 1;
  m.ep = 2;
  m.num_slots = 4;
  m.fingerprint = "task=regression experts=8";
  m.files = {{"dense.bin", 100, 0x1234, {}},
             {"experts-0.bin", 101, 0xfedcba9876543210, {{0, 1}}},
             {"experts-1.bin", 102, 0x42, {{2}}}};
  m.layer_slots = {{0, 1, -1, 2}};
  m.eplb_window = {{5, 6, 7}};
  return m;
}

TEST(CheckpointFormat, MetaRoundTripsAndAnyEditIsCaught) {
  const std::string text = detail::format_checkpoint_meta(small_meta());
  CheckpointMeta m;
  ASSERT_TRUE(detail::parse_checkpoint_meta(text, "meta.json", &m).is_ok());
  EXPECT_EQ(m.step, 12);
  EXPECT_EQ(m.fingerprint, "task=regression experts=8");
  ASSERT_EQ(m.files.size(), 3u);
  EXPECT_EQ(m.files[1].xxh3, 0xfedcba9876543210u);
  EXPECT_EQ(m.ep, 2);
  EXPECT_EQ(m.num_slots, 4);
  EXPECT_TRUE(m.files[0].experts.empty());
  EXPECT_EQ(m.files[1].experts, (std::vector<std::vector<int32_t>>{{0, 1}}));
  EXPECT_EQ(m.files[2].experts, (std::vector<std::vector<int32_t>>{{2}}));
  EXPECT_EQ(m.layer_slots, small_meta().layer_slots);
  EXPECT_EQ(m.eplb_window, small_meta().eplb_window);

  std::string edited = text;
  edited.replace(edited.find("\"step\": 12"), 10, "\"step\": 13");
  Status s = detail::parse_checkpoint_meta(edited, "meta.json", &m);
  EXPECT_NE(s.message().find("edited or damaged"), std::string::npos) << s.to_string();
  for (std::size_t n = 0; n < text.size(); n += 7)
    EXPECT_FALSE(detail::parse_checkpoint_meta(text.substr(0, n), "meta.json", &m).is_ok()) << n;
  for (const char* junk : {"", "[]", "null", "{\"format\":\"epx-checkpoint\"}", "{\"format\":1}", "\xff\xfe"})
    EXPECT_FALSE(detail::parse_checkpoint_meta(junk, "meta.json", &m).is_ok()) << junk;
  // Deep nesting (a stack overflow for a recursive reader) is an error.
  std::string deep = text;
  deep.insert(deep.find("\"files\""), "\"x\": " + std::string(200000, '[') + std::string(200000, ']') + ", ");
  s = detail::parse_checkpoint_meta(deep, "meta.json", &m);
  EXPECT_NE(s.message().find("edited or damaged"), std::string::npos) << s.to_string();
  s = detail::parse_checkpoint_meta(R"({"format": "epx-checkpoint-1", "step": 3})", "meta.json", &m);
  EXPECT_NE(s.message().find("checkpoint format 1"), std::string::npos) << s.to_string();
}

// ---- through train() ----------------------------------------------------------

TrainConfig tiny(int num_ranks, int64_t steps) {
  return testing::tiny_config({.num_ranks = num_ranks, .steps = steps, .batch_tokens = 64, .hidden = 16,
                               .ffn_hidden = 16, .warmup = 1});
}

std::vector<std::string> entries(const fs::path& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

TEST(Checkpoint, SavesStepFoldersKeepsTheNewestAndResumesFromLatestOrAStep) {
  testing::TempDir tmp;
  TrainConfig c = tiny(2, 5);
  c.save_dir = (tmp.path() / "ck").string();
  c.save_every = 1;
  c.keep_checkpoints = 2;
  ASSERT_TRUE(train(c).is_ok());
  EXPECT_EQ(entries(c.save_dir),
            (std::vector<std::string>{".epx-checkpoints", "latest", "step-000004", "step-000005"}));
  EXPECT_EQ(read_text(fs::path(c.save_dir) / "latest"), "step-000005\n");
  EXPECT_EQ(entries(fs::path(c.save_dir) / "step-000005"),
            (std::vector<std::string>{"dense.bin", "experts-0.bin", "experts-1.bin", "meta.json"}));

  TrainConfig r = tiny(2, 6);
  r.resume_dir = c.save_dir;
  std::vector<int64_t> steps;
  ASSERT_TRUE(train(r, [&](const StepReport& s) { steps.push_back(s.step); }).is_ok());
  EXPECT_EQ(steps, (std::vector<int64_t>{5}));
  steps.clear();
  r.resume_dir = (fs::path(c.save_dir) / "step-000004").string();
  ASSERT_TRUE(train(r, [&](const StepReport& s) { steps.push_back(s.step); }).is_ok());
  EXPECT_EQ(steps, (std::vector<int64_t>{4, 5}));
}

// --async-save: while a slow disk writes checkpoint 2, steps 2 and 3 run (the
// step folder is not there yet when step 3 starts); each save is published at
// the first boundary after every rank wrote it, and the files are the ones a
// synchronous save writes.
TEST(Checkpoint, AsyncSavesWriteWhileTrainingGoesOnAndGiveTheSameFiles) {
  testing::TempDir tmp;
  TrainConfig c = tiny(2, 6);
  c.save_every = 2;
  c.keep_checkpoints = 10;
  c.save_dir = (tmp.path() / "sync").string();
  ASSERT_TRUE(train(c).is_ok());

  TrainConfig a = c;
  a.save_dir = (tmp.path() / "async").string();
  a.async_save = true;
  std::vector<bool> published_before;  // step-000002 there when step s starts (rank 0)
  a.before_step = [&](int rank, int64_t step) {
    if (rank == 0 && step >= 2) published_before.push_back(fs::exists(fs::path(a.save_dir) / "step-000002"));
    return Status::ok();
  };
  setenv("EPX_TEST_CHECKPOINT_WRITE_DELAY_MS", "1500", 1);
  const bool ok = train(a).is_ok();
  unsetenv("EPX_TEST_CHECKPOINT_WRITE_DELAY_MS");
  ASSERT_TRUE(ok);
  ASSERT_EQ(published_before.size(), 4u);
  EXPECT_FALSE(published_before[0]) << "step 2 waited for the save of step 2";
  EXPECT_FALSE(published_before[1]) << "step 3 waited for the save of step 2";
  EXPECT_EQ(entries(a.save_dir), entries(c.save_dir));
  for (const char* step : {"step-000002", "step-000004", "step-000006"})
    for (const char* file : {"dense.bin", "experts-0.bin", "experts-1.bin"})
      EXPECT_EQ(read_text(fs::path(a.save_dir) / step / file), read_text(fs::path(c.save_dir) / step / file))
          << step << "/" << file;
}

// A resume that runs no step saves the same step again; a crash in that
// rewrite (the old folder moved aside) is repaired by the next save, and a
// stale temporary folder is removed.
TEST(Checkpoint, RewritesTheSameStepAndRepairsAnInterruptedSave) {
  testing::TempDir tmp;
  TrainConfig c = tiny(2, 2);
  c.save_dir = (tmp.path() / "ck").string();
  ASSERT_TRUE(train(c).is_ok());
  c.resume_dir = c.save_dir;
  ASSERT_TRUE(train(c).is_ok());
  EXPECT_EQ(entries(c.save_dir), (std::vector<std::string>{".epx-checkpoints", "latest", "step-000002"}));
  EXPECT_TRUE(check_resume(c).is_ok());

  const fs::path dir(c.save_dir);
  fs::rename(dir / "step-000002", dir / ".step-000002.old");  // as if killed inside the rewrite
  fs::create_directory(dir / ".step-000003.tmp");
  c.resume_dir.clear();
  c.steps = 1;
  c.schedule.total_steps = 1;
  c.overwrite_checkpoints = true;  // a new run into the folder of the run above
  ASSERT_TRUE(train(c).is_ok());
  EXPECT_EQ(entries(c.save_dir),
            (std::vector<std::string>{".epx-checkpoints", "latest", "step-000001", "step-000002"}));
}

TEST(Checkpoint, RefusesAFileAndAForeignFolderAndTouchesNothing) {
  testing::TempDir tmp;
  TrainConfig c = tiny(2, 1);
  c.save_dir = (tmp.path() / "notes.txt").string();
  write_text(c.save_dir, "mine");
  auto s = train(c);
  ASSERT_FALSE(s.is_ok());
  EXPECT_EQ(s.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.status().message().find("is an existing file"), std::string::npos) << s.status().to_string();
  EXPECT_EQ(read_text(c.save_dir), "mine");

  c.save_dir = (tmp.path() / "project").string();
  fs::create_directory(c.save_dir);
  write_text(fs::path(c.save_dir) / "thesis.tex", "x");
  s = train(c);
  ASSERT_FALSE(s.is_ok());
  EXPECT_NE(s.status().message().find("holds other files (e.g. 'thesis.tex')"), std::string::npos)
      << s.status().to_string();
  EXPECT_EQ(entries(c.save_dir), (std::vector<std::string>{"thesis.tex"}));

  c.save_dir = (tmp.path() / "empty").string();  // an empty folder is accepted
  fs::create_directory(c.save_dir);
  ASSERT_TRUE(train(c).is_ok());
  EXPECT_TRUE(fs::exists(fs::path(c.save_dir) / "latest"));
}

// Under MPI every rank checks the folder while rank 0 may already hold the
// lock of a new folder: a folder holding only epx's lock file (and probes)
// is epx's, not a foreign one.
TEST(Checkpoint, AFolderWithOnlyTheLockFileIsEpxs) {
  testing::TempDir tmp;
  const fs::path dir = tmp.path() / "new";
  fs::create_directory(dir);
  write_text(dir / kSaveLockFile, "host 1 0 run");
  write_text(dir / ".epx-probe-host-42", "");
  EXPECT_TRUE(detail::check_save_dir(dir.string()).is_ok()) << detail::check_save_dir(dir.string()).to_string();
  write_text(dir / "thesis.tex", "x");
  const Status s = detail::check_save_dir(dir.string());
  EXPECT_NE(s.message().find("holds other files (e.g. 'thesis.tex')"), std::string::npos) << s.to_string();
}

// The estimate is an upper bound of the real size, within 10 %.
TEST(Checkpoint, SizeEstimateBoundsTheRealSize) {
  for (bool eplb : {false, true}) {
    testing::TempDir tmp;
    TrainConfig c = tiny(2, 1);
    c.balancing.eplb = eplb;
    c.save_dir = (tmp.path() / "ck").string();
    auto plan = check_save(c);
    ASSERT_TRUE(plan.is_ok()) << plan.status().to_string();
    ASSERT_TRUE(train(c).is_ok());
    int64_t real = 0;
    for (const auto& e : fs::directory_iterator(fs::path(c.save_dir) / "step-000001"))
      real += static_cast<int64_t>(e.file_size());
    EXPECT_GE(plan->checkpoint_bytes, real) << "eplb " << eplb;
    EXPECT_LE(plan->checkpoint_bytes, real * 11 / 10) << "eplb " << eplb;
    EXPECT_GT(plan->free_bytes, 0u);
  }
}

// One checkpoint of 2 ranks at step 2, and the same of another seed.
class Corrupt : public ::testing::Test {
 protected:
  void SetUp() override {
    config_ = tiny(2, 2);
    config_.save_dir = (tmp_.path() / "ck").string();
    ASSERT_TRUE(train(config_).is_ok());
    TrainConfig other = config_;
    other.model.layer.seed += 1;
    other.save_dir = (tmp_.path() / "other").string();
    ASSERT_TRUE(train(other).is_ok());
    step_ = fs::path(config_.save_dir) / "step-000002";
    other_ = fs::path(other.save_dir) / "step-000002";
    resume_ = tiny(2, 4);
    resume_.resume_dir = config_.save_dir;
  }
  // check_resume and train both refuse with `code` and `text`, and no step runs.
  void expect_refused(StatusCode code, const std::string& text) {
    Status s = check_resume(resume_);
    EXPECT_EQ(s.code(), code) << s.to_string();
    EXPECT_NE(s.message().find(text), std::string::npos) << s.to_string();
    int steps = 0;
    auto r = train(resume_, [&](const StepReport&) { ++steps; });
    EXPECT_FALSE(r.is_ok());
    EXPECT_EQ(steps, 0);
  }
  std::vector<uint8_t> bytes(const fs::path& p) {
    const std::string t = read_text(p);
    return {t.begin(), t.end()};
  }
  void put(const fs::path& p, const std::vector<uint8_t>& b) { write_text(p, std::string(b.begin(), b.end())); }

  testing::TempDir tmp_;
  TrainConfig config_, resume_;
  fs::path step_, other_;
};

TEST_F(Corrupt, IntactResumes) { EXPECT_TRUE(check_resume(resume_).is_ok()); }

TEST_F(Corrupt, FlippedBit) {
  std::vector<uint8_t> b = bytes(step_ / "experts-1.bin");
  b[b.size() / 2] ^= 1;
  put(step_ / "experts-1.bin", b);
  expect_refused(StatusCode::kInvalidArgument, "experts-1.bin: the payload's checksum is");
}

TEST_F(Corrupt, AppendedAndMissingBytes) {
  std::vector<uint8_t> b = bytes(step_ / "dense.bin");
  b.push_back(0);
  put(step_ / "dense.bin", b);
  expect_refused(StatusCode::kInvalidArgument, "dense.bin is " + std::to_string(b.size()) + " bytes; meta.json lists");
  b.resize(b.size() - 2);
  put(step_ / "dense.bin", b);
  expect_refused(StatusCode::kInvalidArgument, "(bytes appended or cut)");
}

TEST_F(Corrupt, SwappedExpertFiles) {
  fs::rename(step_ / "experts-0.bin", step_ / "x");
  fs::rename(step_ / "experts-1.bin", step_ / "experts-0.bin");
  fs::rename(step_ / "x", step_ / "experts-1.bin");
  expect_refused(StatusCode::kInvalidArgument, "experts-0.bin holds the part of experts-1.bin, not of experts-0.bin");
}

TEST_F(Corrupt, MissingExpertFile) {
  fs::remove(step_ / "experts-1.bin");
  expect_refused(StatusCode::kNotFound, "has no experts-1.bin");
}

TEST_F(Corrupt, EditedMeta) {
  std::string meta = read_text(step_ / "meta.json");
  meta.replace(meta.find("\"step\": 2"), 9, "\"step\": 1");
  write_text(step_ / "meta.json", meta);
  expect_refused(StatusCode::kInvalidArgument, "meta.json: its content hashes to");
}

TEST_F(Corrupt, ForeignMeta) {
  fs::copy_file(other_ / "meta.json", step_ / "meta.json", fs::copy_options::overwrite_existing);
  expect_refused(StatusCode::kInvalidArgument, "dense.bin hashes to");
}

TEST_F(Corrupt, FileOfAnotherCheckpoint) {
  fs::copy_file(other_ / "experts-1.bin", step_ / "experts-1.bin", fs::copy_options::overwrite_existing);
  expect_refused(StatusCode::kInvalidArgument, "(a file of another checkpoint?)");
}

// A header edited with valid checksums still disagrees with meta.json.
TEST_F(Corrupt, ResealedHeaderOfAnotherStep) {
  std::vector<uint8_t> b = bytes(step_ / "experts-0.bin");
  const int64_t step = 1;
  std::memcpy(b.data() + 32, &step, 8);
  reseal(b);
  put(step_ / "experts-0.bin", b);
  expect_refused(StatusCode::kInvalidArgument, "experts-0.bin is of step 1; meta.json says step 2");
}

TEST_F(Corrupt, AnotherModel) {
  resume_.model.layer.ffn_hidden = 32;
  expect_refused(StatusCode::kInvalidArgument, "is of another model: ffn=16 in the checkpoint, ffn=32 in this run");
}

// Another layout is no error: it reshards (tests/train/reshard_test.cc).
TEST_F(Corrupt, AnotherRankCountResumes) {
  resume_.num_ranks = 4;
  EXPECT_TRUE(check_resume(resume_).is_ok());
  auto note = resume_note(resume_);
  ASSERT_TRUE(note.is_ok()) << note.status().to_string();
  EXPECT_NE(note->find("written by 2 ranks on 1 node (EP 2, 8 slots per layer) onto 4 ranks on 1 node (EP 4"),
            std::string::npos) << *note;
  EXPECT_TRUE(train(resume_).is_ok());
}

// meta.json edited with its checksum made right: what its file list promises
// is checked before any file is read.
class CorruptMeta : public Corrupt {
 protected:
  void edit(const std::function<void(nlohmann::json&)>& change) {
    nlohmann::json j = nlohmann::json::parse(read_text(step_ / "meta.json"));
    change(j);
    j.erase("meta_xxh3");
    j["meta_xxh3"] = fmt::format("{:016x}", XXH3_64bits(j.dump().data(), j.dump().size()));
    write_text(step_ / "meta.json", j.dump(2));
  }
};

TEST_F(CorruptMeta, AnOlderFormatIsNamed) {
  edit([](nlohmann::json& j) { j["version"] = 2; });
  expect_refused(StatusCode::kInvalidArgument,
                 "checkpoint format version 2; this epx reads 3 (format 3 stores experts in logical order");
}

TEST_F(CorruptMeta, AnExpertListedTwice) {
  edit([](nlohmann::json& j) { j["files"][2]["experts"][0].push_back(j["files"][1]["experts"][0][0]); });
  expect_refused(StatusCode::kInvalidArgument, "lists layer 0's expert 0 in both experts-0.bin and experts-1.bin");
}

TEST_F(CorruptMeta, AnExpertListedNowhere) {
  edit([](nlohmann::json& j) { j["files"][1]["experts"][1].erase(0); });
  expect_refused(StatusCode::kInvalidArgument, "lists no file for layer 1's expert 0");
}

TEST_F(CorruptMeta, AnExpertFileMissingFromTheList) {
  edit([](nlohmann::json& j) { j["files"].erase(2); });
  expect_refused(StatusCode::kInvalidArgument, "lists 2 files; ep = 2 needs 3");
}

TEST_F(Corrupt, LatestNamesAMissingFolder) {
  write_text(fs::path(config_.save_dir) / "latest", "step-000009\n");
  expect_refused(StatusCode::kNotFound, "latest names step-000009, which holds no meta.json");
}

}  // namespace
}  // namespace epx
