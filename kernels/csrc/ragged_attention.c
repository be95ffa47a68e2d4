/* Ragged causal attention over a paged KV cache, for CPUs: one call per layer per iteration.
 *
 * The same contract as kernels/attention.py (its docstring): the query tokens of every request of
 * the iteration are concatenated, `query_start_loc` cuts them into requests, request i's tokens sit at
 * positions seq_lens[i] - q_len_i .. seq_lens[i] - 1 and attend to every cached position up to their
 * own, reading K/V through the request's block table. Prompts, prompt chunks and decodes share a call.
 *
 * Work is split into items of (request, kv head, up to TILE_ROWS query tokens), spread over OpenMP
 * threads. An item holds the query rows of all GROUP heads that share its kv head, so each K and V
 * row is read from memory once for all of them: decode attention is memory-bound, and this keeps it
 * at one pass over the request's cache. Softmax is exact (two passes over a row of scores kept in a
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

static int64_t find_request(const int64_t *tile_start, int64_t num_seqs, int64_t tile) {
    int64_t lo = 0, hi = num_seqs;  /* the last request whose first tile is <= tile */
    while (hi - lo > 1) {
        int64_t mid = (lo + hi) / 2;
        if (tile_start[mid] <= tile) lo = mid; else hi = mid;
    }
    return lo;
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
    int64_t *tile_start = malloc((size_t)(num_seqs + 1) * sizeof(int64_t));                                 \
    if (tile_start == NULL) return 1;                                                                       \
    tile_start[0] = 0;                                                                                      \
    for (int64_t s = 0; s < num_seqs; s++) {                                                                \
        int64_t q_len = query_start_loc[s + 1] - query_start_loc[s];                                        \
        tile_start[s + 1] = tile_start[s] + (q_len + TILE_ROWS - 1) / TILE_ROWS;                            \
    }                                                                                                       \
    const int64_t num_items = tile_start[num_seqs] * num_kv_heads;                                          \
    const int64_t max_rows = TILE_ROWS * group;                                                             \
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
        for (int64_t item = 0; item < num_items; item++) {                                                  \
            if (scores == NULL || acc == NULL || q == NULL) continue;                                       \
            const int64_t tile = item / num_kv_heads, kv_head = item % num_kv_heads;                        \
            const int64_t s = find_request(tile_start, num_seqs, tile);                                     \
            const int64_t q_start = query_start_loc[s];                                                     \
            const int64_t q_len = query_start_loc[s + 1] - q_start;                                         \
            const int64_t context = seq_lens[s] - q_len;  /* tokens cached before this iteration */        \
            const int64_t row0 = (tile - tile_start[s]) * TILE_ROWS;                                        \
            const int64_t num_tokens = q_len - row0 < TILE_ROWS ? q_len - row0 : TILE_ROWS;                 \
            const int64_t rows = num_tokens * group;  /* row r: token r / group, head r % group */          \
            const int64_t kv_end = context + row0 + num_tokens;  /* causal bound of the last token */      \
            const int32_t *table = block_tables + s * max_blocks;                                           \
            for (int64_t r = 0; r < rows; r++) {                                                            \
                const T *src = query + (q_start + row0 + r / group) * stride_qt                             \
                                     + (kv_head * group + r % group) * stride_qh;                           \
                for (int64_t d = 0; d < head_dim; d++) q[r * head_dim + d] = (ACC)src[d] * (ACC)scale;      \
            }                                                                                               \
            for (int64_t n = 0; n < kv_end; n++) {  /* pass 1: scores, one K row for all rows */            \
                const int64_t slot = (int64_t)table[n / block_size] * block_size + n % block_size;          \
                const T *k = k_cache + slot * slot_stride + kv_head * head_dim;                             \
                for (int64_t r = 0; r < rows; r++) {                                                        \
                    const ACC *qr = q + r * head_dim;                                                       \
                    ACC dot = 0;                                                                            \
                    _Pragma("omp simd reduction(+:dot)")                                                    \
                    for (int64_t d = 0; d < head_dim; d++) dot += qr[d] * (ACC)k[d];                        \
                    scores[r * max_seq_len + n] = dot;                                                      \
                }                                                                                           \
            }                                                                                               \
            for (int64_t r = 0; r < rows; r++) {  /* softmax over each row's causal prefix */               \
                ACC *row = scores + r * max_seq_len;                                                        \
                const int64_t end = context + row0 + r / group + 1;                                         \
                ACC m = row[0];                                                                             \
                for (int64_t n = 1; n < end; n++) m = row[n] > m ? row[n] : m;                              \
                ACC sum = 0;                                                                                \
                for (int64_t n = 0; n < end; n++) { row[n] = EXP(row[n] - m); sum += row[n]; }              \
                for (int64_t n = 0; n < end; n++) row[n] /= sum;                                            \
                for (int64_t n = end; n < kv_end; n++) row[n] = 0;                                          \
            }                                                                                               \
            memset(acc, 0, (size_t)(rows * head_dim) * sizeof(ACC));                                        \
            for (int64_t n = 0; n < kv_end; n++) {  /* pass 2: weighted sum, one V row for all rows */      \
                const int64_t slot = (int64_t)table[n / block_size] * block_size + n % block_size;          \
                const T *v = v_cache + slot * slot_stride + kv_head * head_dim;                             \
                for (int64_t r = 0; r < rows; r++) {                                                        \
                    const ACC p = scores[r * max_seq_len + n];                                              \
                    ACC *ar = acc + r * head_dim;                                                           \
                    _Pragma("omp simd")                                                                     \
                    for (int64_t d = 0; d < head_dim; d++) ar[d] += p * (ACC)v[d];                          \
                }                                                                                           \
            }                                                                                               \
            for (int64_t r = 0; r < rows; r++) {                                                            \
                T *dst = out + ((q_start + row0 + r / group) * num_heads + kv_head * group + r % group)     \
                               * head_dim;                                                                  \
                for (int64_t d = 0; d < head_dim; d++) dst[d] = (T)acc[r * head_dim + d];                   \
            }                                                                                               \
        }                                                                                                   \
        free(scores); free(acc); free(q);                                                                   \
    }                                                                                                       \
    free(tile_start);                                                                                       \
    return failed;                                                                                          \
}

DEFINE_RAGGED_ATTENTION(ragged_attention_f32, float, float, expf)
DEFINE_RAGGED_ATTENTION(ragged_attention_f64, double, double, exp)
