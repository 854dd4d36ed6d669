/* io.c: chunked pread/pwrite with CRC32C on the fly. */
#define _POSIX_C_SOURCE 200809L
#define _DEFAULT_SOURCE 1
#define _DARWIN_C_SOURCE 1

#include <errno.h>
#include <unistd.h>

#include "crc32c.h"
#include "io.h"

/* Reads go in 1 MiB chunks: large enough that a syscall per chunk costs
 * nothing, small enough that the CRC pass finds the chunk still in cache.
 * Writes go in 8 MiB chunks: every write takes the file's lock in the
 * kernel, and the writer usually leaves the CRC to another thread. */
#define READ_CHUNK (1u << 20)
#define WRITE_CHUNK (8u << 20)

int kvs_pread_full(int fd, uint8_t *buf, size_t len, uint64_t off, uint32_t *crc)
{
    while (len) {
        size_t want = len < READ_CHUNK ? len : READ_CHUNK;
        ssize_t got = pread(fd, buf, want, (off_t)off);
        if (got < 0) {
            if (errno == EINTR) continue;
            return -errno;
        }
        if (got == 0) return KVS_ESHORT;
        if (crc) *crc = kvs_crc32c(*crc, buf, (size_t)got);
        buf += got; len -= (size_t)got; off += (uint64_t)got;
    }
    return 0;
}

int kvs_pwrite_full(int fd, const uint8_t *buf, size_t len, uint64_t off, uint32_t *crc)
{
    while (len) {
        size_t want = len < WRITE_CHUNK ? len : WRITE_CHUNK;
        ssize_t put = pwrite(fd, buf, want, (off_t)off);
        if (put < 0) {
            if (errno == EINTR) continue;
            return -errno;
        }
        if (put == 0) return -EIO;
        /* CRC what reached the file, while it is still in cache. */
        if (crc) *crc = kvs_crc32c(*crc, buf, (size_t)put);
        buf += put; len -= (size_t)put; off += (uint64_t)put;
    }
    return 0;
}
