// The token-wise ops of a decoder layer on the CPU, float32, each one pass over its rows in one call:
// residual add + RMSNorm, rotary embedding of query and key, the KV cache write, SwiGLU.
//
// Why C: at the row counts of decoding (one to a few dozen tokens) each of these is several torch ops,
// and each torch op costs a dispatch (a few microseconds here) that dwarfs its arithmetic; a layer ran
// about forty of them. Here each is one ctypes call. Rows are split across OpenMP threads only when there
// is enough work to pay for waking them. Strides are in elements; the last dimension is unit-stride.
#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "exp_f32.h"

#define PARALLEL_MIN_ELEMENTS 32768  // below this, one thread: waking the pool costs more than the work

static inline float row_inv_rms(const float *s, int64_t hidden, double eps) {
    double squares = 0.0;  // double: a long row's sum keeps its precision
    for (int64_t i = 0; i < hidden; i++) squares += (double)s[i] * s[i];
    return (float)(1.0 / sqrt(squares / (double)hidden + eps));
}

// out = weight * s / rms(s), with s = x + residual written to sum_out (or s = x when residual is NULL).
int rms_norm_f32(float *out, float *sum_out, const float *x, const float *residual, const float *weight,
                 int64_t rows, int64_t hidden, double eps) {
#pragma omp parallel for if (rows * hidden >= PARALLEL_MIN_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * hidden;
        const float *s = xr;
        if (residual != NULL) {
            float *sr = sum_out + r * hidden;
            const float *rr = residual + r * hidden;
            for (int64_t i = 0; i < hidden; i++) sr[i] = xr[i] + rr[i];
            s = sr;
        }
        float inv = row_inv_rms(s, hidden, eps);
        float *o = out + r * hidden;
        for (int64_t i = 0; i < hidden; i++) o[i] = weight[i] * (s[i] * inv);
    }
    return 0;
}

// One head in place: x1' = x1 c - x2 s, x2' = x2 c + x1 s (NeoX / HF rotate_half).
static inline void rotate_head(float *x, const float *c, const float *s, int64_t half) {
    for (int64_t i = 0; i < half; i++) {
        float x1 = x[i], x2 = x[i + half];
        x[i] = x1 * c[i] - x2 * s[i];
        x[i + half] = x2 * c[i] + x1 * s[i];
    }
}

// Query (T, nq, hd) and key (T, nk, hd) rotated in place at their positions; cos/sin (max_pos, hd/2).
int rotary_f32(float *query, float *key, const float *cos_table, const float *sin_table,
               const int64_t *positions, int64_t tokens, int64_t num_q_heads, int64_t num_k_heads,
               int64_t head_dim, int64_t q_token_stride, int64_t q_head_stride, int64_t k_token_stride,
               int64_t k_head_stride) {
    int64_t half = head_dim / 2;
#pragma omp parallel for if (tokens * (num_q_heads + num_k_heads) * head_dim >= PARALLEL_MIN_ELEMENTS)
    for (int64_t t = 0; t < tokens; t++) {
        const float *c = cos_table + positions[t] * half;
        const float *s = sin_table + positions[t] * half;
        for (int64_t h = 0; h < num_q_heads; h++) rotate_head(query + t * q_token_stride + h * q_head_stride, c, s, half);
        for (int64_t h = 0; h < num_k_heads; h++) rotate_head(key + t * k_token_stride + h * k_head_stride, c, s, half);
    }
    return 0;
}

static inline void copy_heads(float *dst, const float *src, int64_t heads, int64_t head_dim, int64_t head_stride) {
    for (int64_t h = 0; h < heads; h++)
        for (int64_t i = 0; i < head_dim; i++) dst[h * head_dim + i] = src[h * head_stride + i];
}

// Each token's key and value rows (T, nkv, hd, strided) into its slot of the contiguous paged caches.
int write_kv_f32(const float *key, const float *value, float *k_cache, float *v_cache, const int64_t *slots,
                 int64_t tokens, int64_t num_kv_heads, int64_t head_dim, int64_t k_token_stride,
                 int64_t k_head_stride, int64_t v_token_stride, int64_t v_head_stride) {
    int64_t row = num_kv_heads * head_dim;
#pragma omp parallel for if (tokens * row >= PARALLEL_MIN_ELEMENTS)
    for (int64_t t = 0; t < tokens; t++) {
        copy_heads(k_cache + slots[t] * row, key + t * k_token_stride, num_kv_heads, head_dim, k_head_stride);
        copy_heads(v_cache + slots[t] * row, value + t * v_token_stride, num_kv_heads, head_dim, v_head_stride);
    }
    return 0;
}


// SwiGLU: out[r, i] = silu(x[r, i]) * x[r, inter + i] for x (rows, 2 * inter), its row stride given; as
// torch's silu(gate) * up, with silu(g) = g / (1 + exp(-g)) taken from exp(-|g|) <= 1, which cannot
// overflow, and the exp vectorised (exp_f32.h): one pass, where torch made two and a temporary.
int silu_and_mul_f32(float *out, const float *x, int64_t rows, int64_t inter, int64_t x_row_stride) {
#pragma omp parallel for if (rows * inter >= PARALLEL_MIN_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = x + r * x_row_stride, *up = gate + inter;
        float *o = out + r * inter;
#pragma omp simd
        for (int64_t i = 0; i < inter; i++) {
            const float g = gate[i];
            const float e = exp_f32(-fabsf(g));  // exp(-|g|), in (0, 1]
            const float sigmoid = (g >= 0.0f ? 1.0f : e) / (1.0f + e);
            o[i] = (g * sigmoid) * up[i];
        }
    }
    return 0;
}
