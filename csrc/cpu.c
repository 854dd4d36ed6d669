/* cpu.c: CPU feature probes (see cpu.h). */
#include "cpu.h"

#if defined(KVS_HAVE_X86)
#include <cpuid.h>

static void cpuid_regs(unsigned leaf, unsigned sub, unsigned r[4])
{
    r[0] = r[1] = r[2] = r[3] = 0;
    if (__get_cpuid_max(0, 0) >= leaf)
        __cpuid_count(leaf, sub, r[0], r[1], r[2], r[3]);
}

int kvs_cpu_has_shani(void)
{
    unsigned l1[4], l7[4];
    cpuid_regs(1, 0, l1);
    cpuid_regs(7, 0, l7);
    /* SHA-NI (leaf 7 EBX bit 29); the kernel also uses SSSE3 byte shuffles
     * (leaf 1 ECX bit 9) and SSE4.1 extracts (bit 19). */
    return (l7[1] >> 29 & 1) && (l1[2] >> 9 & 1) && (l1[2] >> 19 & 1);
}

int kvs_cpu_has_ssse3(void)
{
    unsigned l1[4];
    cpuid_regs(1, 0, l1);
    return l1[2] >> 9 & 1;
}

int kvs_cpu_has_sse42(void)
{
    unsigned l1[4];
    cpuid_regs(1, 0, l1);
    return l1[2] >> 20 & 1;
}

int kvs_cpu_has_avx512_vpclmul(void)
{
    unsigned l1[4], l7[4];
    cpuid_regs(1, 0, l1);
    cpuid_regs(7, 0, l7);
    /* SSE4.2 (leaf 1 ECX bit 20) and OSXSAVE (bit 27); AVX512F (leaf 7 EBX
     * bit 16) and VPCLMULQDQ (leaf 7 ECX bit 10). */
    if (!(l1[2] >> 20 & 1) || !(l1[2] >> 27 & 1) || !(l7[1] >> 16 & 1) || !(l7[2] >> 10 & 1))
        return 0;
    /* The OS must save the SSE, AVX, opmask and both ZMM state components
     * (XCR0 bits 1, 2, 5, 6, 7).  macOS enables AVX-512 state only on first
     * use, so there this says no and the SSE4.2 path runs. */
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    (void)hi;
    return (lo & 0xE6) == 0xE6;
}

int kvs_cpu_has_avx2(void)
{
    unsigned l1[4], l7[4];
    cpuid_regs(1, 0, l1);
    cpuid_regs(7, 0, l7);
    /* AVX (leaf 1 ECX bit 28), OSXSAVE (bit 27) and AVX2 (leaf 7 EBX bit
     * 5); the OS saves the SSE and AVX state components (XCR0 bits 1, 2). */
    if (!(l1[2] >> 28 & 1) || !(l1[2] >> 27 & 1) || !(l7[1] >> 5 & 1))
        return 0;
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    (void)hi;
    return (lo & 0x6) == 0x6;
}
#else
int kvs_cpu_has_avx2(void) { return 0; }
int kvs_cpu_has_shani(void) { return 0; }
int kvs_cpu_has_ssse3(void) { return 0; }
int kvs_cpu_has_sse42(void) { return 0; }
int kvs_cpu_has_avx512_vpclmul(void) { return 0; }
#endif

#if defined(KVS_HAVE_ARM_SHA1) || defined(KVS_HAVE_ARM_CRC)
#if defined(__linux__)
#include <sys/auxv.h>
#ifndef HWCAP_CRC32
#define HWCAP_CRC32 (1 << 7)
#endif
#ifndef HWCAP_SHA1
#define HWCAP_SHA1 (1 << 5)
#endif
static int arm_hwcap(unsigned long bit) { return (getauxval(AT_HWCAP) & bit) != 0; }
#else
/* Every arm64 Apple core (and every core a compiler targets with these
 * features enabled on other systems) has them: the compile-time flag is the
 * promise. */
static int arm_hwcap(unsigned long bit) { (void)bit; return 1; }
#define HWCAP_CRC32 1
#define HWCAP_SHA1 1
#endif
#endif

#if defined(KVS_HAVE_ARM_SHA1)
int kvs_cpu_has_arm_sha1(void) { return arm_hwcap(HWCAP_SHA1); }
#else
int kvs_cpu_has_arm_sha1(void) { return 0; }
#endif
#if defined(KVS_HAVE_ARM_CRC)
int kvs_cpu_has_arm_crc32(void) { return arm_hwcap(HWCAP_CRC32); }
#else
int kvs_cpu_has_arm_crc32(void) { return 0; }
#endif
