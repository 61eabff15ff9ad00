// GradientSync: which gradients are summed over which group, in buckets in
// the backward's order; overlap on and off give the same bits (also through
// the trainer); a reduction that cannot complete is returned by finish()
// naming its bucket; the gradient norm over the EP group counts each expert once.
#include "train/grad_sync.h"
#include "train/tiny_config.h"

#include <gtest/gtest.h>

#include <cstring>
#include <set>

#include "epx/comm/inproc.h"
#include "epx/train/trainer.h"

namespace epx {
namespace {

using detail::GradientSync;

ModelConfig tiny_model(int num_ranks) {
  auto m = testing::tiny_config({.num_ranks = num_ranks}).resolved_model();
  EXPECT_TRUE(m.is_ok()) << m.status().to_string();
  return m.value();
}

// Rank-encoded gradients: a sum in rank order is checked exactly.
float grad_value(int rank, std::size_t param, std::size_t i) {
  return static_cast<float>(rank + 1) * 0.25f + static_cast<float>(param) * 0.5f + static_cast<float>(i % 7) * 0.125f;
}

void fill_grads(MoEModel& model, int rank) {
  const std::vector<Parameter*> params = model.parameters();
  for (std::size_t p = 0; p < params.size(); ++p)
    for (std::size_t i = 0; i < params[p]->grad.size(); ++i) params[p]->grad[i] = grad_value(rank, p, i);
}

// Hands every stage over as the backward would: head, layers last to first, input.
Status all_stages_ready(GradientSync& sync, int num_layers) {
  for (int s = num_layers; s >= -1; --s) EPX_RETURN_IF_ERROR(sync.ready(s));
  return Status::ok();
}

TEST(GradSync, BucketsFollowTheBackwardAndHoldEveryDenseParameterOnce) {
  const ModelConfig m = tiny_model(2);
  std::vector<Status> st = run_ranks(*Topology::create(2, 1), [&](Transport& t) -> Status {
    EPX_ASSIGN_OR_RETURN(auto model, MoEModel::create(m, t));
    EPX_ASSIGN_OR_RETURN(auto sync, GradientSync::create({.world = &t, .ep = &t},
                                                         {.bucket_bytes = 2048, .overlap = false},
                                                         Deadline::after(std::chrono::seconds(10))));
    EPX_RETURN_IF_ERROR(sync->plan(*model));
    std::multiset<const Parameter*> seen;
    int last_stage = m.num_layers + 1;
    for (const detail::GradBucket& b : sync->buckets()) {
      EXPECT_FALSE(b.experts);  // EDP of one: no expert bucket
      EXPECT_LE(b.stage, last_stage) << "buckets start in the backward's order";
      last_stage = b.stage;
      if (b.params.size() > 1) {
        EXPECT_LE(b.count * 4, 2048u);
      }
      for (const Parameter* p : b.params) seen.insert(p);
    }
    const std::vector<Parameter*> params = model->parameters();  // input, layers, final norm, head
    EXPECT_EQ(sync->buckets().front().params.front(), params[params.size() - 2]);  // the head is final first
    EXPECT_EQ(sync->buckets().back().params.back(), params.front());  // the input projection last
    EXPECT_EQ(sync->buckets().back().stage, -1);
    for (Parameter* p : model->parameters())
      EXPECT_EQ(seen.count(p), p->kind == ParamKind::kDense ? 1u : 0u) << p->name;
    return Status::ok();
  });
  EXPECT_TRUE(first_error(st).is_ok()) << first_error(st).to_string();
}

// Dense gradients summed over the world; with `edp_of` (rank -> EDP color),
// expert gradients over that group; overlap on or off and any bucket size.
void check_sums(bool overlap, std::size_t bucket_bytes, bool two_edp) {
  constexpr int R = 4;
  const ModelConfig m = tiny_model(two_edp ? 2 : R);
  std::vector<Status> st = run_ranks(*Topology::create(R, 1), [&](Transport& world) -> Status {
    const auto deadline = [] { return Deadline::after(std::chrono::seconds(10)); };
    const int rank = world.rank();
    std::unique_ptr<Transport> ep, edp;
    if (two_edp) {  // EP groups {0,1}, {2,3}; EDP groups {0,2}, {1,3}
      EPX_ASSIGN_OR_RETURN(ep, world.split(rank / 2, rank, deadline()));
      EPX_ASSIGN_OR_RETURN(edp, world.split(rank % 2, rank, deadline()));
    }
    Transport& layer_group = two_edp ? *ep : world;
    EPX_ASSIGN_OR_RETURN(auto model, MoEModel::create(m, world, layer_group));
    EPX_ASSIGN_OR_RETURN(auto sync, GradientSync::create({.world = &world, .ep = &layer_group, .edp = edp.get()},
                                                         {.bucket_bytes = bucket_bytes, .overlap = overlap},
                                                         deadline()));
    EPX_RETURN_IF_ERROR(sync->plan(*model));
    EXPECT_EQ(sync->overlapped(), overlap);  // groups split: the thread runs
    for (int step = 0; step < 2; ++step) {  // a second step reuses the plan and the thread
      fill_grads(*model, rank);
      sync->start_step();
      EPX_RETURN_IF_ERROR(all_stages_ready(*sync, m.num_layers));
      EPX_RETURN_IF_ERROR(sync->finish(deadline()));
      const std::vector<Parameter*> params = model->parameters();
      for (std::size_t p = 0; p < params.size(); ++p) {
        const bool expert = params[p]->kind == ParamKind::kExpert;
        for (std::size_t i = 0; i < params[p]->grad.size(); ++i) {
          float want = 0;  // in rank order, as the transport sums
          for (int r = 0; r < R; ++r)
            if (!expert || (two_edp && r % 2 == rank % 2)) want += grad_value(r, p, i);
          if (expert && !two_edp) want = grad_value(rank, p, i);
          if (std::memcmp(&want, &params[p]->grad[i], sizeof(float)) != 0)
            return internal_error("rank {} {}[{}] = {}, want {}", rank, params[p]->name, i, params[p]->grad[i], want);
        }
      }
      EXPECT_GT(sync->reduced_bytes(), 0u);
    }
    return Status::ok();
  });
  EXPECT_TRUE(first_error(st).is_ok()) << first_error(st).to_string();
}

TEST(GradSync, DenseOverTheWorldWithoutOverlap) { check_sums(false, detail::kDefaultBucketBytes, false); }
TEST(GradSync, DenseOverTheWorldWithOverlapAndSmallBuckets) { check_sums(true, 512, false); }
TEST(GradSync, ExpertsOverTheEdpGroupWithoutOverlap) { check_sums(false, 1024, true); }
TEST(GradSync, ExpertsOverTheEdpGroupWithOverlap) { check_sums(true, 1024, true); }

// Rank 1 never hands its gradients over: rank 0's first bucket cannot
// complete; finish() says which bucket, within the timeout, in both modes.
void check_stuck_peer(bool overlap) {
  const ModelConfig m = tiny_model(2);
  std::vector<Status> st = run_ranks(*Topology::create(2, 1), [&](Transport& t) -> Status {
    const auto deadline = [] { return Deadline::after(std::chrono::seconds(10)); };
    EPX_ASSIGN_OR_RETURN(auto model, MoEModel::create(m, t));
    EPX_ASSIGN_OR_RETURN(auto sync, GradientSync::create({.world = &t, .ep = &t},
                                                         {.overlap = overlap, .timeout = Milliseconds(300)},
                                                         deadline()));
    EPX_RETURN_IF_ERROR(sync->plan(*model));
    EXPECT_EQ(sync->overlapped(), overlap);
    sync->start_step();
    if (t.rank() == 1) return Status::ok();  // leaves without reducing
    EPX_RETURN_IF_ERROR(all_stages_ready(*sync, m.num_layers));
    return sync->finish(deadline());
  });
  ASSERT_EQ(st.size(), 2u);
  EXPECT_FALSE(st[0].is_ok());
  EXPECT_NE(st[0].message().find("gradient bucket 1 of"), std::string::npos) << st[0].to_string();
}

TEST(GradSync, StuckPeerIsNamedByFinishWithoutOverlap) { check_stuck_peer(false); }
TEST(GradSync, StuckPeerIsNamedByFinishWithOverlap) { check_stuck_peer(true); }

TEST(GradSync, FinishBeforeTheWholeBackwardIsRefused) {
  const ModelConfig m = tiny_model(1);
  std::vector<Status> st = run_ranks(*Topology::create(1, 1), [&](Transport& t) -> Status {
    EPX_ASSIGN_OR_RETURN(auto model, MoEModel::create(m, t));
    EPX_ASSIGN_OR_RETURN(auto sync, GradientSync::create({.world = &t, .ep = &t}, {.overlap = false},
                                                         Deadline::after(std::chrono::seconds(10))));
    EPX_RETURN_IF_ERROR(sync->plan(*model));
    sync->start_step();
    EXPECT_EQ(sync->ready(0).code(), StatusCode::kFailedPrecondition);  // the head comes first
    EXPECT_EQ(sync->finish(Deadline::after(std::chrono::seconds(1))).code(), StatusCode::kFailedPrecondition);
    return Status::ok();
  });
  EXPECT_TRUE(first_error(st).is_ok()) << first_error(st).to_string();
}

// With EDP copies the norm is taken over the EP group, which holds each
// logical expert once: 4 ranks, EP groups {0, 1} and {2, 3}, the expert
// gradients of EP rank e the same in both groups (as after the EDP
// all-reduce): sqrt(3^2 + 4^2 + 12^2) = 13 on every rank, not sqrt(9 + 2 x 160).
TEST(GradSync, NormOverTheEpGroupCountsEachExpertOnce) {
  std::vector<Status> st = run_ranks(*Topology::create(4, 1), [&](Transport& t) -> Status {
    const auto deadline = [] { return Deadline::after(std::chrono::seconds(10)); };
    EPX_ASSIGN_OR_RETURN(auto ep, t.split(t.rank() / 2, t.rank(), deadline()));
    Parameter dense("d", ParamKind::kDense, 1, 1), expert("e", ParamKind::kExpert, 1, 1);
    dense.grad = {3.0f};
    expert.grad = {ep->rank() == 0 ? 4.0f : 12.0f};
    Parameter* params[] = {&dense, &expert};
    EPX_ASSIGN_OR_RETURN(const double norm, clip_grad_norm(params, 0.0, *ep, deadline()));
    EXPECT_DOUBLE_EQ(norm, 13.0);
    return Status::ok();
  });
  EXPECT_TRUE(first_error(st).is_ok()) << first_error(st).to_string();
}

// Through the trainer: overlap on and off, and a small bucket size, end with
// the same parameter bits; with EP 2 x EDP 2 and with EPLB replicas too.
std::map<std::string, std::vector<float>> trained(TrainConfig c) {
  auto summary = train(c, {}, /*keep_parameters=*/true);
  EXPECT_TRUE(summary.is_ok()) << summary.status().to_string();
  return summary.is_ok() ? summary.value().parameters : std::map<std::string, std::vector<float>>{};
}

void expect_same_bits(const std::map<std::string, std::vector<float>>& a,
                      const std::map<std::string, std::vector<float>>& b) {
  ASSERT_EQ(a.size(), b.size());
  ASSERT_FALSE(a.empty());
  for (const auto& [name, values] : a) {
    const auto& other = b.at(name);
    ASSERT_EQ(values.size(), other.size()) << name;
    EXPECT_EQ(std::memcmp(values.data(), other.data(), values.size() * sizeof(float)), 0) << name;
  }
}

TEST(GradSync, TrainerOverlapOnAndOffGiveTheSameBits) {
  TrainConfig off = testing::tiny_config({.num_ranks = 4, .steps = 3});
  off.grad_overlap = false;
  TrainConfig on = off;
  on.grad_overlap = true;
  on.grad_bucket_bytes = 1024;
  expect_same_bits(trained(off), trained(on));
}

TEST(GradSync, TrainerOverlapOnAndOffGiveTheSameBitsWithEpTwoEdpTwo) {
  TrainConfig off = testing::tiny_config({.num_ranks = 4, .steps = 3});
  off.ep = 2;
  off.grad_overlap = false;
  TrainConfig on = off;
  on.grad_overlap = true;
  on.grad_bucket_bytes = 4096;
  expect_same_bits(trained(off), trained(on));
}

TEST(GradSync, TrainerOverlapOnAndOffGiveTheSameBitsWithEplbReplicas) {
  TrainConfig off = testing::tiny_config({.num_ranks = 4, .steps = 4});
  off.balancing = {.eplb = true, .eplb_every = 2};  // a re-placement re-plans the buckets
  off.grad_overlap = false;
  TrainConfig on = off;
  on.grad_overlap = true;
  expect_same_bits(trained(off), trained(on));
}

}  // namespace
}  // namespace epx
