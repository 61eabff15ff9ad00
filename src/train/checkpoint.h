// Checkpoints of the trainer: a directory that epx owns, one verified step
// folder per save and an atomically replaced `latest` file.
//
//   DIR/.epx-checkpoints      marker: DIR belongs to epx (written at the first save)
//   DIR/latest                "step-000120\n", replaced by write + fsync + rename
//   DIR/step-000120/meta.json step, layout, model, eplb state, every file's size
//                             and XXH3-64 checksum, and a checksum of itself
//   DIR/step-000120/rank-N.bin  header (magic, format version, rank and world
//                             layout, step, model hash, payload size and XXH3-64,
//                             header XXH3-64) + payload (parameters, AdamW
//                             moments and step count, expert biases)
//
// A save writes `.step-000120.tmp/` inside DIR, fsyncs every file and the
// folder, renames it, then replaces `latest`, then removes all but the newest
// `keep` step folders (the new one always stays). A failed save removes its
// temporary folder; the previous step folders and `latest` stay as they were.
// A resume verifies meta.json and every rank file before anything is loaded.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "epx/comm/transport.h"
#include "epx/layer/moe_layer.h"
#include "epx/train/optimizer.h"

namespace epx::detail {

constexpr uint32_t kCheckpointFormatVersion = 2;
constexpr const char* kCheckpointMarker = ".epx-checkpoints";

struct CheckpointFile {
  std::string name;  // "rank-3.bin"
  uint64_t bytes = 0;
  uint64_t xxh3 = 0;  // XXH3_64bits of the whole file
};

struct CheckpointMeta {
  int64_t step = 0;  // steps done
  int num_ranks = 0;
  int num_nodes = 0;
  std::string fingerprint;  // the model's shape; a resume must match it
  // EPLB (meta.json, the same for every rank): each layer's slot -> logical
  // expert map and the per-expert loads of the unfinished window. Empty without eplb.
  std::vector<std::vector<int32_t>> layer_slots;
  std::vector<std::vector<int64_t>> eplb_window;
  std::vector<CheckpointFile> files;  // one per rank, in rank order
};

// The fixed-size header at the start of every rank file.
struct RankFileHeader {
  int32_t rank = 0, num_ranks = 0, num_nodes = 0;
  int64_t step = 0;
  uint64_t model_hash = 0;  // XXH3_64bits of the model fingerprint
  uint64_t payload_bytes = 0;
  uint64_t payload_xxh3 = 0;
};

// One rank's part, as read from its file, before it touches the model.
struct RankState {
  struct Param {
    std::string name;
    std::vector<float> value, m, v;  // parameter, AdamW first and second moments
  };
  int64_t adam_steps = 0;
  std::vector<Param> params;
  std::vector<std::vector<float>> biases;  // one per MoE layer
};

[[nodiscard]] uint64_t model_hash(std::string_view fingerprint);
[[nodiscard]] std::string step_folder_name(int64_t step);  // "step-000120"

// In-memory formats, for the writer, the reader and fuzzing. Both parsers
// accept any bytes without crashing: every length is checked against the
// bytes left before anything is sized, and errors name `name` and the field.
// parse_rank_file checks the magic, the version, the header and payload
// checksums and the payload's structure; it compares nothing with a model.
[[nodiscard]] std::vector<uint8_t> serialize_rank_file(const RankFileHeader& header, const RankState& state);
[[nodiscard]] Status parse_rank_file(std::span<const uint8_t> bytes, const std::string& name, RankFileHeader* header,
                                     RankState* state);
// meta.json's text with its own checksum ("meta_xxh3", over the compact JSON
// of everything else); parse_checkpoint_meta checks the format and that checksum.
[[nodiscard]] std::string format_checkpoint_meta(const CheckpointMeta& meta);
[[nodiscard]] Status parse_checkpoint_meta(std::string_view text, const std::string& name, CheckpointMeta* meta);

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

// --resume PATH: PATH/latest's step folder, or PATH itself when it holds
// meta.json. NotFound naming PATH otherwise.
[[nodiscard]] Result<std::string> resolve_checkpoint(const std::string& path);
// Reads and checks meta.json of `path`'s checkpoint against `expected`
// (ranks, nodes, model; another layout is refused until resharding exists);
// fills step, layer_slots, eplb_window and files. No rank file is read.
[[nodiscard]] Status read_checkpoint_meta(const std::string& path, CheckpointMeta* expected);
// read_checkpoint_meta, then every rank file: size, checksums, header (rank,
// layout, step, model hash) against meta.json. The first difference is an
// InvalidArgument (NotFound for a missing file) naming the file.
[[nodiscard]] Status verify_checkpoint(const std::string& path, CheckpointMeta* expected);

// Collective. Writes step folder `meta.step` under dir (see the top).
// `delay_ms` > 0 sleeps between writing the files and renaming the folder
// (a test hook: set by the EPX_TEST_CHECKPOINT_DELAY_MS environment variable).
[[nodiscard]] Status save_checkpoint(const std::string& dir, int keep, const CheckpointMeta& meta, Transport& transport,
                                     std::span<Parameter* const> params, AdamW& adam,
                                     std::span<MoELayer* const> layers, const Deadline& deadline);
// Collective. Reads meta.json and this rank's file, verifies them and their
// fit to the model, agrees with every rank (all verified, all at the same
// step), and only then loads (step is set).
[[nodiscard]] Status load_checkpoint(const std::string& path, CheckpointMeta* expected, Transport& transport,
                                     std::span<Parameter* const> params, AdamW& adam,
                                     std::span<MoELayer* const> layers, const Deadline& deadline);

}  // namespace epx::detail
