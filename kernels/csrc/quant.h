// ggml's Q4_0 and Q8_0 block formats for the CPU kernels (sparse_ffn.cpp): the weight row types,
// the Q8_0 quantizer of the activation and the integer dot of one step of blocks.
//
// A quantized row is n_cols / 32 blocks, each an f16 scale d then the weights:
//   Q4_0 (18 bytes): 16 bytes, byte i holds element i in its low nibble and element i + 16 in its
//        high nibble; value = (nibble - 8) * d.
//   Q8_0 (34 bytes): 32 int8 q; value = q * d.
// Dot products follow ggml (vec_dot_q4_0_q8_0, vec_dot_q8_0_q8_0): the activation is quantized
// to Q8_0 once per call (quantize_row_q8, ggml's reference rounding), each block's integer dot is
// exact, and sum_b d_w[b] * d_x[b] * isum[b] accumulates in fp32. Q4_0's integer dot takes the
// nibbles as they are (0..15, unsigned) and starts from -8 * sum(x's block), which the activation
// carries (xq_offsets): sum((n - 8) * x) without the sign juggling a signed weight needs. The down
// projection dequantizes (row_load) and accumulates in fp32 like the plain types.
//
// Integer vector code, chosen at compile time: AVX-512F + BW (two blocks per step; VNNI's dpbusd
// when present, else maddubs + madd), else AVX2 + FMA (one block per step), else scalar C++.
#pragma once

#include "simd.h"

namespace {

constexpr int QK = 32;  // weights per block

inline float f16_bits_at(const uint8_t* p) {  // the f16 at p (any alignment) as fp32
    uint16_t h;
    std::memcpy(&h, p, 2);
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    return f16_to_f32(h);
#endif
}

// ---- the integer step: QB blocks of 32 int8 (qi) against QB blocks of x, into fp32 lanes (qf) ----
#if defined(__AVX512F__) && defined(__AVX512BW__)
constexpr int QB = 2;
typedef __m512i qi;
typedef __m512 qf;
inline qf qf_zero() { return _mm512_setzero_ps(); }
inline qf qf_mul(qf a, qf b) { return _mm512_mul_ps(a, b); }
inline float qf_sum(qf v) { return _mm512_reduce_add_ps(v); }
inline qf qf_scales(float a, float b) { return _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(a), _mm512_set1_ps(b)); }
inline qi qi_join(__m256i a, __m256i b) { return _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1); }
inline qi qi_load(const int8_t* p) { return _mm512_loadu_si512((const void*)p); }
inline qi qi_load_tail(const int8_t* p) {
    return qi_join(_mm256_loadu_si256((const __m256i*)p), _mm256_setzero_si256());
}
// acc + dd * (w . x per lane): lanes 0-7 hold block 0's partial sums, lanes 8-15 block 1's.
inline qf qdot_acc(qi w, qi x, qf dd, qf acc) {
    const qi aw = _mm512_abs_epi8(w);
    const qi sx = _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(w), _mm512_setzero_si512(), x);  // sign of w moved to x
#if defined(__AVX512VNNI__)
    const qi s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), aw, sx);
#else
    const qi s = _mm512_madd_epi16(_mm512_maddubs_epi16(aw, sx), _mm512_set1_epi16(1));
#endif
    return _mm512_fmadd_ps(dd, _mm512_cvtepi32_ps(s), acc);
}
// The same for unsigned weights w (Q4_0's nibbles): acc + dd * (off + w . x per lane).
inline qf qdot_acc_u(qi w, qi x, qi off, qf dd, qf acc) {
#if defined(__AVX512VNNI__)
    const qi s = _mm512_dpbusd_epi32(off, w, x);
#else
    const qi s = _mm512_add_epi32(_mm512_madd_epi16(_mm512_maddubs_epi16(w, x), _mm512_set1_epi16(1)), off);
#endif
    return _mm512_fmadd_ps(dd, _mm512_cvtepi32_ps(s), acc);
}
#define PI_QSIMD 1
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int QB = 1;
typedef __m256i qi;
typedef __m256 qf;
inline qf qf_zero() { return _mm256_setzero_ps(); }
inline qf qf_mul(qf a, qf b) { return _mm256_mul_ps(a, b); }
inline float qf_sum(qf v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_hadd_ps(s, s);
    s = _mm_hadd_ps(s, s);
    return _mm_cvtss_f32(s);
}
inline qf qf_scales(float a, float) { return _mm256_set1_ps(a); }
inline qi qi_load(const int8_t* p) { return _mm256_loadu_si256((const __m256i*)p); }
inline qf qdot_acc(qi w, qi x, qf dd, qf acc) {
    const qi s = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w)),
                                   _mm256_set1_epi16(1));
    return _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(s), acc);
}
inline qf qdot_acc_u(qi w, qi x, qi off, qf dd, qf acc) {
    const qi s = _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)), off);
    return _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(s), acc);
}
#define PI_QSIMD 1
#else
constexpr int QB = 1;
struct qi { int8_t v[QK]; };
typedef float qf;
inline qf qf_zero() { return 0.f; }
inline qf qf_mul(qf a, qf b) { return a * b; }
inline float qf_sum(qf v) { return v; }
inline qf qf_scales(float a, float) { return a; }
inline qi qi_load(const int8_t* p) { qi r; std::memcpy(r.v, p, QK); return r; }
inline qf qdot_acc(const qi& w, const qi& x, qf dd, qf acc) {
    int32_t s = 0;
    for (int i = 0; i < QK; ++i) s += (int32_t)w.v[i] * x.v[i];
    return acc + dd * (float)s;
}
#endif

// ---- weight rows: unpack QB blocks to int8 (the dots), dequantize VW values (the axpy) -----------
template <class Q>
struct QuantRow {
    typedef uint8_t T;
    static constexpr bool QUANT = true;
    static constexpr bool OFFSET = false;  // the integer dot on unsigned weights plus x's offsets (Q4_0)
    static int64_t bytes(int64_t d) { return d / QK * Q::BB; }
    static float scale(const T* row, int64_t b) { return f16_bits_at(row + b * Q::BB); }
    // out[i] = mul x the scale of block b + i, i < nb <= 16
    static void scales_times(const T* row, int64_t b, int nb, float mul, float* out) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
        if (nb == 16) {
            // block i's scale is f16 word i BB / 2 of the run: G blocks' words at a time from 128 bytes
            // (two loads, one two-source permute into lanes j .. j + G - 1; the run's last load ends
            // at its 16th block's quants, inside the row)
            constexpr int G = 63 / (Q::BB / 2) + 1;
            static_assert((16 - G) * Q::BB + 128 <= 16 * Q::BB, "a block run's loads stay inside it");
            const __m512i word = _mm512_mullo_epi16(
                _mm512_set_epi16(31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17, 16, 15, 14, 13, 12, 11,
                                 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), _mm512_set1_epi16(Q::BB / 2));
            const uint8_t* p = row + b * Q::BB;
            __m512i w = _mm512_setzero_si512();
            for (int j = 0; j < 16; j += G) {
                const __m512i lo = _mm512_loadu_si512((const void*)(p + j * Q::BB));
                const __m512i hi = _mm512_loadu_si512((const void*)(p + j * Q::BB + 64));
                const __m512i at = _mm512_sub_epi16(word, _mm512_set1_epi16((short)(j * Q::BB / 2)));
                w = _mm512_mask_mov_epi16(w, (__mmask32)(((1u << G) - 1) << j), _mm512_permutex2var_epi16(lo, at, hi));
            }
            _mm512_storeu_ps(out, _mm512_mul_ps(_mm512_cvtph_ps(_mm512_castsi512_si256(w)), _mm512_set1_ps(mul)));
            return;
        }
#endif
        for (int i = 0; i < nb; ++i) out[i] = mul * scale(row, b + i);
    }
    static qf scales(const T* row, int64_t b) {  // blocks b .. b+QB-1 (QB = 2: b+1 must exist)
        return qf_scales(scale(row, b), QB > 1 ? scale(row, b + 1) : 0.f);
    }
#if defined(PI_QSIMD)
    static qi unpack(const T* row, int64_t b) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
        return qi_join(Q::block(row + b * Q::BB), Q::block(row + (b + 1) * Q::BB));
#else
        return Q::block(row + b * Q::BB);
#endif
    }
#if defined(__AVX512F__) && defined(__AVX512BW__)
    static qi unpack_tail(const T* row, int64_t b) {
        return qi_join(Q::block(row + b * Q::BB), _mm256_setzero_si256());
    }
#endif
#else
    static qi unpack(const T* row, int64_t b) {
        qi r;
        for (int i = 0; i < QK; ++i) r.v[i] = (int8_t)Q::at_int(row + b * Q::BB, i);
        return r;
    }
#endif
    static float row_at(const T* row, int64_t d) {
        const T* blk = row + d / QK * Q::BB;
        return (float)Q::at_int(blk, (int)(d % QK)) * f16_bits_at(blk);
    }
};

struct WQ8_0 : QuantRow<WQ8_0> {
    static constexpr int BB = 34;  // bytes per block
    static int at_int(const uint8_t* blk, int i) { return (int8_t)blk[2 + i]; }
#if defined(PI_QSIMD)
    static __m256i block(const uint8_t* blk) { return _mm256_loadu_si256((const __m256i*)(blk + 2)); }
#endif
    static vf row_load(const T* row, int64_t d) {  // VW values from column d (a multiple of VW)
        const uint8_t* blk = row + d / QK * BB;
        const uint8_t* p = blk + 2 + d % QK;
#if defined(__AVX512F__)
        const vf q = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
        const vf q = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
#else
        vf q;
        for (int i = 0; i < VW; ++i) q.v[i] = (float)(int8_t)p[i];
#endif
        return vmul(q, vset1(f16_bits_at(blk)));
    }
    static void block_vals(const T* row, int64_t b, vf* q) {  // block b's 32 q as QK / VW vectors
        const uint8_t* p = row + b * BB + 2;
        for (int j = 0; j < QK / VW; ++j) {
#if defined(__AVX512F__)
            q[j] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(p + 16 * j))));
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
            q[j] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(p + 8 * j))));
#else
            for (int i = 0; i < VW; ++i) q[j].v[i] = (float)(int8_t)p[VW * j + i];
#endif
        }
    }
};

struct WQ4_0 : QuantRow<WQ4_0> {
    static constexpr int BB = 18;
#if defined(PI_QSIMD)
    static constexpr bool OFFSET = true;
#endif
    static int at_int(const uint8_t* blk, int i) { return ((blk[2 + i % 16] >> (i < 16 ? 0 : 4)) & 15) - 8; }
#if defined(PI_QSIMD)
    static __m256i block_u(const uint8_t* blk) {  // the nibbles 0..15: elements 0-15 low, 16-31 high
        const __m128i b = _mm_loadu_si128((const __m128i*)(blk + 2));
        return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(b, 4), b), _mm256_set1_epi8(15));
    }
    static __m256i block(const uint8_t* blk) { return _mm256_sub_epi8(block_u(blk), _mm256_set1_epi8(8)); }
#if defined(__AVX512F__) && defined(__AVX512BW__)
    static qi unpack_u(const T* row, int64_t b) {  // blocks b, b + 1 in element order
        const __m128i b0 = _mm_loadu_si128((const __m128i*)(row + b * BB + 2));
        const __m128i b1 = _mm_loadu_si128((const __m128i*)(row + (b + 1) * BB + 2));
        const __m256i v = _mm256_inserti128_si256(_mm256_castsi128_si256(b0), b1, 1);
        const __m512i z = _mm512_and_si512(_mm512_inserti64x4(_mm512_castsi256_si512(v), _mm256_srli_epi16(v, 4), 1),
                                           _mm512_set1_epi8(15));  // [low 0, low 1, high 0, high 1]
        return _mm512_shuffle_i64x2(z, z, _MM_SHUFFLE(3, 1, 2, 0));  // [low 0, high 0, low 1, high 1]
    }
    static qi unpack_u_tail(const T* row, int64_t b) { return qi_join(block_u(row + b * BB), _mm256_setzero_si256()); }
#if defined(__AVX512VL__)
    static qf scales(const T* row, int64_t b) {  // blocks b, b + 1: f16 words 0 and 9 of the pair's 36 bytes
        const __m256i raw = _mm256_loadu_si256((const __m256i*)(row + b * BB));
        const __m256i pick = _mm256_setr_epi16(0, 0, 0, 0, 0, 0, 0, 0, 9, 9, 9, 9, 9, 9, 9, 9);
        return _mm512_cvtph_ps(_mm256_permutexvar_epi16(pick, raw));
    }
#endif
#else
    static qi unpack_u(const T* row, int64_t b) { return block_u(row + b * BB); }
#endif
#endif
    static vf row_load(const T* row, int64_t d) {
        const uint8_t* blk = row + d / QK * BB;
        const int i = (int)(d % QK), shift = i < 16 ? 0 : 4;
        const uint8_t* p = blk + 2 + i % 16;
#if defined(__AVX512F__)
        const __m512i n = _mm512_and_si512(_mm512_srl_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p)),
                                                            _mm_cvtsi32_si128(shift)), _mm512_set1_epi32(15));
        const vf q = _mm512_cvtepi32_ps(_mm512_sub_epi32(n, _mm512_set1_epi32(8)));
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
        const __m256i n = _mm256_and_si256(_mm256_srl_epi32(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p)),
                                                            _mm_cvtsi32_si128(shift)), _mm256_set1_epi32(15));
        const vf q = _mm256_cvtepi32_ps(_mm256_sub_epi32(n, _mm256_set1_epi32(8)));
#else
        vf q;
        for (int j = 0; j < VW; ++j) q.v[j] = (float)(((p[j] >> shift) & 15) - 8);
#endif
        return vmul(q, vset1(f16_bits_at(blk)));
    }
    static void block_vals(const T* row, int64_t b, vf* q) {  // block b's 32 (nibble - 8) as QK / VW vectors
        const uint8_t* p = row + b * BB + 2;
#if defined(__AVX512F__)
        // vpermps takes the low 4 bits of each lane: the nibble picks its value from the table
        const __m512 tbl = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
        const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p));
        q[0] = _mm512_permutexvar_ps(v, tbl);
        q[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), tbl);
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
        const __m128i bytes = _mm_loadu_si128((const __m128i*)p);
        const __m256i lo = _mm256_cvtepu8_epi32(bytes), hi = _mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8));
        const __m256i m = _mm256_set1_epi32(15), eight = _mm256_set1_epi32(8);
        q[0] = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(lo, m), eight));
        q[1] = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(hi, m), eight));
        q[2] = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(lo, 4), eight));
        q[3] = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(hi, 4), eight));
#else
        for (int i = 0; i < QK; ++i) q[i / VW].v[i % VW] = (float)at_int(p - 2, i);
#endif
    }
};

// ---- the activation: x [D] fp32 -> Q8_0 ---------------------------------------------------------
// ggml's reference rounding (quantize_row_q8_0_ref, gguf-py's Q8_0): d = amax / 127, q =
// round-half-away-from-zero(x * (1 / d)), d stored as f16. q [D] int8, d [D / 32] the f16 scales
// as fp32. |x * (1 / d)| <= 127, so the rounding below is exact.
inline float round_away(float v) {
    const float t = std::trunc(v);
    return std::fabs(v - t) >= 0.5f ? t + (v < 0.f ? -1.f : 1.f) : t;
}

inline void quantize_row_q8(const float* x, int64_t D, int8_t* q, float* d, int32_t* off) {
    for (int64_t b = 0; b < D / QK; ++b) {
        const float* xb = x + b * QK;
        int8_t* qb = q + b * QK;
#if defined(__AVX512F__)
        const __m512 v0 = _mm512_loadu_ps(xb), v1 = _mm512_loadu_ps(xb + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
        const __m256 sgn = _mm256_set1_ps(-0.f);
        __m256 m = _mm256_andnot_ps(sgn, _mm256_loadu_ps(xb));
        for (int j = 8; j < QK; j += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sgn, _mm256_loadu_ps(xb + j)));
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        h = _mm_max_ss(h, _mm_movehdup_ps(h));
        const float amax = _mm_cvtss_f32(h);
#else
        float amax = 0.f;
        for (int i = 0; i < QK; ++i) amax = std::fabs(xb[i]) > amax ? std::fabs(xb[i]) : amax;
#endif
        const float dd = amax / 127.f;
        const float id = dd != 0.f ? 1.f / dd : 0.f;
#if defined(__AVX512F__)
        const __m512 vid = _mm512_set1_ps(id), half = _mm512_set1_ps(0.5f);
        const __m512i one = _mm512_castps_si512(_mm512_set1_ps(1.f)), sbit = _mm512_set1_epi32((int)0x80000000u);
        for (int j = 0; j < 2; ++j) {
            const __m512 v = _mm512_mul_ps(j ? v1 : v0, vid);
            const __m512 t = _mm512_roundscale_ps(v, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
            const __mmask16 up = _mm512_cmp_ps_mask(_mm512_abs_ps(_mm512_sub_ps(v, t)), half, _CMP_GE_OQ);
            const __m512 s = _mm512_castsi512_ps(_mm512_or_si512(one, _mm512_and_si512(_mm512_castps_si512(v), sbit)));
            const __m512i r = _mm512_cvtps_epi32(_mm512_mask_add_ps(t, up, t, s));
            _mm_storeu_si128((__m128i*)(qb + 16 * j), _mm512_cvtepi32_epi8(r));
        }
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
        const __m256 vid = _mm256_set1_ps(id), half = _mm256_set1_ps(0.5f), one = _mm256_set1_ps(1.f);
        __m256i r[4];
        for (int j = 0; j < 4; ++j) {
            const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(xb + 8 * j), vid);
            const __m256 t = _mm256_round_ps(v, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
            const __m256 up = _mm256_cmp_ps(_mm256_andnot_ps(sgn, _mm256_sub_ps(v, t)), half, _CMP_GE_OQ);
            const __m256 s = _mm256_or_ps(one, _mm256_and_ps(v, sgn));
            r[j] = _mm256_cvtps_epi32(_mm256_add_ps(t, _mm256_and_ps(up, s)));
        }
        // int32 x 32 -> int8 x 32 in order (packs interleave 128-bit lanes; the permute undoes it)
        const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(r[0], r[1]), _mm256_packs_epi32(r[2], r[3]));
        _mm256_storeu_si256((__m256i*)qb, _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
#else
        for (int i = 0; i < QK; ++i) qb[i] = (int8_t)round_away(xb[i] * id);
#endif
        d[b] = f16_to_f32(f32_to_f16(dd));
        int32_t sum = 0;
        for (int i = 0; i < QK; ++i) sum += qb[i];
        for (int i = 0; i < 8; ++i) off[8 * b + i] = i ? 0 : -8 * sum;
    }
}

// A Q8_0 activation row in the space of D floats: q [D] int8, the D / 32 scales as fp32, then
// Q4_0's offsets (-8 * the sum of each block's q), one qi of int32 per step of QB blocks (block b's
// offset in lane 8b of them, the block's other lanes 0): D + D / 8 + ~D bytes. After an odd number
// of blocks the last step's upper lanes are not written: the tail step scales them by 0.
inline const int8_t* xq_values(const float* x) { return (const int8_t*)x; }
inline const float* xq_scales(const float* x, int64_t D) { return (const float*)((const int8_t*)x + D); }
inline const int32_t* xq_offsets(const float* x, int64_t D) { return (const int32_t*)(xq_scales(x, D) + D / QK); }

// quantize_row_q8 of columns d0 .. d1-1 (d0 a multiple of QK * QB) into the row's parts.
inline void quantize_into(const float* x, int64_t d0, int64_t d1, float* row, int64_t D) {
    quantize_row_q8(x + d0, d1 - d0, (int8_t*)row + d0, (float*)xq_scales(row, D) + d0 / QK,
                    (int32_t*)xq_offsets(row, D) + 8 * (d0 / QK));
}

}  // namespace
