/* A whole decode step of a Llama-family model in one call: every layer's norm, qkv GEMV,
 * rotary, KV-cache write, paged attention, o-proj + residual, norm, gate-up GEMV, silu-and-mul,
 * down + residual, then the final norm, for the few rows (<= 4 requests) of a pure-decode step.
 *
 * One OpenMP team runs the whole step (one parallel region a token, not one per GEMV): a GEMV's
 * output rows are handed out in chunks through an atomic counter per phase (so a thread the
 * machine delays takes fewer chunks), attention in the (request, kv head, run of positions)
 * tasks of attention.h, and `omp barrier` separates the dependent phases. What is cheap and
 * read by every thread (the rms norms, silu-and-mul) each thread computes into its own buffer
 * instead of waiting for one thread to do it. The arithmetic is the layer-by-layer path's own:
 * the same GEMV row kernels (quant_kernels.c's NAME##_range), and cpu_kernels.c's norm, rotary,
 * KV write, attention tasks, silu-and-mul and fp32 rows through the function pointers the model
 * hands over; each output value is computed by one thread in the same order whatever the split,
 * so the result is identical bit for bit.
 *
 * Built into each ISA build of quant_kernels.c (it includes that file), so the GEMVs are the
 * chosen ISA's. Nothing here allocates: buffers are the caller's scratch
 * (shm_decode_scratch_floats, sized for m->threads threads and contexts up to m->max_len).
 */
typedef float act_t;
#include "attention.h"
#include "quant_kernels.c"

typedef struct {
    int64_t offset, n, row_bytes, type; /* type -1: plain fp32 rows run by cpu_kernels.c's shm_linear_rows */
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
typedef void (*silu_mul_fn)(float *, const float *, int64_t, int64_t);
typedef void (*linear_rows_fn)(float *, const float *, const float *, const float *, const float *, int64_t, int64_t,
                               int64_t, int64_t, int64_t);

typedef struct {
    int64_t num_layers, hidden, num_heads, kv_heads, head_dim, intermediate, num_slots, block_size;
    float eps, scale;
    int64_t max_len, threads; /* the scratch holds contexts up to max_len for up to `threads` threads */
    const shm_layer *layers;
    const float *final_norm;
    const float *cos_table, *sin_table;
    rms_norm_fn rms_norm;
    rotary_fn rotary;
    write_kv_fn write_kv;
    attention_task_fn attention_task;
    attention_combine_fn attention_combine;
    silu_mul_fn silu_mul;
    linear_rows_fn linear_rows;
} shm_model;

/* Phases a layer hands out work in (qkv, attention, combine, o, gate-up, down), each its counter. */
#define PHASES_PER_LAYER 6

/* Output rows per chunk handed out: about four chunks per thread, whole cache lines of output. */
static inline int64_t chunk_rows(int64_t n, int threads) {
    const int64_t rows = (n + 4 * threads - 1) / (4 * threads);
    return rows < 16 ? 16 : (rows + 15) & ~(int64_t)15;
}

/* Output rows [j0, j1) of out[rows, n] = x @ W^T (+ bias) (+ residual), part by part. */
static void linear_rows(const shm_model *m, const shm_linear *lin, float *out, const float *x, const float *residual,
                        int64_t rows, int64_t j0, int64_t j1) {
    for (int64_t p = 0; p < lin->num_parts; p++) {
        const shm_part *part = &lin->parts[p];
        const int64_t a = j0 > part->offset ? j0 : part->offset;
        const int64_t b = j1 < part->offset + part->n ? j1 : part->offset + part->n;
        if (a >= b) continue;
        if (part->type < 0) {
            m->linear_rows(out, x, (const float *)part->w, lin->bias, residual, rows, lin->n, lin->k, a, b);
            continue;
        }
        format_fns fns;
        lookup((int)part->type, &fns);
        const int64_t o = part->offset;
        fns.range((int)rows, out + o, lin->n, x, lin->k, part->w, part->row_bytes, lin->bias != NULL ? lin->bias + o : NULL,
                  residual != NULL ? residual + o : NULL, lin->n, a - o, b - o, lin->k);
    }
}

/* This thread's share of a GEMV: chunks of output rows taken from `counter` until none is left. */
static void team_linear(const shm_model *m, const shm_linear *lin, float *out, const float *x, const float *residual,
                        int64_t rows, int threads, int64_t *counter) {
    const int64_t step = chunk_rows(lin->n, threads), chunks = (lin->n + step - 1) / step;
    for (int64_t c; (c = __atomic_fetch_add(counter, 1, __ATOMIC_RELAXED)) < chunks;)
        linear_rows(m, lin, out, x, residual, rows, c * step, (c + 1) * step < lin->n ? (c + 1) * step : lin->n);
}

/* Each part's format has kernels and its rows hold whole blocks (fp32 parts: one part, whole). */
static int check_linear(const shm_linear *lin) {
    for (int64_t p = 0; p < lin->num_parts; p++) {
        const shm_part *part = &lin->parts[p];
        format_fns fns;
        if (part->type < 0) {
            if (part->offset != 0 || part->n != lin->n) return -3;
        } else if (lookup((int)part->type, &fns) != 0 || lin->k % block_values((int)part->type) != 0) {
            return -1;
        }
    }
    return 0;
}

static int64_t counter_floats(const shm_model *m) { return 2 * (PHASES_PER_LAYER * m->num_layers + 16); }

int64_t shm_decode_scratch_floats(const shm_model *m, int64_t rows) {
    const int64_t q = m->num_heads * m->head_dim, kv = m->kv_heads * m->head_dim, group = m->num_heads / m->kv_heads;
    const int64_t shared = rows * ((q + 2 * kv) + q + 2 * m->intermediate) +
                           attention_partial_floats(rows, m->kv_heads, attention_chunks(m->max_len), group, m->head_dim);
    const int64_t own = rows * (m->hidden + m->intermediate) + attention_work_floats(group, m->head_dim);
    return counter_floats(m) + shared + m->threads * (own + 16) + 16;
}

/* hidden [rows, hidden] in: the embedded tokens; out: the final-normed hidden states (written to
 * `out`, hidden is the residual stream and is overwritten). Every row is a decode row
 * (decode_rows[i] = i). Returns 0; -1 / -3 for a weight the kernels cannot run; -4 for a context
 * longer than m->max_len. */
int shm_decode_step(const shm_model *m, float *hidden, float *out, int64_t rows, const int64_t *positions,
                    const int64_t *slot_mapping, const int64_t *decode_rows, const int32_t *block_table,
                    int64_t block_table_stride, const int32_t *seq_lens, float *scratch) {
    const int64_t H = m->hidden, D = m->head_dim, q_size = m->num_heads * D, kv_size = m->kv_heads * D;
    const int64_t qkv_width = q_size + 2 * kv_size, I = m->intermediate, group = m->num_heads / m->kv_heads;
    int64_t max_len = 1;
    for (int64_t i = 0; i < rows; i++) max_len = seq_lens[i] > max_len ? seq_lens[i] : max_len;
    if (max_len > m->max_len) return -4;
    for (int64_t l = 0; l < m->num_layers; l++) {
        const shm_layer *layer = &m->layers[l];
        int rc;
        if ((rc = check_linear(&layer->qkv)) || (rc = check_linear(&layer->o)) || (rc = check_linear(&layer->gate_up)) ||
            (rc = check_linear(&layer->down)))
            return rc;
    }
    const int64_t max_chunks = attention_chunks(max_len), pairs = rows * m->kv_heads;
    const int64_t tasks = pairs * max_chunks;
    int64_t *counters = (int64_t *)scratch;
    memset(counters, 0, (size_t)counter_floats(m) * sizeof(float));
    float *qkv = scratch + counter_floats(m), *attn = qkv + rows * qkv_width, *gate_up = attn + rows * q_size;
    float *partials = gate_up + rows * 2 * I;
    float *own_base = partials + attention_partial_floats(rows, m->kv_heads, max_chunks, group, D);
    const int64_t own_floats = rows * (H + I) + attention_work_floats(group, D) + 16;
    const shm_attention_args args = {attn, q_size, qkv, qkv_width, decode_rows, rows, NULL, NULL, m->num_slots,
                                     block_table, block_table_stride, seq_lens, m->block_size, m->num_heads,
                                     m->kv_heads, D, m->scale, max_chunks};
    int threads = omp_get_max_threads();
    threads = threads < m->threads ? threads : (int)m->threads;
#pragma omp parallel num_threads(threads)
    {
        const int tid = omp_get_thread_num(), team = omp_get_num_threads();
        float *normed = own_base + tid * own_floats, *act = normed + rows * H, *work = act + rows * I;
        int64_t *counter = counters;
        shm_attention_args a = args;
        for (int64_t l = 0; l < m->num_layers; l++, counter += PHASES_PER_LAYER) {
            const shm_layer *layer = &m->layers[l];
            a.k_cache = layer->k_cache;
            a.v_cache = layer->v_cache;
            m->rms_norm(normed, hidden, layer->input_norm, rows, H, m->eps);
            team_linear(m, &layer->qkv, qkv, normed, NULL, rows, team, &counter[0]);
#pragma omp barrier
            if (tid == 0) {
                m->rotary(qkv, qkv_width, rows, m->num_heads + m->kv_heads, D, positions, m->cos_table, m->sin_table);
                m->write_kv(qkv + q_size, qkv_width, qkv + q_size + kv_size, qkv_width, slot_mapping, rows,
                            layer->k_cache, layer->v_cache, m->num_slots, m->kv_heads, D);
            }
#pragma omp barrier
            for (int64_t t; (t = __atomic_fetch_add(&counter[1], 1, __ATOMIC_RELAXED)) < tasks;)
                m->attention_task(&a, t, work, partials);
            if (max_chunks > 1) {
#pragma omp barrier
                for (int64_t p; (p = __atomic_fetch_add(&counter[2], 1, __ATOMIC_RELAXED)) < pairs;)
                    m->attention_combine(&a, p, partials);
            }
#pragma omp barrier
            team_linear(m, &layer->o, hidden, attn, hidden, rows, team, &counter[3]);
#pragma omp barrier
            m->rms_norm(normed, hidden, layer->post_norm, rows, H, m->eps);
            team_linear(m, &layer->gate_up, gate_up, normed, NULL, rows, team, &counter[4]);
#pragma omp barrier
            m->silu_mul(act, gate_up, rows, I);
            team_linear(m, &layer->down, hidden, act, hidden, rows, team, &counter[5]);
#pragma omp barrier
        }
        if (tid == 0) m->rms_norm(out, hidden, m->final_norm, rows, H, m->eps);
    }
    return 0;
}

/* The streaming-read probe: `threads` threads each sum their contiguous share of buf[0, bytes)
 * with the build's widest loads (four independent accumulators, so the adds never limit the
 * loads); returns the sum, so the reads cannot be optimized away. `bytes`: a multiple of four
 * vectors (256 covers every build). What the decode step's weight stream is compared against
 * (benchmarks/latency.py, benchmarks/decode_profile.py). */
double shm_read_probe(const uint8_t *buf, int64_t bytes, int threads) {
    const int64_t step = 4 * sizeof(vf), steps = bytes / step;
    double total = 0.0;
#pragma omp parallel num_threads(threads) reduction(+ : total)
    {
        const int64_t t = omp_get_thread_num(), team = omp_get_num_threads();
        const uint8_t *end = buf + steps * (t + 1) / team * step;
        vf a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
        for (const uint8_t *p = buf + steps * t / team * step; p < end; p += step) {
            a0 += loadf((const float *)p);
            a1 += loadf((const float *)(p + sizeof(vf)));
            a2 += loadf((const float *)(p + 2 * sizeof(vf)));
            a3 += loadf((const float *)(p + 3 * sizeof(vf)));
        }
        total += hsum((a0 + a1) + (a2 + a3));
    }
    return total;
}
