#include "exchange/payload.h"

#include <cstring>

namespace epx::detail {
namespace {

bool is_wide_dtype(DType dtype) { return dtype == DType::kF32 || dtype == DType::kBF16; }

}  // namespace

Result<PayloadFormat> PayloadFormat::of(const BufferConfig& config) {
  PayloadFormat p;
  p.dtype_ = config.dtype;
  p.scale_format_ = config.fp8_scales;
  p.hidden_ = config.hidden;
  if (config.fp8_scales != Fp8ScaleFormat::kF32 && config.fp8_scales != Fp8ScaleFormat::kUE8M0)
    return invalid_argument("fp8_scales = {} is not f32 or ue8m0", static_cast<int>(config.fp8_scales));
  if (p.fp8()) {
    if (config.hidden % kFp8BlockSize != 0)
      return invalid_argument("hidden = {} is not a multiple of {}, the channels per fp8 scale; fp8 payloads need it",
                              config.hidden, kFp8BlockSize);
    const std::size_t scale_bytes =
        static_cast<std::size_t>(config.hidden / kFp8BlockSize) * dtype_size(scale_dtype(config.fp8_scales));
    p.row_bytes_ = (static_cast<std::size_t>(config.hidden) + scale_bytes + 7) / 8 * 8;
    return p;
  }
  if (!is_wide_dtype(config.dtype))
    return invalid_argument("dtype = {} is not a payload type; use bf16, f32 or fp8_e4m3", dtype_name(config.dtype));
  p.row_bytes_ = static_cast<std::size_t>(config.hidden) * dtype_size(config.dtype);
  if (p.row_bytes_ % 8 != 0)
    return invalid_argument("hidden = {} gives rows of {} bytes; rows must be a multiple of 8 bytes", config.hidden,
                            p.row_bytes_);
  return p;
}

Result<PayloadFormat> PayloadFormat::gradients_of(const BufferConfig& config) {
  if (!config.gradient_dtype || *config.gradient_dtype == config.dtype) return of(config);
  const DType g = *config.gradient_dtype;
  if (config.dtype != DType::kFP8E4M3 || !is_wide_dtype(g))
    return invalid_argument("gradient_dtype = {} with dtype = {}: only fp8_e4m3 Buffers take one, and it must be bf16 "
                            "or f32",
                            dtype_name(g), dtype_name(config.dtype));
  BufferConfig wide = config;
  wide.dtype = g;
  wide.gradient_dtype.reset();
  return of(wide);
}

Status PayloadFormat::check_input(const TensorView& x, std::string_view name, int64_t rows) const {
  if (!fp8()) return check_matrix(x, name, dtype_, rows, hidden_);
  if (!is_wide_dtype(x.dtype()))
    return invalid_argument("{} must be bf16 or f32 (an fp8 Buffer quantises rows as it sends them), got {}", name,
                            x.describe());
  return check_matrix(x, name, x.dtype(), rows, hidden_);
}

Status PayloadFormat::stage(const TensorView& x, AlignedBuffer* stage, TensorView* rows) const {
  if (!fp8()) {
    *rows = x;
    return Status::ok();
  }
  const int64_t n = x.size(0);
  EPX_RETURN_IF_ERROR(stage->reserve(static_cast<std::size_t>(n) * row_bytes_, "the fp8 rows to send"));
  // Padding bytes travel too: keep them zero, so every run sends the same bytes.
  const std::size_t used = static_cast<std::size_t>(hidden_) +
                           static_cast<std::size_t>(hidden_ / kFp8BlockSize) * dtype_size(scale_dtype(scale_format_));
  if (used < row_bytes_)
    for (int64_t t = 0; t < n; ++t) std::memset(stage->data() + t * row_bytes_ + used, 0, row_bytes_ - used);
  EPX_RETURN_IF_ERROR(quantize_fp8(x, scale_format_, values(stage->data(), n), scales(stage->data(), n)));
  *rows = TensorView(stage->data(), DType::kFP8E4M3, {n, static_cast<int64_t>(row_bytes_)},
                     {static_cast<int64_t>(row_bytes_), 1});
  return Status::ok();
}

Status PayloadFormat::check_gradient_payload(std::string_view op) const {
  if (!fp8()) return Status::ok();
  return failed_precondition(
      "{} sends gradients, and this Buffer's payload is fp8_e4m3 (forward activations only); set "
      "BufferConfig::gradient_dtype (bf16 or f32) or run the backward passes on a bf16 or f32 Buffer",
      op);
}

TensorView PayloadFormat::values(std::byte* base, int64_t rows) const {
  const int64_t elem = static_cast<int64_t>(dtype_size(dtype_));
  return TensorView(base, dtype_, {rows, hidden_}, {static_cast<int64_t>(row_bytes_) / elem, 1});
}

TensorView PayloadFormat::scales(std::byte* base, int64_t rows) const {
  if (!fp8()) return {};
  const DType sd = scale_dtype(scale_format_);
  return TensorView(base + hidden_, sd, {rows, hidden_ / kFp8BlockSize},
                    {static_cast<int64_t>(row_bytes_ / dtype_size(sd)), 1});
}

}  // namespace epx::detail
