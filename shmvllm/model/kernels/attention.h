/* The decode attention's task list, shared by cpu_kernels.c (which runs the tasks) and the
 * native decode step (decode_step.c, whose thread team hands them out). Include after act_t. */
#include <stdint.h>

/* Positions per task: long enough that a task's setup is noise, short enough that a 4k context
 * makes 8 tasks per kv head to spread over the threads. */
#define ATTN_CHUNK 512

typedef struct {
    act_t *out;
    int64_t out_row_stride;
    const act_t *q;
    int64_t q_row_stride;
    const int64_t *decode_rows;
    int64_t num_decodes;
    const act_t *k_cache, *v_cache;
    int64_t num_slots;
    const int32_t *block_table;
    int64_t block_table_stride;
    const int32_t *seq_lens;
    int64_t block_size, num_heads, kv_heads, head_dim;
    float scale;
    int64_t max_chunks; /* runs of the longest context */
    int64_t head_splits; /* slices each kv head's query heads are cut into (attention_head_splits) */
    int64_t window;     /* > 0: a sliding-window layer attends to the last `window` positions only */
    float softcap;      /* > 0: scores become softcap * tanh(score / softcap) (Gemma 2) */
    const float *sinks; /* non-NULL: each query head's sink logit joins its softmax's denominator (gpt-oss) */
} shm_attention_args;

static inline int64_t attention_chunks(int64_t seq_len) { return (seq_len + ATTN_CHUNK - 1) / ATTN_CHUNK; }

/* Tasks are (request, slice of the query heads, kv head, run of positions), the runs fastest.
 * Fewer (request, kv head, run) tasks than two a thread (a short context's 3 kv heads on 2 threads:
 * one thread would take two) are cut by query head into `threads` slices (at most one head each),
 * so that the threads share the work evenly; slices outermost, so that the tasks the threads start
 * together read different kv heads. Each head's arithmetic is the same whichever slice computes
 * it: any split gives the same values. */
static inline int64_t attention_head_splits(int64_t pair_runs, int64_t group, int64_t threads) {
    return pair_runs >= 2 * threads ? 1 : (threads < group ? threads : group);
}
static inline int64_t attention_tasks(const shm_attention_args *a) {
    return a->num_decodes * a->head_splits * a->kv_heads * a->max_chunks;
}

/* The first position a query at the end of a seq_len context attends to. */
static inline int64_t attention_first(int64_t seq_len, int64_t window) {
    return window > 0 && seq_len > window ? seq_len - window : 0;
}

/* Floats of one thread's work buffer; of the partial results of all tasks of a step. */
static inline int64_t attention_work_floats(int64_t group, int64_t head_dim) { return group * (ATTN_CHUNK + head_dim); }
static inline int64_t attention_partial_floats(int64_t num_decodes, int64_t kv_heads, int64_t max_chunks,
                                               int64_t group, int64_t head_dim) {
    return num_decodes * kv_heads * max_chunks * group * (head_dim + 2);
}

typedef void (*attention_task_fn)(const shm_attention_args *, int64_t, float *, float *);
typedef void (*attention_combine_fn)(const shm_attention_args *, int64_t, const float *);
