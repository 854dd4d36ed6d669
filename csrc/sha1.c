/* sha1.c: SHA1 with three block functions chosen at run time: x86-64 SHA-NI,
 * the ARMv8 SHA1 instructions, and portable C.  The streaming layer above the
 * block function (buffering, padding, prefix snapshots) is shared by all. */
#include <string.h>

#include "cpu.h"
#include "dispatch.h"
#include "sha1.h"

#if defined(KVS_HAVE_X86)
#include <immintrin.h>
#endif
#if defined(KVS_HAVE_ARM_SHA1)
#include <arm_neon.h>
#endif

typedef void (*blocks_fn)(uint32_t state[5], const uint8_t *p, size_t n);

static uint32_t rol(uint32_t x, int n) { return (x << n) | (x >> (32 - n)); }

static uint32_t load_be32(const uint8_t *p)
{
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}

static void store_be32(uint8_t *p, uint32_t v)
{
    p[0] = (uint8_t)(v >> 24); p[1] = (uint8_t)(v >> 16);
    p[2] = (uint8_t)(v >> 8); p[3] = (uint8_t)v;
}

/* A lanes kernel compresses one final block of each of LANES messages,
 * and up to LANES_MAIN_BLOCKS blocks of one more message (a prefix pass's
 * main pass) beside them (see lanes_avx512).  It pads the final blocks
 * itself: lane j's block is the first keep[j] bytes at blk[j] (64 bytes
 * readable there), the byte 0x80 at mark[j] (none from 64 on), zeros, and
 * the message's bit length in the last two words where len_hi[j] and
 * len_lo[j] are not zero (the last block).  The states are stored word by
 * word: st[w][j] is word w of lane j. */
#define LANES 16
#define LANES_MAIN_BLOCKS 8
typedef struct {
    uint32_t st[5][LANES];
    uint32_t keep[LANES], mark[LANES], len_hi[LANES], len_lo[LANES];
    const uint8_t *blk[LANES];
} lane_blocks;
typedef void (*lanes_fn)(lane_blocks *lb, uint32_t main_st[5], const uint8_t *p, size_t nm, uint32_t after[][5]);

/* ---- portable ---------------------------------------------------------- */

static void blocks_portable(uint32_t st[5], const uint8_t *p, size_t n)
{
    uint32_t w[16];
    while (n--) {
        uint32_t a = st[0], b = st[1], c = st[2], d = st[3], e = st[4], f, k, t;
        for (int i = 0; i < 16; i++)
            w[i] = load_be32(p + 4 * i);
        for (int i = 0; i < 80; i++) {
            if (i >= 16)
                w[i & 15] = rol(w[(i + 13) & 15] ^ w[(i + 8) & 15] ^
                                w[(i + 2) & 15] ^ w[i & 15], 1);
            if (i < 20) { f = (b & c) | (~b & d); k = 0x5A827999; }
            else if (i < 40) { f = b ^ c ^ d; k = 0x6ED9EBA1; }
            else if (i < 60) { f = (b & c) | (b & d) | (c & d); k = 0x8F1BBCDC; }
            else { f = b ^ c ^ d; k = 0xCA62C1D6; }
            t = rol(a, 5) + f + e + k + w[i & 15];
            e = d; d = c; c = rol(b, 30); b = a; a = t;
        }
        st[0] += a; st[1] += b; st[2] += c; st[3] += d; st[4] += e;
        p += KVS_SHA1_BLOCK;
    }
}

/* ---- x86-64 SHA-NI ----------------------------------------------------- */

#if defined(KVS_HAVE_X86)
/* Four rounds per group; W[g] is the 4-word message vector of group g, kept
 * in a ring of four.  e for group g comes from the ABCD value before group
 * g-1 (sha1nexte rotates its A lane), hence `prev`. */
#define SHANI_SCHEDULE(g)                                                     \
    w[(g) & 3] = _mm_sha1msg2_epu32(                                          \
        _mm_xor_si128(_mm_sha1msg1_epu32(w[(g) & 3], w[((g) + 1) & 3]),       \
                      w[((g) + 2) & 3]),                                      \
        w[((g) + 3) & 3])
#define SHANI_GROUP(g, f)                                                     \
    do {                                                                      \
        e = _mm_sha1nexte_epu32(prev, w[(g) & 3]);                            \
        prev = abcd;                                                          \
        abcd = _mm_sha1rnds4_epu32(abcd, e, f);                               \
    } while (0)
#define SHANI_GROUP_S(g, f) do { SHANI_SCHEDULE(g); SHANI_GROUP(g, f); } while (0)
/* One block at p into (abcd, e0); needs bswap, w, e and prev in scope. */
#define SHANI_BLOCK(p)                                                        \
    do {                                                                      \
        __m128i abcd_save = abcd, e0_save = e0;                               \
        for (int i_ = 0; i_ < 4; i_++)                                        \
            w[i_] = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)((p) + 16 * i_)), bswap); \
        e = _mm_add_epi32(e0, w[0]);                                          \
        prev = abcd;                                                          \
        abcd = _mm_sha1rnds4_epu32(abcd, e, 0);                               \
        SHANI_GROUP(1, 0); SHANI_GROUP(2, 0); SHANI_GROUP(3, 0);              \
        SHANI_GROUP_S(4, 0);                                                  \
        SHANI_GROUP_S(5, 1); SHANI_GROUP_S(6, 1); SHANI_GROUP_S(7, 1);        \
        SHANI_GROUP_S(8, 1); SHANI_GROUP_S(9, 1);                             \
        SHANI_GROUP_S(10, 2); SHANI_GROUP_S(11, 2); SHANI_GROUP_S(12, 2);     \
        SHANI_GROUP_S(13, 2); SHANI_GROUP_S(14, 2);                           \
        SHANI_GROUP_S(15, 3); SHANI_GROUP_S(16, 3); SHANI_GROUP_S(17, 3);     \
        SHANI_GROUP_S(18, 3); SHANI_GROUP_S(19, 3);                           \
        e0 = _mm_sha1nexte_epu32(prev, e0_save);                              \
        abcd = _mm_add_epi32(abcd, abcd_save);                                \
    } while (0)

__attribute__((target("sha,sse4.1")))
static void blocks_shani(uint32_t st[5], const uint8_t *p, size_t n)
{
    const __m128i bswap = _mm_set_epi64x(0x0001020304050607LL, 0x08090a0b0c0d0e0fLL);
    __m128i abcd = _mm_shuffle_epi32(_mm_loadu_si128((const __m128i *)st), 0x1B);
    __m128i e0 = _mm_set_epi32((int)st[4], 0, 0, 0);
    __m128i w[4], e, prev;

    while (n--) {
        SHANI_BLOCK(p);
        p += KVS_SHA1_BLOCK;
    }
    _mm_storeu_si128((__m128i *)st, _mm_shuffle_epi32(abcd, 0x1B));
    st[4] = (uint32_t)_mm_extract_epi32(e0, 3);
}

/* Two independent messages at once.  sha1rnds4 has a latency of several
 * cycles but issues every one or two, so one message leaves the unit idle
 * most of the time; a second, interleaved message fills those slots.  The
 * prefix pass finishes its digests beside its main blocks with this. */
#define SHANI2_SCHEDULE(w, g)                                                 \
    w[(g) & 3] = _mm_sha1msg2_epu32(                                          \
        _mm_xor_si128(_mm_sha1msg1_epu32(w[(g) & 3], w[((g) + 1) & 3]),       \
                      w[((g) + 2) & 3]),                                      \
        w[((g) + 3) & 3])
#define SHANI2_GROUP(g, f)                                                    \
    do {                                                                      \
        if ((g) >= 4) { SHANI2_SCHEDULE(wa, g); SHANI2_SCHEDULE(wb, g); }     \
        ea = _mm_sha1nexte_epu32(preva, wa[(g) & 3]);                         \
        eb = _mm_sha1nexte_epu32(prevb, wb[(g) & 3]);                         \
        preva = a; prevb = b;                                                 \
        a = _mm_sha1rnds4_epu32(a, ea, f);                                    \
        b = _mm_sha1rnds4_epu32(b, eb, f);                                    \
    } while (0)

__attribute__((target("sha,sse4.1")))
static void blocks2_shani(uint32_t sa[5], const uint8_t *pa, uint32_t sb[5],
                          const uint8_t *pb, size_t n)
{
    const __m128i bswap = _mm_set_epi64x(0x0001020304050607LL, 0x08090a0b0c0d0e0fLL);
    __m128i a = _mm_shuffle_epi32(_mm_loadu_si128((const __m128i *)sa), 0x1B);
    __m128i b = _mm_shuffle_epi32(_mm_loadu_si128((const __m128i *)sb), 0x1B);
    __m128i ea0 = _mm_set_epi32((int)sa[4], 0, 0, 0), eb0 = _mm_set_epi32((int)sb[4], 0, 0, 0);
    __m128i wa[4], wb[4], ea, eb, preva, prevb;

    while (n--) {
        __m128i a_save = a, b_save = b, ea_save = ea0, eb_save = eb0;
        for (int i = 0; i < 4; i++) {
            wa[i] = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(pa + 16 * i)), bswap);
            wb[i] = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(pb + 16 * i)), bswap);
        }
        ea = _mm_add_epi32(ea0, wa[0]);
        eb = _mm_add_epi32(eb0, wb[0]);
        preva = a; prevb = b;
        a = _mm_sha1rnds4_epu32(a, ea, 0);
        b = _mm_sha1rnds4_epu32(b, eb, 0);
        SHANI2_GROUP(1, 0); SHANI2_GROUP(2, 0); SHANI2_GROUP(3, 0); SHANI2_GROUP(4, 0);
        SHANI2_GROUP(5, 1); SHANI2_GROUP(6, 1); SHANI2_GROUP(7, 1); SHANI2_GROUP(8, 1);
        SHANI2_GROUP(9, 1);
        SHANI2_GROUP(10, 2); SHANI2_GROUP(11, 2); SHANI2_GROUP(12, 2); SHANI2_GROUP(13, 2);
        SHANI2_GROUP(14, 2);
        SHANI2_GROUP(15, 3); SHANI2_GROUP(16, 3); SHANI2_GROUP(17, 3); SHANI2_GROUP(18, 3);
        SHANI2_GROUP(19, 3);
        ea0 = _mm_sha1nexte_epu32(preva, ea_save);
        eb0 = _mm_sha1nexte_epu32(prevb, eb_save);
        a = _mm_add_epi32(a, a_save);
        b = _mm_add_epi32(b, b_save);
        pa += KVS_SHA1_BLOCK; pb += KVS_SHA1_BLOCK;
    }
    _mm_storeu_si128((__m128i *)sa, _mm_shuffle_epi32(a, 0x1B));
    sa[4] = (uint32_t)_mm_extract_epi32(ea0, 3);
    _mm_storeu_si128((__m128i *)sb, _mm_shuffle_epi32(b, 0x1B));
    sb[4] = (uint32_t)_mm_extract_epi32(eb0, 3);
}

#if defined(KVS_HAVE_X86_VPCLMUL)
/* Sixteen messages at once, one per 32-bit lane of an AVX-512 register,
 * with plain SHA1 rounds (no SHA-NI).  A prefix lookup finishes one digest
 * per stored length, independent of one another, while its main pass is a
 * single chain of dependent SHA-NI blocks that leaves the vector units
 * idle; so each call also runs up to LANES_MAIN_BLOCKS blocks of the main
 * pass, which the out-of-order core overlaps with the lanes' rounds: on a
 * Zen 5 core a call of eight main blocks and sixteen lanes takes 292 ns,
 * the eight main blocks alone 266 ns, and sixteen finishing blocks two at
 * a time on SHA-NI 296 ns. */
#define X16_ROUND(i)                                                          \
    do {                                                                      \
        __m512i f_, k_, t_;                                                   \
        if ((i) >= 16)                                                        \
            xw[(i) & 15] = _mm512_rol_epi32(_mm512_ternarylogic_epi32(        \
                xw[((i) + 13) & 15], xw[((i) + 8) & 15],                      \
                _mm512_xor_si512(xw[((i) + 2) & 15], xw[(i) & 15]), 0x96), 1); \
        if ((i) < 20) { f_ = _mm512_ternarylogic_epi32(xb, xc, xd, 0xCA); k_ = _mm512_set1_epi32(0x5A827999); } \
        else if ((i) < 40) { f_ = _mm512_ternarylogic_epi32(xb, xc, xd, 0x96); k_ = _mm512_set1_epi32(0x6ED9EBA1); } \
        else if ((i) < 60) { f_ = _mm512_ternarylogic_epi32(xb, xc, xd, 0xE8); k_ = _mm512_set1_epi32(0x8F1BBCDC); } \
        else { f_ = _mm512_ternarylogic_epi32(xb, xc, xd, 0x96); k_ = _mm512_set1_epi32(0xCA62C1D6); } \
        t_ = _mm512_add_epi32(_mm512_add_epi32(xe, _mm512_add_epi32(xw[(i) & 15], k_)),         \
                              _mm512_add_epi32(f_, _mm512_rol_epi32(xa, 5)));                   \
        xe = xd; xd = xc; xc = _mm512_rol_epi32(xb, 30); xb = xa; xa = t_;  \
    } while (0)
#define X16_ROUNDS10(r)                                                       \
    X16_ROUND((r) + 0); X16_ROUND((r) + 1); X16_ROUND((r) + 2); X16_ROUND((r) + 3); X16_ROUND((r) + 4); \
    X16_ROUND((r) + 5); X16_ROUND((r) + 6); X16_ROUND((r) + 7); X16_ROUND((r) + 8); X16_ROUND((r) + 9)
/* Main block c (if the call has it) beside lane rounds 10c..10c+9. */
#define LANES_CHUNK(c)                                                        \
    do {                                                                      \
        if ((size_t)(c) < nm) {                                               \
            SHANI_BLOCK(p + KVS_SHA1_BLOCK * (c));                            \
            _mm_storeu_si128((__m128i *)after[c], _mm_shuffle_epi32(abcd, 0x1B)); \
            after[c][4] = (uint32_t)_mm_extract_epi32(e0, 3);                \
        }                                                                     \
        X16_ROUNDS10(10 * (c));                                               \
    } while (0)

/* The register arrays below stay in registers only when their loops are
 * unrolled, which -O2 does not do by itself. */
#define LANES_UNROLL _Pragma("GCC unroll 16")

/* The 16 blocks as 16 message-word vectors: a 16x16 transpose of 32-bit
 * words, each word from big-endian, then the padding (see lane_blocks). */
__attribute__((target("avx512f")))
static void load_lanes(__m512i xw[16], const lane_blocks *lb)
{
    const __m512i low = _mm512_set1_epi32(0x00FF00FF), ones = _mm512_set1_epi32(-1);
    const __m512i top = _mm512_set1_epi32((int)0x80000000u), zero = _mm512_setzero_si512();
    const __m512i keep = _mm512_loadu_si512(lb->keep), mark = _mm512_loadu_si512(lb->mark);
    __m512i r[16], t[16];

    LANES_UNROLL for (int j = 0; j < 16; j++)
        r[j] = _mm512_loadu_si512(lb->blk[j]);
    LANES_UNROLL for (int j = 0; j < 16; j += 2) {
        t[j] = _mm512_unpacklo_epi32(r[j], r[j + 1]);
        t[j + 1] = _mm512_unpackhi_epi32(r[j], r[j + 1]);
    }
    LANES_UNROLL for (int j = 0; j < 16; j += 4) {
        r[j] = _mm512_unpacklo_epi64(t[j], t[j + 2]);
        r[j + 1] = _mm512_unpackhi_epi64(t[j], t[j + 2]);
        r[j + 2] = _mm512_unpacklo_epi64(t[j + 1], t[j + 3]);
        r[j + 3] = _mm512_unpackhi_epi64(t[j + 1], t[j + 3]);
    }
    /* r[4k + i] holds, in 128-bit lane L, word 4L + i of blocks 4k..4k+3. */
    LANES_UNROLL for (int i = 0; i < 4; i++) {
        __m512i x0 = _mm512_shuffle_i32x4(r[i], r[4 + i], 0x44), x1 = _mm512_shuffle_i32x4(r[i], r[4 + i], 0xEE);
        __m512i y0 = _mm512_shuffle_i32x4(r[8 + i], r[12 + i], 0x44), y1 = _mm512_shuffle_i32x4(r[8 + i], r[12 + i], 0xEE);
        t[i] = _mm512_shuffle_i32x4(x0, y0, 0x88);
        t[4 + i] = _mm512_shuffle_i32x4(x0, y0, 0xDD);
        t[8 + i] = _mm512_shuffle_i32x4(x1, y1, 0x88);
        t[12 + i] = _mm512_shuffle_i32x4(x1, y1, 0xDD);
    }
    /* Word i keeps its first keep - 4i bytes (the high ones once
     * big-endian) and takes the 0x80 at byte mark - 4i; shifts of 32 or
     * more (a negative count included) give 0. */
    LANES_UNROLL for (int i = 0; i < 16; i++) {
        __m512i w = _mm512_ternarylogic_epi32(low, _mm512_rol_epi32(t[i], 8), _mm512_rol_epi32(t[i], 24), 0xCA);
        __m512i kept = _mm512_max_epi32(_mm512_sub_epi32(keep, _mm512_set1_epi32(4 * i)), zero);
        __m512i at = _mm512_slli_epi32(_mm512_sub_epi32(mark, _mm512_set1_epi32(4 * i)), 3);
        xw[i] = _mm512_or_si512(_mm512_andnot_si512(_mm512_srlv_epi32(ones, _mm512_slli_epi32(kept, 3)), w),
                                _mm512_srlv_epi32(top, at));
    }
    xw[14] = _mm512_or_si512(xw[14], _mm512_loadu_si512(lb->len_hi));
    xw[15] = _mm512_or_si512(xw[15], _mm512_loadu_si512(lb->len_lo));
}

/* One final block of each lane (see lane_blocks) and nm <=
 * LANES_MAIN_BLOCKS blocks of the main pass (p into main_st, the state
 * after block c into after[c]). */
__attribute__((target("sha,sse4.1,avx512f")))
static void lanes_avx512(lane_blocks *lb, uint32_t main_st[5], const uint8_t *p, size_t nm, uint32_t after[][5])
{
    const __m128i bswap = _mm_set_epi64x(0x0001020304050607LL, 0x08090a0b0c0d0e0fLL);
    __m128i abcd = _mm_shuffle_epi32(_mm_loadu_si128((const __m128i *)main_st), 0x1B);
    __m128i e0 = _mm_set_epi32((int)main_st[4], 0, 0, 0);
    __m128i w[4], e, prev;
    uint32_t (*st)[LANES] = lb->st;
    __m512i xw[16], xa, xb, xc, xd, xe, x0[5];

    load_lanes(xw, lb);
    xa = x0[0] = _mm512_loadu_si512(st[0]);
    xb = x0[1] = _mm512_loadu_si512(st[1]);
    xc = x0[2] = _mm512_loadu_si512(st[2]);
    xd = x0[3] = _mm512_loadu_si512(st[3]);
    xe = x0[4] = _mm512_loadu_si512(st[4]);
    LANES_CHUNK(0); LANES_CHUNK(1); LANES_CHUNK(2); LANES_CHUNK(3);
    LANES_CHUNK(4); LANES_CHUNK(5); LANES_CHUNK(6); LANES_CHUNK(7);
    _mm512_storeu_si512(st[0], _mm512_add_epi32(xa, x0[0]));
    _mm512_storeu_si512(st[1], _mm512_add_epi32(xb, x0[1]));
    _mm512_storeu_si512(st[2], _mm512_add_epi32(xc, x0[2]));
    _mm512_storeu_si512(st[3], _mm512_add_epi32(xd, x0[3]));
    _mm512_storeu_si512(st[4], _mm512_add_epi32(xe, x0[4]));
    if (nm)
        memcpy(main_st, after[nm - 1], 5 * sizeof(uint32_t));
}
#endif
#endif

/* ---- ARMv8 SHA1 instructions ------------------------------------------- */

#if defined(KVS_HAVE_ARM_SHA1)
/* Group g applies four rounds with sha1c (g < 5), sha1p, sha1m (10..14) or
 * sha1p; the e input of group g is sha1h of the A lane before group g-1. */
#define ARM_SCHEDULE(g)                                                       \
    w[(g) & 3] = vsha1su1q_u32(                                               \
        vsha1su0q_u32(w[(g) & 3], w[((g) + 1) & 3], w[((g) + 2) & 3]),        \
        w[((g) + 3) & 3])
#define ARM_GROUP(g, op, k)                                                   \
    do {                                                                      \
        uint32_t e_next = vsha1h_u32(vgetq_lane_u32(abcd, 0));                \
        abcd = op(abcd, e, vaddq_u32(w[(g) & 3], k));                         \
        e = e_next;                                                           \
    } while (0)
#define ARM_GROUP_S(g, op, k) do { ARM_SCHEDULE(g); ARM_GROUP(g, op, k); } while (0)

static void blocks_armv8(uint32_t st[5], const uint8_t *p, size_t n)
{
    const uint32x4_t k0 = vdupq_n_u32(0x5A827999), k1 = vdupq_n_u32(0x6ED9EBA1);
    const uint32x4_t k2 = vdupq_n_u32(0x8F1BBCDC), k3 = vdupq_n_u32(0xCA62C1D6);
    uint32x4_t abcd = vld1q_u32(st);
    uint32_t e0 = st[4];

    while (n--) {
        uint32x4_t abcd_save = abcd, w[4];
        uint32_t e = e0;
        for (int i = 0; i < 4; i++)
            w[i] = vreinterpretq_u32_u8(vrev32q_u8(vld1q_u8(p + 16 * i)));
        ARM_GROUP(0, vsha1cq_u32, k0); ARM_GROUP(1, vsha1cq_u32, k0);
        ARM_GROUP(2, vsha1cq_u32, k0); ARM_GROUP(3, vsha1cq_u32, k0);
        ARM_GROUP_S(4, vsha1cq_u32, k0);
        ARM_GROUP_S(5, vsha1pq_u32, k1); ARM_GROUP_S(6, vsha1pq_u32, k1);
        ARM_GROUP_S(7, vsha1pq_u32, k1); ARM_GROUP_S(8, vsha1pq_u32, k1);
        ARM_GROUP_S(9, vsha1pq_u32, k1);
        ARM_GROUP_S(10, vsha1mq_u32, k2); ARM_GROUP_S(11, vsha1mq_u32, k2);
        ARM_GROUP_S(12, vsha1mq_u32, k2); ARM_GROUP_S(13, vsha1mq_u32, k2);
        ARM_GROUP_S(14, vsha1mq_u32, k2);
        ARM_GROUP_S(15, vsha1pq_u32, k3); ARM_GROUP_S(16, vsha1pq_u32, k3);
        ARM_GROUP_S(17, vsha1pq_u32, k3); ARM_GROUP_S(18, vsha1pq_u32, k3);
        ARM_GROUP_S(19, vsha1pq_u32, k3);
        abcd = vaddq_u32(abcd, abcd_save);
        e0 += e;
        p += KVS_SHA1_BLOCK;
    }
    vst1q_u32(st, abcd);
    st[4] = e0;
}
#endif

/* ---- dispatch ---------------------------------------------------------- */

typedef void (*blocks2_fn)(uint32_t sa[5], const uint8_t *pa, uint32_t sb[5],
                           const uint8_t *pb, size_t n);

/* Two messages, one after the other: the fallback where no lane-parallel
 * kernel exists. */
static blocks_fn sha1_blocks_fn;
static void blocks2_serial(uint32_t sa[5], const uint8_t *pa, uint32_t sb[5],
                           const uint8_t *pb, size_t n)
{
    sha1_blocks_fn(sa, pa, n);
    sha1_blocks_fn(sb, pb, n);
}

static blocks_fn sha1_blocks_fn = blocks_portable;
static blocks2_fn sha1_blocks2_fn = blocks2_serial;
static lanes_fn sha1_lanes_fn;           /* NULL: the prefix pass uses two lanes */
static const char *sha1_name = "portable";

int kvs_sha1_has(int impl)
{
    switch (impl) {
    case KVS_IMPL_AUTO:
    case KVS_IMPL_PORTABLE: return 1;
#if defined(KVS_HAVE_X86)
    case KVS_IMPL_X86: return kvs_cpu_has_shani();
#endif
#if defined(KVS_HAVE_ARM_SHA1)
    case KVS_IMPL_ARM: return kvs_cpu_has_arm_sha1();
#endif
    default: return 0;
    }
}

int kvs_sha1_select(int impl)
{
    if (impl == KVS_IMPL_AUTO) {
        if (kvs_sha1_has(KVS_IMPL_X86)) impl = KVS_IMPL_X86;
        else if (kvs_sha1_has(KVS_IMPL_ARM)) impl = KVS_IMPL_ARM;
        else impl = KVS_IMPL_PORTABLE;
    }
    if (!kvs_sha1_has(impl))
        return -1;
    sha1_lanes_fn = NULL;
    switch (impl) {
#if defined(KVS_HAVE_X86)
    case KVS_IMPL_X86:
        sha1_blocks_fn = blocks_shani; sha1_blocks2_fn = blocks2_shani; sha1_name = "sha-ni";
#if defined(KVS_HAVE_X86_VPCLMUL)
        /* The lanes need AVX-512F and the OS's ZMM state.  Asking for
         * VPCLMULQDQ too keeps them to the cores (Ice Lake, Zen 4 and later)
         * that run 512-bit code without dropping their clock much. */
        if (kvs_cpu_has_avx512_vpclmul())
            sha1_lanes_fn = lanes_avx512;
#endif
        break;
#endif
#if defined(KVS_HAVE_ARM_SHA1)
    case KVS_IMPL_ARM:
        sha1_blocks_fn = blocks_armv8; sha1_blocks2_fn = blocks2_serial; sha1_name = "armv8"; break;
#endif
    default:
        sha1_blocks_fn = blocks_portable; sha1_blocks2_fn = blocks2_serial; sha1_name = "portable"; break;
    }
    return 0;
}

const char *kvs_sha1_impl_name(void) { return sha1_name; }

void kvs_sha1_blocks(uint32_t state[5], const uint8_t *p, size_t nblocks)
{
    sha1_blocks_fn(state, p, nblocks);
}

/* ---- streaming --------------------------------------------------------- */

static const uint32_t sha1_iv[5] = {0x67452301, 0xEFCDAB89, 0x98BADCFE, 0x10325476, 0xC3D2E1F0};

void kvs_sha1_begin(kvs_sha1_ctx *ctx)
{
    memcpy(ctx->state, sha1_iv, sizeof sha1_iv);
    ctx->total = 0;
    ctx->buflen = 0;
}

void kvs_sha1_update(kvs_sha1_ctx *ctx, const uint8_t *data, size_t len)
{
    ctx->total += len;
    if (ctx->buflen) {
        size_t take = KVS_SHA1_BLOCK - ctx->buflen;
        if (take > len) take = len;
        memcpy(ctx->buf + ctx->buflen, data, take);
        ctx->buflen += take; data += take; len -= take;
        if (ctx->buflen < KVS_SHA1_BLOCK) return;
        sha1_blocks_fn(ctx->state, ctx->buf, 1);
        ctx->buflen = 0;
    }
    if (len >= KVS_SHA1_BLOCK) {
        size_t nb = len / KVS_SHA1_BLOCK;
        sha1_blocks_fn(ctx->state, data, nb);
        data += nb * KVS_SHA1_BLOCK; len -= nb * KVS_SHA1_BLOCK;
    }
    memcpy(ctx->buf, data, len);
    ctx->buflen = len;
}

/* A finished-but-not-compressed digest: the state so far and the padded
 * final block(s).  Kept apart so that two can be compressed together.
 * With outer set it is the inner hash of an HMAC: once compressed, the same
 * slot turns into the outer hash of that digest (one more block), so the
 * outer hashes ride the two lanes beside the main pass as the inner ones do. */
typedef struct {
    uint32_t st[5];
    uint8_t tail[2 * KVS_SHA1_BLOCK];
    size_t blocks;              /* 1 or 2 padded blocks */
    size_t done;                /* of which already compressed */
    uint8_t *out;
    const uint32_t *outer;      /* an HMAC key's outer state, or NULL */
} pending_digest;

/* keep_first + 64 - n: n bytes of 0xFF, then zeros; end_mark + 64 - n: the
 * byte 0x80 at n.  A padded block is then one fixed-size pass over 64
 * bytes: a memcpy and a memset of n bytes cost more, once per length. */
static const uint8_t keep_first[2 * KVS_SHA1_BLOCK] = {
    255, 255, 255, 255, 255, 255, 255, 255, 255, 255, 255, 255, 255, 255, 255, 255,
    255, 255, 255, 255, 255, 255, 255, 255, 255, 255, 255, 255, 255, 255, 255, 255,
    255, 255, 255, 255, 255, 255, 255, 255, 255, 255, 255, 255, 255, 255, 255, 255,
    255, 255, 255, 255, 255, 255, 255, 255, 255, 255, 255, 255, 255, 255, 255, 255,
};
static const uint8_t end_mark[2 * KVS_SHA1_BLOCK] = {[KVS_SHA1_BLOCK] = 0x80};

/* Pads the last n (< 64) bytes of a message of len bytes whose whole
 * blocks are already in st.  block holds 64 readable bytes, the first n of
 * them the message's. */
static inline void pad_block(const uint32_t st[5], const uint8_t *block, size_t n, uint64_t len,
                             pending_digest *pd, uint8_t *out)
{
    const uint8_t *keep = keep_first + KVS_SHA1_BLOCK - n, *mark = end_mark + KVS_SHA1_BLOCK - n;
    uint64_t bits = len * 8;
    uint8_t *end;

    memcpy(pd->st, st, sizeof pd->st);
    /* Eight bytes at a time (AND and OR act on each byte alike, whatever
     * the byte order). */
    for (int i = 0; i < KVS_SHA1_BLOCK; i += 8) {
        uint64_t b, k, m;
        memcpy(&b, block + i, 8);
        memcpy(&k, keep + i, 8);
        memcpy(&m, mark + i, 8);
        b = (b & k) | m;
        memcpy(pd->tail + i, &b, 8);
    }
    pd->blocks = n + 1 + 8 <= KVS_SHA1_BLOCK ? 1 : 2;
    if (pd->blocks == 2)
        memset(pd->tail + KVS_SHA1_BLOCK, 0, KVS_SHA1_BLOCK);
    end = pd->tail + pd->blocks * KVS_SHA1_BLOCK;
    store_be32(end - 8, (uint32_t)(bits >> 32));
    store_be32(end - 4, (uint32_t)bits);
    pd->done = 0;
    pd->out = out;
    pd->outer = NULL;
}

/* pad_block for a tail with only its n bytes readable. */
static void pad_tail(const uint32_t st[5], const uint8_t *tail, size_t n, uint64_t len,
                     pending_digest *pd, uint8_t *out)
{
    uint8_t block[KVS_SHA1_BLOCK] = {0};

    memcpy(block, tail, n);
    pad_block(st, block, n, len, pd, out);
}

static inline void emit(const pending_digest *pd)
{
    for (int i = 0; i < 5; i++)
        store_be32(pd->out + 4 * i, pd->st[i]);
}

/* A slot whose blocks are all compressed: emits its digest and returns 1,
 * or, the inner hash of an HMAC, becomes the outer hash and returns 0. */
static inline int complete(pending_digest *pd)
{
    uint8_t inner[KVS_SHA1_BLOCK];

    if (!pd->outer) {
        emit(pd);
        return 1;
    }
    memset(inner, 0, sizeof inner);
    for (int i = 0; i < 5; i++)
        store_be32(inner + 4 * i, pd->st[i]);
    pad_block(pd->outer, inner, KVS_SHA1_DIGEST, KVS_SHA1_BLOCK + KVS_SHA1_DIGEST, pd, pd->out);
    return 0;
}

static void finish_one(pending_digest *pd)
{
    do {
        sha1_blocks_fn(pd->st, pd->tail + KVS_SHA1_BLOCK * pd->done, pd->blocks - pd->done);
        pd->done = pd->blocks;
    } while (!complete(pd));
}

void kvs_sha1_digest(const kvs_sha1_ctx *ctx, uint8_t out[KVS_SHA1_DIGEST])
{
    pending_digest pd;
    pad_tail(ctx->state, ctx->buf, ctx->buflen, ctx->total, &pd, out);
    finish_one(&pd);
}

void kvs_sha1(const uint8_t *data, size_t len, uint8_t out[KVS_SHA1_DIGEST])
{
    kvs_sha1_ctx ctx;
    kvs_sha1_begin(&ctx);
    kvs_sha1_update(&ctx, data, len);
    kvs_sha1_digest(&ctx, out);
}

/* ---- HMAC-SHA1 ------------------------------------------------------------ */

void kvs_hmac_sha1_key(kvs_hmac_key *k, const uint8_t *key, size_t len)
{
    uint8_t block[KVS_SHA1_BLOCK], pad[KVS_SHA1_BLOCK];

    memset(block, 0, sizeof block);
    if (len > KVS_SHA1_BLOCK)
        kvs_sha1(key, len, block);
    else if (len)
        memcpy(block, key, len);
    for (int i = 0; i < KVS_SHA1_BLOCK; i++) pad[i] = block[i] ^ 0x36;
    memcpy(k->inner, sha1_iv, sizeof sha1_iv);
    sha1_blocks_fn(k->inner, pad, 1);
    for (int i = 0; i < KVS_SHA1_BLOCK; i++) pad[i] = block[i] ^ 0x5c;
    memcpy(k->outer, sha1_iv, sizeof sha1_iv);
    sha1_blocks_fn(k->outer, pad, 1);
}

/* A keyed hash starts after the key's block: the state and the byte count. */
static void keyed_begin(kvs_sha1_ctx *ctx, const kvs_hmac_key *key)
{
    kvs_sha1_begin(ctx);
    if (key) {
        memcpy(ctx->state, key->inner, sizeof ctx->state);
        ctx->total = KVS_SHA1_BLOCK;
    }
}

/* The outer hash: digest (the inner hash) becomes HMAC-SHA1, in place. */
static void hmac_outer(const kvs_hmac_key *key, uint8_t digest[KVS_SHA1_DIGEST])
{
    pending_digest pd;
    pad_tail(key->outer, digest, KVS_SHA1_DIGEST, KVS_SHA1_BLOCK + KVS_SHA1_DIGEST, &pd, digest);
    finish_one(&pd);
}

void kvs_hmac_sha1_outer(const kvs_hmac_key *k, const uint8_t inner[KVS_SHA1_DIGEST], uint8_t out[KVS_SHA1_DIGEST])
{
    memmove(out, inner, KVS_SHA1_DIGEST);
    hmac_outer(k, out);
}

/* A node's lookup tag (KVS_LOOKUP_TAG bytes) lets its inner hash stand in
 * for its digest: all zero means none (the node is always confirmed). */
static int tag_rules_out(const uint8_t *tag, const uint8_t inner[KVS_SHA1_DIGEST])
{
    static const uint8_t none[KVS_LOOKUP_TAG];
    return memcmp(tag, none, KVS_LOOKUP_TAG) != 0 && memcmp(tag, inner, KVS_LOOKUP_TAG) != 0;
}

void kvs_hmac_sha1(const kvs_hmac_key *k, const uint8_t *data, size_t len, uint8_t out[KVS_SHA1_DIGEST])
{
    kvs_sha1_ctx ctx;
    keyed_begin(&ctx, k);
    kvs_sha1_update(&ctx, data, len);
    kvs_sha1_digest(&ctx, out);
    hmac_outer(k, out);
}

/* Sorts indices by length: an LSD radix sort on packed (length, index)
 * keys, one byte of the length per pass (three passes for a 400 KB prompt),
 * using the caller's digest buffer as the second key array.  Where a key
 * does not fit in 64 bits (a prompt over 16 TiB or over a million lengths)
 * an indirect heapsort runs instead.  No allocation either way. */
#define PACK_INDEX_BITS 20

static void sift_down(size_t *a, const uint64_t *key, size_t root, size_t end)
{
    for (;;) {
        size_t child = 2 * root + 1;
        if (child >= end) return;
        if (child + 1 < end && key[a[child + 1]] > key[a[child]]) child++;
        if (key[a[root]] >= key[a[child]]) return;
        size_t t = a[root]; a[root] = a[child]; a[child] = t;
        root = child;
    }
}

static void sort_by_length(size_t *order, const uint64_t *lengths, size_t n, uint8_t *scratch)
{
    uint64_t max = 0;
    for (size_t i = 0; i < n; i++)
        if (lengths[i] > max) max = lengths[i];
    if (sizeof(size_t) == sizeof(uint64_t) && n <= ((size_t)1 << PACK_INDEX_BITS)
        && max < ((uint64_t)1 << (64 - PACK_INDEX_BITS))) {
        uint64_t *a = (uint64_t *)(void *)order, *b = (uint64_t *)(void *)scratch, *t;
        size_t count[256];
        for (size_t i = 0; i < n; i++) a[i] = lengths[i] << PACK_INDEX_BITS | i;
        for (int shift = PACK_INDEX_BITS; (max << PACK_INDEX_BITS) >> shift; shift += 8) {
            memset(count, 0, sizeof count);
            for (size_t i = 0; i < n; i++) count[(a[i] >> shift) & 255]++;
            for (size_t k = 0, sum = 0; k < 256; k++) { size_t c = count[k]; count[k] = sum; sum += c; }
            for (size_t i = 0; i < n; i++) b[count[(a[i] >> shift) & 255]++] = a[i];
            t = a; a = b; b = t;
        }
        for (size_t i = 0; i < n; i++)
            order[i] = (size_t)(a[i] & (((uint64_t)1 << PACK_INDEX_BITS) - 1));
        return;
    }
    for (size_t i = 0; i < n; i++) order[i] = i;
    for (size_t i = n / 2; i-- > 0;) sift_down(order, lengths, i, n);
    for (size_t end = n; end-- > 1;) {
        size_t t = order[0]; order[0] = order[end]; order[end] = t;
        sift_down(order, lengths, 0, end);
    }
}

/* The jobs of a prefix pass: one per distinct length, in ascending order
 * (order[0..n)).  When the main pass has hashed all of a length's whole
 * blocks it parks that state in the length's own output slot (20 bytes:
 * the five state words), so waiting jobs need no memory of their own; a
 * lane later pads the job's last partial block from data and finishes it. */
typedef struct {
    const uint8_t *data;
    size_t len;
    const uint64_t *lengths;
    const size_t *order;
    size_t n;
    size_t next;                /* the first job not started */
    size_t parked;              /* jobs [next, parked) wait for a lane */
    uint8_t *out;
    uint64_t head;              /* bytes hashed before data (an HMAC key's block) */
    const uint32_t *outer;      /* an HMAC key's outer state, or NULL */
} job_queue;

/* Starts the next parked job in lane pd and returns 1, or returns 0 when
 * none waits.  A length equal to the one before it is no job of its own:
 * its digest is copied after the pass. */
static inline int start_job(job_queue *q, pending_digest *pd)
{
    for (; q->next < q->parked; q->next++) {
        size_t i = q->next, k = q->order[i];
        uint64_t want = q->lengths[k], whole = want - want % KVS_SHA1_BLOCK;
        uint32_t st[5];
        if (i && q->lengths[q->order[i - 1]] == want)
            continue;
        memcpy(st, q->out + KVS_SHA1_DIGEST * k, sizeof st);
        if (whole + KVS_SHA1_BLOCK <= q->len)
            pad_block(st, q->data + whole, (size_t)(want - whole), q->head + want, pd, q->out + KVS_SHA1_DIGEST * k);
        else            /* the data's last bytes: copied to a block first */
            pad_tail(st, q->data + whole, (size_t)(want - whole), q->head + want, pd, q->out + KVS_SHA1_DIGEST * k);
        pd->outer = q->outer;
        q->next++;
        return 1;
    }
    return 0;
}

/* Compresses m blocks of lane pd; returns 1 when its job is finished. */
static int lane_step2(uint32_t st[5], const uint8_t *p, pending_digest *pd, size_t m)
{
    sha1_blocks2_fn(st, p, pd->st, pd->tail + KVS_SHA1_BLOCK * pd->done, m);
    pd->done += m;
    return pd->done == pd->blocks && complete(pd);
}

/* Finishes every job still waiting, two lanes at a time, each lane taking
 * the next job as soon as its own is done (a two-block job beside
 * one-block ones wastes no lane).  lane[0] may hold a job already. */
static void drain_jobs(job_queue *q, pending_digest lane[2], int busy0)
{
    int busy[2] = {busy0, 0};

    for (;;) {
        for (int j = 0; j < 2; j++)
            if (!busy[j])
                busy[j] = start_job(q, &lane[j]);
        if (busy[0] && busy[1]) {
            size_t la = lane[0].blocks - lane[0].done, lb = lane[1].blocks - lane[1].done;
            size_t m = la < lb ? la : lb;
            busy[1] = !lane_step2(lane[0].st, lane[0].tail + KVS_SHA1_BLOCK * lane[0].done, &lane[1], m);
            lane[0].done += m;
            busy[0] = !(lane[0].done == lane[0].blocks && complete(&lane[0]));
        } else if (busy[0] || busy[1]) {
            finish_one(&lane[busy[0] ? 0 : 1]);     /* the last job */
            return;
        } else {
            return;
        }
    }
}

/* Parks every length whose whole blocks are the first `done` (hashed into st). */
static inline void park(job_queue *q, const uint32_t st[5], uint64_t done)
{
    while (q->parked < q->n && q->lengths[q->order[q->parked]] / KVS_SHA1_BLOCK == done) {
        memcpy(q->out + KVS_SHA1_DIGEST * q->order[q->parked], st, KVS_SHA1_DIGEST);
        q->parked++;
    }
}

/* The main pass, a chain of dependent blocks, leaves the block unit idle
 * most of the time (see blocks2_shani): each main block is compressed
 * beside a block of a parked job, so the finishing blocks ride along for
 * little more than the pass alone.  Returns with lane[0] holding a job
 * (1) or not (0); the jobs left over wait in q. */
static int main_pass(job_queue *q, uint32_t st[5], pending_digest lane[2])
{
    const uint8_t *p = q->data;
    uint64_t done = 0;          /* whole blocks hashed into st */
    int busy = 0;

    for (;;) {
        park(q, st, done);
        if (q->parked == q->n)
            return busy;
        uint64_t gap = q->lengths[q->order[q->parked]] / KVS_SHA1_BLOCK - done;
        if (!busy)
            busy = start_job(q, &lane[0]);
        if (!busy) {            /* nothing waits: the main pass alone up to the next cut */
            sha1_blocks_fn(st, p, (size_t)gap);
            p += KVS_SHA1_BLOCK * gap;
            done += gap;
            continue;
        }
        size_t m = lane[0].blocks - lane[0].done;
        if (m > gap) m = (size_t)gap;
        busy = !lane_step2(st, p, &lane[0], m);
        p += KVS_SHA1_BLOCK * m;
        done += m;
    }
}

/* ---- the wide pass: a lanes kernel (16 jobs a call) beside the main pass */

/* A lane's job: which block of it the lanes take next. */
enum { LANE_LAST = 0, LANE_SECOND, LANE_OUTER };

/* The jobs in the lanes (their blocks and states in lb). */
typedef struct {
    lane_blocks lb;
    uint8_t *out[LANES];
    uint64_t bits[LANES];           /* the message's length in bits, for a second padding block */
    uint8_t next[LANES];            /* after this block: LANE_LAST (done) or the block that follows */
    uint8_t buf[LANES][KVS_SHA1_BLOCK];  /* a copy of the data's last bytes, or an HMAC's inner hash */
    uint32_t busy;                  /* bit j: lane j holds a job */
} lane_set;

static const uint8_t zero_block[KVS_SHA1_BLOCK];

static void lane_block(lane_set *ls, int j, const uint8_t *blk, uint32_t keep, uint32_t mark, uint64_t bits)
{
    ls->lb.blk[j] = blk;
    ls->lb.keep[j] = keep;
    ls->lb.mark[j] = mark;
    ls->lb.len_hi[j] = (uint32_t)(bits >> 32);
    ls->lb.len_lo[j] = (uint32_t)bits;
}

/* Starts the next parked job in lane j; returns 0 when none waits. */
static int lane_start(job_queue *q, lane_set *ls, int j)
{
    for (; q->next < q->parked; q->next++) {
        size_t i = q->next, k = q->order[i];
        uint64_t want = q->lengths[k], whole = want - want % KVS_SHA1_BLOCK, bits = 8 * (q->head + want);
        uint32_t n = (uint32_t)(want - whole), st[5];
        const uint8_t *blk = q->data + whole;
        int two = n + 1 + 8 > KVS_SHA1_BLOCK;

        if (i && q->lengths[q->order[i - 1]] == want)
            continue;
        if (whole + KVS_SHA1_BLOCK > q->len) {      /* the data's last bytes */
            memcpy(ls->buf[j], blk, n);
            blk = ls->buf[j];
        }
        memcpy(st, q->out + KVS_SHA1_DIGEST * k, sizeof st);
        for (int w = 0; w < 5; w++)
            ls->lb.st[w][j] = st[w];
        lane_block(ls, j, blk, n, n, two ? 0 : bits);
        ls->out[j] = q->out + KVS_SHA1_DIGEST * k;
        ls->bits[j] = bits;
        ls->next[j] = two ? LANE_SECOND : q->outer ? LANE_OUTER : LANE_LAST;
        ls->busy |= 1u << j;
        q->next++;
        return 1;
    }
    return 0;
}

/* Lane j's block is done: sets up the one that follows, or writes its
 * digest and frees the lane. */
static void lane_advance(job_queue *q, lane_set *ls, int j)
{
    uint32_t (*st)[LANES] = ls->lb.st;

    switch (ls->next[j]) {
    case LANE_SECOND:
        lane_block(ls, j, zero_block, 0, KVS_SHA1_BLOCK, ls->bits[j]);
        ls->next[j] = q->outer ? LANE_OUTER : LANE_LAST;
        return;
    case LANE_OUTER:            /* HMAC: the outer hash of the inner one */
        for (int w = 0; w < 5; w++) {
            store_be32(ls->buf[j] + 4 * w, st[w][j]);
            st[w][j] = q->outer[w];
        }
        lane_block(ls, j, ls->buf[j], KVS_SHA1_DIGEST, KVS_SHA1_DIGEST, 8 * (KVS_SHA1_BLOCK + KVS_SHA1_DIGEST));
        ls->next[j] = LANE_LAST;
        return;
    default:
        for (int w = 0; w < 5; w++)
            store_be32(ls->out[j] + 4 * w, st[w][j]);
        ls->busy &= ~(1u << j);
        lane_block(ls, j, zero_block, 0, KVS_SHA1_BLOCK, 0);
    }
}

/* One lanes call: the jobs waiting go into the free lanes, then a block of
 * every busy lane and nm blocks of the main pass (st, at p, `done` blocks
 * in), parking the lengths those reach.  Returns 0, doing nothing, when no
 * lane is busy. */
static int lanes_call(job_queue *q, lane_set *ls, uint32_t st[5], const uint8_t *p, uint64_t done, size_t nm)
{
    uint32_t after[LANES_MAIN_BLOCKS][5];

    for (int j = 0; j < LANES; j++)
        if (!(ls->busy >> j & 1) && !lane_start(q, ls, j))
            break;
    if (!ls->busy)
        return 0;
    sha1_lanes_fn(&ls->lb, st, p, nm, after);
    for (size_t c = 0; c < nm; c++)
        park(q, after[c], done + c + 1);
    for (int j = 0; j < LANES; j++)
        if (ls->busy >> j & 1)
            lane_advance(q, ls, j);
    return 1;
}

/* The main pass in steps of LANES_MAIN_BLOCKS blocks, each beside a block
 * of every job in the lanes, so that finishing the digests costs little
 * more than the main pass; then the jobs left over. */
static void wide_pass(job_queue *q, uint32_t st[5], lane_set *ls)
{
    const uint8_t *p = q->data;
    uint64_t done = 0, last = q->lengths[q->order[q->n - 1]] / KVS_SHA1_BLOCK;

    for (int j = 0; j < LANES; j++)
        lane_block(ls, j, zero_block, 0, KVS_SHA1_BLOCK, 0);
    park(q, st, 0);
    while (done < last) {
        size_t nm = last - done < LANES_MAIN_BLOCKS ? (size_t)(last - done) : LANES_MAIN_BLOCKS;
        if (!lanes_call(q, ls, st, p, done, nm)) {      /* nothing waits: the main pass alone up to the next cut */
            nm = (size_t)(q->lengths[q->order[q->parked]] / KVS_SHA1_BLOCK - done);
            sha1_blocks_fn(st, p, nm);
            park(q, st, done + nm);
        }
        p += KVS_SHA1_BLOCK * nm;
        done += nm;
    }
    while (lanes_call(q, ls, st, NULL, 0, 0))
        ;
}

/* The lanes pay where the lengths are dense: with fewer than about five
 * per four blocks of the longest, each finishing block rides beside a main
 * block in the two-lane pass for as little (measured on Zen 5, 400 KB). */
#define LANES_MIN_PER_4_BLOCKS 5

static int dense(const uint64_t *lengths, const size_t *order, size_t n)
{
    uint64_t blocks = lengths[order[n - 1]] / KVS_SHA1_BLOCK;
    return n / LANES_MIN_PER_4_BLOCKS >= blocks / 4;
}

size_t kvs_sha1_prefixes(const uint8_t *data, size_t len,
                         const uint64_t *lengths, size_t n,
                         size_t *order, uint8_t *out)
{
    return kvs_sha1_prefixes_keyed(data, len, lengths, n, order, out, NULL);
}

/* The pass behind kvs_sha1_prefixes_keyed (outer set) and
 * kvs_hmac_sha1_inner_prefixes (outer clear).  It hashes whole blocks
 * straight from data and pads each prefix's last partial block from data
 * too: no streaming buffer. */
static size_t prefixes(const uint8_t *data, size_t len, const uint64_t *lengths, size_t n,
                       size_t *order, uint8_t *out, const kvs_hmac_key *key, int outer)
{
    uint32_t st[5];
    pending_digest lane[2];
    lane_set ls;
    int ascending = 1;
    job_queue q = {data, len, lengths, order, n, 0, 0, out, key ? KVS_SHA1_BLOCK : 0,
                   key && outer ? key->outer : NULL};

    for (size_t i = 0; i < n; i++) {
        if (lengths[i] > len) return i + 1;
        if (i && lengths[i] < lengths[i - 1]) ascending = 0;
    }
    if (ascending)
        for (size_t i = 0; i < n; i++) order[i] = i;
    else
        sort_by_length(order, lengths, n, out);

    memcpy(st, key ? key->inner : sha1_iv, sizeof st);
    if (sha1_lanes_fn && n >= LANES && dense(lengths, order, n)) {
        memset(&ls, 0, sizeof ls);
        wide_pass(&q, st, &ls);
    } else {
        drain_jobs(&q, lane, main_pass(&q, st, lane));
    }
    for (size_t i = 1; i < n; i++)
        if (lengths[order[i]] == lengths[order[i - 1]])
            memcpy(out + KVS_SHA1_DIGEST * order[i], out + KVS_SHA1_DIGEST * order[i - 1], KVS_SHA1_DIGEST);
    return 0;
}

size_t kvs_sha1_prefixes_keyed(const uint8_t *data, size_t len,
                               const uint64_t *lengths, size_t n,
                               size_t *order, uint8_t *out, const kvs_hmac_key *key)
{
    return prefixes(data, len, lengths, n, order, out, key, 1);
}

size_t kvs_hmac_sha1_inner_prefixes(const uint8_t *data, size_t len,
                                    const uint64_t *lengths, size_t n,
                                    size_t *order, uint8_t *out, const kvs_hmac_key *key)
{
    return prefixes(data, len, lengths, n, order, out, key, 0);
}

/* A binary min-heap of node indices keyed by their lengths. */
static void heap_push(uint32_t *h, size_t *n, const uint64_t *key, uint32_t v)
{
    size_t i = (*n)++;
    while (i > 0) {
        size_t up = (i - 1) / 2;
        if (key[h[up]] <= key[v]) break;
        h[i] = h[up];
        i = up;
    }
    h[i] = v;
}

static uint32_t heap_pop(uint32_t *h, size_t *n, const uint64_t *key)
{
    uint32_t top = h[0], last = h[--(*n)];
    size_t i = 0;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= *n) break;
        if (c + 1 < *n && key[h[c + 1]] < key[h[c]]) c++;
        if (key[last] <= key[h[c]]) break;
        h[i] = h[c];
        i = c;
    }
    if (*n) h[i] = last;
    return top;
}

size_t kvs_sha1_forest(const uint8_t *data, size_t len,
                       const uint64_t *lengths, const uint8_t *digests, size_t n_nodes,
                       int32_t first_root, const int32_t *first_child, const int32_t *next_sibling,
                       uint32_t *heap, uint32_t *matched)
{
    return kvs_sha1_forest_keyed(data, len, lengths, digests, n_nodes, first_root, first_child, next_sibling,
                                 heap, matched, NULL, NULL, 1);
}

size_t kvs_sha1_forest_keyed(const uint8_t *data, size_t len,
                             const uint64_t *lengths, const uint8_t *digests, size_t n_nodes,
                             int32_t first_root, const int32_t *first_child, const int32_t *next_sibling,
                             uint32_t *heap, uint32_t *matched, const kvs_hmac_key *key, const uint8_t *tags,
                             int outer)
{
    kvs_sha1_ctx ctx;
    uint8_t inner[KVS_SHA1_DIGEST], digest[KVS_SHA1_DIGEST];
    uint64_t at = 0, digest_at = UINT64_MAX, outer_at = UINT64_MAX;
    size_t nheap = 0, nmatched = 0, steps = 0;

    /* Every node sits in one list, so a lookup walks at most n_nodes links
     * in all; more means a cycle in the caller's arrays. */
    for (int32_t r = first_root; r >= 0 && (size_t)r < n_nodes && steps++ < n_nodes; r = next_sibling[r])
        if (lengths[r] <= len && nheap < n_nodes) heap_push(heap, &nheap, lengths, (uint32_t)r);
    keyed_begin(&ctx, key);
    while (nheap) {
        uint32_t node = heap_pop(heap, &nheap, lengths);
        uint64_t want = lengths[node];
        if (want != digest_at) {
            kvs_sha1_update(&ctx, data + at, (size_t)(want - at));
            at = want;
            kvs_sha1_digest(&ctx, inner);
            digest_at = want;
        }
        if (!key || !outer) {
            memcpy(digest, inner, KVS_SHA1_DIGEST);
        } else {
            /* The outer block only where a tag does not rule the node out. */
            if (tags && tag_rules_out(tags + (size_t)KVS_LOOKUP_TAG * node, inner))
                continue;
            if (outer_at != want) {
                kvs_hmac_sha1_outer(key, inner, digest);
                outer_at = want;
            }
        }
        if (memcmp(digest, digests + (size_t)KVS_SHA1_DIGEST * node, KVS_SHA1_DIGEST) != 0)
            continue;
        if (nmatched == n_nodes) break;      /* only with a malformed forest: never overflow */
        matched[nmatched++] = node;
        for (int32_t c = first_child[node]; c >= 0 && (size_t)c < n_nodes && steps++ < n_nodes;
             c = next_sibling[c]) {
            /* Longer than the parent (so the pass never goes back) and
             * within the data; never more nodes than the heap holds. */
            if (lengths[c] > want && lengths[c] <= len && nheap < n_nodes)
                heap_push(heap, &nheap, lengths, (uint32_t)c);
        }
    }
    return nmatched;
}
