/* crc32c.h: CRC32C (Castagnoli, the iSCSI/ext4 polynomial) for payload blocks.
 *
 * Every block of a checkpoint payload carries a CRC32C that is checked while
 * the block streams in, so the CRC must run far faster than the disk: the
 * hardware paths (SSE4.2 crc32, ARMv8 crc32c*) run three independent streams
 * to hide the instruction's latency and join them with a precomputed shift.
 *
 * Values are the standard (pre- and post-inverted) CRC, so
 * kvs_crc32c(kvs_crc32c(0, a), b) == kvs_crc32c(0, a || b).
 */
#ifndef KVS_CRC32C_H
#define KVS_CRC32C_H

#include <stddef.h>
#include <stdint.h>

uint32_t kvs_crc32c(uint32_t crc, const uint8_t *data, size_t len);

/* CRC of a || b from crc(a), crc(b) and len(b): lets parallel readers CRC
 * their own slices of one block. */
uint32_t kvs_crc32c_combine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b);

/* Fills the lookup tables; called once by kvs_init(). */
void kvs_crc32c_build_tables(void);

#endif
