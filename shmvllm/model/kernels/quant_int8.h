/* The GEMV rows of the 2- and 3-bit K formats (Q2_K, Q3_K) on integer dot products, for the build
 * with AVX-512 VNNI (vpdpbusd: 64 products of unsigned by signed bytes an instruction). Included
 * by quant_kernels.c in that build only; the plain AVX-512 build keeps the fp32 rows.
 *
 * With fp32 x and one FMA per weight these formats cannot be read as fast as Q4_1 (the work per
 * value is Q4_1's, their bytes per value a half and three quarters of it). Here x is split once
 * per call, per block of 256 values, into three int8 pieces, x = d (a0 + a1 / 128 + a2 / 16384)
 * with d = max |x| / 127 (each piece the rounded remainder of the ones before it): the pieces
 * hold x to within d / 32768, 2^-22 of the block's largest value, about fp32's own rounding of a
 * sum of such values (a single int8, llama.cpp's Q8_K, holds it to 2^-8). The three integer dot
 * products with the weights' integers are exact, and combined exactly (16384 A0 + 128 A1 + A2 in
 * int32: the bounds are below), then scaled in fp32. The pieces are stored in the order the
 * weights' bits unpack in (value 128 h + 32 s + i at byte 64 s + 32 h + i: one shift and mask of
 * a block's 64 bytes of 2-bit fields gives 64 values in that order), so no weight is moved. */

#define PIECES_BYTES 768 /* the three pieces of one block of 256 values */

/* Block b of row m's three pieces at xq + (m * blocks + b) * PIECES_BYTES, its d at xd[m * blocks + b],
 * the sums of the values the pieces hold per 16 at xs[m * k / 16 + ...] (for the mins / offsets:
 * then every weight sees the same x, and the result's error is sum |w| |x - pieces'| at most). */
static void split_x(int M, const float *x, int64_t ldx, int64_t k, int8_t *xq, float *xd, float *xs) {
    const int64_t blocks = k / 256;
    for (int m = 0; m < M; m++)
        for (int64_t b = 0; b < blocks; b++) {
            const float *xb = x + m * ldx + 256 * b;
            int8_t *q = xq + (m * blocks + b) * PIECES_BYTES;
            __m512 top = _mm512_setzero_ps();
            __mmask16 nan = 0;
            for (int t = 0; t < 16; t++) {
                const __m512 v = _mm512_loadu_ps(xb + 16 * t);
                top = _mm512_max_ps(top, _mm512_abs_ps(v));
                nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
            }
            const float amax = nan ? __builtin_nanf("") : _mm512_reduce_max_ps(top);
            if (!(amax > 0.0f && amax <= 3.4028235e38f)) {
                /* zeros give zero; inf / NaN give NaN (0 times it), as they would in fp32 */
                memset(q, 0, PIECES_BYTES);
                xd[m * blocks + b] = amax == 0.0f ? 0.0f : __builtin_nanf("");
                for (int t = 0; t < 16; t++) xs[m * (k / 16) + 16 * b + t] = xd[m * blocks + b];
                continue;
            }
            const float d = amax / 127.0f;
            const __m512 inv = _mm512_set1_ps(1.0f / d), dv = _mm512_set1_ps(d);
            const __m512 d1 = _mm512_set1_ps(d / 128.0f), inv1 = _mm512_set1_ps(128.0f / d);
            const __m512 inv2 = _mm512_set1_ps(16384.0f / d);
            for (int t = 0; t < 16; t++) {
                const int e = 16 * t, at = 64 * ((e % 128) / 32) + 32 * (e / 128) + e % 32;
                const __m512 v = _mm512_loadu_ps(xb + e);
                const __m512i a0 = _mm512_cvtps_epi32(_mm512_mul_ps(v, inv));
                const __m512 r1 = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(a0), dv, v);
                const __m512i a1 = _mm512_cvtps_epi32(_mm512_mul_ps(r1, inv1));
                const __m512 r2 = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(a1), d1, r1);
                const __m512i a2 = _mm512_cvtps_epi32(_mm512_mul_ps(r2, inv2));
                _mm_storeu_si128((__m128i *)(q + at), _mm512_cvtsepi32_epi8(a0));
                _mm_storeu_si128((__m128i *)(q + 256 + at), _mm512_cvtsepi32_epi8(a1));
                _mm_storeu_si128((__m128i *)(q + 512 + at), _mm512_cvtsepi32_epi8(a2));
                /* 16384 a0 + 128 a1 + a2 < 2^22 per value, < 2^26 per 16: exact in int32 */
                const __m512i held = _mm512_add_epi32(_mm512_slli_epi32(_mm512_add_epi32(_mm512_slli_epi32(a0, 7), a1), 7), a2);
                xs[m * (k / 16) + 16 * b + t] = (d * (1.0f / 16384.0f)) * (float)_mm512_reduce_add_epi32(held);
            }
            xd[m * blocks + b] = d;
        }
}

/* Field s (bits 2s, 2s + 1) of a block's 64 bytes of 2-bit values: values 32 s + i (bytes 0..31)
 * and 128 + 32 s + i (bytes 32..63), each 128-bit lane one sub-block of 16. */
static inline __m512i field2(__m512i qs, int s) {
    return _mm512_and_si512(_mm512_srli_epi16(qs, 2 * s), _mm512_set1_epi8(3));
}

/* The sub-block of 16 in 128-bit lane L of field s: 2s, 2s + 1, 8 + 2s, 9 + 2s. */
static inline int field_sub_block(int s, int lane) { return 8 * (lane / 2) + 2 * s + lane % 2; }

static inline void int8_row_out(const int M, const __m512 *acc, const float *macc, float *out, int64_t ldo,
                                const float *bias, const float *residual, int64_t ldr, int64_t j) {
    const float add = bias != NULL ? bias[j] : 0.0f;
    for (int m = 0; m < M; m++)
        out[m * ldo + j] = (_mm512_reduce_add_ps(acc[m]) - macc[m]) + add + (residual != NULL ? residual[m * ldr + j] : 0.0f);
}

/* Q2_K: w = d sc q - dmin m per sub-block of 16 (sc, m 4 bits; q 2 bits). The weight bytes are
 * sc q (at most 45), looked up per 128-bit lane in a table [0, sc, 2 sc, 3 sc] (vpshufb), so a
 * block's three int32 sums accumulate over all its 256 values: per lane at most 16 products of
 * 45 * 127 (a0) or 45 * 65 (a1, a2), so 16384 A0 + 128 A1 + A2 < 1.51e9 fits. The mins: dmin m
 * times the sub-block's sum of x (as the pieces hold it). */
static inline __attribute__((always_inline)) void q2_k_row_int8(const int M, float *out, int64_t ldo,
                                                                const int8_t *xq, const float *xd, const float *xs,
                                                                int64_t blocks, const uint8_t *row, const float *bias,
                                                                const float *residual, int64_t ldr, int64_t j) {
    __m512 acc[FEW_ROWS], mins[FEW_ROWS];
    for (int m = 0; m < M; m++) acc[m] = mins[m] = _mm512_setzero_ps();
    /* per field s: the words of each lane's scale (byte 0x80: zero), times 0x0100 and 0x0302: the
     * bytes 0, sc, 2 sc, 3 sc (no carries: 3 sc < 256) */
    __m512i pick[4];
    for (int s = 0; s < 4; s++) {
        int32_t lanes[16];
        for (int l = 0; l < 16; l++) {
            const int sb = field_sub_block(s, l / 4);
            lanes[l] = sb | 0x80 << 8 | sb << 16 | 0x80 << 24;
        }
        pick[s] = _mm512_loadu_si512(lanes);
    }
    const __m512i times = _mm512_set1_epi32(0x03020100);
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *blk = row + b * 84;
        const __m128i packed = _mm_loadu_si128((const __m128i *)blk);
        const __m512i scales = _mm512_broadcast_i32x4(_mm_and_si128(packed, _mm_set1_epi8(0x0f)));
        const __m512 dm = _mm512_mul_ps(_mm512_set1_ps(fp16_to_fp32(load_u16(blk + 82))),
                                        _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(packed, 4), _mm_set1_epi8(0x0f)))));
        for (int m = 0; m < M; m++) mins[m] = _mm512_fmadd_ps(dm, _mm512_loadu_ps(xs + (m * blocks + b) * 16), mins[m]);
        const __m512i qs = _mm512_loadu_si512(blk + 16);
        __m512i a0[FEW_ROWS], a1[FEW_ROWS], a2[FEW_ROWS];
        for (int m = 0; m < M; m++) a0[m] = a1[m] = a2[m] = _mm512_setzero_si512();
        for (int s = 0; s < 4; s++) {
            const __m512i table = _mm512_mullo_epi16(_mm512_shuffle_epi8(scales, pick[s]), times);
            const __m512i w = _mm512_shuffle_epi8(table, field2(qs, s));
            for (int m = 0; m < M; m++) {
                const int8_t *q = xq + (m * blocks + b) * PIECES_BYTES + 64 * s;
                a0[m] = _mm512_dpbusd_epi32(a0[m], w, _mm512_loadu_si512(q));
                a1[m] = _mm512_dpbusd_epi32(a1[m], w, _mm512_loadu_si512(q + 256));
                a2[m] = _mm512_dpbusd_epi32(a2[m], w, _mm512_loadu_si512(q + 512));
            }
        }
        const float d = fp16_to_fp32(load_u16(blk + 80)) * (1.0f / 16384.0f);
        for (int m = 0; m < M; m++) {
            const __m512i total = _mm512_add_epi32(_mm512_slli_epi32(_mm512_add_epi32(_mm512_slli_epi32(a0[m], 7), a1[m]), 7), a2[m]);
            acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total), _mm512_set1_ps(d * xd[m * blocks + b]), acc[m]);
        }
    }
    float macc[FEW_ROWS];
    for (int m = 0; m < M; m++) macc[m] = _mm512_reduce_add_ps(mins[m]);
    int8_row_out(M, acc, macc, out, ldo, bias, residual, ldr, j);
}

/* Q3_K: w = d (sc - 32) (q - 4) per sub-block of 16 (sc 6 bits, q 3: 2 low bits as Q2_K's and a
 * high bit in hmask). The bytes are q (0..7): a signed scale has no byte table (sc q would need 9
 * bits), so each 64 values' three sums are combined at once (per lane 4 products of 7 * 127:
 * 16384 A0 + 128 A1 + A2 < 5.9e7), converted, and times d (sc - 32) per lane; the - 4 is
 * - 4 d (sc - 32) times the sub-block's sum of x. */
static inline __attribute__((always_inline)) void q3_k_row_int8(const int M, float *out, int64_t ldo,
                                                                const int8_t *xq, const float *xd, const float *xs,
                                                                int64_t blocks, const uint8_t *row, const float *bias,
                                                                const float *residual, int64_t ldr, int64_t j) {
    __m512 acc[FEW_ROWS], offs[FEW_ROWS];
    for (int m = 0; m < M; m++) acc[m] = offs[m] = _mm512_setzero_ps();
    __m512i pick[4], high[4];
    for (int s = 0; s < 4; s++) {
        int32_t lanes[16];
        for (int l = 0; l < 16; l++) lanes[l] = field_sub_block(s, l / 4);
        pick[s] = _mm512_loadu_si512(lanes);
        /* value 128 h + 32 s + i's high bit: bit 4 h + s of hmask[i] (the 32 bytes in both halves) */
        high[s] = _mm512_inserti64x4(_mm512_set1_epi8((char)(1 << s)), _mm256_set1_epi8((char)(1 << (4 + s))), 1);
    }
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *blk = row + b * 110;
        uint64_t sc[2];
        q3_k_scales_u64(blk + 96, sc); /* into a register directly: a 16-byte load of two 8-byte stores stalls */
        const __m128i scales = _mm_set_epi64x((int64_t)sc[1], (int64_t)sc[0]);
        const __m512 dl = _mm512_mul_ps(_mm512_set1_ps(fp16_to_fp32(load_u16(blk + 108))),
                                        _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepu8_epi32(scales), _mm512_set1_epi32(32))));
        for (int m = 0; m < M; m++) offs[m] = _mm512_fmadd_ps(dl, _mm512_loadu_ps(xs + (m * blocks + b) * 16), offs[m]);
        const __m512i qs = _mm512_loadu_si512(blk + 32);
        const __m512i hm = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)blk));
        __m512 part[FEW_ROWS];
        for (int m = 0; m < M; m++) part[m] = _mm512_setzero_ps();
        for (int s = 0; s < 4; s++) {
            const __m512i low = field2(qs, s);
            const __m512i w = _mm512_mask_add_epi8(low, _mm512_test_epi8_mask(hm, high[s]), low, _mm512_set1_epi8(4));
            const __m512 scale = _mm512_permutexvar_ps(pick[s], dl);
            for (int m = 0; m < M; m++) {
                const int8_t *q = xq + (m * blocks + b) * PIECES_BYTES + 64 * s;
                __m512i t = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, _mm512_loadu_si512(q));
                t = _mm512_dpbusd_epi32(_mm512_slli_epi32(t, 7), w, _mm512_loadu_si512(q + 256));
                t = _mm512_dpbusd_epi32(_mm512_slli_epi32(t, 7), w, _mm512_loadu_si512(q + 512));
                part[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), scale, part[m]);
            }
        }
        for (int m = 0; m < M; m++)
            acc[m] = _mm512_fmadd_ps(part[m], _mm512_set1_ps(xd[m * blocks + b] * (1.0f / 16384.0f)), acc[m]);
    }
    float macc[FEW_ROWS];
    for (int m = 0; m < M; m++) macc[m] = 4.0f * _mm512_reduce_add_ps(offs[m]);
    int8_row_out(M, acc, macc, out, ldo, bias, residual, ldr, j);
}

/* NAME##_range for these rows: x split and its sums per 16 once per call, then row by row. */
#define DEFINE_INT8_RANGE(NAME)                                                                                 \
    static void NAME##_range(int M, float *out, int64_t ldo, const float *x, int64_t ldx, const uint8_t *w,      \
                             int64_t row_bytes, const float *bias, const float *residual, int64_t ldr, int64_t j0, \
                             int64_t j1, int64_t k) {                                                           \
        const int64_t blocks = k / 256;                                                                         \
        int8_t xq[M * blocks * PIECES_BYTES];                                                                   \
        float xd[M * blocks], xs[M * (k / 16)];                                                                 \
        split_x(M, x, ldx, k, xq, xd, xs);                                                                      \
        for (int64_t j = j0; j < j1; j++) {                                                                     \
            const uint8_t *row = w + j * row_bytes;                                                             \
            switch (M) {                                                                                        \
            case 1: NAME##_row_int8(1, out, ldo, xq, xd, xs, blocks, row, bias, residual, ldr, j); break;       \
            case 2: NAME##_row_int8(2, out, ldo, xq, xd, xs, blocks, row, bias, residual, ldr, j); break;       \
            case 3: NAME##_row_int8(3, out, ldo, xq, xd, xs, blocks, row, bias, residual, ldr, j); break;       \
            default: NAME##_row_int8(4, out, ldo, xq, xd, xs, blocks, row, bias, residual, ldr, j); break;      \
            }                                                                                                   \
        }                                                                                                       \
    }
