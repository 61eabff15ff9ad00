#include "epx/core/dtype.h"

namespace epx {

std::size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kF32: return 4;
    case DType::kBF16: return 2;
    case DType::kFP8E4M3: return 1;
    case DType::kUE8M0: return 1;
    case DType::kI32: return 4;
    case DType::kI64: return 8;
    case DType::kF64: return 8;
  }
  return 0;
}

std::string_view dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kF32: return "f32";
    case DType::kBF16: return "bf16";
    case DType::kFP8E4M3: return "fp8_e4m3";
    case DType::kUE8M0: return "ue8m0";
    case DType::kI32: return "i32";
    case DType::kI64: return "i64";
    case DType::kF64: return "f64";
  }
  return "unknown";
}

Result<DType> parse_dtype(std::string_view name) {
  if (name == "f32" || name == "fp32" || name == "float32") return DType::kF32;
  if (name == "bf16" || name == "bfloat16") return DType::kBF16;
  if (name == "fp8" || name == "e4m3" || name == "fp8_e4m3") return DType::kFP8E4M3;
  if (name == "ue8m0") return DType::kUE8M0;
  if (name == "i32" || name == "int32") return DType::kI32;
  if (name == "i64" || name == "int64") return DType::kI64;
  if (name == "f64" || name == "float64") return DType::kF64;
  return invalid_argument("dtype '{}' is not one of f32, bf16, fp8_e4m3, ue8m0, i32, i64, f64", name);
}

}  // namespace epx
