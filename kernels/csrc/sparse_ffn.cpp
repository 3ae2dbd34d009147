// Neuron-aware sparse FFN for the CPU executor: gather-free, multi-threaded, each active row of
// up / gate / down_t read once from memory, fp16 / bf16 converted to fp32 in registers, ggml
// Q4_0 / Q8_0 rows multiplied as ggml does (quant.h).
//
// Dimension legend: T tokens, D n_embd, N rows of the shard, K active rows (idx), R rows per block.
//
//   y[t, :] = sum_k  mask[t, k] * act(gate[idx[k]] . x[t], up[idx[k]] . x[t] + b[idx[k]]) * down_t[idx[k], :]
//
// Work split, two of them (pick_split chooses; the same results up to fp32 rounding order):
//  columns (few active rows): phase 1, threads take dynamic chunks of a few idx entries and compute
//    the activations h [K, T] (one pass over the up/gate rows, all tokens at once); barrier;
//    phase 2, thread i owns a slice of the D columns (multiples of 32) and adds h * down_t[:, slice]
//    over all rows with a nonzero activation straight into y (fp32) or an fp32 [T, D] buffer. Every
//    row is still read once in all, every thread has work at any K, and there is no reduction.
//  rows (many active rows): threads take chunks of consecutive idx entries dynamically; for each
//    block of R rows a thread computes h [R, T] (phase 1), then adds h * down_t rows into its
//    private fp32 accumulator A_i [T, D] (phase 2, R rows interleaved so A_i is loaded and stored
//    once per R rows); after a barrier the accumulators are summed in parallel over D.
// Rows whose activation is zero for every token (ReLU zeros, masked tokens) skip their down row.
// At T = 1 phase 1 takes active rows four at a time, one pass over x for all (dotn_t1): eight
// weight streams per thread (four without a gate) keep more reads in flight than two. At T > 1 the
// next row's up / gate and this row's down are prefetched while the dot products run (next_rows).
// pi_linear: dense rows times x (the CPU executor's attention projections), on the same loops.
// pi_sparse_ffn_bitmask decodes the CPU executor's packed mask (active rows and token bits) and
// converts x itself, so the executor's exchange is one call.
// SwiGLU activation thresholds (thr_on): h is zeroed where |SiLU(g)| (THR_GATE) or |h| (THR_H) is
// not above thr. On the gate a block's gate dots come first and only the rows whose gate passes
// for some (masked-in) token read their up row (gate_first_block): gate-first over every row of a
// shard, or the predicted rows, reads a failing row's gate alone.
//
// Parallel regions run on a persistent team of worker threads (pool.h), not OpenMP's fork-join:
// the workers of an exchange spin between calls and start within a cache miss.
// Built at first use by kernels/cpu_library.py with `g++ -O3 -march=native -pthread`; the vector
// code is chosen at compile time (simd.h, quant.h).

#include <time.h>

#include <type_traits>
#include <vector>

#include "pool.h"
#include "simd.h"
#include "quant.h"

// The kernels of each weight type are their own translation unit, compiled in parallel
// (kernels/cpu_library.py builds this file once per unit): PI_W = 0..4 instantiates the kernels of
// weight type PI_W (DT_*) only; PI_W < 0 (the default) is the exported API and dispatches to them.
#ifndef PI_W
#define PI_W -1
#endif

namespace pi {  // what the units share (external linkage: one definition in every unit)

struct Args {
    const float* x; int64_t T, D;
    const void *up, *gate, *down; int64_t ld_up, ld_gate, ld_down;
    const void* bias; int bias_dt;
    const void* idx; int idx64; int64_t K;
    const void* mask; int mask_mode; int64_t ld_mask;
    int act;
    void* y; int y_dt;
    float* scratch; int nthreads;  // split rows: the per-thread accumulators [nthreads, T, D]
    float* h; uint8_t* nz;  // split columns: activations [K, T], row-has-a-nonzero flags [K]
    float* acc;  // split columns: fp32 accumulator [T, D] (y itself when y is fp32)
    const void* x_src; int x_dt; int64_t ld_x;  // non-null: x_src [T] rows (stride ld_x) in x_dt, converted into x
    // keep_zero: read (and add) a row's down row even where its activation is zero for every
    // token, as a dense FFN does (the layer-offload baseline); n_down (non-null): += down rows read
    int keep_zero = 0; int64_t* n_down = nullptr;
    float* xq = nullptr;  // quantized weights: the Q8_0 activation [T] rows of D floats' space (qdot_core)
    // SwiGLU activation threshold (THR_*); up_read (non-null, zeroed): per idx entry, nonzero once its
    // up row is read (gate first: the number of tokens whose gate passes)
    float thr = 0.f; int thr_on = 0 /* THR_NONE */; uint8_t* up_read = nullptr;
};

// Unit k's entry points (k = DT_*): the sparse FFN, and pi_linear's product, on weight type k.
#define PI_UNIT_DECL(k) \
    void run_w##k(const Args& a, int split); \
    void linear_w##k(const float* x, int64_t T, int64_t D, const void* w, int64_t ld_w, int64_t R, float* y, \
                     int nthreads);
PI_UNIT_DECL(0) PI_UNIT_DECL(1) PI_UNIT_DECL(2) PI_UNIT_DECL(3) PI_UNIT_DECL(4)

}  // namespace pi

namespace {

using pi::Args;

enum { DT_F32 = 0, DT_F16 = 1, DT_BF16 = 2, DT_Q4_0 = 3, DT_Q8_0 = 4 };  // weights: also quantized
enum { ACT_RELU = 0, ACT_REGLU = 1, ACT_DRELU = 2, ACT_SWIGLU = 3 };
enum { MASK_NONE = 0, MASK_BOOL = 1, MASK_BITS = 2, MASK_BITS64 = 3 };
enum { SPLIT_AUTO = 0, SPLIT_ROWS = 1, SPLIT_COLS = 2 };
enum { THR_NONE = 0, THR_GATE = 1, THR_H = 2 };  // what a SwiGLU activation threshold compares

constexpr int R = 8;  // rows per block: A_i is touched once per R down rows
constexpr int PF_LINES = 8;  // cache lines prefetched at the head of a row about to be streamed

// Tokens per register block: accumulators 2*TB (+ weights) must fit the register file.
#if defined(__AVX512F__)
constexpr int TBMAX = 8;
#else
constexpr int TBMAX = 4;
#endif

// Rows to prefetch while a row's dot products run (T > 1, where the FMAs take longer than the
// row's bytes): byte pointers to row starts, each prefetched at the offset the dot has reached, so
// the next row's up / gate and this row's down arrive while the FMAs run instead of after them.
struct Pf {
    const char* p[8];
    int n;
};

// Prefetch (to L2) the cache lines that start within bytes [b0, b1) of each of pf's rows.
inline void prefetch_span(const Pf* pf, int64_t b0, int64_t b1) {
    for (int64_t o = (b0 + 63) & ~(int64_t)63; o < b1; o += 64)
        for (int i = 0; i < pf->n; ++i) __builtin_prefetch(pf->p[i] + o, 0, 2);
}

// ---- phase 1 on quantized rows (quant.h): NR rows against TB tokens of the Q8_0 activation ------
// x points at token 0's row of the quantized activation; row t at x + t * D (quant.h: xq_values,
// xq_scales, xq_offsets).

// out[r * TB + t] = rows[r] . x[t], block by block (integer dots, fp32 sums).
template <class W, int NR, int TB>
void qdot_core(const uint8_t* const* rows, const float* x, int64_t D, float* out, const Pf* pf) {
    const int64_t nb = D / QK;
    qf acc[NR][TB];
    for (int r = 0; r < NR; ++r)
        for (int t = 0; t < TB; ++t) acc[r][t] = qf_zero();
    int64_t b = 0;
    for (; b + QB <= nb; b += QB) {
        if (pf) prefetch_span(pf, W::bytes(b * QK), W::bytes((b + QB) * QK));
        qi xv[TB], xo[TB];  // xo: Q4_0's offsets of the step's blocks
        qf xs[TB];
        for (int t = 0; t < TB; ++t) {
            const float* xt = x + t * D;
            xv[t] = qi_load(xq_values(xt) + b * QK);
            xs[t] = qf_scales(xq_scales(xt, D)[b], QB > 1 ? xq_scales(xt, D)[b + 1] : 0.f);
            if constexpr (W::OFFSET) xo[t] = qi_load((const int8_t*)(xq_offsets(xt, D) + 8 * b));
        }
        for (int r = 0; r < NR; ++r) {
            const qf ws = W::scales(rows[r], b);
            if constexpr (W::OFFSET) {
                const qi wv = W::unpack_u(rows[r], b);
                for (int t = 0; t < TB; ++t) acc[r][t] = qdot_acc_u(wv, xv[t], xo[t], qf_mul(ws, xs[t]), acc[r][t]);
            } else {
                const qi wv = W::unpack(rows[r], b);
                for (int t = 0; t < TB; ++t) acc[r][t] = qdot_acc(wv, xv[t], qf_mul(ws, xs[t]), acc[r][t]);
            }
        }
    }
#if defined(__AVX512F__) && defined(__AVX512BW__)
    if (b < nb)  // an odd number of blocks: the last step's upper half is zero
        for (int r = 0; r < NR; ++r) {
            const float ws = W::scale(rows[r], b);
            for (int t = 0; t < TB; ++t) {
                const float* xt = x + t * D;
                const qi xv = qi_load_tail(xq_values(xt) + b * QK);
                const qf dd = qf_scales(ws * xq_scales(xt, D)[b], 0.f);
                if constexpr (W::OFFSET)
                    acc[r][t] = qdot_acc_u(W::unpack_u_tail(rows[r], b), xv,
                                           qi_load((const int8_t*)(xq_offsets(xt, D) + 8 * b)), dd, acc[r][t]);
                else
                    acc[r][t] = qdot_acc(W::unpack_tail(rows[r], b), xv, dd, acc[r][t]);
            }
        }
#endif
    for (int r = 0; r < NR; ++r)
        for (int t = 0; t < TB; ++t) out[r * TB + t] = qf_sum(acc[r][t]);
}

template <class W, bool GATE, int TB>
inline void qdot_block(const uint8_t* up, const uint8_t* gate, const float* x, int64_t D, float* u, float* g,
                       const Pf* pf) {
    const uint8_t* rows[2] = {up, gate};
    float out[2 * TB];
    qdot_core<W, GATE ? 2 : 1, TB>(rows, x, D, out, pf);
    for (int t = 0; t < TB; ++t) {
        u[t] = out[t];
        g[t] = GATE ? out[TB + t] : 0.f;
    }
}

// dot_all_tokens on quantized rows: token blocks of TBMAX, 4, 2, 1.
template <class W, bool GATE>
void qdot_tokens(const uint8_t* up, const uint8_t* gate, const float* x, int64_t T, int64_t D, float* u, float* g,
                 const Pf* pf) {
    int64_t t0 = 0;
    for (; t0 + TBMAX <= T; t0 += TBMAX, pf = nullptr)
        qdot_block<W, GATE, TBMAX>(up, gate, x + t0 * D, D, u + t0, g + t0, pf);
    if (TBMAX > 4 && t0 + 4 <= T) {
        qdot_block<W, GATE, 4>(up, gate, x + t0 * D, D, u + t0, g + t0, pf);
        t0 += 4, pf = nullptr;
    }
    for (; t0 + 2 <= T; t0 += 2, pf = nullptr) qdot_block<W, GATE, 2>(up, gate, x + t0 * D, D, u + t0, g + t0, pf);
    if (t0 < T) qdot_block<W, GATE, 1>(up, gate, x + t0 * D, D, u + t0, g + t0, pf);
}

// ---- phase 1: u[t] = up_row . x[t], g[t] = gate_row . x[t] for tokens t0 .. t0+TB-1 ----------
template <class W, int TB, bool GATE>
inline void dot_rows(const typename W::T* up, const typename W::T* gate, const float* x, int64_t D,
                     float* u, float* g, const Pf* pf = nullptr) {
    // x points at token t0; u, g get TB values. Single-token blocks use 4 accumulators so the
    // FMA latency chain does not cap the read rate.
    constexpr int U = TB == 1 ? 4 : (TB == 2 ? 2 : 1);
    constexpr int64_t SZ = sizeof(typename W::T);
    vf au[TB][U], ag[TB][U];
    for (int t = 0; t < TB; ++t)
        for (int j = 0; j < U; ++j) au[t][j] = ag[t][j] = vzero();
    int64_t d = 0;
    for (; d + U * VW <= D; d += U * VW) {
        if (pf) prefetch_span(pf, d * SZ, (d + U * VW) * SZ);  // pf's rows, at this step's offsets
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
                    int64_t D, float* u, float* g, const Pf* pf = nullptr) {
    if constexpr (W::QUANT) {
        qdot_tokens<W, GATE>(up, gate, x, T, D, u, g, pf);
        return;
    } else {
        int64_t t0 = 0;
        for (; t0 + TBMAX <= T; t0 += TBMAX, pf = nullptr)  // prefetches with the first token block
            dot_rows<W, TBMAX, GATE>(up, gate, x + t0 * D, D, u + t0, g + t0, pf);
        switch (T - t0) {  // remainder block
            case 0: break;
            case 1: dot_rows<W, 1, GATE>(up, gate, x + t0 * D, D, u + t0, g + t0, pf); break;
            case 2: dot_rows<W, 2, GATE>(up, gate, x + t0 * D, D, u + t0, g + t0, pf); break;
            case 3: dot_rows<W, 3, GATE>(up, gate, x + t0 * D, D, u + t0, g + t0, pf); break;
#if defined(__AVX512F__)
            case 4: dot_rows<W, 4, GATE>(up, gate, x + t0 * D, D, u + t0, g + t0, pf); break;
            case 5: dot_rows<W, 5, GATE>(up, gate, x + t0 * D, D, u + t0, g + t0, pf); break;
            case 6: dot_rows<W, 6, GATE>(up, gate, x + t0 * D, D, u + t0, g + t0, pf); break;
            case 7: dot_rows<W, 7, GATE>(up, gate, x + t0 * D, D, u + t0, g + t0, pf); break;
#endif
        }
    }
}

// T == 1, NR rows in one pass over x, so a thread keeps 2 NR weight streams in flight (NR without
// a gate): more reads in flight than one row at a time. u, g get NR values (g 0 without a gate).
template <class W, bool GATE, int NR>
void dotn_t1(const typename W::T* const* up, const typename W::T* const* gate, const float* x, int64_t D,
             float* u, float* g, const Pf* pf = nullptr) {
    constexpr int64_t SZ = sizeof(typename W::T);
    vf a[NR], b[NR], ga[NR], gb[NR];
    for (int r = 0; r < NR; ++r) a[r] = b[r] = ga[r] = gb[r] = vzero();
    int64_t d = 0;
    for (; d + 2 * VW <= D; d += 2 * VW) {
        if (pf) prefetch_span(pf, d * SZ, (d + 2 * VW) * SZ);
        const vf xa = vload(x + d), xb = vload(x + d + VW);
        for (int r = 0; r < NR; ++r) {
            a[r] = vfma(W::load(up[r] + d), xa, a[r]);
            b[r] = vfma(W::load(up[r] + d + VW), xb, b[r]);
            if (GATE) {
                ga[r] = vfma(W::load(gate[r] + d), xa, ga[r]);
                gb[r] = vfma(W::load(gate[r] + d + VW), xb, gb[r]);
            }
        }
    }
    for (; d + VW <= D; d += VW) {
        const vf xa = vload(x + d);
        for (int r = 0; r < NR; ++r) {
            a[r] = vfma(W::load(up[r] + d), xa, a[r]);
            if (GATE) ga[r] = vfma(W::load(gate[r] + d), xa, ga[r]);
        }
    }
    for (int r = 0; r < NR; ++r) {
        float s = vsum(vadd(a[r], b[r])), sg = GATE ? vsum(vadd(ga[r], gb[r])) : 0.f;
        for (int64_t e = d; e < D; ++e) {  // tail
            s += W::at(up[r] + e) * x[e];
            if (GATE) sg += W::at(gate[r] + e) * x[e];
        }
        u[r] = s;
        g[r] = sg;
    }
}

// dotn_t1 on any rows (quantized: qdot_core over the 2 NR rows).
template <class W, bool GATE, int NR>
inline void dots_t1(const typename W::T* const* up, const typename W::T* const* gate, const float* x, int64_t D,
                    float* u, float* g, const Pf* pf = nullptr) {
    if constexpr (W::QUANT) {
        const uint8_t* rows[2 * NR];
        for (int r = 0; r < NR; ++r) {
            rows[r] = up[r];
            rows[NR + r] = GATE ? gate[r] : nullptr;
        }
        float out[2 * NR];
        qdot_core<W, GATE ? 2 * NR : NR, 1>(rows, x, D, out, pf);
        for (int r = 0; r < NR; ++r) {
            u[r] = out[r];
            g[r] = GATE ? out[NR + r] : 0.f;
        }
    } else {
        dotn_t1<W, GATE, NR>(up, gate, x, D, u, g, pf);
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

// ---- phase 2: A[t, d0:d1] += sum_r h[r, t] * rows[r][d0:d1] -----------------------------------
// h is [nr, T] row-major; A is [T, D] (row stride D). Tokens t0 .. t0+TB-1, columns d0 .. d1-1.
// One token's A[t0, d0:d1] += sum_r h[r, t0] * rows[r][d0:d1] on quantized rows (d0, d1 multiples
// of 32): block by block, each row's block unpacked once and its scale folded into h (a row's 16
// scales at a time: QuantRow::scales_times); two
// accumulator sets (even and odd rows) so FMA latency does not bound the rows.
template <class W>
void qaxpy_t1(const uint8_t* const* rows, int nr, const float* h, int64_t T, int64_t t0, float* A, int64_t D,
              int64_t d0, int64_t d1) {
    constexpr int QV = QK / VW;
    constexpr int SB = 16;  // blocks whose scales are converted at once
    float hs_all[R][SB];  // h[r] x the scale of block b of row r (nr <= R: every caller passes a row block)
    for (int64_t b = d0 / QK; b < d1 / QK; ++b) {
        const int64_t bs = b - (b - d0 / QK) % SB;
        if (b == bs) {
            const int nb = (int)std::min<int64_t>(SB, d1 / QK - bs);
            for (int r = 0; r < nr; ++r) W::scales_times(rows[r], bs, nb, h[r * T + t0], hs_all[r]);
        }
        float* a = A + t0 * D + b * QK;
        vf acc0[QV], acc1[QV], q[QV];
        for (int j = 0; j < QV; ++j) {
            acc0[j] = vload(a + j * VW);
            acc1[j] = vzero();
        }
        for (int r = 0; r < nr; ++r) {
            W::block_vals(rows[r], b, q);
            const vf hs = vset1(hs_all[r][b - bs]);
            for (int j = 0; j < QV; ++j) {
                if (r % 2) acc1[j] = vfma(hs, q[j], acc1[j]);
                else acc0[j] = vfma(hs, q[j], acc0[j]);
            }
        }
        for (int j = 0; j < QV; ++j) vstore(a + j * VW, vadd(acc0[j], acc1[j]));
    }
}

template <class W, int TB>
inline void axpy_rows(const typename W::T* const* rows, int nr, const float* h, int64_t T, int64_t t0,
                      float* A, int64_t D, int64_t d0, int64_t d1) {
    if constexpr (W::QUANT && TB == 1) {
        qaxpy_t1<W>(rows, nr, h, T, t0, A, D, d0, d1);
        return;
    }
    int64_t d = d0;
    if (TB > 1 && TB <= 8)  // two d-vectors per pass: 2 weight loads + TB broadcasts feed 2 * TB FMAs
        for (; d + 2 * VW <= d1; d += 2 * VW) {
            vf acc0[TB], acc1[TB];
            for (int t = 0; t < TB; ++t) {
                acc0[t] = vload(A + (t0 + t) * D + d);
                acc1[t] = vload(A + (t0 + t) * D + d + VW);
            }
            for (int r = 0; r < nr; ++r) {
                const vf w0 = W::row_load(rows[r], d), w1 = W::row_load(rows[r], d + VW);
                for (int t = 0; t < TB; ++t) {
                    const vf hv = vset1(h[r * T + t0 + t]);
                    acc0[t] = vfma(hv, w0, acc0[t]);
                    acc1[t] = vfma(hv, w1, acc1[t]);
                }
            }
            for (int t = 0; t < TB; ++t) {
                vstore(A + (t0 + t) * D + d, acc0[t]);
                vstore(A + (t0 + t) * D + d + VW, acc1[t]);
            }
        }
    for (; d + VW <= d1; d += VW) {
        if (TB == 1) {  // two chains so FMA latency does not bound a single token
            vf a0 = vload(A + t0 * D + d), a1 = vzero();
            int r = 0;
            for (; r + 2 <= nr; r += 2) {
                a0 = vfma(vset1(h[r * T + t0]), W::row_load(rows[r], d), a0);
                a1 = vfma(vset1(h[(r + 1) * T + t0]), W::row_load(rows[r + 1], d), a1);
            }
            if (r < nr) a0 = vfma(vset1(h[r * T + t0]), W::row_load(rows[r], d), a0);
            vstore(A + t0 * D + d, vadd(a0, a1));
        } else {
            vf acc[TB];
            for (int t = 0; t < TB; ++t) acc[t] = vload(A + (t0 + t) * D + d);
            for (int r = 0; r < nr; ++r) {
                vf w = W::row_load(rows[r], d);
                for (int t = 0; t < TB; ++t) acc[t] = vfma(vset1(h[r * T + t0 + t]), w, acc[t]);
            }
            for (int t = 0; t < TB; ++t) vstore(A + (t0 + t) * D + d, acc[t]);
        }
    }
    for (; d < d1; ++d)  // tail
        for (int r = 0; r < nr; ++r) {
            float w = W::row_at(rows[r], d);
            for (int t = 0; t < TB; ++t) A[(t0 + t) * D + d] += h[r * T + t0 + t] * w;
        }
}

template <class W>
void axpy_all_tokens(const typename W::T* const* rows, int nr, const float* h, int64_t T, float* A, int64_t D,
                     int64_t d0, int64_t d1) {
    // token blocks of TBMAX: axpy_rows keeps 2 x TB accumulators (two d-vectors per pass)
    constexpr int TB2 = TBMAX;
    int64_t t0 = 0;
    for (; t0 + TB2 <= T; t0 += TB2) axpy_rows<W, TB2>(rows, nr, h, T, t0, A, D, d0, d1);
    for (; t0 + 4 <= T; t0 += 4) axpy_rows<W, 4>(rows, nr, h, T, t0, A, D, d0, d1);
    for (; t0 + 2 <= T; t0 += 2) axpy_rows<W, 2>(rows, nr, h, T, t0, A, D, d0, d1);
    for (; t0 < T; ++t0) axpy_rows<W, 1>(rows, nr, h, T, t0, A, D, d0, d1);
}

// The activation phase 1 reads: x, or its Q8_0 form for quantized rows.
template <class W>
inline const float* xin(const Args& a) { return W::QUANT ? a.xq : a.x; }

inline void count_down(const Args& a, int64_t n) {  // once per thread and call
    if (a.n_down && n) __atomic_fetch_add(a.n_down, n, __ATOMIC_RELAXED);
}

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

inline bool gate_passes(const Args& a, float g) { return std::fabs(g / (1.f + std::exp(-g))) > a.thr; }

// The activation with the threshold applied (see the header).
inline float act_of(const Args& a, float u, float g) {
    const float h = activate(a.act, u, g);
    if (a.thr_on == THR_GATE) return gate_passes(a, g) ? h : 0.f;
    if (a.thr_on == THR_H) return std::fabs(h) > a.thr ? h : 0.f;
    return h;
}

inline void mark_up(const Args& a, int64_t k) {
    if (a.up_read && !a.up_read[k]) a.up_read[k] = 1;
}

inline bool mask_at(const Args& a, int64_t t, int64_t k) {
    if (a.mask_mode == MASK_BOOL) return ((const uint8_t*)a.mask)[t * a.ld_mask + k] != 0;
    if (a.mask_mode == MASK_BITS) return (((const int32_t*)a.mask)[k] >> t) & 1;
    if (a.mask_mode == MASK_BITS64) return (((const uint64_t*)a.mask)[k] >> t) & 1;
    return true;
}

// Few tokens of a row active (T > 1): the row is computed for those tokens alone, one dot product
// and one axpy each, instead of for all T in register blocks and masked after. At batch 32 the
// union of the sequences' active cold rows covers most of the CPU shard while each row is active
// for a few sequences: the blocked path spent its FMAs on masked tokens.
inline bool few_tokens(const Args& a, int64_t k, uint64_t* bits) {
    if (a.T < 4 || a.T > 64 || (a.mask_mode != MASK_BITS && a.mask_mode != MASK_BITS64)) return false;
    const uint64_t b = a.mask_mode == MASK_BITS ? (uint64_t)(uint32_t)((const int32_t*)a.mask)[k]
                                                : ((const uint64_t*)a.mask)[k];
    *bits = b;
    return 2 * __builtin_popcountll(b) <= a.T;
}

// out [m, T] = rows[j] . x[t] for m <= R rows of one matrix (no gate): at T = 1 in fours and twos
// (dots_t1), else row by row.
template <class W>
void dot_rows_of(const typename W::T* const* rows, int m, const float* x, int64_t T, int64_t D, float* out) {
    float unused[R * 64];
    int j = 0;
    if (T == 1) {
        for (; j + 4 <= m; j += 4) dots_t1<W, false, 4>(rows + j, nullptr, x, D, out + j, unused);
        for (; j + 2 <= m; j += 2) dots_t1<W, false, 2>(rows + j, nullptr, x, D, out + j, unused);
    }
    for (; j < m; ++j) dot_all_tokens<W, false>(rows[j], nullptr, x, T, D, out + j * T, unused);
}

// Gate first (a threshold on |SiLU(gate)|): the gate dots of idx entries k0 .. k0+m-1 (m <= R),
// then the up dots of only those rows whose gate passes for some masked-in token. The others
// keep u = 0: their h is zero, so neither their up nor their down row is read. u, g [m, T].
template <class W>
void gate_first_block(const Args& a, int64_t k0, int m, float* u, float* g) {
    typedef typename W::T WT;
    const int64_t T = a.T, D = a.D;
    const WT* rows[R];
    int at[R], n = 0;
    for (int j = 0; j < m; ++j) rows[j] = (const WT*)a.gate + row_id(a, k0 + j) * a.ld_gate;
    dot_rows_of<W>(rows, m, xin<W>(a), T, D, g);
    for (int j = 0; j < m; ++j) {
        int pass = 0;  // masked-in tokens whose gate passes
        for (int64_t t = 0; t < T; ++t) pass += mask_at(a, t, k0 + j) && gate_passes(a, g[j * T + t]);
        for (int64_t t = 0; t < T; ++t) u[j * T + t] = 0.f;
        if (pass) {
            rows[n] = (const WT*)a.up + row_id(a, k0 + j) * a.ld_up;
            at[n++] = j;
            if (a.up_read) a.up_read[k0 + j] = (uint8_t)pass;
        }
    }
    float ub[R * 64];
    dot_rows_of<W>(rows, n, xin<W>(a), T, D, ub);
    for (int i = 0; i < n; ++i) std::memcpy(u + at[i] * T, ub + i * T, T * sizeof(float));
}

// Pre-activations of idx entries k0 .. k0+m-1 (m <= R): u, g [m, T] (row j at j * T). Each row's
// up / gate are streamed once. Entries k0+m .. kend-1 come next: at T = 1 each group of quantized
// rows prefetches the next group's rows at the offset its own dots have reached, so a group's
// streams start in cache rather than each at a miss (fp16 rows, 3.6x as long as Q4_0's, gained
// nothing: bench/RESULTS.md); a single row prefetches the next entry's heads.
template <class W, bool GATE>
void dot_block(const Args& a, int64_t k0, int m, int64_t kend, float* u, float* g, const Pf* pf = nullptr) {
    if constexpr (GATE) {
        if (a.thr_on == THR_GATE) {
            gate_first_block<W>(a, k0, m, u, g);
            return;
        }
    }
    for (int j = 0; j < m; ++j) mark_up(a, k0 + j);
    typedef typename W::T WT;
    const WT* up = (const WT*)a.up;
    const WT* gate = (const WT*)a.gate;
    const int64_t T = a.T, D = a.D;
    auto row_up = [&](int64_t r) { return up + r * a.ld_up; };
    auto row_gate = [&](int64_t r) { return GATE ? gate + r * a.ld_gate : nullptr; };
    auto prefetch_heads = [&](int64_t r) {  // start a row's up / gate streams ahead of its dot
        if (r < 0) return;
        for (int l = 0; l < PF_LINES; ++l) {
            __builtin_prefetch((const char*)row_up(r) + 64 * l);
            if (GATE) __builtin_prefetch((const char*)row_gate(r) + 64 * l);
        }
    };
    auto entry = [&](int j) { return k0 + j < kend ? row_id(a, k0 + j) : -1; };
    auto ahead = [&](int j, int n) {  // quantized: the up / gate rows of entries j .. j+n-1 that exist
        Pf p{{}, 0};
        if constexpr (!W::QUANT) return p;
        for (int i = 0; i < n && k0 + j + i < kend; ++i) {
            const int64_t r = row_id(a, k0 + j + i);
            p.p[p.n++] = (const char*)row_up(r);
            if (GATE) p.p[p.n++] = (const char*)row_gate(r);
        }
        return p;
    };
    int j = 0;
    if (T == 1)  // four rows per pass: eight weight streams with a gate, four without
        for (; j + 4 <= m; j += 4) {
            const int64_t r[4] = {row_id(a, k0 + j), row_id(a, k0 + j + 1), row_id(a, k0 + j + 2),
                                  row_id(a, k0 + j + 3)};
            const WT* ups[4] = {row_up(r[0]), row_up(r[1]), row_up(r[2]), row_up(r[3])};
            const WT* gates[4] = {row_gate(r[0]), row_gate(r[1]), row_gate(r[2]), row_gate(r[3])};
            const Pf next = ahead(j + 4, 4);
            dots_t1<W, GATE, 4>(ups, gates, xin<W>(a), D, u + j, g + j, next.n ? &next : nullptr);
        }
    if (T == 1)
        for (; j + 2 <= m; j += 2) {
            const int64_t r0 = row_id(a, k0 + j), r1 = row_id(a, k0 + j + 1);
            const WT* ups[2] = {row_up(r0), row_up(r1)};
            const WT* gates[2] = {row_gate(r0), row_gate(r1)};
            const Pf next = ahead(j + 2, 2);
            dots_t1<W, GATE, 2>(ups, gates, xin<W>(a), D, u + j, g + j, next.n ? &next : nullptr);
        }
    for (; j < m; ++j) {
        prefetch_heads(entry(j + 1));
        dot_all_tokens<W, GATE>(row_up(row_id(a, k0 + j)), row_gate(row_id(a, k0 + j)), xin<W>(a), T, D, u + j * T,
                                g + j * T, pf);
    }
}

// What to prefetch while idx entry k's dots run for T > 1 tokens: the up / gate rows of entry
// k + 1 (if < k1) and, with_down, entry k's own down row (its axpy follows the block).
template <class W, bool GATE>
Pf next_rows(const Args& a, int64_t k, int64_t k1, bool with_down) {
    typedef typename W::T WT;
    Pf pf{{}, 0};
    if (with_down) pf.p[pf.n++] = (const char*)((const WT*)a.down + row_id(a, k) * a.ld_down);
    if (k + 1 < k1) {
        const int64_t nx = row_id(a, k + 1);
        pf.p[pf.n++] = (const char*)((const WT*)a.up + nx * a.ld_up);
        if (GATE) pf.p[pf.n++] = (const char*)((const WT*)a.gate + nx * a.ld_gate);
    }
    return pf;
}

// act(gate[row] . x[t], up[row] . x[t] + b) for one token t (the few-tokens paths; idx entry k).
template <class W, bool GATE>
inline float token_act(const Args& a, int64_t k, int64_t row, float b, int t, const Pf* pf = nullptr) {
    typedef typename W::T WT;
    float u, g;
    if constexpr (GATE) {
        if (a.thr_on == THR_GATE) {  // gate first: the up row only when this token's gate passes
            float unused;  // a gateless dot's second output
            dot_all_tokens<W, false>((const WT*)a.gate + row * a.ld_gate, nullptr, xin<W>(a) + t * a.D, 1, a.D, &g,
                                     &unused, pf);
            if (!gate_passes(a, g)) return 0.f;
            mark_up(a, k);
            dot_all_tokens<W, false>((const WT*)a.up + row * a.ld_up, nullptr, xin<W>(a) + t * a.D, 1, a.D, &u,
                                     &unused);
            return act_of(a, u + b, g);
        }
    }
    mark_up(a, k);
    dot_all_tokens<W, GATE>((const WT*)a.up + row * a.ld_up, GATE ? (const WT*)a.gate + row * a.ld_gate : nullptr,
                            xin<W>(a) + t * a.D, 1, a.D, &u, &g, pf);
    return act_of(a, u + b, g);
}

// Row k for the tokens in ``bits`` only: per token u, g = up/gate . x[t], h = act, A[t] += h * down.
// The row's bytes come from memory once (first token, which prefetches pf's rows: the next row's
// up / gate and this row's down) and from cache after.
template <class W, bool GATE>
bool row_few_tokens(const Args& a, int64_t k, uint64_t bits, float* A, const Pf* pf = nullptr) {
    typedef typename W::T WT;
    const int64_t row = row_id(a, k), D = a.D;
    const WT* down = (const WT*)a.down + row * a.ld_down;
    const float b = a.bias ? bias_at(a, row) : 0.f;
    bool read = false;
    for (; bits; bits &= bits - 1, pf = nullptr) {
        const int t = __builtin_ctzll(bits);
        const float h = token_act<W, GATE>(a, k, row, b, t, pf);
        if (h != 0.f || a.keep_zero) {
            axpy_rows<W, 1>(&down, 1, &h, 1, 0, A + t * D, D, 0, D);
            read = true;
        }
    }
    return read;
}

// One thread's slice [k0, k1) of idx into its accumulator A [T, D]; returns the down rows read.
template <class W, bool GATE>
int64_t run_slice(const Args& a, int64_t k0, int64_t k1, float* A) {
    typedef typename W::T WT;
    const WT* down = (const WT*)a.down;
    const int64_t T = a.T, D = a.D;
    float ub[R * 64], gb[R * 64];  // T <= 64 per block of tokens, see pi_sparse_ffn
    float h[R * 64];
    const WT* rows[R];
    int64_t n_down = 0;
    for (int64_t kb = k0; kb < k1; kb += R) {
        const int m = (int)(kb + R < k1 ? R : k1 - kb);
        bool few[R] = {};
        if (T == 1) {
            dot_block<W, GATE>(a, kb, m, k1, ub, gb);
        } else {  // rows active for few tokens: those tokens alone, now; the others' dots for the block
            for (int j = 0; j < m; ++j) {
                uint64_t bits;
                few[j] = few_tokens(a, kb + j, &bits);
                const Pf pf = next_rows<W, GATE>(a, kb + j, k1, true);
                if (few[j]) n_down += row_few_tokens<W, GATE>(a, kb + j, bits, A, pf.n ? &pf : nullptr);
                else dot_block<W, GATE>(a, kb + j, 1, kb + j + 1, ub + j * T, gb + j * T, pf.n ? &pf : nullptr);
            }
        }
        int nr = 0;
        for (int64_t k = kb; k < kb + m; ++k) {
            if (few[k - kb]) continue;  // done above
            const int64_t row = row_id(a, k);
            const float* u = ub + (k - kb) * T;
            const float* g = gb + (k - kb) * T;
            float b = a.bias ? bias_at(a, row) : 0.f;
            bool any = false;
            for (int64_t t = 0; t < T; ++t) {
                float v = mask_at(a, t, k) ? act_of(a, u[t] + b, g[t]) : 0.f;
                h[nr * T + t] = v;
                any |= v != 0.f;
            }
            if (any || a.keep_zero) {  // all-zero activation: skip the down row (unless keep_zero)
                rows[nr] = down + row * a.ld_down;
                for (int l = 0; l < PF_LINES; ++l) __builtin_prefetch((const char*)rows[nr] + 64 * l);
                ++nr;
            }
        }
        if (nr) axpy_all_tokens<W>(rows, nr, h, T, A, D, 0, D);
        n_down += nr;
    }
    return n_down;
}

template <class W>
int64_t run_slice_w(const Args& a, int64_t k0, int64_t k1, float* A) {
    return a.gate ? run_slice<W, true>(a, k0, k1, A) : run_slice<W, false>(a, k0, k1, A);
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

// Columns d0 .. d1-1 of row t of x_src (dtype x_dt, row stride ld_x) -> x (fp32 [T, D]).
void convert_x(const Args& a, int64_t t, int64_t d0, int64_t d1) {
    float* o = (float*)a.x + t * a.D;
    if (a.x_dt == DT_F32) {
        std::memcpy(o + d0, (const float*)a.x_src + t * a.ld_x + d0, (d1 - d0) * sizeof(float));
        return;
    }
    const uint16_t* s = (const uint16_t*)a.x_src + t * a.ld_x;
    int64_t d = d0;
    if (a.x_dt == DT_F16) {
        for (; d + VW <= d1; d += VW) vstore(o + d, vload_f16(s + d));
        for (; d < d1; ++d) o[d] = f16_to_f32(s[d]);
    } else {
        for (; d + VW <= d1; d += VW) vstore(o + d, vload_bf16(s + d));
        for (; d < d1; ++d) o[d] = bf16_to_f32(s[d]);
    }
}

// Inside a parallel region: x_src -> x by all threads, in 1024-column pieces; ends with a barrier.
inline void convert_x_par(const Args& a, pool::Ctx& c) {
    if (!a.x_src) return;
    constexpr int64_t C = 1024;
    const int64_t nc = (a.D + C - 1) / C;
    c.for_static(a.T * nc, [&](int64_t j) {
        const int64_t t = j / nc, d0 = (j % nc) * C;
        convert_x(a, t, d0, d0 + C < a.D ? d0 + C : a.D);
    });
}

// Inside a parallel region: x (fp32) -> its Q8_0 form xq, in pieces of 1024 columns; ends with a barrier.
inline void quantize_x_par(const Args& a, pool::Ctx& c) {
    constexpr int64_t C = 1024;  // a multiple of QK
    const int64_t nc = (a.D + C - 1) / C;
    c.for_static(a.T * nc, [&](int64_t j) {
        const int64_t t = j / nc, d0 = (j % nc) * C, d1 = d0 + C < a.D ? d0 + C : a.D;
        quantize_into(a.x + t * a.D, d0, d1, a.xq + t * a.D, a.D);
    });
}

// Inside a parallel region: the activation phase 1 reads, ready for every thread.
template <class W>
inline void prepare_x(const Args& a, pool::Ctx& c) {
    convert_x_par(a, c);
    if constexpr (W::QUANT) quantize_x_par(a, c);
}

// ---- split over columns: phase 1 (rows over threads), barrier, phase 2 (columns over threads) ----
// Phase 1: rows k0 .. k1-1 of idx -> h[k, :] (activations of all tokens, 0 where masked) and
// nz[k] (any of them nonzero, or keep_zero: the down row is read); returns how many nz are set.
template <class W, bool GATE>
int64_t act_rows(const Args& a, int64_t k0, int64_t k1) {
    const int64_t T = a.T;
    int64_t n_down = 0;
    float ub[R * 64], gb[R * 64];
    for (int64_t k = k0; k < k1; ++k) {
        const int64_t row = row_id(a, k);
        const float b = a.bias ? bias_at(a, row) : 0.f;
        float* h = a.h + k * T;
        uint64_t bits;
        if (T > 1 && few_tokens(a, k, &bits)) {  // those tokens' dots alone (see few_tokens)
            bool any = false;
            for (int64_t t = 0; t < T; ++t) h[t] = 0.f;
            for (; bits; bits &= bits - 1) {
                const int t = __builtin_ctzll(bits);
                h[t] = token_act<W, GATE>(a, k, row, b, t);
                any |= h[t] != 0.f;
            }
            a.nz[k] = any || a.keep_zero;
            n_down += a.nz[k];
            continue;
        }
        if (T > 1) {  // this row's pre-activations (rows of a block may take the path above)
            const Pf pf = next_rows<W, GATE>(a, k, k1, false);
            dot_block<W, GATE>(a, k, 1, k + 1, ub, gb, pf.n ? &pf : nullptr);
        } else if ((k - k0) % R == 0) {  // T == 1: the next block's, in pairs
            const int m = (int)(k + R < k1 ? R : k1 - k);
            dot_block<W, GATE>(a, k, m, k1, ub, gb);
        }
        const float* u = ub + (T == 1 ? (k - k0) % R : 0) * T;
        const float* g = gb + (T == 1 ? (k - k0) % R : 0) * T;
        bool any = false;
        for (int64_t t = 0; t < T; ++t) {
            const float v = mask_at(a, t, k) ? act_of(a, u[t] + b, g[t]) : 0.f;
            h[t] = v;
            any |= v != 0.f;
        }
        a.nz[k] = any || a.keep_zero;
        n_down += a.nz[k];
    }
    return n_down;
}

// A block's rows one token at a time, each token's rows with a nonzero h alone: at T > 1 most
// rows of a batch's union are active for few tokens, and the token blocks would multiply zeros.
// rows / h as axpy_all_tokens takes them (h [nr, T]).
template <class W>
void axpy_nonzero(const typename W::T* const* rows, int nr, const float* h, int64_t T, float* A, int64_t D,
                  int64_t d0, int64_t d1) {
    const typename W::T* rt[R];
    float ht[R];
    for (int64_t t = 0; t < T; ++t) {
        int m = 0;
        for (int r = 0; r < nr; ++r)
            if (h[r * T + t] != 0.f) {
                rt[m] = rows[r];
                ht[m++] = h[r * T + t];
            }
        if (m) axpy_rows<W, 1>(rt, m, ht, 1, 0, A + t * D, D, d0, d1);
    }
}

// Phase 2: columns d0 .. d1-1 of every token's output from all rows with nz set, R rows at a
// time (the accumulator slice is loaded and stored once per R rows); each row's segment is read
// by this thread only, so every down row is read once in all. The next block's segment heads are
// prefetched while this block is added. A block whose nonzero activations are under a quarter of
// its rows x tokens adds them token by token (axpy_nonzero), others in token blocks.
template <class W>
void down_cols(const Args& a, int64_t d0, int64_t d1) {
    typedef typename W::T WT;
    const WT* down = (const WT*)a.down;
    const int64_t T = a.T, D = a.D, K = a.K;
    float* A = a.acc;
    for (int64_t t = 0; t < T; ++t) std::memset(A + t * D + d0, 0, (d1 - d0) * sizeof(float));
    const int64_t seg_lines = (W::bytes(d1 - d0) + 63) / 64;
    const int pf = seg_lines < PF_LINES ? (int)seg_lines : PF_LINES;
    auto prefetch_block = [&](int64_t q) {
        for (int j = 0; q < K && j < R; ++q)
            if (a.nz[q]) {
                const char* p = (const char*)(down + row_id(a, q) * a.ld_down) + W::bytes(d0);
                for (int l = 0; l < pf; ++l) __builtin_prefetch(p + 64 * l);
                ++j;
            }
    };
    const WT* rows[R];
    float hb[R * 64];
    int64_t p = 0;
    prefetch_block(0);
    for (;;) {
        int nr = 0;
        int64_t live = 0;  // nonzero activations of the block
        for (; p < K && nr < R; ++p)
            if (a.nz[p]) {
                rows[nr] = down + row_id(a, p) * a.ld_down;
                const float* hp = a.h + p * T;
                for (int64_t t = 0; t < T; ++t) live += (hb[nr * T + t] = hp[t]) != 0.f;
                ++nr;
            }
        if (!nr) break;
        prefetch_block(p);
        if (T > 1 && 4 * live < nr * T) axpy_nonzero<W>(rows, nr, hb, T, A, D, d0, d1);
        else axpy_all_tokens<W>(rows, nr, hb, T, A, D, d0, d1);
    }
    if (A != (float*)a.y)
        for (int64_t t = 0; t < T; ++t) store_out(a, t, d0, d1, A + t * D + d0);
}

constexpr int64_t CU = 32;  // phase 2 column unit: 64 B of fp16 / bf16, 128 B of fp32

template <class W>
void run_cols(const Args& a) {
    const int64_t K = a.K, D = a.D;
    // One row of phase 1 per thread at least; phase 2 needs no more threads than column units.
    int64_t nt = K < a.nthreads ? K : a.nthreads;
    const int64_t nunits = (D + CU - 1) / CU;
    nt = nt > nunits ? nunits : nt;
    nt = nt < 1 ? 1 : nt;
    pool::run((int)nt, [&](pool::Ctx& c) {
        const int64_t i = c.tid, n = c.n;
        prepare_x<W>(a, c);
        // Dynamic chunks of a few rows: balanced to a row (~T x 2 x D elements) and robust to a
        // preempted thread; fewer hand-outs when K is large.
        int64_t ch = K / (8 * n);
        ch = ch < 1 ? 1 : (ch > 8 ? 8 : ch);
        const int64_t nch = (K + ch - 1) / ch;
        int64_t n_down = 0;
        c.for_dynamic(nch, 1, [&](int64_t q) {
            const int64_t k0 = q * ch, k1 = k0 + ch < K ? k0 + ch : K;
            n_down += a.gate ? act_rows<W, true>(a, k0, k1) : act_rows<W, false>(a, k0, k1);
        });  // barrier: h and nz complete
        count_down(a, n_down);
        const int64_t u0 = nunits * i / n, u1 = nunits * (i + 1) / n;
        const int64_t d0 = u0 * CU, d1 = u1 * CU < D ? u1 * CU : D;
        if (d0 < d1) down_cols<W>(a, d0, d1);
    });
}

// ---- split over rows: chunks of 4R idx entries to threads, per-thread accumulators, reduction --
template <class W>
void run_rows(const Args& a) {
    const int64_t K = a.K, T = a.T, D = a.D;
    // Fewer threads for few rows: every thread costs a T x D accumulator in the reduction.
    int64_t nt = (K + 7) / 8;
    nt = nt < 1 ? 1 : (nt > a.nthreads ? a.nthreads : nt);
    const int64_t TD = T * D;
    float* scratch = a.scratch;
    pool::run((int)nt, [&](pool::Ctx& c) {
        const int64_t i = c.tid, n = c.n;
        float* A = scratch + i * TD;
        std::memset(A, 0, TD * sizeof(float));
        prepare_x<W>(a, c);
        // Guided chunks (up to 4R rows, shrinking to single rows at the end): few hand-outs while
        // many rows are left, and an even finish, also when the OS preempts a thread (cores shared
        // with other processes).
        int64_t n_down = 0;
        c.for_guided(K, 4 * R, [&](int64_t k0, int64_t k1) { n_down += run_slice_w<W>(a, k0, k1, A); });
        // barrier: every accumulator complete
        count_down(a, n_down);
        // Reduction over threads, split over D in chunks of 256 columns, one chunk per claim.
        constexpr int64_t C = 256;
        float buf[C];
        const int64_t nchunks = (D + C - 1) / C;
        c.for_dynamic(T * nchunks, 1, [&](int64_t q) {
            const int64_t t = q / nchunks, d0 = (q % nchunks) * C, d1 = d0 + C < D ? d0 + C : D;
            const float* src = scratch + t * D;
            for (int64_t d = d0; d < d1; ++d) buf[d - d0] = src[d];
            for (int64_t j = 1; j < n; ++j) {
                const float* s = scratch + j * TD + t * D;
                for (int64_t d = d0; d < d1; ++d) buf[d - d0] += s[d];
            }
            store_out(a, t, d0, d1, buf);
        });
    });
}

// Which split. auto: rows when every thread gets at least two R-row blocks (K >= 16 per thread:
// its dynamic chunks keep them all reading), else columns (few rows: every thread still has
// work, and no reduction).
inline int pick_split(int split, int64_t K, int nthreads) {
    if (split == SPLIT_ROWS || split == SPLIT_COLS) return split;
    return K >= 2 * (int64_t)R * nthreads ? SPLIT_ROWS : SPLIT_COLS;
}

template <class W>
void run_split(const Args& a, int split) {
    if (pick_split(split, a.K, a.nthreads) == SPLIT_ROWS) run_rows<W>(a);
    else run_cols<W>(a);
}

inline bool quantized(int w_dt) { return w_dt == DT_Q4_0 || w_dt == DT_Q8_0; }

// Weight dtype and row length the kernel takes: plain, or quantized with whole blocks per row.
inline bool weights_ok(int w_dt, int64_t D) { return w_dt >= 0 && w_dt <= DT_Q8_0 && (!quantized(w_dt) || D % QK == 0); }

// Scratch layout (bytes, each part 64-byte aligned): [per-thread accumulators nthreads x T x D
// fp32 (split rows only)] [h K x T fp32] [nz K] [acc T x D fp32 (y not fp32)] [x T x D fp32
// (bitmask entry)] [idx K int32 (bitmask entry)] [token bits K uint64 (bitmask entry)] [xq T x D
// fp32's space (quantized weights): the Q8_0 activation] [up_read K (bitmask entry)].
inline int64_t al64(int64_t b) { return (b + 63) / 64 * 64; }

struct Scratch {
    float *acc_rows, *h, *acc, *x, *xq;
    uint8_t *nz, *up_read;
    int32_t* idx;
    uint64_t* tok;
    int64_t bytes;
};

Scratch carve(void* base, int64_t T, int64_t D, int64_t K, int nthreads, int y_dt, int split, bool bitmask,
             bool quant) {
    Scratch s{};
    char* p = (char*)base;
    int64_t off = 0;
    auto take = [&](int64_t bytes) { char* r = p ? p + off : nullptr; off += al64(bytes); return r; };
    // the bitmask entry's K is any of 0 .. n (n = K here): auto may pick either split for it
    const bool both = bitmask && split == SPLIT_AUTO;
    const bool rows = both || pick_split(split, K, nthreads) == SPLIT_ROWS;
    const bool cols = both || !rows;
    s.acc_rows = (float*)take(rows ? (int64_t)nthreads * T * D * 4 : 0);
    s.h = (float*)take(cols ? K * T * 4 : 0);
    s.nz = (uint8_t*)take(cols ? K : 0);
    s.acc = (float*)take(cols && y_dt != DT_F32 ? T * D * 4 : 0);
    s.x = (float*)take(bitmask ? T * D * 4 : 0);
    s.idx = (int32_t*)take(bitmask ? K * 4 : 0);
    s.tok = (uint64_t*)take(bitmask && T > 1 ? K * 8 : 0);
    s.xq = (float*)take(quant ? T * D * 4 : 0);
    s.up_read = (uint8_t*)take(bitmask ? K : 0);
    s.bytes = off;
    return s;
}

// 8 bytes of a packed mask row from byte offset 8w (fewer at the end of the row: B - 8w).
inline uint64_t mask_word(const uint8_t* row, int64_t w, int64_t B) {
    uint64_t v = 0;
    const int64_t nb = B - 8 * w;
    std::memcpy(&v, row + 8 * w, nb >= 8 ? 8 : (size_t)nb);  // little-endian: byte j -> bits 8j..
    return v;
}

// Bits of word w that are neurons (< n): the padding bits of the last byte are ignored.
inline uint64_t valid_bits(int64_t w, int64_t n) {
    const int64_t left = n - 64 * w;
    return left >= 64 ? ~0ull : ((1ull << left) - 1);
}

// ---- dense rows: y[t, r] = W[r] . x[t] (the CPU executor's attention projections) -------------
// Rows r0 .. r1-1 of W [R, D] (row stride ld_w) against every token of x [T, D]; y is [T, R]. At
// T = 1 rows go four at a time (dotn_t1), as the gate-less FFN's phase 1 does.
template <class W>
void linear_rows(const float* x, int64_t T, int64_t D, const typename W::T* w, int64_t ld_w, int64_t R,
                 int64_t r0, int64_t r1, float* y) {
    float u[64], g[64];
    int64_t r = r0;
    if (T == 1)
        for (; r + 4 <= r1; r += 4) {
            const typename W::T* rows4[4] = {w + r * ld_w, w + (r + 1) * ld_w, w + (r + 2) * ld_w, w + (r + 3) * ld_w};
            dots_t1<W, false, 4>(rows4, nullptr, x, D, y + r, g);
        }
    for (; r < r1; ++r) {
        dot_all_tokens<W, false>(w + r * ld_w, nullptr, x, T, D, u, g);
        for (int64_t t = 0; t < T; ++t) y[t * R + r] = u[t];
    }
}

template <class W>
void linear_par(const float* x, int64_t T, int64_t D, const void* w, int64_t ld_w, int64_t R, float* y,
                int nthreads) {
    int64_t nt = (R + 3) / 4;
    nt = nt > nthreads ? nthreads : nt;
    int64_t ch = R / (8 * nt);  // ~8 dynamic chunks per thread, a multiple of 4 rows each
    ch = ch < 4 ? 4 : (ch + 3) / 4 * 4;
    const int64_t nch = (R + ch - 1) / ch;
    pool::run((int)nt, [&](pool::Ctx& c) {
        c.for_dynamic(nch, 1, [&](int64_t q) {
            const int64_t r0 = q * ch, r1 = r0 + ch < R ? r0 + ch : R;
            linear_rows<W>(x, T, D, (const typename W::T*)w, ld_w, R, r0, r1, y);
        });
    });
}

}  // namespace

#if PI_W >= 0
namespace pi {  // this unit's weight type

using W_OF_UNIT = std::conditional_t<PI_W == DT_F32, WF32, std::conditional_t<PI_W == DT_F16, WF16,
    std::conditional_t<PI_W == DT_BF16, WBF16, std::conditional_t<PI_W == DT_Q4_0, WQ4_0, WQ8_0>>>>;

#define PI_UNIT_NAME(base, k) PI_UNIT_NAME2(base, k)
#define PI_UNIT_NAME2(base, k) base##k
void PI_UNIT_NAME(run_w, PI_W)(const Args& a, int split) { run_split<W_OF_UNIT>(a, split); }
void PI_UNIT_NAME(linear_w, PI_W)(const float* x, int64_t T, int64_t D, const void* w, int64_t ld_w, int64_t R,
                                  float* y, int nthreads) {
    linear_par<W_OF_UNIT>(x, T, D, w, ld_w, R, y, nthreads);
}

}  // namespace pi
#else
namespace {

void run(const Args& a, int w_dt, int split) {
    switch (w_dt) {
        case DT_F32: pi::run_w0(a, split); break;
        case DT_F16: pi::run_w1(a, split); break;
        case DT_BF16: pi::run_w2(a, split); break;
        case DT_Q4_0: pi::run_w3(a, split); break;
        default: pi::run_w4(a, split); break;
    }
}

}  // namespace

extern "C" {

constexpr int64_t BAD_ARGS = -1000000000;

// Bytes of scratch the entry points below need (the same arguments; bitmask: K = n).
int64_t pi_scratch_bytes(int64_t T, int64_t D, int64_t K, int nthreads, int y_dt, int split, int bitmask, int w_dt) {
    if (T > 64) T = 64;
    return carve(nullptr, T, D, K, nthreads, y_dt, split, bitmask != 0, quantized(w_dt)).bytes;
}

// y [T, D] over the rows idx [K] (int32, or int64 when idx64) with mask none / bool [T, K] (row
// stride ld_mask) / int32 token bits [K]. x fp32 [T, D] dense. Weights w_dt: 0 fp32, 1 fp16, 2
// bf16, 3 Q4_0, 4 Q8_0 (quant.h; row strides ld_* in bytes, D a multiple of 32). split: 0 auto, 1
// rows, 2 columns. scratch: pi_scratch_bytes(T, D, K, nthreads, y_dt, split, 0, w_dt) bytes. T <= 64.
// thr_on: THR_NONE, or a SwiGLU activation threshold thr on |SiLU(g)| (THR_GATE: gate first) / |h|.
// Returns 0, or -(k+1) when idx[k] is outside [0, n_rows), or BAD_ARGS.
int64_t pi_sparse_ffn(const float* x, int64_t T, int64_t D,
                      const void* up, const void* gate, const void* down, int w_dt,
                      int64_t ld_up, int64_t ld_gate, int64_t ld_down, int64_t n_rows,
                      const void* bias, int bias_dt,
                      const void* idx, int idx64, int64_t K,
                      const void* mask, int mask_mode, int64_t ld_mask,
                      int act, void* y, int y_dt, void* scratch, int nthreads, int split, float thr, int thr_on) {
    if (T < 1 || T > 64 || D < 1 || K < 0 || nthreads < 1 || !weights_ok(w_dt, D) || y_dt < 0 || y_dt > 2 ||
        thr_on < THR_NONE || thr_on > THR_H || (thr_on == THR_GATE && !gate))
        return BAD_ARGS;
    const Scratch s = carve(scratch, T, D, K, nthreads, y_dt, split, false, quantized(w_dt));
    Args a{x, T, D, up, gate, down, ld_up, ld_gate, ld_down, bias, bias_dt, idx, idx64, K,
           mask, mask_mode, ld_mask, act, y, y_dt, s.acc_rows, nthreads, s.h, s.nz,
           y_dt == DT_F32 ? (float*)y : s.acc, nullptr, DT_F32, D};
    a.xq = s.xq;
    a.thr = thr;
    a.thr_on = thr_on;
    for (int64_t k = 0; k < K; ++k) {
        int64_t r = row_id(a, k);
        if (r < 0 || r >= n_rows) return -(k + 1);
    }
    run(a, w_dt, split);
    return 0;
}

// The CPU executor's exchange in one call: the packed mask uint8 [T, ceil(n/8)] (row stride
// ld_packed bytes; neuron j in bit j % 8 of byte j // 8; bits >= n ignored) is decoded here into
// the active rows (those set for any token) and per-token bits; x [T, D] (row stride ld_x) in
// fp32 / fp16 / bf16 is converted here. packed == nullptr: every one of the n rows, every token.
// Any T: tokens are run in blocks of 64. stats[0] = (token, neuron) pairs set, stats[1] = rows
// active for any of the T tokens (each read from up / gate once), stats[2] = down rows read
// (summed over the blocks of 64 tokens; rows whose activation is zero for every token of a block
// are skipped unless keep_zero). Weights as pi_sparse_ffn's. row_ids: neuron j of the mask is row
// row_ids[j] of up / gate / down and bias (int32 [n], each in [0, n_rows): the caller checks;
// nullptr: row j), so a shard can be rows of the model file's whole matrices, read in place.
// thr_on, thr: a SwiGLU activation threshold as pi_sparse_ffn's; stats[3] = rows whose up row was
// read (summed over the blocks; without a threshold on the gate, the rows of stats[1]), and with
// THR_GATE and no packed mask (gate-first over every row) stats[0] counts the (token, neuron)
// pairs whose gate passes. scratch: pi_scratch_bytes(T, D, n, nthreads, y_dt, split, 1, w_dt).
// Returns 0 or BAD_ARGS.
int64_t pi_sparse_ffn_bitmask(const void* x, int x_dt, int64_t ld_x, int64_t T, int64_t D,
                              const void* up, const void* gate, const void* down, int w_dt,
                              int64_t ld_up, int64_t ld_gate, int64_t ld_down, int64_t n_rows,
                              const void* bias, int bias_dt,
                              const uint8_t* packed, int64_t ld_packed, int64_t n, const int32_t* row_ids,
                              int act, void* y, int y_dt, void* scratch, int nthreads, int split,
                              int keep_zero, int64_t* stats, float thr, int thr_on) {
    if (T < 0 || D < 1 || n < 0 || (!row_ids && n > n_rows) || nthreads < 1 || !weights_ok(w_dt, D) ||
        y_dt < 0 || y_dt > 2 || x_dt < 0 || x_dt > 2 || ld_x < D || thr_on < THR_NONE || thr_on > THR_H ||
        (thr_on == THR_GATE && !gate))
        return BAD_ARGS;
    const int64_t B = (n + 7) / 8, nw = (B + 7) / 8;
    if (packed && ld_packed < B) return BAD_ARGS;
    const int64_t ysz = y_dt == DT_F32 ? 4 : 2;
    int64_t pairs = 0, rows = 0, n_down = 0, n_up = 0;
    const bool gate_first = !packed && thr_on == THR_GATE;  // pairs: those whose gate passes, counted below
    if (!packed) {
        pairs = gate_first ? 0 : T * n;
        rows = T ? n : 0;
    } else if (T > 64) {  // rows active for any token of all blocks
        for (int64_t w = 0; w < nw; ++w) {
            uint64_t u = 0;
            for (int64_t t = 0; t < T; ++t) u |= mask_word(packed + t * ld_packed, w, B);
            rows += __builtin_popcountll(u & valid_bits(w, n));
        }
    }
    for (int64_t t0 = 0; t0 < T; t0 += 64) {
        const int64_t Tc = T - t0 < 64 ? T - t0 : 64;
        // decode: idx = rows set for any token of the block, tok[k] = their token bits
        int64_t K = 0;
        const Scratch s = carve(scratch, Tc, D, n, nthreads, y_dt, split, true, quantized(w_dt));  // n rows
        if (packed) {
            uint64_t m[64];
            for (int64_t w = 0; w < nw; ++w) {
                const uint64_t valid = valid_bits(w, n);
                uint64_t u = 0;
                for (int64_t t = 0; t < Tc; ++t) {
                    m[t] = mask_word(packed + (t0 + t) * ld_packed, w, B) & valid;
                    u |= m[t];
                    pairs += __builtin_popcountll(m[t]);
                }
                while (u) {
                    const int b = __builtin_ctzll(u);
                    u &= u - 1;
                    s.idx[K] = row_ids ? row_ids[64 * w + b] : (int32_t)(64 * w + b);
                    if (Tc > 1) {
                        uint64_t tb = 0;
                        for (int64_t t = 0; t < Tc; ++t) tb |= ((m[t] >> b) & 1) << t;
                        s.tok[K] = tb;
                    }
                    ++K;
                }
            }
            if (T <= 64) rows = K;
        } else {
            for (int64_t k = 0; k < n; ++k) s.idx[k] = row_ids ? row_ids[k] : (int32_t)k;
            K = n;
        }
        void* yc = (char*)y + t0 * D * ysz;
        Args a{s.x, Tc, D, up, gate, down, ld_up, ld_gate, ld_down, bias, bias_dt, s.idx, 0, K,
               s.tok, packed && Tc > 1 ? MASK_BITS64 : MASK_NONE, 0, act, yc, y_dt, s.acc_rows, nthreads,
               s.h, s.nz, y_dt == DT_F32 ? (float*)yc : s.acc,
               (const char*)x + t0 * ld_x * (x_dt == DT_F32 ? 4 : 2), x_dt, ld_x,  // x converted in run
               keep_zero, &n_down, s.xq};
        a.thr = thr;
        a.thr_on = thr_on;
        a.up_read = s.up_read;
        std::memset(s.up_read, 0, K);
        run(a, w_dt, split);
        for (int64_t k = 0; k < K; ++k) {
            n_up += s.up_read[k] != 0;
            if (gate_first) pairs += s.up_read[k];
        }
    }
    if (stats) {
        stats[0] = pairs;
        stats[1] = rows;
        stats[2] = n_down;
        stats[3] = n_up;
    }
    return 0;
}

// Multi-threaded read of n floats (the host's DRAM read ceiling). Returns their sum. Each thread
// reads its share as 4 interleaved streams: one stream per core leaves the hardware prefetchers
// short of memory-level parallelism (the sparse kernel itself streams several rows at a time).
double pi_read_sum(const float* p, int64_t n, int nthreads) {
    std::vector<double> part(nthreads > 0 ? nthreads : 1, 0.0);
    pool::run(nthreads, [&](pool::Ctx& c) {
        const int64_t i = c.tid, nt = c.n;
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
        part[i] = s;
    });
    double total = 0.0;
    for (double v : part) total += v;
    return total;
}

// The worker threads (csrc/pool.h): spin for spin_us after each job before sleeping, and pin the
// caller to cpus[0] and worker i to cpus[i] (ncpus 0: no pinning). Returns the workers started.
int pi_pool_config(int64_t spin_us, const int32_t* cpus, int ncpus) {
    pool::Pool::get().config(spin_us < 0 ? 0 : spin_us, cpus, ncpus);
    return pool::Pool::get().workers();
}

// y [T, R] fp32 = x [T, D] fp32 times the rows of W [R, D] (w_dt as pi_sparse_ffn's; row stride
// ld_w >= a row, in elements, or bytes for quantized rows, whose x is quantized to Q8_0 first): a
// dense matrix-vector product, every row read once, rows over threads. T <= 64. Returns 0 or BAD_ARGS.
int64_t pi_linear(const float* x, int64_t T, int64_t D, const void* w, int w_dt, int64_t ld_w, int64_t R,
                  float* y, int nthreads) {
    if (T < 1 || T > 64 || D < 1 || R < 0 || nthreads < 1 || !weights_ok(w_dt, D)) return BAD_ARGS;
    if (ld_w < (w_dt == DT_Q4_0 ? WQ4_0::bytes(D) : w_dt == DT_Q8_0 ? WQ8_0::bytes(D) : D)) return BAD_ARGS;
    if (R == 0) return 0;
    if (quantized(w_dt)) {  // the Q8_0 activation, rows of D floats' space (qdot_core)
        thread_local std::vector<float> xq;
        if ((int64_t)xq.size() < T * D) xq.resize(T * D);
        for (int64_t t = 0; t < T; ++t) quantize_into(x + t * D, 0, D, xq.data() + t * D, D);
        x = xq.data();
    }
    switch (w_dt) {
        case DT_F32: pi::linear_w0(x, T, D, w, ld_w, R, y, nthreads); break;
        case DT_F16: pi::linear_w1(x, T, D, w, ld_w, R, y, nthreads); break;
        case DT_BF16: pi::linear_w2(x, T, D, w, ld_w, R, y, nthreads); break;
        case DT_Q4_0: pi::linear_w3(x, T, D, w, ld_w, R, y, nthreads); break;
        default: pi::linear_w4(x, T, D, w, ld_w, R, y, nthreads); break;
    }
    return 0;
}

// pi_sparse_ffn_bitmask with its 29 arguments in one int64 array, in its order (pointers as
// addresses, thr as the bits of a double): a prepared call (cpu_ffn.prepare_bitmask) fills the array
// once and sets T, scratch and nthreads per call, so ctypes converts one argument instead of 29.
int64_t pi_sparse_ffn_bitmask_argv(const int64_t* v) {
    auto P = [&](int i) { return (void*)(intptr_t)v[i]; };
    double thr;
    std::memcpy(&thr, &v[27], sizeof thr);
    return pi_sparse_ffn_bitmask(P(0), (int)v[1], v[2], v[3], v[4], P(5), P(6), P(7), (int)v[8], v[9], v[10], v[11],
                                 v[12], P(13), (int)v[14], (const uint8_t*)P(15), v[16], v[17], (const int32_t*)P(18),
                                 (int)v[19], P(20), (int)v[21], P(22), (int)v[23], (int)v[24], (int)v[25],
                                 (int64_t*)P(26), (float)thr, (int)v[28]);
}

// The CPU executor's serving loop (runtime/cpu_executor.py), on the channel's int64 header (its
// layout is runtime/channel.py's: the H_* below). It answers the requests it can alone: an FFN
// request (op 2) of a layer whose call was prepared (calls[layer], a pi_sparse_ffn_bitmask_argv
// array; nullptr: not prepared) for the request's mask width (n_mask[layer]), as the Python loop
// would: the kernel writes the channel's out, then the answer's times, status and resp_seq (last,
// with release order; none once the primary gave up, resp_seq ABORTED).
// ctl: [0] nonzero: return before the next request (another thread sets it), [1] threads,
// [2] scratch address and [3] its bytes (a request needing more goes back to the caller), [4] ns
// without a request before returning, [5] the channel's tokens.
// counters (int64 [14], added to before the answer is published): exchanges, tokens of layer 0,
// (token, neuron) pairs, rows, up rows, down rows, busy ns (request seen to answer), kernel ns; then
// of the decode exchanges (one token a sequence): exchanges, busy ns, kernel ns, rows, up rows, down rows.
// Returns the sequence number of a request left unanswered for the caller (>= 0), or, when none came
// within ctl[4] ns or ctl[0] was set, -1 - the last request it answered (or was given: `last`).
constexpr int H_REQ = 0, H_RESP = 1, H_OP = 2, H_LAYER = 3, H_NSEQ = 4, H_NTOK = 5, H_NMASK = 6, H_STATUS = 7,
              H_TSTART = 10, H_TEND = 11, H_BUSY = 13;
constexpr int64_t OP_FFN = 2, ABORTED = int64_t(1) << 62;

static int64_t monotonic_ns() {
    timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);  // time.monotonic_ns's clock: comparable across processes
    return int64_t(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

int64_t pi_serve(int64_t* hdr, int64_t last, int64_t* const* calls, const int64_t* n_mask, int64_t n_layers,
                 int64_t* ctl, int64_t* counters) {
    auto load = [](int64_t* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); };
    int64_t idle_from = monotonic_ns();
    for (uint32_t spins = 0;;) {
        if (load(&ctl[0])) return -1 - last;
        const int64_t seq = load(&hdr[H_REQ]);
        if (seq == last) {
            cpu_relax();
            if ((++spins & 1023) == 0 && monotonic_ns() - idle_from > ctl[4]) return -1 - last;
            continue;
        }
        const int64_t t0 = monotonic_ns();
        const int64_t l = hdr[H_LAYER], n_seq = hdr[H_NSEQ], T = hdr[H_NTOK];
        if (hdr[H_OP] != OP_FFN || l < 0 || l >= n_layers || !calls[l] || hdr[H_NMASK] != n_mask[l] || T < 1 ||
            T > ctl[5] || n_seq < 1)
            return seq;
        int64_t a[29], st[4] = {0, 0, 0, 0};
        std::memcpy(a, calls[l], sizeof a);
        a[3] = T, a[22] = ctl[2], a[23] = ctl[1], a[26] = (int64_t)(intptr_t)st;
        if (pi_scratch_bytes(T, a[4], a[17], (int)a[23], (int)a[21], (int)a[24], 1, (int)a[8]) > ctl[3]) return seq;
        const int64_t tk = monotonic_ns();
        if (pi_sparse_ffn_bitmask_argv(a) != 0) return seq;  // rejected before any work: the caller's path says why
        const int64_t t1 = monotonic_ns();
        const int64_t up = a[28] ? st[3] : st[1];  // with a threshold, the up rows it read
        const int64_t add[8] = {1, l == 0 ? T : 0, st[0], st[1], up, st[2], t1 - t0, t1 - tk};
        for (int i = 0; i < 8; ++i) counters[i] += add[i];
        if (T == n_seq) {
            const int64_t dec[6] = {1, t1 - t0, t1 - tk, st[1], up, st[2]};
            for (int i = 0; i < 6; ++i) counters[8 + i] += dec[i];
        }
        if (load(&hdr[H_RESP]) != ABORTED) {  // the answer last: whoever sees it sees the counters
            hdr[H_TSTART] = t0, hdr[H_TEND] = t1, hdr[H_BUSY] += t1 - t0, hdr[H_STATUS] = 0;
            __atomic_store_n(&hdr[H_RESP], seq, __ATOMIC_RELEASE);
        }
        last = seq;
        idle_from = monotonic_ns();
        spins = 0;
    }
}

// x [n] fp32 (n a multiple of 32) -> n / 32 ggml Q8_0 blocks (f16 d, 32 int8): the activation
// quantizer the kernels use, for tests against gguf-py. Returns 0 or BAD_ARGS.
int64_t pi_quantize_q8_0(const float* x, int64_t n, uint8_t* blocks) {
    if (n < 0 || n % QK) return BAD_ARGS;
    int8_t q[QK];
    float d;
    int32_t off[8];  // the block's Q4_0 offset lanes (unused here)
    for (int64_t b = 0; b < n / QK; ++b) {
        quantize_row_q8(x + b * QK, QK, q, &d, off);
        const uint16_t h = f32_to_f16(d);
        std::memcpy(blocks + b * WQ8_0::BB, &h, 2);
        std::memcpy(blocks + b * WQ8_0::BB + 2, q, QK);
    }
    return 0;
}

int pi_simd_width() { return VW; }

// The integer code of the quantized dots (quant.h): 0 scalar, 256 AVX2, 512 AVX-512BW, 513 with VNNI.
int pi_quant_isa() {
#if defined(__AVX512F__) && defined(__AVX512BW__)
#if defined(__AVX512VNNI__)
    return 513;
#else
    return 512;
#endif
#elif defined(PI_QSIMD)
    return 256;
#else
    return 0;
#endif
}

}  // extern "C"
#endif  // PI_W
