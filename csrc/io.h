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

/* Maps the pages of buf[0, len) for writing in one call where reads
 * prefault (kvs_io_prefaults()), as a read does before it fills them: for
 * code that fills fresh memory itself (a packed block's join).  Nothing
 * elsewhere. */
void kvs_populate(uint8_t *buf, size_t len);

/* Reads len bytes at offset off into buf; *crc (if not NULL) is updated with
 * the CRC32C of the bytes read.  Returns 0, KVS_ESHORT or -errno. */
int kvs_pread_full(int fd, uint8_t *buf, size_t len, uint64_t off, uint32_t *crc);

/* One read of a batch: count runs of run bytes, consecutive in the file at
 * off, landing at dst, dst + stride, ...  The CRC32C of the file bytes read
 * goes to crc (continuing from its value) and the status to status: 0,
 * KVS_ESHORT or -errno. */
typedef struct {
    int fd;
    uint64_t off;
    size_t run;
    size_t count;
    size_t stride;
    uint8_t *dst;
    uint32_t crc;
    int status;
} kvs_piece;

/* Reads every piece in order (a chain load's share of one thread: many
 * small strided reads in one call, without returning to the caller between
 * them).  Consecutive runs of a piece go in one preadv() of up to
 * KVS_PIECE_IOV runs, each run's pages prefaulted first.  with_crc = 0
 * leaves every crc as it is.  Returns the number of pieces that failed (each
 * has its status set). */
#define KVS_PIECE_IOV 64
size_t kvs_pread_pieces(kvs_piece *pieces, size_t n, int with_crc);

/* Copies count runs of run bytes, consecutive in src, to dst every stride
 * bytes (a sealed chain block's rows, decrypted in a scratch chunk, to their
 * places in a tensor); each destination run's pages are mapped first, as a
 * read maps them.  The caller checks that the runs fit both buffers. */
void kvs_copy_runs(uint8_t *dst, const uint8_t *src, size_t run, size_t count, size_t stride);

/* Allocates the first len bytes of a new file's blocks (the size becomes
 * len).  Returns 0 or -errno: -EOPNOTSUPP where the filesystem or system
 * cannot (the caller writes as usual), -ENOSPC, -EDQUOT or -EFBIG where the
 * file does not fit. */
int kvs_preallocate(int fd, uint64_t len);

/* Writes len bytes from buf at offset off; *crc (if not NULL) is updated.
 * Returns 0 or -errno (ENOSPC, EFBIG, EIO ...). */
int kvs_pwrite_full(int fd, const uint8_t *buf, size_t len, uint64_t off, uint32_t *crc);

/* A buffer of a vectored write. */
typedef struct {
    const uint8_t *buf;
    size_t len;
} kvs_span;

/* Writes n spans one after another from off (a vectored write per
 * KVS_PIECE_IOV spans where the platform has one), then the CRC32C of each
 * span still in cache when crc is not NULL; 0 or -errno. */
int kvs_pwrite_spans(int fd, const kvs_span *spans, size_t n, uint64_t off, uint32_t *crc);

#endif
