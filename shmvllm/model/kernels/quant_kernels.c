/* GEMM / GEMV on GGUF block-quantized weights with fp32 activations, and row dequantization.
 *
 * A weight is [n, k] as nn.Linear keeps it, each row a run of GGML blocks (Q4_0, Q4_1, Q8_0:
 * 32 values; Q4_K, Q5_K, Q6_K: 256; F16 / BF16 rows are handled as blocks of 32; Q5_0, Q5_1,
 * Q2_K, Q3_K, IQ4_NL, IQ4_XS and MXFP4 are dequantized in quant_formats.h). A block is
 * dequantized in registers to the exact fp32 values gguf.quants.dequantize (transformers' GGUF
 * loader) produces: the scale products are exact in fp32 (an fp16 scale has 11 significant
 * bits, the integer factors at most 13 together), so the only rounding is the one the
 * reference does too (Q4_1's "+ m", the K formats' "- dmin * m"), and contracting that into an
 * FMA rounds identically. The dot products accumulate in fp32 vectors; activations stay fp32.
 * The GEMV rows of most formats fold the block or sub-block constants out of the inner loop instead
 * (d * sum(q * x) + m * sum(x)): the same weights, the sum reassociated.
 *
 * Built four times from this one file (kernels/__init__.py): with AVX-512 (VW = 16; with and
 * without VNNI), with AVX2 + FMA (VW = 8) and for the baseline ISA (portable), through GCC's vector
 * extensions (the VNNI and AVX2 builds run Q2_K / Q3_K / Q4_1's GEMV on integer dot products, VNNI Q8_0's, AVX2 Q5_0 /
 * Q5_1's too: quant_int8.h), and picked at run time by what the CPU reports (shm_quant_cpu_supports). Compiled without
 * -ffast-math: no reassociation may touch the dequantization arithmetic.
 *
 * The GEMV takes up to FEW_ROWS activation rows (decoding), where the kernel should be bound by
 * reading the weights: each weight block is widened once into registers and multiplied into
 * every row. More rows (prefill, batched decode) run the blocked GEMM (gemm_blocked): it is bound by
 * the FMAs, and dequantizes each weight once per call into a cache-resident panel. Measured
 * single-threaded on Zen 4 (benchmarks/qgemm.py --threads 1 --cpu-time), the GEMMs of a
 * SmolLM2-135M step on its Q4_1 / Q8_0 blocks run at 1.02x the speed of oneDNN's packed fp32
 * GEMM at 64 rows (~90 GFLOP/s) and 0.93x at 512 rows. The AVX-512 VNNI build runs the blocked GEMM of
 * Q5_0 / Q5_1 / Q4_K on int8 dot products instead (quant_gemm_int8.h: x in two int8 pieces per
 * block of 32, to 2^-15 of its largest value).
 */
#if defined(__AVX2__) || defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifndef VW
#define VW 8
#endif

typedef float vf __attribute__((vector_size(VW * 4)));
typedef int32_t vi __attribute__((vector_size(VW * 4)));
typedef uint32_t vu __attribute__((vector_size(VW * 4)));
typedef uint8_t vb __attribute__((vector_size(VW)));
typedef int8_t vsb __attribute__((vector_size(VW)));
typedef uint16_t vh __attribute__((vector_size(VW * 2)));
typedef uint64_t vq __attribute__((vector_size(VW)));

/* GGML type ids (ggml.h). */
enum { T_F32 = 0, T_F16 = 1, T_Q4_0 = 2, T_Q4_1 = 3, T_Q8_0 = 8, T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14, T_BF16 = 30 };
enum { T_Q5_0 = 6, T_Q5_1 = 7, T_Q2_K = 10, T_Q3_K = 11, T_IQ4_NL = 20, T_IQ4_XS = 23, T_MXFP4 = 39 };
/* Not a GGML type: Q4_1 repacked at load in groups of 8 rows (q4_1_r8_block below says the layout). */
enum { T_Q4_1_R8 = 1003 };

#define FEW_ROWS 4
#define PARALLEL_MIN_WORK (1 << 16)

static inline float fp16_to_fp32(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#endif
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
    uint32_t bits;
    if (exp == 0) {
        const float v = (float)mant * 5.9604644775390625e-08f; /* 2^-24: subnormals, exact */
        memcpy(&bits, &v, 4);
        bits |= sign;
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (mant << 13);
    } else {
        bits = sign | ((exp + 112) << 23) | (mant << 13);
    }
    float out;
    memcpy(&out, &bits, 4);
    return out;
}

static inline uint16_t load_u16(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

static inline vf loadf(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* s in every lane (s - 0 is s for every s, so unlike 0 + s it folds to a broadcast) */
static inline vf splat(float s) { return s - (vf){0}; }

/* Sum of the lanes, as a tree of halves (a sequential sum is VW dependent scalar adds). */
typedef float vf8 __attribute__((vector_size(32)));
typedef float vf4 __attribute__((vector_size(16)));
static inline float hsum(vf v) {
#if VW == 16
    const vf8 h8 = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                   __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
#else
    const vf8 h8 = v;
#endif
    const vf4 h4 = __builtin_shufflevector(h8, h8, 0, 1, 2, 3) + __builtin_shufflevector(h8, h8, 4, 5, 6, 7);
    return (h4[0] + h4[2]) + (h4[1] + h4[3]);
}

/* VW bytes -> VW floats. GCC 12 scalarizes __builtin_convertvector from bytes to 32-bit lanes,
 * so the ISA builds widen with the instruction meant for it. */
#if VW == 16 && defined(__AVX512F__)
static inline vf bytes_to_float(vb b) {
    __m128i v;
    memcpy(&v, &b, 16);
    return (vf)_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(v));
}
static inline vf sbytes_to_float(vsb b) {
    __m128i v;
    memcpy(&v, &b, 16);
    return (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v));
}
#elif VW == 8 && defined(__AVX2__)
static inline vf bytes_to_float(vb b) {
    int64_t bits;
    memcpy(&bits, &b, 8);
    return (vf)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(bits)));
}
static inline vf sbytes_to_float(vsb b) {
    int64_t bits;
    memcpy(&bits, &b, 8);
    return (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_cvtsi64_si128(bits)));
}
#else
static inline vf bytes_to_float(vb b) {
    vf out;
    for (int i = 0; i < VW; i++) out[i] = (float)b[i];
    return out;
}
static inline vf sbytes_to_float(vsb b) {
    vf out;
    for (int i = 0; i < VW; i++) out[i] = (float)b[i];
    return out;
}
#endif

/* VW bytes -> VW int32 lanes */
#if VW == 16 && defined(__AVX512F__)
static inline vi bytes_to_int(vb b) {
    __m128i v;
    memcpy(&v, &b, 16);
    return (vi)_mm512_cvtepu8_epi32(v);
}
#elif VW == 8 && defined(__AVX2__)
static inline vi bytes_to_int(vb b) {
    int64_t bits;
    memcpy(&bits, &b, 8);
    return (vi)_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(bits));
}
#else
static inline vi bytes_to_int(vb b) {
    vi out;
    for (int i = 0; i < VW; i++) out[i] = b[i];
    return out;
}
#endif

static inline vf int_to_float(vi v) { return __builtin_convertvector(v, vf); }

/* Values per block and bytes per block of each format. */
static int block_values(int type) {
    switch (type) {
    case T_Q4_K: case T_Q5_K: case T_Q6_K: return 256;
    case T_Q2_K: case T_Q3_K: case T_IQ4_XS: return 256;
    default: return 32;
    }
}

static int block_bytes(int type) {
    switch (type) {
    case T_F32: return 128;
    case T_F16: case T_BF16: return 64;
    case T_Q4_0: return 18;
    case T_Q4_1: case T_Q4_1_R8: return 20;
    case T_Q8_0: return 34;
    case T_Q4_K: return 144;
    case T_Q5_K: return 176;
    case T_Q6_K: return 210;
    case T_Q5_0: return 22;
    case T_Q5_1: return 24;
    case T_Q2_K: return 84;
    case T_Q3_K: return 110;
    case T_IQ4_NL: return 18;
    case T_IQ4_XS: return 136;
    case T_MXFP4: return 17;
    default: return 0;
    }
}

/* ---- one block -> QK / VW vectors of fp32 weights ---- */

static inline void deq_q4_0(const uint8_t *blk, vf *w) {
    const vf d = splat(fp16_to_fp32(load_u16(blk)));
    const uint8_t *qs = blk + 2;
    for (int c = 0; c < 16 / VW; c++) {
        vb q;
        memcpy(&q, qs + c * VW, VW);
        /* q - 8 is exact in fp32, as in the reference's int8 arithmetic */
        w[c] = d * (bytes_to_float(q & 0x0f) - 8.0f);
        w[16 / VW + c] = d * (bytes_to_float(q >> 4) - 8.0f);
    }
}

static inline void deq_q4_1(const uint8_t *blk, vf *w) {
    const vf d = splat(fp16_to_fp32(load_u16(blk))), m = splat(fp16_to_fp32(load_u16(blk + 2)));
    const uint8_t *qs = blk + 4;
    for (int c = 0; c < 16 / VW; c++) {
        vb q;
        memcpy(&q, qs + c * VW, VW);
        w[c] = d * bytes_to_float(q & 0x0f) + m;
        w[16 / VW + c] = d * bytes_to_float(q >> 4) + m;
    }
}

static inline void deq_q8_0(const uint8_t *blk, vf *w) {
    const vf d = splat(fp16_to_fp32(load_u16(blk)));
    for (int c = 0; c < 32 / VW; c++) {
        vsb q;
        memcpy(&q, blk + 2 + c * VW, VW);
        w[c] = sbytes_to_float(q) * d;
    }
}

/* Q4_K / Q5_K: eight 6-bit scales and mins packed into 12 bytes. */
static inline void k_scale_min(const uint8_t *s, int j, uint8_t *sc, uint8_t *mn) {
    if (j < 4) {
        *sc = s[j] & 0x3f;
        *mn = s[j + 4] & 0x3f;
    } else {
        *sc = (s[j + 4] & 0x0f) | ((s[j - 4] >> 2) & 0x30);
        *mn = (s[j + 4] >> 4) | ((s[j] >> 2) & 0x30);
    }
}

static inline void deq_q4_k(const uint8_t *blk, vf *w) {
    const float d = fp16_to_fp32(load_u16(blk)), dmin = fp16_to_fp32(load_u16(blk + 2));
    const uint8_t *scales = blk + 4, *qs = blk + 16;
    for (int g = 0; g < 4; g++) {
        uint8_t sc0, m0, sc1, m1;
        k_scale_min(scales, 2 * g, &sc0, &m0);
        k_scale_min(scales, 2 * g + 1, &sc1, &m1);
        const vf d0 = splat(d * (float)sc0), dm0 = splat(dmin * (float)m0);
        const vf d1 = splat(d * (float)sc1), dm1 = splat(dmin * (float)m1);
        for (int c = 0; c < 32 / VW; c++) {
            vb bytes;
            memcpy(&bytes, qs + 32 * g + c * VW, VW);
            const vi q = bytes_to_int(bytes); /* nibbles taken apart in 32-bit lanes: no x86 byte shifts */
            w[(64 * g) / VW + c] = d0 * int_to_float(q & 0x0f) - dm0;
            w[(64 * g + 32) / VW + c] = d1 * int_to_float(q >> 4) - dm1;
        }
    }
}

static inline void deq_q5_k(const uint8_t *blk, vf *w) {
    const float d = fp16_to_fp32(load_u16(blk)), dmin = fp16_to_fp32(load_u16(blk + 2));
    const uint8_t *scales = blk + 4, *qh = blk + 16, *qs = blk + 48;
    for (int g = 0; g < 4; g++) {
        uint8_t sc0, m0, sc1, m1;
        k_scale_min(scales, 2 * g, &sc0, &m0);
        k_scale_min(scales, 2 * g + 1, &sc1, &m1);
        const vf d0 = splat(d * (float)sc0), dm0 = splat(dmin * (float)m0);
        const vf d1 = splat(d * (float)sc1), dm1 = splat(dmin * (float)m1);
        for (int c = 0; c < 32 / VW; c++) {
            vb q, h;
            memcpy(&q, qs + 32 * g + c * VW, VW);
            memcpy(&h, qh + c * VW, VW);
            const vb h0 = ((h >> (2 * g)) & 1) << 4, h1 = ((h >> (2 * g + 1)) & 1) << 4;
            w[(64 * g) / VW + c] = d0 * bytes_to_float((q & 0x0f) | h0) - dm0;
            w[(64 * g + 32) / VW + c] = d1 * bytes_to_float((q >> 4) | h1) - dm1;
        }
    }
}

/* Q6_K's q - 32 of values 128 h + 32 c + i .. + VW as floats: the low 4 bits are nibble c / 2 of
 * ql[64 h + 32 (c % 2) + i], the high 2 bits 2c of qh[32 h + i] (unpacked in 32-bit lanes) */
static inline vf q6_k_q(const uint8_t *ql, const uint8_t *qh, int h, int c, int i) {
    vb l, hb;
    memcpy(&l, ql + 64 * h + 32 * (c % 2) + i, VW);
    memcpy(&hb, qh + 32 * h + i, VW);
    return int_to_float((((bytes_to_int(l) >> (4 * (c / 2))) & 0x0f) | (((bytes_to_int(hb) >> (2 * c)) & 3) << 4)) - 32);
}

static inline void deq_q6_k(const uint8_t *blk, vf *w) {
    const uint8_t *ql = blk, *qh = blk + 128;
    const int8_t *scales = (const int8_t *)(blk + 192);
    const float d = fp16_to_fp32(load_u16(blk + 208));
    for (int h = 0; h < 2; h++) {
        for (int c = 0; c < 4; c++) {
            for (int i = 0; i < 32; i += VW) {
                const int e = 128 * h + 32 * c + i;
                const vf ds = splat(d * (float)scales[e / 16]);
                w[e / VW] = ds * q6_k_q(ql, qh, h, c, i);
            }
        }
    }
}

static inline void deq_f16(const uint8_t *blk, vf *w) {
    for (int c = 0; c < 32 / VW; c++) {
        vf v;
        for (int i = 0; i < VW; i++) v[i] = fp16_to_fp32(load_u16(blk + 2 * (c * VW + i)));
        w[c] = v;
    }
}

static inline void deq_bf16(const uint8_t *blk, vf *w) {
    for (int c = 0; c < 32 / VW; c++) {
        vh h;
        memcpy(&h, blk + 2 * c * VW, sizeof h);
        const vu bits = __builtin_convertvector(h, vu) << 16;
        memcpy(&w[c], &bits, sizeof bits);
    }
}

static inline void deq_f32(const uint8_t *blk, vf *w) { memcpy(w, blk, 128); }

#include "quant_formats.h"

/* ---- the blocked GEMM for more rows ----
 *
 * out[M, n] = x[M, k] @ W^T with W dequantized NR weight rows (output columns) at a time into a
 * panel that stays in L1/L2 while every activation row runs against it, so each weight is
 * dequantized once per call, whatever M. The panel keeps the NR rows' values of each run of
 * PANEL_K inputs together, [k / PANEL_K][NR][PANEL_K]: a block dequantizes into it with plain
 * vector stores, and the micro-kernel reads it in order at constant offsets. The activations
 * are packed once per call transposed into tiles of MR rows, [k][MR], so that the micro-kernel's
 * accumulators hold MR rows of one output column in MV vectors: per input value it loads MV
 * vectors of x and multiplies each of NR broadcast weights into them (NR * MV accumulators:
 * 24 of the 32 zmm registers with AVX-512, 12 of the 16 ymm with AVX2). */
#define PANEL_K 32
#if VW == 16
#define MV 4
#define NR 6
#elif defined(__AVX2__)
#define MV 2
#define NR 6
#else
#define MV 2
#define NR 4
#endif
#define MR (MV * VW)

/* r[0..VW) transposed in place: log2(VW) stages, each swapping the off-diagonal b x b blocks of
 * every 2b x 2b block with one two-source shuffle per vector. */
static inline __attribute__((always_inline)) void transpose(vf r[VW]) {
    vi lane;
    for (int l = 0; l < VW; l++) lane[l] = l;
    for (int b = VW / 2; b >= 1; b /= 2) {
        const vi high = (lane & b) != 0;                 /* -1 where lane l is in the upper half */
        const vi lo = lane + (high & (VW - b));           /* r[i] keeps its lower, takes r[j]'s lower */
        const vi hi = lane + (~high & b) + (high & VW);   /* r[j] takes r[i]'s upper, keeps its upper */
        for (int i = 0; i < VW; i++) {
            if (i & b) continue;
            const vf a = r[i], c = r[i + b];
            r[i] = __builtin_shuffle(a, c, lo);
            r[i + b] = __builtin_shuffle(a, c, hi);
        }
    }
}

/* rows x[0..rows) -> xt [k][width], rows past `rows` zero; VW x VW blocks transposed in registers */
static void pack_rows_t(float *xt, int width, const float *x, int64_t ldx, int64_t rows, int64_t k) {
    for (int r0 = 0; r0 < width; r0 += VW)
        for (int64_t k0 = 0; k0 < k; k0 += VW) {
            vf r[VW];
            for (int i = 0; i < VW; i++) r[i] = r0 + i < rows ? loadf(x + (r0 + i) * ldx + k0) : (vf){0};
            transpose(r);
            for (int t = 0; t < VW; t++) memcpy(xt + (k0 + t) * width + r0, &r[t], sizeof(vf));
        }
}

/* acc[j][v] = the tile's rows v * VW .. v * VW + VW of x . panel column j, over all k */
static inline __attribute__((always_inline)) void micro_tile(const int mv, const float *xt, const float *panel,
                                                             int64_t k, vf acc[NR][MV]) {
    const int width = mv * VW;
    for (int j = 0; j < NR; j++)
        for (int v = 0; v < mv; v++) acc[j][v] = (vf){0};
    for (int64_t g = 0; g < k / PANEL_K; g++) {
        const float *p = panel + g * (NR * PANEL_K), *xg = xt + g * PANEL_K * width;
#pragma GCC unroll 4
        for (int t = 0; t < PANEL_K; t++) {
            vf xv[MV];
            for (int v = 0; v < mv; v++) xv[v] = loadf(xg + t * width + v * VW);
            for (int j = 0; j < NR; j++) {
#if VW == 16 && defined(__AVX512F__)
                /* the weight broadcast from memory inside each FMA: measured ~10% faster on
                 * Zen 4 than the separate vbroadcastss into a register that gcc emits */
                for (int v = 0; v < mv; v++)
                    __asm__("vfmadd231ps %[w]%{1to16%}, %[x], %[acc]"
                            : [acc] "+v"(acc[j][v])
                            : [x] "v"(xv[v]), [w] "m"(p[j * PANEL_K + t]));
#else
                const vf wj = splat(p[j * PANEL_K + t]);
                for (int v = 0; v < mv; v++) acc[j][v] += xv[v] * wj;
#endif
            }
        }
    }
}

/* out[m, j] = acc + bias[j] + residual[m, j] for the tile's `rows` x `cols` (out may be residual) */
static inline void store_tile(vf acc[NR][MV], const int mv, float *out, int64_t ldo, int64_t rows, int64_t cols,
                              const float *bias, const float *residual, int64_t ldr) {
    float t[NR][MR];
    for (int j = 0; j < NR; j++)
        for (int v = 0; v < mv; v++) memcpy(&t[j][v * VW], &acc[j][v], sizeof(vf));
    for (int64_t m = 0; m < rows; m++)
        for (int64_t j = 0; j < cols; j++)
            out[m * ldo + j] = t[j][m] + (bias != NULL ? bias[j] : 0.0f) + (residual != NULL ? residual[m * ldr + j] : 0.0f);
}

/* ---- kernels, instantiated per format ---- */

/* out[m, j] (+)= x[m] . w[j] for up to four rows, each weight block dequantized once (the
 * generic row: any format with a DEQ). `xs` (per-block sums of x) is for the folded rows below;
 * the generic row does not use it. */
#define DEFINE_ROW(NAME, DEQ, QK, BB)                                                                          \
    static inline __attribute__((always_inline)) void NAME##_row(                                            \
        const int M, float *out, int64_t ldo, const float *x, int64_t ldx, const uint8_t *row, const float *bias, \
        const float *residual, int64_t ldr, int64_t j, int64_t k, const float *xs) {                            \
        (void)xs;                                                                                               \
        /* independent accumulator chains, so that one row is not one chain of dependent FMAs */ \
        const int NA = M <= 2 ? 4 : 2;                                                                          \
        vf acc[FEW_ROWS][4];                                                                                    \
        for (int m = 0; m < M; m++)                                                                             \
            for (int a = 0; a < NA; a++) acc[m][a] = (vf){0};                                                   \
        const int64_t blocks = k / QK;                                                                          \
        int64_t b = 0;                                                                                          \
        for (; b + 2 <= blocks; b += 2) {                                                                       \
            vf w0[QK / VW], w1[QK / VW];                                                                        \
            DEQ(row + b * BB, w0);                                                                              \
            DEQ(row + (b + 1) * BB, w1);                                                                        \
            for (int t = 0; t < QK / VW; t++)                                                                   \
                for (int m = 0; m < M; m++) {                                                                   \
                    const float *xm = x + m * ldx + b * QK + t * VW;                                            \
                    acc[m][(t & 1) % NA] += w0[t] * loadf(xm);                                                  \
                    acc[m][(2 + (t & 1)) % NA] += w1[t] * loadf(xm + QK);                                       \
                }                                                                                               \
        }                                                                                                       \
        for (; b < blocks; b++) {                                                                               \
            vf wv[QK / VW];                                                                                     \
            DEQ(row + b * BB, wv);                                                                              \
            for (int t = 0; t < QK / VW; t++)                                                                   \
                for (int m = 0; m < M; m++) acc[m][(t & 1) % NA] += wv[t] * loadf(x + m * ldx + b * QK + t * VW); \
        }                                                                                                       \
        const float add = bias != NULL ? bias[j] : 0.0f;                                                        \
        for (int m = 0; m < M; m++) {                                                                           \
            vf sum = acc[m][0];                                                                                 \
            for (int a = 1; a < NA; a++) sum += acc[m][a];                                                      \
            out[m * ldo + j] = hsum(sum) + add + (residual != NULL ? residual[m * ldr + j] : 0.0f);             \
        }                                                                                                       \
    }

/* The folded rows of the 32-value linear formats. A block's dot product is d * sum(q * x) (+ m *
 * sum(x) for Q4_1, with sum(x) per block computed once per call for all rows), so each weight
 * costs one widen, one convert and one FMA, and the block constants one FMA per block: about half
 * the vector work of dequantizing first (d * q + m, then * x). The sums are the dequantized
 * weights' dot product reassociated (fp32 rounding differs at the last bits, as any change of
 * summation order does). AVX-512 runs Q4_0 on the nibble rows below instead (and Q4_1 where it has
 * no VNNI); the VNNI and AVX2 builds run Q4_1 on quant_int8.h's integer rows. */
#if VW == 16 && defined(__AVX512F__)
/* the 16 bytes widened to 32-bit lanes once: & 15 gives the low nibbles, >> 4 the high ones */
static inline void nibbles_to_float(const uint8_t *qs, vf q[32 / VW]) {
    const __m512i wide = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)qs));
    q[0] = (vf)_mm512_cvtepi32_ps(_mm512_and_si512(wide, _mm512_set1_epi32(0x0f)));
    q[1] = (vf)_mm512_cvtepi32_ps(_mm512_srli_epi32(wide, 4));
}
static inline void int8s_to_float(const uint8_t *qs, vf q[32 / VW]) {
    q[0] = (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)qs)));
    q[1] = (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(qs + 16))));
}
#elif VW == 8 && defined(__AVX2__)
static inline void nibbles_to_float(const uint8_t *qs, vf q[32 / VW]) {
    const __m256i mask = _mm256_set1_epi32(0x0f);
    for (int c = 0; c < 2; c++) {
        const __m256i wide = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qs + 8 * c)));
        q[c] = (vf)_mm256_cvtepi32_ps(_mm256_and_si256(wide, mask));
        q[2 + c] = (vf)_mm256_cvtepi32_ps(_mm256_srli_epi32(wide, 4));
    }
}
static inline void int8s_to_float(const uint8_t *qs, vf q[32 / VW]) {
    for (int c = 0; c < 4; c++)
        q[c] = (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(qs + 8 * c))));
}
#else
static inline void nibbles_to_float(const uint8_t *qs, vf q[32 / VW]) {
    for (int c = 0; c < 16 / VW; c++) {
        vb b;
        memcpy(&b, qs + c * VW, VW);
        q[c] = bytes_to_float(b & 0x0f);
        q[16 / VW + c] = bytes_to_float(b >> 4);
    }
}
static inline void int8s_to_float(const uint8_t *qs, vf q[32 / VW]) {
    for (int c = 0; c < 32 / VW; c++) {
        vsb b;
        memcpy(&b, qs + c * VW, VW);
        q[c] = sbytes_to_float(b);
    }
}
#endif

/* xs[m * (k / g) + b] = sum of x[m][g b, g b + g), for runs of g = 16 or 32 */
static inline void block_sums(float *xs, int M, const float *x, int64_t ldx, int64_t k, int g) {
    for (int m = 0; m < M; m++)
        for (int64_t b = 0; b < k / g; b++) {
            vf s = loadf(x + m * ldx + g * b);
            for (int t = 1; t < g / VW; t++) s += loadf(x + m * ldx + g * b + t * VW);
            xs[m * (k / g) + b] = hsum(s);
        }
}

/* Q5_0 / Q5_1: the 16 nibble bytes at qs (values i and 16 + i) with the fifth bits of all 32
 * values in qh (little-endian uint32). AVX-512 ORs the fifth bits in as a lane mask (AVX2 runs these
 * rows on integer dot products: quant_int8.h). */
#if VW == 16 && defined(__AVX512F__)
static inline void q5_to_float(const uint8_t *qs, uint32_t qh, vf q[32 / VW]) {
    const __m512i wide = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)qs)), sixteen = _mm512_set1_epi32(16);
    const __m512i lo = _mm512_and_si512(wide, _mm512_set1_epi32(0x0f)), hi = _mm512_srli_epi32(wide, 4);
    q[0] = (vf)_mm512_cvtepi32_ps(_mm512_mask_or_epi32(lo, (__mmask16)qh, lo, sixteen));
    q[1] = (vf)_mm512_cvtepi32_ps(_mm512_mask_or_epi32(hi, (__mmask16)(qh >> 16), hi, sixteen));
}
#else
static inline void q5_to_float(const uint8_t *qs, uint32_t qh, vf q[32 / VW]) {
    for (int c = 0; c < 16 / VW; c++) {
        vb b;
        memcpy(&b, qs + c * VW, VW);
        const vu lanes = lane_ids() + (uint32_t)(c * VW);
        q[c] = int_to_float(bytes_to_int(b & 0x0f) | (vi)(((qh - (vu){0}) >> lanes & 1) << 4));
        q[16 / VW + c] = int_to_float(bytes_to_int(b >> 4) | (vi)(((qh - (vu){0}) >> (lanes + 16) & 1) << 4));
    }
}
#endif

/* Per format of blocks of 32: NAME##_d (the block's scale), NAME##_q (its 32 integers, or table
 * values, as floats) and NAME##_m (the constant per sum of x: w = d * q + m, m = -8 d for Q4_0's q - 8). */
static inline float fp16_d(const uint8_t *blk) { return fp16_to_fp32(load_u16(blk)); }
#define q4_0_d fp16_d
#define q4_1_d fp16_d
#define q8_0_d fp16_d
#define q5_0_d fp16_d
#define q5_1_d fp16_d
#define iq4_nl_d fp16_d
static inline void q4_0_q(const uint8_t *blk, vf q[32 / VW]) { nibbles_to_float(blk + 2, q); }
static inline float q4_0_m(const uint8_t *blk) { return -8.0f * fp16_to_fp32(load_u16(blk)); }
static inline void q4_1_q(const uint8_t *blk, vf q[32 / VW]) { nibbles_to_float(blk + 4, q); }
static inline float q4_1_m(const uint8_t *blk) { return fp16_to_fp32(load_u16(blk + 2)); }
static inline void q8_0_q(const uint8_t *blk, vf q[32 / VW]) { int8s_to_float(blk + 2, q); }
static inline float q8_0_m(const uint8_t *blk) { (void)blk; return 0.0f; }
static inline void q5_0_q(const uint8_t *blk, vf q[32 / VW]) { q5_to_float(blk + 6, load_u32(blk + 2), q); }
static inline float q5_0_m(const uint8_t *blk) { return -16.0f * fp16_to_fp32(load_u16(blk)); }
static inline void q5_1_q(const uint8_t *blk, vf q[32 / VW]) { q5_to_float(blk + 8, load_u32(blk + 4), q); }
static inline float q5_1_m(const uint8_t *blk) { return fp16_to_fp32(load_u16(blk + 2)); }

#ifdef TABLE_FOLDED_ROWS
/* IQ4_NL / MXFP4's table values, unscaled, of 16 bytes of nibbles (values i: low, 16 + i: high) */
static inline void iq4_nl_q(const uint8_t *blk, vf q[32 / VW]) { nibble_table_q(IQ4_VALUES, blk + 2, q); }
static inline float iq4_nl_m(const uint8_t *blk) { (void)blk; return 0.0f; }
static inline float mxfp4_d(const uint8_t *blk) { return e8m0_to_fp32_half(blk[0]); }
static inline void mxfp4_q(const uint8_t *blk, vf q[32 / VW]) { nibble_table_q(MXFP4_VALUES, blk + 1, q); }
static inline float mxfp4_m(const uint8_t *blk) { (void)blk; return 0.0f; }
#endif

/* BB-byte blocks of 32 (NAME##_q, NAME##_m above). Blocks go in pairs, each into its own
 * accumulator (two chains a row). */
#define FOLDED_BLOCK(NAME, BB, HAS_M, B, A)                                                                    \
    {                                                                                                           \
        const uint8_t *blk = row + (B) * BB;                                                                    \
        const vf d = splat(NAME##_d(blk));                                                                      \
        vf q[32 / VW];                                                                                          \
        NAME##_q(blk, q);                                                                                       \
        for (int m = 0; m < M; m++) {                                                                           \
            const float *xb = x + m * ldx + 32 * (B);                                                           \
            vf s = q[0] * loadf(xb);                                                                            \
            for (int t = 1; t < 32 / VW; t++) s += q[t] * loadf(xb + t * VW);                                    \
            A[m] += d * s;                                                                                      \
            if (HAS_M) macc[m] += NAME##_m(blk) * xs[m * blocks + (B)];                                         \
        }                                                                                                       \
    }
#define DEFINE_FOLDED_ROW(NAME, BB, HAS_M)                                                                     \
    static inline __attribute__((always_inline)) void NAME##_row(                                            \
        const int M, float *out, int64_t ldo, const float *x, int64_t ldx, const uint8_t *row, const float *bias, \
        const float *residual, int64_t ldr, int64_t j, int64_t k, const float *xs) {                            \
        vf acc0[FEW_ROWS], acc1[FEW_ROWS];                                                                      \
        float macc[FEW_ROWS];                                                                                   \
        for (int m = 0; m < M; m++) acc0[m] = acc1[m] = (vf){0}, macc[m] = 0.0f;                               \
        const int64_t blocks = k / 32;                                                                          \
        int64_t b = 0;                                                                                          \
        for (; b + 2 <= blocks; b += 2) {                                                                       \
            FOLDED_BLOCK(NAME, BB, HAS_M, b, acc0)                                                              \
            FOLDED_BLOCK(NAME, BB, HAS_M, b + 1, acc1)                                                          \
        }                                                                                                       \
        if (b < blocks) FOLDED_BLOCK(NAME, BB, HAS_M, b, acc0)                                                 \
        const float add = bias != NULL ? bias[j] : 0.0f;                                                        \
        for (int m = 0; m < M; m++)                                                                             \
            out[m * ldo + j] = (hsum(acc0[m] + acc1[m]) + macc[m]) + add +                                      \
                               (residual != NULL ? residual[m * ldr + j] : 0.0f);                               \
    }

#if VW == 16 && defined(__AVX512F__)
/* Q4_0 / Q4_1 rows on AVX-512 (Q4_1 without VNNI), the rows sharing each block's dequantization (the folded rows repeat
 * d * s and m * sum(x) per row): the block's 16 possible weights d * i + m (i = 0..15; Q4_0's m is
 * -8 d) made by one FMA, exactly the reference's values (d * i is exact, the sum rounded once), each
 * weight looked up by its nibble (vpermps reads the low 4 bits of each index), then one FMA per row
 * and vector. Each row sums into four chains, one per vector of a pair of blocks, in the same
 * order whatever M: a row comes out bit for bit the same alone or verified among others. */
#define NIBBLE_ROWS 1
static inline void nibble_weights(const uint8_t *blk, int qs, float d, float m, vf w[2]) {
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 table = _mm512_fmadd_ps(_mm512_set1_ps(d), iota, _mm512_set1_ps(m));
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk + qs)));
    w[0] = (vf)_mm512_permutexvar_ps(v, table);
    w[1] = (vf)_mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table);
}
#define NIBBLE_BLOCK(NAME, BB, QS, B, W) nibble_weights(row + (B) * BB, QS, NAME##_d(row + (B) * BB), NAME##_m(row + (B) * BB), W)
#define DEFINE_NIBBLE_ROW(NAME, BB, QS)                                                                        \
    static inline __attribute__((always_inline)) void NAME##_row(                                            \
        const int M, float *out, int64_t ldo, const float *x, int64_t ldx, const uint8_t *row, const float *bias, \
        const float *residual, int64_t ldr, int64_t j, int64_t k, const float *xs) {                            \
        (void)xs;                                                                                               \
        vf acc[FEW_ROWS][4];                                                                                    \
        for (int m = 0; m < M; m++) acc[m][0] = acc[m][1] = acc[m][2] = acc[m][3] = (vf){0};                   \
        const int64_t blocks = k / 32;                                                                          \
        int64_t b = 0;                                                                                          \
        for (; b + 2 <= blocks; b += 2) {                                                                       \
            vf w[4];                                                                                            \
            NIBBLE_BLOCK(NAME, BB, QS, b, w);                                                                  \
            NIBBLE_BLOCK(NAME, BB, QS, b + 1, w + 2);                                                          \
            for (int m = 0; m < M; m++)                                                                         \
                for (int t = 0; t < 4; t++) acc[m][t] += w[t] * loadf(x + m * ldx + 32 * b + 16 * t);           \
        }                                                                                                       \
        if (b < blocks) {                                                                                       \
            vf w[2];                                                                                            \
            NIBBLE_BLOCK(NAME, BB, QS, b, w);                                                                  \
            for (int m = 0; m < M; m++)                                                                         \
                for (int t = 0; t < 2; t++) acc[m][t] += w[t] * loadf(x + m * ldx + 32 * b + 16 * t);           \
        }                                                                                                       \
        const float add = bias != NULL ? bias[j] : 0.0f;                                                        \
        for (int m = 0; m < M; m++)                                                                             \
            out[m * ldo + j] = hsum((acc[m][0] + acc[m][1]) + (acc[m][2] + acc[m][3])) + add +                  \
                               (residual != NULL ? residual[m * ldr + j] : 0.0f);                               \
    }
#endif

/* Q2_K / Q3_K rows of the plain AVX-512 build (AVX2 and AVX-512 VNNI run them on integer dot
 * products: quant_int8.h), folded as the rows above: per sub-block of 16, the 2-bit (Q2_K) or
 * 3-bit (Q3_K) integers as floats times x, then times the sub-block's scale dl once; Q2_K's mins
 * as dmin * m times the sub-block's sum of x (once per call for all rows). The integers come from
 * a constant table in one register indexed by each value's 2 low bits, shifted into place in its
 * 32-bit lane (vpermilps reads the low 2 bits of a lane: the bits above need no mask); Q3_K's values with the high bit set are 4 higher, added under a lane mask. The scales
 * of a row are computed first, into memory the loop reads them from. */
#if VW == 16 && defined(__AVX512F__) && !defined(__AVX512VNNI__)
#define LOW_BIT_ROWS 1
static inline vf permute4(vf table, vi idx) { return (vf)_mm512_permutevar_ps((__m512)table, (__m512i)idx); }

static inline void low_bit_out(const int M, vf acc[FEW_ROWS][2], const float *macc, float *out, int64_t ldo,
                               const float *bias, const float *residual, int64_t ldr, int64_t j) {
    const float add = bias != NULL ? bias[j] : 0.0f;
    for (int m = 0; m < M; m++)
        out[m * ldo + j] = (hsum(acc[m][0] + acc[m][1]) - macc[m]) + add + (residual != NULL ? residual[m * ldr + j] : 0.0f);
}

/* the 2 * 16 / VW vectors of 16 values of field s (bits 2s, 2s + 1) of q[half * 16 / VW ..] looked
 * up in `table`, Q3_K's high bits (hmask bit hbit, hm != NULL) adding 4, times x, summed */
static inline vf sub_block_dot(vf table, const vi *q, int s, const uint8_t *hm, int hbit, const float *xe) {
    vf sum = (vf){0};
    for (int v = 0; v < 16 / VW; v++) {
        vf w = permute4(table, q[v] >> (2 * s));
        if (hm != NULL) {
            const __mmask16 high = _mm_test_epi8_mask(_mm_loadu_si128((const __m128i *)hm), _mm_set1_epi8((char)(1 << hbit)));
            w = (vf)_mm512_mask_add_ps((__m512)w, high, (__m512)w, _mm512_set1_ps(4.0f));
        }
        sum += w * loadf(xe + v * VW);
    }
    return sum;
}

static inline __attribute__((always_inline)) void q2_k_row(const int M, float *out, int64_t ldo, const float *x,
                                                           int64_t ldx, const uint8_t *row, const float *bias,
                                                           const float *residual, int64_t ldr, int64_t j, int64_t k,
                                                           const float *xs) {
    vf acc[FEW_ROWS][2];
    float macc[FEW_ROWS];
    vf mv[FEW_ROWS];
    for (int m = 0; m < M; m++) acc[m][0] = acc[m][1] = mv[m] = (vf){0};
    float dls[k / 16];
    for (int64_t b = 0; b < k / 256; b++) {
        const uint8_t *blk = row + b * 84;
        const vf d = splat(fp16_to_fp32(load_u16(blk + 80))), dmin = splat(fp16_to_fp32(load_u16(blk + 82)));
        for (int c = 0; c < 16 / VW; c++) {
            vb bytes;
            memcpy(&bytes, blk + c * VW, VW);
            const vi sc = bytes_to_int(bytes);
            const vf dl = d * int_to_float(sc & 0x0f), ml = dmin * int_to_float(sc >> 4);
            memcpy(dls + 16 * b + c * VW, &dl, sizeof dl);
            for (int m = 0; m < M; m++) mv[m] += ml * loadf(xs + m * (k / 16) + 16 * b + c * VW);
        }
    }
    for (int m = 0; m < M; m++) macc[m] = hsum(mv[m]);
    vf pat;
    for (int l = 0; l < VW; l++) pat[l] = (float)(l & 3);
    for (int64_t b = 0; b < k / 256; b++) {
        const uint8_t *qs = row + b * 84 + 16;
        for (int h = 0; h < 2; h++) {
            vi q[32 / VW];
            for (int v = 0; v < 32 / VW; v++) {
                vb bytes;
                memcpy(&bytes, qs + 32 * h + v * VW, VW);
                q[v] = bytes_to_int(bytes);
            }
            for (int s = 0; s < 4; s++)
                for (int half = 0; half < 2; half++) {
                    const vf dl = splat(dls[16 * b + 8 * h + 2 * s + half]);
                    for (int m = 0; m < M; m++)
                        acc[m][half] += dl * sub_block_dot(pat, q + half * (16 / VW), s, NULL, 0,
                                                           x + m * ldx + b * 256 + 128 * h + 32 * s + 16 * half);
                }
        }
    }
    low_bit_out(M, acc, macc, out, ldo, bias, residual, ldr, j);
}

static inline __attribute__((always_inline)) void q3_k_row(const int M, float *out, int64_t ldo, const float *x,
                                                           int64_t ldx, const uint8_t *row, const float *bias,
                                                           const float *residual, int64_t ldr, int64_t j, int64_t k,
                                                           const float *xs) {
    (void)xs;
    vf acc[FEW_ROWS][2];
    float macc[FEW_ROWS];
    for (int m = 0; m < M; m++) acc[m][0] = acc[m][1] = (vf){0}, macc[m] = 0.0f;
    float dls[k / 16];
    for (int64_t b = 0; b < k / 256; b++) {
        const uint8_t *blk = row + b * 110;
        const vf d = splat(fp16_to_fp32(load_u16(blk + 108)));
        uint8_t bytes16[16];
        q3_k_scales(blk + 96, bytes16);
        for (int c = 0; c < 16 / VW; c++) {
            vb bytes;
            memcpy(&bytes, bytes16 + c * VW, VW);
            const vf dl = d * int_to_float(bytes_to_int(bytes) - 32);
            memcpy(dls + 16 * b + c * VW, &dl, sizeof dl);
        }
    }
    vf pat;
    for (int l = 0; l < VW; l++) pat[l] = (float)((l & 3) - 4);
    for (int64_t b = 0; b < k / 256; b++) {
        const uint8_t *blk = row + b * 110, *qs = blk + 32;
        for (int h = 0; h < 2; h++) {
            vi q[32 / VW];
            for (int v = 0; v < 32 / VW; v++) {
                vb bytes;
                memcpy(&bytes, qs + 32 * h + v * VW, VW);
                q[v] = bytes_to_int(bytes);
            }
            for (int s = 0; s < 4; s++)
                for (int half = 0; half < 2; half++) {
                    const vf dl = splat(dls[16 * b + 8 * h + 2 * s + half]);
                    for (int m = 0; m < M; m++)
                        acc[m][half] += dl * sub_block_dot(pat, q + half * (16 / VW), s, blk + 16 * half, 4 * h + s,
                                                           x + m * ldx + b * 256 + 128 * h + 32 * s + 16 * half);
                }
        }
    }
    low_bit_out(M, acc, macc, out, ldo, bias, residual, ldr, j);
}
#endif

#if defined(__AVX512VNNI__) || (VW == 8 && defined(__AVX2__))
#define INT8_ROWS 1
#include "quant_int8.h"
#endif

/* Folded rows of the 256-value formats with a scale per sub-block (IQ4_XS, Q4_K, Q6_K): each
 * sub-block's integers (or table values) as floats, their dot product with x, times the
 * sub-block's scale once (and Q4_K's min times the sub-block's sum of x, computed once per call):
 * one sub-block in registers at a time (two whole 256-value blocks, as the generic row holds, are
 * 64 vectors: spilled on AVX2's 16 registers). The sums are reassociated, as in the rows above. */
static inline vf dot_run(const vf *q, const float *x, int n) {
    vf s = q[0] * loadf(x);
    for (int t = 1; t < n; t++) s += q[t] * loadf(x + t * VW);
    return s;
}

static inline void store_folded_out(const int M, vf acc[FEW_ROWS][2], const float *macc, float *out, int64_t ldo,
                                    const float *bias, const float *residual, int64_t ldr, int64_t j) {
    const float add = bias != NULL ? bias[j] : 0.0f;
    for (int m = 0; m < M; m++)
        out[m * ldo + j] = (hsum(acc[m][0] + acc[m][1]) + macc[m]) + add + (residual != NULL ? residual[m * ldr + j] : 0.0f);
}

/* IQ4_XS: d, the 2 high bits of eight 6-bit signed scales (one uint16), their 4 low bits, eight
 * runs of 32 values as IQ4_NL's nibbles (AVX-512: looked up in the table times d * scale) */
static inline __attribute__((always_inline)) void iq4_xs_row(const int M, float *out, int64_t ldo, const float *x,
                                                             int64_t ldx, const uint8_t *row, const float *bias,
                                                             const float *residual, int64_t ldr, int64_t j, int64_t k,
                                                             const float *xs) {
    (void)xs;
    vf acc[FEW_ROWS][2];
    float macc[FEW_ROWS];
    for (int m = 0; m < M; m++) acc[m][0] = acc[m][1] = (vf){0}, macc[m] = 0.0f;
    for (int64_t b = 0; b < k / 256; b++) {
        const uint8_t *blk = row + b * 136;
        const float d = fp16_to_fp32(load_u16(blk));
        const uint16_t scales_h = load_u16(blk + 2);
#ifdef TABLE_FOLDED_ROWS
        /* the eight scales times d in one pass of 32-bit lanes (lane r: scale r), not eight scalar
         * extractions and conversions */
        float dss[VW];
        const vi lane = (vi)lane_ids(); /* VW is 8 in the builds with these rows */
        const vi low = ((int32_t)load_u32(blk + 4) - (vi){0}) >> (lane * 4) & 0x0f;
        const vi high = ((int32_t)scales_h - (vi){0}) >> (lane * 2) & 3;
        const vf dsv = splat(d) * int_to_float((low | high << 4) - 32);
        memcpy(dss, &dsv, sizeof dss);
#endif
        for (int r = 0; r < 8; r++) {
#ifdef TABLE_FOLDED_ROWS
            const vf ds = splat(dss[r]);
            vf q[32 / VW];
            nibble_table_q(IQ4_VALUES, blk + 8 + 16 * r, q);
            for (int m = 0; m < M; m++) acc[m][r & 1] += ds * dot_run(q, x + m * ldx + b * 256 + 32 * r, 32 / VW);
#else
            const int scale = (((blk[4 + r / 2] >> (4 * (r % 2))) & 0x0f) | (((scales_h >> (2 * r)) & 3) << 4)) - 32;
            vf w[32 / VW];
            deq_nibble_table(IQ4_VALUES, d * (float)scale, blk + 8 + 16 * r, w);
            for (int m = 0; m < M; m++)
                for (int t = 0; t < 32 / VW; t++) acc[m][t & 1] += w[t] * loadf(x + m * ldx + b * 256 + 32 * r + t * VW);
#endif
        }
    }
    store_folded_out(M, acc, macc, out, ldo, bias, residual, ldr, j);
}

/* Q4_K: sub-blocks of 32, w = d sc q - dmin m; xs holds the sums of x per 32 */
static inline __attribute__((always_inline)) void q4_k_row(const int M, float *out, int64_t ldo, const float *x,
                                                           int64_t ldx, const uint8_t *row, const float *bias,
                                                           const float *residual, int64_t ldr, int64_t j, int64_t k,
                                                           const float *xs) {
    vf acc[FEW_ROWS][2];
    float macc[FEW_ROWS];
    for (int m = 0; m < M; m++) acc[m][0] = acc[m][1] = (vf){0}, macc[m] = 0.0f;
    const int64_t groups = k / 32;
    for (int64_t b = 0; b < k / 256; b++) {
        const uint8_t *blk = row + b * 144, *scales = blk + 4, *qs = blk + 16;
        const float d = fp16_to_fp32(load_u16(blk)), dmin = fp16_to_fp32(load_u16(blk + 2));
        for (int g = 0; g < 4; g++) {
            uint8_t sc0, m0, sc1, m1;
            k_scale_min(scales, 2 * g, &sc0, &m0);
            k_scale_min(scales, 2 * g + 1, &sc1, &m1);
            const vf d0 = splat(d * (float)sc0), d1 = splat(d * (float)sc1);
            const float mn0 = -dmin * (float)m0, mn1 = -dmin * (float)m1;
            vf lo[32 / VW], hi[32 / VW];
            for (int c = 0; c < 32 / VW; c++) {
                vb bytes;
                memcpy(&bytes, qs + 32 * g + c * VW, VW);
                const vi q = bytes_to_int(bytes);
                lo[c] = int_to_float(q & 0x0f);
                hi[c] = int_to_float(q >> 4);
            }
            for (int m = 0; m < M; m++) {
                const float *xb = x + m * ldx + b * 256 + 64 * g;
                acc[m][0] += d0 * dot_run(lo, xb, 32 / VW);
                acc[m][1] += d1 * dot_run(hi, xb + 32, 32 / VW);
                macc[m] += mn0 * xs[m * groups + 8 * b + 2 * g] + mn1 * xs[m * groups + 8 * b + 2 * g + 1];
            }
        }
    }
    store_folded_out(M, acc, macc, out, ldo, bias, residual, ldr, j);
}

/* Q6_K: sub-blocks of 16, w = d sc (q - 32) */
static inline __attribute__((always_inline)) void q6_k_row(const int M, float *out, int64_t ldo, const float *x,
                                                           int64_t ldx, const uint8_t *row, const float *bias,
                                                           const float *residual, int64_t ldr, int64_t j, int64_t k,
                                                           const float *xs) {
    (void)xs;
    vf acc[FEW_ROWS][2];
    float macc[FEW_ROWS];
    for (int m = 0; m < M; m++) acc[m][0] = acc[m][1] = (vf){0}, macc[m] = 0.0f;
    for (int64_t b = 0; b < k / 256; b++) {
        const uint8_t *blk = row + b * 210, *ql = blk, *qh = blk + 128;
        const int8_t *scales = (const int8_t *)(blk + 192);
        const float d = fp16_to_fp32(load_u16(blk + 208));
        for (int h = 0; h < 2; h++)
            for (int c = 0; c < 4; c++)
                for (int half = 0; half < 2; half++) {
                    vf q[16 / VW];
                    for (int v = 0; v < 16 / VW; v++) q[v] = q6_k_q(ql, qh, h, c, 16 * half + v * VW);
                    const vf ds = splat(d * (float)scales[8 * h + 2 * c + half]);
                    for (int m = 0; m < M; m++)
                        acc[m][half] += ds * dot_run(q, x + m * ldx + b * 256 + 128 * h + 32 * c + 16 * half, 16 / VW);
                }
    }
    store_folded_out(M, acc, macc, out, ldo, bias, residual, ldr, j);
}

/* Per format: NAME##_range (rows [j0, j1) of the output on the calling thread: what the decode
 * step's team runs), NAME##_few (the GEMV for up to FEW_ROWS rows, the rows split over the
 * threads), NAME##_deq_row, NAME##_panel. The row body is inlined with M a constant (so the
 * accumulators live in registers). XSUM: the row wants sums of x per run of XSUM values (0: none). */
#define DEFINE_RANGE(NAME, XSUM)                                                                               \
    static void NAME##_range(int M, float *out, int64_t ldo, const float *x, int64_t ldx, const uint8_t *w,      \
                             int64_t row_bytes, const float *bias, const float *residual, int64_t ldr, int64_t j0, \
                             int64_t j1, int64_t k) {                                                           \
        float xs[XSUM ? M * (k / (XSUM ? XSUM : 1)) : 1];                                                       \
        if (XSUM) block_sums(xs, M, x, ldx, k, XSUM);                                                           \
        for (int64_t j = j0; j < j1; j++) {                                                                     \
            const uint8_t *row = w + j * row_bytes;                                                             \
            switch (M) {                                                                                        \
            case 1: NAME##_row(1, out, ldo, x, ldx, row, bias, residual, ldr, j, k, xs); break;                 \
            case 2: NAME##_row(2, out, ldo, x, ldx, row, bias, residual, ldr, j, k, xs); break;                 \
            case 3: NAME##_row(3, out, ldo, x, ldx, row, bias, residual, ldr, j, k, xs); break;                 \
            default: NAME##_row(4, out, ldo, x, ldx, row, bias, residual, ldr, j, k, xs); break;                \
            }                                                                                                   \
        }                                                                                                       \
    }
#define DEFINE_FEW_DEQ(NAME, DEQ, QK, BB)                                                                      \
    static void NAME##_few(int M, float *out, int64_t ldo, const float *x, int64_t ldx, const uint8_t *w,        \
                           int64_t row_bytes, const float *bias, const float *residual, int64_t ldr, int64_t n,  \
                           int64_t k) {                                                                         \
        _Pragma("omp parallel if (n * k * M >= PARALLEL_MIN_WORK)")                                            \
        {                                                                                                       \
            const int64_t t = omp_get_thread_num(), threads = omp_get_num_threads();                            \
            NAME##_range(M, out, ldo, x, ldx, w, row_bytes, bias, residual, ldr, n * t / threads,               \
                         n * (t + 1) / threads, k);                                                             \
        }                                                                                                       \
    }                                                                                                           \
    static void NAME##_deq_row(const uint8_t *row, float *dst, int64_t k) {                                     \
        for (int64_t b = 0; b < k / QK; b++) {                                                                  \
            vf wv[QK / VW];                                                                                     \
            DEQ(row + b * BB, wv);                                                                              \
            memcpy(dst + b * QK, wv, sizeof wv);                                                                \
        }                                                                                                       \
    }                                                                                                           \
    static void NAME##_panel(const uint8_t *w, int64_t row_bytes, int64_t j0, int64_t cols, int64_t k,         \
                             float *panel) {                                                                    \
        for (int64_t c = 0; c < cols; c++)                                                                      \
            for (int64_t b = 0; b < k / QK; b++) {                                                              \
                vf wv[QK / VW];                                                                                 \
                DEQ(w + (j0 + c) * row_bytes + b * BB, wv);                                                     \
                for (int s = 0; s < QK / PANEL_K; s++)                                                          \
                    memcpy(panel + ((b * (QK / PANEL_K) + s) * NR + c) * PANEL_K, wv + s * (PANEL_K / VW),        \
                           PANEL_K * sizeof(float));                                                            \
            }                                                                                                   \
        for (int64_t g = 0; g < k / PANEL_K; g++)                                                               \
            memset(panel + (g * NR + cols) * PANEL_K, 0, (NR - cols) * PANEL_K * sizeof(float));                 \
    }
#define DEFINE_FORMAT(NAME, DEQ, QK, BB, XSUM) DEFINE_RANGE(NAME, XSUM) DEFINE_FEW_DEQ(NAME, DEQ, QK, BB)

#ifdef NIBBLE_ROWS
DEFINE_NIBBLE_ROW(q4_0, 18, 2)
#ifndef INT8_ROWS
DEFINE_NIBBLE_ROW(q4_1, 20, 4)
#endif
#define Q4_XSUM 0
#else
DEFINE_FOLDED_ROW(q4_0, 18, 1)
#ifndef INT8_ROWS
DEFINE_FOLDED_ROW(q4_1, 20, 1)
#endif
#define Q4_XSUM 32 /* the folded rows' m * sum(x) */
#endif
#ifndef INT8_Q8_ROWS
DEFINE_FOLDED_ROW(q8_0, 34, 0)
#endif
DEFINE_ROW(q5_k, deq_q5_k, 256, 176)
DEFINE_ROW(f16, deq_f16, 32, 64)
DEFINE_ROW(bf16, deq_bf16, 32, 64)
DEFINE_ROW(f32, deq_f32, 32, 128)
#ifndef INT8_Q5_ROWS
DEFINE_FOLDED_ROW(q5_0, 22, 1)
DEFINE_FOLDED_ROW(q5_1, 24, 1)
#endif
#if !defined(LOW_BIT_ROWS) && !defined(INT8_ROWS)
DEFINE_ROW(q2_k, deq_q2_k, 256, 84)
DEFINE_ROW(q3_k, deq_q3_k, 256, 110)
#endif
#ifdef TABLE_FOLDED_ROWS
DEFINE_FOLDED_ROW(iq4_nl, 18, 0)
DEFINE_FOLDED_ROW(mxfp4, 17, 0)
#else
DEFINE_ROW(iq4_nl, deq_iq4_nl, 32, 18)
DEFINE_ROW(mxfp4, deq_mxfp4, 32, 17)
#endif

DEFINE_FORMAT(q4_0, deq_q4_0, 32, 18, Q4_XSUM)
#ifdef INT8_ROWS
DEFINE_FEW_DEQ(q4_1, deq_q4_1, 32, 20)
#else
DEFINE_FORMAT(q4_1, deq_q4_1, 32, 20, Q4_XSUM)
#endif
#ifdef INT8_Q8_ROWS
DEFINE_FEW_DEQ(q8_0, deq_q8_0, 32, 34)
#else
DEFINE_FORMAT(q8_0, deq_q8_0, 32, 34, 0)
#endif
DEFINE_FORMAT(q4_k, deq_q4_k, 256, 144, 32)
DEFINE_FORMAT(q5_k, deq_q5_k, 256, 176, 0)
DEFINE_FORMAT(q6_k, deq_q6_k, 256, 210, 0)
DEFINE_FORMAT(f16, deq_f16, 32, 64, 0)
DEFINE_FORMAT(bf16, deq_bf16, 32, 64, 0)
DEFINE_FORMAT(f32, deq_f32, 32, 128, 0)
#ifdef INT8_Q5_ROWS
DEFINE_INT8_RANGE(q5_0, 32)
DEFINE_FEW_DEQ(q5_0, deq_q5_0, 32, 22)
DEFINE_INT8_RANGE(q5_1, 32)
DEFINE_FEW_DEQ(q5_1, deq_q5_1, 32, 24)
#else
DEFINE_FORMAT(q5_0, deq_q5_0, 32, 22, 32)
DEFINE_FORMAT(q5_1, deq_q5_1, 32, 24, 32)
#endif
#if defined(INT8_ROWS)
DEFINE_INT8_RANGE(q2_k, 256)
DEFINE_FEW_DEQ(q2_k, deq_q2_k, 256, 84)
DEFINE_INT8_RANGE(q3_k, 256)
DEFINE_FEW_DEQ(q3_k, deq_q3_k, 256, 110)
#elif defined(LOW_BIT_ROWS)
DEFINE_FORMAT(q2_k, deq_q2_k, 256, 84, 16)
DEFINE_FORMAT(q3_k, deq_q3_k, 256, 110, 0)
#else
DEFINE_FORMAT(q2_k, deq_q2_k, 256, 84, 0)
DEFINE_FORMAT(q3_k, deq_q3_k, 256, 110, 0)
#endif
DEFINE_FORMAT(iq4_nl, deq_iq4_nl, 32, 18, 0)
DEFINE_FORMAT(iq4_xs, deq_iq4_xs, 256, 136, 0)
DEFINE_FORMAT(mxfp4, deq_mxfp4, 32, 17, 0)

/* ---- Q4_1 repacked at load in groups of 8 rows (T_Q4_1_R8) ----
 * The interleave the 8-row pass (quant_int8.h) otherwise builds in registers from 8 rows, laid out
 * once: per group of 8 rows and per block, 160 bytes: dword t (t < 4) of the 8 rows' nibbles side
 * by side (row r at 32 t + 4 r), then the 8 rows' d, then their m (fp16). The groups follow one
 * another, so a GEMV reads one sequential stream, with no transposes and no scale words to
 * gather. The same bytes as the rows; a weight's rows are a multiple of 8. Only the builds with
 * the 8-row pass repack (shm_qrepack_type); every build runs a repacked weight. */
static inline void q4_1_r8_block(const uint8_t *w, int64_t row_bytes, int64_t j, int64_t b, uint8_t blk[20]) {
    const uint8_t *g = w + (j / 8) * 8 * row_bytes + 160 * b; /* row j's block b, as its plain 20 bytes */
    const int r = (int)(j % 8);
    memcpy(blk, g + 128 + 2 * r, 2);
    memcpy(blk + 2, g + 144 + 2 * r, 2);
    for (int t = 0; t < 4; t++) memcpy(blk + 4 + 4 * t, g + 32 * t + 4 * r, 4);
}

#ifndef Q4_1_R8_ROWS
/* builds without the 8-row pass: each row gathered back into its plain blocks and run as Q4_1 */
static void q4_1_r8_range(int M, float *out, int64_t ldo, const float *x, int64_t ldx, const uint8_t *w,
                          int64_t row_bytes, const float *bias, const float *residual, int64_t ldr, int64_t j0,
                          int64_t j1, int64_t k) {
    uint8_t row[row_bytes];
    for (int64_t j = j0; j < j1; j++) {
        for (int64_t b = 0; b < k / 32; b++) q4_1_r8_block(w, row_bytes, j, b, row + 20 * b);
        q4_1_range(M, out + j, ldo, x, ldx, row, row_bytes, bias != NULL ? bias + j : NULL,
                   residual != NULL ? residual + j : NULL, ldr, 0, 1, k);
    }
}
#endif

static void q4_1_r8_few(int M, float *out, int64_t ldo, const float *x, int64_t ldx, const uint8_t *w, int64_t row_bytes,
                        const float *bias, const float *residual, int64_t ldr, int64_t n, int64_t k) {
#pragma omp parallel if (n * k * M >= PARALLEL_MIN_WORK)
    {
        const int64_t t = omp_get_thread_num(), threads = omp_get_num_threads();
        q4_1_r8_range(M, out, ldo, x, ldx, w, row_bytes, bias, residual, ldr, n * t / threads, n * (t + 1) / threads, k);
    }
}

/* deq_q4_1's arithmetic, each row's nibbles read in place from the group (no plain block built) */
static void q4_1_r8_panel(const uint8_t *w, int64_t row_bytes, int64_t j0, int64_t cols, int64_t k, float *panel) {
    for (int64_t c = 0; c < cols; c++) {
        const int64_t j = j0 + c;
        const uint8_t *row = w + (j / 8) * 8 * row_bytes + 4 * (j % 8), *scales = row - 2 * (j % 8);
        for (int64_t b = 0; b < k / 32; b++) {
            const uint8_t *g = row + 160 * b;
            const vf d = splat(fp16_to_fp32(load_u16(scales + 160 * b + 128))), m = splat(fp16_to_fp32(load_u16(scales + 160 * b + 144)));
            float *dst = panel + (b * NR + c) * PANEL_K;
            for (int h = 0; h < 16 / VW; h++) {
                /* the nibbles split in 64-bit lanes: a shift of bytes has no AVX2 / AVX-512 instruction */
                uint64_t u[2];
                for (int i = 0; i < VW / 8; i++) {
                    uint32_t a, z;
                    memcpy(&a, g + 32 * (h * VW / 4 + 2 * i), 4);
                    memcpy(&z, g + 32 * (h * VW / 4 + 2 * i + 1), 4);
                    u[i] = a | (uint64_t)z << 32;
                }
#if VW == 16
                const vq q = {u[0], u[1]};
#else
                const vq q = {u[0]};
#endif
                const vb q_lo = (vb)(q & 0x0f0f0f0f0f0f0f0full), q_hi = (vb)((q >> 4) & 0x0f0f0f0f0f0f0f0full);
                const vf lo = d * bytes_to_float(q_lo) + m, hi = d * bytes_to_float(q_hi) + m;
                memcpy(dst + h * VW, &lo, sizeof lo);
                memcpy(dst + 16 + h * VW, &hi, sizeof hi);
            }
        }
    }
    for (int64_t g = 0; g < k / PANEL_K; g++) memset(panel + (g * NR + cols) * PANEL_K, 0, (NR - cols) * PANEL_K * sizeof(float));
}

/* The repacked type rows of `type` take in this build (T_Q4_1_R8 for Q4_1 where the 8-row pass is
 * built and n is a multiple of 8), or -1: they stay as they are. */
int shm_qrepack_type(int type, int64_t n) {
#ifdef Q4_1_R8_ROWS
    if (type == T_Q4_1 && n > 0 && n % 8 == 0) return T_Q4_1_R8;
#endif
    (void)type, (void)n;
    return -1;
}

/* dst (n * row_bytes bytes) = W [n, k] of `type`, rows `row_bytes` apart, in its repacked type's
 * layout. Returns that type, or -1 (nothing written) where shm_qrepack_type says none. */
int shm_qrepack(uint8_t *dst, const uint8_t *w, int64_t row_bytes, int type, int64_t n, int64_t k) {
    const int repacked = shm_qrepack_type(type, n);
    if (repacked < 0 || k % 32 != 0 || row_bytes != k / 32 * 20) return -1;
    for (int64_t g = 0; g < n / 8; g++)
        for (int64_t b = 0; b < k / 32; b++) {
            uint8_t *out = dst + g * 8 * row_bytes + 160 * b;
            for (int r = 0; r < 8; r++) {
                const uint8_t *blk = w + (8 * g + r) * row_bytes + 20 * b;
                memcpy(out + 128 + 2 * r, blk, 2);
                memcpy(out + 144 + 2 * r, blk + 2, 2);
                for (int t = 0; t < 4; t++) memcpy(out + 32 * t + 4 * r, blk + 4 + 4 * t, 4);
            }
        }
    return repacked;
}

typedef void (*few_fn)(int, float *, int64_t, const float *, int64_t, const uint8_t *, int64_t, const float *,
                       const float *, int64_t, int64_t, int64_t);
typedef void (*range_fn)(int, float *, int64_t, const float *, int64_t, const uint8_t *, int64_t, const float *,
                         const float *, int64_t, int64_t, int64_t, int64_t);
typedef void (*deq_row_fn)(const uint8_t *, float *, int64_t);
typedef void (*panel_fn)(const uint8_t *, int64_t, int64_t, int64_t, int64_t, float *);
typedef struct {
    few_fn few;
    range_fn range;
    deq_row_fn deq_row;
    panel_fn panel;
} format_fns;

#define FNS(NAME) (format_fns){NAME##_few, NAME##_range, NAME##_deq_row, NAME##_panel}
static int lookup(int type, format_fns *fns) {
    switch (type) {
    case T_Q4_0: *fns = FNS(q4_0); return 0;
    case T_Q4_1: *fns = FNS(q4_1); return 0;
    case T_Q4_1_R8: *fns = (format_fns){q4_1_r8_few, q4_1_r8_range, NULL, q4_1_r8_panel}; return 0; /* no row lookup */
    case T_Q8_0: *fns = FNS(q8_0); return 0;
    case T_Q4_K: *fns = FNS(q4_k); return 0;
    case T_Q5_K: *fns = FNS(q5_k); return 0;
    case T_Q6_K: *fns = FNS(q6_k); return 0;
    case T_F16: *fns = FNS(f16); return 0;
    case T_BF16: *fns = FNS(bf16); return 0;
    case T_F32: *fns = FNS(f32); return 0;
    case T_Q5_0: *fns = FNS(q5_0); return 0;
    case T_Q5_1: *fns = FNS(q5_1); return 0;
    case T_Q2_K: *fns = FNS(q2_k); return 0;
    case T_Q3_K: *fns = FNS(q3_k); return 0;
    case T_IQ4_NL: *fns = FNS(iq4_nl); return 0;
    case T_IQ4_XS: *fns = FNS(iq4_xs); return 0;
    case T_MXFP4: *fns = FNS(mxfp4); return 0;
    default: return -1;
    }
}

static void *alloc_floats(int64_t count) {
    const size_t bytes = ((size_t)count * sizeof(float) + 63) & ~(size_t)63;
    return aligned_alloc(64, bytes > 0 ? bytes : 64);
}

/* The blocked GEMM (see above) for any m_rows; -3 when out of memory. */
static int gemm_blocked(panel_fn panel_of, float *out, int64_t ldo, const float *x, int64_t ldx, const uint8_t *w,
                        int64_t row_bytes, const float *bias, const float *residual, int64_t ldr, int64_t m_rows,
                        int64_t n, int64_t k) {
    /* full tiles of MR rows, then the rest in one tile of as few vectors as hold it */
    const int64_t full = m_rows / MR, rest = m_rows % MR, tiles = full + (rest > 0);
    const int rest_mv = (int)((rest + VW - 1) / VW);
    float *xt = alloc_floats((full * MR + rest_mv * VW) * k);
    if (xt == NULL) return -3;
    const int64_t col_tiles = (n + NR - 1) / NR;
    int failed = 0;
#pragma omp parallel if (m_rows * n * k >= PARALLEL_MIN_WORK)
    {
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; t++)
            pack_rows_t(xt + t * MR * k, t < full ? MR : rest_mv * VW, x + t * MR * ldx, ldx, t < full ? MR : rest, k);
        float *panel = alloc_floats(NR * k);
        if (panel == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t c = 0; c < col_tiles; c++) {
            if (panel == NULL) continue;
            const int64_t j0 = c * NR, cols = n - j0 < NR ? n - j0 : NR;
            panel_of(w, row_bytes, j0, cols, k, panel);
            /* the next panel's blocks (this thread's next tile: static schedule) come from memory
             * while this one computes; in bursts as they are read, the hardware fetches them late */
            if (c + 1 < col_tiles) {
                const uint8_t *next = w + (j0 + NR) * row_bytes;
                const int64_t next_bytes = (n - j0 - NR < NR ? n - j0 - NR : NR) * row_bytes;
                for (int64_t off = 0; off < next_bytes; off += 64) __builtin_prefetch(next + off, 0, 3);
            }
            const float *b = bias != NULL ? bias + j0 : NULL;
            for (int64_t t = 0; t < tiles; t++) {
                const float *xtile = xt + t * MR * k;
                const float *res = residual != NULL ? residual + t * MR * ldr + j0 : NULL;
                float *o = out + t * MR * ldo + j0;
                const int64_t rows = t < full ? MR : rest;
                vf acc[NR][MV];
                switch (t < full ? MV : rest_mv) {
#define TILE(V)                                                                                                     \
    case V:                                                                                                         \
        micro_tile(V, xtile, panel, k, acc);                                                                        \
        store_tile(acc, V, o, ldo, rows, cols, b, res, ldr);                                                        \
        break;
                    TILE(1)
                    TILE(2)
#if MV > 2
                    TILE(3)
                    TILE(4)
#endif
#undef TILE
                }
            }
        }
        free(panel);
    }
    free(xt);
    return failed ? -3 : 0;
}

#ifdef __AVX512VNNI__
#include "quant_gemm_int8.h"
#endif

/* out[m, :n] = x[m, :k] @ W^T (+ bias) (+ residual[m]) for m < m_rows, W [n, k] in GGML `type`
 * blocks, rows `row_bytes` apart; out / x / residual rows `ldo` / `ldx` / `ldr` floats apart (out
 * may be residual). Up to FEW_ROWS rows the GEMV, more the blocked GEMM. Returns 0; -1 for an
 * unknown type or k not a multiple of the block; -3 when out of memory. */
int shm_qgemm(float *out, int64_t ldo, const float *x, int64_t ldx, const uint8_t *w, int64_t row_bytes, int type,
              const float *bias, const float *residual, int64_t ldr, int64_t m_rows, int64_t n, int64_t k) {
    format_fns fns;
    if (lookup(type, &fns) != 0 || k % block_values(type) != 0) return -1;
    if (m_rows <= 0 || n <= 0) return 0;
    if (m_rows <= FEW_ROWS) {
        fns.few((int)m_rows, out, ldo, x, ldx, w, row_bytes, bias, residual, ldr, n, k);
        return 0;
    }
#ifdef __AVX512VNNI__
    int has_m;
    if (i8_panel_of(type, &has_m) != NULL)
        return gemm_int8(type, out, ldo, x, ldx, w, row_bytes, bias, residual, ldr, m_rows, n, k);
#endif
    return gemm_blocked(fns.panel, out, ldo, x, ldx, w, row_bytes, bias, residual, ldr, m_rows, n, k);
}

/* out[i, :k] = dequantized row ids[i] of W, [n, k] (ids == NULL: rows 0..count-1). Returns 0,
 * -1 for an unknown type, -2 for an id outside [0, n) (nothing written then). */
int shm_qdequant_rows(float *out, const uint8_t *w, int64_t row_bytes, int type, const int64_t *ids, int64_t count,
                      int64_t n, int64_t k) {
    format_fns fns;
    if (lookup(type, &fns) != 0 || fns.deq_row == NULL || k % block_values(type) != 0) return -1;
    if (ids != NULL)
        for (int64_t i = 0; i < count; i++)
            if (ids[i] < 0 || ids[i] >= n) return -2;
#pragma omp parallel for schedule(static) if (count * k >= PARALLEL_MIN_WORK * 4)
    for (int64_t i = 0; i < count; i++) fns.deq_row(w + (ids != NULL ? ids[i] : i) * row_bytes, out + i * k, k);
    return 0;
}

/* Bytes of one block and values in it, so Python can check its tables against these. */
int shm_qblock_bytes(int type) { return block_bytes(type); }
int shm_qblock_values(int type) { return block_values(type); }
int shm_qvector_width(void) { return VW; }

/* 1 when this CPU runs the named build: 0 portable, 1 AVX2 + FMA + F16C, 2 AVX-512 F/BW/VL/DQ,
 * 3 that and AVX-512 VNNI. */
int shm_quant_cpu_supports(int isa) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    switch (isa) {
    case 0: return 1;
    case 1: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case 2:
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("avx512f") &&
               __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
               __builtin_cpu_supports("avx512dq");
    case 3: return shm_quant_cpu_supports(2) && __builtin_cpu_supports("avx512vnni");
    default: return 0;
    }
#else
    return isa == 0;
#endif
}
