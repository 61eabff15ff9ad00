// GradientSync: every gradient reduction of one training step on one rank,
// packed into buckets and (by default) overlapped with the backward pass.
//
// Three kinds of reduction, each over its own group:
//  (a) the replicas of a redundant (EPLB) expert are summed over the EP group
//      (MoELayer::sum_replica_gradients), so every replica takes the same update;
//  (b) routed-expert gradients are summed over the EDP group (the ranks that
//      hold the same experts in the other EP groups);
//  (c) dense gradients (input projection, routers, norms, shared experts, the
//      head) are summed over the world.
// The loss is already scaled by the global batch, so sums (not means) make the
// update that of one rank on the global batch.
//
// Buckets: parameters are taken in the order their gradients become final in
// the backward (the head first, then the layers from the last to the first,
// the input projection last) and packed, per group, into buckets of at most
// `bucket_bytes` (a larger parameter is a bucket of its own, reduced in
// place). A bucket starts once its last parameter is final. Every rank plans
// the same buckets from the same shapes, so the collectives line up.
//
// Overlap (options.overlap): the model's GradReadyHook hands each finished
// stage to a thread of this object that reduces it on duplicates of the
// groups (Transport::split(0, rank)), beside the backward's own collectives on
// the originals; finish() waits for the last bucket. Without overlap finish()
// reduces the same buckets on the caller's thread, on the originals. The
// reduction is element-wise in rank order either way, so both modes (and any
// bucket size) give the same bits.
//
// Errors: a failed reduction is returned by finish() (and by the next hook
// call, which stops the backward early), naming the bucket; the transport
// already fails its peers, so nothing is aborted a second time. Every wait has
// a deadline.
//
//   EPX_ASSIGN_OR_RETURN(auto sync, GradientSync::create({&world, &ep, &edp}, {}, deadline));
//   EPX_RETURN_IF_ERROR(sync->plan(*model));      // sets the model's hook
//   sync->start_step();
//   EPX_ASSIGN_OR_RETURN(double loss, model->forward_backward(batch, global_tokens));
//   EPX_RETURN_IF_ERROR(sync->finish(deadline));  // gradients summed
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "epx/comm/transport.h"
#include "epx/train/model.h"

namespace epx::detail {

// 4 MiB: one bucket is one collective call, which costs a rendezvous of all
// its ranks (tens of microseconds in-process or over MPI shared memory); at a
// few GB/s 4 MiB takes about a millisecond, so the call is a few percent of
// it, while a layer of a few MiB of expert gradients still starts its own
// bucket as soon as it is final. (PyTorch DDP: 25 MiB for GPU links.)
constexpr std::size_t kDefaultBucketBytes = std::size_t{4} << 20;

struct GradSyncGroups {
  Transport* world = nullptr;  // dense gradients
  Transport* ep = nullptr;     // the layers' own transport: replica sums; may be `world`
  Transport* edp = nullptr;    // routed-expert gradients; may be `world`; null: a group of one
};

struct GradSyncOptions {
  std::size_t bucket_bytes = kDefaultBucketBytes;
  bool overlap = true;
  Milliseconds timeout{60000};  // each collective of the thread
};

// One step's times on this rank, in seconds.
struct GradSyncTimes {
  double reduce = 0;  // in the reductions (on the thread with overlap)
  double wait = 0;    // in finish(): what the backward did not hide
};

// One planned bucket, for reports and tests.
struct GradBucket {
  bool experts = false;  // routed-expert gradients over the EDP group; else dense over the world
  int stage = 0;         // starts when this stage is final: num_layers (head), a layer, -1 (input)
  std::size_t count = 0; // floats
  std::vector<Parameter*> params;
};

class GradientSync {
 public:
  // Splits the duplicates of the groups (collective over each group, with
  // overlap only) and starts the thread. On a backend without groups
  // (split: Unimplemented) it reduces after the backward: overlapped() false.
  static Result<std::unique_ptr<GradientSync>> create(const GradSyncGroups& groups, const GradSyncOptions& options,
                                                      const Deadline& deadline);
  ~GradientSync();  // stops the thread after its current collective
  GradientSync(const GradientSync&) = delete;
  GradientSync& operator=(const GradientSync&) = delete;

  // Plans the buckets of `model` and sets its GradReadyHook (again after a
  // re-placement rebuilt its layers). Not while a step is in flight.
  [[nodiscard]] Status plan(MoEModel& model);
  // Arms the next step: call before forward_backward.
  void start_step();
  // The hook: stage `stage`'s gradients are final.
  [[nodiscard]] Status ready(int stage);
  // Returns once every bucket of the step is reduced, or the first error.
  [[nodiscard]] Status finish(const Deadline& deadline);

  [[nodiscard]] bool overlapped() const { return options_.overlap; }
  [[nodiscard]] const GradSyncTimes& times() const { return times_; }
  [[nodiscard]] const std::vector<GradBucket>& buckets() const { return buckets_; }
  // Floats this rank contributed to reductions in the last step (all kinds).
  [[nodiscard]] uint64_t reduced_bytes() const { return reduced_bytes_; }

 private:
  struct Stage {
    int stage = 0;
    MoELayer* layer = nullptr;  // replica sum; null for the head and the input
    std::vector<int> buckets;   // started at this stage, in order
  };
  GradientSync(const GradSyncGroups& groups, const GradSyncOptions& options) : groups_(groups), options_(options) {}
  [[nodiscard]] Result<bool> split_groups(const Deadline& deadline);
  [[nodiscard]] Status reduce_stage(std::size_t s, const GradSyncGroups& on);
  [[nodiscard]] Status reduce_bucket(int b, Transport& group);
  void run_thread();

  GradSyncGroups groups_;
  GradSyncGroups own_;  // the thread's duplicates (overlap)
  std::vector<std::unique_ptr<Transport>> duplicates_;
  GradSyncOptions options_;
  std::vector<GradBucket> buckets_;
  std::vector<Stage> stages_;
  std::vector<float> scratch_;
  GradSyncTimes times_;
  uint64_t reduced_bytes_ = 0;

  std::thread thread_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::size_t num_ready_ = 0;  // stages handed over this step
  std::size_t num_done_ = 0;   // stages reduced this step
  Status failure_;             // the thread's first error
  double thread_seconds_ = 0;
  bool stop_ = false;
};

}  // namespace epx::detail
