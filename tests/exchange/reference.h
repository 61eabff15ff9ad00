// Reference implementation of the exchange contract, for the tests.
//
// Plain, obviously-correct code that sees every rank's inputs at once and
// computes what each rank must end up with: the layout, the received rows and
// their metadata, the combined outputs in the documented summation orders,
// the expanded per-expert layout, the backward passes and the bytes that must
// cross between nodes. Nothing here is fast or clever on purpose; the
// implementation under test is compared against it bit for bit.
//
//   ExchangeSpec spec{topology, placement, DType::kBF16, /*hidden=*/64, /*expert_alignment=*/4};
//   std::vector<RankInputs> inputs = ...;                       // one per rank
//   std::vector<RefRecv> recv = reference_dispatch(spec, inputs);
//   std::vector<Matrix> recv_x = gather_rows(xs_of(inputs), recv);
//   std::vector<Matrix> out = reference_combine(spec, inputs, recv, y, {}, DType::kF32, CombineOrder::kFlat);
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "epx/comm/topology.h"
#include "epx/core/dtype.h"
#include "epx/core/tensor.h"
#include "epx/exchange/buffer.h"
#include "epx/exchange/layout.h"
#include "epx/exchange/placement.h"

namespace epx::exchange_test {

// A dense row-major host matrix that owns its bytes; compared bit for bit.
// get/set read and write f32 or bf16 elements as float.
class Matrix {
 public:
  Matrix() = default;
  Matrix(DType dtype, int64_t rows, int64_t cols);  // zero-filled
  // [rows, cols] of `value`: an output buffer that must be fully overwritten.
  static Matrix filled(DType dtype, int64_t rows, int64_t cols, float value);
  // A copy of a 2-D view (any row stride), or of a 1-D view as [n, 1].
  static Matrix copy_of(const TensorView& view);

  [[nodiscard]] DType dtype() const { return dtype_; }
  [[nodiscard]] int64_t rows() const { return rows_; }
  [[nodiscard]] int64_t cols() const { return cols_; }
  [[nodiscard]] std::size_t row_bytes() const { return static_cast<std::size_t>(cols_) * dtype_size(dtype_); }
  [[nodiscard]] const std::byte* row(int64_t r) const { return data_.data() + r * row_bytes(); }
  [[nodiscard]] std::byte* row(int64_t r) { return data_.data() + r * row_bytes(); }
  [[nodiscard]] float get(int64_t r, int64_t c) const { return load_as_f32(row(r), dtype_, c); }
  void set(int64_t r, int64_t c, float value) { store_from_f32(row(r), dtype_, c, value); }
  [[nodiscard]] TensorView view() const;
  [[nodiscard]] const std::vector<std::byte>& bytes() const { return data_; }
  [[nodiscard]] bool same_bits(const Matrix& other) const;
  [[nodiscard]] bool same_row_bits(int64_t r, const Matrix& other, int64_t other_r) const;
  [[nodiscard]] bool all_zero() const;

 private:
  DType dtype_ = DType::kF32;
  int64_t rows_ = 0;
  int64_t cols_ = 0;
  std::vector<std::byte> data_;
};

// The elements of a 1-D or 2-D i32 / f32 view, in row-major order.
std::vector<int32_t> copy_i32(const TensorView& view);
std::vector<float> copy_f32(const TensorView& view);

// What one rank passes to dispatch.
struct RankInputs {
  Matrix x;                         // [T, H] of the payload dtype
  int topk = 0;
  std::vector<int32_t> topk_idx;    // [T, K] global expert ids, -1 = none
  bool with_weights = false;        // dispatched with topk_weights (a T = 0 rank passes [0, K])
  std::vector<float> topk_weights;  // [T, K] when with_weights

  [[nodiscard]] int num_tokens() const { return static_cast<int>(x.rows()); }
  [[nodiscard]] bool has_weights() const { return with_weights; }
  [[nodiscard]] int32_t expert(int t, int k) const { return topk_idx[static_cast<std::size_t>(t) * topk + k]; }
  [[nodiscard]] TensorView idx_view() const;
  [[nodiscard]] TensorView weights_view() const;  // undefined without weights
  [[nodiscard]] DispatchInputs dispatch_inputs() const;
};

// Everything about the world the reference needs to know.
struct ExchangeSpec {
  Topology topology;
  ExpertPlacement placement;
  DType dtype = DType::kF32;  // dispatch payload
  int hidden = 0;
  int expert_alignment = 1;

  [[nodiscard]] int num_ranks() const { return topology.num_ranks(); }
};

// What one rank receives in a dispatch (the payload rows are gather_rows()).
struct RefRecv {
  int topk = 0;
  std::vector<int32_t> src_rank;                    // [n]
  std::vector<int32_t> src_idx;                     // [n]
  std::vector<int32_t> topk_idx;                    // [n, K] local ids, -1 where the expert is elsewhere
  std::vector<float> topk_weights;                  // [n, K], 0 there; empty without input weights
  std::vector<int32_t> num_recv_tokens_per_expert;  // [E_local], rounded up to the alignment

  [[nodiscard]] int64_t num_recv() const { return static_cast<int64_t>(src_rank.size()); }
};

// Which order combine must sum in.
enum class CombineOrder {
  kFlat,          // over the holding ranks in ascending order
  kHierarchical,  // per node over its ranks, then over nodes, both ascending
};
CombineOrder expected_combine_order(const Topology& topology, DispatchAlgorithm algorithm);
const char* combine_order_name(CombineOrder order);

// The layout each rank must compute from its own topk_idx.
DispatchLayout reference_layout(const ExchangeSpec& spec, const RankInputs& inputs);

// What each rank receives: rows ordered by (source rank, source token).
std::vector<RefRecv> reference_dispatch(const ExchangeSpec& spec, const std::vector<RankInputs>& inputs);

// recv[r] row i = rows[src_rank[i]] row src_idx[i], bit for bit (dispatch,
// cached dispatch, combine backward).
std::vector<Matrix> gather_rows(const std::vector<Matrix>& rows, const std::vector<RefRecv>& recv);
std::vector<Matrix> xs_of(const std::vector<RankInputs>& inputs);

// out[s][t] = the sum of y[r][row of (s, t) on r] over the ranks r holding t,
// in fp32 in `order`, then + bias[s][t] when `bias` is not empty; stored as
// `out_dtype`. Tokens that went nowhere get 0 (+ bias).
std::vector<Matrix> reference_combine(const ExchangeSpec& spec, const std::vector<RankInputs>& inputs,
                                      const std::vector<RefRecv>& recv, const std::vector<Matrix>& y,
                                      const std::vector<Matrix>& bias, DType out_dtype, CombineOrder order);

// The expanded per-expert layout of one rank.
struct RefExpanded {
  std::vector<int64_t> expert_offsets;         // [E_local + 1]
  std::vector<int32_t> num_tokens_per_expert;  // [E_local], before padding
  std::vector<int64_t> row_of;                 // [n, K]
  std::vector<int64_t> recv_row;               // [num_rows], -1 = padding

  [[nodiscard]] int64_t num_rows() const { return expert_offsets.back(); }
};
RefExpanded reference_expanded(const RefRecv& recv, int num_local_experts, int expert_alignment);
// The received rows copied into the expanded layout, padding rows zero.
Matrix reference_expand(const Matrix& recv_x, const RefExpanded& expanded);
// One rank's fp32 partial rows [n, H]: partial[i] = sum over k in order of
// weights[i][k] * y_expanded[row_of[i][k]], from 0.0f.
Matrix reference_expert_partial(const Matrix& y_expanded, const RefExpanded& expanded,
                                const std::vector<float>& weights, int topk);

// The dispatch backward of the weights: grad[s][t][k] = grad_recv[r][row of
// (s, t) on r][k] where r holds expert topk_idx[t][k]; 0 for -1.
std::vector<std::vector<float>> reference_weight_grads(const ExchangeSpec& spec,
                                                       const std::vector<RankInputs>& inputs,
                                                       const std::vector<RefRecv>& recv,
                                                       const std::vector<std::vector<float>>& grad_recv_weights);

// Pairs that must cross between nodes: (token, destination node) for the
// two-hop path, (token, destination rank) for the flat one; destinations on
// the token's own node do not count.
struct RefTraffic {
  int64_t remote_node_pairs = 0;
  int64_t remote_rank_pairs = 0;
};
RefTraffic reference_traffic(const ExchangeSpec& spec, const std::vector<RankInputs>& inputs);
// Routing metadata sent with each row across nodes: source index, top-k ids, weights.
int64_t dispatch_meta_bytes(int topk, bool with_weights);

}  // namespace epx::exchange_test
