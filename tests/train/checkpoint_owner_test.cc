// Who writes a checkpoint folder and what a resume continues: the save lock
// (one writer; a stale lock taken over and explained), the run id in every
// checkpoint (a resume continues it; another run's step folders refuse a new
// run and are never pruned), and the data settings a resume must keep.
#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "epx/train/checkpoint_lock.h"
#include "epx/train/trainer.h"
#include "observe/temp_dir.h"
#include "train/checkpoint.h"
#include "train/tiny_config.h"

namespace epx {
namespace {

namespace fs = std::filesystem;
using epx::testing::read_file;
using epx::testing::TempDir;

TrainConfig tiny(int64_t steps) {
  return testing::tiny_config({.num_ranks = 2, .steps = steps, .batch_tokens = 64, .hidden = 16, .ffn_hidden = 16,
                               .warmup = 1});
}

void write_text(const fs::path& p, const std::string& text) { std::ofstream(p, std::ios::trunc) << text; }

std::string run_id_of(const fs::path& step_folder) {
  detail::CheckpointMeta meta;
  const std::string text = read_file((step_folder / "meta.json").string());
  EXPECT_TRUE(detail::parse_checkpoint_meta(text, "meta.json", &meta).is_ok());
  return meta.run_id;
}

std::vector<std::string> entries(const fs::path& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

constexpr const char* kOwner = "host node07\npid 4711\nstarted 2026-01-02T03:04:05Z\nrun feed\n";

TEST(SaveLock, OneProcessSharesItsLockAndRemovesTheFileWhenDone) {
  TempDir tmp;
  const std::string dir = (tmp.path() / "ck").string();
  {
    auto first = SaveLock::acquire(dir, "abc");
    ASSERT_TRUE(first.is_ok()) << first.status().to_string();
    EXPECT_TRUE(first->note().empty());
    const std::string text = read_file(dir + "/.epx-lock");
    EXPECT_NE(text.find("pid " + std::to_string(::getpid()) + "\n"), std::string::npos) << text;
    EXPECT_NE(text.find("run abc\n"), std::string::npos) << text;
    auto again = SaveLock::acquire(dir, "abc");  // what train() does under `epx train`
    ASSERT_TRUE(again.is_ok()) << again.status().to_string();
  }
  EXPECT_EQ(entries(dir), (std::vector<std::string>{".epx-checkpoints"}));
}

TEST(SaveLock, AFolderLockedByAnotherOwnerIsRefusedNamingIt) {
  TempDir tmp;
  const fs::path dir = tmp.path() / "ck";
  ASSERT_TRUE(detail::make_checkpoint_folder(dir.string()).is_ok());
  write_text(dir / ".epx-lock", kOwner);
  const int fd = ::open((dir / ".epx-lock").c_str(), O_RDWR | O_CLOEXEC);  // another open file: another owner
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::flock(fd, LOCK_EX | LOCK_NB), 0);
  auto refused = SaveLock::acquire(dir.string(), "abc");
  EXPECT_EQ(refused.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(refused.status().message().find("is in use by another run: pid 4711 on host node07, started "
                                            "2026-01-02T03:04:05Z (run feed) holds its lock"),
            std::string::npos)
      << refused.status().message();
  // train() takes the lock too: refused before any step, the owner's file as it was.
  TrainConfig c = tiny(1);
  c.save_dir = dir.string();
  const auto trained = train(c);
  EXPECT_EQ(trained.status().code(), StatusCode::kFailedPrecondition) << trained.status().to_string();
  EXPECT_EQ(read_file((dir / ".epx-lock").string()), kOwner);
  EXPECT_EQ(entries(dir), (std::vector<std::string>{".epx-checkpoints", ".epx-lock"}));
  ::close(fd);
}

TEST(SaveLock, AStaleLockIsTakenOverAndExplained) {
  TempDir tmp;
  const fs::path dir = tmp.path() / "ck";
  ASSERT_TRUE(detail::make_checkpoint_folder(dir.string()).is_ok());
  write_text(dir / ".epx-lock", kOwner);  // its owner died: no process holds the lock
  {
    auto taken = SaveLock::acquire(dir.string(), "abc");
    ASSERT_TRUE(taken.is_ok()) << taken.status().to_string();
    EXPECT_NE(taken->note().find("the lock of a previous run was left behind: pid 4711 on host node07, started "
                                 "2026-01-02T03:04:05Z (run feed) is gone"),
              std::string::npos)
        << taken->note();
    EXPECT_NE(read_file((dir / ".epx-lock").string()).find("run abc\n"), std::string::npos);
  }
  EXPECT_FALSE(fs::exists(dir / ".epx-lock"));
}

TEST(CheckpointOwner, ANewRunIntoAnotherRunsFolderIsRefusedUnlessItSaysSo) {
  TempDir tmp;
  TrainConfig a = tiny(4);
  a.save_dir = (tmp.path() / "ck").string();
  ASSERT_TRUE(train(a).is_ok());
  const std::string theirs = run_id_of(fs::path(a.save_dir) / "step-000004");
  EXPECT_EQ(theirs.size(), 16u);
  const std::string their_meta = read_file(a.save_dir + "/step-000004/meta.json");

  TrainConfig b = tiny(3);
  b.save_dir = a.save_dir;
  const Status refused = check_save(b).status();
  EXPECT_EQ(refused.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(refused.message().find("holds checkpoints of another run: step-000004 (run " + theirs + ")"),
            std::string::npos)
      << refused.message();
  EXPECT_EQ(train(b).status().code(), StatusCode::kInvalidArgument);

  // Said so: it saves; --keep 1 prunes its own step folders only.
  b.overwrite_checkpoints = true;
  b.save_every = 1;
  b.keep_checkpoints = 1;
  ASSERT_TRUE(train(b).is_ok());
  EXPECT_EQ(entries(b.save_dir),
            (std::vector<std::string>{".epx-checkpoints", "latest", "step-000003", "step-000004"}));
  EXPECT_EQ(read_file(a.save_dir + "/step-000004/meta.json"), their_meta);
  EXPECT_NE(run_id_of(fs::path(b.save_dir) / "step-000003"), theirs);
}

TEST(CheckpointOwner, AResumeContinuesItsCheckpointsRunAndPrunesItsSteps) {
  TempDir tmp;
  TrainConfig a = tiny(2);
  a.save_dir = (tmp.path() / "ck").string();
  a.save_every = 1;
  ASSERT_TRUE(train(a).is_ok());
  const std::string id = run_id_of(fs::path(a.save_dir) / "step-000002");
  TrainConfig r = tiny(4);
  r.save_dir = r.resume_dir = a.save_dir;
  r.save_every = 1;
  r.keep_checkpoints = 1;
  auto resolved = resolve_run_id(r);
  ASSERT_TRUE(resolved.is_ok());
  EXPECT_EQ(*resolved, id);
  ASSERT_TRUE(train(r).is_ok());
  EXPECT_EQ(entries(r.save_dir), (std::vector<std::string>{".epx-checkpoints", "latest", "step-000004"}));
  EXPECT_EQ(run_id_of(fs::path(r.save_dir) / "step-000004"), id);
}

TEST(CheckpointOwner, AResumeRefusesOtherDataSettingsNamingEach) {
  TempDir tmp;
  TrainConfig a = tiny(2);
  a.save_dir = (tmp.path() / "ck").string();
  ASSERT_TRUE(train(a).is_ok());
  TrainConfig r = tiny(3);
  r.resume_dir = a.save_dir;
  EXPECT_TRUE(check_resume(r).is_ok());
  r.synthetic.seed = 9;
  r.synthetic.num_clusters = 4;
  Status s = check_resume(r);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("was trained on other data: clusters = 8 in the checkpoint, 4 in this run; seed = 1 "
                             "in the checkpoint, 9 in this run"),
            std::string::npos)
      << s.message();
  EXPECT_EQ(train(r).status().code(), StatusCode::kInvalidArgument);
  r.allow_data_change = true;
  EXPECT_TRUE(check_resume(r).is_ok());
  auto note = resume_data_note(r);
  ASSERT_TRUE(note.is_ok());
  EXPECT_NE(note->find("(--allow-data-change): clusters = 8 in the checkpoint, 4 in this run"), std::string::npos)
      << *note;
}

// A checkpoint written before data settings and run ids were recorded.
TEST(CheckpointOwner, ACheckpointWithoutDataSettingsResumesWithANote) {
  TempDir tmp;
  TrainConfig a = tiny(2);
  a.save_dir = (tmp.path() / "ck").string();
  ASSERT_TRUE(train(a).is_ok());
  const fs::path meta_path = fs::path(a.save_dir) / "step-000002" / "meta.json";
  detail::CheckpointMeta meta;
  ASSERT_TRUE(detail::parse_checkpoint_meta(read_file(meta_path.string()), "meta.json", &meta).is_ok());
  ASSERT_FALSE(meta.data.empty());
  meta.data.clear();
  meta.run_id.clear();
  write_text(meta_path, detail::format_checkpoint_meta(meta));

  TrainConfig r = tiny(3);
  r.resume_dir = r.save_dir = a.save_dir;
  r.synthetic.seed = 5;  // not recorded: not checked
  EXPECT_TRUE(check_resume(r).is_ok());
  auto note = resume_data_note(r);
  ASSERT_TRUE(note.is_ok());
  EXPECT_NE(note->find("records no data settings (written by an earlier epx)"), std::string::npos) << *note;
  const auto resumed = train(r);
  ASSERT_TRUE(resumed.is_ok()) << resumed.status().to_string();
  // The older step folder is not this run's: kept (--keep prunes only its own).
  EXPECT_EQ(entries(r.save_dir),
            (std::vector<std::string>{".epx-checkpoints", "latest", "step-000002", "step-000003"}));
}

}  // namespace
}  // namespace epx
