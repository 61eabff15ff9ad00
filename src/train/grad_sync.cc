#include "train/grad_sync.h"

#include <algorithm>
#include <map>
#include <set>

#include <fmt/format.h>

#include "epx/core/clock.h"
#include "core/guard.h"

namespace epx::detail {
namespace {

std::string mib(std::size_t floats) { return fmt::format("{:.2f} MiB", static_cast<double>(floats) * 4 / (1 << 20)); }

// The stages of `model` in the order the backward finishes them, each with
// its parameters: the head and final norm, the layers from last to first,
// the input projection.
struct StagePlan {
  int stage = 0;
  MoELayer* layer = nullptr;
  std::vector<Parameter*> params;
};

std::vector<StagePlan> stages_of(MoEModel& model) {
  const std::vector<MoELayer*> layers = model.layers();
  const int L = static_cast<int>(layers.size());
  std::set<const Parameter*> in_layers;
  for (MoELayer* layer : layers)
    for (Parameter* p : layer->parameters()) in_layers.insert(p);
  StagePlan head{.stage = L, .layer = nullptr, .params = {}};
  StagePlan input{.stage = -1, .layer = nullptr, .params = {}};
  bool before_layers = true;  // parameters() lists the input, the layers, then the head
  for (Parameter* p : model.parameters()) {
    if (in_layers.count(p) != 0) {
      before_layers = false;
      continue;
    }
    (before_layers ? input : head).params.push_back(p);
  }
  std::vector<StagePlan> out = {head};
  for (int l = L - 1; l >= 0; --l) out.push_back({.stage = l, .layer = layers[l], .params = layers[l]->parameters()});
  out.push_back(input);
  return out;
}

}  // namespace

Result<std::unique_ptr<GradientSync>> GradientSync::create(const GradSyncGroups& groups, const GradSyncOptions& options,
                                                           const Deadline& deadline) {
  if (groups.world == nullptr || groups.ep == nullptr)
    return invalid_argument("GradientSync needs the world and the EP group's transports");
  if (options.bucket_bytes < 4) return invalid_argument("bucket_bytes = {} must be at least 4", options.bucket_bytes);
  std::unique_ptr<GradientSync> sync(new GradientSync(groups, options));
  sync->own_ = groups;
  if (!options.overlap) return sync;
  EPX_ASSIGN_OR_RETURN(const bool split, sync->split_groups(deadline));
  if (!split) {  // a backend without groups: after the backward, as without overlap
    sync->options_.overlap = false;
    return sync;
  }
  GradientSync* self = sync.get();
  EPX_ASSIGN_OR_RETURN(sync->thread_, start_thread("the gradient all-reduce thread", [self] { self->run_thread(); }));
  return sync;
}

// One duplicate per distinct group, split in the same order on every rank;
// false when the backend has no groups (Unimplemented on the first split,
// which every rank of the world sees alike).
Result<bool> GradientSync::split_groups(const Deadline& deadline) {
  std::map<Transport*, Transport*> dup;
  for (Transport** slot : {&own_.world, &own_.ep, &own_.edp}) {
    Transport* original = *slot;
    if (original == nullptr) continue;
    if (dup.count(original) == 0) {
      Result<std::unique_ptr<Transport>> copy = original->split(0, original->rank(), deadline);
      if (copy.status().code() == StatusCode::kUnimplemented && duplicates_.empty()) {
        own_ = groups_;
        return false;
      }
      if (!copy.is_ok())
        return Status(copy.status().code(),
                      fmt::format("the gradient thread's own transport (--grad-overlap off does without one): {}",
                                  copy.status().message()));
      duplicates_.push_back(std::move(copy).value());
      dup[original] = duplicates_.back().get();
    }
    *slot = dup[original];
  }
  return true;
}

GradientSync::~GradientSync() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

Status GradientSync::plan(MoEModel& model) {
  buckets_.clear();
  stages_.clear();
  const bool reduce_experts = groups_.edp != nullptr && groups_.edp->num_ranks() > 1;
  int open[2] = {-1, -1};  // the bucket being filled: dense, experts
  std::size_t largest = 0;
  for (StagePlan& sp : stages_of(model)) {
    stages_.push_back({.stage = sp.stage, .layer = sp.layer, .buckets = {}});
    for (Parameter* p : sp.params) {
      const bool experts = p->kind == ParamKind::kExpert;
      if (experts && !reduce_experts) continue;
      int& b = open[experts ? 1 : 0];
      if (b >= 0 && (buckets_[b].count + p->grad.size()) * 4 > options_.bucket_bytes) b = -1;
      if (b < 0) {
        b = static_cast<int>(buckets_.size());
        buckets_.push_back({.experts = experts, .stage = sp.stage, .count = 0, .params = {}});
      }
      buckets_[b].params.push_back(p);
      buckets_[b].count += p->grad.size();
      buckets_[b].stage = sp.stage;
    }
  }
  // Each bucket starts at the stage of its last parameter, in bucket order.
  for (std::size_t b = 0; b < buckets_.size(); ++b) {
    for (Stage& s : stages_)
      if (s.stage == buckets_[b].stage) s.buckets.push_back(static_cast<int>(b));
    if (buckets_[b].params.size() > 1) largest = std::max(largest, buckets_[b].count);
  }
  scratch_.assign(largest, 0.0f);
  model.set_grad_ready_hook([this](int stage) { return ready(stage); });
  return Status::ok();
}

void GradientSync::start_step() {
  std::lock_guard lock(mu_);
  num_ready_ = num_done_ = 0;
  thread_seconds_ = 0;
  times_ = {};
  reduced_bytes_ = 0;
}

Status GradientSync::ready(int stage) {
  std::lock_guard lock(mu_);
  if (!failure_.is_ok()) return failure_;
  if (num_ready_ >= stages_.size() || stages_[num_ready_].stage != stage)
    return failed_precondition("gradients of stage {} were ready out of order (expected {})", stage,
                               num_ready_ < stages_.size() ? stages_[num_ready_].stage : -2);
  ++num_ready_;
  if (options_.overlap) cv_.notify_all();
  return Status::ok();
}

Status GradientSync::finish(const Deadline& deadline) {
  Stopwatch watch;
  if (num_ready_ != stages_.size())
    return failed_precondition("gradient all-reduce: {} of {} stages were ready; run a whole backward first",
                               num_ready_, stages_.size());
  Status status;
  if (options_.overlap) {
    std::unique_lock lock(mu_);
    const bool done = cv_.wait_until(lock, deadline.when(),
                                     [&] { return num_done_ == stages_.size() || !failure_.is_ok(); });
    if (!failure_.is_ok()) {
      status = failure_;
    } else if (!done) {
      status = deadline_exceeded("gradient all-reduce: {} of {} stages reduced when the deadline passed", num_done_,
                                 stages_.size());
    }
    times_.reduce = thread_seconds_;
  } else {
    Stopwatch reduce;
    for (std::size_t s = 0; s < stages_.size() && status.is_ok(); ++s) status = reduce_stage(s, groups_);
    times_.reduce = reduce.seconds();
  }
  times_.wait = watch.seconds();
  return status;
}

// (a) the layer's replica sum, then (b) and (c): the buckets that start here.
Status GradientSync::reduce_stage(std::size_t s, const GradSyncGroups& on) {
  const Stage& stage = stages_[s];
  if (stage.layer != nullptr) {
    Status st = stage.layer->sum_replica_gradients(*on.ep, Deadline::after(options_.timeout));
    if (!st.is_ok())
      return Status(st.code(), fmt::format("layer {}: summing replica gradients over the EP group: {}", stage.stage,
                                           st.message()));
  }
  for (int b : stage.buckets) EPX_RETURN_IF_ERROR(reduce_bucket(b, buckets_[b].experts ? *on.edp : *on.world));
  return Status::ok();
}

Status GradientSync::reduce_bucket(int b, Transport& group) {
  GradBucket& bucket = buckets_[b];
  const Deadline deadline = Deadline::after(options_.timeout);
  Status st;
  if (bucket.params.size() == 1) {
    st = group.all_reduce(std::span<float>(bucket.params[0]->grad), ReduceOp::kSum, deadline);
  } else {
    float* at = scratch_.data();
    for (const Parameter* p : bucket.params) at = std::copy(p->grad.begin(), p->grad.end(), at);
    st = group.all_reduce(std::span<float>(scratch_.data(), bucket.count), ReduceOp::kSum, deadline);
    const float* from = scratch_.data();
    for (Parameter* p : bucket.params) {
      std::copy_n(from, p->grad.size(), p->grad.begin());
      from += p->grad.size();
    }
  }
  reduced_bytes_ += bucket.count * 4;
  if (st.is_ok()) return st;
  return Status(st.code(), fmt::format("gradient bucket {} of {} ({}, {} over {} ranks): {}", b + 1, buckets_.size(),
                                       bucket.experts ? "expert gradients" : "dense gradients", mib(bucket.count),
                                       group.num_ranks(), st.message()));
}

// Reduces stages as the hook hands them over, until stopped; after an error
// it only counts them, so finish() returns at once.
void GradientSync::run_thread() {
  set_thread_wait_style(WaitStyle::kBackground);
  std::unique_lock lock(mu_);
  for (;;) {
    cv_.wait(lock, [&] { return stop_ || num_done_ < num_ready_; });
    if (stop_) return;
    const std::size_t s = num_done_;
    const bool failed = !failure_.is_ok();
    lock.unlock();
    Stopwatch watch;
    Status status = failed ? Status::ok() : guard("the gradient all-reduce thread", [&] { return reduce_stage(s, own_); });
    const double seconds = watch.seconds();
    lock.lock();
    thread_seconds_ += seconds;
    if (!status.is_ok() && failure_.is_ok()) failure_ = status;
    ++num_done_;
    cv_.notify_all();
  }
}

}  // namespace epx::detail
