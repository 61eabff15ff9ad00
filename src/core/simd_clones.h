// Private: EPX_SIMD_CLONES marks a hot loop to be compiled in AVX-512, AVX2
// and baseline versions, one of which the loader picks for this CPU (GCC's
// target_clones, through an ifunc resolver). Callers keep the loops free of
// FMA contraction and reassociation, so every version gives the same bits.
//
// The AVX-512 clone is built for x86-64-v4 (AVX512F/BW/CD/DQ/VL), not plain
// avx512f: without BW/VL GCC handles 8- and 16-bit elements in 256-bit
// registers with spills, and the fp8 loops (8/16/32-bit conversions) ran
// 2-2.4x slower so built (AMD EPYC; docs/benchmarks.md, "fp8 in the layer").
//
// ThreadSanitizer's runtime is not up yet when ifunc resolvers run, and a
// TSan build crashed at start, so under -fsanitize=thread the loops are
// compiled once, for the baseline.
#pragma once

#if defined(__SANITIZE_THREAD__)
#define EPX_SIMD_CLONES
#else
#define EPX_SIMD_CLONES __attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
#endif
