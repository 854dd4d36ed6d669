/* header.c: KVC header pack/parse and the atomic in-place hit update. */
#define _POSIX_C_SOURCE 200809L
#define _DEFAULT_SOURCE 1
#define _DARWIN_C_SOURCE 1

#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "header.h"

#ifndef O_CLOEXEC
#define O_CLOEXEC 0
#endif

static void put_le(uint8_t *p, uint64_t v, int n)
{
    for (int i = 0; i < n; i++) p[i] = (uint8_t)(v >> (8 * i));
}

static uint64_t get_le(const uint8_t *p, int n)
{
    uint64_t v = 0;
    for (int i = n - 1; i >= 0; i--) v = v << 8 | p[i];
    return v;
}

void kvs_header_pack(const kvs_header *h, uint8_t out[KVS_HEADER_SIZE])
{
    memset(out, 0, KVS_HEADER_SIZE);
    out[0] = 'K'; out[1] = 'V'; out[2] = 'C';
    out[3] = h->version;
    out[4] = h->quant_bits;
    out[5] = h->reason;
    out[6] = h->ext_flags;
    out[7] = h->model_id;
    put_le(out + 8, h->tokens, 4);
    put_le(out + 12, h->hits, 4);
    put_le(out + 16, h->ctx_size, 4);
    out[20] = h->payload_abi;
    put_le(out + 21, h->model_tag & KVS_MODEL_TAG_MAX, 3);
    put_le(out + 24, h->created_at, 8);
    put_le(out + 32, h->last_used, 8);
    put_le(out + 40, h->payload_bytes, 8);
}

int kvs_header_parse(const uint8_t in[KVS_HEADER_SIZE], kvs_header *h)
{
    if (in[0] != 'K' || in[1] != 'V' || in[2] != 'C') return KVS_EMAGIC;
    h->version = in[3];
    h->quant_bits = in[4];
    h->reason = in[5];
    h->ext_flags = in[6];
    h->model_id = in[7];
    h->tokens = (uint32_t)get_le(in + 8, 4);
    h->hits = (uint32_t)get_le(in + 12, 4);
    h->ctx_size = (uint32_t)get_le(in + 16, 4);
    h->payload_abi = in[20];
    h->model_tag = (uint32_t)get_le(in + 21, 3);
    h->created_at = get_le(in + 24, 8);
    h->last_used = get_le(in + 32, 8);
    h->payload_bytes = get_le(in + 40, 8);
    if (h->version != KVS_FORMAT_VERSION) return KVS_EVERSION;
    if (h->tokens == 0) return KVS_ETOKENS;
    return KVS_OK;
}

int kvs_envelope_fits(uint64_t file_size, uint32_t text_len, uint64_t payload_bytes)
{
    /* Subtract instead of add: file_size - 52 - text_len >= payload_bytes. */
    if (file_size < KVS_PREFIX_SIZE) return KVS_ETRUNC;
    file_size -= KVS_PREFIX_SIZE;
    if (file_size < text_len) return KVS_ETRUNC;
    file_size -= text_len;
    if (file_size < payload_bytes) return KVS_ETRUNC;
    return KVS_OK;
}

/* The header fields are little-endian on disk; on a big-endian host the
 * atomic add works on a byte-swapped view through a compare-and-swap. */
static uint32_t to_le32(uint32_t v)
{
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    return __builtin_bswap32(v);
#else
    return v;
#endif
}

static uint64_t to_le64(uint64_t v)
{
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    return __builtin_bswap64(v);
#else
    return v;
#endif
}

int kvs_touch_fd(int fd, uint64_t now, uint32_t *hits_out)
{
    int rc = KVS_OK;
    struct stat st;
    uint8_t *map = MAP_FAILED;
    uint32_t *hits, old, next;
    kvs_header h;

    if (fstat(fd, &st) != 0) return -errno;
    if (!S_ISREG(st.st_mode)) return KVS_ENOTREG;
    if ((uint64_t)st.st_size < KVS_PREFIX_SIZE) return KVS_ETRUNC;
    map = mmap(NULL, KVS_HEADER_SIZE, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (map == MAP_FAILED) return -errno;
    rc = kvs_header_parse(map, &h);
    if (rc != KVS_OK) goto cleanup;

    /* Offsets 12 (u32) and 32 (u64) are naturally aligned in a page-aligned
     * map, so the hardware updates them atomically for every process that
     * maps the file.  A kill at any point leaves the old or the new value. */
    hits = (uint32_t *)(void *)(map + 12);
    old = __atomic_load_n(hits, __ATOMIC_RELAXED);
    do {
        next = to_le32(old);
        if (next != UINT32_MAX) next++;
        next = to_le32(next);
    } while (!__atomic_compare_exchange_n(hits, &old, next, 1,
                                          __ATOMIC_SEQ_CST, __ATOMIC_RELAXED));
    __atomic_store_n((uint64_t *)(void *)(map + 32), to_le64(now), __ATOMIC_SEQ_CST);
    *hits_out = to_le32(next);

cleanup:
    munmap(map, KVS_HEADER_SIZE);
    return rc;
}

int kvs_touch(const char *path, uint64_t now, uint32_t *hits_out)
{
    int rc, fd = open(path, O_RDWR | O_NOFOLLOW | O_CLOEXEC);

    if (fd < 0) return -errno;
    rc = kvs_touch_fd(fd, now, hits_out);
    close(fd);
    return rc;
}
