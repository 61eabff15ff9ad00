// Private: what a Buffer's dispatch rows look like, in one place.
//
// A row is `hidden` elements of the payload dtype (f32, bf16), or, for fp8,
// `hidden` e4m3 bytes followed by hidden / 128 scales (f32 or ue8m0), padded
// to a multiple of 8 bytes. The exchange moves rows as opaque bytes, so
// deduplication, the two-hop path and the receive order are the same for
// every format, and its byte counters count the scales (and any padding).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "epx/core/buffer.h"
#include "epx/core/fp8.h"
#include "epx/core/status.h"
#include "epx/core/tensor.h"
#include "epx/exchange/buffer.h"

namespace epx::detail {

class PayloadFormat {
 public:
  PayloadFormat() = default;
  // Checks the config's dtype, fp8_scales and hidden (InvalidArgument naming the value).
  static Result<PayloadFormat> of(const BufferConfig& config);
  // The rows the backward passes send: of config.gradient_dtype when set
  // (fp8 Buffers), else those of `of`. Checks gradient_dtype.
  static Result<PayloadFormat> gradients_of(const BufferConfig& config);

  [[nodiscard]] std::size_t row_bytes() const { return row_bytes_; }
  [[nodiscard]] bool fp8() const { return dtype_ == DType::kFP8E4M3; }

  // Checks a dispatch input x [rows, hidden]: of the payload dtype, or f32 /
  // bf16 for fp8 (quantised on send).
  [[nodiscard]] Status check_input(const TensorView& x, std::string_view name, int64_t rows) const;
  // The rows to send: x itself, or for fp8 x quantised into `stage` (a view
  // [rows, row_bytes] of bytes). Fails on a non-finite x (fp8), before anything is sent.
  [[nodiscard]] Status stage(const TensorView& x, AlignedBuffer* stage, TensorView* rows) const;
  // The backward passes send gradients, which fp8 Buffers do not carry.
  [[nodiscard]] Status check_gradient_payload(std::string_view op) const;

  // Views of `rows` received rows starting at `base`: the payload ([rows,
  // hidden] of dtype; e4m3 for fp8, rows row_bytes apart) and, for fp8, the
  // scales ([rows, hidden / 128] f32 or ue8m0, in the same rows; undefined otherwise).
  [[nodiscard]] TensorView values(std::byte* base, int64_t rows) const;
  [[nodiscard]] TensorView scales(std::byte* base, int64_t rows) const;

 private:
  DType dtype_ = DType::kBF16;
  Fp8ScaleFormat scale_format_ = Fp8ScaleFormat::kF32;
  int hidden_ = 0;
  std::size_t row_bytes_ = 0;
};

}  // namespace epx::detail
