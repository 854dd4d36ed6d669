/* crc32c.c: CRC32C with a slicing-by-8 table path for every platform and
 * hardware paths on x86-64 (SSE4.2, and AVX-512 carry-less multiplies) and
 * arm64 (ARMv8 CRC), chosen at run time.
 *
 * The hardware instruction has a latency of about three cycles but can start
 * one per cycle, so one stream reaches only a third of its throughput.  The
 * long-buffer loop hashes three adjacent slices at once and joins them:
 * crc(A||B) = shift_|B|(crc(A)) ^ crc(B), where shift_n multiplies by
 * x^(8n) modulo the polynomial.  For the two fixed slice sizes the shift is a
 * four-table lookup built once in kvs_init().
 *
 * Where the CPU has VPCLMULQDQ on 512-bit registers, long buffers are folded
 * instead: sixteen 128-bit lanes each carry the running remainder of every
 * 256th 16-byte block, and one carry-less multiply per half moves a lane 256
 * bytes on: A(x) * x^2048 + next (mod P).  At the end the lanes are folded
 * into one and the crc32 instruction reduces its 128 bits to the CRC.  This
 * runs about twice as fast as the three crc32 streams, and the CRC is part of
 * every checkpoint load.
 */
#include <string.h>

#include "cpu.h"
#include "crc32c.h"
#include "dispatch.h"

#if defined(KVS_HAVE_X86)
#include <nmmintrin.h>
#endif
#if defined(KVS_HAVE_X86_VPCLMUL)
#include <immintrin.h>
#endif
#if defined(KVS_HAVE_ARM_CRC)
#include <arm_acle.h>
#endif

#define POLY 0x82F63B78u        /* Castagnoli, bit-reflected */

/* Slice sizes of the three-stream loop: LONG amortises the join over 24 KiB,
 * SHORT keeps mid-sized buffers (768 B .. 24 KiB) on three streams too. */
#define LONG_SLICE 8192
#define SHORT_SLICE 256

static uint32_t table8[8][256];
static uint32_t shift_long[4][256];
static uint32_t shift_short[4][256];
static uint32_t x2n_table[31];
/* Fold constants of the VPCLMULQDQ path: fold[d] moves a 128-bit lane on by
 * 16 * (d + 1) bytes; [0] multiplies its first (higher-degree) 64 bits, [1]
 * its last 64. */
static uint64_t fold[16][2];

/* a * b modulo POLY, bit-reflected (bit 31 is x^0). */
static uint32_t multmodp(uint32_t a, uint32_t b)
{
    uint32_t m = 1u << 31, p = 0;
    for (;;) {
        if (a & m) {
            p ^= b;
            if ((a & (m - 1)) == 0) break;
        }
        m >>= 1;
        b = b & 1 ? (b >> 1) ^ POLY : b >> 1;
    }
    return p;
}

/* x^(n * 2^k) modulo POLY.  x^(2^k) repeats with period 31, not 32 as for
 * zlib's CRC-32: x has order 2^31 - 1 modulo the Castagnoli polynomial, so
 * x^(2^31) == x.  (k & 31 gave wrong results for lengths >= 2^29 bytes.) */
static uint32_t x2nmodp(uint64_t n, unsigned k)
{
    uint32_t p = 1u << 31;
    while (n) {
        if (n & 1) p = multmodp(x2n_table[k % 31], p);
        n >>= 1;
        k++;
    }
    return p;
}

static void build_shift(uint32_t t[4][256], size_t bytes)
{
    uint32_t xp = x2nmodp(bytes, 3);
    for (int k = 0; k < 4; k++)
        for (uint32_t b = 0; b < 256; b++)
            t[k][b] = multmodp(xp, b << (8 * k));
}

static uint32_t shift(const uint32_t t[4][256], uint32_t crc)
{
    return t[0][crc & 255] ^ t[1][(crc >> 8) & 255] ^ t[2][(crc >> 16) & 255] ^ t[3][crc >> 24];
}

uint32_t kvs_crc32c_combine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b)
{
    return multmodp(x2nmodp(len_b, 3), crc_a) ^ crc_b;
}

/* ---- portable: slicing-by-8 -------------------------------------------- */

static uint32_t load_le32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static uint32_t crc_portable(uint32_t c, const uint8_t *p, size_t n)
{
    while (n && ((uintptr_t)p & 7)) {
        c = table8[0][(c ^ *p++) & 255] ^ (c >> 8);
        n--;
    }
    while (n >= 8) {
        uint32_t lo = load_le32(p) ^ c, hi = load_le32(p + 4);
        c = table8[7][lo & 255] ^ table8[6][(lo >> 8) & 255] ^
            table8[5][(lo >> 16) & 255] ^ table8[4][lo >> 24] ^
            table8[3][hi & 255] ^ table8[2][(hi >> 8) & 255] ^
            table8[1][(hi >> 16) & 255] ^ table8[0][hi >> 24];
        p += 8;
        n -= 8;
    }
    while (n--)
        c = table8[0][(c ^ *p++) & 255] ^ (c >> 8);
    return c;
}

/* ---- hardware: one template, two instruction sets ---------------------- */

/* HW_CRC_BODY expands to the three-stream loop over the 64-bit and 8-bit
 * instructions CRC64(c, u64) and CRC8(c, u8); c is the raw register value. */
#define HW_CRC_BODY(CRC64, CRC8)                                              \
    uint64_t c0 = c;                                                          \
    while (n && ((uintptr_t)p & 7)) { c0 = CRC8((uint32_t)c0, *p++); n--; }   \
    while (n >= 3 * LONG_SLICE) {                                             \
        uint64_t c1 = 0, c2 = 0, v0, v1, v2;                                  \
        for (size_t i = 0; i < LONG_SLICE; i += 8) {                          \
            memcpy(&v0, p + i, 8);                                            \
            memcpy(&v1, p + LONG_SLICE + i, 8);                               \
            memcpy(&v2, p + 2 * LONG_SLICE + i, 8);                           \
            c0 = CRC64(c0, v0); c1 = CRC64(c1, v1); c2 = CRC64(c2, v2);       \
        }                                                                     \
        c0 = shift(shift_long, (uint32_t)c0) ^ (uint32_t)c1;                  \
        c0 = shift(shift_long, (uint32_t)c0) ^ (uint32_t)c2;                  \
        p += 3 * LONG_SLICE; n -= 3 * LONG_SLICE;                             \
    }                                                                         \
    while (n >= 3 * SHORT_SLICE) {                                            \
        uint64_t c1 = 0, c2 = 0, v0, v1, v2;                                  \
        for (size_t i = 0; i < SHORT_SLICE; i += 8) {                         \
            memcpy(&v0, p + i, 8);                                            \
            memcpy(&v1, p + SHORT_SLICE + i, 8);                              \
            memcpy(&v2, p + 2 * SHORT_SLICE + i, 8);                          \
            c0 = CRC64(c0, v0); c1 = CRC64(c1, v1); c2 = CRC64(c2, v2);       \
        }                                                                     \
        c0 = shift(shift_short, (uint32_t)c0) ^ (uint32_t)c1;                 \
        c0 = shift(shift_short, (uint32_t)c0) ^ (uint32_t)c2;                 \
        p += 3 * SHORT_SLICE; n -= 3 * SHORT_SLICE;                           \
    }                                                                         \
    while (n >= 8) { uint64_t v; memcpy(&v, p, 8); c0 = CRC64(c0, v); p += 8; n -= 8; } \
    while (n--) c0 = CRC8((uint32_t)c0, *p++);                                \
    return (uint32_t)c0;

#if defined(KVS_HAVE_X86)
__attribute__((target("sse4.2")))
static uint32_t crc_sse42(uint32_t c, const uint8_t *p, size_t n)
{
#define X86_CRC64(c, v) _mm_crc32_u64((c), (v))
#define X86_CRC8(c, b) _mm_crc32_u8((c), (b))
    HW_CRC_BODY(X86_CRC64, X86_CRC8)
}
#endif

#if defined(KVS_HAVE_X86_VPCLMUL)
/* The fold runs from this length on; shorter buffers go to crc_sse42. */
#define FOLD_MIN 512

#define FOLD_KEY(d) _mm512_broadcast_i32x4(_mm_set_epi64x((long long)fold[d][1], (long long)fold[d][0]))
/* x * k + d over each 128-bit lane: the two 64x64 products XORed with d. */
#define FOLD(x, k, d) _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128((x), (k), 0x00), \
                                                _mm512_clmulepi64_epi128((x), (k), 0x11), (d), 0x96)

__attribute__((target("avx512f,vpclmulqdq,sse4.2")))
static uint32_t crc_avx512(uint32_t c, const uint8_t *p, size_t n)
{
    if (n >= FOLD_MIN) {
        __m512i x0 = _mm512_loadu_si512((const void *)p), x1 = _mm512_loadu_si512((const void *)(p + 64));
        __m512i x2 = _mm512_loadu_si512((const void *)(p + 128)), x3 = _mm512_loadu_si512((const void *)(p + 192));
        /* The running CRC enters as an XOR into the first four bytes. */
        x0 = _mm512_xor_si512(x0, _mm512_maskz_mov_epi32(1, _mm512_set1_epi32((int)c)));
        p += 256; n -= 256;
        const __m512i k256 = FOLD_KEY(15);
        while (n >= 256) {
            x0 = FOLD(x0, k256, _mm512_loadu_si512((const void *)p));
            x1 = FOLD(x1, k256, _mm512_loadu_si512((const void *)(p + 64)));
            x2 = FOLD(x2, k256, _mm512_loadu_si512((const void *)(p + 128)));
            x3 = FOLD(x3, k256, _mm512_loadu_si512((const void *)(p + 192)));
            p += 256; n -= 256;
        }
        /* Four registers into x3, then x3's four lanes into its last. */
        x3 = FOLD(x0, FOLD_KEY(11), x3);
        x3 = FOLD(x1, FOLD_KEY(7), x3);
        x3 = FOLD(x2, FOLD_KEY(3), x3);
        const __m512i lanes = _mm512_set_epi64(0, 0, (long long)fold[0][1], (long long)fold[0][0],
                                               (long long)fold[1][1], (long long)fold[1][0],
                                               (long long)fold[2][1], (long long)fold[2][0]);
        __m512i t = _mm512_xor_si512(_mm512_clmulepi64_epi128(x3, lanes, 0x00),
                                     _mm512_clmulepi64_epi128(x3, lanes, 0x11));
        __m128i r = _mm_xor_si128(_mm_xor_si128(_mm512_extracti32x4_epi32(t, 0), _mm512_extracti32x4_epi32(t, 1)),
                                  _mm_xor_si128(_mm512_extracti32x4_epi32(t, 2), _mm512_extracti32x4_epi32(x3, 3)));
        /* crc32 of the 16 remainder bytes from zero is R(x) * x^32 mod P. */
        uint64_t lo = (uint64_t)_mm_cvtsi128_si64(r), hi = (uint64_t)_mm_cvtsi128_si64(_mm_unpackhi_epi64(r, r));
        c = (uint32_t)_mm_crc32_u64(_mm_crc32_u64(0, lo), hi);
        /* Clean upper state before leaving: GCC tail-calls crc_sse42 without
         * its own vzeroupper, and a thread left with dirty upper registers runs
         * every later legacy-SSE instruction (libm's, MLX's scalar CPU kernels)
         * many times slower -- a 50x slower MLX softmax was measured here --
         * and hands that state on to any thread it creates. */
        _mm256_zeroupper();
    }
    return crc_sse42(c, p, n);
}
#endif

#if defined(KVS_HAVE_ARM_CRC)
static uint32_t crc_armv8(uint32_t c, const uint8_t *p, size_t n)
{
#define ARM_CRC64(c, v) __crc32cd((uint32_t)(c), (v))
#define ARM_CRC8(c, b) __crc32cb((c), (b))
    HW_CRC_BODY(ARM_CRC64, ARM_CRC8)
}
#endif

/* The 64-bit loads above are little-endian words, as the instructions want;
 * every target with these instructions is little-endian. */

/* ---- dispatch ---------------------------------------------------------- */

typedef uint32_t (*crc_fn)(uint32_t c, const uint8_t *p, size_t n);
static crc_fn crc_impl = crc_portable;
static const char *crc_name = "portable";

int kvs_crc32c_has(int impl)
{
    switch (impl) {
    case KVS_IMPL_AUTO:
    case KVS_IMPL_PORTABLE: return 1;
#if defined(KVS_HAVE_X86)
    case KVS_IMPL_X86: return kvs_cpu_has_sse42();
#endif
#if defined(KVS_HAVE_X86_VPCLMUL)
    case KVS_IMPL_X86_AVX512: return kvs_cpu_has_avx512_vpclmul();
#endif
#if defined(KVS_HAVE_ARM_CRC)
    case KVS_IMPL_ARM: return kvs_cpu_has_arm_crc32();
#endif
    default: return 0;
    }
}

int kvs_crc32c_select(int impl)
{
    if (impl == KVS_IMPL_AUTO) {
        if (kvs_crc32c_has(KVS_IMPL_X86_AVX512)) impl = KVS_IMPL_X86_AVX512;
        else if (kvs_crc32c_has(KVS_IMPL_X86)) impl = KVS_IMPL_X86;
        else if (kvs_crc32c_has(KVS_IMPL_ARM)) impl = KVS_IMPL_ARM;
        else impl = KVS_IMPL_PORTABLE;
    }
    if (!kvs_crc32c_has(impl))
        return -1;
    switch (impl) {
#if defined(KVS_HAVE_X86)
    case KVS_IMPL_X86: crc_impl = crc_sse42; crc_name = "sse4.2"; break;
#endif
#if defined(KVS_HAVE_X86_VPCLMUL)
    case KVS_IMPL_X86_AVX512: crc_impl = crc_avx512; crc_name = "avx512-vpclmulqdq"; break;
#endif
#if defined(KVS_HAVE_ARM_CRC)
    case KVS_IMPL_ARM: crc_impl = crc_armv8; crc_name = "armv8"; break;
#endif
    default: crc_impl = crc_portable; crc_name = "portable"; break;
    }
    return 0;
}

const char *kvs_crc32c_impl_name(void) { return crc_name; }

uint32_t kvs_crc32c(uint32_t crc, const uint8_t *data, size_t len)
{
    return ~crc_impl(~crc, data, len);
}

void kvs_crc32c_build_tables(void)
{
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = n;
        for (int k = 0; k < 8; k++)
            c = c & 1 ? (c >> 1) ^ POLY : c >> 1;
        table8[0][n] = c;
    }
    for (uint32_t n = 0; n < 256; n++)
        for (int k = 1; k < 8; k++)
            table8[k][n] = (table8[k - 1][n] >> 8) ^ table8[0][table8[k - 1][n] & 255];
    x2n_table[0] = 1u << 30;     /* x^1 */
    for (int k = 1; k < 31; k++)
        x2n_table[k] = multmodp(x2n_table[k - 1], x2n_table[k - 1]);
    build_shift(shift_long, LONG_SLICE);
    build_shift(shift_short, SHORT_SLICE);
    /* A lane's 64-bit halves sit 64 + 8B and 8B bits before the lane B bytes
     * on; the carry-less product of two bit-reflected values comes out one
     * degree high, hence the - 1. */
    for (int d = 0; d < 16; d++) {
        uint64_t bits = 8 * 16 * (uint64_t)(d + 1);
        fold[d][0] = (uint64_t)x2nmodp(bits + 64 - 1, 0) << 32;
        fold[d][1] = (uint64_t)x2nmodp(bits - 1, 0) << 32;
    }
}

