/* Paged decode attention for bfloat16 KV caches on the CPU (see kernels/cpu_decode_attention.py).
 *
 * One task per (decoding sequence, kv head): the task reads that kv head's keys and values
 * straight from the cache blocks its block table names, up to its context length, and serves the
 * query heads of its group together (grouped-query attention repeats nothing): each key row is
 * converted once and scored against every query head, then each query head weighs the values in
 * turn, its accumulator kept in registers across the context (one pass over the values for all
 * heads, accumulators stored and reloaded per row, measured 1.4x slower at 32 x 512 tokens).
 * Scores, softmax and the weighted sum of values are float32; only the output is rounded to
 * bfloat16. Nothing is gathered, padded or masked: a task never reads a slot past its context.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_HEAD_DIM 256
#define MAX_GROUP 16

static inline float bf16_to_float(uint16_t value) {
    uint32_t bits = (uint32_t)value << 16;
    float result;
    memcpy(&result, &bits, sizeof result);
    return result;
}

static inline uint16_t float_to_bf16(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u); /* NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u); /* round to nearest, ties to even, as torch does */
    return (uint16_t)(bits >> 16);
}

/* Everything one call needs; kernels/cpu_decode_attention.py mirrors it field by field. */
typedef struct {
    const uint16_t *query; /* [num_rows, heads, head_dim], last dimension dense */
    int64_t query_row_stride, query_head_stride, num_rows;
    const uint16_t *key_cache, *value_cache; /* [num_blocks, block_size, kv_heads, head_dim] */
    int64_t num_blocks, block_size;
    const int32_t *block_tables; /* [num_seqs, table_width] */
    int64_t block_table_stride, table_width;
    const int32_t *context_lens; /* [num_seqs] */
    int64_t num_seqs;
    const int32_t *seq_ids;    /* [num_decode]: the batch's sequences that decode */
    const int32_t *query_rows; /* [num_decode]: each one's query (and output) row */
    int64_t num_decode, max_context_len;
    uint16_t *out; /* like the query */
    int64_t out_row_stride, out_head_stride;
    int64_t num_heads, num_kv_heads, head_dim;
    float scale;
    /* Optional (NULL key_new: the cache already holds the new tokens and the query is rotated):
     * the new tokens' unrotated K and V, [num_rows, kv_heads, head_dim] (last dimension dense),
     * their rotary cos and sin, [num_rows, head_dim] dense, and their cache slots, [num_rows] (a
     * negative slot is not written). Each task then rotates its query heads and its kv head's new
     * key, writes that key and value into the cache, and attends, all in one pass. */
    const uint16_t *key_new, *value_new;
    int64_t key_new_row_stride, key_new_head_stride, value_new_row_stride, value_new_head_stride;
    const uint16_t *cos, *sin;
    const int64_t *slot_mapping;
} Problem;

enum { OK = 0, BAD_SHAPE = -1, OUT_OF_MEMORY = -2, BAD_INDEX = -3 };

/* x rotated by rotary embedding in the rotate-half layout: x * cos + (-x2, x1) * sin. */
static inline void rotate(const uint16_t *x, const uint16_t *cos, const uint16_t *sin, int64_t dim,
                          float *out) {
    const int64_t half = dim / 2;
    for (int64_t d = 0; d < dim; d++) {
        const float partner = d < half ? -bf16_to_float(x[d + half]) : bf16_to_float(x[d - half]);
        out[d] = bf16_to_float(x[d]) * bf16_to_float(cos[d]) + partner * bf16_to_float(sin[d]);
    }
}

/* The new token's K (rotated) and V for one kv head, into its cache slot. */
static inline int write_new_kv(const Problem *p, int64_t row, int64_t kv_head, int64_t dim) {
    const int64_t slot = p->slot_mapping[row];
    if (slot < 0) return OK;
    if (slot >= p->num_blocks * p->block_size) return BAD_INDEX;
    const int64_t offset = (slot * p->num_kv_heads + kv_head) * dim;
    float rotated[MAX_HEAD_DIM];
    rotate(p->key_new + row * p->key_new_row_stride + kv_head * p->key_new_head_stride,
           p->cos + row * dim, p->sin + row * dim, dim, rotated);
    uint16_t *key = (uint16_t *)p->key_cache + offset;
    for (int64_t d = 0; d < dim; d++) key[d] = float_to_bf16(rotated[d]);
    memcpy((uint16_t *)p->value_cache + offset,
           p->value_new + row * p->value_new_row_stride + kv_head * p->value_new_head_stride,
           sizeof(uint16_t) * dim);
    return OK;
}

/* Inlined into a copy per common head_dim (below), so that the loops over `dim` have a constant
 * trip count: unrolled, vectorized without remainder handling, the accumulators in registers. */
static inline __attribute__((always_inline)) int attend_dim(const Problem *p, int64_t task,
                                                            float *scores, const int64_t dim) {
    const int64_t group = p->num_heads / p->num_kv_heads;
    const int64_t i = task / p->num_kv_heads, kv_head = task % p->num_kv_heads;
    const int64_t seq = p->seq_ids[i], row = p->query_rows[i];
    if (seq < 0 || seq >= p->num_seqs || row < 0 || row >= p->num_rows) return BAD_INDEX;
    const int64_t context = p->context_lens[seq];
    /* The scores buffer holds max_context_len per query head; the table names its blocks. */
    if (context < 1 || context > p->max_context_len || context > p->table_width * p->block_size)
        return BAD_INDEX;
    const int32_t *table = p->block_tables + seq * p->block_table_stride;
    for (int64_t b = 0; b * p->block_size < context; b++)
        if (table[b] < 0 || table[b] >= p->num_blocks) return BAD_INDEX;
    const int64_t slot_stride = p->num_kv_heads * dim, block_stride = p->block_size * slot_stride;
    float q[MAX_GROUP][MAX_HEAD_DIM], row_f[MAX_HEAD_DIM], max_score[MAX_GROUP];

    if (p->key_new != NULL && write_new_kv(p, row, kv_head, dim) != OK) return BAD_INDEX;
    for (int64_t g = 0; g < group; g++) {
        const uint16_t *src = p->query + row * p->query_row_stride +
                              (kv_head * group + g) * p->query_head_stride;
        if (p->key_new != NULL) {
            rotate(src, p->cos + row * dim, p->sin + row * dim, dim, q[g]);
            for (int64_t d = 0; d < dim; d++) q[g][d] *= p->scale;
        } else {
            for (int64_t d = 0; d < dim; d++) q[g][d] = bf16_to_float(src[d]) * p->scale;
        }
        max_score[g] = -FLT_MAX; /* built with -ffast-math: no infinities */
    }
    for (int64_t start = 0; start < context; start += p->block_size) {
        const uint16_t *key =
            p->key_cache + table[start / p->block_size] * block_stride + kv_head * dim;
        const int64_t end = start + p->block_size < context ? start + p->block_size : context;
        for (int64_t t = start; t < end; t++, key += slot_stride) {
            for (int64_t d = 0; d < dim; d++) row_f[d] = bf16_to_float(key[d]);
            for (int64_t g = 0; g < group; g++) {
                float dot = 0.0f;
                for (int64_t d = 0; d < dim; d++) dot += q[g][d] * row_f[d];
                scores[g * context + t] = dot;
                if (dot > max_score[g]) max_score[g] = dot;
            }
        }
    }
    for (int64_t g = 0; g < group; g++) {
        float *s = scores + g * context, total = 0.0f, top = max_score[g];
        for (int64_t t = 0; t < context; t++) {
            s[t] = expf(s[t] - top);
            total += s[t];
        }
        /* One query head at a time: its accumulator stays in registers across the context
         * (a kv head's values are read once per query head of its group, from cache after the
         * first). */
        float acc[MAX_HEAD_DIM] = {0};
        for (int64_t start = 0; start < context; start += p->block_size) {
            const uint16_t *value =
                p->value_cache + table[start / p->block_size] * block_stride + kv_head * dim;
            const int64_t end = start + p->block_size < context ? start + p->block_size : context;
            for (int64_t t = start; t < end; t++, value += slot_stride) {
                const float weight = s[t];
                for (int64_t d = 0; d < dim; d++) acc[d] += weight * bf16_to_float(value[d]);
            }
        }
        uint16_t *dst = p->out + row * p->out_row_stride + (kv_head * group + g) * p->out_head_stride;
        const float inverse = 1.0f / total;
        for (int64_t d = 0; d < dim; d++) dst[d] = float_to_bf16(acc[d] * inverse);
    }
    return OK;
}

static int attend(const Problem *p, int64_t task, float *scores) {
    switch (p->head_dim) {
    case 64: return attend_dim(p, task, scores, 64);
    case 128: return attend_dim(p, task, scores, 128);
    default: return attend_dim(p, task, scores, p->head_dim);
    }
}

/* Writes the attention of every decode row into `out`. Returns OK, BAD_SHAPE (past the fixed
 * per-task buffers), OUT_OF_MEMORY, or BAD_INDEX (a sequence, row, context length or block id out
 * of range: such a task reads and writes nothing). */
int tandem_paged_decode_bf16(const Problem *problem, int num_threads) {
    if (problem->head_dim > MAX_HEAD_DIM || problem->num_heads / problem->num_kv_heads > MAX_GROUP)
        return BAD_SHAPE;
    const int64_t tasks = problem->num_decode * problem->num_kv_heads;
    const int64_t scratch = (problem->num_heads / problem->num_kv_heads) * problem->max_context_len;
    int status = OK;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1 && tasks > 1)
    {
        float *scores = malloc(sizeof(float) * (size_t)(scratch > 0 ? scratch : 1));
        if (scores == NULL) {
#pragma omp atomic write
            status = OUT_OF_MEMORY;
        }
#pragma omp for schedule(dynamic)
        for (int64_t task = 0; task < tasks; task++) {
            const int result = scores != NULL ? attend(problem, task, scores) : OUT_OF_MEMORY;
            if (result != OK) {
#pragma omp atomic write
                status = result;
            }
        }
        free(scores);
    }
    return status;
}
