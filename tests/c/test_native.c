/* test_native.c: checks every compiled-in SHA1 and CRC32C path against the
 * portable one and against known vectors.  Built natively by the test suite
 * and, for the ARMv8 paths, cross-compiled for aarch64 and run under qemu.
 * Exits non-zero on any failure; prints "N passed, N failed". */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "crc32c.h"
#include "dispatch.h"
#include "sha1.h"

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

int main(void)
{
    static const int impls[] = {KVS_IMPL_X86, KVS_IMPL_ARM};
    enum { MAX = 200000 };
    uint8_t *buf = malloc(MAX + 16), d0[20], d1[20];
    char hx[41];
    int hw_sha = 0, hw_crc = 0;

    kvs_init();
    for (size_t i = 0; i < MAX + 16; i++) buf[i] = next_byte();

    for (int k = 0; k < 2; k++) {
        int impl = impls[k];
        if (kvs_sha1_has(impl)) {
            hw_sha++;
            for (size_t n = 0; n < MAX; n = n < 300 ? n + 1 : n * 3 + 7) {
                for (size_t off = 0; off < 3; off++) {
                    kvs_sha1_select(KVS_IMPL_PORTABLE);
                    kvs_sha1(buf + off, n, d0);
                    kvs_sha1_select(impl);
                    kvs_sha1(buf + off, n, d1);
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
                    check(a == b, kvs_crc32c_impl_name(), n);
                }
            }
        }
    }
    for (int impl = KVS_IMPL_PORTABLE; impl <= KVS_IMPL_ARM; impl++) {
        if (kvs_sha1_select(impl) == 0) {
            kvs_sha1((const uint8_t *)"abc", 3, d0);
            hex(d0, hx);
            check(strcmp(hx, "a9993e364706816aba3e25717850c26c9cd0d89d") == 0, "sha1 abc", 3);
            kvs_sha1((const uint8_t *)"", 0, d0);
            hex(d0, hx);
            check(strcmp(hx, "da39a3ee5e6b4b0d3255bfef95601890afd80709") == 0, "sha1 empty", 0);
        }
        if (kvs_crc32c_select(impl) == 0) {
            check(kvs_crc32c(0, (const uint8_t *)"123456789", 9) == 0xE3069283u, "crc32c check", 9);
            uint32_t whole = kvs_crc32c(0, buf, 100000);
            uint32_t a = kvs_crc32c(0, buf, 33333), b = kvs_crc32c(0, buf + 33333, 100000 - 33333);
            check(kvs_crc32c_combine(a, b, 100000 - 33333) == whole, "crc32c combine", 100000);
            check(kvs_crc32c(a, buf + 33333, 100000 - 33333) == whole, "crc32c incremental", 100000);
        }
    }
    printf("sha1 hardware paths: %d, crc32c hardware paths: %d\n", hw_sha, hw_crc);
    printf("%d passed, %d failed\n", passed, failed);
    free(buf);
    return failed != 0;
}
