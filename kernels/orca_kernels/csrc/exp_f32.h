/* Shared by the CPU kernels (included, so each .c stays one compile unit; kernels/cpu_build.py keys its
 * cache on these headers too). */
#ifndef ORCA_EXP_F32_H
#define ORCA_EXP_F32_H

#include <math.h>
#include <stdint.h>
#include <string.h>

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

#endif
