#include "exchange/progress.h"

#include <exception>

#include "core/guard.h"
#include "epx/comm/transport.h"

namespace epx::detail {

ProgressThread::~ProgressThread() {
  {
    std::lock_guard lock(mutex_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

std::shared_ptr<PendingState> ProgressThread::submit(std::function<Status()> op) {
  auto state = std::make_shared<PendingState>();
  {
    std::lock_guard lock(mutex_);
    // Queued behind the others, this one must end one timeout (and a margin
    // for the local work around its waits) after the last one must.
    const Clock::time_point start = std::max(Clock::now(), last_bound_.when());
    last_bound_ = Deadline::at(start + op_timeout_ + std::chrono::seconds(5));
    state->bound = last_bound_;
    if (!thread_.joinable()) {
      // Started on first use; without it the operation fails before it runs.
      Result<std::thread> thread = start_thread("the progress thread of an exchange buffer", [this] { run(); });
      if (!thread.is_ok()) {
        state->status = thread.status();
        state->done = true;
        return state;
      }
      thread_ = std::move(thread).value();
    }
    queue_.push_back({std::move(op), state});
  }
  cv_.notify_all();
  return state;
}

Status ProgressThread::drain() {
  EPX_CHECK(!on_progress_thread());
  std::unique_lock lock(mutex_);
  const Deadline bound = last_bound_;
  if (!cv_.wait_until(lock, bound.when(), [&] { return queue_.empty() && running_ == 0; }))
    return deadline_exceeded("the Buffer's queued operations had not finished when the last of them was due");
  return Status::ok();
}

void ProgressThread::run() {
  // Beside the caller's compute: leave the cores to it while waiting.
  set_thread_wait_style(WaitStyle::kBackground);
  std::unique_lock lock(mutex_);
  for (;;) {
    cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stopping, and nothing is left to run
    Item item = std::move(queue_.front());
    queue_.pop_front();
    ++running_;
    lock.unlock();
    Status status;
    try {
      status = item.op();
    } catch (const std::exception& e) {
      status = internal_error("an asynchronous exchange operation threw: {}", e.what());
    } catch (...) {
      status = internal_error("an asynchronous exchange operation threw something that is not a std::exception");
    }
    {
      std::lock_guard done_lock(item.state->mutex);
      item.state->status = std::move(status);
      item.state->done = true;
    }
    item.state->done_cv.notify_all();
    lock.lock();
    --running_;
    cv_.notify_all();
  }
}

}  // namespace epx::detail
