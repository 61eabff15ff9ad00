#include "exchange/reference.h"

#include <cstring>
#include <stdexcept>

namespace epx::exchange_test {

Matrix::Matrix(DType dtype, int64_t rows, int64_t cols)
    : dtype_(dtype), rows_(rows), cols_(cols), data_(static_cast<std::size_t>(rows) * row_bytes()) {}

Matrix Matrix::copy_of(const TensorView& view) {
  if (!view.defined()) throw std::invalid_argument("Matrix::copy_of: undefined view");
  const int64_t rows = view.size(0);
  const int64_t cols = view.ndim() >= 2 ? view.size(1) : 1;
  if (view.ndim() > 2) throw std::invalid_argument("Matrix::copy_of: more than 2 dims: " + view.describe());
  if (view.ndim() == 2 && cols > 1 && view.stride(1) != 1)
    throw std::invalid_argument("Matrix::copy_of: column stride is not 1: " + view.describe());
  Matrix m(view.dtype(), rows, cols);
  for (int64_t r = 0; r < rows; ++r) std::memcpy(m.row(r), view.row(r), m.row_bytes());
  return m;
}

Matrix Matrix::filled(DType dtype, int64_t rows, int64_t cols, float value) {
  Matrix m(dtype, rows, cols);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) m.set(r, c, value);
  return m;
}

TensorView Matrix::view() const { return TensorView::contiguous(data_.data(), dtype_, {rows_, cols_}); }

bool Matrix::same_bits(const Matrix& other) const {
  return dtype_ == other.dtype_ && rows_ == other.rows_ && cols_ == other.cols_ && data_ == other.data_;
}

bool Matrix::same_row_bits(int64_t r, const Matrix& other, int64_t other_r) const {
  return dtype_ == other.dtype_ && cols_ == other.cols_ && std::memcmp(row(r), other.row(other_r), row_bytes()) == 0;
}

bool Matrix::all_zero() const {
  for (std::byte b : data_)
    if (b != std::byte{0}) return false;
  return true;
}

namespace {

template <typename T>
std::vector<T> copy_elements(const TensorView& view) {
  if (!view.defined()) return {};
  const int64_t rows = view.size(0);
  const int64_t cols = view.ndim() >= 2 ? view.size(1) : 1;
  std::vector<T> out(static_cast<std::size_t>(rows * cols));
  for (int64_t r = 0; r < rows; ++r) {
    const T* src = static_cast<const T*>(view.data()) + r * view.stride(0);
    for (int64_t c = 0; c < cols; ++c) out[r * cols + c] = src[c * (view.ndim() >= 2 ? view.stride(1) : 1)];
  }
  return out;
}

int64_t round_up(int64_t n, int64_t alignment) { return (n + alignment - 1) / alignment * alignment; }

// row_index[r][s][t]: the row of (source s, token t) in rank r's receive order, or -1.
std::vector<std::vector<std::vector<int64_t>>> row_index(const std::vector<RankInputs>& inputs,
                                                         const std::vector<RefRecv>& recv) {
  const std::size_t num_ranks = inputs.size();
  std::vector<std::vector<std::vector<int64_t>>> index(num_ranks);
  for (std::size_t r = 0; r < num_ranks; ++r) {
    index[r].resize(num_ranks);
    for (std::size_t s = 0; s < num_ranks; ++s) index[r][s].assign(inputs[s].num_tokens(), -1);
    for (int64_t i = 0; i < recv[r].num_recv(); ++i) index[r][recv[r].src_rank[i]][recv[r].src_idx[i]] = i;
  }
  return index;
}

}  // namespace

std::vector<int32_t> copy_i32(const TensorView& view) { return copy_elements<int32_t>(view); }
std::vector<float> copy_f32(const TensorView& view) { return copy_elements<float>(view); }

TensorView RankInputs::idx_view() const {
  return TensorView::contiguous(topk_idx.data(), DType::kI32, {num_tokens(), topk});
}

TensorView RankInputs::weights_view() const {
  if (!has_weights()) return {};
  return TensorView::contiguous(topk_weights.data(), DType::kF32, {num_tokens(), topk});
}

DispatchInputs RankInputs::dispatch_inputs() const {
  return DispatchInputs{.x = x.view(), .topk_idx = idx_view(), .topk_weights = weights_view()};
}

CombineOrder expected_combine_order(const Topology& topology, DispatchAlgorithm algorithm) {
  if (topology.num_nodes() > 1 && algorithm != DispatchAlgorithm::kFlat) return CombineOrder::kHierarchical;
  return CombineOrder::kFlat;
}

const char* combine_order_name(CombineOrder order) {
  return order == CombineOrder::kFlat ? "flat" : "hierarchical";
}

DispatchLayout reference_layout(const ExchangeSpec& spec, const RankInputs& inputs) {
  const int num_ranks = spec.num_ranks();
  DispatchLayout layout;
  layout.num_tokens = inputs.num_tokens();
  layout.num_ranks = num_ranks;
  layout.num_tokens_per_rank.assign(num_ranks, 0);
  layout.num_tokens_per_node.assign(spec.topology.num_nodes(), 0);
  layout.num_tokens_per_expert.assign(spec.placement.num_experts(), 0);
  layout.is_token_in_rank.assign(static_cast<std::size_t>(inputs.num_tokens()) * num_ranks, 0);
  for (int t = 0; t < inputs.num_tokens(); ++t) {
    for (int k = 0; k < inputs.topk; ++k) {
      const int e = inputs.expert(t, k);
      if (e >= 0) layout.num_tokens_per_expert[e] += 1;
    }
    for (int r = 0; r < num_ranks; ++r) {
      bool goes_there = false;
      for (int k = 0; k < inputs.topk; ++k) {
        const int e = inputs.expert(t, k);
        if (e >= 0 && spec.placement.rank_of(e) == r) goes_there = true;
      }
      if (goes_there) {
        layout.is_token_in_rank[static_cast<std::size_t>(t) * num_ranks + r] = 1;
        layout.num_tokens_per_rank[r] += 1;
      }
    }
    for (int n = 0; n < spec.topology.num_nodes(); ++n) {
      bool goes_there = false;
      for (int k = 0; k < inputs.topk; ++k) {
        const int e = inputs.expert(t, k);
        if (e >= 0 && spec.topology.node_of(spec.placement.rank_of(e)) == n) goes_there = true;
      }
      if (goes_there) layout.num_tokens_per_node[n] += 1;
    }
  }
  return layout;
}

std::vector<RefRecv> reference_dispatch(const ExchangeSpec& spec, const std::vector<RankInputs>& inputs) {
  const int num_ranks = spec.num_ranks();
  std::vector<RefRecv> recv(num_ranks);
  for (int r = 0; r < num_ranks; ++r) {
    RefRecv& out = recv[r];
    const int num_local = spec.placement.num_local_experts(r);
    out.num_recv_tokens_per_expert.assign(num_local, 0);
    for (int s = 0; s < num_ranks; ++s) {
      const RankInputs& in = inputs[s];
      out.topk = in.topk;
      for (int t = 0; t < in.num_tokens(); ++t) {
        bool goes_here = false;
        for (int k = 0; k < in.topk; ++k) {
          const int e = in.expert(t, k);
          if (e >= 0 && spec.placement.rank_of(e) == r) goes_here = true;
        }
        if (!goes_here) continue;
        out.src_rank.push_back(s);
        out.src_idx.push_back(t);
        for (int k = 0; k < in.topk; ++k) {
          const int e = in.expert(t, k);
          const bool local = e >= 0 && spec.placement.rank_of(e) == r;
          out.topk_idx.push_back(local ? spec.placement.local_id(e) : -1);
          if (in.has_weights()) out.topk_weights.push_back(local ? in.topk_weights[t * in.topk + k] : 0.0f);
          if (local) out.num_recv_tokens_per_expert[spec.placement.local_id(e)] += 1;
        }
      }
    }
    for (int32_t& n : out.num_recv_tokens_per_expert) n = static_cast<int32_t>(round_up(n, spec.expert_alignment));
  }
  return recv;
}

std::vector<Matrix> gather_rows(const std::vector<Matrix>& rows, const std::vector<RefRecv>& recv) {
  std::vector<Matrix> out;
  for (const RefRecv& r : recv) {
    Matrix m(rows.at(0).dtype(), r.num_recv(), rows.at(0).cols());
    for (int64_t i = 0; i < r.num_recv(); ++i)
      std::memcpy(m.row(i), rows[r.src_rank[i]].row(r.src_idx[i]), m.row_bytes());
    out.push_back(std::move(m));
  }
  return out;
}

std::vector<Matrix> xs_of(const std::vector<RankInputs>& inputs) {
  std::vector<Matrix> xs;
  for (const RankInputs& in : inputs) xs.push_back(in.x);
  return xs;
}

std::vector<Matrix> reference_combine(const ExchangeSpec& spec, const std::vector<RankInputs>& inputs,
                                      const std::vector<RefRecv>& recv, const std::vector<Matrix>& y,
                                      const std::vector<Matrix>& bias, DType out_dtype, CombineOrder order) {
  const int num_ranks = spec.num_ranks();
  const auto index = row_index(inputs, recv);
  std::vector<Matrix> out;
  for (int s = 0; s < num_ranks; ++s) {
    Matrix o(out_dtype, inputs[s].num_tokens(), spec.hidden);
    for (int t = 0; t < inputs[s].num_tokens(); ++t) {
      for (int c = 0; c < spec.hidden; ++c) {
        float acc = 0.0f;
        if (order == CombineOrder::kFlat) {
          for (int r = 0; r < num_ranks; ++r) {
            const int64_t row = index[r][s][t];
            if (row >= 0) acc += y[r].get(row, c);
          }
        } else {
          for (int n = 0; n < spec.topology.num_nodes(); ++n) {
            float partial = 0.0f;
            bool held = false;
            for (int l = 0; l < spec.topology.ranks_per_node(); ++l) {
              const int r = spec.topology.rank_of(n, l);
              const int64_t row = index[r][s][t];
              if (row < 0) continue;
              partial += y[r].get(row, c);
              held = true;
            }
            if (held) acc += partial;
          }
        }
        if (!bias.empty()) acc += bias[s].get(t, c);
        o.set(t, c, acc);
      }
    }
    out.push_back(std::move(o));
  }
  return out;
}

RefExpanded reference_expanded(const RefRecv& recv, int num_local_experts, int expert_alignment) {
  const int topk = recv.topk;
  RefExpanded ex;
  ex.row_of.assign(static_cast<std::size_t>(recv.num_recv()) * topk, -1);
  ex.num_tokens_per_expert.assign(num_local_experts, 0);
  ex.expert_offsets.push_back(0);
  for (int e = 0; e < num_local_experts; ++e) {
    for (int64_t i = 0; i < recv.num_recv(); ++i) {
      for (int k = 0; k < topk; ++k) {
        if (recv.topk_idx[i * topk + k] != e) continue;
        ex.row_of[i * topk + k] = static_cast<int64_t>(ex.recv_row.size());
        ex.recv_row.push_back(i);
        ex.num_tokens_per_expert[e] += 1;
      }
    }
    while (static_cast<int64_t>(ex.recv_row.size()) % expert_alignment != 0) ex.recv_row.push_back(-1);
    ex.expert_offsets.push_back(static_cast<int64_t>(ex.recv_row.size()));
  }
  return ex;
}

Matrix reference_expand(const Matrix& recv_x, const RefExpanded& expanded) {
  Matrix out(recv_x.dtype(), expanded.num_rows(), recv_x.cols());
  for (int64_t j = 0; j < expanded.num_rows(); ++j)
    if (expanded.recv_row[j] >= 0) std::memcpy(out.row(j), recv_x.row(expanded.recv_row[j]), out.row_bytes());
  return out;
}

Matrix reference_expert_partial(const Matrix& y_expanded, const RefExpanded& expanded,
                                const std::vector<float>& weights, int topk) {
  const int64_t num_recv = static_cast<int64_t>(expanded.row_of.size()) / (topk > 0 ? topk : 1);
  Matrix out(DType::kF32, num_recv, y_expanded.cols());
  for (int64_t i = 0; i < num_recv; ++i) {
    for (int64_t c = 0; c < y_expanded.cols(); ++c) {
      float partial = 0.0f;
      for (int k = 0; k < topk; ++k) {
        const int64_t j = expanded.row_of[i * topk + k];
        if (j < 0) continue;
        const float product = weights[i * topk + k] * y_expanded.get(j, c);
        partial += product;
      }
      out.set(i, c, partial);
    }
  }
  return out;
}

std::vector<std::vector<float>> reference_weight_grads(const ExchangeSpec& spec,
                                                       const std::vector<RankInputs>& inputs,
                                                       const std::vector<RefRecv>& recv,
                                                       const std::vector<std::vector<float>>& grad_recv_weights) {
  const auto index = row_index(inputs, recv);
  std::vector<std::vector<float>> grads;
  for (int s = 0; s < spec.num_ranks(); ++s) {
    const RankInputs& in = inputs[s];
    std::vector<float> g(static_cast<std::size_t>(in.num_tokens()) * in.topk, 0.0f);
    for (int t = 0; t < in.num_tokens(); ++t) {
      for (int k = 0; k < in.topk; ++k) {
        const int e = in.expert(t, k);
        if (e < 0) continue;
        const int r = spec.placement.rank_of(e);
        g[t * in.topk + k] = grad_recv_weights[r][index[r][s][t] * in.topk + k];
      }
    }
    grads.push_back(std::move(g));
  }
  return grads;
}

RefTraffic reference_traffic(const ExchangeSpec& spec, const std::vector<RankInputs>& inputs) {
  RefTraffic traffic;
  for (int s = 0; s < spec.num_ranks(); ++s) {
    const DispatchLayout layout = reference_layout(spec, inputs[s]);
    const int home = spec.topology.node_of(s);
    for (int t = 0; t < inputs[s].num_tokens(); ++t) {
      std::vector<bool> node_seen(spec.topology.num_nodes(), false);
      for (int r = 0; r < spec.num_ranks(); ++r) {
        if (!layout.in_rank(t, r)) continue;
        const int node = spec.topology.node_of(r);
        if (node == home) continue;
        traffic.remote_rank_pairs += 1;
        if (!node_seen[node]) traffic.remote_node_pairs += 1;
        node_seen[node] = true;
      }
    }
  }
  return traffic;
}

int64_t dispatch_meta_bytes(int topk, bool with_weights) { return 4 + 4 * topk + (with_weights ? 4 * topk : 0); }

}  // namespace epx::exchange_test
