"""C++ preamble shared by the CPU kernels (ops/cpu_build.py builds them): a 16-float vector
`V` and the few operations the kernels use, as AVX-512, as two AVX2 halves, or as plain
loops where neither is available (correct, slower). Inductor compiles for the host's ISA
(-march=native), so the preprocessor picks the widest one the machine runs."""

SIMD = r"""
#include <cstdint>
#include <cstring>
#include <cmath>
#include <algorithm>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

static inline float f16_to_f32(const uint8_t* p) {
    uint16_t h; std::memcpy(&h, p, 2);
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff, bits;
    if (e == 0) {
        float f = (float)m * (1.0f / 16777216.0f);
        std::memcpy(&bits, &f, 4);
        bits |= sign;
    } else if (e == 31) {
        bits = sign | 0x7f800000u | (m << 13);
    } else {
        bits = sign | ((e + 112) << 23) | (m << 13);
    }
    float f; std::memcpy(&f, &bits, 4); return f;
#endif
}

// n fp16 values (unaligned bytes) -> floats
static inline void halves_to_floats(const uint8_t* src, float* dst, int64_t n) {
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(src + 2 * i))));
#elif defined(__F16C__)
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(src + 2 * i))));
#endif
    for (; i < n; i++) dst[i] = f16_to_f32(src + 2 * i);
}

#if defined(__AVX512F__)
typedef __m512 V;
static inline V vzero() { return _mm512_setzero_ps(); }
static inline V vset(float a) { return _mm512_set1_ps(a); }
static inline V vload(const float* p) { return _mm512_loadu_ps(p); }
static inline void vstore(float* p, V a) { _mm512_storeu_ps(p, a); }
static inline V vadd(V a, V b) { return _mm512_add_ps(a, b); }
static inline V vsub(V a, V b) { return _mm512_sub_ps(a, b); }
static inline V vmul(V a, V b) { return _mm512_mul_ps(a, b); }
static inline V vfma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
static inline float vsum(V a) { return _mm512_reduce_add_ps(a); }
// 16 bytes -> 16 floats: the low nibbles, the high nibbles, signed bytes
static inline V lo_nibbles(const uint8_t* p) {
    __m128i q = _mm_loadu_si128((const __m128i*)p);
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(q, _mm_set1_epi8(15))));
}
static inline V hi_nibbles(const uint8_t* p) {
    __m128i q = _mm_srli_epi16(_mm_loadu_si128((const __m128i*)p), 4);
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(q, _mm_set1_epi8(15))));
}
static inline V signed_bytes(const uint8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
}
static inline void prefetch(const uint8_t* p) { _mm_prefetch((const char*)p, _MM_HINT_T0); }
#elif defined(__AVX2__)
struct V { __m256 a, b; };
static inline V vzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
static inline V vset(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
static inline V vload(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
static inline void vstore(float* p, V x) { _mm256_storeu_ps(p, x.a); _mm256_storeu_ps(p + 8, x.b); }
static inline V vadd(V x, V y) { return {_mm256_add_ps(x.a, y.a), _mm256_add_ps(x.b, y.b)}; }
static inline V vsub(V x, V y) { return {_mm256_sub_ps(x.a, y.a), _mm256_sub_ps(x.b, y.b)}; }
static inline V vmul(V x, V y) { return {_mm256_mul_ps(x.a, y.a), _mm256_mul_ps(x.b, y.b)}; }
static inline V vfma(V x, V y, V z) {
    return {_mm256_fmadd_ps(x.a, y.a, z.a), _mm256_fmadd_ps(x.b, y.b, z.b)};
}
static inline float vsum(V x) {
    float t[8]; _mm256_storeu_ps(t, _mm256_add_ps(x.a, x.b));
    return ((t[0] + t[1]) + (t[2] + t[3])) + ((t[4] + t[5]) + (t[6] + t[7]));
}
static inline V bytes_to_v(__m128i q, bool sign) {
    __m128i hi = _mm_srli_si128(q, 8);
    if (sign) return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)),
                      _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi))};
    return {_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q)),
            _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi))};
}
static inline V lo_nibbles(const uint8_t* p) {
    __m128i q = _mm_loadu_si128((const __m128i*)p);
    return bytes_to_v(_mm_and_si128(q, _mm_set1_epi8(15)), false);
}
static inline V hi_nibbles(const uint8_t* p) {
    __m128i q = _mm_srli_epi16(_mm_loadu_si128((const __m128i*)p), 4);
    return bytes_to_v(_mm_and_si128(q, _mm_set1_epi8(15)), false);
}
static inline V signed_bytes(const uint8_t* p) {
    return bytes_to_v(_mm_loadu_si128((const __m128i*)p), true);
}
static inline void prefetch(const uint8_t* p) { _mm_prefetch((const char*)p, _MM_HINT_T0); }
#else
struct V { float v[16]; };
#define VLOOP(expr) V r; for (int i = 0; i < 16; i++) r.v[i] = (expr); return r;
static inline V vzero() { VLOOP(0.0f) }
static inline V vset(float x) { VLOOP(x) }
static inline V vload(const float* p) { VLOOP(p[i]) }
static inline void vstore(float* p, V x) { for (int i = 0; i < 16; i++) p[i] = x.v[i]; }
static inline V vadd(V x, V y) { VLOOP(x.v[i] + y.v[i]) }
static inline V vsub(V x, V y) { VLOOP(x.v[i] - y.v[i]) }
static inline V vmul(V x, V y) { VLOOP(x.v[i] * y.v[i]) }
static inline V vfma(V x, V y, V z) { VLOOP(std::fma(x.v[i], y.v[i], z.v[i])) }
static inline float vsum(V x) { float s = 0.f; for (int i = 0; i < 16; i++) s += x.v[i]; return s; }
static inline V lo_nibbles(const uint8_t* p) { VLOOP((float)(p[i] & 15)) }
static inline V hi_nibbles(const uint8_t* p) { VLOOP((float)(p[i] >> 4)) }
static inline V signed_bytes(const uint8_t* p) { VLOOP((float)(int8_t)p[i]) }
static inline void prefetch(const uint8_t*) {}
#endif
"""
