/* io.h: payload streaming between files and caller-owned memory.
 *
 * The payload of a checkpoint is read straight into the destination arrays
 * and written straight from the source arrays, in chunks small enough to
 * stay in cache, with the CRC32C computed on each chunk while it is hot.
 * Callers run several of these at once on disjoint ranges (threads with the
 * GIL released) and join the CRCs with kvs_crc32c_combine().
 */
#ifndef KVS_IO_H
#define KVS_IO_H

#include <stddef.h>
#include <stdint.h>

#define KVS_ESHORT 1010             /* end of file before len bytes */

/* Probes what the kernel offers the reads (called once by kvs_init()). */
void kvs_io_init(void);

/* 1 when reads map each chunk's pages with MADV_POPULATE_WRITE before
 * filling it (Linux 5.14 and later), 0 when the read faults them in. */
int kvs_io_prefaults(void);

/* Turns prefaulting on (where the kernel has it) or off, for tests and
 * KVSTORE_PORTABLE; returns kvs_io_prefaults().  Not thread-safe: call it
 * while no read runs. */
int kvs_io_set_prefault(int on);

/* Reads len bytes at offset off into buf; *crc (if not NULL) is updated with
 * the CRC32C of the bytes read.  Returns 0, KVS_ESHORT or -errno. */
int kvs_pread_full(int fd, uint8_t *buf, size_t len, uint64_t off, uint32_t *crc);

/* Reads count runs of run bytes, consecutive in the file from offset off,
 * into buf, buf + stride, buf + 2 * stride, ...: one block's slice of a
 * tensor laid out [outer, tokens, inner], read straight into its place in
 * the whole tensor.  *crc (if not NULL) covers the file bytes in order.
 * The caller checks that (count - 1) * stride + run fits its buffer.
 * Returns 0, KVS_ESHORT or -errno. */
int kvs_pread_strided(int fd, uint8_t *buf, size_t run, size_t count, size_t stride,
                      uint64_t off, uint32_t *crc);

/* Allocates the first len bytes of a new file's blocks (the size becomes
 * len).  Returns 0 or -errno: -EOPNOTSUPP where the filesystem or system
 * cannot (the caller writes as usual), -ENOSPC, -EDQUOT or -EFBIG where the
 * file does not fit. */
int kvs_preallocate(int fd, uint64_t len);

/* Writes len bytes from buf at offset off; *crc (if not NULL) is updated.
 * Returns 0 or -errno (ENOSPC, EFBIG, EIO ...). */
int kvs_pwrite_full(int fd, const uint8_t *buf, size_t len, uint64_t off, uint32_t *crc);

#endif
