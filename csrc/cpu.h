/* cpu.h: run-time CPU feature probes shared by sha1.c, crc32c.c, table.c and quant.c.
 * Only compile-time-available paths are probed; each probe is cheap and
 * called once from kvs_init(). */
#ifndef KVS_CPU_H
#define KVS_CPU_H

#if defined(__x86_64__) || defined(_M_X64)
#define KVS_HAVE_X86 1
/* The AVX-512 carry-less multiply path needs a compiler that knows the
 * vpclmulqdq target (GCC 8, clang 6 and later). */
#if (defined(__clang__) && __clang_major__ >= 6) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 8)
#define KVS_HAVE_X86_VPCLMUL 1
#endif
#endif

/* The ARM paths are compiled only when the compiler targets the extensions
 * (Apple Silicon compilers always do; on Linux pass -march=armv8-a+crc+crypto).
 * The CPU is still asked at run time on Linux, where a baseline armv8-a core
 * (a Raspberry Pi, say) may lack them. */
#if defined(__aarch64__) && defined(__ARM_FEATURE_CRC32)
#define KVS_HAVE_ARM_CRC 1
#endif
#if defined(__aarch64__) && (defined(__ARM_FEATURE_SHA2) || defined(__ARM_FEATURE_CRYPTO))
#define KVS_HAVE_ARM_SHA1 1
#endif

int kvs_cpu_has_shani(void);
int kvs_cpu_has_ssse3(void);
int kvs_cpu_has_sse42(void);
int kvs_cpu_has_avx512_vpclmul(void);
int kvs_cpu_has_avx2(void);
int kvs_cpu_has_arm_sha1(void);
int kvs_cpu_has_arm_crc32(void);

#endif
