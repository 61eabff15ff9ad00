// Checkpoints of the trainer in LOGICAL order: a directory that epx owns,
// one verified step folder per save and an atomically replaced `latest` file.
// A checkpoint holds each dense parameter once and each logical expert of
// each layer once (weights and AdamW moments), whatever the layout (ranks,
// EP, nodes, EPLB slots and replicas) that wrote it, so any layout of the
// same model resumes from it.
//
//   DIR/.epx-checkpoints      marker: DIR belongs to epx (written when a run takes
//                             the folder, make_checkpoint_folder)
//   DIR/.epx-lock             the writing run's lock (SaveLock), while it runs
//   DIR/latest                "step-000120\n", replaced by write + fsync + rename
//   DIR/step-000120/meta.json step, model, the writing layout (ranks, nodes,
//                             ep, slots, each layer's slot map), the eplb
//                             window's loads, every file's size, XXH3-64 and
//                             (expert files) its logical experts per layer,
//                             the run id, the data settings and a checksum of
//                             itself
//   DIR/step-000120/dense.bin        written by rank 0: every dense parameter
//                             with its two AdamW moments, the AdamW step
//                             count, the expert biases
//   DIR/step-000120/experts-N.bin    written by rank N of EP group 0: the
//                             logical experts whose first replica (lowest
//                             slot) it holds, as "layerL.experts.w1#E" etc.
//                             with their moments
// Every file: header (magic, format version, part index, writing layout,
// step, model hash, payload size and XXH3-64, header XXH3-64) + payload.
//
// A save writes `.step-000120.tmp/` inside DIR, fsyncs every file and the
// folder, renames it, then replaces `latest`, then removes all but the newest
// `keep` step folders of the same run (the new one always stays; a folder
// written by another run, or whose meta.json cannot be read, stays). A failed save removes its
// temporary folder; the previous step folders and `latest` stay as they were.
// A resume verifies meta.json and every file a rank reads before anything is
// loaded; each rank reads dense.bin and the expert files of its own experts.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "epx/comm/parallel_layout.h"
#include "epx/comm/transport.h"
#include "epx/layer/moe_layer.h"
#include "epx/train/optimizer.h"

namespace epx::detail {

constexpr uint32_t kCheckpointFormatVersion = 3;
constexpr const char* kCheckpointMarker = ".epx-checkpoints";
constexpr const char* kDenseFileName = "dense.bin";

struct CheckpointFile {
  std::string name;  // "dense.bin", "experts-3.bin"
  uint64_t bytes = 0;
  uint64_t xxh3 = 0;  // XXH3_64bits of the whole file
  // Expert files: per layer, the logical experts it holds (ascending).
  std::vector<std::vector<int32_t>> experts;
};

struct CheckpointMeta {
  int64_t step = 0;  // steps done
  std::string fingerprint;  // the model's shape, without its layout; a resume must match it
  // The layout that wrote it (information: another layout reshards on resume).
  int num_ranks = 0;
  int num_nodes = 0;
  int ep = 0;         // ranks per EP group
  int num_slots = 0;  // physical expert slots per layer (= experts without eplb)
  // EPLB: each layer's slot -> logical expert map and the per-logical-expert
  // loads of the unfinished window. Empty without eplb.
  std::vector<std::vector<int32_t>> layer_slots;
  std::vector<std::vector<int64_t>> eplb_window;
  std::vector<CheckpointFile> files;  // dense.bin, then experts-0.bin .. experts-(ep-1).bin
  // The run that wrote it (TrainConfig::run_id; a resume continues its
  // checkpoint's). Empty: written before run ids were recorded.
  std::string run_id;
  // The settings that decide the training data (data_settings in the
  // trainer), name -> value. Empty: written before they were recorded.
  std::map<std::string, std::string> data;
};

// The fixed-size header at the start of every file.
struct PartFileHeader {
  int32_t part = 0;  // 0: dense.bin; 1 + N: experts-N.bin
  int32_t num_ranks = 0, num_nodes = 0;
  int64_t step = 0;
  uint64_t model_hash = 0;  // XXH3_64bits of the model fingerprint
  uint64_t payload_bytes = 0;
  uint64_t payload_xxh3 = 0;
};

// One file's content, as read, before it touches the model.
struct PartState {
  struct Param {
    std::string name;  // a dense parameter's name, or "layer1.experts.w2#5" (logical expert 5)
    std::vector<float> value, m, v;  // parameter, AdamW first and second moments
  };
  int64_t adam_steps = 0;
  std::vector<Param> params;
  std::vector<std::vector<float>> biases;  // dense.bin: one per MoE layer; expert files: none
};

[[nodiscard]] uint64_t model_hash(std::string_view fingerprint);
[[nodiscard]] std::string step_folder_name(int64_t step);  // "step-000120"
[[nodiscard]] std::string expert_file_name(int ep_rank);    // "experts-3.bin"
// "layer1.experts.w2#5": a logical expert's block of an expert parameter.
[[nodiscard]] std::string expert_entry_name(const std::string& param, int expert);

// In-memory formats, for the writer, the reader and fuzzing. Both parsers
// accept any bytes without crashing: every length is checked against the
// bytes left before anything is sized, and errors name `name` and the field.
// parse_part_file checks the magic, the version, the header and payload
// checksums and the payload's structure; it compares nothing with a model.
[[nodiscard]] std::vector<uint8_t> serialize_part_file(const PartFileHeader& header, const PartState& state);
[[nodiscard]] Status parse_part_file(std::span<const uint8_t> bytes, const std::string& name, PartFileHeader* header,
                                     PartState* state);
// meta.json's text with its own checksum ("meta_xxh3", over the compact JSON
// of everything else); parse_checkpoint_meta checks the format and that checksum.
[[nodiscard]] std::string format_checkpoint_meta(const CheckpointMeta& meta);
[[nodiscard]] Status parse_checkpoint_meta(std::string_view text, const std::string& name, CheckpointMeta* meta);

// A step folder of a checkpoint folder and the run that wrote it.
struct StepOwner {
  int64_t step = 0;
  std::string run_id;     // empty: written before run ids were recorded, or unreadable
  bool readable = false;  // its meta.json parsed (checksum and format)
};
// The step folders (step-NNNNNN) of `dir` with their owners, by step; none
// when `dir` does not exist. Reads each step's meta.json only.
[[nodiscard]] std::vector<StepOwner> list_step_owners(const std::string& dir);

// Creates DIR (check_save_dir first) and its marker, when missing.
[[nodiscard]] Status make_checkpoint_folder(const std::string& dir);

// --save DIR: OK when DIR does not exist (its nearest existing ancestor must
// be a folder), is an empty folder, or holds epx's marker; InvalidArgument
// naming what is there otherwise. Touches nothing.
[[nodiscard]] Status check_save_dir(const std::string& dir);
struct SaveSpace {
  std::string probed;  // the folder that was probed: DIR or its nearest existing ancestor
  uint64_t free_bytes = 0;
};
// Creates and removes a probe file in DIR (or its nearest existing
// ancestor) and reads the free space of that filesystem (statvfs).
[[nodiscard]] Result<SaveSpace> probe_save_dir(const std::string& dir);

// How often this process has probed a save folder (probe_save_dir) and read
// a checkpoint's meta.json to decide on a resume (read_checkpoint_meta,
// verify_checkpoint; load_checkpoint's own reads are not counted): the tests
// see that a run plan decides once and train(plan) does not again.
struct CheckpointProbes {
  int64_t save_dir = 0;
  int64_t meta = 0;
};
[[nodiscard]] CheckpointProbes checkpoint_probes();

// --resume PATH: PATH/latest's step folder, or PATH itself when it holds
// meta.json. NotFound naming PATH otherwise.
[[nodiscard]] Result<std::string> resolve_checkpoint(const std::string& path);
// Reads and checks meta.json of `path`'s checkpoint against `expected`'s
// fingerprint (any layout may resume it); fills everything else from it. No
// other file is read.
[[nodiscard]] Status read_checkpoint_meta(const std::string& path, CheckpointMeta* expected);
// read_checkpoint_meta, then every file: size, checksums, header (part,
// layout, step, model hash) against meta.json. The first difference is an
// InvalidArgument (NotFound for a missing file) naming the file.
[[nodiscard]] Status verify_checkpoint(const std::string& path, CheckpointMeta* expected);

// Collective over the world. Writes step folder `meta.step` under dir (see
// the top); meta gives the step, fingerprint, layout and eplb state, the
// files are filled in. `layout` says who writes which expert file. After
// the save, the step folders of meta.run_id beyond the newest `keep` are
// removed; another run's step folders are never removed.
// EPX_TEST_CHECKPOINT_DELAY_MS (environment) > 0 sleeps between writing the
// files and renaming the folder (a test hook: a window for kill -9).
[[nodiscard]] Status save_checkpoint(const std::string& dir, int keep, const CheckpointMeta& meta, Transport& transport,
                                     const ParallelLayout& layout, std::span<Parameter* const> params, AdamW& adam,
                                     std::span<MoELayer* const> layers, const Deadline& deadline);

// One save in three parts, so its files can be written while training goes
// on (asynchronous checkpoints): begin (collective) prepares the folder and
// copies this rank's part of the state (the snapshot: the memory of one
// checkpoint's share per rank); write (this rank alone, on any thread, once)
// serialises and writes it, fsynced; finish (collective) agrees that every
// rank wrote, gathers sizes and checksums, and rank 0 publishes the step
// folder (meta.json, rename, `latest`) and prunes. A failure anywhere leaves
// the earlier checkpoints as they were; an unfinished save's temporary
// folder is removed when the object goes. save_checkpoint is the three in a row.
// EPX_TEST_CHECKPOINT_WRITE_DELAY_MS (environment) > 0 sleeps at the start of
// write() (a test hook: a slow disk).
class CheckpointWrite {
 public:
  [[nodiscard]] static Result<std::unique_ptr<CheckpointWrite>> begin(
      const std::string& dir, int keep, const CheckpointMeta& meta, Transport& transport, const ParallelLayout& layout,
      std::span<Parameter* const> params, AdamW& adam, std::span<MoELayer* const> layers, const Deadline& deadline);
  ~CheckpointWrite();
  CheckpointWrite(const CheckpointWrite&) = delete;
  CheckpointWrite& operator=(const CheckpointWrite&) = delete;

  void write();
  // write() on a thread of its own; finish() and the destructor join it.
  void write_in_background();
  // Joins the background write (if any): after it, written() is true.
  void wait();
  // This rank's files are written (or failed): finish will not wait for them.
  [[nodiscard]] bool written() const { return written_.load(); }
  [[nodiscard]] int64_t step() const { return meta_.step; }
  [[nodiscard]] Status finish(Transport& transport, const Deadline& deadline);

 private:
  CheckpointWrite(const std::string& dir, int keep, const CheckpointMeta& meta, int rank);
  [[nodiscard]] Status fail(const Status& s) const;

  std::string dir_, tmp_;
  int keep_ = 0, rank_ = 0, ep_rank_ = 0;
  CheckpointMeta meta_;
  std::optional<PartState> dense_, experts_;  // the snapshot, until written
  uint64_t sums_[4] = {0, 0, 0, 0};           // (dense bytes, xxh3, expert file bytes, xxh3)
  Status written_status_;
  std::atomic<bool> written_{false};
  bool finished_ = false;
  std::thread writer_;
};
// Collective. Reads meta.json, dense.bin and the expert files that hold this
// rank's logical experts, verifies them and their fit to the model (names,
// sizes, every local expert found once), agrees with every rank (all
// verified, all at the same step), and only then loads: dense parameters,
// each local slot's logical expert (empty slots: zeros) with its moments,
// biases, the AdamW step count. `expected` holds the fingerprint; meta.json
// fills the rest.
[[nodiscard]] Status load_checkpoint(const std::string& path, CheckpointMeta* expected, Transport& transport,
                                     std::span<Parameter* const> params, AdamW& adam,
                                     std::span<MoELayer* const> layers, const Deadline& deadline);

}  // namespace epx::detail
