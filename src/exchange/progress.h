// Private: the progress thread that runs a Buffer's asynchronous operations.
//
// Operations run one at a time, in the order they were submitted, on one
// thread per Buffer, started on first use. Each operation is bounded by its
// own deadline (BufferConfig::timeout), so the queue always drains.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

#include "epx/core/clock.h"
#include "epx/core/status.h"

namespace epx::detail {

// What a PendingOp waits on.
struct PendingState {
  std::mutex mutex;
  std::condition_variable done_cv;
  bool done = false;
  Status status;
  // When the operation must have ended even if every queued operation ahead
  // of it ran to its own deadline (a bound for wait() without a deadline).
  Deadline bound = Deadline::after(Clock::duration::zero());
};

class ProgressThread {
 public:
  explicit ProgressThread(Milliseconds op_timeout) : op_timeout_(op_timeout) {}
  // Lets every queued operation finish (each ends by its deadline), then joins.
  ~ProgressThread();
  ProgressThread(const ProgressThread&) = delete;
  ProgressThread& operator=(const ProgressThread&) = delete;

  // Queues `op`; the returned state is completed with its status.
  std::shared_ptr<PendingState> submit(std::function<Status()> op);
  // Waits until every submitted operation has finished; DeadlineExceeded if
  // that has not happened by the time the last one must have ended. Called
  // from an operation itself it would wait for itself: checked.
  Status drain();
  // Whether the calling thread is the progress thread.
  [[nodiscard]] bool on_progress_thread() const { return std::this_thread::get_id() == thread_.get_id(); }

 private:
  struct Item {
    std::function<Status()> op;
    std::shared_ptr<PendingState> state;
  };
  void run();

  Milliseconds op_timeout_;
  std::mutex mutex_;
  std::condition_variable cv_;  // new work, stop, and "an operation finished"
  std::deque<Item> queue_;
  int running_ = 0;             // operations taken off the queue and not yet finished
  bool stop_ = false;
  Deadline last_bound_ = Deadline::after(Clock::duration::zero());
  std::thread thread_;
};

}  // namespace epx::detail
