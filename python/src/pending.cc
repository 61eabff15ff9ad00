#include "pending.h"

#include <memory>
#include <optional>

#include "errors.h"
#include "transport.h"

namespace pb = pybind11;

namespace epx::py {
namespace {

struct PyPendingOp {
  PendingOp op;
  std::vector<pb::object> keep;        // the arguments, alive until the operation ends
  std::function<pb::object()> finish;  // builds the result (with the GIL) once it succeeded
  std::optional<pb::object> result;

  PyPendingOp(PendingOp o, std::vector<pb::object> k, std::function<pb::object()> f)
      : op(std::move(o)), keep(std::move(k)), finish(std::move(f)) {}
  PyPendingOp(const PyPendingOp&) = delete;
  PyPendingOp& operator=(const PyPendingOp&) = delete;
  // A dropped operation is waited for: its arguments must outlive it.
  ~PyPendingOp() {
    if (result || op.done()) return;
    pb::gil_scoped_release release;
    op.wait().ignore();
  }

  pb::object wait(pb::handle timeout) {
    if (result) return *result;
    Status status;
    {
      const bool forever = timeout.is_none();
      const Deadline deadline = deadline_after(timeout, 0);
      pb::gil_scoped_release release;
      status = forever ? op.wait() : op.wait(deadline);
    }
    check(status);
    result = finish();
    keep.clear();
    return *result;
  }
};

}  // namespace

pb::object pending(PendingOp op, std::vector<pb::object> keep, std::function<pb::object()> finish) {
  return pb::cast(std::make_unique<PyPendingOp>(std::move(op), std::move(keep), std::move(finish)));
}

void register_pending(pb::module_& m) {
  pb::class_<PyPendingOp>(m, "PendingOp", "An asynchronous operation; wait(timeout=None) gives its result.")
      .def("wait", &PyPendingOp::wait, pb::arg("timeout") = pb::none(),
           "Its result once it has finished; DeadlineExceededError when not by `timeout` s (wait again).")
      .def("done", [](const PyPendingOp& p) { return p.result.has_value() || p.op.done(); },
           "Whether wait() would not block.");
}

}  // namespace epx::py
