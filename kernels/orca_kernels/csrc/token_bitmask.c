/* Structured outputs' token mask on the CPU: set to -inf every logit whose bit is clear.
 *
 * bitmask row i (`words` int32 words, bit j of word w allowing token 32w + j: llguidance's and xgrammar's
 * layout) masks logits row rows[i]. A word with every bit set is skipped and one with none is a run of
 * 32 stores, so the work follows the refused tokens, not the vocabulary: a mask inside a JSON string
 * allows almost everything, one between keys almost nothing. Built by kernels/cpu_build.py, called
 * from kernels/token_bitmask.py; kernels/token_bitmask.py's torch path is its reference.
 */
#include <math.h>
#include <stdint.h>

#define APPLY(NAME, T)                                                                              \
    void NAME(T *logits, int64_t row_stride, const int64_t *rows, int64_t n_rows,                    \
              const int32_t *bitmask, int64_t words, int64_t vocab) {                              \
        const T minus_inf = (T)(-INFINITY);                                                          \
        for (int64_t i = 0; i < n_rows; i++) {                                                      \
            T *row = logits + rows[i] * row_stride;                                                  \
            const uint32_t *mask = (const uint32_t *)(bitmask + i * words);                          \
            for (int64_t w = 0; w < words; w++) {                                                    \
                const uint32_t bits = mask[w];                                                       \
                if (bits == 0xFFFFFFFFu) continue;                                                   \
                const int64_t start = w * 32;                                                        \
                const int64_t end = start + 32 < vocab ? start + 32 : vocab;                         \
                if (bits == 0) {                                                                     \
                    for (int64_t t = start; t < end; t++) row[t] = minus_inf;                        \
                } else {                                                                             \
                    for (int64_t t = start; t < end; t++)                                            \
                        if (!((bits >> (t - start)) & 1u)) row[t] = minus_inf;                       \
                }                                                                                    \
            }                                                                                        \
        }                                                                                            \
    }

APPLY(apply_token_bitmask_f32, float)
APPLY(apply_token_bitmask_f64, double)
