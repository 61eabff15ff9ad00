// The GEMM behind the experts: oneDNN's matmul with every size and leading
// dimension given at run time, so one primitive per (dtype, transposes,
// accumulate, threads) serves every expert and every token count.
#pragma once

#include <cstdint>
#include <memory>

#include "epx/core/dtype.h"
#include "epx/core/status.h"

namespace epx::detail {

struct PackedB;  // a B operand in oneDNN's own layout (pack_b)

// Row-major operands. A is [m, k] (or, with trans_a, stored as [k, m]); B is
// [k, n] (or stored as [n, k]); both of `dtype` (f32 or bf16). C is f32 [m, n]:
// C = A B, or C += A B with `accumulate`. Products are accumulated in fp32.
struct GemmArgs {
  DType dtype = DType::kF32;
  bool trans_a = false;
  bool trans_b = false;
  bool accumulate = false;
  int64_t m = 0, n = 0, k = 0;
  const void* a = nullptr;
  int64_t lda = 0;
  const void* b = nullptr;
  int64_t ldb = 0;
  void* c = nullptr;               // [m, n] of c_dtype
  int64_t ldc = 0;
  DType c_dtype = DType::kF32;     // kF32, or kBF16 (oneDNN rounds the f32 sums once; not with accumulate)
  // B packed by pack_b from this b (same dtype, trans_b, k, n), or null.
  // The call then reads the packed copy and not b.
  const PackedB* packed_b = nullptr;
};

// Runs on `num_threads` threads (1: the calling thread only). Safe to call
// from several threads at once. Fails with Internal if oneDNN does.
//
// Row-invariant (A not transposed): each row of C gets the same bits
// whatever the number of rows m of the call, so a batch computed in chunks
// gives the bits of the whole batch (MoELayer's overlap modes rely on it).
// oneDNN's matmul picks its kernel by m, and kernels for different m may sum
// in different orders (seen for m < 16 with B transposed); so the rows go in
// blocks of kRowBlock: the whole blocks in one call, the last partial block
// zero-padded to a whole one. With the same thread count, tests/experts
// checks that any split of the rows gives the same bits.
inline constexpr int64_t kRowBlock = 16;
[[nodiscard]] Status gemm(const GemmArgs& args, int num_threads);

// B packed once into the layout oneDNN's fixed-size kernels read, for a B
// that many calls reuse (an expert's weights): a call with it skips
// oneDNN's per-call rearrangement of B, which costs about as much as
// streaming B once. bf16 only: there it gives the plain calls' bits (tests/experts
// check it, at any split of the rows), where f32 gives other bits. Calls
// with it run a fixed-size primitive per (rows, leading dimensions,
// accumulate), made once and kept. The packed copy does not follow later
// writes to b: pack again after them. InvalidArgument for f32 or bad sizes;
// FailedPrecondition where oneDNN would read B in another layout for some
// row count (checked when packing up to 1024 rows, and at every call: such a
// call fails rather than read the plain b, so a row's bits never depend on
// the path); Internal if oneDNN fails.
[[nodiscard]] Result<std::shared_ptr<const PackedB>> pack_b(DType dtype, bool trans_b, int64_t k, int64_t n,
                                                            const void* b, int64_t ldb);
// The same into *into, refilling its memory in place when *into has the
// same layout and nothing else holds it (repacking after each weight update
// then touches no fresh pages).
[[nodiscard]] Status pack_b(DType dtype, bool trans_b, int64_t k, int64_t n, const void* b, int64_t ldb,
                            std::shared_ptr<PackedB>* into);

// How many calls have read a packed B so far, in this process (for tests:
// proof that the packed path ran rather than the plain fallback).
[[nodiscard]] int64_t packed_gemm_calls();

// Sets the calling thread's OpenMP thread count (what oneDNN uses) for a
// scope and restores it after.
class ScopedOmpThreads {
 public:
  explicit ScopedOmpThreads(int num_threads);
  ~ScopedOmpThreads();
  ScopedOmpThreads(const ScopedOmpThreads&) = delete;
  ScopedOmpThreads& operator=(const ScopedOmpThreads&) = delete;

 private:
  int saved_;
};

// Whether oneDNN's bf16 GEMM outruns its f32 one on this CPU, by a fixed
// rule: with AVX512-BF16 dot products, yes on AMD and no on Intel; with AMX
// tiles, yes (assumed); without either, no (oneDNN widens bf16 to f32 inside
// its kernels). Follows ONEDNN_MAX_CPU_ISA. The measurements behind it:
// docs/performance.md, "The MoE layer against the GEMM library".
[[nodiscard]] bool bf16_gemm_beats_f32();
// The rule itself: `onednn_isa` a dnnl_cpu_isa_t mask, `amd` the vendor.
[[nodiscard]] bool bf16_gemm_beats_f32(int onednn_isa, bool amd);

// The number of cores the process may run on (omp_get_num_procs).
[[nodiscard]] int available_cores();

}  // namespace epx::detail
