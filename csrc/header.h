/* header.h: the 48-byte KVC envelope header (docs/format.md §2), byte-compatible
 * with ds4's .kv files, and the in-place hit update.
 *
 * This file owns the byte layout and the structural rules that make a header
 * a header (magic, version, a non-zero token count).  Policy rules (which
 * quant bits are allowed, which payload ABIs load) belong to the caller.
 */
#ifndef KVS_HEADER_H
#define KVS_HEADER_H

#include <stddef.h>
#include <stdint.h>

#define KVS_HEADER_SIZE 48
#define KVS_PREFIX_SIZE 52          /* header + u32 text length */
#define KVS_FORMAT_VERSION 1
#define KVS_MODEL_TAG_MAX 0xFFFFFFu  /* the model tag is 24 bits (ds4's reserved bytes 21..23) */

/* Status codes.  Negative errno values are also returned for OS failures. */
#define KVS_OK 0
#define KVS_EMAGIC 1001             /* not "KVC" */
#define KVS_EVERSION 1002           /* version byte != 1 */
#define KVS_ETOKENS 1003            /* token count 0 */
#define KVS_ETRUNC 1004             /* shorter than its own lengths say */
#define KVS_ENOTREG 1005            /* not a regular file */

typedef struct {
    uint8_t version;
    uint8_t quant_bits;
    uint8_t reason;
    uint8_t ext_flags;
    uint8_t model_id;
    uint32_t tokens;
    uint32_t hits;
    uint32_t ctx_size;
    uint8_t payload_abi;
    uint32_t model_tag;         /* bytes 21..23 (u24): 0 = no model fingerprint recorded */
    uint64_t created_at;
    uint64_t last_used;
    uint64_t payload_bytes;
} kvs_header;

void kvs_header_pack(const kvs_header *h, uint8_t out[KVS_HEADER_SIZE]);

/* Parses and checks magic, version and token count. */
int kvs_header_parse(const uint8_t in[KVS_HEADER_SIZE], kvs_header *h);

/* 0 when a file of file_size bytes can hold the prefix, text_len text bytes
 * and payload_bytes of payload; KVS_ETRUNC otherwise.  No overflow for any
 * input (u32 text length, u64 payload length, u64 file size). */
int kvs_envelope_fits(uint64_t file_size, uint32_t text_len, uint64_t payload_bytes);

/* Adds one hit and sets last_used = now in the header of the file at path,
 * in place through a shared memory map, with an atomic add so concurrent
 * touches from any number of processes never lose an increment.  The count
 * saturates at 2^32-1.  Symlinks are not followed.  *hits_out receives the
 * new count. */
int kvs_touch(const char *path, uint64_t now, uint32_t *hits_out);

/* kvs_touch on a file the caller has open for reading and writing: a caller
 * that has just read a checkpoint through one descriptor records the hit on
 * that same file, never on a newer one renamed over its name since.  The
 * descriptor stays open. */
int kvs_touch_fd(int fd, uint64_t now, uint32_t *hits_out);

#endif
