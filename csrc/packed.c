/* packed.c: reads of packed chain blocks (see packed.h). */
#include "io.h"
#include "packed.h"
#include "quant.h"
#include "table.h"

int kvs_packed_join(const uint8_t *stored, size_t len, const uint8_t *table, const size_t *lens, size_t width,
                    uint8_t *dst, size_t run, size_t count, size_t stride)
{
    size_t n = run * count / width, at = 0;
    kvs_plane planes[KVS_PLANES_MAX];
    for (size_t k = 0; k < width; k++) {
        planes[k].bytes = stored + at;
        planes[k].table = table[k];
        if (lens[k] > len - at) return KVS_EBADTABLE;
        if (!table[k] ? lens[k] != n : kvs_table_check(stored + at, lens[k], n) != 0)
            return KVS_EBADTABLE;
        at += lens[k];
    }
    if (at != len) return KVS_EBADTABLE;
    for (size_t r = 0, first = 0; r < count; r++, first += run / width) {
        kvs_populate(dst + r * stride, run);
        kvs_table_join(dst + r * stride, planes, width, n, first, run / width);
    }
    return 0;
}

int kvs_quant_join(const uint8_t *stored, size_t len, int bits, int dtype, size_t group, size_t width,
                   uint8_t *dst, size_t run, size_t count, size_t stride)
{
    if ((bits != 8 && bits != 4) || !width || !group || run % width) return KVS_EBADTABLE;
    size_t per = run / width, n = per * count, groups = per / group;
    if (per % group || len != n * (size_t)bits / 8 + 2 * (n / group) * width) return KVS_EBADTABLE;
    const uint8_t *q = stored, *scales = stored + n * (size_t)bits / 8, *biases = scales + (n / group) * width;
    for (size_t r = 0; r < count; r++) {
        uint8_t *out = dst + r * stride;
        kvs_populate(out, run);
        kvs_dequantize(q + r * per * (size_t)bits / 8, scales + r * groups * width, biases + r * groups * width,
                       per, dtype, bits, group, out);
    }
    return 0;
}

size_t kvs_read_packed(kvs_packed_piece *pieces, size_t n, uint8_t *scratch, int check_crc)
{
    size_t failed = 0;
    for (size_t i = 0; i < n; i++) {
        kvs_packed_piece *p = &pieces[i];
        p->crc = 0;
        p->status = kvs_pread_full(p->fd, scratch, p->stored, p->off, &p->crc);
        if (p->status == 0 && (!check_crc || p->crc == p->want))
            p->status = p->qbits ? kvs_quant_join(scratch, p->stored, p->qbits, p->qdtype, p->group, p->width,
                                                  p->dst, p->run, p->count, p->stride)
                                 : kvs_packed_join(scratch, p->stored, p->table, p->lens, p->width, p->dst,
                                                   p->run, p->count, p->stride);
        failed += p->status != 0;
    }
    return failed;
}
