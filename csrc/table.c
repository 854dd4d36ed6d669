/* table.c: table planes (see table.h). */
#include <string.h>

#include "cpu.h"
#include "dispatch.h"
#include "planes.h"
#include "table.h"

#if defined(KVS_HAVE_X86)
#include <tmmintrin.h>
#endif
#if defined(__aarch64__)
#include <arm_neon.h>
#endif

/* A join decodes a table plane STEP elements at a time into a buffer that
 * stays in the first-level cache, then interleaves the planes from there. */
#define STEP 2048

static uint32_t load32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static void store32(uint8_t *p, uint32_t v)
{
    p[0] = (uint8_t)v; p[1] = (uint8_t)(v >> 8); p[2] = (uint8_t)(v >> 16); p[3] = (uint8_t)(v >> 24);
}

/* The table: the 16 most common values of a sample of at most SAMPLE bytes
 * spread evenly over the plane, most common first (ties by value); unused
 * entries 0.  A table drawn from a sample is as valid as any: the bytes it
 * misses are exceptions. */
#define SAMPLE 16384

static void choose_table(const uint8_t *plane, size_t n, uint8_t table[16])
{
    uint32_t count[256] = {0};
    size_t step = n > SAMPLE ? n / SAMPLE : 1;
    for (size_t i = 0; i < n; i += step) count[plane[i]]++;
    memset(table, 0, 16);
    int taken[256] = {0};
    for (int k = 0; k < 16; k++) {
        int best = -1;
        for (int v = 0; v < 256; v++)
            if (!taken[v] && count[v] && (best < 0 || count[v] > count[best])) best = v;
        if (best < 0) break;
        taken[best] = 1;
        table[k] = (uint8_t)best;
    }
}

/* Exceptions are looked for in runs of RUN bytes: a run none of whose bytes
 * is one (the common case) costs one flag test. */
#define RUN 64

size_t kvs_table_pack(const uint8_t *plane, size_t n, size_t max_exceptions, uint8_t *out)
{
    if (n == 0 || n > UINT32_MAX) return 0;
    uint8_t table[16], code[256];
    choose_table(plane, n, table);
    /* code[v]: v's code in the low nibble, 16 when v is an exception (not
     * in the table, and not table[15], which code 15 stands for). */
    memset(code, 15 | 16, sizeof code);
    for (int k = 15; k >= 0; k--) code[table[k]] = (uint8_t)k;   /* a value twice in the table: its first */
    memcpy(out, table, 16);
    uint8_t *codes = out + KVS_TABLE_HEAD;
    uint8_t *places = codes + (n + 1) / 2;
    uint8_t *values = places + 4 * max_exceptions;   /* moved down once the count is known */
    size_t e = 0, even = n & ~(size_t)1;
    for (size_t run = 0; run < even; run += RUN) {
        size_t end = run + RUN < even ? run + RUN : even;
        unsigned flags = 0;
        for (size_t i = run; i < end; i += 2) {
            unsigned a = code[plane[i]], b = code[plane[i + 1]];
            codes[i / 2] = (uint8_t)((a & 15) | (b & 15) << 4);
            flags |= a | b;
        }
        if (!(flags & 16)) continue;
        for (size_t j = run; j < end; j++) {
            if (!(code[plane[j]] & 16)) continue;
            if (e == max_exceptions) return 0;
            store32(places + 4 * e, (uint32_t)j);
            values[e++] = plane[j];
        }
    }
    if (n & 1) {                                      /* the last byte; the unused nibble is 0 */
        unsigned a = code[plane[n - 1]];
        codes[n / 2] = (uint8_t)(a & 15);
        if (a & 16) {
            if (e == max_exceptions) return 0;
            store32(places + 4 * e, (uint32_t)(n - 1));
            values[e++] = plane[n - 1];
        }
    }
    store32(out + 16, (uint32_t)e);
    memmove(places + 4 * e, values, e);
    return KVS_TABLE_SIZE(n, e);
}

static unsigned code_at(const uint8_t *codes, size_t i)
{
    return i & 1 ? codes[i / 2] >> 4 : codes[i / 2] & 15;
}

int kvs_table_check(const uint8_t *stored, size_t len, size_t n)
{
    if (n > UINT32_MAX || len < KVS_TABLE_HEAD) return KVS_EBADTABLE;
    size_t e = load32(stored + 16);
    if (e > n || len != KVS_TABLE_SIZE(n, e)) return KVS_EBADTABLE;
    const uint8_t *codes = stored + KVS_TABLE_HEAD, *places = codes + (n + 1) / 2;
    for (size_t k = 0; k < e; k++) {
        size_t at = load32(places + 4 * k);
        if (at >= n || (k && at <= load32(places + 4 * (k - 1))) || code_at(codes, at) != 15)
            return KVS_EBADTABLE;
    }
    return 0;
}

/* The decoders: out[i] = table[code first + i], for i < count. */
typedef void (*decode_fn)(uint8_t *out, const uint8_t *codes, size_t first, size_t count, const uint8_t table[16]);

static void decode_portable(uint8_t *out, const uint8_t *codes, size_t first, size_t count, const uint8_t table[16])
{
    size_t i = 0;
    if (first & 1 && count) out[i++] = table[codes[first / 2] >> 4];
    const uint8_t *c = codes + (first + i) / 2;
    for (; i + 2 <= count; i += 2, c++) {
        out[i] = table[*c & 15];
        out[i + 1] = table[*c >> 4];
    }
    if (i < count) out[i] = table[*c & 15];
}

/* The joins of a 16-bit block whose low plane is stored as it is and whose
 * high plane is a table plane (bfloat16's and float16's usual form), fused:
 * dst[2i] = low[i], dst[2i + 1] = table[code first + i], for i < count, with
 * no pass through a step buffer. */
typedef void (*join2_fn)(uint8_t *dst, const uint8_t *low, const uint8_t *codes, size_t first, size_t count,
                         const uint8_t table[16]);

static void join2_portable(uint8_t *dst, const uint8_t *low, const uint8_t *codes, size_t first, size_t count,
                           const uint8_t table[16])
{
    for (size_t i = 0; i < count; i++) {
        size_t k = first + i;
        dst[2 * i] = low[i];
        dst[2 * i + 1] = table[(codes[k / 2] >> (4 * (k & 1))) & 15];
    }
}

#if defined(KVS_HAVE_X86)
/* The 32 values whose codes are the 16 bytes at c: elements 0..15 in *e0,
 * 16..31 in *e1. */
__attribute__((target("ssse3")))
static inline void lookup32_ssse3(const uint8_t *c, __m128i t, __m128i *e0, __m128i *e1)
{
    const __m128i mask = _mm_set1_epi8(15);
    __m128i v = _mm_loadu_si128((const __m128i *)c);
    __m128i a = _mm_shuffle_epi8(t, _mm_and_si128(v, mask));
    __m128i b = _mm_shuffle_epi8(t, _mm_and_si128(_mm_srli_epi16(v, 4), mask));
    *e0 = _mm_unpacklo_epi8(a, b);
    *e1 = _mm_unpackhi_epi8(a, b);
}

__attribute__((target("ssse3")))
static void join2_ssse3(uint8_t *dst, const uint8_t *low, const uint8_t *codes, size_t first, size_t count,
                        const uint8_t table[16])
{
    size_t i = (first & 1) && count ? 1 : 0;
    join2_portable(dst, low, codes, first, i, table);
    const uint8_t *c = codes + (first + i) / 2;
    const __m128i t = _mm_loadu_si128((const __m128i *)table);
    for (; i + 32 <= count; i += 32, c += 16) {
        __m128i h0, h1;
        lookup32_ssse3(c, t, &h0, &h1);
        __m128i l0 = _mm_loadu_si128((const __m128i *)(low + i));
        __m128i l1 = _mm_loadu_si128((const __m128i *)(low + i + 16));
        __m128i *o = (__m128i *)(dst + 2 * i);
        _mm_storeu_si128(o, _mm_unpacklo_epi8(l0, h0));
        _mm_storeu_si128(o + 1, _mm_unpackhi_epi8(l0, h0));
        _mm_storeu_si128(o + 2, _mm_unpacklo_epi8(l1, h1));
        _mm_storeu_si128(o + 3, _mm_unpackhi_epi8(l1, h1));
    }
    join2_portable(dst + 2 * i, low + i, codes, first + i, count - i, table);
}

__attribute__((target("ssse3")))
static void decode_ssse3(uint8_t *out, const uint8_t *codes, size_t first, size_t count, const uint8_t table[16])
{
    size_t i = 0;
    if (first & 1 && count) out[i++] = table[codes[first / 2] >> 4];
    const uint8_t *c = codes + (first + i) / 2;
    const __m128i t = _mm_loadu_si128((const __m128i *)table);
    for (; i + 32 <= count; i += 32, c += 16) {
        __m128i e0, e1;
        lookup32_ssse3(c, t, &e0, &e1);
        _mm_storeu_si128((__m128i *)(out + i), e0);
        _mm_storeu_si128((__m128i *)(out + i + 16), e1);
    }
    decode_portable(out + i, codes, first + i, count - i, table);
}
#endif

#if defined(__aarch64__)
/* The 32 values whose codes are the 16 bytes at c: elements 0..15 in *e0,
 * 16..31 in *e1. */
static inline void lookup32_neon(const uint8_t *c, uint8x16_t t, uint8x16_t *e0, uint8x16_t *e1)
{
    uint8x16_t v = vld1q_u8(c);
    uint8x16_t a = vqtbl1q_u8(t, vandq_u8(v, vdupq_n_u8(15))), b = vqtbl1q_u8(t, vshrq_n_u8(v, 4));
    *e0 = vzip1q_u8(a, b);
    *e1 = vzip2q_u8(a, b);
}

static void join2_neon(uint8_t *dst, const uint8_t *low, const uint8_t *codes, size_t first, size_t count,
                       const uint8_t table[16])
{
    size_t i = (first & 1) && count ? 1 : 0;
    join2_portable(dst, low, codes, first, i, table);
    const uint8_t *c = codes + (first + i) / 2;
    const uint8x16_t t = vld1q_u8(table);
    for (; i + 32 <= count; i += 32, c += 16) {
        uint8x16x2_t e0, e1;
        lookup32_neon(c, t, &e0.val[1], &e1.val[1]);
        e0.val[0] = vld1q_u8(low + i);
        e1.val[0] = vld1q_u8(low + i + 16);
        vst2q_u8(dst + 2 * i, e0);          /* stores the two registers interleaved */
        vst2q_u8(dst + 2 * i + 32, e1);
    }
    join2_portable(dst + 2 * i, low + i, codes, first + i, count - i, table);
}

static void decode_neon(uint8_t *out, const uint8_t *codes, size_t first, size_t count, const uint8_t table[16])
{
    size_t i = 0;
    if (first & 1 && count) out[i++] = table[codes[first / 2] >> 4];
    const uint8_t *c = codes + (first + i) / 2;
    const uint8x16_t t = vld1q_u8(table);
    for (; i + 32 <= count; i += 32, c += 16) {
        uint8x16_t e0, e1;
        lookup32_neon(c, t, &e0, &e1);
        vst1q_u8(out + i, e0);
        vst1q_u8(out + i + 16, e1);
    }
    decode_portable(out + i, codes, first + i, count - i, table);
}
#endif

static decode_fn decode = decode_portable;
static join2_fn join2 = join2_portable;
static const char *decode_name = "portable";

int kvs_table_has(int impl)
{
    /* NEON is part of every arm64 core. */
    return kvs_impl_has(impl, impl == KVS_IMPL_X86 && kvs_cpu_has_ssse3(), 1);
}

int kvs_table_select(int impl)
{
    if (impl == KVS_IMPL_AUTO) {
#if defined(__aarch64__)
        impl = KVS_IMPL_ARM;
#else
        impl = kvs_table_has(KVS_IMPL_X86) ? KVS_IMPL_X86 : KVS_IMPL_PORTABLE;
#endif
    }
    if (!kvs_table_has(impl)) return -1;
    decode = decode_portable, join2 = join2_portable, decode_name = "portable";
#if defined(KVS_HAVE_X86)
    if (impl == KVS_IMPL_X86) decode = decode_ssse3, join2 = join2_ssse3, decode_name = "ssse3";
#endif
#if defined(__aarch64__)
    if (impl == KVS_IMPL_ARM) decode = decode_neon, join2 = join2_neon, decode_name = "neon";
#endif
    return 0;
}

const char *kvs_table_impl_name(void) { return decode_name; }

/* Sets each exception of the table plane p whose place lies in [first,
 * first + count) in dst, the block's elements from first on. */
static void patch(uint8_t *dst, const uint8_t *stored, size_t n, size_t p, size_t width, size_t first, size_t count)
{
    size_t e = load32(stored + 16);
    const uint8_t *places = stored + KVS_TABLE_HEAD + (n + 1) / 2, *values = places + 4 * e;
    size_t lo = 0, hi = e;
    while (lo < hi) {               /* the first exception at or after first */
        size_t mid = lo + (hi - lo) / 2;
        if (load32(places + 4 * mid) < first) lo = mid + 1; else hi = mid;
    }
    for (size_t k = lo; k < e; k++) {
        size_t at = load32(places + 4 * k);
        if (at >= first + count) break;
        dst[(at - first) * width + p] = values[k];
    }
}

void kvs_table_join(uint8_t *dst, const kvs_plane planes[], size_t width, size_t n, size_t first, size_t count)
{
    uint8_t step[KVS_PLANES_MAX][STEP];
    const uint8_t *from[KVS_PLANES_MAX];
    if (width == 2 && !planes[0].table && planes[1].table) {
        join2(dst, planes[0].bytes + first, planes[1].bytes + KVS_TABLE_HEAD, first, count, planes[1].bytes);
        patch(dst, planes[1].bytes, n, 1, width, first, count);
        return;
    }
    for (size_t done = 0; done < count;) {
        size_t k = count - done < STEP ? count - done : STEP;
        for (size_t p = 0; p < width; p++) {
            if (planes[p].table) {
                decode(step[p], planes[p].bytes + KVS_TABLE_HEAD, first + done, k, planes[p].bytes);
                from[p] = step[p];
            } else {
                from[p] = planes[p].bytes + first + done;
            }
        }
        kvs_planes_join(dst + done * width, from, 0, k, width);
        done += k;
    }
    for (size_t p = 0; p < width; p++)
        if (planes[p].table) patch(dst, planes[p].bytes, n, p, width, first, count);
}
