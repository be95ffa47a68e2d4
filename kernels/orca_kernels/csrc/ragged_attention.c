/* Ragged causal attention over a paged KV cache, for CPUs: one call per layer per iteration.
 *
 * The same contract as kernels/attention.py (its docstring): the query tokens of every request of
 * the iteration are concatenated, `query_start_loc` cuts them into requests, request i's tokens sit at
 * positions seq_lens[i] - q_len_i .. seq_lens[i] - 1 and attend to every cached position up to their
 * own, reading K/V through the request's block table. Prompts, prompt chunks and decodes share a call.
 *
 * Work is split into items of (request, up to TILE_ROWS query tokens), spread over OpenMP threads.
 * An item holds the query rows of every head, so each cache slot (all KV heads' rows, contiguous) is
 * read from memory once and whole, block by block. Softmax is exact (two passes over a row of scores
 * kept in a per-thread buffer), in the accumulation type of the kernel (float for f32, double for f64).
 *
 * Decode attention waits on memory: blocks lie anywhere, and one pass reads a request's K, the next
 * its V. So reads are issued ahead of use: the same slot of the next block as a block is read, each V
 * slot (to L2) as its K slot is read, and the next item's K slots (to L2) while this item reads V.
 * With that, and head_dim a constant for 64 and 128, a decode batch of 128 requests (contexts
 * 16-512, 4 heads of 64, 2 KV heads, 4 layers' caches, one thread) takes 3.2 ms a layer against 5.1-5.5
 * before (benchmarks/attention_cpu.py).
 *
 * Built on first use by kernels/cpu_build.py and called through ctypes from kernels/attention_cpu.py;
 * it links the OpenMP runtime torch itself loaded, so both share one thread pool.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "exp_f32.h"

#define TILE_ROWS 8

static inline double exp_f64(double x) { return exp(x); }

typedef float f32x8 __attribute__((vector_size(32), aligned(4), may_alias));  /* GCC/clang vectors, unaligned loads */

/* q . k over head_dim, with four independent sums: one sum would chain every multiply-add behind
 * the last (about 4 cycles each), and the loop would wait on that chain, not on the data. */
static inline __attribute__((always_inline)) float dot_f32(const float *a, const float *b, int64_t n) {
    if (n % 32 != 0) {
        float dot = 0;
        _Pragma("omp simd reduction(+:dot)")
        for (int64_t d = 0; d < n; d++) dot += a[d] * b[d];
        return dot;
    }
    f32x8 s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0};
    for (int64_t d = 0; d < n; d += 32) {
        s0 += *(const f32x8 *)(a + d) * *(const f32x8 *)(b + d);
        s1 += *(const f32x8 *)(a + d + 8) * *(const f32x8 *)(b + d + 8);
        s2 += *(const f32x8 *)(a + d + 16) * *(const f32x8 *)(b + d + 16);
        s3 += *(const f32x8 *)(a + d + 24) * *(const f32x8 *)(b + d + 24);
    }
    const f32x8 s = (s0 + s1) + (s2 + s3);
    return ((s[0] + s[4]) + (s[1] + s[5])) + ((s[2] + s[6]) + (s[3] + s[7]));
}

static inline __attribute__((always_inline)) double dot_f64(const double *a, const double *b, int64_t n) {
    double dot = 0;
    _Pragma("omp simd reduction(+:dot)")
    for (int64_t d = 0; d < n; d++) dot += a[d] * b[d];
    return dot;
}

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
    int look_ahead;           /* prefetch the next block's slots as it goes */
} SlotReader;

static inline void prefetch_slot(const char *slot, int64_t slot_bytes) {
    for (int64_t b = 0; b < slot_bytes; b += 64) __builtin_prefetch(slot + b);
}

/* Into L2 only: a row's V slots (read by pass 2) and the next item's K slots, fetched a pass ahead. */
static inline void prefetch_slot_l2(const void *slot, int64_t slot_bytes) {
    for (int64_t b = 0; b < slot_bytes; b += 64) __builtin_prefetch((const char *)slot + b, 0, 2);
}

static inline SlotReader slot_reader(const void *cache, const int32_t *table, int64_t block_size,
                                     int64_t slot_bytes, int64_t num_slots) {
    const SlotReader reader = {(const char *)cache, table, block_size, slot_bytes, num_slots, 0, NULL, NULL, 1};
    return reader;
}

static inline const void *read_slot(SlotReader *r) {
    if (r->left == 0) {  /* a new block: find it, and the next one if this one does not end the read */
        const int64_t block_bytes = r->block_size * r->slot_bytes;
        r->slot = r->cache + (int64_t)r->table[0] * block_bytes;
        r->next = r->look_ahead && r->remaining > r->block_size ? r->cache + (int64_t)r->table[1] * block_bytes : NULL;
        r->table++;
        r->left = r->block_size;
    }
    if (r->next != NULL) {
        prefetch_slot(r->next, r->slot_bytes);
        r->next += r->slot_bytes;
    }
    const char *slot = r->slot;
    r->slot += r->slot_bytes;
    r->left--;
    r->remaining--;
    return slot;
}

/* One work item: up to TILE_ROWS query tokens of one request, every head. Inlined with head_dim a
 * constant for the common sizes (64, 128), where the compiler unrolls the head_dim loops whole. */
#define DEFINE_ATTEND_TILE(NAME, T, ACC, EXP, DOT)                                                              \
static inline __attribute__((always_inline)) void NAME(                                                   \
    T *out, const T *query, const T *k_cache, const T *v_cache, const int32_t *table,                       \
    int64_t q_start, int64_t context, int64_t row0, int64_t num_tokens, int64_t num_heads, int64_t group,   \
    const int64_t head_dim, int64_t block_size, int64_t slot_bytes, int64_t stride_qt, int64_t stride_qh,  \
    int64_t max_seq_len, ACC scale, ACC *scores, ACC *acc, ACC *q, int64_t *kv_off,                         \
    const int32_t *next_table, int64_t next_kv_end)                                                         \
{                                                                                                           \
    const int64_t rows = num_tokens * num_heads;  /* row r: token r / num_heads, head r % num_heads */     \
    const int64_t kv_end = context + row0 + num_tokens;  /* causal bound of the last token */              \
    for (int64_t r = 0; r < rows; r++) {                                                                    \
        const T *src = query + (q_start + row0 + r / num_heads) * stride_qt + (r % num_heads) * stride_qh;  \
        for (int64_t d = 0; d < head_dim; d++) q[r * head_dim + d] = (ACC)src[d] * scale;                   \
        kv_off[r] = ((r % num_heads) / group) * head_dim;                                                   \
    }                                                                                                       \
    SlotReader keys = slot_reader(k_cache, table, block_size, slot_bytes, kv_end);                          \
    for (int64_t n = 0; n < kv_end; n++) {  /* pass 1: scores, slot by slot */                              \
        const T *k = read_slot(&keys);                                                                      \
        prefetch_slot_l2((const char *)v_cache + ((const char *)k - (const char *)k_cache), slot_bytes);    \
        for (int64_t r = 0; r < rows; r++) {                                                                \
            const ACC *qr = q + r * head_dim;                                                               \
            const T *kh = k + kv_off[r];                                                                    \
            scores[r * max_seq_len + n] = DOT(qr, kh, head_dim);                                            \
        }                                                                                                   \
    }                                                                                                       \
    for (int64_t r = 0; r < rows; r++) {  /* softmax over each row's causal prefix */                       \
        ACC *row = scores + r * max_seq_len;                                                                \
        const int64_t end = context + row0 + r / num_heads + 1;                                             \
        ACC m = row[0];                                                                                     \
        _Pragma("omp simd reduction(max:m)")                                                                \
        for (int64_t n = 1; n < end; n++) m = row[n] > m ? row[n] : m;                                      \
        ACC sum = 0;                                                                                        \
        _Pragma("omp simd reduction(+:sum)")                                                                \
        for (int64_t n = 0; n < end; n++) { row[n] = EXP(row[n] - m); sum += row[n]; }                      \
        const ACC inv = (ACC)1 / sum;                                                                       \
        _Pragma("omp simd")                                                                                 \
        for (int64_t n = 0; n < end; n++) row[n] *= inv;                                                    \
        for (int64_t n = end; n < kv_end; n++) row[n] = 0;                                                  \
    }                                                                                                       \
    memset(acc, 0, (size_t)(rows * head_dim) * sizeof(ACC));                                                \
    SlotReader values = slot_reader(v_cache, table, block_size, slot_bytes, kv_end);                        \
    SlotReader next_keys = slot_reader(k_cache, next_table, block_size, slot_bytes, next_kv_end);           \
    next_keys.look_ahead = 0;                                                                               \
    for (int64_t n = 0; n < kv_end; n++) {  /* pass 2: weighted sum of V rows, slot by slot */              \
        const T *v = read_slot(&values);                                                                    \
        if (n < next_kv_end) prefetch_slot_l2(read_slot(&next_keys), slot_bytes);                            \
        for (int64_t r = 0; r < rows; r++) {                                                                \
            const ACC p = scores[r * max_seq_len + n];                                                      \
            const T *vh = v + kv_off[r];                                                                    \
            ACC *ar = acc + r * head_dim;                                                                   \
            _Pragma("omp simd")                                                                             \
            for (int64_t d = 0; d < head_dim; d++) ar[d] += p * (ACC)vh[d];                                 \
        }                                                                                                   \
    }                                                                                                       \
    for (int64_t r = 0; r < rows; r++) {  /* rows are (token, head) in out's own order */                  \
        T *dst = out + (q_start + row0) * num_heads * head_dim + r * head_dim;                              \
        for (int64_t d = 0; d < head_dim; d++) dst[d] = (T)acc[r * head_dim + d];                           \
    }                                                                                                       \
}

#define DEFINE_RAGGED_ATTENTION(NAME, TILE, T, ACC)                                                         \
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
    const int64_t slot_bytes = num_kv_heads * head_dim * (int64_t)sizeof(T);                                \
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
        int64_t *kv_off = malloc((size_t)max_rows * sizeof(int64_t));          /* row -> its KV head */   \
        const int ok = scores != NULL && acc != NULL && q != NULL && kv_off != NULL;                        \
        if (!ok) {                                                                                          \
            _Pragma("omp atomic write")                                                                     \
            failed = 1;                                                                                     \
        }                                                                                                   \
        _Pragma("omp for schedule(dynamic, 1)")                                                             \
        for (int64_t tile = 0; tile < num_items; tile++) {                                                  \
            if (!ok) continue;                                                                              \
            const int64_t s = find_request(tile_start, num_seqs, tile);                                     \
            const int64_t q_start = query_start_loc[s];                                                     \
            const int64_t q_len = query_start_loc[s + 1] - q_start;                                         \
            const int64_t context = seq_lens[s] - q_len;  /* tokens cached before this iteration */        \
            const int64_t row0 = (tile - tile_start[s]) * TILE_ROWS;                                        \
            const int64_t num_tokens = q_len - row0 < TILE_ROWS ? q_len - row0 : TILE_ROWS;                 \
            const int32_t *table = block_tables + s * max_blocks;                                           \
            /* the next item's first tokens' keys, read ahead while this one reads its values */            \
            int64_t next_kv_end = 0;                                                                        \
            const int32_t *next_table = table;                                                              \
            if (tile + 1 < num_items) {                                                                     \
                const int64_t ns = find_request(tile_start, num_seqs, tile + 1);                            \
                const int64_t next_q_len = query_start_loc[ns + 1] - query_start_loc[ns];                   \
                const int64_t next_row0 = (tile + 1 - tile_start[ns]) * TILE_ROWS;                          \
                const int64_t next_tokens = next_q_len - next_row0 < TILE_ROWS ? next_q_len - next_row0 : TILE_ROWS; \
                next_kv_end = seq_lens[ns] - next_q_len + next_row0 + next_tokens;                          \
                next_table = block_tables + ns * max_blocks;                                                \
            }                                                                                               \
            if (head_dim == 64)                                                                             \
                TILE(out, query, k_cache, v_cache, table, q_start, context, row0, num_tokens, num_heads,     \
                     group, 64, block_size, slot_bytes, stride_qt, stride_qh, max_seq_len, (ACC)scale,      \
                     scores, acc, q, kv_off, next_table, next_kv_end);                                      \
            else if (head_dim == 128)                                                                       \
                TILE(out, query, k_cache, v_cache, table, q_start, context, row0, num_tokens, num_heads,     \
                     group, 128, block_size, slot_bytes, stride_qt, stride_qh, max_seq_len, (ACC)scale,     \
                     scores, acc, q, kv_off, next_table, next_kv_end);                                      \
            else                                                                                            \
                TILE(out, query, k_cache, v_cache, table, q_start, context, row0, num_tokens, num_heads,     \
                     group, head_dim, block_size, slot_bytes, stride_qt, stride_qh, max_seq_len, (ACC)scale,\
                     scores, acc, q, kv_off, next_table, next_kv_end);                                      \
        }                                                                                                   \
        free(scores); free(acc); free(q); free(kv_off);                                                     \
    }                                                                                                       \
    free(tile_start);                                                                                       \
    return failed;                                                                                          \
}

DEFINE_ATTEND_TILE(attend_tile_f32, float, float, exp_f32, dot_f32)
DEFINE_ATTEND_TILE(attend_tile_f64, double, double, exp_f64, dot_f64)
DEFINE_RAGGED_ATTENTION(ragged_attention_f32, attend_tile_f32, float, float)
DEFINE_RAGGED_ATTENTION(ragged_attention_f64, attend_tile_f64, double, double)
