/* packed.c: reads of packed chain blocks (see packed.h). */
#include "io.h"
#include "packed.h"
#include "table.h"

static int join(kvs_packed_piece *p, const uint8_t *stored)
{
    size_t n = p->run * p->count / p->width, at = 0;
    kvs_plane planes[KVS_PLANES_MAX];
    for (size_t k = 0; k < p->width; k++) {
        planes[k].bytes = stored + at;
        planes[k].table = p->table[k];
        if (p->lens[k] > p->stored - at) return KVS_EBADTABLE;
        if (!p->table[k] ? p->lens[k] != n : kvs_table_check(stored + at, p->lens[k], n) != 0)
            return KVS_EBADTABLE;
        at += p->lens[k];
    }
    if (at != p->stored) return KVS_EBADTABLE;
    for (size_t r = 0, first = 0; r < p->count; r++, first += p->run / p->width) {
        kvs_populate(p->dst + r * p->stride, p->run);
        kvs_table_join(p->dst + r * p->stride, planes, p->width, n, first, p->run / p->width);
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
            p->status = join(p, scratch);
        failed += p->status != 0;
    }
    return failed;
}
