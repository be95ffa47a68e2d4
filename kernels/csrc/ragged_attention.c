/* Ragged causal attention over a paged KV cache, for CPUs: one call per layer per iteration.
 *
 * The same contract as kernels/attention.py (its docstring): the query tokens of every request of
 * the iteration are concatenated, `query_start_loc` cuts them into requests, request i's tokens sit at
 * positions seq_lens[i] - q_len_i .. seq_lens[i] - 1 and attend to every cached position up to their
 * own, reading K/V through the request's block table. Prompts, prompt chunks and decodes share a call.
 *
 * Work is split into items of (request, up to TILE_ROWS query tokens), spread over OpenMP threads.
 * An item holds the query rows of every head, so each cache slot (all KV heads' rows, contiguous) is
 * read from memory once and whole, block by block: decode attention is memory-bound, and reading
 * whole slots in order lets the prefetcher stream them. Softmax is exact (two passes over a row of scores kept in a
 * per-thread buffer), in the accumulation type of the kernel (float for f32, double for f64).
 *
 * Built on first use by kernels/cpu_build.py and called through ctypes from kernels/attention_cpu.py;
 * it links the OpenMP runtime torch itself loaded, so both share one thread pool.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define TILE_ROWS 8

/* exp(x) for x <= 0 in float, vectorisable (no libm call in the loop): Cephes' range reduction and
 * polynomial, within 2 ulp of expf; below -87 it returns ~1e-38 instead of a denormal. */
static inline float exp_f32(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float n = floorf(x * 1.44269504088896341f + 0.5f);
    const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;  /* 2^n */
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

static inline double exp_f64(double x) { return exp(x); }

static int64_t find_request(const int64_t *tile_start, int64_t num_seqs, int64_t tile) {
    int64_t lo = 0, hi = num_seqs;  /* the last request whose first tile is <= tile */
    while (hi - lo > 1) {
        int64_t mid = (lo + hi) / 2;
        if (tile_start[mid] <= tile) lo = mid; else hi = mid;
    }
    return lo;
}

/* Reads one request's cache slots (a slot: every KV head's row, contiguous) in position order, block by
 * block through its block table. While it reads a block it prefetches the same slot of the next one,
 * which lies elsewhere in memory, where the hardware prefetcher would not look. Both passes over K and
 * V read through it; it is inlined, so a slot costs a branch or two on top of the rows it holds. */
typedef struct {
    const char *cache;        /* the K or V cache */
    const int32_t *table;     /* the block table entry of the next block to read */
    int64_t block_size, slot_bytes;
    int64_t remaining;        /* slots still to read */
    int64_t left;             /* slots still to read in the block being read */
    const char *slot, *next;  /* the slot read next, and the same slot of the next block (NULL: not needed) */
} SlotReader;

static inline SlotReader slot_reader(const void *cache, const int32_t *table, int64_t block_size,
                                     int64_t slot_bytes, int64_t num_slots) {
    const SlotReader reader = {(const char *)cache, table, block_size, slot_bytes, num_slots, 0, NULL, NULL};
    return reader;
}

static inline const void *read_slot(SlotReader *r) {
    if (r->left == 0) {  /* a new block: find it, and the next one if this one does not end the read */
        const int64_t block_bytes = r->block_size * r->slot_bytes;
        r->slot = r->cache + (int64_t)r->table[0] * block_bytes;
        r->next = r->remaining > r->block_size ? r->cache + (int64_t)r->table[1] * block_bytes : NULL;
        r->table++;
        r->left = r->block_size;
    }
    if (r->next != NULL) {
        for (int64_t b = 0; b < r->slot_bytes; b += 64) __builtin_prefetch(r->next + b);
        r->next += r->slot_bytes;
    }
    const char *slot = r->slot;
    r->slot += r->slot_bytes;
    r->left--;
    r->remaining--;
    return slot;
}

#define DEFINE_RAGGED_ATTENTION(NAME, T, ACC, EXP)                                                          \
int NAME(                                                                                                   \
    T *out,                        /* (num_tokens, num_heads, head_dim) contiguous */                     \
    const T *query,                /* (num_tokens, num_heads, head_dim), strides below, unit dim stride */\
    const T *k_cache,              /* (num_blocks * block_size, num_kv_heads, head_dim) contiguous */     \
    const T *v_cache,              /* same layout as k_cache */                                           \
    const int32_t *block_tables,   /* (num_seqs, max_blocks) */                                           \
    const int32_t *seq_lens,       /* (num_seqs,) context length, this iteration's tokens included */     \
    const int32_t *query_start_loc,/* (num_seqs + 1,) */                                                  \
    int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,      \
    int64_t max_blocks, int64_t stride_qt, int64_t stride_qh, int64_t max_seq_len, double scale)          \
{                                                                                                           \
    const int64_t group = num_heads / num_kv_heads;                                                         \
    const int64_t slot_stride = num_kv_heads * head_dim;                                                    \
    const int64_t slot_bytes = slot_stride * (int64_t)sizeof(T);                                            \
    int64_t *tile_start = malloc((size_t)(num_seqs + 1) * sizeof(int64_t));                                 \
    if (tile_start == NULL) return 1;                                                                       \
    tile_start[0] = 0;                                                                                      \
    for (int64_t s = 0; s < num_seqs; s++) {                                                                \
        int64_t q_len = query_start_loc[s + 1] - query_start_loc[s];                                        \
        tile_start[s + 1] = tile_start[s] + (q_len + TILE_ROWS - 1) / TILE_ROWS;                            \
    }                                                                                                       \
    const int64_t num_items = tile_start[num_seqs];                                                         \
    const int64_t max_rows = TILE_ROWS * num_heads;                                                         \
    int failed = 0;                                                                                         \
    _Pragma("omp parallel")                                                                                 \
    {                                                                                                       \
        ACC *scores = malloc((size_t)(max_rows * max_seq_len) * sizeof(ACC));  /* (rows, ctx) */          \
        ACC *acc = malloc((size_t)(max_rows * head_dim) * sizeof(ACC));        /* (rows, head_dim) */     \
        ACC *q = malloc((size_t)(max_rows * head_dim) * sizeof(ACC));          /* (rows, head_dim) */     \
        if (scores == NULL || acc == NULL || q == NULL) {                                                   \
            _Pragma("omp atomic write")                                                                     \
            failed = 1;                                                                                     \
        }                                                                                                   \
        _Pragma("omp for schedule(dynamic, 1)")                                                             \
        for (int64_t tile = 0; tile < num_items; tile++) {                                                  \
            if (scores == NULL || acc == NULL || q == NULL) continue;                                       \
            const int64_t s = find_request(tile_start, num_seqs, tile);                                     \
            const int64_t q_start = query_start_loc[s];                                                     \
            const int64_t q_len = query_start_loc[s + 1] - q_start;                                         \
            const int64_t context = seq_lens[s] - q_len;  /* tokens cached before this iteration */        \
            const int64_t row0 = (tile - tile_start[s]) * TILE_ROWS;                                        \
            const int64_t num_tokens = q_len - row0 < TILE_ROWS ? q_len - row0 : TILE_ROWS;                 \
            const int64_t rows = num_tokens * num_heads;  /* row r: token r / num_heads, head r % num_heads */ \
            const int64_t kv_end = context + row0 + num_tokens;  /* causal bound of the last token */      \
            const int32_t *table = block_tables + s * max_blocks;                                           \
            for (int64_t r = 0; r < rows; r++) {                                                            \
                const T *src = query + (q_start + row0 + r / num_heads) * stride_qt + (r % num_heads) * stride_qh; \
                for (int64_t d = 0; d < head_dim; d++) q[r * head_dim + d] = (ACC)src[d] * (ACC)scale;      \
            }                                                                                               \
            SlotReader keys = slot_reader(k_cache, table, block_size, slot_bytes, kv_end);                  \
            for (int64_t n = 0; n < kv_end; n++) {  /* pass 1: scores, slot by slot */                      \
                const T *k = read_slot(&keys);                                                              \
                for (int64_t r = 0; r < rows; r++) {                                                        \
                    const ACC *qr = q + r * head_dim;                                                       \
                    const T *kh = k + ((r % num_heads) / group) * head_dim;                                 \
                    ACC dot = 0;                                                                            \
                    _Pragma("omp simd reduction(+:dot)")                                                    \
                    for (int64_t d = 0; d < head_dim; d++) dot += qr[d] * (ACC)kh[d];                       \
                    scores[r * max_seq_len + n] = dot;                                                      \
                }                                                                                           \
            }                                                                                               \
            for (int64_t r = 0; r < rows; r++) {  /* softmax over each row's causal prefix */               \
                ACC *row = scores + r * max_seq_len;                                                        \
                const int64_t end = context + row0 + r / num_heads + 1;                                     \
                ACC m = row[0];                                                                             \
                for (int64_t n = 1; n < end; n++) m = row[n] > m ? row[n] : m;                              \
                ACC sum = 0;                                                                                \
                _Pragma("omp simd reduction(+:sum)")                                                        \
                for (int64_t n = 0; n < end; n++) { row[n] = EXP(row[n] - m); sum += row[n]; }              \
                const ACC inv = (ACC)1 / sum;                                                               \
                _Pragma("omp simd")                                                                         \
                for (int64_t n = 0; n < end; n++) row[n] *= inv;                                            \
                for (int64_t n = end; n < kv_end; n++) row[n] = 0;                                          \
            }                                                                                               \
            memset(acc, 0, (size_t)(rows * head_dim) * sizeof(ACC));                                        \
            SlotReader values = slot_reader(v_cache, table, block_size, slot_bytes, kv_end);                \
            for (int64_t n = 0; n < kv_end; n++) {  /* pass 2: weighted sum of V rows, slot by slot */      \
                const T *v = read_slot(&values);                                                            \
                for (int64_t r = 0; r < rows; r++) {                                                        \
                    const ACC p = scores[r * max_seq_len + n];                                              \
                    const T *vh = v + ((r % num_heads) / group) * head_dim;                                 \
                    ACC *ar = acc + r * head_dim;                                                           \
                    _Pragma("omp simd")                                                                     \
                    for (int64_t d = 0; d < head_dim; d++) ar[d] += p * (ACC)vh[d];                         \
                }                                                                                           \
            }                                                                                               \
            for (int64_t r = 0; r < rows; r++) {  /* rows are (token, head) in out's own order */          \
                T *dst = out + (q_start + row0) * num_heads * head_dim + r * head_dim;                      \
                for (int64_t d = 0; d < head_dim; d++) dst[d] = (T)acc[r * head_dim + d];                   \
            }                                                                                               \
        }                                                                                                   \
        free(scores); free(acc); free(q);                                                                   \
    }                                                                                                       \
    free(tile_start);                                                                                       \
    return failed;                                                                                          \
}

DEFINE_RAGGED_ATTENTION(ragged_attention_f32, float, float, exp_f32)
DEFINE_RAGGED_ATTENTION(ragged_attention_f64, double, double, exp_f64)
