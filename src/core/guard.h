// Private: where the standard library's exceptions become Statuses, so none
// crosses the public API (docs/errors.md).
//
// guard() runs a public entry point's body and maps what escapes it:
// std::bad_alloc and std::length_error become ResourceExhausted ("out of
// memory"), a std::system_error that says EAGAIN or ENOMEM ResourceExhausted,
// anything else Internal; every message starts with what was running.
// start_thread() starts a thread or says ResourceExhausted "could not start
// <what>: Resource temporarily unavailable". Allocations of a size the user
// controls use AlignedBuffer::allocate or Parameter::make, which name the bytes.
//
//   Status Buffer::dispatch(...) {
//     return detail::guard("dispatch", [&] { return dispatch_blocking(...); });
//   }
//
// Test hooks, for the whole process: fail_allocations(skip, n) lets the next
// `skip` allocations through AlignedBuffer / Parameter::make succeed and makes
// the n after them fail; fail_thread_starts(skip, n) does the same to
// start_thread (std::errc::resource_unavailable_try_again). (0, 0) disarms.
#pragma once

#include <string_view>
#include <system_error>
#include <thread>
#include <utility>

#include "epx/core/status.h"

namespace epx::detail {

// Call only inside a catch block: the Status for the exception being handled.
Status status_of_current_exception(std::string_view what);

template <typename F>
auto guard(std::string_view what, F&& fn) -> decltype(std::forward<F>(fn)()) {
  try {
    return std::forward<F>(fn)();
  } catch (...) {
    return status_of_current_exception(what);
  }
}

void fail_allocations(int skip, int n);
void fail_thread_starts(int skip, int n);
// Counts one allocation / thread start against the hook: whether it must fail.
bool take_injected_allocation_failure();
bool take_injected_thread_failure();

// std::thread or std::jthread running fn(args...), or ResourceExhausted.
template <typename Thread = std::thread, typename F, typename... Args>
Result<Thread> start_thread(std::string_view what, F&& fn, Args&&... args) {
  try {
    if (take_injected_thread_failure())
      throw std::system_error(std::make_error_code(std::errc::resource_unavailable_try_again));
    return Thread(std::forward<F>(fn), std::forward<Args>(args)...);
  } catch (const std::system_error& e) {
    return resource_exhausted("could not start {}: {}", what, e.code().message());
  }
}

}  // namespace epx::detail
