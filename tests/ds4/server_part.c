/* ds4_server.c's tool-map writer and loader behind two plain functions
 * (tests/ds4/gen_vectors.c).  Its main() is renamed; nothing else is changed. */
#define main ds4_server_main
#include "ds4_server.c"
#undef main

/* Writes the KTM tool map ds4-server writes after a checkpoint's payload
 * for text, with ids[0..n) remembered for the DSML block block. */
int vec_tool_map_write(FILE *fp, const char *text, const char *block, const char **ids, int n) {
    static server s;
    memset(&s, 0, sizeof(s));
    pthread_mutex_init(&s.tool_mu, NULL);
    for (int i = 0; i < n; i++) tool_memory_put_source(&s, ids[i], block, TOOL_MEMORY_RAM);
    uint64_t written = 0;
    return kv_tool_map_write(&s, fp, text, &written) ? (int)written : -1;
}

/* How many tool-map entries ds4-server's loader takes from fp's position. */
int vec_tool_map_load(FILE *fp) {
    static server s;
    memset(&s, 0, sizeof(s));
    pthread_mutex_init(&s.tool_mu, NULL);
    return kv_tool_map_load_from_pos(&s, fp, NULL);
}

const char *vec_dsml_block_start(void) { return "\n\n" DS4_TOOL_CALLS_START; }
const char *vec_dsml(void) { return DS4_DSML; }
