// Transports: in-process worlds (ranks are threads running a Python function
// each), MPI (one rank per process, initialised on first use) and sockets
// (one rank per process, met through a key-value store: epx.torchrun_transport).
#include "transport.h"

#include <dlfcn.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "args.h"
#include "arrays.h"
#include "epx/comm/inproc.h"
#include "epx/comm/mpi.h"
#include "epx/comm/socket.h"
#include "errors.h"
#include "gil.h"

namespace pb = pybind11;

namespace epx::py {

Transport& PyTransport::get() const {
  if (!transport) throw_error("FailedPreconditionError", "the transport is closed (MPI was finalised at exit)");
  return *transport;
}

Deadline deadline_after(pb::handle seconds, double fallback) {
  if (!seconds.is_none() && !pb::isinstance<pb::float_>(seconds) && !PyIndex_Check(seconds.ptr())) {
    throw pb::type_error(fmt::format("timeout = {} ({}) is not a number of seconds",
                                     pb::repr(seconds).cast<std::string>(), type_name(seconds)));
  }
  const double s = seconds.is_none() ? fallback : seconds.cast<double>();
  if (!(s >= 0)) throw_error("InvalidArgumentError", fmt::format("timeout: {} s is negative", s));
  return Deadline::after(std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s)));
}

namespace {

using TransportPtr = std::shared_ptr<PyTransport>;

std::shared_ptr<PyTransport> wrap(std::unique_ptr<Transport> transport, bool mpi) {
  auto out = std::make_shared<PyTransport>();
  out->transport = std::move(transport);
  out->mpi = mpi;
  return out;
}

// ---- MPI: one session per process, closed at exit in order ------------------

struct MpiState {
  std::unique_ptr<MpiSession> session;
  std::vector<std::function<void()>> buffer_closers;  // creation order
  std::vector<std::weak_ptr<PyTransport>> transports;
};

MpiState& mpi_state() {
  static auto* state = new MpiState;  // never destroyed: closed by close_mpi() at exit
  return *state;
}

void close_mpi() {
  MpiState& state = mpi_state();
  pb::gil_scoped_release release;  // closing waits for the other processes
  for (auto& close : state.buffer_closers) close();
  state.buffer_closers.clear();
  for (auto& weak : state.transports) {
    if (auto transport = weak.lock()) transport->transport.reset();
  }
  state.transports.clear();
  state.session.reset();
}

// Open MPI loads its plugins with dlopen and needs libmpi's symbols global;
// a Python extension is loaded RTLD_LOCAL, so promote libmpi first.
void promote_libmpi() {
  for (const char* name : {"libmpi.so.40", "libmpi.so"}) {
    if (dlopen(name, RTLD_NOW | RTLD_GLOBAL | RTLD_NOLOAD) != nullptr) return;
  }
}

// An exception that ends the interpreter aborts this process's MPI
// transports first, so the other ranks fail with AbortedError naming it at
// their next (or current) epx call instead of waiting for a rank that left.
void abort_mpi_transports(const pb::handle& type, const pb::handle& value) {
  const std::string what = fmt::format("{}: {}", pb::str(type.attr("__name__")).cast<std::string>(),
                                       pb::str(value).cast<std::string>());
  for (auto& weak : mpi_state().transports) {
    auto transport = weak.lock();
    if (!transport || !transport->transport) continue;
    transport->transport->abort(Status(StatusCode::kAborted, "Python raised " + what));
  }
}

void abort_on_uncaught_exception() {
  pb::module_ sys = pb::module_::import("sys");
  pb::object previous = sys.attr("excepthook");
  sys.attr("excepthook") = pb::cpp_function([previous](pb::handle type, pb::handle value, pb::handle traceback) {
    abort_mpi_transports(type, value);
    previous(type, value, traceback);
  });
}

// Once per process: transports of other processes (MPI, sockets) are closed
// at exit in order, and aborted by an uncaught exception.
void close_at_exit() {
  static bool registered = false;
  if (registered) return;
  registered = true;
  pb::module_::import("atexit").attr("register")(pb::cpp_function(&close_mpi));
  abort_on_uncaught_exception();
}

MpiSession& mpi_session() {
  MpiState& state = mpi_state();
  if (!state.session) {
    promote_libmpi();
    state.session = call([] { return MpiSession::init(nullptr, nullptr); });
    close_at_exit();
  }
  return *state.session;
}

// A torchrun-style launch (WORLD_SIZE > 1, no MPI launcher): MPI would give
// each process rank 0 of 1 and every process would train alone; refused.
void refuse_torchrun_launch() {
  const char* world_size = std::getenv("WORLD_SIZE");
  if (world_size == nullptr || launched_by_mpi()) return;
  char* end = nullptr;
  const long size = std::strtol(world_size, &end, 10);
  if (end == world_size || size <= 1) return;
  const char* rank = std::getenv("RANK");
  throw_error("FailedPreconditionError",
              fmt::format("mpi_transport: WORLD_SIZE={} and RANK={} are set (a torchrun-style launch) but no MPI "
                          "launcher started this process, so MPI would make it rank 0 of 1 and each process would "
                          "train alone; use epx.torchrun_transport() (or epx.launched_transport()) for this launch, "
                          "start the {} processes with `mpirun -n {} python3 ...` or srun, or run in one process with "
                          "epx.InprocWorld",
                          world_size, rank != nullptr ? rank : "(unset)", size, size));
}

TransportPtr mpi_transport(int ranks_per_node) {
  refuse_torchrun_launch();
  MpiSession& session = mpi_session();
  MpiOptions options;
  options.ranks_per_node = ranks_per_node;
  TransportPtr out = wrap(call([&] { return session.connect(options); }), true);
  mpi_state().transports.push_back(out);
  return out;
}

// ---- Sockets: a rendezvous through a store given as two Python callables -------

// set(key: str, value: bytes) and get(key: str, timeout_s: float) -> bytes,
// called with the GIL (connect runs without it).
class PyStore final : public KeyValueStore {
 public:
  PyStore(pb::object set, pb::object get) : set_(std::move(set)), get_(std::move(get)) {}
  Status set(const std::string& key, const std::string& value) override {
    pb::gil_scoped_acquire gil;
    try {
      set_(key, pb::bytes(value));
      return Status::ok();
    } catch (pb::error_already_set& error) {
      return internal_error("the store's set({}) raised {}", key, error.what());
    }
  }
  Result<std::string> get(const std::string& key, const Deadline& deadline) override {
    pb::gil_scoped_acquire gil;
    try {
      const double seconds = std::chrono::duration<double>(deadline.remaining()).count();
      return get_(key, std::max(seconds, 0.001)).cast<std::string>();
    } catch (pb::error_already_set& error) {
      return deadline_exceeded("the store's get({}) raised {} (no rank set it in time?)", key, error.what());
    }
  }

 private:
  pb::object set_;
  pb::object get_;
};

TransportPtr socket_transport(int rank, int world_size, const std::string& address, pb::object store_set,
                              pb::object store_get, int ranks_per_node, const std::string& prefix,
                              pb::handle timeout) {
  SocketOptions options;
  options.rank = rank;
  options.world_size = world_size;
  options.address = address;
  options.ranks_per_node = ranks_per_node;
  options.prefix = prefix;
  options.setup_timeout = std::chrono::duration_cast<std::chrono::milliseconds>(deadline_after(timeout, 60.0).remaining());
  PyStore store(std::move(store_set), std::move(store_get));
  TransportPtr out = wrap(call([&] { return connect_sockets(store, options); }), true);
  close_at_exit();
  mpi_state().transports.push_back(out);
  return out;
}

// ---- Transport's methods ---------------------------------------------------------

void barrier(const PyTransport& self, pb::handle timeout) {
  Transport& t = self.get();
  const Deadline deadline = deadline_after(timeout, 30.0);
  call([&] { return t.barrier(deadline); });
}

// In place, over every rank: array (contiguous f32, f64, i32 or i64).
pb::object all_reduce(const PyTransport& self, pb::object array, const std::string& op, pb::handle timeout) {
  Transport& t = self.get();
  ArrayArg arg = view_array(array, "array");
  const DType dtype = arg.view.dtype();
  if (dtype != DType::kF32 && dtype != DType::kF64 && dtype != DType::kI32 && dtype != DType::kI64) {
    throw_error("InvalidArgumentError", fmt::format("array: dtype {} is not f32, f64, i32 or i64", dtype_name(dtype)));
  }
  if (!arg.view.is_contiguous()) throw_error("InvalidArgumentError", "array: must be contiguous");
  const ReduceOp reduce =
      parse_choice<ReduceOp>(op, "op", {{"sum", ReduceOp::kSum}, {"max", ReduceOp::kMax}, {"min", ReduceOp::kMin}});
  const Deadline deadline = deadline_after(timeout, 30.0);
  call([&] { return t.all_reduce_raw(arg.view.data(), static_cast<std::size_t>(arg.view.numel()), dtype, reduce, deadline); });
  return array;
}

TransportPtr split(const PyTransport& self, int color, int key, pb::handle timeout) {
  Transport& t = self.get();
  const Deadline deadline = deadline_after(timeout, 30.0);
  TransportPtr out = wrap(call([&] { return t.split(color, key, deadline); }), self.mpi);
  if (self.mpi) mpi_state().transports.push_back(out);
  return out;
}

// ---- InprocWorld -------------------------------------------------------------------

struct PyWorld {
  std::shared_ptr<InprocWorld> world;
};

PyWorld make_world(int num_ranks, int num_nodes) {
  return PyWorld{std::make_shared<InprocWorld>(unwrap(Topology::create(num_ranks, num_nodes)))};
}

// What one rank's fn did.
struct Outcome {
  pb::object value;
  std::optional<pb::error_already_set> error;
  int64_t order = -1;  // when it failed, among the failures
};

// Calls fn(transport) on the rank's thread, holding the GIL only for Python.
Status run_rank(const pb::function& fn, const pb::object& transport, Outcome& outcome,
                std::atomic<int64_t>& failures) {
  pb::gil_scoped_acquire gil;
  try {
    outcome.value = fn(transport);
    return Status::ok();
  } catch (pb::error_already_set& error) {
    outcome.order = failures++;
    Status status(StatusCode::kInternal, fmt::format("Python raised {}", error.what()));
    outcome.error = std::move(error);
    return status;
  }
}

// The exception of the rank that failed first, prefixed "rank N: ". The
// ranks that only saw the abort (AbortedError) come last: they may reach
// Python before the rank that caused it.
[[noreturn]] void raise_first(const std::vector<Outcome>& outcomes) {
  pb::module_ errors = pb::module_::import("epx.errors");
  pb::object aborted = errors.attr("AbortedError");
  auto aborted_after = [&](int64_t order) { return order + (1LL << 40); };
  std::size_t first = outcomes.size();
  int64_t best = 0;
  for (std::size_t r = 0; r < outcomes.size(); ++r) {
    if (outcomes[r].order < 0) continue;
    const bool was_aborted = pb::isinstance(outcomes[r].error->value(), aborted);
    const int64_t key = was_aborted ? aborted_after(outcomes[r].order) : outcomes[r].order;
    if (first == outcomes.size() || key < best) {
      first = r;
      best = key;
    }
  }
  pb::object again = errors.attr("_with_rank")(first, outcomes[first].error->value());
  PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(again.ptr())), again.ptr());
  throw pb::error_already_set();
}

pb::list run(const PyWorld& self, const pb::function& fn) {
  const int num_ranks = self.world->topology().num_ranks();
  std::vector<pb::object> transports;
  for (int r = 0; r < num_ranks; ++r) transports.push_back(pb::cast(wrap(self.world->connect(r), false)));
  std::vector<Outcome> outcomes(static_cast<std::size_t>(num_ranks));
  std::atomic<int64_t> failures{0};
  std::vector<Status> statuses;
  {
    pb::gil_scoped_release release;
    statuses = self.world->run([&](Transport& t) {
      return run_rank(fn, transports[t.rank()], outcomes[t.rank()], failures);
    });
  }
  if (failures > 0) raise_first(outcomes);
  check(first_error(statuses));
  pb::list values;
  for (Outcome& outcome : outcomes) values.append(outcome.value);
  return values;
}

}  // namespace

void refuse_and_abort(const PyTransport& transport, std::string_view error_class, const std::string& message) {
  transport.get().abort(Status(StatusCode::kAborted, message));
  throw_error(error_class, message);
}

void at_mpi_exit(std::function<void()> close) { mpi_state().buffer_closers.push_back(std::move(close)); }

void register_transport(pb::module_& m) {
  pb::class_<PyTransport, TransportPtr>(m, "Transport", "One rank's transport (in-process, MPI or sockets).")
      .def_property_readonly("rank", [](const PyTransport& t) { return t.get().rank(); })
      .def_property_readonly("num_ranks", [](const PyTransport& t) { return t.get().num_ranks(); })
      .def_property_readonly("num_nodes", [](const PyTransport& t) { return t.get().topology().num_nodes(); })
      .def_property_readonly("node", [](const PyTransport& t) { return t.get().node(); })
      .def_property_readonly("local_rank", [](const PyTransport& t) { return t.get().local_rank(); })
      .def_property_readonly("backend", [](const PyTransport& t) { return std::string(t.get().backend_name()); })
      .def("barrier", &barrier, pb::arg("timeout") = 30.0)
      .def("all_reduce", &all_reduce, pb::arg("array"), pb::arg("op") = "sum", pb::arg("timeout") = 30.0,
           "Reduces `array` (contiguous f32, f64, i32, i64) over every rank, in place; returns it.")
      .def("split", &split, pb::arg("color"), pb::arg("key"), pb::arg("timeout") = 30.0)
      .def("abort", [](const PyTransport& t, const std::string& message) {
        t.get().abort(Status(StatusCode::kAborted, message));
      }, pb::arg("message"));

  pb::class_<PyWorld>(m, "InprocWorld", "In-process ranks: threads of this process.")
      .def(pb::init(&make_world), pb::arg("num_ranks"), pb::arg("num_nodes") = 1)
      .def_property_readonly("num_ranks", [](const PyWorld& w) { return w.world->topology().num_ranks(); })
      .def_property_readonly("num_nodes", [](const PyWorld& w) { return w.world->topology().num_nodes(); })
      .def("run", &run, pb::arg("fn"), "fn(transport) on one thread per rank; their return values in rank order.")
      .def("connect", [](const PyWorld& w, int rank) {
        if (rank < 0 || rank >= w.world->topology().num_ranks()) {
          throw_error("InvalidArgumentError", fmt::format("rank: {} is not in [0, {})", rank, w.world->topology().num_ranks()));
        }
        return wrap(w.world->connect(rank), false);
      }, pb::arg("rank"));

  m.def("mpi_transport", &mpi_transport, pb::arg("ranks_per_node") = 0,
        "This process's rank under mpirun / srun (MPI initialised on first use, finalised at exit).");
  m.def("socket_transport", &socket_transport, pb::arg("rank"), pb::arg("world_size"), pb::arg("address"),
        pb::arg("store_set"), pb::arg("store_get"), pb::arg("ranks_per_node") = 0, pb::arg("prefix") = "epx",
        pb::arg("timeout") = 60.0,
        "The socket backend's transport of this process (collective over world_size processes), met through a "
        "store: store_set(key, value: bytes), store_get(key, timeout_s) -> bytes. epx.torchrun_transport() calls it "
        "with torch.distributed's store.");
  m.def("mpi_available", &mpi_available);
  m.def("launched_by_mpi", &launched_by_mpi);
}

}  // namespace epx::py
