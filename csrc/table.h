/* table.h: table planes, a byte plane stored as 4-bit codes into 16 values.
 *
 * The high byte plane of a 16-bit float KV tensor (planes.h: the sign and
 * seven exponent bits of bfloat16) takes few values: in a block of a KV
 * cache the 16 most common cover all but a few in ten thousand.  A table
 * plane stores each byte as the index of its value in a 16-entry table,
 * two indices a byte, and lists the bytes that are not in the table as
 * exceptions.  Rebuilding a block is then a table lookup per byte, which
 * SSSE3 (pshufb) and NEON (tbl) do sixteen at a time: a block is joined at
 * the pace of a copy, where an entropy coder (zstd decodes the same plane at
 * about 1 GB/s a core here) would cost more than the bytes it saves.
 *
 * The stored form of a plane of n bytes with E exceptions, 20 + ceil(n/2)
 * + 5E bytes (KVS_TABLE_SIZE):
 *
 *   16 bytes   the table: value of code 0, 1, ... 15
 *   u32 LE     E
 *   ceil(n/2)  the codes: byte i of the plane has the code in the low
 *              nibble of code byte i/2 when i is even, the high nibble when
 *              odd (a last odd nibble is 0)
 *   E u32 LE   the exceptions' places in the plane, strictly increasing
 *   E bytes    their values
 *
 * Byte i of the plane is table[code i], then each exception (place, value)
 * sets byte place to value; an exception's code is 15.  Any table makes a
 * valid plane; the writer draws its table from a sample of the plane, most
 * common values first.
 */
#ifndef KVS_TABLE_H
#define KVS_TABLE_H

#include <stddef.h>
#include <stdint.h>

#define KVS_TABLE_HEAD 20
#define KVS_TABLE_SIZE(n, e) (KVS_TABLE_HEAD + ((n) + 1) / 2 + 5 * (e))
#define KVS_EBADTABLE 1020          /* a table plane's form does not hold */

/* plane (n bytes) in its stored form into out, which has room for
 * KVS_TABLE_SIZE(n, max_exceptions) bytes; returns the stored size, or 0
 * when the plane has more than max_exceptions exceptions (out then holds
 * nothing of use) or is empty.  The table is drawn from a sample of the
 * plane, most common values first. */
size_t kvs_table_pack(const uint8_t *plane, size_t n, size_t max_exceptions, uint8_t *out);

/* 0 when stored (len bytes) is a table plane of n bytes: its length says its
 * exception count, whose places are strictly increasing, inside the plane and
 * coded 15; else KVS_EBADTABLE.  The joins below read only checked planes. */
int kvs_table_check(const uint8_t *stored, size_t len, size_t n);

/* One plane of a block for the join: a plane stored as it is (table 0), or a
 * checked table plane's stored form (table 1). */
typedef struct {
    const uint8_t *bytes;
    int table;
} kvs_plane;

/* dst[i * width + p] = byte first + i of plane p, for i < count: elements
 * first .. first + count - 1 of a block of n elements rebuilt from its planes
 * (planes.h's join, with table planes decoded on the way in cache-sized
 * steps, then their exceptions set; a 16-bit block whose low plane is raw
 * and whose high plane is a table plane, in one fused pass). */
void kvs_table_join(uint8_t *dst, const kvs_plane planes[], size_t width, size_t n, size_t first, size_t count);

/* The decoder: portable C, SSSE3 on x86-64, NEON on arm64.  select returns 0,
 * or -1 when impl cannot run here (the selection stays); the impl values are
 * dispatch.h's (KVS_IMPL_X86 for SSSE3, KVS_IMPL_ARM for NEON). */
int kvs_table_select(int impl);
int kvs_table_has(int impl);
const char *kvs_table_impl_name(void);

#endif
