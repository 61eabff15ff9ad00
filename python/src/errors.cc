// Statuses to Python exceptions: one table, the classes of epx/errors.py.
#include "errors.h"

#include <string>

#include <pybind11/pybind11.h>

namespace pb = pybind11;

namespace epx::py {
namespace {

struct Mapping {
  StatusCode code;
  const char* class_name;
};

// docs/python.md, "Errors".
constexpr Mapping kMappings[] = {
    {StatusCode::kInvalidArgument, "InvalidArgumentError"},
    {StatusCode::kOutOfRange, "OutOfRangeError"},
    {StatusCode::kFailedPrecondition, "FailedPreconditionError"},
    {StatusCode::kResourceExhausted, "ResourceExhaustedError"},
    {StatusCode::kDeadlineExceeded, "DeadlineExceededError"},
    {StatusCode::kAborted, "AbortedError"},
    {StatusCode::kUnimplemented, "UnimplementedError"},
    {StatusCode::kInternal, "InternalError"},
    {StatusCode::kNotFound, "NotFoundError"},
};

const char* class_of(StatusCode code) {
  for (const Mapping& mapping : kMappings) {
    if (mapping.code == code) return mapping.class_name;
  }
  return "Error";
}

[[noreturn]] void raise(std::string_view class_name, std::string_view message, const char* code) {
  pb::object cls = pb::module_::import("epx.errors").attr(std::string(class_name).c_str());
  pb::object error = code != nullptr ? cls(std::string(message), code) : cls(std::string(message));
  PyErr_SetObject(cls.ptr(), error.ptr());
  throw pb::error_already_set();
}

}  // namespace

void throw_status(const Status& status) {
  const std::string code(status_code_name(status.code()));
  raise(class_of(status.code()), status.message(), code.c_str());
}

void throw_error(std::string_view class_name, std::string_view message) {
  raise(class_name, message, nullptr);
}

}  // namespace epx::py
