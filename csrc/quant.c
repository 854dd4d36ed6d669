/* quant.c: see quant.h. */
#include "quant.h"

#include <math.h>
#include <string.h>

#include "cpu.h"
#include "dispatch.h"

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

#define KVS_Q_GROUP_MAX 64

/* The smallest and largest of n floats, none NaN.  Min and max do not
 * depend on the order they are taken in, so GCC may vectorise the
 * reduction (what it otherwise must not assume: no NaN, one zero). */
#if defined(__GNUC__) && !defined(__clang__)
__attribute__((optimize("finite-math-only", "no-signed-zeros")))
#endif
static void range_of(const float *f, size_t n, float *lo_out, float *hi_out)
{
    float lo = f[0], hi = f[0];
    for (size_t i = 1; i < n; i++) {
        lo = f[i] < lo ? f[i] : lo;
        hi = f[i] > hi ? f[i] : hi;
    }
    *lo_out = lo;
    *hi_out = hi;
}

/* A group's values as float32 in f; 1 when all are finite. */
static inline __attribute__((always_inline)) int group_values(const void *src, size_t at, size_t group, int dtype,
                                                              float *f)
{
    int bad = 0;
    for (size_t i = 0; i < group; i++) {
        float v = load(src, at + i, dtype);
        f[i] = v;
        bad |= !(v - v == 0.0f);                        /* NaN for inf and NaN */
    }
    return !bad;
}

static inline __attribute__((always_inline)) int quantize_all(const void *src, size_t count, int dtype, int bits,
                                                               size_t group, uint8_t *q, void *scales, void *biases)
{
    const float levels = (float)((1 << bits) - 1);
    uint8_t ints[KVS_Q_GROUP_MAX];
    float f[KVS_Q_GROUP_MAX];
    for (size_t g = 0; g * group < count; g++) {
        size_t at = g * group;
        float lo, hi;
        if (!group_values(src, at, group, dtype, f))
            return -1;
        range_of(f, group, &lo, &hi);
        lo = lo == 0.0f ? 0.0f : lo;                    /* +0 whichever zero was smallest */
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
        const float inv = 1.0f / (s > 0 ? s : 1.0f);
        uint8_t *out = bits == 8 ? q + at : ints;
        for (size_t i = 0; i < group; i++) {
            /* Clamped first (to integers, so the order does not change the
             * result), then rounded by adding 1.5 * 2^23: the sum's low
             * mantissa bits are the integer, read without a conversion. */
            float x = (f[i] - lo) * inv;
            x = x < 0 ? 0 : x > levels ? levels : x;
            out[i] = (uint8_t)f32_bits(x + 12582912.0f);
        }
        if (bits == 4)
            for (size_t i = 0; i < group / 2; i++)
                q[at / 2 + i] = (uint8_t)(ints[2 * i] | (ints[2 * i + 1] << 4));
    }
    return 0;
}

static inline __attribute__((always_inline)) void dequantize_all(const uint8_t *q, const void *scales,
                                                                  const void *biases, size_t count, int dtype,
                                                                  int bits, size_t group, void *dst)
{
    uint8_t ints[KVS_Q_GROUP_MAX];
    for (size_t g = 0; g * group < count; g++) {
        size_t at = g * group;
        float s = load(scales, g, dtype), b = load(biases, g, dtype);
        const uint8_t *in = q + at;
        if (bits == 4) {
            for (size_t i = 0; i < group / 2; i++) {
                ints[2 * i] = q[at / 2 + i] & 0xF;
                ints[2 * i + 1] = q[at / 2 + i] >> 4;
            }
            in = ints;
        }
        for (size_t i = 0; i < group; i++) {
            float p = (float)in[i] * s;
            store(dst, at + i, dtype, p + b);
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

/* The dequantizers: one body, compiled for the baseline (SSE2 on x86-64,
 * NEON on arm64: the compiler vectorises both) and, on x86-64, for AVX2
 * (twice the lanes), chosen at run time.  The arithmetic is the same IEEE
 * float32 multiply and add either way (no fused multiply-add), so both
 * give the same bits. */
typedef void (*dequantize_fn)(const uint8_t *q, const void *scales, const void *biases, size_t count, int dtype,
                              int bits, size_t group, void *dst);

#define KVS_Q_CALL(d, b) dequantize_all(q, scales, biases, count, d, b, group, dst); return

static void dequantize_portable(const uint8_t *q, const void *scales, const void *biases, size_t count, int dtype,
                                int bits, size_t group, void *dst)
{
    KVS_Q_CASES(KVS_Q_CALL)
}

#if defined(KVS_HAVE_X86)
__attribute__((target("avx2")))
static void dequantize_avx2(const uint8_t *q, const void *scales, const void *biases, size_t count, int dtype,
                            int bits, size_t group, void *dst)
{
    KVS_Q_CASES(KVS_Q_CALL)
}
#endif
#undef KVS_Q_CALL

static dequantize_fn dequantize = dequantize_portable;
static const char *dequantize_name = "portable";

int kvs_quant_has(int impl)
{
    return kvs_impl_has(impl, impl == KVS_IMPL_X86 && kvs_cpu_has_avx2(), 0);
}

int kvs_quant_select(int impl)
{
    if (impl == KVS_IMPL_AUTO)
        impl = kvs_quant_has(KVS_IMPL_X86) ? KVS_IMPL_X86 : KVS_IMPL_PORTABLE;
    if (!kvs_quant_has(impl)) return -1;
    dequantize = dequantize_portable, dequantize_name = "portable";
#if defined(KVS_HAVE_X86)
    if (impl == KVS_IMPL_X86) dequantize = dequantize_avx2, dequantize_name = "avx2";
#endif
    return 0;
}

const char *kvs_quant_impl_name(void) { return dequantize_name; }

void kvs_dequantize(const uint8_t *q, const void *scales, const void *biases, size_t count, int dtype, int bits,
                    size_t group, void *dst)
{
    dequantize(q, scales, biases, count, dtype, bits, group, dst);
}
