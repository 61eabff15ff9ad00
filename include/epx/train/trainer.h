// Training: the MoE model on R ranks, one step after another.
//
// `train` builds an InprocWorld of num_ranks ranks (num_nodes emulated
// nodes), or, given a `transport` (e.g. MPI: one rank per process, every
// process calling train() with the same config), runs this process's rank on
// it; then it gives every rank its model replica (dense parameters replicated,
// experts spread by the placement) and runs `steps` optimizer steps. Each
// step's global batch is samples [step * batch_tokens, (step + 1) *
// batch_tokens) of the task's deterministic stream, split into contiguous
// shares over the ranks, so R ranks and one rank see the same batch. After
// every step `on_step` gets a StepReport (on the calling thread's behalf
// from rank 0; keep it quick); a non-OK Status from it stops every rank
// after that step.
//
// EP x EDP (ep < num_ranks): the ranks form num_ranks / ep EP groups
// (ParallelLayout: consecutive ranks, filling nodes first), each holding
// every expert once; the exchange runs inside an EP group. Dense gradients
// (input, output, norms, routers, shared experts) are summed over all ranks,
// routed-expert gradients over the EDP group (the ranks holding the same
// experts); aux losses, load statistics and the expert bias see the global
// batch. The update equals one EP group's (or one rank's) on the same global
// batch up to the order of fp32 sums.
//
// Balancing strategies: none, the auxiliary load-balancing loss, the
// aux-loss-free expert bias (DeepSeek-V3), a capacity factor with position
// or score drops, and EPLB (every eplb_every steps, re-place each layer's
// experts over eplb_slots physical slots with redundant replicas, from the
// window's per-expert loads); they combine (e.g. bias + capacity, bias + eplb).
//
// Checkpoints (save_dir / resume_dir) are in logical order: each dense
// parameter and each logical expert once with its AdamW moments, the expert
// biases, the step and (eplb) the current window's loads, plus the layout that
// wrote them. Any layout of the same model resumes from one (resharding); on
// the same layout (ranks, nodes, EP, slots) the resumed run continues with the
// same bits as an uninterrupted one, on another within fp32 reassociation.
// save_dir is a folder epx owns: it must be new, empty or
// already hold epx's marker `.epx-checkpoints` (nothing else is ever deleted
// or overwritten). Each save is a step folder (step-000120/) written under a
// temporary name, fsynced and renamed, then recorded in `latest` (replaced
// atomically); the newest keep_checkpoints step folders stay. A failed save
// removes its temporary folder, keeps the earlier checkpoints and stops the
// run with the error. Every file carries a header and XXH3-64 checksums that
// meta.json lists (itself checksummed); a resume verifies all of it on every
// rank before anything is loaded. One run writes into a save_dir at a time:
// train() holds its lock (SaveLock, on rank 0) for the whole run; each
// checkpoint records the run's id and data settings, and a resume refuses
// other data settings (check_resume). See docs/design.md, Checkpoints.
//
//   epx::TrainConfig config;  // defaults: the tiny synthetic task
//   EPX_ASSIGN_OR_RETURN(epx::TrainSummary summary,
//                        epx::train(config, [](const epx::StepReport& r) { ... }));
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "epx/core/trace.h"
#include "epx/routing/load_stats.h"
#include "epx/train/data.h"
#include "epx/train/model.h"
#include "epx/train/optimizer.h"

namespace epx {

struct BalancingConfig {
  double aux_loss_coeff = 0.0;  // > 0: the auxiliary loss
  AuxLossKind aux_loss = AuxLossKind::kMicroBatch;
  bool expert_bias = false;     // aux-loss-free bias balancing
  float bias_rate = ExpertBias::kDefaultRate;
  double capacity_factor = 0.0;  // > 0: drop over capacity
  DropPolicy drop_policy = DropPolicy::kPosition;
  bool eplb = false;        // re-place experts with redundant replicas
  int64_t eplb_every = 50;  // steps between re-placements
  int eplb_slots = 0;       // physical slots per layer and EP group; 0: experts + ep (rounded up to a multiple of ep)
  // A short name: "none", "aux", "bias", "capacity", "eplb", combinations joined by '+'.
  [[nodiscard]] std::string name() const;
  // The physical slots per layer (of each EP group) with eplb; num_ranks:
  // the ranks of an EP group.
  [[nodiscard]] int slots(int num_experts, int num_ranks) const {
    // Default: one redundant slot per rank above the experts' own.
    return eplb_slots > 0 ? eplb_slots : ((num_experts + num_ranks - 1) / num_ranks + 1) * num_ranks;
  }
};

// "none", "aux", "aux-global", "bias", "capacity" (or "capacity-score"),
// "eplb", and '+'-joined combinations such as "bias+capacity";
// InvalidArgument otherwise.
Result<BalancingConfig> parse_balancing(std::string_view text, const BalancingConfig& defaults);

struct TrainConfig {
  ModelConfig model;  // max_tokens_per_rank is set from batch_tokens and num_ranks
  SyntheticTaskConfig synthetic;
  TextTaskConfig text;  // used when model.task == kNextByte
  BalancingConfig balancing;
  int num_ranks = 4;
  int num_nodes = 1;
  // Ranks per expert-parallel group (0: all ranks, one EP group). It divides
  // num_ranks; the num_ranks / ep EP groups each hold every expert once and
  // are data-parallel to each other (EDP): ParallelLayout, docs/design.md.
  int ep = 0;
  int64_t steps = 200;
  int64_t batch_tokens = 512;  // global tokens per step
  LearningRateSchedule schedule;
  AdamWConfig adamw;
  double clip_norm = 1.0;  // 0 = no clipping
  // Gradient all-reduces start per bucket as soon as the backward has made its
  // gradients final, on a thread beside the rest of the backward (the same
  // bits as off, where they run after it); buckets of about grad_bucket_bytes.
  bool grad_overlap = true;
  int64_t grad_bucket_bytes = int64_t{4} << 20;
  std::string save_dir;    // write a checkpoint at the end (and every save_every steps)
  int64_t save_every = 0;
  int keep_checkpoints = 2;  // step folders kept in save_dir (>= 1)
  // Checkpoints every save_every steps are written while training goes on:
  // the step boundary copies the state (the snapshot, one checkpoint's share
  // per rank), a thread writes and fsyncs the files, and the step boundary
  // after every rank has written them publishes the step folder. At most one
  // save is in flight. The final checkpoint and a preemption's are written
  // at once. The same files as without; a failed write stops the run as a
  // failed save does, and the earlier checkpoints stay.
  bool async_save = false;
  std::string resume_dir;    // start from this checkpoint: a save_dir (its `latest`) or one step folder
  // The run's id, recorded in each checkpoint it writes and in save_dir's
  // lock (SaveLock). Empty: train() takes the resumed checkpoint's, or makes
  // a new one (resolve_run_id); a resume continues the run of its checkpoint.
  std::string run_id;
  // save_dir holding step folders of another run (any step folder, for a run
  // that does not resume) is refused unless this is set; the run then takes
  // over `latest` and replaces a step folder of the same step; the other
  // run's other step folders stay (keep_checkpoints prunes only this run's).
  bool overwrite_checkpoints = false;
  // A resume whose data settings (data_settings) differ from those its
  // checkpoint recorded is refused unless this is set.
  bool allow_data_change = false;
  Tracer* tracer = nullptr;  // records spans of steps [trace_first, trace_first + trace_steps)
  int64_t trace_first = 1;
  int64_t trace_steps = 0;
  // Run this process's rank on this transport instead of num_ranks threads;
  // it must have num_ranks ranks on num_nodes nodes. The summary and
  // on_step are then filled on rank 0 only.
  Transport* transport = nullptr;
  // Every this many steps (0: never) a step's report carries the full
  // who-waited-for-whom matrices (StepReport::wait_matrix); every report
  // carries each rank's summary of them (RankTimes::exchange_wait ...).
  int64_t wait_matrix_every = 100;
  // A test hook for fault injection: when set, every rank calls it before
  // each step (from the rank's own thread). Sleeping in it stalls the rank;
  // a non-OK status makes the rank fail as a crashed one would. The other
  // ranks then fail within model.timeout naming it (docs/errors.md).
  std::function<Status(int rank, int64_t step)> before_step;
  // Preemption: when set, every rank reads it after each step; once it is
  // true on any rank, every rank saves a checkpoint of that step into
  // save_dir (which must be set) and train() returns with
  // TrainSummary::preempted_at set. epx train points it at a flag its
  // SIGTERM/SIGUSR1 handler raises (lock-free, so a handler may set it).
  const std::atomic<bool>* preempt = nullptr;

  // The ranks of one EP group: ep, or num_ranks when ep is 0.
  [[nodiscard]] int ep_size() const { return ep > 0 ? ep : num_ranks; }
  // Applies balancing to the model's layer config and sizes the buffers.
  [[nodiscard]] Result<ModelConfig> resolved_model() const;
  [[nodiscard]] Status validate() const;
};

struct RankTimes {
  double router = 0, dispatch = 0, experts = 0, combine = 0, dense = 0;
  double wait = 0;  // in the barrier after forward/backward: waiting for the slowest rank
  double sync = 0;  // after the backward: the gradient all-reduce's exposed part, clipping, optimizer, stats
  double total = 0;
  double grad_reduce = 0;  // in the gradient all-reduces (with grad_overlap on the thread, beside the backward)
  double grad_wait = 0;    // waiting for them after the backward (part of sync): what overlap did not hide
  double grad_bytes = 0;   // not a time: bytes this rank contributed to them (TransportCounters::collective_bytes)
  // Who waited for whom in the step's dispatches and combines (every layer,
  // forward and backward; WaitRecord in epx/exchange/buffer.h, meanings in
  // docs/operations.md), over world ranks.
  double exchange_wait = 0;  // seconds this rank was blocked on others (WaitRecord::blocked)
  int waited_for = -1;       // the rank it waited for most (arrival + data); -1: none
  double late = 0;           // seconds the others waited for this rank to arrive (a column sum of arrival)
  double slow_data = 0;      // seconds the others waited for this rank's data (a column sum of data)
  [[nodiscard]] double communication() const { return dispatch + combine + sync; }
};

// The full who-waited-for-whom picture of one step, world ranks x world
// ranks, row-major [r * num_ranks + s], seconds summed over the step's
// dispatches and combines: arrival[r][s], rank r waited for s to arrive;
// data[r][s], for s's data (WaitRecord). Ranks of different EP groups: 0.
struct WaitMatrixReport {
  int num_ranks = 0;
  std::vector<double> arrival, data;
};

// An EPLB re-placement done at the end of a step.
struct EplbReport {
  // Per layer: max / mean rank load of the window's per-expert loads under
  // the old and the new placement (1 = perfectly even).
  std::vector<double> balance_before, balance_after;
  int num_moved_slots = 0;  // all layers, all EP groups (each moves the same slots inside itself)
  // Bytes a real system would send between ranks, over every EP group: one
  // expert (w1, w3, w2 and their two AdamW moments, f32) per slot whose new
  // expert was not on its rank before (a replica already there is a local
  // copy). epx moves them with a full-table all-reduce.
  int64_t moved_bytes = 0;
};

struct StepReport {
  int64_t step = 0;  // 0-based
  int64_t steps = 0;
  int num_nodes = 1;  // of the run (ranks node-major); the straggler diagnosis tells links from ranks by it
  double loss = 0;       // main + auxiliary, summed over ranks
  double main_loss = 0;  // the task loss of the global batch
  double learning_rate = 0;
  double grad_norm = 0;
  double seconds = 0;
  double tokens_per_second = 0;
  std::vector<LoadStats> layers;  // global, per layer
  std::vector<RankTimes> ranks;
  std::optional<EplbReport> eplb;  // set on the steps that end with a re-placement
  std::optional<WaitMatrixReport> wait_matrix;  // every TrainConfig::wait_matrix_every steps
  int64_t resumed_from = -1;  // the first step of a resumed run: its checkpoint's step; -1 otherwise
  // One JSON object (docs/operations.md); non-finite numbers (a NaN loss) as null.
  [[nodiscard]] std::string to_json() const;
};

struct TrainSummary {
  int64_t steps = 0;
  double first_loss = 0;
  double final_loss = 0;      // mean main loss of the last min(10, steps) steps
  double tokens_per_second = 0;  // over the run, after the first step
  double max_vio = 0;         // mean over layers of the last step's MaxVio
  double mean_max_vio = 0;    // ... averaged over the last 10 steps
  int64_t dropped = 0;        // (token, slot) pairs dropped over the run
  double idle_fraction = 0;   // mean over the last 10 steps of the worst layer's idle fraction
  double communication_share = 0;  // dispatch + combine + sync over total time, all ranks
  int64_t eplb_moved_bytes = 0;  // over the run
  // Every rank's parameters after the last step, dense ones once, expert ones
  // by "name#global_expert" (the physical slot with eplb; layer_slots says
  // which logical expert it holds; with several EP groups, EP group 0's) for
  // comparisons; filled when keep_parameters.
  std::map<std::string, std::vector<float>> parameters;
  std::vector<std::vector<int32_t>> layer_slots;  // eplb: the final slot -> expert map per layer
  // A preempted run (TrainConfig::preempt): the step it stopped and saved
  // at (the checkpoint step-NNNNNN in save_dir), or -1 when it ran to the end.
  int64_t preempted_at = -1;
};

// With a resume folder: its meta file is of this model (any layout: ranks,
// EP, nodes, eplb slots), every file it lists is there, whole and of this
// checkpoint (sizes, headers, checksums), and its step is at most
// config.steps; its data settings, when it recorded them, are this run's
// (InvalidArgument naming each that differs, its old and new value, unless
// allow_data_change). Reads every file once.
Status check_resume(const TrainConfig& config);

// The settings that decide which data each step trains on, name -> value:
// data ("synthetic", or "text:" and the file's absolute path), seed,
// batch_tokens, and clusters, zipf, cluster_spread, input_dim, output_dim
// (synthetic) or window (text). A checkpoint records them; a resume compares.
[[nodiscard]] std::map<std::string, std::string> data_settings(const TrainConfig& config);

// Where a resume starts: the step folder, its step (steps done) and the run
// that wrote it (empty for a checkpoint written before run ids). Reads
// meta.json only.
struct ResumePoint {
  std::string folder;
  int64_t step = 0;
  std::string run_id;
};
[[nodiscard]] Result<ResumePoint> resume_point(const TrainConfig& config);

// config.run_id, else the resumed checkpoint's, else a new one (16 hex digits).
[[nodiscard]] Result<std::string> resolve_run_id(const TrainConfig& config);

// What --save needs, found before step 1 by check_save.
struct SavePlan {
  std::string folder;            // save_dir; empty when there is none
  std::string probed;            // save_dir or, before the first save, its nearest existing parent
  int keep = 0;
  int64_t checkpoint_bytes = 0;  // one checkpoint, all ranks: an estimate from the shapes (an upper bound)
  uint64_t free_bytes = 0;       // statvfs of `probed`
  bool tight = false;            // free < (keep + 1) x checkpoint_bytes: a later save may fail
  [[nodiscard]] std::string describe() const;  // one line for people
};

// With a save folder: it is epx's to write (check above), a probe file can be
// created and removed in it (or in its nearest existing parent), and its
// filesystem has room for one checkpoint (InvalidArgument with the numbers
// otherwise); `tight` warns when it lacks room for keep + 1. It holds no step
// folder of another run unless overwrite_checkpoints (InvalidArgument naming
// the run and its steps): a run that does not resume owns none of them, a
// resumed one those of its checkpoint's run (and those written before run
// ids). Touches no file but the probe.
[[nodiscard]] Result<SavePlan> check_save(const TrainConfig& config);


// Called on rank 0 after every step. It may return a Status (or nothing):
// a non-OK Status stops the run after that step on every rank (the ranks
// agree on it in one small all-reduce per step), and train() returns it.
class StepCallback {
 public:
  StepCallback() = default;
  template <typename F>
    requires(std::is_invocable_v<F&, const StepReport&> && !std::is_same_v<std::decay_t<F>, StepCallback>)
  StepCallback(F fn) {  // NOLINT(google-explicit-constructor): lambdas convert
    if constexpr (std::is_void_v<std::invoke_result_t<F&, const StepReport&>>)
      fn_ = [fn = std::move(fn)](const StepReport& r) mutable {
        fn(r);
        return Status::ok();
      };
    else
      fn_ = std::move(fn);
  }
  explicit operator bool() const { return static_cast<bool>(fn_); }
  [[nodiscard]] Status operator()(const StepReport& r) const { return fn_(r); }

 private:
  std::function<Status(const StepReport&)> fn_;
};

// With a resume folder written by another layout (ranks, nodes, EP, eplb
// slots): one line saying so and how the experts are placed now (e.g.
// "resharding checkpoint ck (step 6) written by 4 ranks on 1 node (EP 4, 12
// slots per layer, eplb) onto 2 ranks ...: expert placement computed anew from
// the saved eplb window loads"). Empty without a resume folder or on the same
// layout (the run then continues with the same bits as one that never stopped).
[[nodiscard]] Result<std::string> resume_note(const TrainConfig& config);
// With a resume folder: one line when its checkpoint recorded no data
// settings (written before they were; nothing is checked), or when
// allow_data_change let them differ (naming each). Empty otherwise.
[[nodiscard]] Result<std::string> resume_data_note(const TrainConfig& config);

Result<TrainSummary> train(const TrainConfig& config, const StepCallback& on_step = {}, bool keep_parameters = false);

}  // namespace epx
