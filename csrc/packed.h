/* packed.h: reads of packed chain blocks (table planes, table.h) and of
 * quantised ones (quant.h).
 *
 * The share of one I/O thread of a chain load, for its packed pieces, in
 * one call: each block's stored bytes are read into a scratch buffer (a
 * block of a real model's KV is a few hundred KiB: it stays in cache), their
 * CRC32C computed, and, when it is the one expected, the planes checked
 * (table.h: kvs_table_check) and joined, or the integers multiplied out
 * (quant.h: kvs_dequantize), into the block's runs in the destination, whose
 * pages are mapped first (io.h: kvs_populate).  Nothing lands in the
 * destination from a block whose CRC or form does not hold.
 */
#ifndef KVS_PACKED_H
#define KVS_PACKED_H

#include <stddef.h>
#include <stdint.h>

#include "planes.h"

typedef struct {
    int fd;
    uint64_t off;                   /* the stored bytes in the file */
    size_t stored;                  /* their length */
    size_t width;                   /* planes: the element's bytes */
    size_t lens[KVS_PLANES_MAX];    /* each plane's stored length */
    uint8_t table[KVS_PLANES_MAX];  /* 1: a table plane; 0: raw */
    int qbits;                      /* 8 or 4: a quantised block (quant.h), width its
                                     * dtype's bytes; 0: planes */
    int qdtype;                     /* KVS_Q_F32, KVS_Q_F16 or KVS_Q_BF16 */
    size_t group;                   /* the quantised block's group */
    uint8_t *dst;                   /* the first run */
    size_t run, count, stride;      /* count runs of run bytes, stride apart */
    uint32_t want;                  /* the stored bytes' CRC32C (when checked) */
    uint32_t crc;                   /* out: the CRC32C of the bytes read */
    int status;                     /* out: 0, KVS_ESHORT, -errno or KVS_EBADTABLE */
} kvs_packed_piece;

/* Checks a block's stored planes (len bytes, plane k of lens[k] bytes, a
 * table plane where table[k]; width of them: the element's bytes) and joins
 * them into count runs of run bytes at dst, stride apart, the runs' pages
 * mapped first.  Returns 0, or KVS_EBADTABLE (nothing written) when the
 * lengths do not add up to len, a raw plane is not one byte an element or a
 * table plane's form does not hold. */
int kvs_packed_join(const uint8_t *stored, size_t len, const uint8_t *table, const size_t *lens, size_t width,
                    uint8_t *dst, size_t run, size_t count, size_t stride);

/* Checks a quantised block's stored length (len: count runs of run bytes of
 * width-byte elements, each run whole groups of group) and multiplies it
 * out into the runs at dst, stride apart, their pages mapped first.
 * Returns 0, or KVS_EBADTABLE (nothing written) when the lengths do not
 * hold. */
int kvs_quant_join(const uint8_t *stored, size_t len, int bits, int dtype, size_t group, size_t width,
                   uint8_t *dst, size_t run, size_t count, size_t stride);

/* Reads, checks and joins every piece in order with scratch (at least the
 * largest stored length).  check_crc = 0 joins without comparing the CRC.
 * Returns the number of pieces that failed (each has its status set; a CRC
 * that is not want leaves status 0 and the destination untouched: the
 * caller compares crc with want). */
size_t kvs_read_packed(kvs_packed_piece *pieces, size_t n, uint8_t *scratch, int check_crc);

#endif
