/* A whole decode step of a decoder model in one call: every layer's norms, qkv GEMV, q/k norms,
 * rotary, KV-cache write, paged attention, o-proj + residual, norms, gate-up GEMV, GLU
 * activation, down + residual (or a mixture of experts: router GEMV, softmax top-k, then moe.c's
 * experts: each chosen expert's gate-up and down GEMVs on the rows that chose it, the weighted sum
 * + residual), then the final norm, for the few rows (<= 4 requests) of a pure-decode step.
 *
 * The families' options are data in the layer table, not code paths of their own: each of a
 * layer's four norms (before / after attention, before / after the MLP) is there or NULL, its
 * weight already (1 + w) where the family scales so (Gemma); q/k norms over each head (Qwen3,
 * Gemma 3) or over the whole projection (OLMo 2); a rotary table per layer or none (Gemma 3's
 * local base, SmolLM3's NoPE layers); per layer the score scale, sliding window and
 * soft-capping; the GLU activation (SiLU or tanh GELU) and a residual scale (Granite) per model.
 *
 * One OpenMP team runs the whole step (one parallel region a token, not one per GEMV): a GEMV's
 * output rows are handed out in chunks through an atomic counter per phase (so a thread the
 * machine delays takes fewer chunks), attention in the (request, query heads, kv head, run
 * of positions) tasks of attention.h, and `omp barrier` separates the dependent phases. What is
 * cheap and read by every thread (the rms norms, the activation, and where the residual add is not fused
 * into a GEMV, the residual stream itself) each thread computes into its own buffer instead of
 * waiting for one thread to do it. The arithmetic is the layer-by-layer path's own: the same
 * GEMV row kernels (quant_kernels.c's NAME##_range), and cpu_kernels.c's norm, rotary, KV
 * write, attention tasks, activations and fp32 rows through the function pointers the model
 * hands over; the residual add is torch's (one rounding for the product by the residual
 * scale, one for the sum); each output value is computed by one thread in the same order
 * whatever the split, so the result is identical bit for bit.
 *
 * A greedy decode burst (shm_decode_burst) runs several tokens of one sequence in one parallel
 * region: per token the embedding row, the step, the lm_head (its rows in one chunk a thread,
 * each chunk's argmax taken while its logits are in cache) and the argmax, so the tokens
 * between two engine steps make no Python call and enter no further OpenMP region.
 *
 * Built into each ISA build of quant_kernels.c (it includes that file), so the GEMVs are the
 * chosen ISA's. Nothing here allocates: buffers are the caller's scratch
 * (shm_decode_scratch_floats, sized for m->threads threads and contexts up to m->max_len; a
 * burst's own, shm_decode_burst_floats).
 */
typedef float act_t;
#include <math.h>
#include <sched.h>
#include "attention.h"
#include "quant_kernels.c"

#ifdef SHM_STEP_PROFILE
/* The profiling build (benchmarks/decode_profile.py --step-stages): each thread's nanoseconds in
 * each stage of the step, summed over calls; the shipped build compiles STAMP to nothing. */
#include <time.h>
enum { ST_FORK, ST_QKV, ST_QKV_WAIT, ST_ROPE, ST_ROPE_WAIT, ST_ATTN, ST_ATTN_WAIT, ST_O, ST_O_WAIT, ST_GATE_UP,
       ST_GATE_UP_WAIT, ST_GLU, ST_DOWN, ST_DOWN_WAIT, ST_FINAL, ST_FINAL_WAIT, ST_HEAD, ST_HEAD_WAIT, ST_PICK,
       ST_STAGES };
#define PROFILE_THREADS 8
static int64_t step_profile[PROFILE_THREADS][ST_STAGES];
static __thread int64_t last_; /* when this thread's last stage ended */
static inline int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}
#define STAMP(stage)                                                    \
    do {                                                                \
        const int64_t now_ = now_ns();                                  \
        if (tid < PROFILE_THREADS) step_profile[tid][stage] += now_ - last_; \
        last_ = now_;                                                   \
    } while (0)

/* Copies the sums into out[PROFILE_THREADS * ST_STAGES] and zeroes them; returns ST_STAGES. */
int shm_step_profile(int64_t *out) {
    memcpy(out, step_profile, sizeof(step_profile));
    memset(step_profile, 0, sizeof(step_profile));
    return ST_STAGES;
}
#else
#define STAMP(stage) ((void)0)
#endif

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
    /* before attention, after it, before the MLP, after it; NULL: the layer has no such norm */
    const float *attn_in_norm, *attn_out_norm, *mlp_in_norm, *mlp_out_norm;
    const float *q_norm, *k_norm; /* NULL: no q/k norm; else over m->qk_norm_width features at a time */
    shm_linear qkv, o, gate_up, down;
    float *k_cache, *v_cache; /* [kv_heads, num_slots, head_dim] */
    const float *cos_table, *sin_table; /* NULL: no rotary on this layer */
    float scale, softcap; /* scores times scale; softcap > 0: cap * tanh(score / cap) */
    int64_t window;       /* > 0: the layer attends to the last `window` positions */
    /* a mixture-of-experts MLP where num_experts > 0 (gate_up / down unused): the router (fp32 logits ->
     * softmax -> top_k, renormalized where norm_topk) and each expert's gate-up and down projections */
    shm_linear router;
    const shm_linear *expert_gate_up, *expert_down;
    int64_t num_experts, top_k, norm_topk, expert_intermediate;
} shm_layer;

typedef void (*rms_norm_fn)(float *, const float *, const float *, int64_t, int64_t, float);
typedef void (*rotary_fn)(float *, int64_t, int64_t, int64_t, int64_t, const int64_t *, const float *, const float *);
typedef void (*write_kv_fn)(const float *, int64_t, const float *, int64_t, const int64_t *, int64_t, float *, float *,
                            int64_t, int64_t, int64_t);
typedef void (*glu_fn)(float *, const float *, int64_t, int64_t);
typedef void (*linear_rows_fn)(float *, const float *, const float *, const float *, const float *, int64_t, int64_t,
                               int64_t, int64_t, int64_t);

typedef struct {
    int64_t num_layers, hidden, num_heads, kv_heads, head_dim, intermediate, num_slots, block_size;
    float eps, residual_scale;
    int64_t fused_residual; /* 1: o and down add the residual in their GEMV (pre norms only, residual scale 1) */
    int64_t qk_norm_width;  /* head_dim: q/k norms per head; 0: over the whole projection */
    int64_t max_len, threads; /* the scratch holds contexts up to max_len for up to `threads` threads */
    const shm_layer *layers;
    const float *final_norm;
    rms_norm_fn rms_norm;
    rotary_fn rotary;
    write_kv_fn write_kv;
    attention_task_fn attention_task;
    attention_combine_fn attention_combine;
    glu_fn glu; /* silu-and-mul or gelu-tanh-and-mul */
    linear_rows_fn linear_rows;
    int64_t moe_slots, max_experts; /* the largest top_k and expert count of the MoE layers (0: none) */
} shm_model;

/* Phases a layer hands out work in (qkv, attention, combine, o, gate-up, down, router, attention
 * inputs), each its counter; a MoE layer's experts take synchronisation words of their own (moe.c's moe_team). */
#define PHASES_PER_LAYER 8

/* Output rows per chunk handed out: one chunk per thread (each streams one contiguous run of weight
 * rows, the hardware prefetcher's best case; smaller chunks measured slower, decode_profile.md). */
static inline int64_t chunk_rows(int64_t n, int threads) {
    const int64_t rows = (n + threads - 1) / threads;
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

#include "moe.c"
#include "greedy_head.c"

/* A MoE layer's moe_team synchronisation words (its runs: at most FEW_ROWS rows x moe_slots). */
static int64_t moe_layer_words(const shm_model *m) {
    return m->moe_slots > 0 ? moe_sync_words(FEW_ROWS * m->moe_slots, m->threads) : 0;
}

/* The phases' counters and the MoE layers' synchronisation words, zeroed at each step's start. */
static int64_t counter_floats(const shm_model *m) {
    return 2 * (PHASES_PER_LAYER * m->num_layers + 16 + m->num_layers * moe_layer_words(m));
}

/* A MoE layer's routing, as each thread keeps it: each row's top_k expert ids and weights, the
 * softmax, the slots sorted by expert (moe.c's plan) and the normed rows gathered in slot order. */
typedef struct {
    int64_t *ids;
    moe_plan plan;
    float *weights, *probs, *xs;
} moe_routing;

static int64_t moe_own_floats(const shm_model *m, int64_t rows) {
    const int64_t slots = rows * m->moe_slots;
    return 2 * slots + moe_plan_floats(rows, m->moe_slots, m->max_experts) + slots + rows * m->max_experts +
           slots * m->hidden;
}

/* This thread's routing buffers at `buf` (8-byte aligned). */
static moe_routing moe_routing_at(const shm_model *m, const shm_layer *layer, float *buf, int64_t rows) {
    const int64_t slots = rows * m->moe_slots;
    moe_routing r;
    r.ids = (int64_t *)buf;
    r.plan = moe_plan_at(buf + 2 * slots, rows, layer->top_k, layer->num_experts);
    r.weights = buf + 2 * slots + moe_plan_floats(rows, m->moe_slots, m->max_experts);
    r.probs = r.weights + slots;
    r.xs = r.probs + rows * m->max_experts;
    return r;
}

/* A thread's own floats: normed input, activation, attention work, (unfused residual) the
 * residual stream and a normed block output, and a MoE layer's routing. */
static int64_t own_floats(const shm_model *m, int64_t rows) {
    return rows * (3 * m->hidden + m->intermediate) + attention_work_floats(m->num_heads / m->kv_heads, m->head_dim) +
           moe_own_floats(m, rows) + 16;
}

int64_t shm_decode_scratch_floats(const shm_model *m, int64_t rows) {
    const int64_t q = m->num_heads * m->head_dim, kv = m->kv_heads * m->head_dim, group = m->num_heads / m->kv_heads;
    const int64_t shared = rows * ((q + 2 * kv) + q + 2 * m->intermediate + m->hidden) +
                           rows * (m->max_experts + m->moe_slots * m->hidden) + /* router logits, experts' outputs */
                           rows * m->intermediate * (m->moe_slots > 0) +          /* the experts' activations */
                           attention_partial_floats(rows, m->kv_heads, attention_chunks(m->max_len), group, m->head_dim);
    return counter_floats(m) + shared + m->threads * own_floats(m, rows) + 16;
}

/* The norm of `x` with `weight` into `buf`, or x itself where the layer has no such norm. */
static inline const float *norm_or_same(const shm_model *m, float *buf, const float *x, const float *weight,
                                        int64_t rows) {
    if (weight == NULL) return x;
    m->rms_norm(buf, x, weight, rows, m->hidden, m->eps);
    return buf;
}

/* residual += norm(block) (times the residual scale), as torch adds them in the layer path:
 * the product rounded, then the sum (no fused multiply-add). */
__attribute__((optimize("fp-contract=off"))) static void add_block(const shm_model *m, float *residual,
                                                                   const float *block, const float *norm, float *buf,
                                                                   int64_t rows) {
    const float *out = norm_or_same(m, buf, block, norm, rows);
    const float scale = m->residual_scale;
    if (scale == 1.0f) {
        for (int64_t i = 0; i < rows * m->hidden; i++) residual[i] = residual[i] + out[i];
    } else {
        for (int64_t i = 0; i < rows * m->hidden; i++) residual[i] = residual[i] + out[i] * scale;
    }
}

/* The routing of every row from the router's logits [rows, E], as the layer path's torch ops do:
 * softmax over the experts in fp32, the top_k largest (the lower index first among equals), divided
 * by their sum where norm_topk; then moe.c's plan of the slots and the normed rows gathered in slot
 * order. Every thread computes it (no barrier; the same values on each). */
static void moe_route(const shm_model *m, const shm_layer *layer, const float *logits, const float *x, int64_t rows,
                      moe_routing *r) {
    const int64_t E = layer->num_experts, K = layer->top_k, H = m->hidden;
    for (int64_t t = 0; t < rows; t++) {
        const float *l = logits + t * E;
        float *p = r->probs + t * E, top = l[0], sum = 0.0f;
        for (int64_t e = 1; e < E; e++) top = l[e] > top ? l[e] : top;
        for (int64_t e = 0; e < E; e++) sum += (p[e] = expf(l[e] - top));
        for (int64_t e = 0; e < E; e++) p[e] /= sum;
        int64_t *ids = r->ids + t * K;
        float *weights = r->weights + t * K, chosen = 0.0f;
        for (int64_t j = 0; j < K; j++) {
            int64_t best = -1;
            for (int64_t e = 0; e < E; e++) {
                int taken = 0;
                for (int64_t i = 0; i < j; i++) taken |= ids[i] == e;
                if (!taken && (best < 0 || p[e] > p[best])) best = e;
            }
            ids[j] = best;
            chosen += (weights[j] = p[best]);
        }
        if (layer->norm_topk)
            for (int64_t j = 0; j < K; j++) weights[j] /= chosen;
    }
    moe_sort(&r->plan, r->ids, r->weights, rows, K, E); /* ids in [0, E): nothing to refuse */
    for (int64_t s = 0; s < r->plan.slots; s++) memcpy(r->xs + s * H, x + r->plan.row[s] * H, (size_t)H * sizeof(float));
}

/* The q/k norms, rotary and KV write of the step's rows where the q/k norms span the whole
 * projection (OLMo 2): every head's norm needs all heads, so one thread does it all. */
static void attention_inputs(const shm_model *m, const shm_layer *layer, float *qkv, int64_t rows,
                             const int64_t *positions, const int64_t *slot_mapping) {
    const int64_t D = m->head_dim, q_size = m->num_heads * D, kv_size = m->kv_heads * D, width = q_size + 2 * kv_size;
    for (int64_t t = 0; t < rows; t++) {
        float *q = qkv + t * width, *k = q + q_size;
        m->rms_norm(q, q, layer->q_norm, 1, q_size, m->eps);
        m->rms_norm(k, k, layer->k_norm, 1, kv_size, m->eps);
    }
    if (layer->cos_table != NULL)
        m->rotary(qkv, width, rows, m->num_heads + m->kv_heads, D, positions, layer->cos_table, layer->sin_table);
    m->write_kv(qkv + q_size, width, qkv + q_size + kv_size, width, slot_mapping, rows, layer->k_cache, layer->v_cache,
                m->num_slots, m->kv_heads, D);
}

/* The same for one (row, kv head) `pair` = t * kv_heads + h, where the q/k norms are per head or
 * absent: its group's query heads and its key head normed and rotated, its key and value rows
 * written to the cache. Each head's arithmetic is the whole-row calls' (they loop over heads), so
 * the pairs run on any threads. */
static void attention_pair_inputs(const shm_model *m, const shm_layer *layer, float *qkv, int64_t pair,
                                  const int64_t *positions, const int64_t *slot_mapping) {
    const int64_t D = m->head_dim, q_size = m->num_heads * D, kv_size = m->kv_heads * D, width = q_size + 2 * kv_size;
    const int64_t t = pair / m->kv_heads, h = pair % m->kv_heads, group = m->num_heads / m->kv_heads;
    float *q = qkv + t * width + h * group * D, *k = qkv + t * width + q_size + h * D, *v = k + kv_size;
    if (layer->q_norm != NULL) {
        m->rms_norm(q, q, layer->q_norm, group, D, m->eps);
        m->rms_norm(k, k, layer->k_norm, 1, D, m->eps);
    }
    if (layer->cos_table != NULL) {
        m->rotary(q, width, 1, group, D, positions + t, layer->cos_table, layer->sin_table);
        m->rotary(k, width, 1, 1, D, positions + t, layer->cos_table, layer->sin_table);
    }
    const int64_t head = h * m->num_slots * D;
    m->write_kv(k, width, v, width, slot_mapping + t, 1, layer->k_cache + head, layer->v_cache + head, m->num_slots, 1, D);
}

/* Each layer's norm weights and GEMVs can run; -1 / -3 for a weight the kernels cannot run. */
static int check_model(const shm_model *m) {
    for (int64_t l = 0; l < m->num_layers; l++) {
        const shm_layer *layer = &m->layers[l];
        int rc;
        if ((rc = check_linear(&layer->qkv)) || (rc = check_linear(&layer->o)) || (rc = check_linear(&layer->gate_up)) ||
            (rc = check_linear(&layer->down)) || (rc = check_linear(&layer->router)))
            return rc;
        if (layer->num_experts > m->max_experts || layer->top_k > m->moe_slots) return -6;
        for (int64_t e = 0; e < layer->num_experts; e++)
            if ((rc = check_linear(&layer->expert_gate_up[e])) || (rc = check_linear(&layer->expert_down[e]))) return rc;
        if (m->fused_residual && (layer->attn_out_norm != NULL || layer->mlp_out_norm != NULL)) return -5;
    }
    if (m->fused_residual && m->residual_scale != 1.0f) return -5;
    return 0;
}

/* One call's buffers and inputs as every thread of the team sees them. `max_len` (the longest
 * context of the call's rows) and the inputs may change between a burst's tokens. */
typedef struct {
    float *hidden, *out, *qkv, *attn, *gate_up, *block, *router_logits, *expert_out, *moe_act, *partials, *own_base;
    int64_t *counters, *moe_sync;
    int64_t rows, own, max_len;
    const int64_t *positions, *slot_mapping;
    shm_attention_args args;
#ifdef SHM_STEP_PROFILE
    int64_t forked; /* when the team was asked to start (ST_FORK); 0 in a burst */
#endif
} step_state;

/* Lays out `scratch` for `rows` rows at contexts up to `max_len` (counters zeroed). */
static step_state step_state_at(const shm_model *m, float *scratch, float *hidden, float *out, int64_t rows,
                                int64_t max_len, const int64_t *positions, const int64_t *slot_mapping,
                                const int64_t *decode_rows, const int32_t *block_table, int64_t block_table_stride,
                                const int32_t *seq_lens) {
    const int64_t D = m->head_dim, q_size = m->num_heads * D, kv_size = m->kv_heads * D;
    const int64_t I = m->intermediate, group = m->num_heads / m->kv_heads;
    step_state s;
#ifdef SHM_STEP_PROFILE
    s.forked = 0;
#endif
    s.hidden = hidden;
    s.out = out;
    s.rows = rows;
    s.max_len = max_len;
    s.positions = positions;
    s.slot_mapping = slot_mapping;
    s.counters = (int64_t *)scratch;
    memset(s.counters, 0, (size_t)counter_floats(m) * sizeof(float));
    s.qkv = scratch + counter_floats(m);
    s.attn = s.qkv + rows * (q_size + 2 * kv_size);
    s.gate_up = s.attn + rows * q_size;
    s.block = s.gate_up + rows * 2 * I; /* o's and down's outputs where the residual is not fused */
    s.router_logits = s.block + rows * m->hidden;
    s.expert_out = s.router_logits + rows * m->max_experts;
    s.moe_act = s.expert_out + rows * m->moe_slots * m->hidden;
    s.partials = s.moe_act + rows * I * (m->moe_slots > 0);
    s.moe_sync = s.counters + PHASES_PER_LAYER * m->num_layers + 16; /* each MoE layer's moe_layer_words */
    s.own_base = s.partials + attention_partial_floats(rows, m->kv_heads, attention_chunks(max_len), group, D);
    s.own = own_floats(m, rows);
    const shm_attention_args args = {s.attn, q_size, s.qkv, q_size + 2 * kv_size, decode_rows, rows, NULL, NULL,
                                     m->num_slots, block_table, block_table_stride, seq_lens, m->block_size,
                                     m->num_heads, m->kv_heads, D, 0.0f, 1, 1, 0, 0.0f, NULL};
    s.args = args;
    return s;
}

/* This thread's part of one step over every layer, then (thread 0) the final norm into s->out.
 * Every thread of the team calls it; the counters must be zero. */
static void step_layers(const shm_model *m, const step_state *s, int tid, int team) {
    const int64_t H = m->hidden, D = m->head_dim, rows = s->rows, max_len = s->max_len;
    const int64_t I = m->intermediate, group = m->num_heads / m->kv_heads, pairs = rows * m->kv_heads;
    float *hidden = s->hidden, *qkv = s->qkv, *attn = s->attn, *gate_up = s->gate_up, *block = s->block;
    float *router_logits = s->router_logits, *expert_out = s->expert_out, *moe_act = s->moe_act;
    float *partials = s->partials;
    const int64_t *positions = s->positions, *slot_mapping = s->slot_mapping;
#ifdef SHM_STEP_PROFILE
    if (s->forked != 0) last_ = s->forked; /* a burst's stages run on from its previous token's */
    STAMP(ST_FORK);
#endif
    float *normed = s->own_base + tid * s->own, *act = normed + rows * H, *residual = act + rows * I;
    float *block_normed = residual + rows * H, *work = block_normed + rows * H;
    float *routing_base = work + attention_work_floats(group, D);
    /* the residual stream: the shared `hidden` where the GEMVs add into it, else this thread's copy */
    float *stream = hidden;
    if (!m->fused_residual) {
        memcpy(residual, hidden, (size_t)(rows * H) * sizeof(float));
        stream = residual;
    }
    int64_t *counter = s->counters;
    shm_attention_args a = s->args;
    for (int64_t l = 0; l < m->num_layers; l++, counter += PHASES_PER_LAYER) {
        const shm_layer *layer = &m->layers[l];
        const int64_t span = layer->window > 0 && max_len > layer->window ? layer->window : max_len;
        a.k_cache = layer->k_cache;
        a.v_cache = layer->v_cache;
        a.scale = layer->scale;
        a.softcap = layer->softcap;
        a.window = layer->window;
        a.max_chunks = attention_chunks(span);
        a.head_splits = attention_head_splits(pairs * a.max_chunks, group, team);
        const int64_t tasks = attention_tasks(&a);
        team_linear(m, &layer->qkv, qkv, norm_or_same(m, normed, stream, layer->attn_in_norm, rows), NULL, rows, team,
                    &counter[0]);
        STAMP(ST_QKV);
#pragma omp barrier
        STAMP(ST_QKV_WAIT);
        if (layer->q_norm != NULL && m->qk_norm_width == 0) {
            if (tid == 0) attention_inputs(m, layer, qkv, rows, positions, slot_mapping);
        } else {
            for (int64_t p; (p = __atomic_fetch_add(&counter[7], 1, __ATOMIC_RELAXED)) < pairs;)
                attention_pair_inputs(m, layer, qkv, p, positions, slot_mapping);
        }
        STAMP(ST_ROPE);
#pragma omp barrier
        STAMP(ST_ROPE_WAIT);
        for (int64_t t; (t = __atomic_fetch_add(&counter[1], 1, __ATOMIC_RELAXED)) < tasks;)
            m->attention_task(&a, t, work, partials);
        STAMP(ST_ATTN);
        if (a.max_chunks > 1) {
#pragma omp barrier
            for (int64_t p; (p = __atomic_fetch_add(&counter[2], 1, __ATOMIC_RELAXED)) < pairs;)
                m->attention_combine(&a, p, partials);
        }
#pragma omp barrier
        STAMP(ST_ATTN_WAIT);
        if (m->fused_residual) {
            team_linear(m, &layer->o, hidden, attn, hidden, rows, team, &counter[3]);
            STAMP(ST_O);
#pragma omp barrier
            STAMP(ST_O_WAIT);
        } else {
            team_linear(m, &layer->o, block, attn, NULL, rows, team, &counter[3]);
#pragma omp barrier
            add_block(m, stream, block, layer->attn_out_norm, block_normed, rows);
        }
        if (layer->num_experts > 0) {
            const float *x = norm_or_same(m, normed, stream, layer->mlp_in_norm, rows);
            const moe_experts experts = {layer->expert_gate_up, layer->expert_down, H, layer->expert_intermediate,
                                         layer->top_k, m->glu};
            moe_routing routing = moe_routing_at(m, layer, routing_base, rows);
            team_linear(m, &layer->router, router_logits, x, NULL, rows, team, &counter[6]);
#pragma omp barrier
            moe_route(m, layer, router_logits, x, rows, &routing);
            /* the weighted sums go into the residual stream (fused) or `block` */
            moe_team(m, &experts, &routing.plan, routing.xs, gate_up, moe_act, expert_out,
                     m->fused_residual ? hidden : block, m->fused_residual ? hidden : NULL, rows, team,
                     s->moe_sync + l * moe_layer_words(m));
#pragma omp barrier
            if (!m->fused_residual) add_block(m, stream, block, layer->mlp_out_norm, block_normed, rows);
            continue;
        }
        team_linear(m, &layer->gate_up, gate_up, norm_or_same(m, normed, stream, layer->mlp_in_norm, rows), NULL, rows,
                    team, &counter[4]);
        STAMP(ST_GATE_UP);
#pragma omp barrier
        STAMP(ST_GATE_UP_WAIT);
        m->glu(act, gate_up, rows, I);
        STAMP(ST_GLU);
        if (m->fused_residual) {
            team_linear(m, &layer->down, hidden, act, hidden, rows, team, &counter[5]);
            STAMP(ST_DOWN);
#pragma omp barrier
            STAMP(ST_DOWN_WAIT);
        } else {
            team_linear(m, &layer->down, block, act, NULL, rows, team, &counter[5]);
#pragma omp barrier
            add_block(m, stream, block, layer->mlp_out_norm, block_normed, rows);
        }
    }
    if (tid == 0) m->rms_norm(s->out, stream, m->final_norm, rows, H, m->eps);
    STAMP(ST_FINAL);
}

/* The team's size for a call: OpenMP's, at most the table's. */
static int step_threads(const shm_model *m) {
    const int threads = omp_get_max_threads();
    return threads < m->threads ? threads : (int)m->threads;
}

/* hidden [rows, hidden] in: the embedded tokens; out: the final-normed hidden states (written to
 * `out`; hidden is overwritten). Every row is a decode row (decode_rows[i] = i). Returns 0;
 * -1 / -3 for a weight the kernels cannot run; -4 for a context longer than m->max_len; -5 for
 * a residual fused into the GEMVs of a model with norms after the blocks or a residual scale; -6
 * for a MoE layer beyond the table's moe_slots / max_experts or, with MoE layers, more than FEW_ROWS rows. */
int shm_decode_step(const shm_model *m, float *hidden, float *out, int64_t rows, const int64_t *positions,
                    const int64_t *slot_mapping, const int64_t *decode_rows, const int32_t *block_table,
                    int64_t block_table_stride, const int32_t *seq_lens, float *scratch) {
    int64_t max_len = 1;
    for (int64_t i = 0; i < rows; i++) max_len = seq_lens[i] > max_len ? seq_lens[i] : max_len;
    if (max_len > m->max_len) return -4;
    int rc = check_model(m);
    if (rc != 0) return rc;
    if (m->moe_slots > 0 && rows > FEW_ROWS) return -6; /* the MoE layers' synchronisation words */
    step_state s = step_state_at(m, scratch, hidden, out, rows, max_len, positions, slot_mapping, decode_rows,
                                 block_table, block_table_stride, seq_lens);
#ifdef SHM_STEP_PROFILE
    s.forked = now_ns();
#endif
#pragma omp parallel num_threads(step_threads(m))
    step_layers(m, &s, omp_get_thread_num(), omp_get_num_threads());
    return 0;
}

/* What a decode burst adds to the step: the embedding (GGML blocks of `embedding_type`, or fp32
 * rows where it is -1), the lm_head, and the burst's stop rule: it ends after a token in
 * stops[0, num_stops), or when input_waiting() (may be NULL) returns non-zero after a token;
 * the vocabulary's masked[0, num_masked) are not picked for the first `masked_tokens` tokens
 * (min_tokens). head_norms (shm_q8_0_row_norms of a lm_head that is one Q8_0 part without bias, or
 * NULL): the argmax through greedy_head.c's approximate pass and exact recheck. */
typedef struct {
    const uint8_t *embedding;
    int64_t embedding_type, embedding_row_bytes;
    shm_linear lm_head;
    const float *head_norms;
    const int64_t *stops, *masked;
    int64_t num_stops, num_masked, masked_tokens;
    int (*input_waiting)(void);
} shm_burst;

/* Floats of a burst's own buffer beside the step's scratch: each lm_head chunk's argmax index, value
 * and floor (a chunk a thread), the hidden row, the normed row and the logits. */
int64_t shm_decode_burst_floats(const shm_model *m, const shm_burst *b) {
    return 4 * (m->threads + 1) + 2 * m->hidden + b->lm_head.n;
}

static int in_list(int64_t value, const int64_t *list, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        if (list[i] == value) return 1;
    return 0;
}

/* This thread's lm_head chunks: logits rows, the masked ids among them set to -inf, their argmax
 * (with head_norms: greedy_head.c's pass, which holds a barrier, so every thread calls it). */
static void head_chunks(const shm_model *m, const shm_burst *b, float *logits, const float *x, int team,
                        int64_t *counter, int masking, float *best, int64_t *index, float *floors) {
    const shm_linear *lin = &b->lm_head;
    const int64_t step = chunk_rows(lin->n, team), chunks = (lin->n + step - 1) / step;
#ifdef HEAD_APPROX
    if (b->head_norms != NULL) {
        const shm_part *part = &lin->parts[0];
        greedy_head_team(part->w, part->row_bytes, lin->n, lin->k, b->head_norms, x, b->masked,
                         masking ? b->num_masked : 0, logits, step, chunks, counter, floors, best, index);
        return;
    }
#else
    (void)floors;
#endif
    for (int64_t c; (c = __atomic_fetch_add(counter, 1, __ATOMIC_RELAXED)) < chunks;) {
        const int64_t j0 = c * step, j1 = (c + 1) * step < lin->n ? (c + 1) * step : lin->n;
        linear_rows(m, lin, logits, x, NULL, 1, j0, j1);
        if (masking)
            for (int64_t i = 0; i < b->num_masked; i++)
                if (b->masked[i] >= j0 && b->masked[i] < j1) logits[b->masked[i]] = -INFINITY;
        argmax_range(logits, j0, j1, &best[c], &index[c]);
    }
}

/* Greedy decoding of one sequence, 1 to `count` tokens, in one parallel region: from `token` at
 * `position` (its KV not yet written), each token is embedded, run through the step, normed,
 * multiplied by the lm_head and its argmax taken (the masked ids excluded while masked_tokens
 * last), the next token's KV slot read from block_table (the sequence's blocks, which must hold
 * position + count slots). Ends after `count` tokens, or after a token that is a stop token or
 * after which input is waiting. Writes the tokens to tokens[0, n) and returns n >= 1 (0 for
 * count <= 0); negative: shm_decode_step's errors, or -2 for a `token` outside the vocabulary.
 * `work`: shm_decode_burst_floats floats. */
int64_t shm_decode_burst(const shm_model *m, const shm_burst *b, int64_t token, int64_t position,
                         const int32_t *block_table, int64_t count, int64_t *tokens, float *scratch, float *work) {
    const int64_t H = m->hidden, vocab = b->lm_head.n;
    if (count <= 0) return 0;
    if (position + count > m->max_len) return -4;
    int rc = check_model(m);
    if (rc == 0) rc = check_linear(&b->lm_head);
    if (rc != 0) return rc;
    if (b->lm_head.k != H) return -1;
    if (b->head_norms != NULL && (b->lm_head.num_parts != 1 || b->lm_head.parts[0].type != T_Q8_0 ||
                                  b->lm_head.parts[0].n != vocab || b->lm_head.bias != NULL))
        return -1;
    if (token < 0 || token >= vocab) return -2;
    int64_t *index = (int64_t *)work; /* 8-byte aligned first, then the floats */
    float *best = work + 2 * (m->threads + 1), *floors = best + m->threads + 1, *hidden = floors + m->threads + 1;
    float *normed = hidden + H, *logits = normed + H;
    int64_t pos[1] = {position}, slot[1] = {0}, row[1] = {0}, done = 0;
    int32_t seq_len[1] = {1};
    int go = 1;
    format_fns embed;
    if (b->embedding_type >= 0 && (lookup((int)b->embedding_type, &embed) != 0 || embed.deq_row == NULL)) return -1;
    /* laid out for the burst's longest context: the threads' own buffers stay where they are */
    step_state s = step_state_at(m, scratch, hidden, normed, 1, position + count, pos, slot, row, block_table, 0,
                                 seq_len);
#pragma omp parallel num_threads(step_threads(m))
    {
        const int tid = omp_get_thread_num(), team = omp_get_num_threads();
#ifdef SHM_STEP_PROFILE
        last_ = now_ns();
#endif
        for (;;) {
            if (tid == 0) {
                go = done == 0 || (done < count && !in_list(token, b->stops, b->num_stops) &&
                                   (b->input_waiting == NULL || !b->input_waiting()));
                if (go) {
                    const int64_t p = position + done;
                    if (b->embedding_type >= 0)
                        embed.deq_row(b->embedding + token * b->embedding_row_bytes, hidden, H);
                    else
                        memcpy(hidden, b->embedding + token * b->embedding_row_bytes, (size_t)H * sizeof(float));
                    pos[0] = p;
                    slot[0] = (int64_t)block_table[p / m->block_size] * m->block_size + p % m->block_size;
                    seq_len[0] = (int32_t)(p + 1);
                    s.max_len = p + 1;
                    memset(s.counters, 0, (size_t)counter_floats(m) * sizeof(float));
                }
            }
#pragma omp barrier
            if (!go) break;
            step_layers(m, &s, tid, team);
#pragma omp barrier
            STAMP(ST_FINAL_WAIT);
            head_chunks(m, b, logits, normed, team, &s.counters[PHASES_PER_LAYER * m->num_layers], done < b->masked_tokens,
                        best, index, floors);
            STAMP(ST_HEAD);
#pragma omp barrier
            STAMP(ST_HEAD_WAIT);
            if (tid == 0) {
                const int64_t chunks = (vocab + chunk_rows(vocab, team) - 1) / chunk_rows(vocab, team);
                tokens[done++] = token = index[chunks_argmax(best, chunks)];
            }
            STAMP(ST_PICK);
        }
    }
    return done;
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
