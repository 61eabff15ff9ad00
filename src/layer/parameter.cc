#include "epx/layer/parameter.h"

#include <cstdint>
#include <new>
#include <stdexcept>

#include "core/guard.h"

namespace epx {

Result<Parameter> Parameter::make(std::string name, ParamKind kind, int64_t rows, int64_t cols) {
  if (rows < 0 || cols < 0) return invalid_argument("parameter '{}' has a negative shape [{}, {}]", name, rows, cols);
  uint64_t bytes = 0;  // value and gradient
  const bool too_many = __builtin_mul_overflow(static_cast<uint64_t>(rows), static_cast<uint64_t>(cols), &bytes) ||
                        __builtin_mul_overflow(bytes, 2 * sizeof(float), &bytes) || bytes > PTRDIFF_MAX;
  auto exhausted = [&] {
    return resource_exhausted("could not allocate {} bytes for parameter '{}' ([{}, {}] f32, value and gradient): out "
                              "of memory",
                              too_many ? "more than 2^63" : std::to_string(bytes), name, rows, cols);
  };
  if (too_many || detail::take_injected_allocation_failure()) return exhausted();
  try {
    return Parameter(name, kind, rows, cols);
  } catch (const std::bad_alloc&) {
    return exhausted();
  } catch (const std::length_error&) {
    return exhausted();
  }
}

}  // namespace epx
