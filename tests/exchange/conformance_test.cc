// The exchange conformance table (conformance_table.h) on Buffer: every
// operation, on every rank, against the reference (exchange/reference.h), in
// every form (blocking, asynchronous, split).
//
// Everything is compared bit for bit: rows and metadata exactly, combines in
// the order the contract fixes (flat: ranks ascending; two-hop: ranks of a
// node ascending, then nodes ascending). Each gtest case is one (shape,
// algorithm, dtype) and runs its sub-cases one after the other, naming each
// in a SCOPED_TRACE.
#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "epx/comm/topology.h"
#include "epx/exchange/buffer.h"
#include "exchange/conformance_table.h"
#include "exchange/harness.h"
#include "exchange/reference.h"
#include "exchange/world.h"

namespace epx::exchange_test {
namespace {

// What one rank saw.
struct RankResult {
  bool hierarchical = false;
  int num_local_experts = -1;
  DispatchLayout layout;
  // dispatch
  Matrix recv_x;
  std::vector<int32_t> recv_idx, recv_src_rank, recv_src_idx, counts;
  std::vector<float> recv_w;
  bool recv_w_defined = false;
  ExchangeStats stats;
  int64_t handle_num_recv = -1;
  int handle_num_tokens = -1;
  int handle_topk = -1;
  TransportCounters dispatch_counters;
  // combine A: y f32 -> out of the payload dtype (+ bias of that dtype);
  // combine B: y bf16 -> out f32 (+ f32 bias); C: through combine_input().
  Matrix out_a, out_b, out_c;
  TransportCounters combine_a_counters, combine_b_counters, combine_e_counters;
  DType combine_input_dtype = DType::kF32;
  int64_t combine_input_rows = -1, combine_input_cols = -1;
  // expanded
  ExpandedLayout expanded;
  Matrix expanded_x;
  Matrix out_e;
  // cached dispatch with the same x, with another x
  Matrix cached_same, cached_x2;
  // backward
  Matrix grad_x;
  std::vector<float> grad_w;
  Matrix grad_y;
  // the same dispatch + combine A again
  Matrix recv_x_again, out_a_again;
  std::vector<int32_t> recv_idx_again, recv_src_rank_again, counts_again;
};

Status with_context(const char* what, Status status) {
  if (status.is_ok()) return status;
  return Status(status.code(), std::string(what) + ": " + status.message());
}

// Fills `y` (expanded rows) with expert output, padding rows with garbage.
Matrix expanded_expert_output(const Matrix& expanded_x, const std::vector<int64_t>& recv_row, int rank, DType dtype) {
  Matrix y = expert_output(expanded_x, rank, dtype);
  for (int64_t j = 0; j < y.rows() && j < static_cast<int64_t>(recv_row.size()); ++j)
    if (recv_row[j] < 0)
      for (int64_t col = 0; col < y.cols(); ++col) y.set(j, col, kPaddingGarbage);
  return y;
}

// Runs one operation in the case's form. In the asynchronous forms one rank
// (it changes with the seed) pauses between issuing and waiting, as a rank
// computing meanwhile would: the others must finish regardless.
class Caller {
 public:
  Caller(const Case& c, Buffer& buffer, int rank)
      : form_(c.form), buffer_(buffer), pauses_(static_cast<int>(c.seed % c.shape.num_ranks) == rank) {}

  Status run(const std::function<Status()>& blocking, const std::function<PendingOp()>& async) {
    if (form_ == Form::kBlocking) return blocking();
    const PendingOp op = async();
    pause();
    return op.wait();
  }
  Status dispatch(const DispatchInputs& in, DispatchResult* out, const DispatchLayout* layout) {
    if (form_ != Form::kSplit)
      return run([&] { return buffer_.dispatch(in, out, layout); }, [&] { return buffer_.dispatch_async(in, out, layout); });
    EPX_RETURN_IF_ERROR(buffer_.dispatch_send(in, layout));
    pause();
    return buffer_.dispatch_recv(out, Deadline::after(std::chrono::seconds(60)));
  }
  Status combine(const TensorView& y, const Handle& handle, const TensorView& out, const CombineOptions& options) {
    if (form_ != Form::kSplit)
      return run([&] { return buffer_.combine(y, handle, out, options); },
                 [&] { return buffer_.combine_async(y, handle, out, options); });
    EPX_RETURN_IF_ERROR(buffer_.combine_send(y, handle, out, options));
    pause();
    return buffer_.combine_recv(Deadline::after(std::chrono::seconds(60)));
  }

 private:
  void pause() const {
    if (pauses_) std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  Form form_;
  Buffer& buffer_;
  bool pauses_;
};

Status run_rank(Transport& transport, const Case& c, const RankInputs& in, RankResult* res) {
  const int r = transport.rank();
  const int T = in.num_tokens();
  const int H = c.hidden;
  const int K = c.topk;
  EPX_ASSIGN_OR_RETURN(auto buffer, Buffer::create(transport, make_config(c)));
  Caller call(c, *buffer, r);
  res->hierarchical = buffer->hierarchical();
  res->num_local_experts = buffer->num_local_experts();
  EPX_ASSIGN_OR_RETURN(res->layout, buffer->get_layout(in.idx_view()));

  TransportCounters before = transport.counters();
  DispatchResult d;
  EPX_RETURN_IF_ERROR(
      with_context("dispatch", call.dispatch(in.dispatch_inputs(), &d, c.pass_layout ? &res->layout : nullptr)));
  res->dispatch_counters = counters_delta(before, transport.counters());
  res->recv_x = Matrix::copy_of(d.recv_x);
  res->recv_idx = copy_i32(d.recv_topk_idx);
  res->recv_w_defined = d.recv_topk_weights.defined();
  res->recv_w = copy_f32(d.recv_topk_weights);
  res->recv_src_rank = copy_i32(d.recv_src_rank);
  res->recv_src_idx = copy_i32(d.recv_src_idx);
  res->counts = d.num_recv_tokens_per_expert;
  res->stats = d.stats;
  const Handle handle = d.handle;
  res->handle_num_recv = handle.num_recv_tokens();
  res->handle_num_tokens = handle.num_tokens();
  res->handle_topk = handle.topk();
  const int64_t n = res->recv_x.rows();

  // combine A
  const Matrix y_a = expert_output(res->recv_x, r, DType::kF32);
  const Matrix bias_a = c.with_bias ? make_random_matrix(sub_seed(c, kBiasA, r), T, H, c.shape.dtype) : Matrix();
  CombineOptions options_a;
  if (c.with_bias) options_a.bias = bias_a.view();
  res->out_a = Matrix::filled(c.shape.dtype, T, H, kUnwritten);
  before = transport.counters();
  EPX_RETURN_IF_ERROR(with_context("combine A", call.combine(y_a.view(), handle, res->out_a.view(), options_a)));
  res->combine_a_counters = counters_delta(before, transport.counters());

  // combine B
  const Matrix y_b = expert_output(res->recv_x, r, DType::kBF16);
  const Matrix bias_b = c.with_bias ? make_random_matrix(sub_seed(c, kBiasB, r), T, H, DType::kF32) : Matrix();
  CombineOptions options_b;
  if (c.with_bias) options_b.bias = bias_b.view();
  res->out_b = Matrix::filled(DType::kF32, T, H, kUnwritten);
  before = transport.counters();
  EPX_RETURN_IF_ERROR(with_context("combine B", call.combine(y_b.view(), handle, res->out_b.view(), options_b)));
  res->combine_b_counters = counters_delta(before, transport.counters());

  // combine C: the experts write straight into the combine region.
  auto input = buffer->combine_input(handle, c.combine_input_dtype);
  if (!input.is_ok()) return with_context("combine_input", input.status());
  const TensorView y_c = *input;
  res->combine_input_dtype = y_c.dtype();
  res->combine_input_rows = y_c.ndim() == 2 ? y_c.size(0) : -1;
  res->combine_input_cols = y_c.ndim() == 2 ? y_c.size(1) : -1;
  if (res->combine_input_dtype != c.combine_input_dtype || res->combine_input_rows != n || res->combine_input_cols != H)
    return internal_error("combine_input returned {}", y_c.describe());
  const bool c_is_a = c.combine_input_dtype == DType::kF32;
  for (int64_t i = 0; i < n; ++i)
    for (int col = 0; col < H; ++col)
      store_from_f32(y_c.row(i), y_c.dtype(), col, expert_value(res->recv_x.get(i, col), r, col));
  res->out_c = Matrix::filled(c_is_a ? c.shape.dtype : DType::kF32, T, H, kUnwritten);
  EPX_RETURN_IF_ERROR(
      with_context("combine C", call.combine(y_c, handle, res->out_c.view(), c_is_a ? options_a : options_b)));

  // expanded
  res->expanded = buffer->expanded_layout(handle);
  res->expanded_x = Matrix::filled(c.shape.dtype, res->expanded.num_rows(), H, kUnwritten);
  EPX_RETURN_IF_ERROR(with_context("expand", buffer->expand(res->recv_x.view(), handle, res->expanded_x.view())));
  const Matrix y_e = expanded_expert_output(res->expanded_x, res->expanded.recv_row, r, c.expanded_dtype);
  const std::vector<float> expand_weights =
      c.explicit_expand_weights ? make_random_floats(sub_seed(c, kExpandWeights, r), n * K) : std::vector<float>();
  const TensorView expand_weights_view = c.explicit_expand_weights
                                             ? TensorView::contiguous(expand_weights.data(), DType::kF32, {n, K})
                                             : TensorView();
  res->out_e = Matrix::filled(DType::kF32, T, H, kUnwritten);
  before = transport.counters();
  EPX_RETURN_IF_ERROR(with_context(
      "combine_expanded",
      call.run([&] { return buffer->combine_expanded(y_e.view(), handle, res->out_e.view(), expand_weights_view); },
               [&] { return buffer->combine_expanded_async(y_e.view(), handle, res->out_e.view(), expand_weights_view); })));
  res->combine_e_counters = counters_delta(before, transport.counters());

  // cached dispatch
  TensorView cached;
  EPX_RETURN_IF_ERROR(with_context("dispatch_cached(x)",
                                   call.run([&] { return buffer->dispatch_cached(in.x.view(), handle, &cached); },
                                            [&] { return buffer->dispatch_cached_async(in.x.view(), handle, &cached); })));
  res->cached_same = Matrix::copy_of(cached);
  const Matrix x2 = make_payload(7, r, T, H, c.shape.dtype);
  EPX_RETURN_IF_ERROR(with_context("dispatch_cached(x2)",
                                   call.run([&] { return buffer->dispatch_cached(x2.view(), handle, &cached); },
                                            [&] { return buffer->dispatch_cached_async(x2.view(), handle, &cached); })));
  res->cached_x2 = Matrix::copy_of(cached);

  // dispatch backward, with the weights' gradient
  const Matrix grad_recv_x = expert_output(res->recv_x, r + 5, DType::kF32);
  const std::vector<float> grad_recv_w = make_random_floats(sub_seed(c, kGradRecvWeights, r), n * K);
  res->grad_w.assign(static_cast<std::size_t>(T) * K, -7.0f);
  res->grad_x = Matrix::filled(DType::kF32, T, H, kUnwritten);
  CombineOptions grad_options;
  grad_options.grad_recv_topk_weights = TensorView::contiguous(grad_recv_w.data(), DType::kF32, {n, K});
  grad_options.grad_topk_weights = TensorView::contiguous(res->grad_w.data(), DType::kF32, {T, K});
  EPX_RETURN_IF_ERROR(with_context(
      "dispatch_backward",
      call.run([&] { return buffer->dispatch_backward(grad_recv_x.view(), handle, res->grad_x.view(), grad_options); },
               [&] {
                 return buffer->dispatch_backward_async(grad_recv_x.view(), handle, res->grad_x.view(), grad_options);
               })));

  // combine backward
  const Matrix grad_out = make_payload(11, r, T, H, c.shape.dtype);
  TensorView grad_y;
  EPX_RETURN_IF_ERROR(
      with_context("combine_backward", call.run([&] { return buffer->combine_backward(grad_out.view(), handle, &grad_y); },
                                                [&] { return buffer->combine_backward_async(grad_out.view(), handle, &grad_y); })));
  res->grad_y = Matrix::copy_of(grad_y);

  // the same dispatch and combine again, on the same Buffer
  DispatchResult again;
  EPX_RETURN_IF_ERROR(with_context("second dispatch", call.dispatch(in.dispatch_inputs(), &again, nullptr)));
  res->recv_x_again = Matrix::copy_of(again.recv_x);
  res->recv_idx_again = copy_i32(again.recv_topk_idx);
  res->recv_src_rank_again = copy_i32(again.recv_src_rank);
  res->counts_again = again.num_recv_tokens_per_expert;
  const Matrix y_again = expert_output(res->recv_x_again, r, DType::kF32);
  res->out_a_again = Matrix::filled(c.shape.dtype, T, H, kUnwritten);
  EPX_RETURN_IF_ERROR(
      with_context("second combine", call.combine(y_again.view(), again.handle, res->out_a_again.view(), options_a)));
  return Status::ok();
}

std::vector<Matrix> per_rank(int num_ranks, const std::function<Matrix(int)>& make) {
  std::vector<Matrix> out;
  for (int r = 0; r < num_ranks; ++r) out.push_back(make(r));
  return out;
}

// One sub-case's exchange and inputs, and what its ranks returned.
struct CaseRun {
  std::optional<ExchangeSpec> spec;
  std::vector<RankInputs> inputs;
  std::vector<RankResult> results;
  std::vector<Status> statuses;
};

// The spec and inputs of `c`; empty spec (and a failure) when the case is malformed.
CaseRun prepare_case(const Case& c) {
  CaseRun run;
  const int R = c.shape.num_ranks;
  auto topology = Topology::create(R, c.shape.num_nodes);
  EXPECT_TRUE(topology.is_ok()) << topology.status().to_string();
  auto placement = c.expert_map.empty() ? ExpertPlacement::contiguous(c.num_experts, R)
                                        : ExpertPlacement::from_map(c.expert_map, R);
  EXPECT_TRUE(placement.is_ok()) << placement.status().to_string();
  if (!topology.is_ok() || !placement.is_ok()) return run;
  run.spec.emplace(ExchangeSpec{*topology, *placement, c.shape.dtype, c.hidden, c.alignment});
  run.inputs = make_inputs(*run.spec, c.routing, c.topk, kConformanceMaxTokens, c.with_weights, c.seed);
  run.results.resize(static_cast<std::size_t>(R));
  return run;
}

void check_results(const Case& c, const CaseRun& run, const std::function<bool(int)>& holds);

// Runs one sub-case on a fresh world and checks every rank against the reference.
void check_case(const Case& c) {
  SCOPED_TRACE(c.name());
  CaseRun run = prepare_case(c);
  ASSERT_TRUE(run.spec.has_value());
  TestWorld& world = test_world();
  run.statuses = world.run(run.spec->topology, [&](Transport& t) {
    return run_rank(t, c, run.inputs[t.rank()], &run.results[t.rank()]);
  });
  check_results(c, run, [&](int r) { return world.holds(r); });
}

// Checks the ranks of `run` this process holds (holds(rank)) against the
// reference; every process calls it, in the same order (it sums over them).
void check_results(const Case& c, const CaseRun& run, const std::function<bool(int)>& holds) {
  const int R = c.shape.num_ranks;
  const ExchangeSpec& spec = *run.spec;
  const std::vector<RankInputs>& inputs = run.inputs;
  const std::vector<RankResult>& results = run.results;
  const std::vector<Status>& statuses = run.statuses;
  TestWorld& world = test_world();
  // Totals over every rank, summed over the processes (MPI) before any
  // check can return early: every process makes the same sum() calls.
  enum : int { kFailed, kDispatchBytes, kPayloadBytes, kMetaBytes, kCombineABytes, kCombineBBytes, kCombineEBytes,
               kNonzeroRecvX, kNonzeroA, kNonzeroB, kNonzeroE, kNonzeroGradX, kNumTotals };
  std::vector<int64_t> totals(kNumTotals, 0);
  for (int r = 0; r < R; ++r) {
    if (!holds(r)) continue;
    const RankResult& res = results[r];
    EXPECT_TRUE(statuses[r].is_ok()) << "rank " << r << ": " << statuses[r].to_string();
    if (!statuses[r].is_ok()) {
      ++totals[kFailed];
      continue;
    }
    totals[kDispatchBytes] += static_cast<int64_t>(res.dispatch_counters.inter_node_bytes);
    totals[kPayloadBytes] += res.stats.inter_node_payload_bytes;
    totals[kMetaBytes] += res.stats.inter_node_meta_bytes;
    totals[kCombineABytes] += static_cast<int64_t>(res.combine_a_counters.inter_node_bytes);
    totals[kCombineBBytes] += static_cast<int64_t>(res.combine_b_counters.inter_node_bytes);
    totals[kCombineEBytes] += static_cast<int64_t>(res.combine_e_counters.inter_node_bytes);
    totals[kNonzeroRecvX] += any_nonzero({res.recv_x});
    totals[kNonzeroA] += any_nonzero({res.out_a});
    totals[kNonzeroB] += any_nonzero({res.out_b});
    totals[kNonzeroE] += any_nonzero({res.out_e});
    totals[kNonzeroGradX] += any_nonzero({res.grad_x});
  }
  world.sum(totals);
  if (totals[kFailed] > 0) {
    if (!::testing::Test::HasFailure()) ADD_FAILURE() << totals[kFailed] << " rank(s) of another process failed";
    return;
  }

  const int H = c.hidden;
  const int K = c.topk;
  const CombineOrder order = expected_combine_order(spec.topology, c.shape.algorithm);
  const CombineOrder other = order == CombineOrder::kFlat ? CombineOrder::kHierarchical : CombineOrder::kFlat;
  const std::vector<RefRecv> recv = reference_dispatch(spec, inputs);
  const std::vector<Matrix> xs = xs_of(inputs);
  const std::vector<Matrix> recv_x = gather_rows(xs, recv);

  // Layout and dispatch.
  int64_t total_recv = 0;
  bool dispatch_ok = true;
  for (int r = 0; r < R; ++r) {
    total_recv += recv[r].num_recv();
    if (!holds(r)) continue;
    SCOPED_TRACE(fmt::format("rank {}", r));
    const RankResult& res = results[r];
    const RefRecv& want = recv[r];
    EXPECT_EQ(res.hierarchical, order == CombineOrder::kHierarchical);
    EXPECT_EQ(res.num_local_experts, spec.placement.num_local_experts(r));
    const DispatchLayout layout = reference_layout(spec, inputs[r]);
    EXPECT_EQ(res.layout.num_tokens, layout.num_tokens);
    EXPECT_EQ(res.layout.num_ranks, layout.num_ranks);
    EXPECT_TRUE(same_vector(res.layout.num_tokens_per_rank, layout.num_tokens_per_rank)) << "num_tokens_per_rank";
    EXPECT_TRUE(same_vector(res.layout.num_tokens_per_node, layout.num_tokens_per_node)) << "num_tokens_per_node";
    EXPECT_TRUE(same_vector(res.layout.num_tokens_per_expert, layout.num_tokens_per_expert)) << "num_tokens_per_expert";
    EXPECT_TRUE(same_vector(res.layout.is_token_in_rank, layout.is_token_in_rank, R)) << "is_token_in_rank";

    const bool rows_ok = same_vector(res.recv_src_rank, want.src_rank) && same_vector(res.recv_src_idx, want.src_idx);
    EXPECT_TRUE(same_vector(res.recv_src_rank, want.src_rank)) << "recv_src_rank";
    EXPECT_TRUE(same_vector(res.recv_src_idx, want.src_idx)) << "recv_src_idx";
    EXPECT_TRUE(same_vector(res.recv_idx, want.topk_idx, K)) << "recv_topk_idx";
    EXPECT_EQ(res.recv_w_defined, c.with_weights) << "recv_topk_weights defined";
    if (c.with_weights) {
      EXPECT_TRUE(same_vector(res.recv_w, want.topk_weights, K)) << "recv_topk_weights";
    }
    EXPECT_TRUE(same_vector(res.counts, want.num_recv_tokens_per_expert)) << "num_recv_tokens_per_expert";
    EXPECT_TRUE(same_matrix(res.recv_x, recv_x[r], &xs)) << "recv_x";
    EXPECT_EQ(res.stats.rows_received, want.num_recv()) << "stats.rows_received";
    int64_t pairs_sent = 0;
    for (int32_t n : layout.num_tokens_per_rank) pairs_sent += n;
    EXPECT_EQ(res.stats.rows_sent, pairs_sent) << "stats.rows_sent: (token, destination rank) pairs";
    EXPECT_EQ(res.handle_num_recv, want.num_recv()) << "handle.num_recv_tokens()";
    EXPECT_EQ(res.handle_num_tokens, inputs[r].num_tokens()) << "handle.num_tokens()";
    EXPECT_EQ(res.handle_topk, K) << "handle.topk()";
    dispatch_ok = dispatch_ok && rows_ok && res.recv_x.rows() == want.num_recv();
  }
  // Everything below depends on the rows being where the contract puts them.
  ASSERT_TRUE(dispatch_ok) << "dispatch delivered the wrong rows; later checks skipped";
  if (total_recv > 0) {
    EXPECT_GT(totals[kNonzeroRecvX], 0) << "every received row is zero";
  }

  // Bytes across nodes.
  const RefTraffic traffic = reference_traffic(spec, inputs);
  const int64_t pairs = order == CombineOrder::kHierarchical ? traffic.remote_node_pairs : traffic.remote_rank_pairs;
  const int64_t row_bytes = static_cast<int64_t>(H * dtype_size(c.shape.dtype));
  const int64_t dispatch_bytes = totals[kDispatchBytes], payload_bytes = totals[kPayloadBytes],
                meta_bytes = totals[kMetaBytes], combine_a_bytes = totals[kCombineABytes],
                combine_b_bytes = totals[kCombineBBytes], combine_e_bytes = totals[kCombineEBytes];
  EXPECT_EQ(dispatch_bytes, pairs * (row_bytes + dispatch_meta_bytes(K, c.with_weights)))
      << "dispatch inter_node_bytes; " << pairs << " pairs cross nodes";
  EXPECT_EQ(payload_bytes, pairs * row_bytes) << "sum of stats.inter_node_payload_bytes";
  EXPECT_EQ(meta_bytes, pairs * dispatch_meta_bytes(K, c.with_weights)) << "sum of stats.inter_node_meta_bytes";
  const int64_t combine_row_f32 = 4 * H;
  const int64_t combine_row_bf16 = order == CombineOrder::kHierarchical ? 4 * H : 2 * H;
  EXPECT_EQ(combine_a_bytes, pairs * combine_row_f32) << "combine (f32 y) inter_node_bytes";
  EXPECT_EQ(combine_b_bytes, pairs * combine_row_bf16) << "combine (bf16 y) inter_node_bytes";
  EXPECT_EQ(combine_e_bytes, pairs * combine_row_f32) << "combine_expanded inter_node_bytes";

  // Combines.
  const auto y_a = per_rank(R, [&](int r) { return expert_output(recv_x[r], r, DType::kF32); });
  const auto y_b = per_rank(R, [&](int r) { return expert_output(recv_x[r], r, DType::kBF16); });
  std::vector<Matrix> bias_a, bias_b;
  if (c.with_bias) {
    bias_a = per_rank(R, [&](int r) {
      return make_random_matrix(sub_seed(c, kBiasA, r), inputs[r].num_tokens(), H, c.shape.dtype);
    });
    bias_b = per_rank(R, [&](int r) {
      return make_random_matrix(sub_seed(c, kBiasB, r), inputs[r].num_tokens(), H, DType::kF32);
    });
  }
  const auto out_a = reference_combine(spec, inputs, recv, y_a, bias_a, c.shape.dtype, order);
  const auto out_a_other = reference_combine(spec, inputs, recv, y_a, bias_a, c.shape.dtype, other);
  const auto out_b = reference_combine(spec, inputs, recv, y_b, bias_b, DType::kF32, order);
  const auto out_b_other = reference_combine(spec, inputs, recv, y_b, bias_b, DType::kF32, other);
  const auto out_b_flat = reference_combine(spec, inputs, recv, y_b, bias_b, DType::kF32, CombineOrder::kFlat);

  // Expanded and weighted.
  std::vector<Matrix> partials;
  std::vector<Matrix> grad_recv_x;
  std::vector<std::vector<float>> grad_recv_w;
  for (int r = 0; r < R; ++r) {
    SCOPED_TRACE(fmt::format("rank {}", r));
    const RankResult& res = results[r];
    const bool held = holds(r);
    const int64_t n = recv[r].num_recv();
    const RefExpanded ex = reference_expanded(recv[r], spec.placement.num_local_experts(r), c.alignment);
    const Matrix expanded_x = reference_expand(recv_x[r], ex);
    if (held) {
      EXPECT_TRUE(same_vector(res.expanded.expert_offsets, ex.expert_offsets)) << "expanded expert_offsets";
      EXPECT_TRUE(same_vector(res.expanded.num_tokens_per_expert, ex.num_tokens_per_expert))
          << "expanded num_tokens_per_expert";
      EXPECT_TRUE(same_vector(res.expanded.row_of, ex.row_of, K)) << "expanded row_of";
      EXPECT_TRUE(same_vector(res.expanded.recv_row, ex.recv_row)) << "expanded recv_row";
      EXPECT_TRUE(same_matrix(res.expanded_x, expanded_x, &xs)) << "expand()";
    }
    const Matrix y_e = expanded_expert_output(expanded_x, ex.recv_row, r, c.expanded_dtype);
    const std::vector<float> weights = c.explicit_expand_weights
                                           ? make_random_floats(sub_seed(c, kExpandWeights, r), n * K)
                                           : recv[r].topk_weights;
    partials.push_back(reference_expert_partial(y_e, ex, weights, K));
    grad_recv_x.push_back(expert_output(recv_x[r], r + 5, DType::kF32));
    grad_recv_w.push_back(make_random_floats(sub_seed(c, kGradRecvWeights, r), n * K));
  }
  const auto out_e = reference_combine(spec, inputs, recv, partials, {}, DType::kF32, order);
  const auto out_e_other = reference_combine(spec, inputs, recv, partials, {}, DType::kF32, other);
  const auto grad_x = reference_combine(spec, inputs, recv, grad_recv_x, {}, DType::kF32, order);
  const auto grad_x_other = reference_combine(spec, inputs, recv, grad_recv_x, {}, DType::kF32, other);
  const auto grad_w = reference_weight_grads(spec, inputs, recv, grad_recv_w);
  const auto x2 = per_rank(R, [&](int r) { return make_payload(7, r, inputs[r].num_tokens(), H, c.shape.dtype); });
  const auto grad_out =
      per_rank(R, [&](int r) { return make_payload(11, r, inputs[r].num_tokens(), H, c.shape.dtype); });
  const auto cached_x2 = gather_rows(x2, recv);
  const auto grad_y = gather_rows(grad_out, recv);

  for (int r = 0; r < R; ++r) {
    if (!holds(r)) continue;
    SCOPED_TRACE(fmt::format("rank {}", r));
    const RankResult& res = results[r];
    const bool multi_node = spec.topology.num_nodes() > 1;
    EXPECT_TRUE(same_combine(res.out_a, out_a[r], multi_node ? &out_a_other[r] : nullptr))
        << "combine (f32 y, " << dtype_name(c.shape.dtype) << " out) in the " << combine_order_name(order) << " order";
    EXPECT_TRUE(same_combine(res.out_b, out_b[r], multi_node ? &out_b_other[r] : nullptr))
        << "combine (bf16 y, f32 out) in the " << combine_order_name(order) << " order";
    if (order == CombineOrder::kHierarchical) {
      EXPECT_TRUE(near_matrix(res.out_b, out_b_flat[r], 1e-5f)) << "two-hop combine vs the flat sum";
    }
    const Matrix& c_ref = c.combine_input_dtype == DType::kF32 ? res.out_a : res.out_b;
    EXPECT_TRUE(same_matrix(res.out_c, c_ref)) << "combine of combine_input(" << dtype_name(c.combine_input_dtype)
                                               << ") vs combine of a separate y";
    EXPECT_TRUE(same_combine(res.out_e, out_e[r], multi_node ? &out_e_other[r] : nullptr))
        << "combine_expanded (" << dtype_name(c.expanded_dtype) << " y) in the " << combine_order_name(order)
        << " order";
    EXPECT_TRUE(same_matrix(res.cached_same, res.recv_x, &xs)) << "dispatch_cached(x) vs dispatch(x)";
    EXPECT_TRUE(same_matrix(res.cached_x2, cached_x2[r], &x2)) << "dispatch_cached(x2)";
    EXPECT_TRUE(same_combine(res.grad_x, grad_x[r], multi_node ? &grad_x_other[r] : nullptr))
        << "dispatch_backward grad_x";
    EXPECT_TRUE(same_vector(res.grad_w, grad_w[r], K)) << "dispatch_backward grad_topk_weights";
    EXPECT_TRUE(same_matrix(res.grad_y, grad_y[r], &grad_out)) << "combine_backward grad_y";
    EXPECT_TRUE(same_matrix(res.recv_x_again, res.recv_x)) << "second dispatch recv_x";
    EXPECT_TRUE(same_vector(res.recv_idx_again, res.recv_idx, K)) << "second dispatch recv_topk_idx";
    EXPECT_TRUE(same_vector(res.recv_src_rank_again, res.recv_src_rank)) << "second dispatch recv_src_rank";
    EXPECT_TRUE(same_vector(res.counts_again, res.counts)) << "second dispatch counts";
    EXPECT_TRUE(same_matrix(res.out_a_again, res.out_a)) << "second combine: not the same bits";
  }
  if (total_recv > 0) {
    EXPECT_GT(totals[kNonzeroA], 0) << "every combine output is zero";
    EXPECT_GT(totals[kNonzeroB], 0) << "every combine output is zero";
    EXPECT_GT(totals[kNonzeroE], 0) << "every combine_expanded output is zero";
    EXPECT_GT(totals[kNonzeroGradX], 0) << "every grad_x is zero";
  }
}

class Conformance : public ::testing::TestWithParam<Shape> {};

TEST_P(Conformance, MatchesTheReference) {
  EPX_SKIP_UNLESS_RUNNABLE(GetParam().num_ranks, GetParam().num_nodes);
  for (const Case& c : make_cases(GetParam())) {
    check_case(c);
    // The trace above names the first failing sub-case; the rest would repeat it.
    if (test_world().any(HasFailure())) return;
  }
}

INSTANTIATE_TEST_SUITE_P(Exchange, Conformance, ::testing::ValuesIn(all_shapes()), shape_name);

// The exchange on groups of a world (Transport::split), several at once: 8
// ranks on 2 nodes split into group 0 = ranks {0 1 4 5} (2 nodes x 2: it
// spans the nodes), group 1 = {2 3} and group 2 = {6 7} (each inside a
// node). Every group runs the same sub-cases of its shape at the same time
// as the others, each checked against the reference of its own shape. A few
// sub-cases only (CI time): the full table runs on worlds above.
struct GroupOfTheWorld {
  int color;
  std::vector<int> members;  // world ranks, in group-rank order
  int num_nodes;
};
const GroupOfTheWorld kGroups[] = {{0, {0, 1, 4, 5}, 2}, {1, {2, 3}, 1}, {2, {6, 7}, 1}};
int group_color(const Transport& world) {
  return world.local_rank() < 2 ? 0 : world.node() == 0 ? 1 : 2;
}

// Sub-case `i` of group g's shape: spread over the table, f32 and bf16 in turn.
Case group_case(const GroupOfTheWorld& g, int i) {
  const DType dtype = i % 2 == 0 ? DType::kF32 : DType::kBF16;
  const std::vector<Case> cases =
      make_cases({static_cast<int>(g.members.size()), g.num_nodes, DispatchAlgorithm::kAuto, dtype});
  return cases[(static_cast<std::size_t>(i) * 11 + 3) % cases.size()];
}

// Every group's sub-case `i` at once, then each checked.
void check_group_cases(int i) {
  std::vector<Case> cases;
  std::vector<CaseRun> runs;
  for (const GroupOfTheWorld& g : kGroups) {
    cases.push_back(group_case(g, i));
    runs.push_back(prepare_case(cases.back()));
    ASSERT_TRUE(runs.back().spec.has_value());
    runs.back().statuses.resize(g.members.size());
  }
  TestWorld& world = test_world();
  const std::vector<Status> statuses = world.run(*Topology::create(8, 2), [&](Transport& t) -> Status {
    const int color = group_color(t);
    EPX_ASSIGN_OR_RETURN(auto group, t.split(color, t.rank(), Deadline::after(std::chrono::seconds(30))));
    CaseRun& run = runs[color];
    const int r = group->rank();
    run.statuses[r] = run_rank(*group, cases[color], run.inputs[r], &run.results[r]);
    return run.statuses[r];
  });
  for (std::size_t g = 0; g < runs.size(); ++g) {
    SCOPED_TRACE(fmt::format("group {} (world ranks {}): {}", g, fmt::join(kGroups[g].members, " "), cases[g].name()));
    const std::vector<int>& members = kGroups[g].members;
    for (std::size_t r = 0; r < members.size(); ++r) {
      // A split that failed left the group's status unset: take the world's.
      if (world.holds(members[r]) && runs[g].statuses[r].is_ok()) runs[g].statuses[r] = statuses[members[r]];
    }
    check_results(cases[g], runs[g], [&](int r) { return world.holds(members[r]); });
  }
}

TEST(ConformanceOnGroups, ThreeGroupsOfAnEightRankWorldAtOnce) {
  EPX_SKIP_UNLESS_RUNNABLE(8, 2);
  for (int i = 0; i < 4; ++i) {
    check_group_cases(i);
    if (test_world().any(HasFailure())) return;
  }
}

// Experts placed unevenly by ExpertPlacement::from_map (10 experts on 4 ranks:
// 5, 0, 3 and 2, interleaved), so a rank may hold none and E need not divide
// by R; flat and two-hop, with every operation checked as above.
TEST(ConformanceUnevenPlacement, MatchesTheReference) {
  EPX_SKIP_UNLESS_RUNNABLE(4, 2);
  const std::vector<int32_t> map = {0, 0, 2, 0, 3, 2, 0, 2, 0, 3};
  // The reference trusts ExpertPlacement for rank_of / local_id; check it by hand first.
  const ExpertPlacement placement = *ExpertPlacement::from_map(map, 4);
  const std::vector<int32_t> local_id = {0, 1, 0, 2, 0, 1, 3, 2, 4, 1};
  const int num_local[4] = {5, 0, 3, 2};
  for (int e = 0; e < 10; ++e) {
    EXPECT_EQ(placement.rank_of(e), map[e]) << "expert " << e;
    EXPECT_EQ(placement.local_id(e), local_id[e]) << "expert " << e;
  }
  for (int r = 0; r < 4; ++r) EXPECT_EQ(placement.num_local_experts(r), num_local[r]) << "rank " << r;
  const ExpertPlacement blocks = *ExpertPlacement::contiguous(48, 3);
  for (int e = 0; e < 48; ++e) {
    EXPECT_EQ(blocks.rank_of(e), e / 16) << "expert " << e;
    EXPECT_EQ(blocks.local_id(e), e % 16) << "expert " << e;
  }
  ASSERT_FALSE(HasFailure());
  uint32_t index = 0;
  for (DispatchAlgorithm algorithm : {DispatchAlgorithm::kFlat, DispatchAlgorithm::kHierarchical}) {
    for (DType dtype : {DType::kF32, DType::kBF16}) {
      for (Routing routing : {Routing::kUniform, Routing::kSkewed, Routing::kHoles, Routing::kOneRankPerToken,
                              Routing::kAllToLast}) {
        Case c;
        c.shape = {4, 2, algorithm, dtype};
        c.num_experts = 10;
        c.topk = 3;
        c.routing = routing;
        c.seed = 500u + index;
        c.hidden = index % 2 ? 36 : 8;
        c.alignment = index % 3 == 0 ? 4 : 1;
        c.with_weights = index % 4 != 3;
        c.pass_layout = index % 2 == 0;
        c.with_bias = index % 3 == 1;
        c.combine_input_dtype = index % 2 ? DType::kBF16 : DType::kF32;
        c.expanded_dtype = index % 4 < 2 ? DType::kBF16 : DType::kF32;
        c.explicit_expand_weights = !c.with_weights || index % 5 == 0;
        c.expert_map = map;
        check_case(c);
        if (test_world().any(HasFailure())) return;
        ++index;
      }
    }
  }
}

// Rows wide enough (16 KB in f32, 8 KB in bf16) that a rank sends the rows
// for another node as runs of consecutive tokens straight from x, not staged
// (a run pays for its message above 64 KB on average): flat and two-hop,
// with long runs (uniform) and a mix of sent and staged targets (skewed).
TEST(ConformanceWideRows, MatchesTheReference) {
  EPX_SKIP_UNLESS_RUNNABLE(8, 2);
  uint32_t index = 0;
  for (const Shape& shape : {Shape{4, 2, DispatchAlgorithm::kFlat, DType::kF32},
                             Shape{8, 2, DispatchAlgorithm::kHierarchical, DType::kBF16}}) {
    // A world of fixed shape (MPI: the processes it was started with) runs what it can.
    if (!test_world().cannot_run(*Topology::create(shape.num_ranks, shape.num_nodes)).empty()) continue;
    for (Routing routing : {Routing::kUniform, Routing::kSkewed}) {
      Case c;
      c.shape = shape;
      c.num_experts = 8 * shape.num_ranks;
      c.topk = 8;
      c.routing = routing;
      c.seed = 900u + index;
      c.hidden = 4096;
      c.with_weights = index % 2 == 0;
      c.pass_layout = index % 3 == 0;
      c.combine_input_dtype = index % 2 ? DType::kBF16 : DType::kF32;
      c.explicit_expand_weights = !c.with_weights;
      c.form = static_cast<Form>(index % 3);
      check_case(c);
      if (test_world().any(HasFailure())) return;
      ++index;
    }
  }
}

}  // namespace
}  // namespace epx::exchange_test
