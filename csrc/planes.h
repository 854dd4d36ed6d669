/* planes.h: byte planes of fixed-width elements (a compressed block's filter).
 *
 * The bytes of a 16-bit float do not compress alike: the high byte (sign and
 * most of the exponent) takes few values in a tensor, the low byte (the
 * mantissa) looks random.  Gathering byte p of every element into plane p
 * gives a compressor one plane that shrinks and others it can store as they
 * are.  These two loops are the filter and its inverse; the compressor and
 * the choice of what to compress are the caller's.
 *
 * Plane p is its own buffer, planes[p], one byte per element of the whole
 * block, so a plane stored as it was can be read in place and a compressed
 * one decompressed wherever the decompressor puts it.  A call handles count
 * elements starting at element first, so a block that lies in memory as
 * several runs (a tensor's slice of tokens, one run per head) is split from,
 * or joined into, those runs one call each, without a contiguous copy.
 */
#ifndef KVS_PLANES_H
#define KVS_PLANES_H

#include <stddef.h>
#include <stdint.h>

#define KVS_PLANES_MAX 16           /* the widest element (complex128) */

/* planes[p][first + i] = src[i * width + p], for i < count, p < width.
 * The caller checks that each plane holds first + count bytes. */
void kvs_planes_split(uint8_t *const planes[], size_t first, const uint8_t *src, size_t count, size_t width);

/* dst[i * width + p] = planes[p][first + i]: kvs_planes_split's inverse. */
void kvs_planes_join(uint8_t *dst, const uint8_t *const planes[], size_t first, size_t count, size_t width);

#endif
