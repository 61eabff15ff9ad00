// The metrics a training run writes (`epx train --metrics`, JSON Lines, one
// object per step), read back as records: the one reader behind
// `epx monitor`, `epx report` and the straggler diagnosis, for a finished
// file or one a run is still writing.
//
//   EPX_ASSIGN_OR_RETURN(epx::MetricsFollower follower, epx::MetricsFollower::open("metrics.jsonl"));
//   for (;;) {
//     EPX_ASSIGN_OR_RETURN(std::vector<epx::StepRecord> fresh, follower.poll());
//     for (const epx::StepRecord& s : fresh) fmt::print("step {} loss {}\n", s.step, s.main_loss);
//     ...
//   }
//
// The line format is the trainer's (StepReport::to_json; docs/operations.md
// lists every field). Fields added by later versions are ignored, fields a
// line lacks keep their defaults below, so files of older runs still read.
// A number the trainer could not write as JSON (a NaN or infinite loss) is
// written as null and read back as NaN.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "epx/core/status.h"

namespace epx {

// One MoE layer in one step (global over every rank: LoadStats).
struct LayerRecord {
  int layer = 0;
  double max_vio = 0;  // max expert load / mean - 1
  double cv = 0;
  int64_t dropped = 0;
  int worst_rank = 0;
  double worst_rank_share = 0;
  double idle_fraction = 0;  // 1 - mean / max work over ranks
  std::vector<int64_t> tokens_per_expert;
  std::vector<int64_t> tokens_per_rank;
  // Mean work over max work across ranks (1 = even): the balance figure of
  // one layer; a run's balancedness is its mean over layers.
  [[nodiscard]] double balancedness() const { return 1.0 - idle_fraction; }
};

// One rank's times in one step, in seconds (RankTimes), and who it waited for.
struct RankRecord {
  int rank = 0;
  double router = 0, dispatch = 0, experts = 0, combine = 0, dense = 0, wait = 0, sync = 0, total = 0;
  double grad_reduce = 0, grad_wait = 0, grad_bytes = 0;
  // Who waited for whom in this step's dispatches and combines (every layer,
  // forward and backward); see WaitMatrix for the two kinds of wait.
  double exchange_wait = 0;  // seconds this rank was blocked waiting for others (arrival + data)
  int waited_for = -1;       // the rank it waited for most; -1: it did not wait
  double late = 0;           // sum over ranks r of WaitMatrix::arrival[r][this]: others waiting for it to arrive
  double slow_data = 0;      // sum over ranks r of WaitMatrix::data[r][this]: others waiting for its data
};

// The full who-waited-for-whom picture of one step (written every
// --wait-matrix-every steps), world ranks x world ranks, row-major
// [r * num_ranks + s], in seconds summed over the step's operations:
// - arrival[r][s]: rank r had arrived at an operation and waited for rank s
//   to arrive (s's compute before the operation was slower);
// - data[r][s]: both had arrived and rank r waited for s's data (s's link,
//   or s forwarding late).
// Ranks of different EP groups never wait for each other: 0 there.
struct WaitMatrix {
  int num_ranks = 0;
  std::vector<double> arrival, data;
  [[nodiscard]] double arrival_at(int r, int s) const { return arrival[static_cast<std::size_t>(r) * num_ranks + s]; }
  [[nodiscard]] double data_at(int r, int s) const { return data[static_cast<std::size_t>(r) * num_ranks + s]; }
};

struct EplbRecord {
  std::vector<double> balance_before, balance_after;
  int64_t moved_slots = 0;
  int64_t moved_bytes = 0;
};

struct StepRecord {
  int64_t step = 0;  // 0-based
  double loss = std::numeric_limits<double>::quiet_NaN();
  double main_loss = std::numeric_limits<double>::quiet_NaN();
  // The held-out (validation) loss measured after this step, on the steps a
  // writer that evaluates (epx.torch.MetricsWriter) evaluated; absent on the
  // others. NaN when written as null.
  std::optional<double> val_loss;
  double lr = 0, grad_norm = 0, seconds = 0, tokens_per_s = 0;
  int num_nodes = 0;  // of the run, ranks node-major; 0: not written (files of older epx versions)
  int64_t resumed_from = -1;  // the first record of a resumed run: its checkpoint's step; -1 otherwise
  std::vector<LayerRecord> layers;
  std::vector<RankRecord> ranks;
  std::optional<WaitMatrix> wait_matrix;
  std::optional<EplbRecord> eplb;  // the steps that ended with a re-placement
  // Mean over layers of balancedness() (1 when there are no layers).
  [[nodiscard]] double balancedness() const;
  // Mean over layers of max_vio.
  [[nodiscard]] double max_vio() const;
};

// One line (without its newline). InvalidArgument naming the field and the
// line's start when it is not a JSON object of the format.
[[nodiscard]] Result<StepRecord> parse_step_record(std::string_view line);

// Calls `on_record` for every line of the file, in order, without holding
// the file in memory. A last line without its newline (a run still writing)
// is left out. InvalidArgument names the line number of a malformed line;
// NotFound when there is no file. Stops at the first error `on_record`
// returns.
[[nodiscard]] Status read_metrics(const std::string& path, const std::function<Status(StepRecord&&)>& on_record);

// Reads whole lines as a run appends them: each poll() returns the records
// of the lines completed since the last one (none when nothing new), and
// keeps a partial last line for later. A file that does not exist yet reads
// as empty until it appears; one that shrinks (a new run over the path)
// starts over from its beginning (so does a file replaced at the path, or
// rewritten so that the last byte read is no longer a newline).
// A malformed line is reported once: a poll returns the records before it,
// the next one its InvalidArgument (with the line number), and the one after
// goes on past it.
class MetricsFollower {
 public:
  [[nodiscard]] static Result<MetricsFollower> open(const std::string& path);
  MetricsFollower(MetricsFollower&&) noexcept;
  MetricsFollower& operator=(MetricsFollower&&) noexcept;
  MetricsFollower(const MetricsFollower&) = delete;
  MetricsFollower& operator=(const MetricsFollower&) = delete;
  ~MetricsFollower();

  [[nodiscard]] Result<std::vector<StepRecord>> poll();
  // The same, reading at most `max_bytes` new bytes of the file: a big file
  // is then caught up over several polls, with bounded memory each.
  [[nodiscard]] Result<std::vector<StepRecord>> poll(std::size_t max_bytes);
  // Lines read so far (whole ones) of the file now at the path.
  [[nodiscard]] int64_t lines_read() const;

 private:
  struct State;
  explicit MetricsFollower(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

}  // namespace epx

// ---- resumed runs ----------------------------------------------------------
// `epx train --resume` cuts its metrics file back to the checkpoint's step
// before it appends (cut_metrics_before_step), and marks the first record
// after the cut (StepRecord::resumed_from). A file written by an older epx
// may still hold a step twice; read_run_metrics reads either as the run's one
// history.

namespace epx {

// Where a metrics file's steps go back: a record whose step is not above the
// step of the record before it (a resumed run appended there).
struct MetricsResume {
  int64_t step = 0;      // the first step after the resume
  int64_t replaced = 0;  // earlier records left out for it (of steps >= step)
};

// read_metrics, each step once: where the steps go back, every earlier record
// of that step or a later one is left out, so `on_record` gets the run's final
// history in file order (of a step written twice, the last record). A file
// whose steps never go back reads as read_metrics reads it (after a quick
// scan of its lines for their steps). `resumes`, when given, receives each
// place the steps went back.
[[nodiscard]] Status read_run_metrics(const std::string& path, const std::function<Status(StepRecord&&)>& on_record,
                                      std::vector<MetricsResume>* resumes = nullptr);

// What cut_metrics_before_step removed.
struct MetricsCut {
  int64_t kept = 0;     // records left in the file
  int64_t removed = 0;  // records cut off
  int64_t first_removed_step = -1, last_removed_step = -1;
  int64_t bytes_removed = 0;  // with a torn last line (no newline) of a run that was killed
};

// For a run resumed from the checkpoint of `step` (steps 0 .. step - 1 done):
// cuts the metrics file back to the end of its last record of a step below
// `step`, in one ftruncate (a reader sees the file before or after), so the
// resumed run appends step `step` after step `step - 1` and no step is in the
// file twice. A missing file, one that is not a regular file, or one with
// nothing after that record is left as it is. InvalidArgument, nothing
// changed, when a line is not a metrics record (not a file epx wrote: name
// another --metrics).
[[nodiscard]] Result<MetricsCut> cut_metrics_before_step(const std::string& path, int64_t step);

}  // namespace epx
