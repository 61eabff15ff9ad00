// epx.LowLatencyBuffer: the low-latency dispatch and combine of decode steps
// (epx/exchange/low_latency.h).
//
// Results are copies (docs/python.md, "Lifetimes"): peers may write the next
// dispatch's rows into this rank's receive region as soon as its combine has
// read y, so no guard on this rank could protect a view. A dispatch_async's
// rows are copied when it is waited for; another dispatch before that would
// overwrite them, so it raises FailedPreconditionError (and aborts the
// transport, so the peers fail too instead of waiting).
#include <array>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "args.h"
#include "arrays.h"
#include "epx/exchange/low_latency.h"
#include "errors.h"
#include "gil.h"
#include "pending.h"
#include "transport.h"

namespace pb = pybind11;

namespace epx::py {
namespace {

using namespace pybind11::literals;

// A dispatch_async's result until wait() copies it out.
struct AsyncDispatch {
  LowLatencyDispatchResult out;
  bool collected = false;
};

struct LowLatencyState {
  std::shared_ptr<PyTransport> transport;
  std::unique_ptr<LowLatencyBuffer> buffer;
  std::weak_ptr<AsyncDispatch> last_async_dispatch;

  LowLatencyState() = default;
  LowLatencyState(const LowLatencyState&) = delete;
  LowLatencyState& operator=(const LowLatencyState&) = delete;
  ~LowLatencyState() { close(); }
  // Destroys the C++ buffer without the GIL (its progress thread may wait).
  void close() { reset_without_gil(buffer); }
  [[nodiscard]] LowLatencyBuffer& get() const {
    if (!buffer) throw_error("FailedPreconditionError", "the LowLatencyBuffer is closed (MPI was finalised at exit)");
    return *buffer;
  }
};
using StatePtr = std::shared_ptr<LowLatencyState>;

struct PyLowLatencyHandle {
  LowLatencyHandle handle;
  int64_t num_tokens = 0;  // of the dispatch: combine's out has this many rows
};

struct PyLowLatencyResult {
  pb::object recv_x, num_recv_tokens_per_expert, recv_src_rank, recv_src_idx, recv_src_slot;
  PyLowLatencyHandle handle;
  ExchangeStats stats;
};

PyLowLatencyResult copy_result(const LowLatencyDispatchResult& r, ArrayKind kind, int64_t num_tokens) {
  return PyLowLatencyResult{copy_of(kind, r.recv_x),
                            copy_of(kind, r.num_recv_tokens_per_expert),
                            copy_of(kind, r.recv_src_rank),
                            copy_of(kind, r.recv_src_idx),
                            copy_of(kind, r.recv_src_slot),
                            PyLowLatencyHandle{r.handle, num_tokens},
                            r.stats};
}

StatePtr create(const std::shared_ptr<PyTransport>& transport, int num_experts, int hidden, const DTypeName& dtype,
                int max_tokens_per_rank, std::optional<int> max_topk, int capacity, const DTypeName& max_combine_dtype,
                const std::optional<std::vector<int32_t>>& expert_rank, double timeout, pb::handle combine_per_rank) {
  Transport& t = transport->get();
  LowLatencyConfig config{.num_experts = num_experts,
                          .hidden = hidden,
                          .dtype = unwrap_arg(parse_dtype(dtype), "dtype"),
                          .max_tokens_per_rank = max_tokens_per_rank,
                          .max_topk = default_topk(max_topk, num_experts),
                          .capacity = capacity,
                          .max_combine_dtype = unwrap_arg(parse_dtype(max_combine_dtype), "max_combine_dtype"),
                          .placement = std::nullopt};
  config.timeout = timeout_arg(timeout);
  config.combine_per_rank = bool_arg(combine_per_rank, "combine_per_rank");
  if (expert_rank) config.placement = unwrap(ExpertPlacement::from_map(*expert_rank, t.num_ranks()));
  auto state = std::make_shared<LowLatencyState>();
  state->buffer = call([&] { return LowLatencyBuffer::create(t, config); });  // collective
  state->transport = transport;
  close_at_mpi_exit(state);
  return state;
}

// Another dispatch would overwrite the rows of a dispatch_async not yet
// waited for: fail here, and abort the transport so the peers fail too.
void check_no_uncollected_dispatch(LowLatencyState& self, std::string_view op) {
  const std::shared_ptr<AsyncDispatch> last = self.last_async_dispatch.lock();
  if (!last || last->collected) return;
  refuse_and_abort(*self.transport, "FailedPreconditionError",
                   fmt::format("{} on rank {} would overwrite the rows of a dispatch_async not yet waited for: wait() "
                               "for it first", op, self.transport->get().rank()));
}

struct DispatchArgs {
  ArrayArg x, idx, weights;
  [[nodiscard]] LowLatencyDispatchInputs inputs() const { return {x.view, idx.view, weights.view}; }
  [[nodiscard]] std::vector<pb::object> owners() const { return {x.owner, idx.owner, weights.owner}; }
  [[nodiscard]] int64_t num_tokens() const { return x.view.ndim() > 0 ? x.view.size(0) : 0; }
};

DispatchArgs dispatch_args(pb::handle x, pb::handle topk_idx, pb::handle topk_weights) {
  return {view_array(x, "x"), view_ids(topk_idx, "topk_idx"), view_optional(topk_weights, "topk_weights")};
}

PyLowLatencyResult dispatch(LowLatencyState& self, pb::handle x, pb::handle topk_idx, pb::handle topk_weights) {
  LowLatencyBuffer& buffer = self.get();
  check_no_uncollected_dispatch(self, "dispatch");
  const DispatchArgs args = dispatch_args(x, topk_idx, topk_weights);
  LowLatencyDispatchResult out;
  call([&] { return buffer.dispatch(args.inputs(), &out); });
  return copy_result(out, args.x.kind, args.num_tokens());
}

pb::object dispatch_async(LowLatencyState& self, pb::handle x, pb::handle topk_idx, pb::handle topk_weights) {
  LowLatencyBuffer& buffer = self.get();
  check_no_uncollected_dispatch(self, "dispatch_async");
  const DispatchArgs args = dispatch_args(x, topk_idx, topk_weights);
  auto pending_dispatch = std::make_shared<AsyncDispatch>();
  PendingOp op = buffer.dispatch_async(args.inputs(), &pending_dispatch->out);
  self.last_async_dispatch = pending_dispatch;
  auto finish = [pending_dispatch, kind = args.x.kind, num_tokens = args.num_tokens()] {
    pending_dispatch->collected = true;
    return pb::cast(copy_result(pending_dispatch->out, kind, num_tokens));
  };
  return pending(std::move(op), args.owners(), finish);
}

const PyLowLatencyHandle& handle_of(pb::handle obj) {
  if (!pb::isinstance<PyLowLatencyHandle>(obj))
    throw_error("InvalidArgumentError",
                fmt::format("handle: a {} is not an epx.LowLatencyHandle (LowLatencyDispatchResult.handle)",
                            type_name(obj)));
  return obj.cast<const PyLowLatencyHandle&>();
}

// y, and `out` or a new [num_tokens, hidden] array of y's library and dtype.
std::pair<ArrayArg, ArrayArg> combine_args(const LowLatencyBuffer& buffer, pb::handle y, const PyLowLatencyHandle& h,
                                           pb::handle out) {
  ArrayArg y_arg = view_array(y, "y");
  if (!out.is_none()) return {std::move(y_arg), view_output(out, "out")};
  const std::array<int64_t, 2> shape{h.num_tokens, buffer.config().hidden};
  ArrayArg out_arg = new_array(y_arg.kind, y_arg.view.dtype(), shape);
  return {std::move(y_arg), std::move(out_arg)};
}

pb::object combine(LowLatencyState& self, pb::handle y, pb::handle handle, pb::handle out) {
  LowLatencyBuffer& buffer = self.get();
  const PyLowLatencyHandle& h = handle_of(handle);
  const auto [y_arg, out_arg] = combine_args(buffer, y, h, out);
  call([&] { return buffer.combine(y_arg.view, h.handle, out_arg.view); });
  return out_arg.owner;
}

pb::object combine_async(LowLatencyState& self, pb::handle y, pb::handle handle, pb::handle out) {
  LowLatencyBuffer& buffer = self.get();
  const PyLowLatencyHandle& h = handle_of(handle);
  auto [y_arg, out_arg] = combine_args(buffer, y, h, out);
  PendingOp op = buffer.combine_async(y_arg.view, h.handle, out_arg.view);
  pb::object result = out_arg.owner;
  return pending(std::move(op), {y_arg.owner, out_arg.owner, pb::reinterpret_borrow<pb::object>(handle)},
                 [result] { return result; });
}

void bind_results(pb::module_& m) {
  pb::class_<PyLowLatencyHandle>(m, "LowLatencyHandle", "Names one low-latency dispatch; combine takes the latest.")
      .def_property_readonly("seq", [](const PyLowLatencyHandle& h) { return h.handle.seq; })
      .def_property_readonly("num_tokens", [](const PyLowLatencyHandle& h) { return h.num_tokens; });
  pb::class_<PyLowLatencyResult>(m, "LowLatencyDispatchResult",
                                 "A low-latency dispatch's rows and metadata: copies, valid for good.")
      .def_readonly("recv_x", &PyLowLatencyResult::recv_x, "[E_local, R * capacity, H] of the buffer's dtype")
      .def_readonly("num_recv_tokens_per_expert", &PyLowLatencyResult::num_recv_tokens_per_expert, "int32 [E_local]")
      .def_readonly("recv_src_rank", &PyLowLatencyResult::recv_src_rank, "int32 [E_local, R * capacity], -1 past the count")
      .def_readonly("recv_src_idx", &PyLowLatencyResult::recv_src_idx, "int32: the token index on the source rank")
      .def_readonly("recv_src_slot", &PyLowLatencyResult::recv_src_slot, "int32: the slot of topk_idx naming the expert")
      .def_readonly("handle", &PyLowLatencyResult::handle)
      .def_readonly("stats", &PyLowLatencyResult::stats);
}

void bind_buffer(pb::module_& m) {
  pb::class_<LowLatencyState, StatePtr>(m, "LowLatencyBuffer",
                                        "Low-latency dispatch and combine with fixed shapes (decode steps). Creating one is "
                                        "collective: every rank creates its buffer with the same settings.")
      .def(pb::init(&create), pb::arg("transport").none(false), "num_experts"_a, "hidden"_a, "dtype"_a = "bf16",
           "max_tokens_per_rank"_a = 0, "max_topk"_a = pybind11::none(), "capacity"_a = 0, "max_combine_dtype"_a = "f32",
           "expert_rank"_a = pb::none(), "timeout"_a = 30.0, "combine_per_rank"_a = false)
      .def("dispatch", &dispatch, "x"_a, "topk_idx"_a, "topk_weights"_a = pb::none(),
           "Collective: each token's row once to each rank holding one of its experts, copied there into each "
           "expert's rows; a LowLatencyDispatchResult of copies.")
      .def("combine", &combine, "y"_a, "handle"_a, "out"_a = pb::none(),
           "Collective: y [E_local, R * capacity, H] back to its tokens, weighted; out [T, H] (y's dtype by default). "
           "combine_per_rank: the owner sums each token's rows and sends one per (token, rank).")
      .def("dispatch_async", &dispatch_async, "x"_a, "topk_idx"_a, "topk_weights"_a = pb::none(),
           "As dispatch, queued: a PendingOp whose wait() returns the LowLatencyDispatchResult.")
      .def("combine_async", &combine_async, "y"_a, "handle"_a, "out"_a = pb::none(),
           "As combine, queued: a PendingOp whose wait() returns out.")
      .def_property_readonly("num_local_experts", [](const LowLatencyState& s) { return s.get().num_local_experts(); })
      .def_property_readonly("rows_per_expert", [](const LowLatencyState& s) { return s.get().rows_per_expert(); })
      .def_property_readonly("capacity",
                             [](const LowLatencyState& s) {
                               return s.get().rows_per_expert() / s.transport->get().num_ranks();
                             })
      .def_property_readonly("expert_rank",
                             [](const LowLatencyState& s) { return s.get().placement().expert_rank(); })
      .def_property_readonly("region_bytes", [](const LowLatencyState& s) { return s.get().region_bytes(); },
                             "Bytes of peer-mapped memory this rank holds.")
      .def_property_readonly("num_experts", [](const LowLatencyState& s) { return s.get().config().num_experts; })
      .def_property_readonly("hidden", [](const LowLatencyState& s) { return s.get().config().hidden; })
      .def_property_readonly("dtype",
                             [](const LowLatencyState& s) { return std::string(dtype_name(s.get().config().dtype)); })
      .def_property_readonly("combine_per_rank",
                             [](const LowLatencyState& s) { return s.get().config().combine_per_rank; })
      .def_property_readonly("transport", [](const LowLatencyState& s) { return s.transport; });
}

}  // namespace

void register_low_latency(pybind11::module_& m) {
  bind_results(m);
  bind_buffer(m);
}

}  // namespace epx::py
