/* dispatch.h: which instruction-set paths this build has and which one runs.
 *
 * Every hot path in csrc/ has a portable C version and, where the compiler
 * and CPU allow, hardware versions (SHA-NI, SSE4.2 and AVX-512 VPCLMULQDQ on
 * x86-64, the ARMv8 crypto and CRC extensions on arm64; for the codecs,
 * table.h's SSSE3 and NEON decoders and quant.h's AVX2 dequantizer).  The choice is made
 * once at run time by kvs_init(); a caller can force the portable paths
 * (tests and CI do) with kvs_select().  Nothing here reads the environment:
 * that is the binding's job.
 */
#ifndef KVS_DISPATCH_H
#define KVS_DISPATCH_H

enum kvs_impl {
    KVS_IMPL_AUTO = 0,      /* the fastest path this CPU supports */
    KVS_IMPL_PORTABLE = 1,  /* plain C, every platform */
    KVS_IMPL_X86 = 2,       /* SHA-NI / SSE4.2 crc32 */
    KVS_IMPL_ARM = 3,       /* ARMv8 SHA1 / CRC32C instructions */
    KVS_IMPL_X86_AVX512 = 4 /* CRC32C only: AVX-512 VPCLMULQDQ folding */
};

/* Builds the CRC tables and picks the fastest paths.  Idempotent; call once
 * before any other kvs_ function (the binding does it at import). */
void kvs_init(void);

/* Selects an implementation for SHA1 and CRC32C.  Returns 0, or -1 when the
 * requested one is not compiled in or not supported by this CPU (the current
 * selection is then left as it was). */
int kvs_sha1_select(int impl);
int kvs_crc32c_select(int impl);

/* 1 when the implementation can run here (compiled in and CPU supports it). */
int kvs_sha1_has(int impl);
int kvs_crc32c_has(int impl);

/* The running implementation, as a short static name ("portable", "sha-ni",
 * "armv8", "sse4.2", "avx512-vpclmulqdq"). */
const char *kvs_sha1_impl_name(void);
const char *kvs_crc32c_impl_name(void);

/* A codec path's kvs_*_has: auto and portable run everywhere; KVS_IMPL_X86
 * where this is an x86-64 build and x86 (its CPU probe's answer) says so;
 * KVS_IMPL_ARM where this is an arm64 build and arm says so. */
static inline int kvs_impl_has(int impl, int x86, int arm)
{
    switch (impl) {
    case KVS_IMPL_AUTO:
    case KVS_IMPL_PORTABLE:
        return 1;
#if defined(__x86_64__) || defined(_M_X64)
    case KVS_IMPL_X86:
        return x86;
#endif
#if defined(__aarch64__)
    case KVS_IMPL_ARM:
        return arm;
#endif
    default:
        (void)x86, (void)arm;
        return 0;
    }
}

#endif
