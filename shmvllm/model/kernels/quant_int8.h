/* The GEMV rows of the 2- and 3-bit K formats (Q2_K, Q3_K), of Q4_1 (Q8_0 on VNNI, Q5_0 / Q5_1 on AVX2) on
 * integer dot products of unsigned by signed bytes, in two widths from one source: the AVX-512
 * VNNI build (512-bit vectors, vpdpbusd: 64 products an instruction) and the AVX2 build (256-bit, vpmaddubsw + vpmaddwd: 32 products in
 * two instructions). Included by quant_kernels.c in those builds; plain AVX-512 keeps fp32 rows.
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
 * a block's 64 bytes of 2-bit fields gives 64 values in that order, or of its 32-byte half h the
 * 32 values of half h), so no weight is moved. */

#define PIECES_BYTES 768 /* the three pieces of one block of 256 values */

/* The vector layer: IW bytes an integer vector (two of its 128-bit lanes per half of a block's
 * 2-bit fields with AVX2, four with AVX-512), FW floats a float vector. */
#if defined(__AVX512VNNI__)
#define IW 64
#define FW 16
typedef __m512i iv;
typedef __m512 fv;
static inline iv iv_load(const void *p) { return _mm512_loadu_si512(p); }
static inline iv iv_set1_8(int8_t v) { return _mm512_set1_epi8(v); }
static inline iv iv_set1_32(int32_t v) { return _mm512_set1_epi32(v); }
/* the 32 bytes at p in each 256-bit half */
static inline iv iv_load_bcast256(const void *p) { return _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)p)); }
static inline iv iv_zero(void) { return _mm512_setzero_si512(); }
static inline iv iv_and(iv a, iv b) { return _mm512_and_si512(a, b); }
static inline iv iv_srli16(iv a, int n) { return _mm512_srli_epi16(a, n); }
static inline iv iv_slli32(iv a, int n) { return _mm512_slli_epi32(a, n); }
static inline iv iv_add32(iv a, iv b) { return _mm512_add_epi32(a, b); }
static inline iv iv_mullo16(iv a, iv b) { return _mm512_mullo_epi16(a, b); }
static inline iv iv_shuffle8(iv table, iv idx) { return _mm512_shuffle_epi8(table, idx); }
static inline iv iv_bcast128(__m128i v) { return _mm512_broadcast_i32x4(v); }
/* 16384 A0 + 128 A1 + A2 per 32-bit lane, Ai its 4 products of the bytes w (unsigned) by piece i
 * at q + stride i (signed): the running sum shifted in between */
static inline iv pieces_dot(iv w, const int8_t *q, int stride) {
    iv t = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, _mm512_loadu_si512(q));
    t = _mm512_dpbusd_epi32(_mm512_slli_epi32(t, 7), w, _mm512_loadu_si512(q + stride));
    return _mm512_dpbusd_epi32(_mm512_slli_epi32(t, 7), w, _mm512_loadu_si512(q + 2 * stride));
}
/* the same summed over four fields (w[s], the pieces at q + 64 s): each piece's sums accumulated
 * apart, combined once */
static inline iv pieces_dot4(const iv w[4], const int8_t *q) {
    iv a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0;
    for (int s = 0; s < 4; s++) {
        a0 = _mm512_dpbusd_epi32(a0, w[s], _mm512_loadu_si512(q + 64 * s));
        a1 = _mm512_dpbusd_epi32(a1, w[s], _mm512_loadu_si512(q + 64 * s + 256));
        a2 = _mm512_dpbusd_epi32(a2, w[s], _mm512_loadu_si512(q + 64 * s + 512));
    }
    return _mm512_add_epi32(_mm512_slli_epi32(_mm512_add_epi32(_mm512_slli_epi32(a0, 7), a1), 7), a2);
}
/* Q3_K's q of field s, part p: the 2-bit low parts, + 4 where value 128 h + 32 s + i's high bit
 * (bit 4 h + s of hmask[i], hm holding the 32 bytes in each half h) is set, under a byte mask */
static inline iv q3_k_q(iv low, iv hm, int s, int p) {
    (void)p;
    const iv bit = _mm512_inserti64x4(_mm512_set1_epi8((char)(1 << s)), _mm256_set1_epi8((char)(1 << (4 + s))), 1);
    return _mm512_mask_add_epi8(low, _mm512_test_epi8_mask(hm, bit), low, _mm512_set1_epi8(4));
}
static inline fv fv_load(const float *p) { return _mm512_loadu_ps(p); }
static inline fv fv_zero(void) { return _mm512_setzero_ps(); }
static inline fv fv_set1(float v) { return _mm512_set1_ps(v); }
static inline fv fv_fmadd(fv a, fv b, fv c) { return _mm512_fmadd_ps(a, b, c); }
static inline fv fv_fnmadd(fv a, fv b, fv c) { return _mm512_fnmadd_ps(a, b, c); }
static inline fv fv_mul(fv a, fv b) { return _mm512_mul_ps(a, b); }
static inline fv fv_sub(fv a, fv b) { return _mm512_sub_ps(a, b); }
static inline fv fv_max_abs(fv top, fv v) { return _mm512_max_ps(top, _mm512_abs_ps(v)); }
static inline int fv_any_nan(fv v) { return _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) != 0; }
static inline float fv_reduce_max(fv v) { return _mm512_reduce_max_ps(v); }
static inline float fv_reduce_add(fv v) { return _mm512_reduce_add_ps(v); }
static inline iv fv_round(fv v) { return _mm512_cvtps_epi32(v); }
static inline fv iv_to_fv(iv v) { return _mm512_cvtepi32_ps(v); }
static inline int iv_reduce_add32(iv v) { return _mm512_reduce_add_epi32(v); }
/* FW int32 lanes (each within int8) -> FW bytes at p */
static inline void iv_store_int8(int8_t *p, iv v) { _mm_storeu_si128((__m128i *)p, _mm512_cvtsepi32_epi8(v)); }
/* FW bytes -> FW floats */
static inline fv u8_to_fv(__m128i v) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(v)); }
/* lane i of `table` (FW floats) at every 32-bit lane of idx */
static inline fv fv_permute(iv idx, fv table) { return _mm512_permutexvar_ps(idx, table); }
#else
#define IW 32
#define FW 8
typedef __m256i iv;
typedef __m256 fv;
static inline iv iv_load(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }
static inline iv iv_set1_8(int8_t v) { return _mm256_set1_epi8(v); }
static inline iv iv_set1_32(int32_t v) { return _mm256_set1_epi32(v); }
static inline iv iv_load_bcast256(const void *p) { return iv_load(p); }
static inline iv iv_zero(void) { return _mm256_setzero_si256(); }
static inline iv iv_and(iv a, iv b) { return _mm256_and_si256(a, b); }
static inline iv iv_srli16(iv a, int n) { return _mm256_srli_epi16(a, n); }
static inline iv iv_slli32(iv a, int n) { return _mm256_slli_epi32(a, n); }
static inline iv iv_add32(iv a, iv b) { return _mm256_add_epi32(a, b); }
static inline iv iv_mullo16(iv a, iv b) { return _mm256_mullo_epi16(a, b); }
static inline iv iv_shuffle8(iv table, iv idx) { return _mm256_shuffle_epi8(table, idx); }
static inline iv iv_bcast128(__m128i v) { return _mm256_broadcastsi128_si256(v); }
/* vpmaddubsw gives the int16 sums of product pairs (it saturates past int16: at most 2 * 45 * 127
 * = 11430 here); vpmaddwd by 16384, 128, 1 sums those pairs into int32 lanes already weighted */
static inline iv pieces_dot(iv w, const int8_t *q, int stride) {
    const iv p0 = _mm256_maddubs_epi16(w, iv_load(q)), p1 = _mm256_maddubs_epi16(w, iv_load(q + stride));
    const iv p2 = _mm256_maddubs_epi16(w, iv_load(q + 2 * stride));
    return _mm256_add_epi32(_mm256_add_epi32(_mm256_madd_epi16(p0, _mm256_set1_epi16(16384)),
                                             _mm256_madd_epi16(p1, _mm256_set1_epi16(128))),
                            _mm256_madd_epi16(p2, _mm256_set1_epi16(1)));
}
/* Over four fields the pair sums add up in int16 first (Q2_K's bytes are at most 45): piece 0's
 * (|a0| <= 127) two fields at a time, |sum| <= 22860; pieces 1, 2's (|a| <= 64) all four, <= 23040 */
static inline iv pieces_dot4(const iv w[4], const int8_t *q) {
    iv p0[2], p1 = _mm256_setzero_si256(), p2 = p1;
    for (int s = 0; s < 4; s++) {
        const iv t0 = _mm256_maddubs_epi16(w[s], iv_load(q + 64 * s));
        p0[s / 2] = s % 2 ? _mm256_add_epi16(p0[s / 2], t0) : t0;
        p1 = _mm256_add_epi16(p1, _mm256_maddubs_epi16(w[s], iv_load(q + 64 * s + 256)));
        p2 = _mm256_add_epi16(p2, _mm256_maddubs_epi16(w[s], iv_load(q + 64 * s + 512)));
    }
    const iv c0 = _mm256_set1_epi16(16384);
    return _mm256_add_epi32(_mm256_add_epi32(_mm256_madd_epi16(p0[0], c0), _mm256_madd_epi16(p0[1], c0)),
                            _mm256_add_epi32(_mm256_madd_epi16(p1, _mm256_set1_epi16(128)),
                                             _mm256_madd_epi16(p2, _mm256_set1_epi16(1))));
}
/* (part p is half h) the high bit 4 p + s shifted to bit 2 of its byte (a 16-bit shift by at most
 * 5 keeps every byte's bit 2 within its byte) and ORed in: the low parts are at most 3 */
static inline iv q3_k_q(iv low, iv hm, int s, int p) {
    const int shift = 4 * p + s - 2;
    const iv moved = shift >= 0 ? _mm256_srli_epi16(hm, shift) : _mm256_slli_epi16(hm, -shift);
    return _mm256_or_si256(low, _mm256_and_si256(moved, _mm256_set1_epi8(4)));
}
static inline fv fv_load(const float *p) { return _mm256_loadu_ps(p); }
static inline fv fv_zero(void) { return _mm256_setzero_ps(); }
static inline fv fv_set1(float v) { return _mm256_set1_ps(v); }
static inline fv fv_fmadd(fv a, fv b, fv c) { return _mm256_fmadd_ps(a, b, c); }
static inline fv fv_fnmadd(fv a, fv b, fv c) { return _mm256_fnmadd_ps(a, b, c); }
static inline fv fv_mul(fv a, fv b) { return _mm256_mul_ps(a, b); }
static inline fv fv_sub(fv a, fv b) { return _mm256_sub_ps(a, b); }
static inline fv fv_max_abs(fv top, fv v) { return _mm256_max_ps(top, _mm256_andnot_ps(_mm256_set1_ps(-0.0f), v)); }
static inline int fv_any_nan(fv v) { return _mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)) != 0; }
static inline float fv_reduce_max(fv v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}
static inline float fv_reduce_add(fv v) { return hsum((vf)v); }
static inline iv fv_round(fv v) { return _mm256_cvtps_epi32(v); }
static inline fv iv_to_fv(iv v) { return _mm256_cvtepi32_ps(v); }
static inline int iv_reduce_add32(iv v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1)));
}
static inline void iv_store_int8(int8_t *p, iv v) {
    const __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    _mm_storel_epi64((__m128i *)p, _mm_packs_epi16(words, words));
}
static inline fv u8_to_fv(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)); }
static inline fv fv_permute(iv idx, fv table) { return _mm256_permutevar8x32_ps(table, idx); }
#endif

/* x split per block of qk values (256: the K formats', in their bit order; 32: Q5_0 / Q5_1's, in
 * order): block b of row m's three pieces at xq + (m * blocks + b) * 3 qk (piece i at + qk i), its d
 * at xd[m * blocks + b], the sums of the values the pieces hold per 16 at xs[m * k / 16 + ...] (for
 * the mins / offsets: then every weight sees the same x, and the result's error is sum |w| |x -
 * pieces'| at most). */
static inline void split_x(int M, const float *x, int64_t ldx, int64_t k, const int qk, int8_t *xq, float *xd,
                           float *xs) {
    const int64_t blocks = k / qk;
    for (int m = 0; m < M; m++)
        for (int64_t b = 0; b < blocks; b++) {
            const float *xb = x + m * ldx + qk * b;
            int8_t *q = xq + (m * blocks + b) * 3 * qk;
            float *sums = xs + m * (k / 16) + (qk / 16) * b;
            fv top = fv_zero();
            int nan = 0;
            for (int t = 0; t < qk / FW; t++) {
                const fv v = fv_load(xb + FW * t);
                top = fv_max_abs(top, v);
                nan |= fv_any_nan(v);
            }
            const float amax = nan ? __builtin_nanf("") : fv_reduce_max(top);
            if (!(amax > 0.0f && amax <= 3.4028235e38f)) {
                /* zeros give zero; inf / NaN give NaN (0 times it), as they would in fp32 */
                memset(q, 0, 3 * qk);
                xd[m * blocks + b] = amax == 0.0f ? 0.0f : __builtin_nanf("");
                for (int t = 0; t < qk / 16; t++) sums[t] = xd[m * blocks + b];
                continue;
            }
            const float d = amax / 127.0f;
            const fv inv = fv_set1(1.0f / d), dv = fv_set1(d);
            const fv d1 = fv_set1(d / 128.0f), inv1 = fv_set1(128.0f / d);
            const fv inv2 = fv_set1(16384.0f / d);
            for (int t = 0; t < qk / 16; t++) {
                /* 16384 a0 + 128 a1 + a2 < 2^22 per value, < 2^26 per 16: exact in int32 */
                iv held = iv_zero();
                for (int e = 16 * t; e < 16 * t + 16; e += FW) {
                    const int at = qk == 256 ? 64 * ((e % 128) / 32) + 32 * (e / 128) + e % 32 : e;
                    const fv v = fv_load(xb + e);
                    const iv a0 = fv_round(fv_mul(v, inv));
                    const fv r1 = fv_fnmadd(iv_to_fv(a0), dv, v);
                    const iv a1 = fv_round(fv_mul(r1, inv1));
                    const fv r2 = fv_fnmadd(iv_to_fv(a1), d1, r1);
                    const iv a2 = fv_round(fv_mul(r2, inv2));
                    iv_store_int8(q + at, a0);
                    iv_store_int8(q + qk + at, a1);
                    iv_store_int8(q + 2 * qk + at, a2);
                    held = iv_add32(held, iv_add32(iv_slli32(iv_add32(iv_slli32(a0, 7), a1), 7), a2));
                }
                sums[t] = (d * (1.0f / 16384.0f)) * (float)iv_reduce_add32(held);
            }
            xd[m * blocks + b] = d;
        }
}

/* Field s (bits 2s, 2s + 1) of 2-bit values: each 128-bit lane one sub-block of 16. */
static inline iv field2(iv qs, int s) { return iv_and(iv_srli16(qs, 2 * s), iv_set1_8(3)); }

/* The sub-block of 16 in 128-bit lane L of field s, counting the lanes of a block's 64 bytes of
 * fields (bytes 0..31: half 0, 32..63: half 1): 2s, 2s + 1, 8 + 2s, 9 + 2s. */
static inline int field_sub_block(int s, int lane) { return 8 * (lane / 2) + 2 * s + lane % 2; }

/* 16 bytes -> 16 / FW vectors of floats */
static inline void u8x16_to_fv(__m128i v, fv out[16 / FW]) {
    out[0] = u8_to_fv(v);
    if (FW == 8) out[16 / FW - 1] = u8_to_fv(_mm_unpackhi_epi64(v, v));
}

static inline void int8_row_out(const int M, const fv *acc, const float *macc, float *out, int64_t ldo,
                                const float *bias, const float *residual, int64_t ldr, int64_t j) {
    const float add = bias != NULL ? bias[j] : 0.0f;
    for (int m = 0; m < M; m++)
        out[m * ldo + j] = (fv_reduce_add(acc[m]) - macc[m]) + add + (residual != NULL ? residual[m * ldr + j] : 0.0f);
}

#define PARTS (64 / IW) /* integer vectors per 64 bytes of 2-bit fields */

/* The 32-bit lanes' sub-blocks of field s in part p: lane l sits in 128-bit lane p IW / 16 + l / 4. */
static inline int lane_sub_block(int s, int p, int l) { return field_sub_block(s, p * (IW / 16) + l / 4); }

/* Q2_K: w = d sc q - dmin m per sub-block of 16 (sc, m 4 bits; q 2 bits). The weight bytes are
 * sc q (at most 45), looked up per 128-bit lane in a table [0, sc, 2 sc, 3 sc] (vpshufb), so one
 * part's three int32 sums accumulate over its four fields: per 32-bit lane at most 16 products of
 * 45 * 127 (a0) or 45 * 64 (a1, a2), so 16384 A0 + 128 A1 + A2 < 1.51e9 fits. The mins: dmin m
 * times the sub-block's sum of x (as the pieces hold it). */
static inline __attribute__((always_inline)) void q2_k_row_int8(const int M, float *out, int64_t ldo,
                                                                const int8_t *xq, const float *xd, const float *xs,
                                                                int64_t blocks, const uint8_t *row, const float *bias,
                                                                const float *residual, int64_t ldr, int64_t j) {
    fv acc[FEW_ROWS], mins[FEW_ROWS];
    for (int m = 0; m < M; m++) acc[m] = mins[m] = fv_zero();
    /* per field s and part p: the words of each lane's scale (byte 0x80: zero), times 0x0100 and
     * 0x0302: the bytes 0, sc, 2 sc, 3 sc (no carries: 3 sc < 256) */
    iv pick[4][PARTS];
    for (int s = 0; s < 4; s++)
        for (int p = 0; p < PARTS; p++) {
            int32_t lanes[IW / 4];
            for (int l = 0; l < IW / 4; l++) {
                const int sb = lane_sub_block(s, p, l);
                lanes[l] = sb | 0x80 << 8 | sb << 16 | 0x80 << 24;
            }
            pick[s][p] = iv_load(lanes);
        }
    const iv times = iv_set1_32(0x03020100);
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *blk = row + b * 84;
        const __m128i packed = _mm_loadu_si128((const __m128i *)blk);
        const iv scales = iv_bcast128(_mm_and_si128(packed, _mm_set1_epi8(0x0f)));
        fv dm[16 / FW];
        u8x16_to_fv(_mm_and_si128(_mm_srli_epi16(packed, 4), _mm_set1_epi8(0x0f)), dm);
        const fv dmin = fv_set1(fp16_to_fp32(load_u16(blk + 82)));
        for (int v = 0; v < 16 / FW; v++)
            for (int m = 0; m < M; m++)
                mins[m] = fv_fmadd(fv_mul(dmin, dm[v]), fv_load(xs + (m * blocks + b) * 16 + v * FW), mins[m]);
        const float d = fp16_to_fp32(load_u16(blk + 80)) * (1.0f / 16384.0f);
        for (int p = 0; p < PARTS; p++) {
            const iv qs = iv_load(blk + 16 + IW * p);
            iv w[4];
            for (int s = 0; s < 4; s++)
                w[s] = iv_shuffle8(iv_mullo16(iv_shuffle8(scales, pick[s][p]), times), field2(qs, s));
            for (int m = 0; m < M; m++) {
                const iv total = pieces_dot4(w, xq + (m * blocks + b) * PIECES_BYTES + IW * p);
                acc[m] = fv_fmadd(iv_to_fv(total), fv_set1(d * xd[m * blocks + b]), acc[m]);
            }
        }
    }
    float macc[FEW_ROWS];
    for (int m = 0; m < M; m++) macc[m] = fv_reduce_add(mins[m]);
    int8_row_out(M, acc, macc, out, ldo, bias, residual, ldr, j);
}

/* Q3_K: w = d (sc - 32) (q - 4) per sub-block of 16 (sc 6 bits, q 3: 2 low bits as Q2_K's and a
 * high bit in hmask). The bytes are q (0..7): a signed scale has no byte table (sc q would need 9
 * bits), so each field's three sums are combined at once (per lane 4 products of 7 * 127:
 * 16384 A0 + 128 A1 + A2 < 5.9e7), converted, and times d (sc - 32) per lane; the - 4 is
 * - 4 d (sc - 32) times the sub-block's sum of x. */
static inline __attribute__((always_inline)) void q3_k_row_int8(const int M, float *out, int64_t ldo,
                                                                const int8_t *xq, const float *xd, const float *xs,
                                                                int64_t blocks, const uint8_t *row, const float *bias,
                                                                const float *residual, int64_t ldr, int64_t j) {
    fv acc[FEW_ROWS], offs[FEW_ROWS];
    for (int m = 0; m < M; m++) acc[m] = offs[m] = fv_zero();
    iv pick[4][PARTS];
    for (int s = 0; s < 4; s++)
        for (int p = 0; p < PARTS; p++) {
            int32_t lanes[IW / 4];
            for (int l = 0; l < IW / 4; l++) lanes[l] = lane_sub_block(s, p, l) % FW;
            pick[s][p] = iv_load(lanes);
        }
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *blk = row + b * 110;
        uint64_t sc[2];
        q3_k_scales_u64(blk + 96, sc); /* into a register directly: a 16-byte load of two 8-byte stores stalls */
        fv dl[16 / FW];
        u8x16_to_fv(_mm_set_epi64x((int64_t)sc[1], (int64_t)sc[0]), dl);
        const fv d = fv_set1(fp16_to_fp32(load_u16(blk + 108)));
        for (int v = 0; v < 16 / FW; v++) {
            dl[v] = fv_mul(d, fv_sub(dl[v], fv_set1(32.0f)));
            for (int m = 0; m < M; m++) offs[m] = fv_fmadd(dl[v], fv_load(xs + (m * blocks + b) * 16 + v * FW), offs[m]);
        }
        const iv hm = iv_load_bcast256(blk);
        fv part[FEW_ROWS];
        for (int m = 0; m < M; m++) part[m] = fv_zero();
        for (int p = 0; p < PARTS; p++) {
            const iv qs = iv_load(blk + 32 + IW * p);
            for (int s = 0; s < 4; s++) {
                const iv w = q3_k_q(field2(qs, s), hm, s, p);
                const fv scale = fv_permute(pick[s][p], dl[lane_sub_block(s, p, 0) / FW]);
                for (int m = 0; m < M; m++)
                    part[m] = fv_fmadd(iv_to_fv(pieces_dot(w, xq + (m * blocks + b) * PIECES_BYTES + 64 * s + IW * p, 256)),
                                       scale, part[m]);
            }
        }
        for (int m = 0; m < M; m++)
            acc[m] = fv_fmadd(part[m], fv_set1(xd[m * blocks + b] * (1.0f / 16384.0f)), acc[m]);
    }
    float macc[FEW_ROWS];
    for (int m = 0; m < M; m++) macc[m] = 4.0f * fv_reduce_add(offs[m]);
    int8_row_out(M, acc, macc, out, ldo, bias, residual, ldr, j);
}

#if IW == 32
#define INT8_Q5_ROWS 1
/* Q5_0 / Q5_1 (AVX2; VNNI keeps the fp32 rows: a 32-value block fills half its vector): w = d q + m
 * per block of 32 (q 5 bits, Q5_0's m = -16 d), x split per 32 values. The bytes are q (0..31,
 * values i and 16 + i from the low and high nibbles of byte i, the fifth bits in qh), so a block's
 * three sums combine at once (per lane 4 products of 31 * 127: < 2.6e8), times d d_x; m times the
 * block's sum of x as the pieces hold it. */
static inline iv q5_bytes(const uint8_t *qs, uint32_t qh) {
    const __m128i packed = _mm_loadu_si128((const __m128i *)qs), low4 = _mm_set1_epi8(0x0f);
    const iv nibbles = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(packed, 4), low4), _mm_and_si128(packed, low4));
    /* byte i takes byte i / 8 of qh (vpshufb within each 128-bit lane), then tests bit i % 8 */
    const iv spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)qh),
                                          _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303));
    const iv bit = _mm256_set1_epi64x(0x8040201008040201);
    const iv fifth = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(16));
    return _mm256_or_si256(nibbles, fifth);
}
static inline __attribute__((always_inline)) void q5_row_int8(const int M, float *out, int64_t ldo, const int8_t *xq,
                                                              const float *xd, const float *xs, int64_t blocks,
                                                              const uint8_t *row, const float *bias,
                                                              const float *residual, int64_t ldr, int64_t j,
                                                              const int has_m) {
    const int bb = has_m ? 24 : 22, qh_at = has_m ? 4 : 2;
    fv acc[FEW_ROWS];
    float macc[FEW_ROWS];
    for (int m = 0; m < M; m++) acc[m] = fv_zero(), macc[m] = 0.0f;
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *blk = row + b * bb;
        const iv w = q5_bytes(blk + qh_at + 4, load_u32(blk + qh_at));
        const float d = fp16_to_fp32(load_u16(blk));
        const float mb = has_m ? fp16_to_fp32(load_u16(blk + 2)) : -16.0f * d;
        for (int m = 0; m < M; m++) {
            const iv total = pieces_dot(w, xq + (m * blocks + b) * 96, 32);
            acc[m] = fv_fmadd(iv_to_fv(total), fv_set1(d * xd[m * blocks + b] * (1.0f / 16384.0f)), acc[m]);
            macc[m] -= mb * (xs[m * 2 * blocks + 2 * b] + xs[m * 2 * blocks + 2 * b + 1]);
        }
    }
    int8_row_out(M, acc, macc, out, ldo, bias, residual, ldr, j);
}
#define q5_0_row_int8(M, ...) q5_row_int8(M, __VA_ARGS__, 0)
#define q5_1_row_int8(M, ...) q5_row_int8(M, __VA_ARGS__, 1)
#endif

/* Q4_1 (both builds; the default model's layers): w = d q + m per block of 32 (q 4 bits), x split
 * per 32 values. Eight output rows at a time, row r in 32-bit lane r: each row's 16 nibble bytes of
 * block b are 4 dwords, transposed in registers so that vector t holds dword t of the 8 rows, and
 * every lane's integer dot product is with x's 4 bytes broadcast (vpbroadcastd). A lane sums its
 * own row's block (no horizontal sum), so the convert, the d d_x scale, the FMA and m sum(x) are
 * one vector op per block for 8 rows, not per 8 weights of one row (the block-per-vector rows this
 * replaces spent more on those than on the dot products, and repeated them for every row of x).
 * Each lane's arithmetic is its row's alone: one row of x gives the bits any 2-4 give, and a row's
 * result does not depend on the rows grouped with it (the last group repeats its last row). */
#if IW == 64
/* one piece's dot over a block: 8 vpdpbusd, lo / hi the values 4t.. / 16 + 4t.. of the 8 rows */
static inline __m256i q4_piece(const __m256i lo[4], const __m256i hi[4], const int8_t *q) {
    __m256i s = _mm256_setzero_si256(), u = s;
    for (int t = 0; t < 4; t++) {
        s = _mm256_dpbusd_epi32(s, lo[t], _mm256_set1_epi32((int)load_u32((const uint8_t *)q + 4 * t)));
        u = _mm256_dpbusd_epi32(u, hi[t], _mm256_set1_epi32((int)load_u32((const uint8_t *)q + 16 + 4 * t)));
    }
    return _mm256_add_epi32(s, u);
}
#else
/* AVX2: vpmaddubsw's int16 pair sums (|.| <= 2 * 15 * 127) add up over the block's 8 vectors
 * (<= 30480) before one vpmaddwd by the piece's weight (16384, 128, 1) */
static inline __m256i q4_piece(const __m256i lo[4], const __m256i hi[4], const int8_t *q, short weight) {
    __m256i s = _mm256_setzero_si256();
    for (int t = 0; t < 4; t++) {
        s = _mm256_add_epi16(s, _mm256_maddubs_epi16(lo[t], _mm256_set1_epi32((int)load_u32((const uint8_t *)q + 4 * t))));
        s = _mm256_add_epi16(s, _mm256_maddubs_epi16(hi[t], _mm256_set1_epi32((int)load_u32((const uint8_t *)q + 16 + 4 * t))));
    }
    return _mm256_madd_epi16(s, _mm256_set1_epi16(weight));
}
#endif
/* a block's 8 lane sums against x's three pieces at q, each piece weighted by its place (2^14, 2^7, 1) */
static inline __attribute__((always_inline)) __m256i q4_total(const __m256i lo[4], const __m256i hi[4], const int8_t *q) {
#if IW == 64
    return _mm256_add_epi32(
        _mm256_slli_epi32(_mm256_add_epi32(_mm256_slli_epi32(q4_piece(lo, hi, q), 7), q4_piece(lo, hi, q + 32)), 7),
        q4_piece(lo, hi, q + 64));
#else
    return _mm256_add_epi32(_mm256_add_epi32(q4_piece(lo, hi, q, 16384), q4_piece(lo, hi, q + 32, 128)),
                            q4_piece(lo, hi, q + 64, 1));
#endif
}
static inline __attribute__((always_inline)) void q4_1_rows8(const int M, float *out, int64_t ldo, const int8_t *xq,
                                                             const float *xd, const float *xs, int64_t blocks,
                                                             const uint8_t *w, int64_t row_bytes, int rows,
                                                             const float *bias, const float *residual, int64_t ldr,
                                                             int64_t j) {
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i low4 = _mm256_set1_epi8(0x0f);
    __m256 acc[FEW_ROWS], macc[FEW_ROWS];
    for (int m = 0; m < M; m++) acc[m] = macc[m] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        /* row r's block b: its (d | m << 16) word then 4 dwords of nibbles; rows r and r + 4 in one vector */
        const uint8_t *blk = w + 20 * b;
        /* the hardware prefetcher loses 8 rows read a block at a time (7-8 GB/s from memory, 17 in
         * L2): the group two ahead is fetched in step with this one's blocks (one or three: slower) */
        for (int l = 0; l < 3; l++) __builtin_prefetch(w + 16 * row_bytes + 192 * b + 64 * l, 0, 3);
        __m256i p[4], h[4];
        for (int r = 0; r < 4; r++) {
            p[r] = _mm256_loadu2_m128i((const __m128i *)(blk + (r + 4) * row_bytes + 4), (const __m128i *)(blk + r * row_bytes + 4));
            h[r] = _mm256_loadu2_m128i((const __m128i *)(blk + (r + 4) * row_bytes), (const __m128i *)(blk + r * row_bytes));
        }
        const __m256i u0 = _mm256_unpacklo_epi32(p[0], p[1]), u1 = _mm256_unpackhi_epi32(p[0], p[1]);
        const __m256i u2 = _mm256_unpacklo_epi32(p[2], p[3]), u3 = _mm256_unpackhi_epi32(p[2], p[3]);
        const __m256i c[4] = {_mm256_unpacklo_epi64(u0, u2), _mm256_unpackhi_epi64(u0, u2), _mm256_unpacklo_epi64(u1, u3),
                              _mm256_unpackhi_epi64(u1, u3)};
        __m256i lo[4], hi[4];
        for (int t = 0; t < 4; t++) lo[t] = _mm256_and_si256(c[t], low4), hi[t] = _mm256_and_si256(_mm256_srli_epi16(c[t], 4), low4);
        /* the 8 rows' (d | m << 16) words: d and m as fp16 halves, then floats */
        const __m256i dm = _mm256_unpacklo_epi64(_mm256_unpacklo_epi32(h[0], h[1]), _mm256_unpacklo_epi32(h[2], h[3]));
        const __m256i halves = _mm256_permute4x64_epi64(
            _mm256_packus_epi32(_mm256_and_si256(dm, _mm256_set1_epi32(0xffff)), _mm256_srli_epi32(dm, 16)), 0xd8);
        const __m256 d = _mm256_cvtph_ps(_mm256_castsi256_si128(halves)), mv = _mm256_cvtph_ps(_mm256_extracti128_si256(halves, 1));
        for (int m = 0; m < M; m++) {
            const int8_t *q = xq + (m * blocks + b) * 96;
            const __m256i total = q4_total(lo, hi, q);
            acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), _mm256_mul_ps(d, _mm256_set1_ps(xd[m * blocks + b])), acc[m]);
            macc[m] = _mm256_fmadd_ps(mv, _mm256_set1_ps(xs[m * blocks + b]), macc[m]);
        }
    }
    const __m256i live = _mm256_cmpgt_epi32(_mm256_set1_epi32(rows), lanes);
    const __m256 add = bias != NULL ? _mm256_maskload_ps(bias + j, live) : _mm256_setzero_ps();
    for (int m = 0; m < M; m++) {
        const __m256 res = residual != NULL ? _mm256_maskload_ps(residual + m * ldr + j, live) : _mm256_setzero_ps();
        const __m256 v = _mm256_add_ps(_mm256_mul_ps(acc[m], _mm256_set1_ps(1.0f / 16384.0f)), macc[m]);
        _mm256_maskstore_ps(out + m * ldo + j, live, _mm256_add_ps(_mm256_add_ps(v, add), res));
    }
}

/* rows [j, j + rows) of w as a group of 8: in place, or (the last group, rows < 8) copied to `last`
 * with its last row repeated */
static inline const uint8_t *rows8_group(const uint8_t *w, int64_t row_bytes, int64_t j, int rows, uint8_t *last) {
    const uint8_t *group = w + j * row_bytes;
    if (rows == 8) return group;
    memcpy(last, group, rows * row_bytes);
    for (int r = rows; r < 8; r++) memcpy(last + r * row_bytes, group + (rows - 1) * row_bytes, row_bytes);
    return last;
}
#define ROWS8_RANGE_LOOP(ROWS8, XSUMS)                                                                          \
    for (int64_t j = j0; j < j1; j += 8) {                                                                      \
        const int rows = j1 - j < 8 ? (int)(j1 - j) : 8;                                                        \
        uint8_t last[rows < 8 ? 8 * row_bytes : 1];                                                             \
        const uint8_t *g = rows8_group(w, row_bytes, j, rows, last);                                            \
        switch (M) {                                                                                            \
        case 1: ROWS8(1, out, ldo, xq, xd, XSUMS, blocks, g, row_bytes, rows, bias, residual, ldr, j); break;    \
        case 2: ROWS8(2, out, ldo, xq, xd, XSUMS, blocks, g, row_bytes, rows, bias, residual, ldr, j); break;    \
        case 3: ROWS8(3, out, ldo, xq, xd, XSUMS, blocks, g, row_bytes, rows, bias, residual, ldr, j); break;    \
        default: ROWS8(4, out, ldo, xq, xd, XSUMS, blocks, g, row_bytes, rows, bias, residual, ldr, j); break;   \
        }                                                                                                       \
    }

/* Q4_1's range: x split once per call, with the sums of x per block (not per 16), then 8 rows a pass */
static void q4_1_range(int M, float *out, int64_t ldo, const float *x, int64_t ldx, const uint8_t *w, int64_t row_bytes,
                       const float *bias, const float *residual, int64_t ldr, int64_t j0, int64_t j1, int64_t k) {
    const int64_t blocks = k / 32;
    int8_t xq[M * blocks * 96];
    float xd[M * blocks], xs[M * (k / 16)];
    split_x(M, x, ldx, k, 32, xq, xd, xs);
    for (int64_t b = 0; b < M * blocks; b++) xs[b] = xs[2 * b] + xs[2 * b + 1];
    ROWS8_RANGE_LOOP(q4_1_rows8, xs)
}

#if IW == 32
static inline __m256i pinned(__m256i v) {
    __asm__("" : "+x"(v));
    return v;
}
/* One dword column t of a block for one row of x on AVX2: its nibble split, then the three pieces'
 * int16 sums s[i] (q4_piece's, in another order), pinned in registers: left free, GCC reassociates
 * them across the columns, hoists all 24 broadcasts and spills (one thread, in L2: 19.7 -> 22.7 GB/s). */
static inline __attribute__((always_inline)) void q4_column(const uint8_t *blk, const int8_t *xq, int t, __m256i s[3]) {
    const uint8_t *q = (const uint8_t *)xq + 4 * t;
    const __m256i low4 = _mm256_set1_epi8(0x0f), c = _mm256_loadu_si256((const __m256i *)(blk + 32 * t));
    const __m256i l4 = _mm256_and_si256(c, low4), h4 = _mm256_and_si256(_mm256_srli_epi16(c, 4), low4);
    for (int i = 0; i < 3; i++) s[i] = _mm256_add_epi16(s[i], _mm256_maddubs_epi16(l4, _mm256_set1_epi32((int)load_u32(q + 32 * i))));
    for (int i = 0; i < 3; i++)
        s[i] = pinned(_mm256_add_epi16(s[i], _mm256_maddubs_epi16(h4, _mm256_set1_epi32((int)load_u32(q + 32 * i + 16)))));
}
/* q4_total of two consecutive blocks for one row of x, their columns interleaved (one stream, more
 * independent sums in flight: one thread, in L2, 22.7 -> 23.5 GB/s); the same exact integer sums,
 * so the same bits */
static inline __attribute__((always_inline)) void q4_totals_by_column(const uint8_t *blk, const int8_t *xq, __m256i total[2]) {
    __m256i s[2][3];
    for (int p = 0; p < 2; p++) s[p][0] = s[p][1] = s[p][2] = _mm256_setzero_si256();
    for (int t = 0; t < 4; t++)
        for (int p = 0; p < 2; p++) q4_column(blk + 160 * p, xq + 96 * p, t, s[p]);
    for (int p = 0; p < 2; p++)
        total[p] = _mm256_add_epi32(_mm256_add_epi32(_mm256_madd_epi16(s[p][0], _mm256_set1_epi16(16384)),
                                                     _mm256_madd_epi16(s[p][1], _mm256_set1_epi16(128))),
                                    _mm256_madd_epi16(s[p][2], _mm256_set1_epi16(1)));
}
#endif

/* a repacked block's 8 lane totals into acc (times d d_x) and its m (times the block's sum of x) into macc */
static inline __attribute__((always_inline)) void r8_accumulate(const uint8_t *blk, __m256i total, float xd, float xs,
                                                                __m256 *acc, __m256 *macc) {
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 128)));
    *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), _mm256_mul_ps(d, _mm256_set1_ps(xd)), *acc);
    *macc = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 144))), _mm256_set1_ps(xs), *macc);
}

/* The same pass over Q4_1 repacked at load (quant_kernels.c's T_Q4_1_R8): the 8 rows' nibble dwords
 * are 4 loads and their d / m two conversions a block, without the loads, unpacks and scale words'
 * packing above; the hardware prefetcher follows the one stream (a software prefetch measured
 * slower). Lanes [lo, hi) of the group are stored; each lane's arithmetic is q4_1_rows8's. */
#define Q4_1_R8_ROWS 1
static inline __attribute__((always_inline)) void q4_1_r8_rows8(const int M, float *out, int64_t ldo, const int8_t *xq,
                                                                const float *xd, const float *xs, int64_t blocks,
                                                                const uint8_t *g, int lo, int hi, const float *bias,
                                                                const float *residual, int64_t ldr, int64_t j) {
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i low4 = _mm256_set1_epi8(0x0f);
    __m256 acc[FEW_ROWS], macc[FEW_ROWS];
    for (int m = 0; m < M; m++) acc[m] = macc[m] = _mm256_setzero_ps();
    int64_t b = 0;
#if IW == 32
    if (M == 1) /* two blocks an iteration; an odd last one takes the loop below */
        for (; b + 1 < blocks; b += 2) {
            __m256i total[2];
            q4_totals_by_column(g + 160 * b, xq + 96 * b, total);
            r8_accumulate(g + 160 * b, total[0], xd[b], xs[b], &acc[0], &macc[0]);
            r8_accumulate(g + 160 * (b + 1), total[1], xd[b + 1], xs[b + 1], &acc[0], &macc[0]);
        }
#endif
    for (; b < blocks; b++) {
        const uint8_t *blk = g + 160 * b;
        __m256i lo4[4], hi4[4];
        for (int t = 0; t < 4; t++) {
            const __m256i c = _mm256_loadu_si256((const __m256i *)(blk + 32 * t));
            lo4[t] = _mm256_and_si256(c, low4), hi4[t] = _mm256_and_si256(_mm256_srli_epi16(c, 4), low4);
        }
        for (int m = 0; m < M; m++)
            r8_accumulate(blk, q4_total(lo4, hi4, xq + (m * blocks + b) * 96), xd[m * blocks + b], xs[m * blocks + b], &acc[m], &macc[m]);
    }
    const __m256i live = _mm256_and_si256(_mm256_cmpgt_epi32(_mm256_set1_epi32(hi), lanes),
                                          _mm256_cmpgt_epi32(lanes, _mm256_set1_epi32(lo - 1)));
    const __m256 add = bias != NULL ? _mm256_maskload_ps(bias + j, live) : _mm256_setzero_ps();
    for (int m = 0; m < M; m++) {
        const __m256 res = residual != NULL ? _mm256_maskload_ps(residual + m * ldr + j, live) : _mm256_setzero_ps();
        const __m256 v = _mm256_add_ps(_mm256_mul_ps(acc[m], _mm256_set1_ps(1.0f / 16384.0f)), macc[m]);
        _mm256_maskstore_ps(out + m * ldo + j, live, _mm256_add_ps(_mm256_add_ps(v, add), res));
    }
}

/* rows [j0, j1) of a repacked Q4_1 weight (w: its first group; row_bytes: a plain row's), x split as q4_1_range's */
static void q4_1_r8_range(int M, float *out, int64_t ldo, const float *x, int64_t ldx, const uint8_t *w,
                          int64_t row_bytes, const float *bias, const float *residual, int64_t ldr, int64_t j0,
                          int64_t j1, int64_t k) {
    const int64_t blocks = k / 32;
    int8_t xq[M * blocks * 96];
    float xd[M * blocks], xs[M * (k / 16)];
    split_x(M, x, ldx, k, 32, xq, xd, xs);
    for (int64_t b = 0; b < M * blocks; b++) xs[b] = xs[2 * b] + xs[2 * b + 1];
    for (int64_t j = j0 / 8 * 8; j < j1; j += 8) {
        const int lo = j0 > j ? (int)(j0 - j) : 0, hi = j1 - j < 8 ? (int)(j1 - j) : 8;
        const uint8_t *g = w + j * row_bytes;
        switch (M) {
        case 1: q4_1_r8_rows8(1, out, ldo, xq, xd, xs, blocks, g, lo, hi, bias, residual, ldr, j); break;
        case 2: q4_1_r8_rows8(2, out, ldo, xq, xd, xs, blocks, g, lo, hi, bias, residual, ldr, j); break;
        case 3: q4_1_r8_rows8(3, out, ldo, xq, xd, xs, blocks, g, lo, hi, bias, residual, ldr, j); break;
        default: q4_1_r8_rows8(4, out, ldo, xq, xd, xs, blocks, g, lo, hi, bias, residual, ldr, j); break;
        }
    }
}

#if IW == 64
/* Q8_0 (the VNNI build; the default model's lm_head): w = d q per block of 32 (q signed 8 bits), x
 * split per 32 values, 8 output rows a pass as Q4_1's. vpdpbusd takes unsigned by signed bytes, so
 * the weights go in as q + 128 (q ^ 0x80) and 128 times the block's sum of each piece comes off:
 * that sum is x's alone (the same in every lane), computed once per call. A piece's sum over a
 * block (|.| <= 32 * 255 * 127) cannot be shifted by 14 in int32: pieces 0 and 1 combine in int32,
 * piece 2 in fp32. */
#define INT8_Q8_ROWS 1
static inline __m256i q8_piece(const __m256i c[8], const int8_t *q) {
    __m256i s = _mm256_setzero_si256(), u = s;
    for (int t = 0; t < 4; t++) {
        s = _mm256_dpbusd_epi32(s, c[t], _mm256_set1_epi32((int)load_u32((const uint8_t *)q + 4 * t)));
        u = _mm256_dpbusd_epi32(u, c[t + 4], _mm256_set1_epi32((int)load_u32((const uint8_t *)q + 16 + 4 * t)));
    }
    return _mm256_add_epi32(s, u);
}
/* rows r and r + 4's 16 bytes at blk + r row_bytes in one vector, as 4 vectors of dword t of the 8 rows */
static inline void dwords8(const uint8_t *blk, int64_t row_bytes, __m256i c[4]) {
    __m256i p[4];
    for (int r = 0; r < 4; r++)
        p[r] = _mm256_loadu2_m128i((const __m128i *)(blk + (r + 4) * row_bytes), (const __m128i *)(blk + r * row_bytes));
    const __m256i u0 = _mm256_unpacklo_epi32(p[0], p[1]), u1 = _mm256_unpackhi_epi32(p[0], p[1]);
    const __m256i u2 = _mm256_unpacklo_epi32(p[2], p[3]), u3 = _mm256_unpackhi_epi32(p[2], p[3]);
    c[0] = _mm256_unpacklo_epi64(u0, u2), c[1] = _mm256_unpackhi_epi64(u0, u2);
    c[2] = _mm256_unpacklo_epi64(u1, u3), c[3] = _mm256_unpackhi_epi64(u1, u3);
}
static inline __attribute__((always_inline)) void q8_0_rows8(const int M, float *out, int64_t ldo, const int8_t *xq,
                                                             const float *xd, const int32_t *xc, int64_t blocks,
                                                             const uint8_t *w, int64_t row_bytes, int rows,
                                                             const float *bias, const float *residual, int64_t ldr,
                                                             int64_t j) {
    const __m256i flip = _mm256_set1_epi8((char)0x80);
    __m256 acc[FEW_ROWS];
    for (int m = 0; m < M; m++) acc[m] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *blk = w + 34 * b;
        for (int l = 0; l < 5; l++) __builtin_prefetch(w + 16 * row_bytes + 272 * b + 64 * l, 0, 3);
        __m256i c[8], h[4];
        dwords8(blk + 2, row_bytes, c);
        dwords8(blk + 18, row_bytes, c + 4);
        for (int t = 0; t < 8; t++) c[t] = _mm256_xor_si256(c[t], flip);
        dwords8(blk, row_bytes, h);
        const __m256 d = _mm256_cvtph_ps(_mm256_cvtepi32_epi16(h[0]));
        for (int m = 0; m < M; m++) {
            const int8_t *q = xq + (m * blocks + b) * 96;
            const int32_t *corr = xc + 2 * (m * blocks + b);
            const __m256i t01 = _mm256_sub_epi32(_mm256_add_epi32(_mm256_slli_epi32(q8_piece(c, q), 7), q8_piece(c, q + 32)),
                                                 _mm256_set1_epi32(corr[0]));
            const __m256 t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t01), _mm256_set1_ps(128.0f),
                                             _mm256_cvtepi32_ps(_mm256_sub_epi32(q8_piece(c, q + 64), _mm256_set1_epi32(corr[1]))));
            acc[m] = _mm256_fmadd_ps(t, _mm256_mul_ps(d, _mm256_set1_ps(xd[m * blocks + b])), acc[m]);
        }
    }
    const __m256i live = _mm256_cmpgt_epi32(_mm256_set1_epi32(rows), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    const __m256 add = bias != NULL ? _mm256_maskload_ps(bias + j, live) : _mm256_setzero_ps();
    for (int m = 0; m < M; m++) {
        const __m256 res = residual != NULL ? _mm256_maskload_ps(residual + m * ldr + j, live) : _mm256_setzero_ps();
        _mm256_maskstore_ps(out + m * ldo + j, live,
                            _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(acc[m], _mm256_set1_ps(1.0f / 16384.0f)), add), res));
    }
}
/* Q8_0's range: x split once per call, with each block's correction for the weights' + 128 */
static void q8_0_range(int M, float *out, int64_t ldo, const float *x, int64_t ldx, const uint8_t *w, int64_t row_bytes,
                       const float *bias, const float *residual, int64_t ldr, int64_t j0, int64_t j1, int64_t k) {
    const int64_t blocks = k / 32;
    int8_t xq[M * blocks * 96];
    float xd[M * blocks], xs[M * (k / 16)];
    int32_t xc[2 * M * blocks];
    split_x(M, x, ldx, k, 32, xq, xd, xs);
    for (int64_t b = 0; b < M * blocks; b++) {
        int32_t sum[3] = {0, 0, 0};
        for (int i = 0; i < 3; i++)
            for (int e = 0; e < 32; e++) sum[i] += xq[b * 96 + 32 * i + e];
        xc[2 * b] = 128 * (128 * sum[0] + sum[1]), xc[2 * b + 1] = 128 * sum[2];
    }
    ROWS8_RANGE_LOOP(q8_0_rows8, xc)
}
#endif

/* NAME##_range for these rows: x split per QK values and its sums per 16 once per call, then row by row. */
#define DEFINE_INT8_RANGE(NAME, QK)                                                                             \
    static void NAME##_range(int M, float *out, int64_t ldo, const float *x, int64_t ldx, const uint8_t *w,      \
                             int64_t row_bytes, const float *bias, const float *residual, int64_t ldr, int64_t j0, \
                             int64_t j1, int64_t k) {                                                           \
        const int64_t blocks = k / QK;                                                                          \
        int8_t xq[M * blocks * 3 * QK];                                                                         \
        float xd[M * blocks], xs[M * (k / 16)];                                                                 \
        split_x(M, x, ldx, k, QK, xq, xd, xs);                                                                  \
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
