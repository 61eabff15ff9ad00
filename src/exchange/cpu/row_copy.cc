#include "exchange/cpu/row_copy.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

#include <unistd.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace epx::detail {
namespace {

constexpr std::size_t kMaxCacheBytes = std::size_t{32} << 20;

std::size_t last_level_cache_bytes() {
  static const std::size_t bytes = [] {
    const long l3 = sysconf(_SC_LEVEL3_CACHE_SIZE);
    return l3 > 0 ? std::min(static_cast<std::size_t>(l3), kMaxCacheBytes) : kMaxCacheBytes;
  }();
  return bytes;
}

#if defined(__x86_64__)
// 64-byte lines of dst (aligned), four per iteration.
__attribute__((target("avx512f"))) void stream_lines_avx512(std::byte* dst, const std::byte* src, std::size_t lines) {
  for (std::size_t i = 0; i < lines; ++i) {
    const __m512i v = _mm512_loadu_si512(src + i * 64);
    _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + i * 64), v);
  }
}

__attribute__((target("avx2"))) void stream_lines_avx2(std::byte* dst, const std::byte* src, std::size_t lines) {
  for (std::size_t i = 0; i < lines; ++i) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i * 64));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i * 64 + 32));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i * 64), a);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i * 64 + 32), b);
  }
}

void stream_lines_sse2(std::byte* dst, const std::byte* src, std::size_t lines) {
  for (std::size_t i = 0; i < lines * 4; ++i)
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i * 16),
                     _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i * 16)));
}

// The widest version this CPU runs, picked once.
void stream_lines(std::byte* dst, const std::byte* src, std::size_t lines) {
  using Fn = void (*)(std::byte*, const std::byte*, std::size_t);
  static const Fn fn = [] {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) return Fn{stream_lines_avx512};
    if (__builtin_cpu_supports("avx2")) return Fn{stream_lines_avx2};
    return Fn{stream_lines_sse2};
  }();
  fn(dst, src, lines);
}
#endif

}  // namespace

RowStores row_stores_for(std::size_t bytes_written) {
  return bytes_written > last_level_cache_bytes() ? RowStores::kStreamed : RowStores::kCached;
}

void copy_row(std::byte* dst, const std::byte* src, std::size_t bytes, RowStores stores) {
#if defined(__x86_64__)
  if (stores == RowStores::kStreamed && bytes >= 256) {
    // The unaligned head and the tail go through the cache.
    const std::size_t head = (64 - reinterpret_cast<std::uintptr_t>(dst) % 64) % 64;
    const std::size_t lines = (bytes - head) / 64;
    std::memcpy(dst, src, head);
    stream_lines(dst + head, src + head, lines);
    const std::size_t done = head + lines * 64;
    std::memcpy(dst + done, src + done, bytes - done);
    return;
  }
#endif
  (void)stores;
  std::memcpy(dst, src, bytes);
}

void finish_streamed_rows() {
#if defined(__x86_64__)
  _mm_sfence();
#endif
}

}  // namespace epx::detail
