/* test_native.c: checks every compiled-in SHA1 and CRC32C path against the
 * portable one and against known vectors.  Built natively by the test suite
 * and, for the ARMv8 paths, cross-compiled for aarch64 and run under qemu.
 * Exits non-zero on any failure; prints "N passed, N failed". */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "crc32c.h"
#include "dispatch.h"
#include "header.h"
#include "planes.h"
#include "quant.h"
#include "sha1.h"
#include "table.h"

#define NLEN 64               /* lengths per kvs_sha1_prefixes call */

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
/* Whether the calling thread's upper vector state is clean, as a function
 * using 256- or 512-bit registers must leave it (vzeroupper): XINUSE
 * (XGETBV with ECX=1) bit 2 is the upper halves of YMM0-15, bit 6 the upper
 * halves of ZMM0-15.  Left dirty, every later legacy-SSE instruction of the
 * thread (libm's, MLX's CPU kernels) runs many times slower, and threads it
 * creates inherit the state.  1 clean, 0 dirty, -1 where XINUSE cannot be read. */
static int upper_state_clean(void)
{
    unsigned a, b, c, d;
    if (!__get_cpuid_count(0xD, 1, &a, &b, &c, &d) || !(a & (1u << 2)))
        return -1;
    unsigned lo, hi;
    __asm__ volatile(".byte 0x0f, 0x01, 0xd0" : "=a"(lo), "=d"(hi) : "c"(1));
    return (lo & ((1u << 2) | (1u << 6))) == 0;
}
#else
static int upper_state_clean(void) { return -1; }
#endif

static int passed, failed;

static void check(int ok, const char *what, size_t n)
{
    if (ok) passed++;
    else { failed++; fprintf(stderr, "FAIL %s len=%zu\n", what, n); }
}

static void hex(const uint8_t *d, char *out)
{
    for (int i = 0; i < 20; i++) sprintf(out + 2 * i, "%02x", d[i]);
}

static uint64_t rng = 0x9E3779B97F4A7C15ull;
static uint8_t next_byte(void)
{
    rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17;
    return (uint8_t)rng;
}


/* kvs_sha1_prefixes(data[:len], lengths) against one kvs_sha1 per length. */
static void check_prefixes(const uint8_t *data, size_t len, const uint64_t *lengths, size_t n,
                           const char *what)
{
    size_t order[NLEN];
    uint8_t out[NLEN * 20], d[20];
    int ok = kvs_sha1_prefixes(data, len, lengths, n, order, out) == 0;
    check(upper_state_clean() != 0, "sha1_prefixes left the upper vector state dirty", len);
    for (size_t i = 0; ok && i < n; i++) {
        kvs_sha1(data, (size_t)lengths[i], d);
        ok = memcmp(d, out + 20 * i, 20) == 0;
    }
    check(ok, what, len);
}

static int cmp_u64(const void *a, const void *b);

/* HMAC-SHA1 (RFC 2202 vectors), and its keyed prefix pass and forest
 * against one kvs_hmac_sha1 per length, on the selected SHA1. */
static void check_hmac(const uint8_t *buf)
{
    static const struct { size_t klen; uint8_t kbyte; const char *data; size_t dlen; const char *hex; } v[] = {
        {20, 0x0b, "Hi There", 8, "b617318655057264e28bc0b6fb378c8ef146be00"},
        {4, 0, "what do ya want for nothing?", 28, "effcdf6ae5eb2fa2d27416d5f184df9c259a7c79"},
        {80, 0xaa, "Test Using Larger Than Block-Size Key - Hash Key First", 54,
         "aa4ae5e15272d00e95705637ce8a3b55ed402112"},
    };
    uint8_t key[80], d[20], out[NLEN * 20];
    uint64_t lengths[NLEN];
    size_t order[NLEN];
    char hx[41];
    kvs_hmac_key k;

    for (size_t i = 0; i < sizeof v / sizeof v[0]; i++) {
        if (v[i].kbyte) memset(key, v[i].kbyte, v[i].klen);
        else memcpy(key, "Jefe", 4);
        kvs_hmac_sha1_key(&k, key, v[i].klen);
        kvs_hmac_sha1(&k, (const uint8_t *)v[i].data, v[i].dlen, d);
        hex(d, hx);
        check(strcmp(hx, v[i].hex) == 0, "hmac_sha1 rfc2202", v[i].dlen);
    }
    kvs_hmac_sha1_key(&k, buf, 32);
    for (int round = 0; round < 50; round++) {
        size_t len = (size_t)next_byte() << 4 | (next_byte() & 15), n = 1 + next_byte() % NLEN, ok = 1;
        for (size_t i = 0; i < n; i++) lengths[i] = (uint64_t)(next_byte() << 8 | next_byte()) % (len + 1);
        ok = kvs_sha1_prefixes_keyed(buf + 100, len, lengths, n, order, out, &k) == 0;
        for (size_t i = 0; ok && i < n; i++) {
            kvs_hmac_sha1(&k, buf + 100, (size_t)lengths[i], d);
            ok = memcmp(d, out + 20 * i, 20) == 0;
        }
        check(ok, "sha1_prefixes_keyed", len);
        /* A forest of one chain: every node matches, in order. */
        qsort(lengths, n, sizeof lengths[0], cmp_u64);
        size_t m = 0;
        int32_t first_child[NLEN], next_sibling[NLEN];
        uint32_t heap[NLEN], matched[NLEN];
        for (size_t i = 0; i < n; i++)
            if (!m || lengths[i] > lengths[m - 1]) lengths[m++] = lengths[i];
        for (size_t i = 0; i < m; i++) {
            kvs_hmac_sha1(&k, buf + 100, (size_t)lengths[i], out + 20 * i);
            first_child[i] = i + 1 < m ? (int32_t)(i + 1) : -1;
            next_sibling[i] = -1;
        }
        size_t got = kvs_sha1_forest_keyed(buf + 100, len, lengths, out, m, 0, first_child, next_sibling,
                                           heap, matched, &k, NULL, 1);
        ok = got == m;
        for (size_t i = 0; ok && i < m; i++) ok = matched[i] == i;
        check(ok, "sha1_forest_keyed", len);
        /* The inner hashes: the outer block makes each one the HMAC; their
         * first bytes as lookup tags find the same chain, and a wrong tag
         * at node j stops the walk there (its children are never tried). */
        uint8_t inner[NLEN * 20], tags[NLEN * KVS_LOOKUP_TAG];
        ok = kvs_hmac_sha1_inner_prefixes(buf + 100, len, lengths, m, order, inner, &k) == 0;
        for (size_t i = 0; ok && i < m; i++) {
            kvs_hmac_sha1_outer(&k, inner + 20 * i, d);
            ok = memcmp(d, out + 20 * i, 20) == 0;
            memcpy(tags + KVS_LOOKUP_TAG * i, inner + 20 * i, KVS_LOOKUP_TAG);
        }
        check(ok, "hmac_sha1_inner_prefixes", len);
        got = kvs_sha1_forest_keyed(buf + 100, len, lengths, out, m, 0, first_child, next_sibling, heap, matched,
                                    &k, tags, 1);
        check(got == m, "sha1_forest_keyed tags", len);
        size_t j = m / 2;
        tags[KVS_LOOKUP_TAG * j] ^= 1;
        got = kvs_sha1_forest_keyed(buf + 100, len, lengths, out, m, 0, first_child, next_sibling, heap, matched,
                                    &k, tags, 1);
        check(got == j, "sha1_forest_keyed wrong tag", len);
        memset(tags + KVS_LOOKUP_TAG * j, 0, KVS_LOOKUP_TAG);          /* no tag: confirmed by the outer block */
        got = kvs_sha1_forest_keyed(buf + 100, len, lengths, out, m, 0, first_child, next_sibling, heap, matched,
                                    &k, tags, 1);
        check(got == m, "sha1_forest_keyed no tag", len);
        /* outer 0: the inner hashes are the names (a namespace), tags unused. */
        got = kvs_sha1_forest_keyed(buf + 100, len, lengths, inner, m, 0, first_child, next_sibling, heap, matched,
                                    &k, tags, 0);
        check(got == m, "sha1_forest_keyed inner names", len);
        got = kvs_sha1_forest_keyed(buf + 100, len, lengths, out, m, 0, first_child, next_sibling, heap, matched,
                                    &k, NULL, 0);
        check(got == 0, "sha1_forest_keyed inner names are not HMACs", len);
    }
}

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

/* Random lengths (unsorted, with repeats, near block edges), then the same
 * ascending, then every cut of a short message, on the selected SHA1. */
static void check_prefixes_all(const uint8_t *buf, size_t max)
{
    uint64_t lengths[NLEN];
    size_t order[NLEN];
    uint8_t out[NLEN * 20];

    for (int round = 0; round < 200; round++) {
        size_t len = round < 100 ? (size_t)round * 7 : (size_t)next_byte() << 8 | next_byte();
        size_t n = 1 + next_byte() % NLEN;
        if (len > max) len = max;
        for (size_t i = 0; i < n; i++) {
            uint64_t v;
            switch (next_byte() % 5) {
            case 0: v = len; break;
            case 1: v = 0; break;
            case 2: v = i ? lengths[next_byte() % i] : len; break;         /* a repeat */
            case 3: v = ((uint64_t)(next_byte() << 8 | next_byte()) % (len / 64 + 1)) * 64
                        + (uint64_t)(next_byte() % 3) - 1; break;          /* a block edge */
            default: v = ((uint64_t)next_byte() << 16 | (uint64_t)next_byte() << 8 | next_byte()) % (len + 1);
            }
            if (v > len) v = len;                                          /* edge - 1 wrapped */
            lengths[i] = v;
        }
        check_prefixes(buf, len, lengths, n, "sha1_prefixes unsorted");
        qsort(lengths, n, sizeof lengths[0], cmp_u64);
        check_prefixes(buf, len, lengths, n, "sha1_prefixes ascending");
    }
    for (size_t start = 0; start < 200; start += NLEN) {          /* every cut of 200 bytes */
        size_t n = 0;
        for (uint64_t v = start; v < start + NLEN && v <= 200; v++) lengths[n++] = v;
        check_prefixes(buf, 200, lengths, n, "sha1_prefixes dense");
    }
    lengths[0] = 5; lengths[1] = 11; lengths[2] = 3;
    check(kvs_sha1_prefixes(buf, 10, lengths, 3, order, out) == 2, "sha1_prefixes too long", 10);
    check(kvs_sha1_prefixes(buf, 10, lengths, 0, order, out) == 0, "sha1_prefixes none", 10);
}

static int header_equal(const kvs_header *a, const kvs_header *b)
{
    return a->version == b->version && a->quant_bits == b->quant_bits && a->reason == b->reason &&
           a->ext_flags == b->ext_flags && a->model_id == b->model_id && a->tokens == b->tokens &&
           a->hits == b->hits && a->ctx_size == b->ctx_size && a->payload_abi == b->payload_abi &&
           a->created_at == b->created_at && a->last_used == b->last_used &&
           a->payload_bytes == b->payload_bytes && a->model_tag == b->model_tag;
}

static uint64_t next_u64(void)
{
    uint64_t v = 0;
    for (int i = 0; i < 8; i++) v = v << 8 | next_byte();
    return v;
}

static void check_header(void)
{
    kvs_header h, back;
    uint8_t b[KVS_HEADER_SIZE];
    static const uint8_t le[] = {0x04, 0x03, 0x02, 0x01};

    for (int i = 0; i < 1000; i++) {
        h.version = KVS_FORMAT_VERSION;
        h.quant_bits = next_byte(); h.reason = next_byte(); h.ext_flags = next_byte();
        h.model_id = next_byte(); h.payload_abi = next_byte();
        h.tokens = (uint32_t)next_u64() | 1;
        h.hits = (uint32_t)next_u64(); h.ctx_size = (uint32_t)next_u64();
        h.created_at = next_u64(); h.last_used = next_u64(); h.payload_bytes = next_u64();
        h.model_tag = (uint32_t)next_u64() & KVS_MODEL_TAG_MAX;
        if (i == 0) { h.tokens = UINT32_MAX; h.hits = UINT32_MAX; h.payload_bytes = UINT64_MAX; }
        kvs_header_pack(&h, b);
        memset(&back, 0xAB, sizeof back);
        check(kvs_header_parse(b, &back) == KVS_OK && header_equal(&h, &back), "header round trip", i);
        /* bytes 21..23: the model tag, little-endian (ds4 writes them 0) */
        check(b[21] == (h.model_tag & 0xFF) && b[22] == ((h.model_tag >> 8) & 0xFF) &&
              b[23] == (h.model_tag >> 16), "header model tag", i);
        b[21] = b[22] = b[23] = 0xFF;
        h.model_tag = KVS_MODEL_TAG_MAX;
        check(kvs_header_parse(b, &back) == KVS_OK && header_equal(&h, &back), "header model tag all ones", i);
    }
    h.tokens = 0x01020304;
    kvs_header_pack(&h, b);
    check(memcmp(b, "KVC\x01", 4) == 0 && memcmp(b + 8, le, 4) == 0, "header layout", 0);
    b[0] = 'X';
    check(kvs_header_parse(b, &back) == KVS_EMAGIC, "header magic", 0);
    b[0] = 'K'; b[3] = 2;
    check(kvs_header_parse(b, &back) == KVS_EVERSION, "header version", 0);
    b[3] = 1; memset(b + 8, 0, 4);
    check(kvs_header_parse(b, &back) == KVS_ETOKENS, "header tokens", 0);
}

static void check_fits(void)
{
    static const struct { uint64_t size; uint32_t text; uint64_t payload; int ok; } cases[] = {
        {52, 0, 0, 1}, {51, 0, 0, 0}, {0, 0, 0, 0}, {62, 10, 0, 1}, {62, 10, 1, 0},
        {100, UINT32_MAX, 0, 0}, {52 + (uint64_t)UINT32_MAX, UINT32_MAX, 0, 1},
        {51 + (uint64_t)UINT32_MAX, UINT32_MAX, 0, 0}, {100, UINT32_MAX - 40, 0, 0},
        {100, 0, UINT64_MAX, 0}, {UINT64_MAX, 0, UINT64_MAX, 0}, {UINT64_MAX, 0, UINT64_MAX - 52, 1},
        {UINT64_MAX, UINT32_MAX, UINT64_MAX - 52 - UINT32_MAX, 1},
        {UINT64_MAX, UINT32_MAX, UINT64_MAX - 51 - UINT32_MAX, 0},
        {100, 10, UINT64_MAX - 60, 0},          /* 52 + 10 + p wraps to 1 */
        {100, UINT32_MAX, UINT64_MAX - 52 - UINT32_MAX + 6, 0},  /* wraps to 5 */
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        check((kvs_envelope_fits(cases[i].size, cases[i].text, cases[i].payload) == KVS_OK) == cases[i].ok,
              "envelope fits", i);
}

/* Byte planes: every width (the unrolled 1, 2, 4 and the general loop), a
 * block split from and joined into uneven runs, against the definition. */
static void check_planes(const uint8_t *buf)
{
    enum { N = 1000 };
    static uint8_t store[KVS_PLANES_MAX][N], back[KVS_PLANES_MAX * N + 1];
    static const size_t widths[] = {1, 2, 3, 4, 8, KVS_PLANES_MAX};
    static const size_t cuts[] = {0, 1, 7, 64, 333, 999, N};
    uint8_t *planes[KVS_PLANES_MAX];
    for (size_t p = 0; p < KVS_PLANES_MAX; p++) planes[p] = store[p];
    for (size_t w = 0; w < sizeof widths / sizeof widths[0]; w++) {
        size_t width = widths[w];
        memset(store, 0xEE, sizeof store);
        memset(back, 0xEE, sizeof back);
        for (size_t c = 0; c + 1 < sizeof cuts / sizeof cuts[0]; c++)
            kvs_planes_split(planes, cuts[c], buf + cuts[c] * width, cuts[c + 1] - cuts[c], width);
        int ok = 1;
        for (size_t i = 0; i < N; i++)
            for (size_t p = 0; p < width; p++)
                ok &= store[p][i] == buf[i * width + p];
        check(ok, "planes split", width);
        for (size_t c = 0; c + 1 < sizeof cuts / sizeof cuts[0]; c++)
            kvs_planes_join(back + cuts[c] * width, (const uint8_t *const *)planes, cuts[c],
                            cuts[c + 1] - cuts[c], width);
        check(memcmp(back, buf, N * width) == 0, "planes join", width);
        check(back[N * width] == 0xEE, "planes join stays in its runs", width);
    }
}

/* Quantised blocks: float32 groups dequantise to q * scale + bias with each
 * operation rounded on its own (no fused multiply-add, which an ARMv8
 * compiler would otherwise contract to: the NumPy twin rounds twice), and
 * every value lands within half a step of what was quantised. */
static void check_quant(void)
{
    enum { N = 64 * 24 };
    static float src[N], dst[N], scales[N / 16], biases[N / 16];
    static uint8_t q[N];
    for (size_t i = 0; i < N; i++)
        src[i] = (float)((int)(next_u64() % 20001) - 10000) / 777.0f;
    for (int bits = 8; bits >= 4; bits -= 4) {
        for (size_t group = 16; group <= 64; group *= 2) {
            check(kvs_quantize(src, N, KVS_Q_F32, bits, group, q, scales, biases) == 0, "quantize", group);
            kvs_dequantize(q, scales, biases, N, KVS_Q_F32, bits, group, dst);
            int same = 1, close = 1;
            for (size_t k = 0; k < N; k++) {
                unsigned v = bits == 8 ? q[k] : (q[k / 2] >> ((k & 1) * 4)) & 0xF;
                volatile float p = (float)v * scales[k / group];
                float want = p + biases[k / group];
                same &= memcmp(&want, &dst[k], 4) == 0;
                float d = dst[k] - src[k];
                close &= (d < 0 ? -d : d) <= scales[k / group] * 0.5f * 1.0001f;
            }
            check(same, "dequantize rounds q * scale and + bias apart", group);
            check(close, "dequantized values within half a step", group);
        }
    }
    float bad[64] = {0};
    bad[5] = 1.0f / 0.0f;
    check(kvs_quantize(bad, 64, KVS_Q_F32, 8, 64, q, scales, biases) == -1, "quantize refuses inf", 64);
}

/* Table planes: a plane of more than 16 values encoded, checked and joined
 * back with every decoder (portable, SSSE3, NEON) over runs that start on
 * odd and even elements, equal to the source; a damaged form is refused.
 * Returns the number of hardware decoders seen. */
static int check_table(void)
{
    enum { N = 4099, W = 2 };
    static uint8_t plane[N], elems[N * W], stored[KVS_TABLE_SIZE(N, N)], back[N * W + 1];
    for (size_t i = 0; i < N; i++) {
        unsigned r = (unsigned)(next_u64() % 1000);
        plane[i] = (uint8_t)(r < 990 ? 0x3C + r % 12 : r);      /* 12 common values, some others */
        elems[i * W] = next_byte();
        elems[i * W + 1] = plane[i];
    }
    size_t size = kvs_table_pack(plane, N, N, stored);
    size_t e = (size - KVS_TABLE_HEAD - (N + 1) / 2) / 5;
    check(size == KVS_TABLE_SIZE(N, e) && e > 0, "table plane size", e);
    check(kvs_table_check(stored, size, N) == 0, "table plane checks", e);
    check(kvs_table_pack(plane, N, e - 1, back) == 0, "table plane over its exceptions", e);
    uint8_t low[N];
    for (size_t i = 0; i < N; i++) low[i] = elems[i * W];
    kvs_plane planes[W] = {{low, 0}, {stored, 1}};
    static const size_t cuts[] = {0, 1, 2, 33, 34, 100, 1001, 4000, N};
    static const int impls[] = {KVS_IMPL_PORTABLE, KVS_IMPL_X86, KVS_IMPL_ARM};
    int hw = 0;
    for (int k = 0; k < 3; k++) {
        if (kvs_table_select(impls[k]) != 0) continue;
        hw += impls[k] != KVS_IMPL_PORTABLE;
        memset(back, 0xEE, sizeof back);
        for (size_t c = 0; c + 1 < sizeof cuts / sizeof cuts[0]; c++)
            kvs_table_join(back + cuts[c] * W, planes, W, N, cuts[c], cuts[c + 1] - cuts[c]);
        check(memcmp(back, elems, N * W) == 0, kvs_table_impl_name(), N);
        check(back[N * W] == 0xEE, "table join stays in its runs", N);
    }
    kvs_table_select(KVS_IMPL_AUTO);
    check(kvs_table_check(stored, KVS_TABLE_SIZE(N, e) - 1, N) != 0, "table plane of a wrong length", N);
    uint8_t *places = stored + KVS_TABLE_HEAD + (N + 1) / 2;
    uint8_t keep = places[0];
    places[0] = places[4], places[1] = places[5], places[2] = places[6], places[3] = places[7];
    check(kvs_table_check(stored, KVS_TABLE_SIZE(N, e), N) != 0, "table places out of order", N);
    places[0] = keep;
    return hw;
}

int main(void)
{
    static const int impls[] = {KVS_IMPL_X86, KVS_IMPL_X86_AVX512, KVS_IMPL_ARM};
    enum { MAX = 200000 };
    uint8_t *buf = malloc(MAX + 16), d0[20], d1[20];
    char hx[41];
    int hw_sha = 0, hw_crc = 0;

    kvs_init();
    for (size_t i = 0; i < MAX + 16; i++) buf[i] = next_byte();

    for (int k = 0; k < 3; k++) {
        int impl = impls[k];
        if (kvs_sha1_has(impl)) {
            hw_sha++;
            for (size_t n = 0; n < MAX; n = n < 300 ? n + 1 : n * 3 + 7) {
                for (size_t off = 0; off < 3; off++) {
                    kvs_sha1_select(KVS_IMPL_PORTABLE);
                    kvs_sha1(buf + off, n, d0);
                    kvs_sha1_select(impl);
                    kvs_sha1(buf + off, n, d1);
                    check(upper_state_clean() != 0, "sha1 left the upper vector state dirty", n);
                    check(memcmp(d0, d1, 20) == 0, kvs_sha1_impl_name(), n);
                }
            }
        }
        if (kvs_crc32c_has(impl)) {
            hw_crc++;
            for (size_t n = 0; n < MAX; n = n < 300 ? n + 1 : n * 3 + 7) {
                for (size_t off = 0; off < 9; off++) {
                    kvs_crc32c_select(KVS_IMPL_PORTABLE);
                    uint32_t a = kvs_crc32c(0, buf + off, n);
                    kvs_crc32c_select(impl);
                    uint32_t b = kvs_crc32c(0, buf + off, n);
                    check(upper_state_clean() != 0, "crc32c left the upper vector state dirty", n);
                    check(a == b, kvs_crc32c_impl_name(), n);
                }
            }
        }
    }
    for (int impl = KVS_IMPL_PORTABLE; impl <= KVS_IMPL_X86_AVX512; impl++) {
        if (kvs_sha1_select(impl) == 0) {
            kvs_sha1((const uint8_t *)"abc", 3, d0);
            hex(d0, hx);
            check(strcmp(hx, "a9993e364706816aba3e25717850c26c9cd0d89d") == 0, "sha1 abc", 3);
            kvs_sha1((const uint8_t *)"", 0, d0);
            hex(d0, hx);
            check(strcmp(hx, "da39a3ee5e6b4b0d3255bfef95601890afd80709") == 0, "sha1 empty", 0);
        }
        if (kvs_sha1_select(impl) == 0) {
            check_prefixes_all(buf, MAX);
            check_hmac(buf);
        }
        if (kvs_crc32c_select(impl) == 0) {
            check(kvs_crc32c(0, (const uint8_t *)"123456789", 9) == 0xE3069283u, "crc32c check", 9);
            uint32_t whole = kvs_crc32c(0, buf, 100000);
            uint32_t a = kvs_crc32c(0, buf, 33333), b = kvs_crc32c(0, buf + 33333, 100000 - 33333);
            check(kvs_crc32c_combine(a, b, 100000 - 33333) == whole, "crc32c combine", 100000);
            check(kvs_crc32c(a, buf + 33333, 100000 - 33333) == whole, "crc32c incremental", 100000);
        }
    }
    check_header();
    check_fits();
    check_planes(buf);
    check_quant();
    int hw_table = check_table();
    printf("sha1 hardware paths: %d, crc32c hardware paths: %d, table hardware paths: %d\n", hw_sha, hw_crc,
           hw_table);
    printf("%d passed, %d failed\n", passed, failed);
    free(buf);
    return failed != 0;
}
