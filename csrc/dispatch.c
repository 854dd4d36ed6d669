/* dispatch.c: one-time set-up of tables and implementation choice. */
#include "crc32c.h"
#include "dispatch.h"
#include "io.h"
#include "quant.h"
#include "table.h"

void kvs_init(void)
{
    static int done;
    if (done) return;
    kvs_crc32c_build_tables();
    kvs_io_init();
    kvs_sha1_select(KVS_IMPL_AUTO);
    kvs_crc32c_select(KVS_IMPL_AUTO);
    kvs_table_select(KVS_IMPL_AUTO);
    kvs_quant_select(KVS_IMPL_AUTO);
    done = 1;
}
