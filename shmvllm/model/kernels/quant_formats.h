/* Block dequantizers of the GGML formats that llama.cpp's mixed recipes (Q4_K_M, Q3_K_M, ...)
 * and its low-bit / non-linear types write: Q5_0, Q5_1 (32 values), Q2_K, Q3_K (256), IQ4_NL
 * (32), IQ4_XS (256) and MXFP4 (32). Included by quant_kernels.c, which instantiates the GEMV,
 * GEMM panel and row lookup of each one from these, as for the other formats.
 *
 * Each gives the exact fp32 values of gguf.quants.dequantize: every product here is of an fp16
 * scale (11 significant bits) or an e8m0 power of two with integers of at most 13 bits together,
 * so it is exact in fp32; the only rounding is Q5_1's "+ m" and Q2_K's "- dmin * m", which the
 * reference does too (one rounding, so an FMA gives the same). */

/* lanes 0 .. VW-1 */
static inline vu lane_ids(void) {
    vu ids;
    for (int i = 0; i < VW; i++) ids[i] = (uint32_t)i;
    return ids;
}

static inline uint32_t load_u32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* Q5_0 / Q5_1: 16 bytes of low nibbles (values i and i + 16) and the fifth bits of all 32 values
 * in one little-endian uint32; the 5-bit q of values [first, first + VW) as floats. AVX-512
 * takes the fifth bits as a lane mask (one masked OR), the others shift them out lane by lane. */
#if VW == 16 && defined(__AVX512F__)
static inline vf q5_float(vb low_nibbles, uint32_t qh, int first) {
    __m128i v;
    memcpy(&v, &low_nibbles, 16);
    const __m512i q = _mm512_cvtepu8_epi32(v);
    return (vf)_mm512_cvtepi32_ps(_mm512_mask_or_epi32(q, (__mmask16)(qh >> first), q, _mm512_set1_epi32(16)));
}
#else
static inline vf q5_float(vb low_nibbles, uint32_t qh, int first) {
    const vu high = ((qh - (vu){0}) >> (lane_ids() + (uint32_t)first)) & 1;
    return int_to_float(bytes_to_int(low_nibbles) | (vi)(high << 4));
}
#endif

/* d * (q - 16) as d * q - 16 d: both products exact, so is their difference (one FMA) */
static inline void deq_q5_0(const uint8_t *blk, vf *w) {
    const float dv = fp16_to_fp32(load_u16(blk));
    const vf d = splat(dv), bias = splat(-16.0f * dv);
    const uint32_t qh = load_u32(blk + 2);
    const uint8_t *qs = blk + 6;
    for (int c = 0; c < 16 / VW; c++) {
        vb q;
        memcpy(&q, qs + c * VW, VW);
        w[c] = d * q5_float(q & 0x0f, qh, c * VW) + bias;
        w[16 / VW + c] = d * q5_float(q >> 4, qh, 16 + c * VW) + bias;
    }
}

static inline void deq_q5_1(const uint8_t *blk, vf *w) {
    const vf d = splat(fp16_to_fp32(load_u16(blk))), m = splat(fp16_to_fp32(load_u16(blk + 2)));
    const uint32_t qh = load_u32(blk + 4);
    const uint8_t *qs = blk + 8;
    for (int c = 0; c < 16 / VW; c++) {
        vb q;
        memcpy(&q, qs + c * VW, VW);
        w[c] = d * q5_float(q & 0x0f, qh, c * VW) + m;
        w[16 / VW + c] = d * q5_float(q >> 4, qh, 16 + c * VW) + m;
    }
}

/* Lane j % VW of v[j / VW] in every lane (a permute, not a round trip through memory). */
static inline vf lane_of(const vf *v, int j) {
    vi idx = (vi){0} + (j % VW);
    return __builtin_shuffle(v[j / VW], idx);
}

/* Q2_K: 16 scale bytes (low nibble: scale, high: min, per 16 values), 64 bytes of 2-bit q, d,
 * dmin. Value 128 h + 32 s + i is bits 2s..2s+1 of qs[32 h + i]. The bits are taken apart in
 * 32-bit lanes: x86 has no byte shifts, and GCC emulates them element by element on 8-byte
 * vectors (the AVX2 build). */
static inline void deq_q2_k(const uint8_t *blk, vf *w) {
    const uint8_t *qs = blk + 16;
    const vf d = splat(fp16_to_fp32(load_u16(blk + 80))), dmin = splat(fp16_to_fp32(load_u16(blk + 82)));
    vf dl[16 / VW], ml[16 / VW];
    for (int c = 0; c < 16 / VW; c++) {
        vb bytes;
        memcpy(&bytes, blk + c * VW, VW);
        const vi sc = bytes_to_int(bytes);
        dl[c] = d * int_to_float(sc & 0x0f);
        ml[c] = dmin * int_to_float(sc >> 4);
    }
    for (int h = 0; h < 2; h++)
        for (int i = 0; i < 32; i += VW) {
            vb bytes;
            memcpy(&bytes, qs + 32 * h + i, VW);
            const vi q = bytes_to_int(bytes);
            for (int s = 0; s < 4; s++) {
                const int e = 128 * h + 32 * s + i;
                w[e / VW] = lane_of(dl, e / 16) * int_to_float((q >> (2 * s)) & 3) - lane_of(ml, e / 16);
            }
        }
}

/* Q3_K's sixteen 6-bit scales (biased by 32) from their 12 packed bytes: scale j's low 4 bits are
 * nibble j / 8 of byte j % 8, its high 2 bits bits 2 (j / 4) of byte 8 + j % 4; assembled 8 at a
 * time in a uint64 (scales 0..7 in s[0], 8..15 in s[1]). */
static inline void q3_k_scales_u64(const uint8_t *packed, uint64_t s[2]) {
    uint64_t low;
    uint32_t high;
    memcpy(&low, packed, 8);
    memcpy(&high, packed + 8, 4);
    const uint64_t m2 = 0x03030303u;
    s[0] = (low & 0x0f0f0f0f0f0f0f0full) | (((high & m2) | ((high >> 2) & m2) << 32) << 4);
    s[1] = ((low >> 4) & 0x0f0f0f0f0f0f0f0full) | ((((high >> 4) & m2) | ((uint64_t)(high >> 6) & m2) << 32) << 4);
}

static inline void q3_k_scales(const uint8_t *packed, uint8_t scales[16]) {
    uint64_t s[2];
    q3_k_scales_u64(packed, s);
    memcpy(scales, s, 16);
}

/* Q3_K: 32 bytes of high bits (value 128 h + 32 s + i: bit 4 h + s of hmask[i]; q is 4 lower
 * when it is clear), 64 bytes of 2-bit low parts laid out as Q2_K's, sixteen 6-bit signed scales
 * packed in 12 bytes, d. */
static inline void deq_q3_k(const uint8_t *blk, vf *w) {
    const uint8_t *hmask = blk, *qs = blk + 32;
    const vf d = splat(fp16_to_fp32(load_u16(blk + 108)));
    uint8_t bytes16[16];
    q3_k_scales(blk + 96, bytes16);
    vf dl[16 / VW];
    for (int c = 0; c < 16 / VW; c++) {
        vb b;
        memcpy(&b, bytes16 + c * VW, VW);
        dl[c] = d * int_to_float(bytes_to_int(b) - 32);
    }
    for (int i = 0; i < 32; i += VW) {
        vb bytes;
        memcpy(&bytes, hmask + i, VW);
        const vi hm = bytes_to_int(bytes);
        for (int h = 0; h < 2; h++) {
            memcpy(&bytes, qs + 32 * h + i, VW);
            const vi q = bytes_to_int(bytes);
            for (int s = 0; s < 4; s++) {
                const int e = 128 * h + 32 * s + i;
                const vi q3 = (((q >> (2 * s)) & 3) | (((hm >> (4 * h + s)) & 1) << 2)) - 4;
                w[e / VW] = lane_of(dl, e / 16) * int_to_float(q3);
            }
        }
    }
}

/* IQ4_NL / IQ4_XS: 4-bit indices into one non-linear table of int8 values; MXFP4: into the e2m1
 * values (doubled, with the e8m0 scale halved, as gguf-py and ggml read them). */
#define IQ4_TABLE -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113
#define MXFP4_TABLE 0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12

/* 16 bytes of nibbles, values i (low) and 16 + i (high), looked up in a 16-entry table and times
 * d (exact: an int8 times a scale of at most 17 significant bits), into w[0 .. 32 / VW).
 * AVX-512: the table times d in one register, and vpermps looks the nibbles up in it (it reads
 * the low 4 bits of each index); AVX2: pshufb on the int8 table (one 128-bit register). */
#if VW == 16 && defined(__AVX512F__)
#define LUT(name, ...) static const float name[16] = {__VA_ARGS__}
static inline void deq_nibble_table(const float *table, float d, const uint8_t *qs, vf *w) {
    const __m512 scaled = _mm512_mul_ps(_mm512_set1_ps(d), _mm512_loadu_ps(table));
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)qs));
    w[0] = (vf)_mm512_permutexvar_ps(v, scaled);
    w[1] = (vf)_mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), scaled);
}
#elif defined(__AVX2__)
#define LUT(name, ...) static const int8_t name[16] = {__VA_ARGS__}
static inline vf sbytes_lanes_to_float(__m128i v) { return (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)); }
static inline void deq_nibble_table(const int8_t *values, float dv, const uint8_t *qs, vf *w) {
    const __m128i table = _mm_loadu_si128((const __m128i *)values);
    const __m128i q = _mm_loadu_si128((const __m128i *)qs), mask = _mm_set1_epi8(0x0f);
    const __m128i lo = _mm_shuffle_epi8(table, _mm_and_si128(q, mask));
    const __m128i hi = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(q, 4), mask));
    const vf d = splat(dv);
    w[0] = d * sbytes_lanes_to_float(lo);
    w[1] = d * sbytes_lanes_to_float(_mm_srli_si128(lo, 8));
    w[2] = d * sbytes_lanes_to_float(hi);
    w[3] = d * sbytes_lanes_to_float(_mm_srli_si128(hi, 8));
}
#else
#define LUT(name, ...) static const int8_t name[16] = {__VA_ARGS__}
static inline void deq_nibble_table(const int8_t *values, float d, const uint8_t *qs, vf *w) {
    for (int i = 0; i < 32; i++) w[i / VW][i % VW] = d * (float)values[i < 16 ? qs[i] & 0x0f : qs[i - 16] >> 4];
}
#endif

/* The table's values of 16 bytes of nibbles (values i: low, 16 + i: high) as floats, unscaled, for
 * the folded rows of AVX2 and the portable build (AVX-512's lookup in the scaled table gives the
 * weights in one permute: folding the scale out would add work there). */
#if !(VW == 16 && defined(__AVX512F__))
#define TABLE_FOLDED_ROWS 1
#if defined(__AVX2__)
static inline void nibble_table_q(const int8_t *values, const uint8_t *qs, vf q[32 / VW]) {
    const __m128i table = _mm_loadu_si128((const __m128i *)values);
    const __m128i b = _mm_loadu_si128((const __m128i *)qs), mask = _mm_set1_epi8(0x0f);
    const __m128i lo = _mm_shuffle_epi8(table, _mm_and_si128(b, mask));
    const __m128i hi = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(b, 4), mask));
    q[0] = sbytes_lanes_to_float(lo);
    q[1] = sbytes_lanes_to_float(_mm_srli_si128(lo, 8));
    q[2] = sbytes_lanes_to_float(hi);
    q[3] = sbytes_lanes_to_float(_mm_srli_si128(hi, 8));
}
#else
static inline void nibble_table_q(const int8_t *values, const uint8_t *qs, vf q[32 / VW]) {
    for (int i = 0; i < 32; i++) q[i / VW][i % VW] = (float)values[i < 16 ? qs[i] & 0x0f : qs[i - 16] >> 4];
}
#endif
#endif

LUT(IQ4_VALUES, IQ4_TABLE);
LUT(MXFP4_VALUES, MXFP4_TABLE);

static inline void deq_iq4_nl(const uint8_t *blk, vf *w) {
    deq_nibble_table(IQ4_VALUES, fp16_to_fp32(load_u16(blk)), blk + 2, w);
}

/* IQ4_XS: d, the 2 high bits of eight 6-bit signed scales (one uint16), their 4 low bits (4
 * bytes), then eight runs of 32 values as IQ4_NL's nibbles. */
static inline void deq_iq4_xs(const uint8_t *blk, vf *w) {
    const float d = fp16_to_fp32(load_u16(blk));
    const uint16_t scales_h = load_u16(blk + 2);
    const uint8_t *scales_l = blk + 4, *qs = blk + 8;
    for (int j = 0; j < 8; j++) {
        const int scale = (((scales_l[j / 2] >> (4 * (j % 2))) & 0x0f) | (((scales_h >> (2 * j)) & 3) << 4)) - 32;
        deq_nibble_table(IQ4_VALUES, d * (float)scale, qs + 16 * j, w + j * (32 / VW));
    }
}

static inline float e8m0_to_fp32_half(uint8_t e) {
    const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float out;
    memcpy(&out, &bits, 4);
    return out;
}

static inline void deq_mxfp4(const uint8_t *blk, vf *w) {
    deq_nibble_table(MXFP4_VALUES, e8m0_to_fp32_half(blk[0]), blk + 1, w);
}
