// The AVX2 path of extend attention: extend_tile.h's loop on 8-lane vectors (head_dim a multiple
// of 8; others take the portable path). Everything after the pragma is built for AVX2 and FMA;
// ops.cpp calls it only where cpuid found them.
#include "common.h"  // RADIXLM_X86: the vector paths are built on x86 only
#if RADIXLM_X86

#include <immintrin.h>

#include <cmath>

#include "avx2.h"
#include "extend.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

namespace radixlm {
namespace {

struct Avx2 {
  using T = __m256;
  static constexpr int L = 8;
  static constexpr int RQ = 6;  // score rows: 12 accumulators, 2 key vectors, a broadcast
  static constexpr int RP = 2;  // value rows x C vectors: 8 accumulators, 4 value vectors
  static constexpr int C = 4;
  static T zero() { return _mm256_setzero_ps(); }
  static T load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, T v) { _mm256_storeu_ps(p, v); }
  static T set1(float x) { return _mm256_set1_ps(x); }
  static T add(T a, T b) { return _mm256_add_ps(a, b); }
  static T sub(T a, T b) { return _mm256_sub_ps(a, b); }
  static T mul(T a, T b) { return _mm256_mul_ps(a, b); }
  static T max(T a, T b) { return _mm256_max_ps(a, b); }
  static T fma(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
  static T exp(T x) { return exp_ps(x); }
  template <class E>
  static T load_kv(const typename E::T* p) { return load8<E>(p); }
  static float hsum(T v) { return radixlm::hsum(v); }
  static float hmax(T v) {
    const __m128 a = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 b = _mm_max_ps(a, _mm_movehl_ps(a, a));
    return _mm_cvtss_f32(_mm_max_ss(b, _mm_movehdup_ps(b)));
  }
};

}  // namespace
}  // namespace radixlm

#include "extend_tile.h"

namespace radixlm {

void attend_sources_avx2(const QueryLayout& x, const KVLayer& kv, const BlockedTask& task, float* scratch,
                         int64_t* positions) {
  attend_sources_typed<Avx2>(x, kv, task, scratch, positions);
}

}  // namespace radixlm

#pragma GCC pop_options

#endif  // RADIXLM_X86
