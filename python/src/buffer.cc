// epx.Buffer: dispatch and combine, their backward passes, the expanded
// layout, the asynchronous and split forms, with the lifetimes design of
// docs/python.md ("Lifetimes"):
//  - region views (recv_x, dispatch_cached's and combine_backward's results,
//    combine_input) hold a lease: a capsule that keeps the BufferState (the
//    C++ Buffer and its transport) alive and counts the live views of its
//    region;
//  - a call that would overwrite a region with live views raises
//    BufferInUseError and aborts the transport before anything is written;
//  - DispatchResult makes its recv_x view on access and checks the region's
//    generation first (StaleViewError).
#include <array>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <pybind11/functional.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "args.h"
#include "arrays.h"
#include "epx/core/clock.h"
#include "epx/core/fp8.h"
#include "epx/exchange/buffer.h"
#include "errors.h"
#include "gil.h"
#include "pending.h"
#include "transport.h"

namespace pb = pybind11;

namespace epx::py {
namespace {

enum Region : int { kRecv = 0, kCombine = 1 };
constexpr const char* kRegionName[] = {"receive", "combine"};

struct BufferState : std::enable_shared_from_this<BufferState> {
  std::shared_ptr<PyTransport> transport;
  std::unique_ptr<Buffer> buffer;
  std::array<uint64_t, 2> generation{};  // calls that wrote each region
  std::array<int, 2> live{};             // leased views of each region alive
  const void* combine_input_data = nullptr;
  // Split forms: the arguments of the outstanding send, kept alive.
  std::vector<pb::object> split_dispatch_args, split_combine_args;
  uint64_t split_dispatch_generation = 0;
  ArrayKind split_dispatch_kind = ArrayKind::kNumpy;
  pb::object split_combine_out;

  ~BufferState() { close(); }
  // Destroys the C++ Buffer without the GIL (its progress thread may wait).
  void close() { reset_without_gil(buffer); }
  Buffer& get() const {
    if (!buffer) throw_error("FailedPreconditionError", "the Buffer is closed (MPI was finalised at exit)");
    return *buffer;
  }
};
using StatePtr = std::shared_ptr<BufferState>;

// ---- leases, generations, the live-view guard ---------------------------------

struct Lease {
  StatePtr state;
  Region region;
};

pb::object region_view(const StatePtr& state, Region region, ArrayKind kind, const TensorView& view) {
  if (!view.defined()) return pb::none();
  ++state->live[region];
  pb::capsule lease(new Lease{state, region}, [](void* p) {
    auto* lease = static_cast<Lease*>(p);
    --lease->state->live[lease->region];
    delete lease;
  });
  return wrap_view(kind, view, lease);
}

// An array over memory the handle owns (its receive metadata).
pb::object handle_view(const Handle& handle, ArrayKind kind, const TensorView& view) {
  if (!view.defined()) return pb::none();
  pb::capsule owner(new Handle(handle), [](void* p) { delete static_cast<Handle*>(p); });
  return wrap_view(kind, view, owner);
}

// Before a call writes `region`: raises BufferInUseError, and aborts the
// transport so the peers fail too, when views of it are still referenced.
// `reading`: the call's input, which may be the combine_input view itself.
uint64_t begin_write(BufferState& state, Region region, std::string_view op, const void* reading = nullptr) {
  (void)state.get();  // raises once the Buffer is closed
  const bool own_input = region == kCombine && reading != nullptr && reading == state.combine_input_data;
  if (state.live[region] > 0 && !own_input) {
    refuse_and_abort(*state.transport, "BufferInUseError",
                     fmt::format("{} on rank {} would overwrite the {} region while {} view(s) of it are still "
                                 "referenced; .copy() (numpy) or .clone() (torch) what must survive and drop the views",
                                 op, state.transport->get().rank(), kRegionName[region], state.live[region]));
  }
  if (region == kCombine) state.combine_input_data = nullptr;
  return ++state.generation[region];
}

void check_fresh(const BufferState& state, uint64_t generation, std::string_view what) {
  if (state.generation[kRecv] != generation) {
    throw_error("StaleViewError",
                fmt::format("{}: the receive region was overwritten by a later dispatch-like call (this result is "
                            "from call {}, the region holds call {}); copy what must survive",
                            what, generation, state.generation[kRecv]));
  }
}

// ---- results ---------------------------------------------------------------------

struct PyHandle {
  Handle handle;
};

const Handle& handle_of(pb::handle obj) {
  if (!pb::isinstance<PyHandle>(obj)) {
    throw_error("InvalidArgumentError", fmt::format("handle: a {} is not an epx.Handle (DispatchResult.handle)",
                                                    type_name(obj)));
  }
  return obj.cast<const PyHandle&>().handle;
}

struct PyDispatchResult {
  StatePtr state;
  std::shared_ptr<DispatchResult> result;
  uint64_t generation = 0;
  ArrayKind kind = ArrayKind::kNumpy;
};

pb::object make_result(const StatePtr& state, std::shared_ptr<DispatchResult> result, uint64_t generation,
                       ArrayKind kind) {
  return pb::cast(PyDispatchResult{state, std::move(result), generation, kind});
}

struct PyExpandedLayout {
  pb::object expert_offsets, num_tokens_per_expert, row_of, recv_row;
  int64_t num_rows = 0;
};

template <typename T>
pb::object numpy_of(const std::vector<T>& values, std::vector<pb::ssize_t> shape) {
  pb::array_t<T> out(shape);
  std::copy(values.begin(), values.end(), out.mutable_data());
  return out;
}

PyExpandedLayout expanded_layout(BufferState& state, pb::handle handle) {
  const Handle& h = handle_of(handle);
  const ExpandedLayout& layout = state.get().expanded_layout(h);
  const auto e_local = static_cast<pb::ssize_t>(layout.num_tokens_per_expert.size());
  return PyExpandedLayout{numpy_of(layout.expert_offsets, {e_local + 1}), numpy_of(layout.num_tokens_per_expert, {e_local}),
                          numpy_of(layout.row_of, {static_cast<pb::ssize_t>(h.num_recv_tokens()), h.topk()}),
                          numpy_of(layout.recv_row, {static_cast<pb::ssize_t>(layout.num_rows())}), layout.num_rows()};
}

// ---- arguments ----------------------------------------------------------------------

struct DispatchArgs {
  ArrayArg x, idx, weights;
  [[nodiscard]] DispatchInputs inputs() const { return {x.view, idx.view, weights.view}; }
  [[nodiscard]] std::vector<pb::object> owners() const { return {x.owner, idx.owner, weights.owner}; }
};

DispatchArgs dispatch_args(pb::handle x, pb::handle topk_idx, pb::handle topk_weights) {
  return {view_array(x, "x"), view_ids(topk_idx, "topk_idx"), view_optional(topk_weights, "topk_weights")};
}

struct CombineArgs {
  ArrayArg bias, grad_recv_w, grad_w;
  [[nodiscard]] CombineOptions options() const { return {bias.view, grad_recv_w.view, grad_w.view}; }
  [[nodiscard]] std::vector<pb::object> owners() const { return {bias.owner, grad_recv_w.owner, grad_w.owner}; }
};

// The combine options; grad_topk_weights [T, K] f32 is allocated when
// grad_recv_topk_weights is given without it.
CombineArgs combine_args(ArrayKind kind, const Handle& handle, pb::handle bias, pb::handle grad_recv_w,
                         pb::handle grad_w) {
  CombineArgs args{view_optional(bias, "bias"), view_optional(grad_recv_w, "grad_recv_topk_weights"),
                   grad_w.is_none() ? ArrayArg{} : view_output(grad_w, "grad_topk_weights")};
  if (args.grad_recv_w.defined() && !args.grad_w.defined()) {
    const std::array<int64_t, 2> shape{handle.num_tokens(), handle.topk()};
    args.grad_w = new_array(kind, DType::kF32, shape);
  }
  return args;
}

// `out` or a new [rows, hidden] array of `dtype`.
ArrayArg out_or_new(pb::handle out, std::string_view name, ArrayKind kind, DType dtype, int64_t rows, int64_t cols) {
  if (!out.is_none()) return view_output(out, name);
  const std::array<int64_t, 2> shape{rows, cols};
  return new_array(kind, dtype, shape);
}

// ---- creation --------------------------------------------------------------------------

StatePtr create_buffer(const std::shared_ptr<PyTransport>& transport, int num_experts, int hidden,
                       const DTypeName& dtype, int max_tokens_per_rank, std::optional<int> max_topk, Int64 max_recv_tokens,
                       int expert_alignment, const DTypeName& max_combine_dtype, const std::string& fp8_scales,
                       const std::string& algorithm, double timeout, bool record_waits,
                       const std::optional<std::vector<int32_t>>& expert_rank, Int64 max_expanded_rows) {
  Transport& t = transport->get();
  BufferConfig config;
  config.num_experts = num_experts;
  config.hidden = hidden;
  config.dtype = unwrap_arg(parse_dtype(dtype), "dtype");
  config.fp8_scales = unwrap_arg(parse_scale_format(fp8_scales), "fp8_scales");
  config.max_topk = default_topk(max_topk, num_experts);
  config.max_tokens_per_rank = max_tokens_per_rank;
  config.max_recv_tokens = max_recv_tokens;
  config.max_expanded_rows = max_expanded_rows;
  config.expert_alignment = expert_alignment;
  config.max_combine_dtype = unwrap_arg(parse_dtype(max_combine_dtype), "max_combine_dtype");
  config.algorithm = parse_choice<DispatchAlgorithm>(algorithm, "algorithm",
                                                    {{"auto", DispatchAlgorithm::kAuto},
                                                     {"flat", DispatchAlgorithm::kFlat},
                                                     {"hierarchical", DispatchAlgorithm::kHierarchical}});
  config.timeout = timeout_arg(timeout);
  config.record_waits = record_waits;
  if (expert_rank) config.placement = unwrap(ExpertPlacement::from_map(*expert_rank, t.num_ranks()));
  auto state = std::make_shared<BufferState>();
  state->transport = transport;
  state->buffer = call([&] { return Buffer::create(t, config); });  // collective
  close_at_mpi_exit(state);
  return state;
}

// Buffer::expanded_rows_bound: the max_expanded_rows that makes room for every
// receiver-weighted combine_expanded with y of `y_dtype` on `num_ranks` ranks.
int64_t expanded_rows_bound(int num_ranks, int num_experts, int hidden, int max_tokens_per_rank,
                            const DTypeName& y_dtype, std::optional<int> max_topk, Int64 max_recv_tokens,
                            int expert_alignment, const DTypeName& max_combine_dtype,
                            const std::optional<std::vector<int32_t>>& expert_rank) {
  if (num_ranks < 1) throw_error("InvalidArgumentError", fmt::format("num_ranks = {} must be at least 1", num_ranks));
  BufferConfig config;
  config.num_experts = num_experts;
  config.hidden = hidden;
  config.max_topk = default_topk(max_topk, num_experts);
  config.max_tokens_per_rank = max_tokens_per_rank;
  config.max_recv_tokens = max_recv_tokens;
  config.expert_alignment = expert_alignment;
  config.max_combine_dtype = unwrap_arg(parse_dtype(max_combine_dtype), "max_combine_dtype");
  if (expert_rank) config.placement = unwrap(ExpertPlacement::from_map(*expert_rank, num_ranks));
  return Buffer::expanded_rows_bound(config, num_ranks, unwrap_arg(parse_dtype(y_dtype), "y_dtype"));
}

// `timeout` seconds from now; None: the Buffer's own timeout.
Deadline buffer_deadline(const Buffer& buffer, pb::handle timeout) {
  return deadline_after(timeout, static_cast<double>(buffer.config().timeout.count()) / 1000);
}

// ---- the operations: each blocking (GIL released) or asynchronous ---------------------

// One operation: its blocking and asynchronous forms (over views and
// handles only), the Python objects they use, and the result it gives.
// Lambdas, not std::functions: the blocking form allocates nothing here.
template <typename Now, typename Start, typename Finish>
struct Op {
  Now now;
  Start start;
  std::vector<pb::object> keep;
  Finish finish;
};

// The C++ side of bench/python_exchange.py's paired timing: the transport's
// barrier, then the blocking operation timed from C++, in the one stretch
// without the GIL, so that no Python runs between the barrier and the end.
struct CxxClock {
  Transport* transport = nullptr;
  Deadline deadline;
  int64_t start_ns = 0;
  int64_t end_ns = 0;

  template <typename Fn>
  Status time(Fn& fn) {
    EPX_RETURN_IF_ERROR(transport->barrier(deadline));
    start_ns = now_ns();
    Status status = fn();
    end_ns = now_ns();
    return status;
  }
  // (value, start, end), in seconds on the monotonic clock.
  pb::object with(pb::object value) const {
    return pb::make_tuple(std::move(value), static_cast<double>(start_ns) * 1e-9, static_cast<double>(end_ns) * 1e-9);
  }
};

// Blocking (`clock` optional) or, with `async`, queued.
template <typename Now, typename Start, typename Finish>
pb::object perform(Op<Now, Start, Finish> op, bool async, CxxClock* clock = nullptr) {
  if (!async) {
    if (clock != nullptr) {
      call([&] { return clock->time(op.now); });
    } else {
      call(op.now);
    }
    return op.finish();
  }
  return pending(op.start(), std::move(op.keep), std::move(op.finish));
}

pb::object dispatch(BufferState& self, pb::handle x, pb::handle topk_idx, pb::handle topk_weights, bool async,
                    CxxClock* clock = nullptr) {
  Buffer& buffer = self.get();
  const DispatchArgs args = dispatch_args(x, topk_idx, topk_weights);
  const uint64_t generation = begin_write(self, kRecv, "dispatch");
  auto result = std::make_shared<DispatchResult>();
  const DispatchInputs in = args.inputs();
  return perform(Op{[&buffer, in, result] { return buffer.dispatch(in, result.get()); },
                  [&buffer, in, result] { return buffer.dispatch_async(in, result.get()); }, args.owners(),
                  [state = self.shared_from_this(), result, generation, kind = args.x.kind] {
                    return make_result(state, result, generation, kind);
                  }},
                 async, clock);
}

// The combines: combine (y -> out) and dispatch_backward (grad_recv_x ->
// grad_x, and the gradient of the top-k weights through the options).
struct CombineForm {
  const char* op;
  const char* input;
  const char* output;
  Status (Buffer::*now)(const TensorView&, const Handle&, const TensorView&, const CombineOptions&);
  PendingOp (Buffer::*start)(const TensorView&, const Handle&, const TensorView&, const CombineOptions&);
};
constexpr CombineForm kCombineForm{"combine", "y", "out", &Buffer::combine, &Buffer::combine_async};
constexpr CombineForm kDispatchBackwardForm{"dispatch_backward", "grad_recv_x", "grad_x", &Buffer::dispatch_backward,
                                            &Buffer::dispatch_backward_async};

// Returns the output, or (output, grad_topk_weights) when grad_recv_topk_weights is given.
pb::object combine_like(const CombineForm& form, BufferState& self, pb::handle y, pb::handle handle, pb::handle out,
                        pb::handle bias, pb::handle grad_recv_w, pb::handle grad_w, bool async,
                        CxxClock* clock = nullptr) {
  Buffer& buffer = self.get();
  const Handle h = handle_of(handle);
  const ArrayArg in = view_array(y, form.input);
  const ArrayArg o = out_or_new(out, form.output, in.kind, in.view.dtype(), h.num_tokens(), buffer.config().hidden);
  const CombineArgs args = combine_args(in.kind, h, bias, grad_recv_w, grad_w);
  begin_write(self, kCombine, form.op, in.view.data());
  const TensorView iv = in.view, ov = o.view;
  const CombineOptions options = args.options();
  std::vector<pb::object> keep = args.owners();
  keep.push_back(in.owner);
  pb::object result = args.grad_recv_w.defined() ? pb::object(pb::make_tuple(o.owner, args.grad_w.owner)) : o.owner;
  return perform(Op{[&buffer, iv, h, ov, options, now = form.now] { return (buffer.*now)(iv, h, ov, options); },
                  [&buffer, iv, h, ov, options, start = form.start] { return (buffer.*start)(iv, h, ov, options); },
                  keep, [result] { return result; }},
                 async, clock);
}

pb::object combine(BufferState& self, pb::handle y, pb::handle handle, pb::handle out, pb::handle bias, bool async,
                   CxxClock* clock = nullptr) {
  return combine_like(kCombineForm, self, y, handle, out, bias, pb::none(), pb::none(), async, clock);
}

// The barrier waits up to `timeout` seconds (None: the Buffer's timeout).
CxxClock cxx_clock(const BufferState& self, pb::handle timeout) {
  return CxxClock{&self.transport->get(), buffer_deadline(self.get(), timeout)};
}

pb::object dispatch_backward(BufferState& self, pb::handle grad_recv_x, pb::handle handle, pb::handle grad_x,
                             pb::handle grad_recv_w, pb::handle grad_w, bool async) {
  return combine_like(kDispatchBackwardForm, self, grad_recv_x, handle, grad_x, pb::none(), grad_recv_w, grad_w, async);
}

// The cached dispatches into the receive region: dispatch_cached (x) and
// combine_backward (grad_out); both give a view of the region.
struct CachedForm {
  const char* op;
  const char* input;
  Status (Buffer::*now)(const TensorView&, const Handle&, TensorView*);
  PendingOp (Buffer::*start)(const TensorView&, const Handle&, TensorView*);
};
constexpr CachedForm kDispatchCachedForm{"dispatch_cached", "x", &Buffer::dispatch_cached,
                                         &Buffer::dispatch_cached_async};
constexpr CachedForm kCombineBackwardForm{"combine_backward", "grad_out", &Buffer::combine_backward,
                                          &Buffer::combine_backward_async};

pb::object cached_like(const CachedForm& form, BufferState& self, pb::handle x, pb::handle handle, bool async) {
  Buffer& buffer = self.get();
  const Handle h = handle_of(handle);
  const ArrayArg in = view_array(x, form.input);
  begin_write(self, kRecv, form.op);
  auto recv = std::make_shared<TensorView>();
  const TensorView iv = in.view;
  return perform(Op{[&buffer, iv, h, recv, now = form.now] { return (buffer.*now)(iv, h, recv.get()); },
                  [&buffer, iv, h, recv, start = form.start] { return (buffer.*start)(iv, h, recv.get()); },
                  {in.owner},
                  [state = self.shared_from_this(), recv, kind = in.kind] {
                    return region_view(state, kRecv, kind, *recv);
                  }},
                 async);
}

pb::object dispatch_cached(BufferState& self, pb::handle x, pb::handle handle, bool async) {
  return cached_like(kDispatchCachedForm, self, x, handle, async);
}

pb::object combine_backward(BufferState& self, pb::handle grad_out, pb::handle handle, bool async) {
  return cached_like(kCombineBackwardForm, self, grad_out, handle, async);
}

// Where combine_expanded applies the weights (CombineOptions::weights_at).
CombineWeights parse_weights_at(const std::string& weights_at) {
  return parse_choice<CombineWeights>(weights_at, "weights_at",
                                      {{"holder", CombineWeights::kHolder}, {"receiver", CombineWeights::kReceiver}});
}

pb::object combine_expanded(BufferState& self, pb::handle y_expanded, pb::handle handle, pb::handle out,
                            pb::handle weights, pb::handle bias, const std::string& weights_at,
                            const DTypeName& partial_dtype, bool async) {
  Buffer& buffer = self.get();
  const Handle h = handle_of(handle);
  const ArrayArg y = view_array(y_expanded, "y_expanded");
  const ArrayArg w = view_optional(weights, "weights");
  const ArrayArg o = out_or_new(out, "out", y.kind, y.view.dtype(), h.num_tokens(), buffer.config().hidden);
  const CombineArgs args = combine_args(y.kind, h, bias, pb::none(), pb::none());
  CombineOptions options = args.options();
  options.weights_at = parse_weights_at(weights_at);
  options.partial_dtype = unwrap_arg(parse_dtype(partial_dtype), "partial_dtype");
  // Receiver weights read y from the combine region: y may be the view
  // combine_expanded_input returned.
  const bool receiver = options.weights_at == CombineWeights::kReceiver;
  begin_write(self, kCombine, "combine_expanded", receiver ? y.view.data() : nullptr);
  const TensorView yv = y.view, wv = w.view, ov = o.view;
  std::vector<pb::object> keep = args.owners();
  keep.insert(keep.end(), {y.owner, w.owner});
  return perform(Op{[&buffer, yv, h, ov, wv, options] { return buffer.combine_expanded(yv, h, ov, wv, options); },
                  [&buffer, yv, h, ov, wv, options] { return buffer.combine_expanded_async(yv, h, ov, wv, options); },
                  keep, [out = o.owner] { return out; }},
                 async);
}

// Returns (grad_y_expanded, grad_weights or None).
pb::object combine_expanded_backward(BufferState& self, pb::handle grad_out, pb::handle handle, pb::handle y_expanded,
                                     pb::handle weights, pb::handle grad_y_expanded, pb::handle grad_weights,
                                     bool with_grad_weights, bool async) {
  Buffer& buffer = self.get();
  const Handle h = handle_of(handle);
  const ArrayArg g = view_array(grad_out, "grad_out");
  const ArrayArg y = view_array(y_expanded, "y_expanded");
  const ArrayArg w = view_optional(weights, "weights");
  const ArrayArg gy = out_or_new(grad_y_expanded, "grad_y_expanded", g.kind, DType::kF32,
                                 buffer.expanded_layout(h).num_rows(), buffer.config().hidden);
  ArrayArg gw = grad_weights.is_none() ? ArrayArg{} : view_output(grad_weights, "grad_weights");
  if (!gw.defined() && with_grad_weights) {
    const std::array<int64_t, 2> shape{h.num_recv_tokens(), h.topk()};
    gw = new_array(g.kind, DType::kF32, shape);
  }
  begin_write(self, kRecv, "combine_expanded_backward");
  const TensorView gv = g.view, yv = y.view, wv = w.view, gyv = gy.view, gwv = gw.view;
  pb::object result = pb::make_tuple(gy.owner, gw.defined() ? gw.owner : pb::none());
  return perform(
      Op{[&buffer, gv, h, yv, wv, gyv, gwv] { return buffer.combine_expanded_backward(gv, h, yv, wv, gyv, gwv); },
       [&buffer, gv, h, yv, wv, gyv, gwv] { return buffer.combine_expanded_backward_async(gv, h, yv, wv, gyv, gwv); },
       {g.owner, y.owner, w.owner}, [result] { return result; }},
      async);
}

ArrayKind parse_library(const std::string& library) {
  return parse_choice<ArrayKind>(library, "library", {{"numpy", ArrayKind::kNumpy}, {"torch", ArrayKind::kTorch}});
}

// A view of the combine region to write y into: rows for combine
// (combine_input), or, `expanded`, the expanded rows of y for a zero-copy
// combine_expanded(weights_at="receiver") (combine_expanded_input, which
// writes the region: views of it must be gone).
pb::object combine_region_input(BufferState& self, pb::handle handle, const DTypeName& dtype,
                                const std::string& library, bool expanded) {
  Buffer& buffer = self.get();
  const Handle& h = handle_of(handle);
  const DType type = unwrap_arg(parse_dtype(dtype), "dtype");
  const ArrayKind kind = parse_library(library);
  if (expanded) begin_write(self, kCombine, "combine_expanded_input");
  const TensorView view = unwrap(expanded ? buffer.combine_expanded_input(h, type) : buffer.combine_input(h, type));
  self.combine_input_data = view.data();
  return region_view(self.shared_from_this(), kCombine, kind, view);
}

// fp8 Buffers: the scales of the rows in the receive region (a view of it).
pb::object recv_scales(BufferState& self, pb::handle handle, const std::string& library) {
  const ArrayKind kind = parse_library(library);
  const TensorView view = unwrap(self.get().recv_scales(handle_of(handle)));
  return region_view(self.shared_from_this(), kRecv, kind, view);
}

pb::object expand(BufferState& self, pb::handle recv_x, pb::handle handle, pb::handle out) {
  Buffer& buffer = self.get();
  const Handle& h = handle_of(handle);
  const ArrayArg x = view_array(recv_x, "recv_x");
  const ArrayArg o = out_or_new(out, "out", x.kind, x.view.dtype(), buffer.expanded_layout(h).num_rows(),
                                buffer.config().hidden);
  check(buffer.expand(x.view, h, o.view));
  return o.owner;
}

// ---- split forms --------------------------------------------------------------------------

void dispatch_send(BufferState& self, pb::handle x, pb::handle topk_idx, pb::handle topk_weights) {
  Buffer& buffer = self.get();
  const DispatchArgs args = dispatch_args(x, topk_idx, topk_weights);
  const uint64_t generation = begin_write(self, kRecv, "dispatch_send");
  call([&] { return buffer.dispatch_send(args.inputs()); });
  self.split_dispatch_args = args.owners();
  self.split_dispatch_generation = generation;
  self.split_dispatch_kind = args.x.kind;
}

pb::object dispatch_recv(BufferState& self, pb::handle timeout) {
  Buffer& buffer = self.get();
  const Deadline deadline = buffer_deadline(buffer, timeout);
  auto result = std::make_shared<DispatchResult>();
  call([&] { return buffer.dispatch_recv(result.get(), deadline); });
  self.split_dispatch_args.clear();
  return make_result(self.shared_from_this(), result, self.split_dispatch_generation, self.split_dispatch_kind);
}

void combine_send(BufferState& self, pb::handle y, pb::handle handle, pb::handle out, pb::handle bias) {
  Buffer& buffer = self.get();
  const Handle h = handle_of(handle);
  const ArrayArg y_arg = view_array(y, "y");
  const ArrayArg o = out_or_new(out, "out", y_arg.kind, y_arg.view.dtype(), h.num_tokens(), buffer.config().hidden);
  const CombineArgs args = combine_args(y_arg.kind, h, bias, pb::none(), pb::none());
  begin_write(self, kCombine, "combine_send", y_arg.view.data());
  call([&] { return buffer.combine_send(y_arg.view, h, o.view, args.options()); });
  self.split_combine_args = args.owners();
  self.split_combine_args.push_back(y_arg.owner);
  self.split_combine_out = o.owner;
}

pb::object combine_recv(BufferState& self, pb::handle timeout) {
  Buffer& buffer = self.get();
  const Deadline deadline = buffer_deadline(buffer, timeout);
  call([&] { return buffer.combine_recv(deadline); });
  self.split_combine_args.clear();
  pb::object out = self.split_combine_out;
  self.split_combine_out = pb::none();
  return out;
}

pb::object take_waits(BufferState& self) {
  WaitRecord sum;
  sum.clear(self.transport->get().num_ranks());
  self.get().take_waits(&sum);
  return pb::cast(sum);
}

pb::object dequantize(pb::handle q, pb::handle scales, pb::handle out, const DTypeName& dtype) {
  const ArrayArg q_arg = view_array(q, "q");
  ArrayArg s_arg = view_array(scales, "scales");
  if (q_arg.view.ndim() != 2 || s_arg.view.ndim() != 2) throw_error("InvalidArgumentError", "q, scales: must be 2-d");
  if (s_arg.view.dtype() == DType::kFP8E4M3) {  // uint8 scales are ue8m0 codes
    s_arg.view = TensorView(s_arg.view.data(), DType::kUE8M0, {s_arg.view.size(0), s_arg.view.size(1)},
                            {s_arg.view.stride(0), s_arg.view.stride(1)});
  }
  const ArrayArg o = out_or_new(out, "out", q_arg.kind, unwrap_arg(parse_dtype(dtype), "dtype"), q_arg.view.size(0),
                                q_arg.view.size(1));
  check(dequantize_fp8(q_arg.view, s_arg.view, o.view));
  return o.owner;
}

void register_results(pb::module_& m) {
  pb::class_<WaitRecord>(m, "WaitRecord", "Who this rank waited for, per rank, in seconds (docs/operations.md).")
      .def_readonly("arrival", &WaitRecord::arrival)
      .def_readonly("data", &WaitRecord::data)
      .def_readonly("blocked", &WaitRecord::blocked)
      .def_readonly("num_ops", &WaitRecord::num_ops);
  pb::class_<ExchangeStats>(m, "ExchangeStats", "What one rank moved in one operation.")
      .def_readonly("rows_sent", &ExchangeStats::rows_sent)
      .def_readonly("rows_received", &ExchangeStats::rows_received)
      .def_readonly("intra_node_payload_bytes", &ExchangeStats::intra_node_payload_bytes)
      .def_readonly("inter_node_payload_bytes", &ExchangeStats::inter_node_payload_bytes)
      .def_readonly("inter_node_meta_bytes", &ExchangeStats::inter_node_meta_bytes)
      .def_readonly("seconds", &ExchangeStats::seconds)
      .def_readonly("waits", &ExchangeStats::waits);
  pb::class_<PyHandle>(m, "Handle", "What a dispatch decided; combine and the backward passes take it.")
      .def_property_readonly("num_tokens", [](const PyHandle& h) { return h.handle.num_tokens(); })
      .def_property_readonly("num_recv_tokens", [](const PyHandle& h) { return h.handle.num_recv_tokens(); })
      .def_property_readonly("topk", [](const PyHandle& h) { return h.handle.topk(); });
  pb::class_<PyExpandedLayout>(m, "ExpandedLayout", "The expanded per-expert layout of one rank's rows (numpy int arrays).")
      .def_readonly("expert_offsets", &PyExpandedLayout::expert_offsets)
      .def_readonly("num_tokens_per_expert", &PyExpandedLayout::num_tokens_per_expert)
      .def_readonly("row_of", &PyExpandedLayout::row_of)
      .def_readonly("recv_row", &PyExpandedLayout::recv_row)
      .def_readonly("num_rows", &PyExpandedLayout::num_rows);
}

using R = PyDispatchResult;

void register_dispatch_result(pb::module_& m) {
  pb::class_<R>(m, "DispatchResult", "What this rank received; recv_x is a view of the receive region.")
      .def_property_readonly("recv_x", [](const R& r) {
        check_fresh(*r.state, r.generation, "recv_x");
        return region_view(r.state, kRecv, r.kind, r.result->recv_x);
      })
      .def_property_readonly("recv_scales", [](const R& r) {
        check_fresh(*r.state, r.generation, "recv_scales");
        return region_view(r.state, kRecv, r.kind, r.result->recv_scales);
      })
      .def_property_readonly("recv_topk_idx", [](const R& r) {
        return handle_view(r.result->handle, r.kind, r.result->recv_topk_idx);
      })
      .def_property_readonly("recv_topk_weights", [](const R& r) {
        return handle_view(r.result->handle, r.kind, r.result->recv_topk_weights);
      })
      .def_property_readonly("recv_src_rank", [](const R& r) {
        return handle_view(r.result->handle, r.kind, r.result->recv_src_rank);
      })
      .def_property_readonly("recv_src_idx", [](const R& r) {
        return handle_view(r.result->handle, r.kind, r.result->recv_src_idx);
      })
      .def_property_readonly("num_recv_tokens_per_expert", [](const R& r) { return r.result->num_recv_tokens_per_expert; })
      .def_property_readonly("handle", [](const R& r) { return PyHandle{r.result->handle}; })
      .def_property_readonly("stats", [](const R& r) { return r.result->stats; })
      .def_property_readonly("is_stale", [](const R& r) { return r.state->generation[kRecv] != r.generation; });
}

// The collective operations, blocking (`async` false) or as NAME_async,
// which returns a PendingOp.
// The docstring of a collective operation: `what`, and for NAME_async that it is queued.
std::string op_doc(bool async, const char* what) {
  return std::string("Collective (every rank calls it, in the same order): ") + what +
         (async ? " Queued: returns an epx.PendingOp whose wait() gives that result." : "");
}

void register_buffer_ops(pb::class_<BufferState, StatePtr>& c, bool async) {
  const auto none = pb::none();
  const auto name = [async](const char* op) { return std::string(op) + (async ? "_async" : ""); };
  c.def(name("dispatch").c_str(), [async](BufferState& s, pb::handle x, pb::handle i, pb::handle w) {
    return dispatch(s, x, i, w, async);
  }, pb::arg("x"), pb::arg("topk_idx"), pb::arg("topk_weights") = none,
     op_doc(async, "sends each row of x [T, H] to the ranks of its experts (topk_idx [T, K], -1 = none); returns a "
                   "DispatchResult whose recv_x is a view of the receive region.").c_str());
  c.def(name("dispatch_cached").c_str(), [async](BufferState& s, pb::handle x, pb::handle h) {
    return dispatch_cached(s, x, h, async);
  }, pb::arg("x"), pb::arg("handle"),
     op_doc(async, "dispatches x along an earlier dispatch's handle (no routing metadata exchanged); returns a view "
                   "of the receive region.").c_str());
  c.def(name("combine").c_str(), [async](BufferState& s, pb::handle y, pb::handle h, pb::handle o, pb::handle b) {
    return combine(s, y, h, o, b, async);
  }, pb::arg("y"), pb::arg("handle"), pb::arg("out") = none, pb::arg("bias") = none,
     op_doc(async, "sends the received rows' outputs y back and sums each token's rows, weighted by its top-k "
                   "weights, into out [T, H] (allocated when not given); returns out.").c_str());
  c.def(name("dispatch_backward").c_str(), [async](BufferState& s, pb::handle g, pb::handle h, pb::handle o,
                                                    pb::handle grw, pb::handle gw) {
    return dispatch_backward(s, g, h, o, grw, gw, async);
  }, pb::arg("grad_recv_x"), pb::arg("handle"), pb::arg("grad_x") = none, pb::arg("grad_recv_topk_weights") = none,
     pb::arg("grad_topk_weights") = none,
     op_doc(async, "dispatch's backward: grad_recv_x back to the tokens, summed into grad_x [T, H]; returns grad_x, "
                   "or (grad_x, grad_topk_weights) when grad_recv_topk_weights is given.").c_str());
  c.def(name("combine_backward").c_str(), [async](BufferState& s, pb::handle g, pb::handle h) {
    return combine_backward(s, g, h, async);
  }, pb::arg("grad_out"), pb::arg("handle"),
     op_doc(async, "combine's backward: grad_out [T, H] to the ranks that received each token; returns a view of "
                   "the receive region.").c_str());
  c.def(name("combine_expanded").c_str(), [async](BufferState& s, pb::handle y, pb::handle h, pb::handle o,
                                                   pb::handle w, pb::handle b, const std::string& at,
                                                   const DTypeName& partial) {
    return combine_expanded(s, y, h, o, w, b, at, partial, async);
  }, pb::arg("y_expanded"), pb::arg("handle"), pb::arg("out") = none, pb::arg("weights") = none,
     pb::arg("bias") = none, pb::arg("weights_at") = "holder", pb::arg("partial_dtype") = "f32",
     op_doc(async, "combine of y in the expanded layout (one row per (token, expert) pair); weights_at 'holder' or "
                   "'receiver' (each token's rank applies its weights, in top-k order); returns out.").c_str());
  c.def(name("combine_expanded_backward").c_str(), [async](BufferState& s, pb::handle g, pb::handle h, pb::handle y,
                                                            pb::handle w, pb::handle gy, pb::handle gw, bool with_gw) {
    return combine_expanded_backward(s, g, h, y, w, gy, gw, with_gw, async);
  }, pb::arg("grad_out"), pb::arg("handle"), pb::arg("y_expanded"), pb::arg("weights") = none,
     pb::arg("grad_y_expanded") = none, pb::arg("grad_weights") = none, pb::arg("with_grad_weights") = false,
     op_doc(async, "combine_expanded's backward: returns (grad_y_expanded, grad_weights), grad_weights None unless "
                   "with_grad_weights or grad_weights= is given.").c_str());
}

// The local operations and the split forms.
void register_buffer_local(pb::class_<BufferState, StatePtr>& c) {
  const auto none = pb::none();
  c.def("combine_input", [](BufferState& s, pb::handle h, const DTypeName& dtype, const std::string& library) {
    return combine_region_input(s, h, dtype, library, false);
  }, pb::arg("handle"), pb::arg("dtype") = "f32", pb::arg("library") = "numpy",
     "Local: a view of the combine region to write the received rows' outputs y into, then pass it to combine.")
      .def("combine_expanded_input", [](BufferState& s, pb::handle h, const DTypeName& dtype,
                                        const std::string& library) {
    return combine_region_input(s, h, dtype, library, true);
  }, pb::arg("handle"), pb::arg("dtype") = "bf16", pb::arg("library") = "numpy",
     "Local: a view of the combine region for y in the expanded layout (a zero-copy receiver-weighted "
     "combine_expanded); writes the region, so other views of it must be gone.")
      .def("recv_scales", &recv_scales, pb::arg("handle"), pb::arg("library") = "numpy",
           "Local: fp8 Buffers: the scales of the received rows (a view of the receive region).")
      .def("expanded_layout", [](BufferState& s, pb::handle h) { return expanded_layout(s, h); }, pb::arg("handle"),
           "Local: the received rows laid out per local expert (expert_offsets, num_tokens_per_expert, row_of, "
           "recv_row, num_rows).")
      .def("expand", &expand, pb::arg("recv_x"), pb::arg("handle"), pb::arg("out") = none,
           "Local: recv_x copied into the expanded layout (one row per (token, local expert)); returns out.")
      .def("dispatch_send", &dispatch_send, pb::arg("x"), pb::arg("topk_idx"), pb::arg("topk_weights") = none,
           "Collective, split form: starts a dispatch; dispatch_recv finishes it.")
      .def("dispatch_recv", &dispatch_recv, pb::arg("timeout") = none,
           "Finishes dispatch_send: the DispatchResult (timeout in seconds, None = the Buffer's).")
      .def("combine_send", &combine_send, pb::arg("y"), pb::arg("handle"), pb::arg("out") = none, pb::arg("bias") = none,
           "Collective, split form: starts a combine; combine_recv finishes it.")
      .def("combine_recv", &combine_recv, pb::arg("timeout") = none,
           "Finishes combine_send: returns out (timeout in seconds, None = the Buffer's).");
  // For bench/python_exchange.py: the operation as C++ runs it, on the same Buffer and memory.
  c.def("_timed_dispatch", [](BufferState& s, pb::handle x, pb::handle i, pb::handle w, pb::handle timeout) {
    CxxClock clock = cxx_clock(s, timeout);
    return clock.with(dispatch(s, x, i, w, false, &clock));
  }, pb::arg("x"), pb::arg("topk_idx"), pb::arg("topk_weights") = none, pb::arg("timeout") = none,
     "Private, for benchmarks: the transport's barrier (timeout in seconds, None = the Buffer's), then dispatch "
     "timed from C++, all without the GIL; returns (DispatchResult, start, end), seconds on the monotonic clock.");
  c.def("_timed_combine", [](BufferState& s, pb::handle y, pb::handle h, pb::handle o, pb::handle timeout) {
    CxxClock clock = cxx_clock(s, timeout);
    return clock.with(combine(s, y, h, o, pb::none(), false, &clock));
  }, pb::arg("y"), pb::arg("handle"), pb::arg("out") = none, pb::arg("timeout") = none,
     "Private, for benchmarks: the transport's barrier (timeout in seconds, None = the Buffer's), then combine "
     "timed from C++, all without the GIL; returns (out, start, end).");
}

}  // namespace

void register_buffer(pb::module_& m) {
  register_results(m);
  register_dispatch_result(m);
  pb::class_<BufferState, StatePtr> c(
      m, "Buffer",
      "Dispatch and combine for one rank (include/epx/exchange/buffer.h). Creating one is collective: every rank "
      "of the transport creates its Buffer with the same settings, in the same order.");
  c.def(pb::init(&create_buffer), pb::arg("transport").none(false), pb::arg("num_experts"), pb::arg("hidden"),
        pb::arg("dtype") = "bf16", pb::arg("max_tokens_per_rank") = 0, pb::arg("max_topk") = pb::none(),
        pb::arg("max_recv_tokens") = 0, pb::arg("expert_alignment") = 1, pb::arg("max_combine_dtype") = "f32",
        pb::arg("fp8_scales") = "f32", pb::arg("algorithm") = "auto", pb::arg("timeout") = 30.0,
        pb::arg("record_waits") = true, pb::arg("expert_rank") = pb::none(), pb::arg("max_expanded_rows") = 0)
      .def_property_readonly("num_local_experts", [](const BufferState& s) { return s.get().num_local_experts(); })
      .def_property_readonly("hierarchical", [](const BufferState& s) { return s.get().hierarchical(); })
      .def_property_readonly("region_bytes", [](const BufferState& s) { return s.get().region_bytes(); })
      .def_property_readonly("num_experts", [](const BufferState& s) { return s.get().config().num_experts; })
      .def_property_readonly("hidden", [](const BufferState& s) { return s.get().config().hidden; })
      .def_property_readonly("max_expanded_rows", [](const BufferState& s) { return s.get().config().max_expanded_rows; })
      .def_property_readonly("dtype", [](const BufferState& s) { return std::string(dtype_name(s.get().config().dtype)); })
      .def_property_readonly("transport", [](const BufferState& s) { return s.transport; })
      .def("take_waits", &take_waits, "Local: who this rank waited for since the last call (a WaitRecord).")
      .def_static("expanded_rows_bound", &expanded_rows_bound, pb::arg("num_ranks"), pb::arg("num_experts"),
                  pb::arg("hidden"), pb::arg("max_tokens_per_rank"), pb::arg("y_dtype") = "bf16",
                  pb::arg("max_topk") = pb::none(), pb::arg("max_recv_tokens") = 0, pb::arg("expert_alignment") = 1,
                  pb::arg("max_combine_dtype") = "f32", pb::arg("expert_rank") = pb::none(),
                  "The max_expanded_rows that makes room for every receiver-weighted combine_expanded (the worst "
                  "case) with y of y_dtype, for a Buffer of these settings on num_ranks ranks.");
  register_buffer_ops(c, false);
  register_buffer_ops(c, true);
  register_buffer_local(c);
  m.def("dequantize_fp8", &dequantize, pb::arg("q"), pb::arg("scales"), pb::arg("out") = pb::none(),
        pb::arg("dtype") = "f32", "fp8 e4m3 codes and their block scales -> f32 or bf16 rows.");
}

}  // namespace epx::py
