// Scalar fp16 / bf16 conversions, the fp32 vector abstraction (VW lanes) and the plain weight
// element types of the CPU kernels (sparse_ffn.cpp). The vector code is chosen at compile time:
// AVX-512F, else AVX2 + FMA + F16C, else portable C++ (an 8-lane struct the compiler may vectorise).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__) && (defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)))
#include <immintrin.h>
#endif

namespace {

// ---- scalar conversions (tails and the portable path) ---------------------------------------
inline float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else {  // subnormal: renormalise
            int e = -1;
            do { ++e; man <<= 1; } while (!(man & 0x400));
            bits = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3ff) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (man << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

inline uint16_t f32_to_f16(float f) {  // round to nearest even
#if defined(__F16C__)
    return (uint16_t)_cvtss_sh(f, 0);
#else
    uint32_t x;
    std::memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000, ax = x & 0x7fffffff;
    if (ax >= 0x7f800000) return (uint16_t)(sign | 0x7c00 | (ax > 0x7f800000 ? 0x200 : 0));
    if (ax >= 0x477ff000) return (uint16_t)(sign | 0x7c00);  // overflow -> inf
    if (ax < 0x38800000) {  // subnormal or zero
        float a;
        std::memcpy(&a, &ax, 4);
        return (uint16_t)(sign | (uint32_t)std::nearbyint(a * 16777216.0f));
    }
    uint32_t r = ax + 0xfff + ((ax >> 13) & 1) - (112u << 23);
    return (uint16_t)(sign | (r >> 13));
#endif
}

inline float bf16_to_f32(uint16_t b) {
    uint32_t bits = (uint32_t)b << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

inline uint16_t f32_to_bf16(float f) {  // round to nearest even, NaN kept NaN
    uint32_t x;
    std::memcpy(&x, &f, 4);
    if ((x & 0x7fffffff) > 0x7f800000) return (uint16_t)((x >> 16) | 0x40);
    return (uint16_t)((x + 0x7fff + ((x >> 16) & 1)) >> 16);
}

// ---- vector abstraction: VW fp32 lanes ------------------------------------------------------
#if defined(__AVX512F__)
constexpr int VW = 16;
typedef __m512 vf;
inline vf vzero() { return _mm512_setzero_ps(); }
inline vf vset1(float a) { return _mm512_set1_ps(a); }
inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, vf v) { _mm512_storeu_ps(p, v); }
inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline float vsum(vf v) { return _mm512_reduce_add_ps(v); }
inline vf vload_f16(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
inline vf vload_bf16(const uint16_t* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
constexpr int VW = 8;
typedef __m256 vf;
inline vf vzero() { return _mm256_setzero_ps(); }
inline vf vset1(float a) { return _mm256_set1_ps(a); }
inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, vf v) { _mm256_storeu_ps(p, v); }
inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
inline float vsum(vf v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_hadd_ps(s, s);
    s = _mm_hadd_ps(s, s);
    return _mm_cvtss_f32(s);
}
inline vf vload_f16(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
inline vf vload_bf16(const uint16_t* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
#else  // portable: an 8-lane struct the compiler may vectorise
constexpr int VW = 8;
struct vf { float v[VW]; };
inline vf vzero() { vf r; for (int i = 0; i < VW; ++i) r.v[i] = 0.f; return r; }
inline vf vset1(float a) { vf r; for (int i = 0; i < VW; ++i) r.v[i] = a; return r; }
inline vf vload(const float* p) { vf r; for (int i = 0; i < VW; ++i) r.v[i] = p[i]; return r; }
inline void vstore(float* p, vf v) { for (int i = 0; i < VW; ++i) p[i] = v.v[i]; }
inline vf vfma(vf a, vf b, vf c) { for (int i = 0; i < VW; ++i) c.v[i] += a.v[i] * b.v[i]; return c; }
inline vf vadd(vf a, vf b) { for (int i = 0; i < VW; ++i) a.v[i] += b.v[i]; return a; }
inline vf vmul(vf a, vf b) { for (int i = 0; i < VW; ++i) a.v[i] *= b.v[i]; return a; }
inline float vsum(vf v) { float s = 0.f; for (int i = 0; i < VW; ++i) s += v.v[i]; return s; }
inline vf vload_f16(const uint16_t* p) { vf r; for (int i = 0; i < VW; ++i) r.v[i] = f16_to_f32(p[i]); return r; }
inline vf vload_bf16(const uint16_t* p) { vf r; for (int i = 0; i < VW; ++i) r.v[i] = bf16_to_f32(p[i]); return r; }
#endif

// Weight element types: a vector load that widens to fp32, and a scalar one for tails. The kernel
// addresses a row by (row start, column): row_load / row_at, and bytes(d) = the byte offset of
// column d (what prefetches use); quantized rows (quant.h) have the same interface.
template <class W>
struct Plain {  // (E = W::T, deduced: W is incomplete where this is declared)
    static constexpr bool QUANT = false;
    template <class E> static int64_t bytes_of(int64_t d) { return d * (int64_t)sizeof(E); }
    template <class E> static vf row_load(const E* row, int64_t d) { return W::load(row + d); }
    template <class E> static float row_at(const E* row, int64_t d) { return W::at(row + d); }
};
struct WF32 : Plain<WF32> {
    typedef float T;
    static int64_t bytes(int64_t d) { return bytes_of<T>(d); }
    static vf load(const T* p) { return vload(p); }
    static float at(const T* p) { return *p; }
};
struct WF16 : Plain<WF16> {
    typedef uint16_t T;
    static int64_t bytes(int64_t d) { return bytes_of<T>(d); }
    static vf load(const T* p) { return vload_f16(p); }
    static float at(const T* p) { return f16_to_f32(*p); }
};
struct WBF16 : Plain<WBF16> {
    typedef uint16_t T;
    static int64_t bytes(int64_t d) { return bytes_of<T>(d); }
    static vf load(const T* p) { return vload_bf16(p); }
    static float at(const T* p) { return bf16_to_f32(*p); }
};

}  // namespace
