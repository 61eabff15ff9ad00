#include "experts/gemm.h"

#include <omp.h>

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>
#include <vector>
#include <cstring>

#include <oneapi/dnnl/dnnl.hpp>

namespace epx::detail {
namespace {

using dnnl::memory;
constexpr memory::dim kRt = DNNL_RUNTIME_DIM_VAL;

dnnl::engine& cpu_engine() {
  static dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  return engine;
}

memory::data_type to_dnnl(DType dtype) {
  return dtype == DType::kBF16 ? memory::data_type::bf16 : memory::data_type::f32;
}

// [rows, cols] with runtime sizes; `transposed` = stored column-major.
memory::desc runtime_desc(memory::data_type type, bool transposed) {
  return memory::desc({kRt, kRt}, type, transposed ? memory::dims{1, kRt} : memory::dims{kRt, 1});
}
memory::desc actual_desc(memory::data_type type, int64_t rows, int64_t cols, int64_t ld, bool transposed) {
  return memory::desc({rows, cols}, type, transposed ? memory::dims{1, ld} : memory::dims{ld, 1});
}

struct Primitive {
  dnnl::matmul::primitive_desc pd;
  dnnl::matmul matmul;
  std::size_t scratchpad_bytes = 0;
};

using Key = std::tuple<DType, bool, bool, bool, int, DType>;

// Primitives are built once per key (a few hundred microseconds each) and
// then shared: oneDNN primitives may execute concurrently, and each call
// brings its own scratchpad.
Result<std::shared_ptr<const Primitive>> primitive_for(const GemmArgs& args, int num_threads) {
  static std::mutex mutex;
  static std::map<Key, std::shared_ptr<const Primitive>> cache;
  const Key key{args.dtype, args.trans_a, args.trans_b, args.accumulate, num_threads, args.c_dtype};
  std::lock_guard<std::mutex> lock(mutex);
  if (auto it = cache.find(key); it != cache.end()) return it->second;
  const auto type = to_dnnl(args.dtype);
  dnnl::primitive_attr attr;
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  if (args.accumulate) {
    dnnl::post_ops ops;
    ops.append_sum(1.0f);
    attr.set_post_ops(ops);
  }
  dnnl::matmul::desc desc(runtime_desc(type, args.trans_a), runtime_desc(type, args.trans_b),
                          runtime_desc(to_dnnl(args.c_dtype), false));
  auto primitive = std::make_shared<Primitive>();
  primitive->pd = dnnl::matmul::primitive_desc(desc, attr, cpu_engine());
  primitive->matmul = dnnl::matmul(primitive->pd);
  primitive->scratchpad_bytes = primitive->pd.scratchpad_desc().get_size();
  cache.emplace(key, primitive);
  return std::shared_ptr<const Primitive>(primitive);
}

// Runs `primitive` on a, b, c on the calling thread's stream, with a kept
// per-thread scratchpad: a call costs tens of microseconds less without a
// fresh stream and scratchpad (it matters for the many small GEMMs of
// chunked experts).
void execute(const Primitive& primitive, const dnnl::memory& a, const dnnl::memory& b, const dnnl::memory& c) {
  auto& engine = cpu_engine();
  thread_local std::vector<std::byte> scratch;
  if (scratch.size() < primitive.scratchpad_bytes) scratch.resize(primitive.scratchpad_bytes);
  memory scratchpad(primitive.pd.scratchpad_desc(), engine, scratch.data());
  thread_local dnnl::stream stream(engine);
  primitive.matmul.execute(stream, {{DNNL_ARG_SRC, a}, {DNNL_ARG_WEIGHTS, b}, {DNNL_ARG_DST, c}, {DNNL_ARG_SCRATCHPAD, scratchpad}});
  stream.wait();
}

Status gemm_call(const GemmArgs& args, int num_threads);

}  // namespace

struct PackedB {
  bool trans_b = false;
  int64_t k = 0, n = 0;
  memory::desc desc;
  std::unique_ptr<std::byte[]> data;  // desc.get_size() bytes, not zeroed (the reorder writes them all)
};

namespace {

// A bf16 matmul with every size fixed (m rows) reading B as oneDNN lays it out.
dnnl::matmul::primitive_desc packed_desc(int64_t m, int64_t k, int64_t n, int64_t lda, int64_t ldc, bool accumulate,
                                         DType c_dtype) {
  dnnl::primitive_attr attr;
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  if (accumulate) {
    dnnl::post_ops ops;
    ops.append_sum(1.0f);
    attr.set_post_ops(ops);
  }
  const auto bf16 = memory::data_type::bf16;
  dnnl::matmul::desc desc(memory::desc({m, k}, bf16, {lda, 1}), memory::desc({k, n}, bf16, memory::format_tag::any),
                          memory::desc({m, n}, to_dnnl(c_dtype), {ldc, 1}));
  return dnnl::matmul::primitive_desc(desc, attr, cpu_engine());
}

// The layout oneDNN reads a [k, n] bf16 B in, the same for every multiple of
// kRowBlock rows up to kCheckedRows (else FailedPrecondition); kept per (k, n).
constexpr int64_t kCheckedRows = 1024;
Result<memory::desc> packed_layout(int64_t k, int64_t n) {
  static std::mutex mutex;
  static std::map<std::pair<int64_t, int64_t>, memory::desc> layouts;
  std::lock_guard<std::mutex> lock(mutex);
  if (auto it = layouts.find({k, n}); it != layouts.end()) return it->second;
  const memory::desc layout = packed_desc(kRowBlock, k, n, k, n, false, DType::kF32).weights_desc();
  for (int64_t m = 2 * kRowBlock; m <= kCheckedRows; m += kRowBlock)
    if (packed_desc(m, k, n, k, n, false, DType::kF32).weights_desc() != layout)
      return failed_precondition("oneDNN reads a packed [{}, {}] bf16 B in another layout for {} rows than for {}: "
                                 "these weights cannot be packed; use the plain ones",
                                 k, n, m, kRowBlock);
  layouts.emplace(std::make_pair(k, n), layout);
  return layout;
}

using PackedKey = std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, bool, DType, int>;

// The fixed-size primitive for one call with packed B, made once per key.
// FailedPrecondition where oneDNN wants B in another layout for this call:
// never the plain B instead, since a row's bits must not depend on which
// of the two its call read.
Result<std::shared_ptr<const Primitive>> packed_primitive_for(const GemmArgs& args, int num_threads) {
  static std::mutex mutex;
  static std::map<PackedKey, std::shared_ptr<const Primitive>> cache;
  const PackedKey key{args.m, args.k, args.n, args.lda, args.ldc, args.accumulate, args.c_dtype, num_threads};
  std::lock_guard<std::mutex> lock(mutex);
  if (auto it = cache.find(key); it != cache.end()) return it->second;
  auto primitive = std::make_shared<Primitive>();
  primitive->pd = packed_desc(args.m, args.k, args.n, args.lda, args.ldc, args.accumulate, args.c_dtype);
  if (primitive->pd.weights_desc() != args.packed_b->desc)
    return failed_precondition("oneDNN reads the packed [{}, {}] B in another layout for a call of {} rows (lda {}, "
                               "ldc {}{}): use the plain weights",
                               args.k, args.n, args.m, args.lda, args.ldc, args.accumulate ? ", accumulating" : "");
  primitive->matmul = dnnl::matmul(primitive->pd);
  primitive->scratchpad_bytes = primitive->pd.scratchpad_desc().get_size();
  cache.emplace(key, primitive);
  return std::shared_ptr<const Primitive>(primitive);
}

std::atomic<int64_t> packed_calls{0};

// One oneDNN matmul of the whole of `args`, B packed.
Status packed_gemm_call(const GemmArgs& args, int num_threads) {
  const PackedB& packed = *args.packed_b;
  if (args.dtype != DType::kBF16 || args.trans_a || packed.k != args.k || packed.n != args.n ||
      packed.trans_b != args.trans_b)
    return invalid_argument("a packed [{}, {}] B{} does not fit a {} GEMM [{}, {}] x [{}, {}]{}{}", packed.k, packed.n,
                            packed.trans_b ? " (transposed)" : "", dtype_name(args.dtype), args.m, args.k, args.k,
                            args.n, args.trans_a ? ", A transposed" : "", args.trans_b ? ", B transposed" : "");
  ScopedOmpThreads threads(num_threads);
  EPX_ASSIGN_OR_RETURN(auto primitive, packed_primitive_for(args, num_threads));
  auto& engine = cpu_engine();
  memory a(primitive->pd.src_desc(), engine, const_cast<void*>(args.a));
  memory b(packed.desc, engine, packed.data.get());
  memory c(primitive->pd.dst_desc(), engine, args.c);
  execute(*primitive, a, b, c);
  packed_calls.fetch_add(1, std::memory_order_relaxed);
  return Status::ok();
}

}  // namespace

int64_t packed_gemm_calls() { return packed_calls.load(std::memory_order_relaxed); }

Status pack_b(DType dtype, bool trans_b, int64_t k, int64_t n, const void* b, int64_t ldb,
              std::shared_ptr<PackedB>* into) {
  if (dtype != DType::kBF16)
    return invalid_argument("pack_b packs bf16 B operands only (packed f32 gives other bits than the plain calls), "
                            "got {}", dtype_name(dtype));
  if (k <= 0 || n <= 0) return invalid_argument("pack_b needs k = {} and n = {} positive", k, n);
  if (ldb < (trans_b ? k : n))
    return invalid_argument("ldb = {} is below the row length {} of B", ldb, trans_b ? k : n);
  try {
    EPX_ASSIGN_OR_RETURN(const memory::desc layout, packed_layout(k, n));
    // Refilled in place when nothing else holds it: touching fresh pages can
    // cost more than the reorder itself.
    std::shared_ptr<PackedB>& packed = *into;
    if (packed == nullptr || packed.use_count() != 1 || packed->desc != layout) {
      packed = std::make_shared<PackedB>();
      packed->desc = layout;
      packed->data.reset(new std::byte[layout.get_size()]);
    }
    packed->trans_b = trans_b, packed->k = k, packed->n = n;
    auto& engine = cpu_engine();
    const auto bf16 = memory::data_type::bf16;
    memory plain(memory::desc({k, n}, bf16, trans_b ? memory::dims{1, ldb} : memory::dims{ldb, 1}), engine,
                 const_cast<void*>(b));
    memory packed_memory(layout, engine, packed->data.get());
    dnnl::stream stream(engine);
    dnnl::reorder(plain, packed_memory).execute(stream, plain, packed_memory);
    stream.wait();
    return Status::ok();
  } catch (const dnnl::error& e) {
    return internal_error("packing a [{}, {}] bf16 B failed: {} (status {})", k, n, e.what(), static_cast<int>(e.status));
  }
}

Result<std::shared_ptr<const PackedB>> pack_b(DType dtype, bool trans_b, int64_t k, int64_t n, const void* b,
                                              int64_t ldb) {
  std::shared_ptr<PackedB> packed;
  EPX_RETURN_IF_ERROR(pack_b(dtype, trans_b, k, n, b, ldb, &packed));
  return std::shared_ptr<const PackedB>(std::move(packed));
}

Status gemm(const GemmArgs& args, int num_threads) {
  if (args.m == 0 || args.n == 0) return Status::ok();
  if (args.trans_a || args.m % kRowBlock == 0) return gemm_call(args, num_threads);
  const int64_t whole = args.m / kRowBlock * kRowBlock, tail = args.m - whole;
  if (whole > 0) {
    GemmArgs head = args;
    head.m = whole;
    EPX_RETURN_IF_ERROR(gemm_call(head, num_threads));
  }
  // The last rows, zero-padded to one whole block (C too, for accumulate).
  const std::size_t elem = dtype_size(args.dtype), c_elem = dtype_size(args.c_dtype);
  const std::size_t c_row = static_cast<std::size_t>(args.n) * c_elem;
  thread_local std::vector<std::byte> a;
  thread_local std::vector<std::byte> c;
  a.assign(static_cast<std::size_t>(kRowBlock * args.k) * elem, std::byte{0});
  c.assign(static_cast<std::size_t>(kRowBlock) * c_row, std::byte{0});
  const auto* a_rows = static_cast<const std::byte*>(args.a) + static_cast<std::size_t>(whole * args.lda) * elem;
  auto* c_rows = static_cast<std::byte*>(args.c) + static_cast<std::size_t>(whole * args.ldc) * c_elem;
  const std::size_t ldc_bytes = static_cast<std::size_t>(args.ldc) * c_elem;
  for (int64_t r = 0; r < tail; ++r) {
    std::memcpy(a.data() + static_cast<std::size_t>(r * args.k) * elem, a_rows + static_cast<std::size_t>(r * args.lda) * elem,
                static_cast<std::size_t>(args.k) * elem);
    if (args.accumulate) std::memcpy(c.data() + r * c_row, c_rows + r * ldc_bytes, c_row);
  }
  GemmArgs last = args;
  last.m = kRowBlock, last.a = a.data(), last.lda = args.k, last.c = c.data(), last.ldc = args.n;
  EPX_RETURN_IF_ERROR(gemm_call(last, num_threads));
  for (int64_t r = 0; r < tail; ++r) std::memcpy(c_rows + r * ldc_bytes, c.data() + r * c_row, c_row);
  return Status::ok();
}

namespace {

// One oneDNN matmul of the whole of `args`.
Status gemm_call(const GemmArgs& args, int num_threads) {
  try {
    if (args.packed_b != nullptr) return packed_gemm_call(args, num_threads);
    ScopedOmpThreads threads(num_threads);
    EPX_ASSIGN_OR_RETURN(auto primitive, primitive_for(args, num_threads));
    const auto type = to_dnnl(args.dtype);
    auto& engine = cpu_engine();
    memory a(actual_desc(type, args.m, args.k, args.lda, args.trans_a), engine, const_cast<void*>(args.a));
    memory b(actual_desc(type, args.k, args.n, args.ldb, args.trans_b), engine, const_cast<void*>(args.b));
    memory c(actual_desc(to_dnnl(args.c_dtype), args.m, args.n, args.ldc, false), engine, args.c);
    execute(*primitive, a, b, c);
  } catch (const dnnl::error& e) {
    return internal_error("oneDNN matmul [{}, {}] x [{}, {}] ({}{}{}) failed: {} (status {})", args.m, args.k, args.k,
                          args.n, dtype_name(args.dtype), args.trans_a ? ", A transposed" : "",
                          args.trans_b ? ", B transposed" : "", e.what(), static_cast<int>(e.status));
  }
  return Status::ok();
}

}  // namespace

ScopedOmpThreads::ScopedOmpThreads(int num_threads) : saved_(omp_get_max_threads()) {
  if (num_threads != saved_) omp_set_num_threads(num_threads);
}
ScopedOmpThreads::~ScopedOmpThreads() {
  if (omp_get_max_threads() != saved_) omp_set_num_threads(saved_);
}

bool bf16_gemm_beats_f32(int onednn_isa, bool amd) {
  const auto has = [onednn_isa](int isa) { return (onednn_isa & isa) == isa; };
  if (has(dnnl_cpu_isa_avx512_core_amx)) return true;
  return has(dnnl_cpu_isa_avx512_core_bf16) && amd;
}

bool bf16_gemm_beats_f32() {
  bool amd = false;
#if defined(__x86_64__)
  __builtin_cpu_init();
  amd = __builtin_cpu_is("amd");
#endif
  return bf16_gemm_beats_f32(static_cast<int>(dnnl::get_effective_cpu_isa()), amd);
}

int available_cores() { return omp_get_num_procs(); }

}  // namespace epx::detail
