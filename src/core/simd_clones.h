// Private: EPX_SIMD_CLONES marks a hot loop to be compiled in AVX-512, AVX2
// and baseline versions, one of which the loader picks for this CPU (GCC's
// target_clones, through an ifunc resolver). Callers keep the loops free of
// FMA contraction and reassociation, so every version gives the same bits.
//
// ThreadSanitizer's runtime is not up yet when ifunc resolvers run, and a
// TSan build crashed at start, so under -fsanitize=thread the loops are
// compiled once, for the baseline.
#pragma once

#if defined(__SANITIZE_THREAD__)
#define EPX_SIMD_CLONES
#else
#define EPX_SIMD_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#endif
