#include "core/guard.h"

#include <algorithm>
#include <atomic>
#include <exception>
#include <mutex>
#include <new>
#include <stdexcept>

namespace epx::detail {
namespace {

// The next `skip` calls pass, the `fail` after them fail.
struct Hook {
  std::atomic<bool> armed{false};
  std::mutex mutex;
  int skip = 0;
  int fail = 0;

  void arm(int s, int n) {
    std::lock_guard lock(mutex);
    skip = std::max(s, 0);
    fail = std::max(n, 0);
    armed.store(fail > 0);
  }
  bool take() {
    if (!armed.load(std::memory_order_relaxed)) return false;
    std::lock_guard lock(mutex);
    if (skip > 0) {
      --skip;
      return false;
    }
    if (fail == 0) return false;
    if (--fail == 0) armed.store(false);
    return true;
  }
};

Hook g_allocations;
Hook g_thread_starts;

bool is_exhaustion(const std::error_code& code) {
  return code == std::errc::resource_unavailable_try_again || code == std::errc::not_enough_memory;
}

}  // namespace

Status status_of_current_exception(std::string_view what) {
  try {
    throw;
  } catch (const std::bad_alloc&) {
    return resource_exhausted("{}: out of memory (an allocation failed)", what);
  } catch (const std::length_error& e) {
    return resource_exhausted("{}: a size is above what can be allocated ({})", what, e.what());
  } catch (const std::system_error& e) {
    if (is_exhaustion(e.code())) return resource_exhausted("{}: {}", what, e.code().message());
    return internal_error("{}: {}", what, e.what());
  } catch (const std::exception& e) {
    return internal_error("{} threw an exception: {}", what, e.what());
  } catch (...) {
    return internal_error("{} threw an exception that is not a std::exception", what);
  }
}

void fail_allocations(int skip, int n) { g_allocations.arm(skip, n); }
void fail_thread_starts(int skip, int n) { g_thread_starts.arm(skip, n); }
bool take_injected_allocation_failure() { return g_allocations.take(); }
bool take_injected_thread_failure() { return g_thread_starts.take(); }

}  // namespace epx::detail
