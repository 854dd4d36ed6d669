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

__attribute__((target("sha,sse4.1")))
static void blocks_shani(uint32_t st[5], const uint8_t *p, size_t n)
{
    const __m128i bswap = _mm_set_epi64x(0x0001020304050607LL, 0x08090a0b0c0d0e0fLL);
    __m128i abcd = _mm_shuffle_epi32(_mm_loadu_si128((const __m128i *)st), 0x1B);
    __m128i e0 = _mm_set_epi32((int)st[4], 0, 0, 0);
    __m128i w[4], e, prev;

    while (n--) {
        __m128i abcd_save = abcd, e0_save = e0;
        for (int i = 0; i < 4; i++)
            w[i] = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(p + 16 * i)), bswap);
        e = _mm_add_epi32(e0, w[0]);
        prev = abcd;
        abcd = _mm_sha1rnds4_epu32(abcd, e, 0);
        SHANI_GROUP(1, 0); SHANI_GROUP(2, 0); SHANI_GROUP(3, 0);
        SHANI_GROUP_S(4, 0);
        SHANI_GROUP_S(5, 1); SHANI_GROUP_S(6, 1); SHANI_GROUP_S(7, 1);
        SHANI_GROUP_S(8, 1); SHANI_GROUP_S(9, 1);
        SHANI_GROUP_S(10, 2); SHANI_GROUP_S(11, 2); SHANI_GROUP_S(12, 2);
        SHANI_GROUP_S(13, 2); SHANI_GROUP_S(14, 2);
        SHANI_GROUP_S(15, 3); SHANI_GROUP_S(16, 3); SHANI_GROUP_S(17, 3);
        SHANI_GROUP_S(18, 3); SHANI_GROUP_S(19, 3);
        e0 = _mm_sha1nexte_epu32(prev, e0_save);
        abcd = _mm_add_epi32(abcd, abcd_save);
        p += KVS_SHA1_BLOCK;
    }
    _mm_storeu_si128((__m128i *)st, _mm_shuffle_epi32(abcd, 0x1B));
    st[4] = (uint32_t)_mm_extract_epi32(e0, 3);
}

/* Two independent messages at once.  sha1rnds4 has a latency of several
 * cycles but issues every one or two, so one message leaves the unit idle
 * most of the time; a second, interleaved message fills those slots.  The
 * prefix lookup finishes its snapshots two at a time with this. */
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
    switch (impl) {
#if defined(KVS_HAVE_X86)
    case KVS_IMPL_X86:
        sha1_blocks_fn = blocks_shani; sha1_blocks2_fn = blocks2_shani; sha1_name = "sha-ni"; break;
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

/* Pads the last len % 64 bytes of a message of len bytes whose whole
 * blocks are already in st. */
static void pad_tail(const uint32_t st[5], const uint8_t *tail, size_t n, uint64_t len,
                     pending_digest *pd, uint8_t *out)
{
    uint64_t bits = len * 8;

    memcpy(pd->st, st, sizeof pd->st);
    memcpy(pd->tail, tail, n);
    pd->tail[n++] = 0x80;
    pd->blocks = n + 8 <= KVS_SHA1_BLOCK ? 1 : 2;
    memset(pd->tail + n, 0, pd->blocks * KVS_SHA1_BLOCK - 8 - n);
    for (int i = 0; i < 8; i++)
        pd->tail[pd->blocks * KVS_SHA1_BLOCK - 1 - i] = (uint8_t)(bits >> (8 * i));
    pd->done = 0;
    pd->out = out;
    pd->outer = NULL;
}

static void emit(const pending_digest *pd)
{
    for (int i = 0; i < 5; i++)
        store_be32(pd->out + 4 * i, pd->st[i]);
}

/* A slot whose blocks are all compressed: emits its digest and returns 1,
 * or, the inner hash of an HMAC, becomes the outer hash and returns 0. */
static int complete(pending_digest *pd)
{
    uint8_t inner[KVS_SHA1_DIGEST];

    if (!pd->outer) {
        emit(pd);
        return 1;
    }
    for (int i = 0; i < 5; i++)
        store_be32(inner + 4 * i, pd->st[i]);
    pad_tail(pd->outer, inner, KVS_SHA1_DIGEST, KVS_SHA1_BLOCK + KVS_SHA1_DIGEST, pd, pd->out);
    return 0;
}

static void finish_one(pending_digest *pd)
{
    do {
        sha1_blocks_fn(pd->st, pd->tail + KVS_SHA1_BLOCK * pd->done, pd->blocks - pd->done);
        pd->done = pd->blocks;
    } while (!complete(pd));
}

static void finish_two(pending_digest *a, pending_digest *b)
{
    int fa = 0, fb = 0;

    /* Both lanes run until one slot is finished; the other ends alone. */
    while (!fa && !fb) {
        size_t la = a->blocks - a->done, lb = b->blocks - b->done, both = la < lb ? la : lb;
        sha1_blocks2_fn(a->st, a->tail + KVS_SHA1_BLOCK * a->done, b->st, b->tail + KVS_SHA1_BLOCK * b->done,
                        both);
        a->done += both;
        b->done += both;
        if (a->done == a->blocks) fa = complete(a);
        if (b->done == b->blocks) fb = complete(b);
    }
    if (!fa) finish_one(a);
    if (!fb) finish_one(b);
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

/* Runs the main pass forward by nblocks, folding the pending digest (if
 * any) into the same instructions: the single main stream is latency-bound,
 * so the second lane finishes snapshots almost for free. */
static void advance(uint32_t st[5], const uint8_t **p, size_t nblocks,
                    pending_digest *pd, int *npending)
{
    while (nblocks && *npending) {
        size_t m = pd[0].blocks - pd[0].done;
        if (m > nblocks) m = nblocks;
        sha1_blocks2_fn(st, *p, pd[0].st, pd[0].tail + KVS_SHA1_BLOCK * pd[0].done, m);
        *p += KVS_SHA1_BLOCK * m;
        nblocks -= m;
        pd[0].done += m;
        if (pd[0].done == pd[0].blocks && complete(&pd[0])) {
            pd[0] = pd[1];
            (*npending)--;
        }
    }
    if (nblocks) {
        sha1_blocks_fn(st, *p, nblocks);
        *p += KVS_SHA1_BLOCK * nblocks;
    }
}

size_t kvs_sha1_prefixes(const uint8_t *data, size_t len,
                         const uint64_t *lengths, size_t n,
                         size_t *order, uint8_t *out)
{
    return kvs_sha1_prefixes_keyed(data, len, lengths, n, order, out, NULL);
}

/* The pass behind kvs_sha1_prefixes_keyed (outer set) and
 * kvs_hmac_sha1_inner_prefixes (outer clear). */
static size_t prefixes(const uint8_t *data, size_t len, const uint64_t *lengths, size_t n,
                       size_t *order, uint8_t *out, const kvs_hmac_key *key, int outer)
{
    uint32_t st[5];
    uint64_t head = key ? KVS_SHA1_BLOCK : 0;   /* bytes hashed before data */
    pending_digest pd[2];
    int npending = 0, ascending = 1;
    const uint8_t *p = data;
    uint64_t done = 0;          /* whole blocks hashed into st */

    for (size_t i = 0; i < n; i++) {
        if (lengths[i] > len) return i + 1;
        if (i && lengths[i] < lengths[i - 1]) ascending = 0;
    }
    if (ascending)
        for (size_t i = 0; i < n; i++) order[i] = i;
    else
        sort_by_length(order, lengths, n, out);

    /* The pass hashes whole blocks straight from data and pads each
     * prefix's last partial block from data too: no streaming buffer.
     * Repeated lengths are copied after the pass. */
    memcpy(st, key ? key->inner : sha1_iv, sizeof st);
    for (size_t i = 0; i < n; i++) {
        size_t k = order[i];
        uint64_t want = lengths[k], whole = want / KVS_SHA1_BLOCK;
        if (i > 0 && lengths[order[i - 1]] == want) continue;
        if (whole > done) {
            advance(st, &p, (size_t)(whole - done), pd, &npending);
            done = whole;
        }
        if (npending == 2) {    /* two cuts with no main blocks between */
            finish_two(&pd[0], &pd[1]);
            npending = 0;
        }
        pad_tail(st, data + KVS_SHA1_BLOCK * whole, (size_t)(want % KVS_SHA1_BLOCK), head + want,
                 &pd[npending], out + KVS_SHA1_DIGEST * k);
        pd[npending++].outer = key && outer ? key->outer : NULL;
    }
    if (npending == 2) finish_two(&pd[0], &pd[1]);
    else if (npending == 1) finish_one(&pd[0]);
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
