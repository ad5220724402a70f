/* A whole decode step of a Llama-family model in one call: every layer's norm, qkv GEMV,
 * rotary, KV-cache write, paged attention, o-proj + residual, norm, gate-up GEMV, silu-and-mul,
 * down + residual, then the final norm, for the few rows (<= 4 requests) of a pure-decode step.
 *
 * Why: at one request the GEMVs on the blocks take ~2-4 ms a token, and the Python around the
 * ~10 kernel calls of each of 30 layers (ctypes argument conversion, torch allocations, module
 * dispatch) came to about as much again. Here Python makes one call a step; the arithmetic is the
 * layer-by-layer path's own kernels in the same order (shm_qgemm below, and cpu_kernels.c's
 * rms_norm, rotary, KV write, attention and silu-and-mul through the function pointers the
 * model hands over), so the result is identical bit for bit.
 *
 * Built into each ISA build of quant_kernels.c (it includes that file), so the GEMVs are the
 * chosen ISA's. Buffers are the caller's (scratch sized by shm_decode_scratch_floats).
 */
#include "quant_kernels.c"

typedef struct {
    int64_t offset, n, row_bytes, type; /* type -1: plain fp32 rows run by the fp32 few-row GEMV */
    const uint8_t *w;
} shm_part;

typedef struct {
    const shm_part *parts;
    int64_t num_parts, n, k;
    const float *bias;
} shm_linear;

typedef struct {
    const float *input_norm, *post_norm;
    shm_linear qkv, o, gate_up, down;
    float *k_cache, *v_cache; /* [kv_heads, num_slots, head_dim] */
} shm_layer;

typedef void (*rms_norm_fn)(float *, const float *, const float *, int64_t, int64_t, float);
typedef void (*rotary_fn)(float *, int64_t, int64_t, int64_t, int64_t, const int64_t *, const float *, const float *);
typedef void (*write_kv_fn)(const float *, int64_t, const float *, int64_t, const int64_t *, int64_t, float *, float *,
                            int64_t, int64_t, int64_t);
typedef int (*attention_fn)(float *, int64_t, const float *, int64_t, const int64_t *, int64_t, const float *,
                            const float *, int64_t, const int32_t *, int64_t, const int32_t *, int64_t, int64_t,
                            int64_t, int64_t, float);
typedef void (*silu_mul_fn)(float *, const float *, int64_t, int64_t);
typedef void (*linear_f32_fn)(float *, const float *, const float *, const float *, const float *, int64_t, int64_t,
                              int64_t);

typedef struct {
    int64_t num_layers, hidden, num_heads, kv_heads, head_dim, intermediate, num_slots, block_size;
    float eps, scale;
    const shm_layer *layers;
    const float *final_norm;
    const float *cos_table, *sin_table;
    rms_norm_fn rms_norm;
    rotary_fn rotary;
    write_kv_fn write_kv;
    attention_fn attention;
    silu_mul_fn silu_mul;
    linear_f32_fn linear_f32;
} shm_model;

/* out[rows, n] = x @ W^T (+ bias) (+ residual), part by part; out may alias residual. */
static int run_linear(const shm_model *m, const shm_linear *lin, float *out, const float *x, const float *residual,
                      int64_t rows) {
    for (int64_t p = 0; p < lin->num_parts; p++) {
        const shm_part *part = &lin->parts[p];
        const float *bias = lin->bias != NULL ? lin->bias + part->offset : NULL;
        const float *res = residual != NULL ? residual + part->offset : NULL;
        if (part->type < 0) {
            if (part->offset != 0 || part->n != lin->n) return -3;
            m->linear_f32(out, x, (const float *)part->w, bias, res, rows, lin->n, lin->k);
        } else {
            const int rc = shm_qgemm(out + part->offset, lin->n, x, lin->k, part->w, part->row_bytes, (int)part->type,
                                     bias, res, lin->n, rows, part->n, lin->k);
            if (rc != 0) return rc;
        }
    }
    return 0;
}

int64_t shm_decode_scratch_floats(const shm_model *m, int64_t rows) {
    const int64_t q = m->num_heads * m->head_dim, kv = m->kv_heads * m->head_dim;
    return rows * (m->hidden + (q + 2 * kv) + q + 2 * m->intermediate + m->intermediate);
}

/* hidden [rows, hidden] in: the embedded tokens; out: the final-normed hidden states (written to
 * `out`, hidden is the residual stream and is overwritten). Every row is a decode row
 * (decode_rows[i] = i). Returns 0, or the failing kernel's status. */
int shm_decode_step(const shm_model *m, float *hidden, float *out, int64_t rows, const int64_t *positions,
                    const int64_t *slot_mapping, const int64_t *decode_rows, const int32_t *block_table,
                    int64_t block_table_stride, const int32_t *seq_lens, float *scratch) {
    const int64_t H = m->hidden, D = m->head_dim, q_size = m->num_heads * D, kv_size = m->kv_heads * D;
    const int64_t qkv_width = q_size + 2 * kv_size, I = m->intermediate;
    float *normed = scratch, *qkv = normed + rows * H, *attn = qkv + rows * qkv_width, *gate_up = attn + rows * q_size;
    float *act = gate_up + rows * 2 * I;
    int rc;
    for (int64_t l = 0; l < m->num_layers; l++) {
        const shm_layer *layer = &m->layers[l];
        m->rms_norm(normed, hidden, layer->input_norm, rows, H, m->eps);
        if ((rc = run_linear(m, &layer->qkv, qkv, normed, NULL, rows)) != 0) return rc;
        m->rotary(qkv, qkv_width, rows, m->num_heads + m->kv_heads, D, positions, m->cos_table, m->sin_table);
        m->write_kv(qkv + q_size, qkv_width, qkv + q_size + kv_size, qkv_width, slot_mapping, rows, layer->k_cache,
                    layer->v_cache, m->num_slots, m->kv_heads, D);
        rc = m->attention(attn, q_size, qkv, qkv_width, decode_rows, rows, layer->k_cache, layer->v_cache, m->num_slots,
                          block_table, block_table_stride, seq_lens, m->block_size, m->num_heads, m->kv_heads, D,
                          m->scale);
        if (rc != 0) return -10 + rc;
        if ((rc = run_linear(m, &layer->o, hidden, attn, hidden, rows)) != 0) return rc;
        m->rms_norm(normed, hidden, layer->post_norm, rows, H, m->eps);
        if ((rc = run_linear(m, &layer->gate_up, gate_up, normed, NULL, rows)) != 0) return rc;
        m->silu_mul(act, gate_up, rows, I);
        if ((rc = run_linear(m, &layer->down, hidden, act, hidden, rows)) != 0) return rc;
    }
    m->rms_norm(out, hidden, m->final_norm, rows, H, m->eps);
    return 0;
}
