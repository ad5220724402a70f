/* The blocked GEMM, on int8 dot products, of the formats of llama.cpp's K-quant recipes whose
 * blocks are 32 values w = s q + m with q a signed byte (Q5_0 q - 16, m = 0; Q5_1 q, m; Q4_K per
 * sub-block of 32, s = d sc, m = -dmin min): the AVX-512 VNNI build, vpdpbusd (64 byte products
 * an instruction, on Zen 4 about 2.4 times the products a second of fp32 FMAs). Included by
 * quant_kernels.c in that build; shm_qgemm runs it for more than FEW_ROWS rows, the prefill's GEMMs.
 *
 * x is split once per call, per block of 32 values, into two int8 pieces, x = d (a0 + a1 / 128)
 * with d = max |x| / 127 (split_x's first two pieces): they hold x to within d / 256, 2^-15 of the
 * block's largest value. (One piece, as llama.cpp's Q8_0 activations, within d / 2, runs 1.7x the
 * fp32 GEMM's speed against 1.2x, but moves the logits of the tiny test models by more than their
 * top-two margins.) Per block and output the integer sum of q (128 a0 + a1) is exact (below),
 * then scaled by s d / 128 in fp32, and m times the block's sum of x as the pieces hold it: every
 * weight sees the same x, so the result's error is sum |w| |x - pieces'| at most. Q4_0, Q4_1 and
 * Q8_0 keep the fp32 GEMM: on them SmolLM2-135M's 128 greedy tokens of benchmarks/latency.py left
 * transformers' at token 29 (all 128 equal with the fp32 GEMM).
 *
 * vpdpbusd multiplies unsigned bytes by signed ones, and broadcasts only its signed operand from
 * memory: the weights' q are that operand, 4 bytes broadcast in the instruction, and x's pieces
 * the unsigned vectors, stored as a + 128; the 128 (128 + 1) sum(q) that adds is subtracted per
 * block and column (|sum| <= 32 * 128 * (255 * 128 + 192) < 2^31). Vectors run over 16
 * activation rows. The weights of I8_PANEL output columns are unpacked once per call into a panel,
 * [block][column][32 q] with s, m and that correction per block and column, which every row tile
 * reuses; x is packed once per call, [block][quad of values][16-row vector][piece][16 rows x 4
 * bytes], with d / 128 and the held sum per block and row. A micro tile is I8_MV row vectors x
 * I8_NJ columns: 12 int32 accumulators for the block (piece 0's sum, shifted by 7, then piece
 * 1's), 12 fp32 ones for the whole sum. */

#define I8_PANEL 16 /* output columns per unpacked panel */
#define I8_NJ 4     /* output columns per micro tile */
#define I8_MV 3     /* 16-row vectors per micro tile */
#define I8_BIAS (128 * 128 + 128) /* what the pieces' + 128 add to 128 a0 + a1 */


/* 16 bytes of nibbles (values i: low, 16 + i: high) -> the 32 values' bytes */
static inline __m256i i8_nibbles(const uint8_t *qs) {
    const __m128i packed = _mm_loadu_si128((const __m128i *)qs), low4 = _mm_set1_epi8(0x0f);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(packed, 4), low4), _mm_and_si128(packed, low4));
}
/* the fifth bits (qh, value i at bit i) added as 16 under a byte mask */
static inline __m256i i8_q5(const uint8_t *qs, uint32_t qh) {
    const __m256i low = i8_nibbles(qs);
    return _mm256_mask_add_epi8(low, (__mmask32)qh, low, _mm256_set1_epi8(16));
}
static inline __attribute__((always_inline)) void i8_q5_0(const uint8_t *row, int64_t b, __m256i *q, float *s, float *m) {
    const uint8_t *blk = row + 22 * b;
    *q = _mm256_sub_epi8(i8_q5(blk + 6, load_u32(blk + 2)), _mm256_set1_epi8(16));
    *s = fp16_to_fp32(load_u16(blk));
    *m = 0.0f;
}
static inline __attribute__((always_inline)) void i8_q5_1(const uint8_t *row, int64_t b, __m256i *q, float *s, float *m) {
    const uint8_t *blk = row + 24 * b;
    *q = i8_q5(blk + 8, load_u32(blk + 4));
    *s = fp16_to_fp32(load_u16(blk));
    *m = fp16_to_fp32(load_u16(blk + 2));
}
/* Q4_K's sub-block b % 8 of super-block b / 8 */
static inline __attribute__((always_inline)) void i8_q4_k(const uint8_t *row, int64_t b, __m256i *q, float *s, float *m) {
    const uint8_t *blk = row + 144 * (b / 8);
    const int sub = (int)(b % 8);
    const __m256i bytes = _mm256_loadu_si256((const __m256i *)(blk + 16 + 32 * (sub / 2)));
    *q = _mm256_and_si256(sub % 2 ? _mm256_srli_epi16(bytes, 4) : bytes, _mm256_set1_epi8(0x0f));
    uint8_t sc, mn;
    k_scale_min(blk + 4, sub, &sc, &mn);
    *s = fp16_to_fp32(load_u16(blk)) * (float)sc;
    *m = -fp16_to_fp32(load_u16(blk + 2)) * (float)mn;
}

/* Row r of x: its two pieces + 128 packed (see above) into `vecs` 16-row vectors; per block, dx =
 * d / 128 and xs = the pieces' sum of x. `pieces`, `d`, `sums`: scratch of split_x for one row. */
static void i8_pack_row(const float *x, int64_t r, int64_t k, int64_t vecs, uint8_t *xp, float *dx, float *xs,
                        int8_t *pieces, float *d, float *sums) {
    const int64_t blocks = k / 32, v = r / 16, lane = r % 16;
    split_x(1, x, 0, k, 32, pieces, d, sums);
    for (int64_t b = 0; b < blocks; b++) {
        int8_t *a0 = pieces + 96 * b, *a1 = a0 + 32;
        int32_t held = 0;
        for (int i = 0; i < 32; i++) held += 128 * a0[i] + a1[i];
        for (int i = 0; i < 64; i++) a0[i] ^= (int8_t)0x80; /* + 128 as unsigned bytes */
        for (int t = 0; t < 8; t++) {
            uint8_t *dst = xp + ((b * 8 + t) * vecs + v) * 128 + 4 * lane;
            memcpy(dst, a0 + 4 * t, 4);
            memcpy(dst + 64, a1 + 4 * t, 4);
        }
        dx[b * vecs * 16 + r] = d[b] * (1.0f / 128.0f);
        xs[b * vecs * 16 + r] = d[b] * (1.0f / 128.0f) * (float)held; /* NaN d (x not finite): NaN */
    }
}

/* acc += the 4 signed bytes at base + off (broadcast) times the unsigned bytes of x, per 32-bit
 * lane: the broadcast in the instruction's memory operand, at a constant offset from one pointer
 * (with a plain load gcc hoists the broadcasts into registers; with "m", a pointer per offset) */
#define I8_DOT(acc, x, base, off)                                                                                \
    __asm__("vpdpbusd %c[o](%[p])%{1to16%}, %[xv], %[a]" : [a] "+v"(acc) : [xv] "v"(x), [p] "r"(base), [o] "i"(off), "m"(*(const int8_t(*)[I8_PANEL * 32])(base)))

/* acc[j][v] = rows 16 (v0 + v) .. + 16 of x . panel column j0 + j, j < I8_NJ, v < mv. */
static inline __attribute__((always_inline)) void i8_tile(const int mv, const int has_m, const uint8_t *xp,
                                                          const float *dx, const float *xs, int64_t vecs, int64_t v0,
                                                          const int8_t *pq, const float *ps, const float *pm,
                                                          const int32_t *pc, int j0, int64_t blocks,
                                                          __m512 acc[I8_NJ][I8_MV]) {
    for (int j = 0; j < I8_NJ; j++)
        for (int v = 0; v < mv; v++) acc[j][v] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        __m512i sum[I8_NJ][I8_MV];
        for (int j = 0; j < I8_NJ; j++)
            for (int v = 0; v < mv; v++) sum[j][v] = _mm512_setzero_si512();
        const int8_t *qb = pq + (b * I8_PANEL + j0) * 32;
#pragma GCC unroll 2
        for (int p = 0; p < 2; p++) {
            if (p == 1)
                for (int j = 0; j < I8_NJ; j++)
                    for (int v = 0; v < mv; v++) sum[j][v] = _mm512_slli_epi32(sum[j][v], 7);
#pragma GCC unroll 8
            for (int t = 0; t < 8; t++) {
                const uint8_t *xt = xp + ((b * 8 + t) * vecs + v0) * 128 + 64 * p;
                __m512i xv[I8_MV];
                for (int v = 0; v < mv; v++) xv[v] = _mm512_loadu_si512(xt + 128 * v);
#pragma GCC unroll 4
                for (int j = 0; j < I8_NJ; j++)
                    for (int v = 0; v < mv; v++) I8_DOT(sum[j][v], xv[v], qb, 32 * j + 4 * t);
            }
        }
        for (int v = 0; v < mv; v++) {
            const int64_t at = (b * vecs + v0 + v) * 16;
            const __m512 d = _mm512_loadu_ps(dx + at);
            for (int j = 0; j < I8_NJ; j++) {
                const int64_t c = b * I8_PANEL + j0 + j;
                const __m512i total = _mm512_sub_epi32(sum[j][v], _mm512_set1_epi32(pc[c]));
                acc[j][v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total), _mm512_mul_ps(d, _mm512_set1_ps(ps[c])), acc[j][v]);
                if (has_m) acc[j][v] = _mm512_fmadd_ps(_mm512_loadu_ps(xs + at), _mm512_set1_ps(pm[c]), acc[j][v]);
            }
        }
    }
}

/* Columns [j0, j0 + cols) of the weight into the panel (columns past cols zero), UNPACK giving a
 * block's 32 signed q (values in order), s and m; and I8_BIAS sum(q) per block and column. */
typedef void (*i8_panel_fn)(const uint8_t *w, int64_t row_bytes, int64_t j0, int64_t cols, int64_t blocks, int8_t *pq,
                            float *ps, float *pm, int32_t *pc);
#define DEFINE_I8_PANEL(NAME)                                                                                     \
    static void NAME##_i8_panel(const uint8_t *w, int64_t row_bytes, int64_t j0, int64_t cols, int64_t blocks,    \
                                int8_t *pq, float *ps, float *pm, int32_t *pc) {                                 \
        for (int64_t j = 0; j < I8_PANEL; j++)                                                                   \
            for (int64_t b = 0; b < blocks; b++) {                                                               \
                const int64_t c = b * I8_PANEL + j;                                                              \
                __m256i q = _mm256_setzero_si256();                                                              \
                ps[c] = pm[c] = 0.0f;                                                                            \
                if (j < cols) i8_##NAME(w + (j0 + j) * row_bytes, b, &q, ps + c, pm + c);                         \
                _mm256_storeu_si256((__m256i *)(pq + c * 32), q);                                                \
                /* sum(q): sums of 8 bytes of q + 128 (vpsadbw), less 32 * 128 */                                \
                const __m256i sad = _mm256_sad_epu8(_mm256_xor_si256(q, _mm256_set1_epi8(-128)), _mm256_setzero_si256()); \
                const __m128i s2 = _mm_add_epi64(_mm256_castsi256_si128(sad), _mm256_extracti128_si256(sad, 1)); \
                pc[c] = I8_BIAS * (_mm_cvtsi128_si32(_mm_add_epi64(s2, _mm_unpackhi_epi64(s2, s2))) - 32 * 128);  \
            }                                                                                                    \
    }
DEFINE_I8_PANEL(q5_0)
DEFINE_I8_PANEL(q5_1)
DEFINE_I8_PANEL(q4_k)

/* The format's panel function (NULL: it runs the fp32 GEMM); *has_m: whether its m can be nonzero. */
static i8_panel_fn i8_panel_of(int type, int *has_m) {
    *has_m = type == T_Q5_1 || type == T_Q4_K;
    switch (type) {
    case T_Q5_0: return q5_0_i8_panel;
    case T_Q5_1: return q5_1_i8_panel;
    case T_Q4_K: return q4_k_i8_panel;
    default: return NULL;
    }
}

/* The int8 GEMM (see above) of format `type` (i8_panel_of(type) not NULL); -3 when out of memory. */
static int gemm_int8(int type, float *out, int64_t ldo, const float *x, int64_t ldx, const uint8_t *w,
                     int64_t row_bytes, const float *bias, const float *residual, int64_t ldr, int64_t m_rows,
                     int64_t n, int64_t k) {
    int has_m;
    const i8_panel_fn panel_of = i8_panel_of(type, &has_m);
    const int64_t blocks = k / 32, vecs = (m_rows + 15) / 16;
    uint8_t *xp = aligned_alloc(64, (size_t)blocks * 8 * vecs * 128);
    float *dx = alloc_floats(blocks * vecs * 16), *xs = alloc_floats(blocks * vecs * 16);
    int failed = xp == NULL || dx == NULL || xs == NULL;
    if (!failed) {
        /* rows past m_rows: zeros, never stored */
        memset(xp, 0, (size_t)blocks * 8 * vecs * 128);
        memset(dx, 0, (size_t)blocks * vecs * 16 * sizeof(float));
        memset(xs, 0, (size_t)blocks * vecs * 16 * sizeof(float));
    }
    const int64_t panels = (n + I8_PANEL - 1) / I8_PANEL;
#pragma omp parallel if (!failed && m_rows * n * k >= PARALLEL_MIN_WORK)
    {
        int8_t *pq = failed ? NULL : aligned_alloc(64, (size_t)blocks * I8_PANEL * 32);
        float *ps = failed ? NULL : alloc_floats(blocks * I8_PANEL), *pm = failed ? NULL : alloc_floats(blocks * I8_PANEL);
        int32_t *pc = failed ? NULL : (int32_t *)alloc_floats(blocks * I8_PANEL);
        int8_t *pieces = failed ? NULL : malloc((size_t)blocks * 96);
        float *d = failed ? NULL : alloc_floats(blocks), *sums = failed ? NULL : alloc_floats(k / 16);
        const int ready = pq != NULL && ps != NULL && pm != NULL && pc != NULL && pieces != NULL && d != NULL && sums != NULL;
        if (!failed && !ready) {
#pragma omp atomic write
            failed = 1;
        }
        /* x packed by all threads, a row each (every thread writes its rows' own bytes) */
#pragma omp for schedule(static)
        for (int64_t r = 0; r < m_rows; r++)
            if (ready) i8_pack_row(x + r * ldx, r, k, vecs, xp, dx, xs, pieces, d, sums);
#pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; p++) {
            if (!ready) continue;
            const int64_t j0 = p * I8_PANEL, cols = n - j0 < I8_PANEL ? n - j0 : I8_PANEL;
            panel_of(w, row_bytes, j0, cols, blocks, pq, ps, pm, pc);
            for (int64_t v0 = 0; v0 < vecs; v0 += I8_MV) {
                const int mv = vecs - v0 < I8_MV ? (int)(vecs - v0) : I8_MV;
                for (int jt = 0; jt < cols; jt += I8_NJ) {
                    __m512 acc[I8_NJ][I8_MV];
                    switch (mv + (has_m ? I8_MV : 0)) {
#define I8_TILE(CASE, MVC, HAS_M)                                                                                   \
    case CASE: i8_tile(MVC, HAS_M, xp, dx, xs, vecs, v0, pq, ps, pm, pc, jt, blocks, acc); break;
                        I8_TILE(1, 1, 0)
                        I8_TILE(2, 2, 0)
                        I8_TILE(3, 3, 0)
                        I8_TILE(4, 1, 1)
                        I8_TILE(5, 2, 1)
                        I8_TILE(6, 3, 1)
#undef I8_TILE
                    }
                    for (int j = 0; j < I8_NJ && jt + j < cols; j++) {
                        const int64_t col = j0 + jt + j;
                        const float add = bias != NULL ? bias[col] : 0.0f;
                        for (int v = 0; v < mv; v++) {
                            float lanes[16];
                            _mm512_storeu_ps(lanes, acc[j][v]);
                            for (int i = 0; i < 16 && 16 * (v0 + v) + i < m_rows; i++) {
                                const int64_t r = 16 * (v0 + v) + i;
                                out[r * ldo + col] = lanes[i] + add + (residual != NULL ? residual[r * ldr + col] : 0.0f);
                            }
                        }
                    }
                }
            }
        }
        free(pq);
        free(ps);
        free(pm);
        free(pc);
        free(pieces);
        free(d);
        free(sums);
    }
    free(xp);
    free(dx);
    free(xs);
    return failed ? -3 : 0;
}
