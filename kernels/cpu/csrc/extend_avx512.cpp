// The AVX-512 path of extend attention: extend_tile.h's loop on 16-lane vectors (head_dim a
// multiple of 16). Everything after the pragma is built for AVX-512 F; ops.cpp calls it only
// where cpuid found the avx512 level's features. Its exp is the AVX2 path's, lane for lane.
#include "common.h"  // RADIXLM_X86: the vector paths are built on x86 only
#if RADIXLM_X86

#include <immintrin.h>

#include <cmath>

#include "avx2.h"
#include "extend.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f")

namespace radixlm {
namespace {

struct Avx512 {
  using T = __m512;
  static constexpr int L = 16;
  static constexpr int RQ = 12;  // score rows: 24 accumulators, 2 key vectors, a broadcast
  static constexpr int RP = 4;   // value rows x C vectors: 16 accumulators, 4 value vectors
  static constexpr int C = 4;
  static T zero() { return _mm512_setzero_ps(); }
  static T load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, T v) { _mm512_storeu_ps(p, v); }
  static T set1(float x) { return _mm512_set1_ps(x); }
  static T add(T a, T b) { return _mm512_add_ps(a, b); }
  static T sub(T a, T b) { return _mm512_sub_ps(a, b); }
  static T mul(T a, T b) { return _mm512_mul_ps(a, b); }
  static T max(T a, T b) { return _mm512_max_ps(a, b); }
  static T fma(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
  static float hsum(T v) { return _mm512_reduce_add_ps(v); }
  static float hmax(T v) { return _mm512_reduce_max_ps(v); }
  template <class E>
  static T load_kv(const typename E::T* p) {  // L elements of a pool row as fp32, exactly (as avx2.h's load8)
    if constexpr (std::is_same_v<E, F16>) {
      return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    } else if constexpr (std::is_same_v<E, BF16>) {
      const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
      return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
    } else if constexpr (std::is_same_v<E, I8>) {
      return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
    } else {
      return _mm512_loadu_ps(p);
    }
  }
  // exp as avx2.h's exp_ps: x = k ln2 + r, a degree-6 polynomial in r, times 2^k
  static T exp(T x) {
    x = _mm512_min_ps(_mm512_max_ps(x, set1(-87.3f)), set1(88.7f));
    const T k = _mm512_roundscale_ps(_mm512_mul_ps(x, set1(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    T r = _mm512_fnmadd_ps(k, set1(0.693359375f), x);
    r = _mm512_fnmadd_ps(k, set1(-2.12194440e-4f), r);
    T p = set1(1.0f / 720);
    p = fma(p, r, set1(1.0f / 120));
    p = fma(p, r, set1(1.0f / 24));
    p = fma(p, r, set1(1.0f / 6));
    p = fma(p, r, set1(0.5f));
    p = fma(p, r, set1(1.0f));
    p = fma(p, r, set1(1.0f));
    const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(k), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
  }
};

}  // namespace
}  // namespace radixlm

#include "extend_tile.h"

namespace radixlm {

void attend_sources_avx512(const QueryLayout& x, const KVLayer& kv, const BlockedTask& task, float* scratch,
                           int64_t* positions) {
  attend_sources_typed<Avx512>(x, kv, task, scratch, positions);
}

}  // namespace radixlm

#pragma GCC pop_options

#endif  // RADIXLM_X86
