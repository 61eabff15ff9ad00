// For tests of the failure hooks of core/guard.h: declared first in a test,
// it disarms both hooks when the test ends, however it ends, so no later test
// inherits an armed hook.
#pragma once

#include "core/guard.h"

namespace epx::testing {

struct DisarmFailureHooks {
  ~DisarmFailureHooks() {
    detail::fail_allocations(0, 0);
    detail::fail_thread_starts(0, 0);
  }
};

}  // namespace epx::testing
