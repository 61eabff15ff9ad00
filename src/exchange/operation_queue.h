// Private: the asynchronous machinery every exchange backend shares (Buffer,
// LowLatencyBuffer, CudaBuffer): one queue of operations on a progress
// thread, and the entry of the blocking forms.
//
// A backend implements each operation once, as a private *_blocking member;
// its public forms are one line each:
//
//   Status Buffer::combine(...) { return ops_->run("combine", [&] { return combine_blocking(...); }); }
//   PendingOp Buffer::combine_async(...) { return ops_->submit([=, this] { return combine_blocking(...); }); }
//
// run() is the blocking form: it waits for the queued operations (they run
// in order, and the blocking one comes after them), then calls the operation
// on the caller's thread under detail::guard (no exception crosses the
// public API). submit() queues the operation and returns at once; the lambda
// captures the arguments by value (views and handles are cheap to copy),
// what they point at is the caller's to keep until PendingOp::wait.
//
// The backend holds its queue last among its members, so that the queue is
// destroyed first: its destructor lets the queued operations finish (each
// ends by its deadline) before the memory they use goes away. A backend
// whose destructor body frees something the operations use resets the
// queue first.
#pragma once

#include <functional>
#include <string_view>
#include <utility>

#include "core/guard.h"
#include "epx/core/clock.h"
#include "epx/exchange/buffer.h"
#include "exchange/progress.h"

namespace epx::detail {

class OperationQueue {
 public:
  // op_timeout: the deadline of one operation (the backend's config.timeout),
  // from which each queued operation's bound for PendingOp::wait() follows.
  explicit OperationQueue(Milliseconds op_timeout) : progress_(op_timeout) {}
  OperationQueue(const OperationQueue&) = delete;
  OperationQueue& operator=(const OperationQueue&) = delete;

  // The blocking form of an operation named `name`: waits for the queued
  // ones, then returns fn() (a Status or a Result).
  template <typename F>
  auto run(std::string_view name, F&& fn) -> decltype(std::forward<F>(fn)()) {
    return guard(name, [&]() -> decltype(std::forward<F>(fn)()) {
      EPX_RETURN_IF_ERROR(progress_.drain());
      return std::forward<F>(fn)();
    });
  }
  // The asynchronous form: `op` queued behind the others.
  [[nodiscard]] PendingOp submit(std::function<Status()> op) { return PendingOp(progress_.submit(std::move(op))); }

 private:
  ProgressThread progress_;
};

}  // namespace epx::detail
