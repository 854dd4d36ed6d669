/* quant.c: see quant.h. */
#include "quant.h"

#include <math.h>
#include <string.h>

/* a * b + c must round twice, as NumPy's separate operations do. */
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#elif defined(__GNUC__)
#pragma GCC optimize("O3", "fp-contract=off")
#endif

static float bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static uint32_t f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

static float bf16_f32(uint16_t h) { return bits_f32((uint32_t)h << 16); }

/* float32 to bfloat16, to the nearest (even); x finite. */
static uint16_t f32_bf16(float x)
{
    uint32_t u = f32_bits(x);
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

static float f16_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
    if (e == 0x1F)
        return bits_f32(sign | 0x7F800000u | (m << 13));
    if (e == 0) {
        float v = (float)m * 5.9604644775390625e-8f;    /* m * 2^-24, exact */
        return sign ? -v : v;
    }
    return bits_f32(sign | ((e + 112u) << 23) | (m << 13));
}

/* float32 to float16, to the nearest (even); past the largest half, inf. */
static uint16_t f32_f16(float x)
{
    uint32_t u = f32_bits(x), sign = (u >> 16) & 0x8000u;
    uint32_t a = u & 0x7FFFFFFFu;
    if (a >= 0x7F800000u)                               /* inf or NaN */
        return (uint16_t)(sign | 0x7C00u | (a > 0x7F800000u ? 0x200u : 0));
    if (a >= 0x477FF000u)                               /* rounds past 65504 */
        return (uint16_t)(sign | 0x7C00u);
    if (a < 0x38800000u) {                              /* below 2^-14: a subnormal half */
        /* |x| = mant * 2^(e - 150) and a subnormal half counts units of
         * 2^-24: mant * 2^(e - 126), mant shifted right by s = 126 - e
         * (14 or more here), rounded to the nearest (even); a carry into
         * 1024 units is the smallest normal half, as its bits say. */
        uint32_t s = 126u - (a >> 23);
        if (s > 24)                                     /* under half a unit (f32 subnormals too) */
            return (uint16_t)sign;
        uint32_t mant = (a & 0x7FFFFFu) | 0x800000u;
        uint32_t q = mant >> s, rem = mant & ((1u << s) - 1u), half = 1u << (s - 1);
        q += rem > half || (rem == half && (q & 1u));
        return (uint16_t)(sign | q);
    }
    uint32_t r = a + 0xFFFu + ((a >> 13) & 1u);         /* round the 13 dropped bits */
    return (uint16_t)(sign | ((r - 0x38000000u) >> 13));
}

static inline float load(const void *p, size_t i, int dtype)
{
    if (dtype == KVS_Q_F32) return ((const float *)p)[i];
    uint16_t h = ((const uint16_t *)p)[i];
    return dtype == KVS_Q_BF16 ? bf16_f32(h) : f16_f32(h);
}

static inline void store(void *p, size_t i, int dtype, float v)
{
    if (dtype == KVS_Q_F32)
        ((float *)p)[i] = v;
    else
        ((uint16_t *)p)[i] = dtype == KVS_Q_BF16 ? f32_bf16(v) : f32_f16(v);
}

/* v in dtype, rounded toward +inf (a scale, v >= 0): its stored bits' value. */
static float round_up(float v, int dtype, void *out, size_t i)
{
    if (dtype == KVS_Q_F32) {
        ((float *)out)[i] = v;
        return v;
    }
    uint16_t h;
    if (dtype == KVS_Q_BF16) {
        uint32_t u = f32_bits(v), t = u & 0xFFFF0000u;
        if (t != u && v > 0)
            t += 0x10000u;
        h = (uint16_t)(t >> 16);
    } else {
        h = f32_f16(v);
        if (f16_f32(h) < v)
            h = (uint16_t)(h + 1);                      /* v >= 0: the next half up */
    }
    ((uint16_t *)out)[i] = h;
    return dtype == KVS_Q_BF16 ? bf16_f32(h) : f16_f32(h);
}

/* rintf for 0 <= v < 2^22, in a form compilers vectorise: adding 1.5 * 2^23
 * leaves no fraction bits, so the sum is rounded to the nearest (even). */
static inline float round_even(float v)
{
    const float magic = 12582912.0f;
    return (v + magic) - magic;
}

/* One group's integers (the loop the compiler specialises per dtype and bits). */
static inline __attribute__((always_inline)) void quantize_group(const void *src, size_t at, size_t group,
                                                                 int dtype, int bits, float lo, float div,
                                                                 float levels, uint8_t *q)
{
    for (size_t i = 0; i < group; i += 2) {
        float a = round_even((load(src, at + i, dtype) - lo) / div);
        float b = round_even((load(src, at + i + 1, dtype) - lo) / div);
        a = a < 0 ? 0 : a > levels ? levels : a;
        b = b < 0 ? 0 : b > levels ? levels : b;
        if (bits == 8) {
            q[at + i] = (uint8_t)a;
            q[at + i + 1] = (uint8_t)b;
        } else {
            q[(at + i) / 2] = (uint8_t)((uint8_t)a | ((uint8_t)b << 4));
        }
    }
}

static inline __attribute__((always_inline)) int quantize_all(const void *src, size_t count, int dtype, int bits,
                                                               size_t group, uint8_t *q, void *scales, void *biases)
{
    const float levels = (float)((1 << bits) - 1);
    for (size_t g = 0; g * group < count; g++) {
        size_t at = g * group;
        float lo = INFINITY, hi = -INFINITY;
        int finite = 1;
        for (size_t i = 0; i < group; i++) {
            float v = load(src, at + i, dtype);
            finite &= isfinite(v) != 0;
            lo = v < lo ? v : lo;
            hi = v > hi ? v : hi;
        }
        if (!finite)
            return -1;
        /* lo is a value of the dtype: the bias is lo exactly. */
        store(biases, g, dtype, lo);
        float s = round_up((hi - lo) / levels, dtype, scales, g);
        if (!isfinite(s) || !isfinite(hi - lo))
            return -1;
        /* The largest value the group's integers give back must be one of
         * the dtype's (near its largest value the rounded-up scale could
         * pass it): else the block is not quantised. */
        float top = levels * s;
        top = top + lo;
        if (!isfinite(top) || (dtype == KVS_Q_BF16 && (f32_bf16(top) & 0x7F80u) == 0x7F80u)
                || (dtype == KVS_Q_F16 && (f32_f16(top) & 0x7C00u) == 0x7C00u))
            return -1;
        quantize_group(src, at, group, dtype, bits, lo, s > 0 ? s : 1.0f, levels, q);
    }
    return 0;
}

static inline __attribute__((always_inline)) void dequantize_all(const uint8_t *q, const void *scales,
                                                                  const void *biases, size_t count, int dtype,
                                                                  int bits, size_t group, void *dst)
{
    for (size_t g = 0; g * group < count; g++) {
        size_t at = g * group;
        float s = load(scales, g, dtype), b = load(biases, g, dtype);
        if (bits == 8) {
            for (size_t i = 0; i < group; i++) {
                float p = (float)q[at + i] * s;
                store(dst, at + i, dtype, p + b);
            }
        } else {
            for (size_t i = 0; i < group; i += 2) {
                uint8_t two = q[(at + i) / 2];
                float p0 = (float)(two & 0xF) * s, p1 = (float)(two >> 4) * s;
                store(dst, at + i, dtype, p0 + b);
                store(dst, at + i + 1, dtype, p1 + b);
            }
        }
    }
}

#define KVS_Q_CASES(call)                                                       \
    switch (dtype * 16 + bits) {                                                \
    case KVS_Q_F32 * 16 + 8: call(KVS_Q_F32, 8);                                \
    case KVS_Q_F32 * 16 + 4: call(KVS_Q_F32, 4);                                \
    case KVS_Q_F16 * 16 + 8: call(KVS_Q_F16, 8);                                \
    case KVS_Q_F16 * 16 + 4: call(KVS_Q_F16, 4);                                \
    case KVS_Q_BF16 * 16 + 8: call(KVS_Q_BF16, 8);                              \
    case KVS_Q_BF16 * 16 + 4: call(KVS_Q_BF16, 4);                              \
    default: break;                                                             \
    }

int kvs_quantize(const void *src, size_t count, int dtype, int bits, size_t group,
                 uint8_t *q, void *scales, void *biases)
{
#define KVS_Q_CALL(d, b) return quantize_all(src, count, d, b, group, q, scales, biases)
    KVS_Q_CASES(KVS_Q_CALL)
#undef KVS_Q_CALL
    return -1;
}

void kvs_dequantize(const uint8_t *q, const void *scales, const void *biases, size_t count, int dtype, int bits,
                    size_t group, void *dst)
{
#define KVS_Q_CALL(d, b) dequantize_all(q, scales, biases, count, d, b, group, dst); return
    KVS_Q_CASES(KVS_Q_CALL)
#undef KVS_Q_CALL
}
