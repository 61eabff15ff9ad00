// Private: work(i) for every share i in [0, threads), one share a thread
// and share 0 on the caller's. A share whose thread cannot start runs on the
// caller's thread after its own, so the result is the same whenever each
// share writes only its own outputs. Every thread is joined before it returns.
// The router's worker threads and the simulator's use it.
//
//   epx::detail::run_shares(threads, "a simulator routing thread", [&](int share) { ... });
#pragma once

#include <functional>
#include <thread>
#include <vector>

#include "core/guard.h"

namespace epx::detail {

inline void run_shares(int threads, const char* what, const std::function<void(int)>& work) {
  std::vector<int> on_caller = {0};
  std::vector<std::jthread> pool;  // joined when this returns
  pool.reserve(threads);
  for (int i = 1; i < threads; ++i) {
    Result<std::jthread> thread = start_thread<std::jthread>(what, work, i);
    if (thread.is_ok()) pool.push_back(std::move(thread).value());
    else on_caller.push_back(i);
  }
  for (int i : on_caller) work(i);
}

}  // namespace epx::detail
