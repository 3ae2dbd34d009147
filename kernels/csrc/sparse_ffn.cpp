// Neuron-aware sparse FFN for the CPU executor: gather-free, multi-threaded, each active row of
// up / gate / down_t read once from memory, fp16 / bf16 converted to fp32 in registers.
//
// Dimension legend: T tokens, D n_embd, N rows of the shard, K active rows (idx), R rows per block.
//
//   y[t, :] = sum_k  mask[t, k] * act(gate[idx[k]] . x[t], up[idx[k]] . x[t] + b[idx[k]]) * down_t[idx[k], :]
//
// Work split: threads take chunks of 4R consecutive idx entries dynamically. For each block of R rows it computes the
// activations h [R, T] (phase 1: one pass over the up/gate rows, all tokens at once), then adds
// h * down_t rows into its private fp32 accumulator A_i [T, D] (phase 2: one pass over the down
// rows, R rows interleaved so A_i is loaded and stored once per R rows). Rows whose activation is
// zero for every token (ReLU zeros, masked tokens) skip their down row. After a barrier the
// accumulators are summed in parallel over D and written in the output dtype.
//
// Built at first use by kernels/cpu_ffn.py with `g++ -O3 -march=native -fopenmp`; the vector
// code is chosen at compile time: AVX-512F, else AVX2 + FMA + F16C, else portable scalar C++.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <omp.h>

#if defined(__x86_64__) && (defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)))
#include <immintrin.h>
#endif

namespace {

enum { DT_F32 = 0, DT_F16 = 1, DT_BF16 = 2 };
enum { ACT_RELU = 0, ACT_REGLU = 1, ACT_DRELU = 2, ACT_SWIGLU = 3 };
enum { MASK_NONE = 0, MASK_BOOL = 1, MASK_BITS = 2 };

constexpr int R = 8;  // rows per block: A_i is touched once per R down rows
constexpr int PF_LINES = 8;  // cache lines prefetched at the head of a row about to be streamed

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
inline float vsum(vf v) { float s = 0.f; for (int i = 0; i < VW; ++i) s += v.v[i]; return s; }
inline vf vload_f16(const uint16_t* p) { vf r; for (int i = 0; i < VW; ++i) r.v[i] = f16_to_f32(p[i]); return r; }
inline vf vload_bf16(const uint16_t* p) { vf r; for (int i = 0; i < VW; ++i) r.v[i] = bf16_to_f32(p[i]); return r; }
#endif

// Weight element types: a vector load that widens to fp32, and a scalar one for tails.
struct WF32 {
    typedef float T;
    static vf load(const T* p) { return vload(p); }
    static float at(const T* p) { return *p; }
};
struct WF16 {
    typedef uint16_t T;
    static vf load(const T* p) { return vload_f16(p); }
    static float at(const T* p) { return f16_to_f32(*p); }
};
struct WBF16 {
    typedef uint16_t T;
    static vf load(const T* p) { return vload_bf16(p); }
    static float at(const T* p) { return bf16_to_f32(*p); }
};

// Tokens per register block: accumulators 2*TB (+ weights) must fit the register file.
#if defined(__AVX512F__)
constexpr int TBMAX = 8;
#else
constexpr int TBMAX = 4;
#endif

// ---- phase 1: u[t] = up_row . x[t], g[t] = gate_row . x[t] for tokens t0 .. t0+TB-1 ----------
template <class W, int TB, bool GATE>
inline void dot_rows(const typename W::T* up, const typename W::T* gate, const float* x, int64_t D,
                     float* u, float* g) {
    // x points at token t0; u, g get TB values. Single-token blocks use 4 accumulators so the
    // FMA latency chain does not cap the read rate.
    constexpr int U = TB == 1 ? 4 : (TB == 2 ? 2 : 1);
    vf au[TB][U], ag[TB][U];
    for (int t = 0; t < TB; ++t)
        for (int j = 0; j < U; ++j) au[t][j] = ag[t][j] = vzero();
    int64_t d = 0;
    for (; d + U * VW <= D; d += U * VW) {
        for (int j = 0; j < U; ++j) {
            vf wu = W::load(up + d + j * VW);
            vf wg = GATE ? W::load(gate + d + j * VW) : vzero();
            for (int t = 0; t < TB; ++t) {
                vf xv = vload(x + t * D + d + j * VW);
                au[t][j] = vfma(wu, xv, au[t][j]);
                if (GATE) ag[t][j] = vfma(wg, xv, ag[t][j]);
            }
        }
    }
    for (; d + VW <= D; d += VW) {
        vf wu = W::load(up + d);
        vf wg = GATE ? W::load(gate + d) : vzero();
        for (int t = 0; t < TB; ++t) {
            vf xv = vload(x + t * D + d);
            au[t][0] = vfma(wu, xv, au[t][0]);
            if (GATE) ag[t][0] = vfma(wg, xv, ag[t][0]);
        }
    }
    for (int t = 0; t < TB; ++t) {
        vf su = au[t][0], sg = ag[t][0];
        for (int j = 1; j < U; ++j) { su = vadd(su, au[t][j]); sg = vadd(sg, ag[t][j]); }
        float fu = vsum(su), fg = GATE ? vsum(sg) : 0.f;
        for (int64_t e = d; e < D; ++e) {  // tail
            fu += W::at(up + e) * x[t * D + e];
            if (GATE) fg += W::at(gate + e) * x[t * D + e];
        }
        u[t] = fu;
        g[t] = fg;
    }
}

template <class W, bool GATE>
void dot_all_tokens(const typename W::T* up, const typename W::T* gate, const float* x, int64_t T,
                    int64_t D, float* u, float* g) {
    int64_t t0 = 0;
    for (; t0 + TBMAX <= T; t0 += TBMAX) dot_rows<W, TBMAX, GATE>(up, gate, x + t0 * D, D, u + t0, g + t0);
    switch (T - t0) {  // remainder block
        case 0: break;
        case 1: dot_rows<W, 1, GATE>(up, gate, x + t0 * D, D, u + t0, g + t0); break;
        case 2: dot_rows<W, 2, GATE>(up, gate, x + t0 * D, D, u + t0, g + t0); break;
        case 3: dot_rows<W, 3, GATE>(up, gate, x + t0 * D, D, u + t0, g + t0); break;
#if defined(__AVX512F__)
        case 4: dot_rows<W, 4, GATE>(up, gate, x + t0 * D, D, u + t0, g + t0); break;
        case 5: dot_rows<W, 5, GATE>(up, gate, x + t0 * D, D, u + t0, g + t0); break;
        case 6: dot_rows<W, 6, GATE>(up, gate, x + t0 * D, D, u + t0, g + t0); break;
        case 7: dot_rows<W, 7, GATE>(up, gate, x + t0 * D, D, u + t0, g + t0); break;
#endif
    }
}

inline float activate(int act, float u, float g) {
    switch (act) {
        case ACT_RELU: return u > 0.f ? u : 0.f;
        case ACT_REGLU: return g > 0.f ? g * u : 0.f;
        case ACT_DRELU: return (g > 0.f && u > 0.f) ? g * u : 0.f;
        default: return g / (1.f + std::exp(-g)) * u;  // swiglu
    }
}

// ---- phase 2: A[t, :] += sum_r h[r, t] * rows[r][:] -------------------------------------------
// h is [nr, T] row-major; A is [T, D]. Tokens t0 .. t0+TB-1.
template <class W, int TB>
inline void axpy_rows(const typename W::T* const* rows, int nr, const float* h, int64_t T, int64_t t0,
                      float* A, int64_t D) {
    int64_t d = 0;
    for (; d + VW <= D; d += VW) {
        if (TB == 1) {  // two chains so FMA latency does not bound a single token
            vf a0 = vload(A + t0 * D + d), a1 = vzero();
            int r = 0;
            for (; r + 2 <= nr; r += 2) {
                a0 = vfma(vset1(h[r * T + t0]), W::load(rows[r] + d), a0);
                a1 = vfma(vset1(h[(r + 1) * T + t0]), W::load(rows[r + 1] + d), a1);
            }
            if (r < nr) a0 = vfma(vset1(h[r * T + t0]), W::load(rows[r] + d), a0);
            vstore(A + t0 * D + d, vadd(a0, a1));
        } else {
            vf acc[TB];
            for (int t = 0; t < TB; ++t) acc[t] = vload(A + (t0 + t) * D + d);
            for (int r = 0; r < nr; ++r) {
                vf w = W::load(rows[r] + d);
                for (int t = 0; t < TB; ++t) acc[t] = vfma(vset1(h[r * T + t0 + t]), w, acc[t]);
            }
            for (int t = 0; t < TB; ++t) vstore(A + (t0 + t) * D + d, acc[t]);
        }
    }
    for (; d < D; ++d)  // tail
        for (int r = 0; r < nr; ++r) {
            float w = W::at(rows[r] + d);
            for (int t = 0; t < TB; ++t) A[(t0 + t) * D + d] += h[r * T + t0 + t] * w;
        }
}

template <class W>
void axpy_all_tokens(const typename W::T* const* rows, int nr, const float* h, int64_t T, float* A, int64_t D) {
    constexpr int TB2 = TBMAX * 2 > 16 ? 16 : TBMAX * 2;  // axpy keeps TB accumulators only
    int64_t t0 = 0;
    for (; t0 + TB2 <= T; t0 += TB2) axpy_rows<W, TB2>(rows, nr, h, T, t0, A, D);
    if (TB2 > 8)
        for (; t0 + 8 <= T; t0 += 8) axpy_rows<W, 8>(rows, nr, h, T, t0, A, D);
    for (; t0 + 4 <= T; t0 += 4) axpy_rows<W, 4>(rows, nr, h, T, t0, A, D);
    for (; t0 + 2 <= T; t0 += 2) axpy_rows<W, 2>(rows, nr, h, T, t0, A, D);
    for (; t0 < T; ++t0) axpy_rows<W, 1>(rows, nr, h, T, t0, A, D);
}

struct Args {
    const float* x; int64_t T, D;
    const void *up, *gate, *down; int64_t ld_up, ld_gate, ld_down;
    const void* bias; int bias_dt;
    const void* idx; int idx64; int64_t K;
    const void* mask; int mask_mode; int64_t ld_mask;
    int act;
    void* y; int y_dt;
    float* scratch; int nthreads;
};

inline int64_t row_id(const Args& a, int64_t k) {
    return a.idx64 ? ((const int64_t*)a.idx)[k] : (int64_t)((const int32_t*)a.idx)[k];
}

inline float bias_at(const Args& a, int64_t row) {
    switch (a.bias_dt) {
        case DT_F32: return ((const float*)a.bias)[row];
        case DT_F16: return f16_to_f32(((const uint16_t*)a.bias)[row]);
        default: return bf16_to_f32(((const uint16_t*)a.bias)[row]);
    }
}

inline bool mask_at(const Args& a, int64_t t, int64_t k) {
    if (a.mask_mode == MASK_BOOL) return ((const uint8_t*)a.mask)[t * a.ld_mask + k] != 0;
    if (a.mask_mode == MASK_BITS) return (((const int32_t*)a.mask)[k] >> t) & 1;
    return true;
}

// One thread's slice [k0, k1) of idx into its accumulator A [T, D].
template <class W, bool GATE>
void run_slice(const Args& a, int64_t k0, int64_t k1, float* A) {
    typedef typename W::T WT;
    const WT* up = (const WT*)a.up;
    const WT* gate = (const WT*)a.gate;
    const WT* down = (const WT*)a.down;
    const int64_t T = a.T, D = a.D;
    float u[64], g[64];  // T <= 64 per block of tokens, see pi_sparse_ffn
    float h[R * 64];
    const WT* rows[R];
    for (int64_t kb = k0; kb < k1; kb += R) {
        int nr = 0;
        for (int64_t k = kb; k < kb + R && k < k1; ++k) {
            int64_t row = row_id(a, k);
            if (k + 1 < k1) {  // start the next row's up / gate streams before this row's dot
                int64_t nx = row_id(a, k + 1);
                for (int l = 0; l < PF_LINES; ++l) {
                    __builtin_prefetch((const char*)(up + nx * a.ld_up) + 64 * l);
                    if (GATE) __builtin_prefetch((const char*)(gate + nx * a.ld_gate) + 64 * l);
                }
            }
            dot_all_tokens<W, GATE>(up + row * a.ld_up, GATE ? gate + row * a.ld_gate : nullptr, a.x, T, D, u, g);
            float b = a.bias ? bias_at(a, row) : 0.f;
            bool any = false;
            for (int64_t t = 0; t < T; ++t) {
                float v = mask_at(a, t, k) ? activate(a.act, u[t] + b, g[t]) : 0.f;
                h[nr * T + t] = v;
                any |= v != 0.f;
            }
            if (any) {  // all-zero activation: skip the down row
                rows[nr] = down + row * a.ld_down;
                for (int l = 0; l < PF_LINES; ++l) __builtin_prefetch((const char*)rows[nr] + 64 * l);
                ++nr;
            }
        }
        if (nr) axpy_all_tokens<W>(rows, nr, h, T, A, D);
    }
}

template <class W>
void run_slice_w(const Args& a, int64_t k0, int64_t k1, float* A) {
    if (a.gate) run_slice<W, true>(a, k0, k1, A);
    else run_slice<W, false>(a, k0, k1, A);
}

void store_out(const Args& a, int64_t t, int64_t d0, int64_t d1, const float* src) {
    // src indexes columns d0 .. d1 of token t
    int64_t off = t * a.D;
    if (a.y_dt == DT_F32) {
        std::memcpy((float*)a.y + off + d0, src, (d1 - d0) * sizeof(float));
    } else if (a.y_dt == DT_F16) {
        uint16_t* y = (uint16_t*)a.y + off;
        for (int64_t d = d0; d < d1; ++d) y[d] = f32_to_f16(src[d - d0]);
    } else {
        uint16_t* y = (uint16_t*)a.y + off;
        for (int64_t d = d0; d < d1; ++d) y[d] = f32_to_bf16(src[d - d0]);
    }
}

}  // namespace

extern "C" {

// Returns 0, or -(k+1) when idx[k] is outside [0, n_rows), or -1000000000 for bad arguments.
// scratch: nthreads * T * D fp32 (the per-thread accumulators). T <= 64.
int64_t pi_sparse_ffn(const float* x, int64_t T, int64_t D,
                      const void* up, const void* gate, const void* down, int w_dt,
                      int64_t ld_up, int64_t ld_gate, int64_t ld_down, int64_t n_rows,
                      const void* bias, int bias_dt,
                      const void* idx, int idx64, int64_t K,
                      const void* mask, int mask_mode, int64_t ld_mask,
                      int act, void* y, int y_dt, float* scratch, int nthreads) {
    if (T < 1 || T > 64 || D < 1 || nthreads < 1 || w_dt < 0 || w_dt > 2) return -1000000000;
    Args a{x, T, D, up, gate, down, ld_up, ld_gate, ld_down, bias, bias_dt, idx, idx64, K,
           mask, mask_mode, ld_mask, act, y, y_dt, scratch, nthreads};
    for (int64_t k = 0; k < K; ++k) {
        int64_t r = row_id(a, k);
        if (r < 0 || r >= n_rows) return -(k + 1);
    }
    // Fewer threads for few rows: every thread costs a T x D accumulator in the reduction.
    int64_t nt = (K + 7) / 8;
    nt = nt < 1 ? 1 : (nt > nthreads ? nthreads : nt);
    const int64_t TD = T * D;
#pragma omp parallel num_threads((int)nt)
    {
        const int64_t i = omp_get_thread_num(), n = omp_get_num_threads();
        float* A = scratch + i * TD;
        std::memset(A, 0, TD * sizeof(float));
        // Chunks of CH rows handed out dynamically: a thread that the OS preempts (cores shared
        // with other processes) delays the barrier by one chunk, not by a whole slice.
        constexpr int64_t CH = 4 * R;
        const int64_t nch = (K + CH - 1) / CH;
#pragma omp for schedule(dynamic, 1)
        for (int64_t c = 0; c < nch; ++c) {
            const int64_t k0 = c * CH, k1 = k0 + CH < K ? k0 + CH : K;
            switch (w_dt) {
                case DT_F32: run_slice_w<WF32>(a, k0, k1, A); break;
                case DT_F16: run_slice_w<WF16>(a, k0, k1, A); break;
                default: run_slice_w<WBF16>(a, k0, k1, A); break;
            }
        }  // implicit barrier
        // Reduction over threads, split over D in chunks of 256 columns.
        constexpr int64_t C = 256;
        float buf[C];
        const int64_t nchunks = (D + C - 1) / C;
#pragma omp for schedule(dynamic, 4) collapse(2)
        for (int64_t t = 0; t < T; ++t)
            for (int64_t c = 0; c < nchunks; ++c) {
                const int64_t d0 = c * C, d1 = d0 + C < D ? d0 + C : D;
                const float* src = scratch + t * D;
                for (int64_t d = d0; d < d1; ++d) buf[d - d0] = src[d];
                for (int64_t j = 1; j < n; ++j) {
                    const float* s = scratch + j * TD + t * D;
                    for (int64_t d = d0; d < d1; ++d) buf[d - d0] += s[d];
                }
                store_out(a, t, d0, d1, buf);
            }
    }
    return 0;
}

// Multi-threaded read of n floats (the host's DRAM read ceiling). Returns their sum. Each thread
// reads its share as 4 interleaved streams: one stream per core leaves the hardware prefetchers
// short of memory-level parallelism (the sparse kernel itself streams several rows at a time).
double pi_read_sum(const float* p, int64_t n, int nthreads) {
    double total = 0.0;
#pragma omp parallel num_threads(nthreads) reduction(+ : total)
    {
        const int64_t i = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t b = n * i / nt, e = n * (i + 1) / nt, q = (e - b) / 4 / VW * VW;
        const float *p0 = p + b, *p1 = p0 + q, *p2 = p1 + q, *p3 = p2 + q;
        vf s0 = vzero(), s1 = vzero(), s2 = vzero(), s3 = vzero();
        for (int64_t j = 0; j < q; j += VW) {
            s0 = vadd(s0, vload(p0 + j));
            s1 = vadd(s1, vload(p1 + j));
            s2 = vadd(s2, vload(p2 + j));
            s3 = vadd(s3, vload(p3 + j));
        }
        float s = vsum(vadd(vadd(s0, s1), vadd(s2, s3)));
        for (int64_t j = b + 4 * q; j < e; ++j) s += p[j];
        total += s;
    }
    return total;
}

int pi_simd_width() { return VW; }

}  // extern "C"
