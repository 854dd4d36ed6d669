/* Reference vectors of ds4's checkpoint files, written and read back by ds4's own code.
 *
 * Built by tests/ds4/generate.py against a ds4 checkout, with server_part.c
 * and agent_part.c (ds4_server.c and ds4_agent.c with their main() renamed;
 * engine symbols the calls never reach stay unresolved).  Writes into the
 * directory argv[1]:
 *
 *   <sha1>.kv     a ds4-server checkpoint, named by the SHA1 of its text:
 *                 ds4_kvstore_fill_header, the text,
 *                 an opaque payload, then the KTM tool map ds4-server writes
 *                 for the DSML tool block in the text;
 *   <sha1>.kv     a ds4-agent session (reason agent-session), named as ds4
 *                 names one: the SHA1 of its rendered transcript;
 *   expected.txt  key=value lines: what ds4's own readers make of them.
 */

#include "ds4_kvstore.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int vec_tool_map_write(FILE *fp, const char *text, const char *block, const char **ids, int n);
int vec_tool_map_load(FILE *fp);
const char *vec_dsml_block_start(void);
const char *vec_dsml(void);
char *vec_session_title(const char *path);

static const char SESSION_TEXT[] =
    "<\xef\xbd\x9c" "begin\xe2\x96\x81of\xe2\x96\x81sentence\xef\xbd\x9c>You are a coding agent."
    "<\xef\xbd\x9cUser\xef\xbd\x9c>  Refactor the   io module so that every read goes through one"
    " buffered helper and nothing else changes  <\xef\xbd\x9c" "Assistant\xef\xbd\x9c></think>Done.";

static void write_file(const char *path, uint8_t reason, uint8_t ext, const char *text,
                       const char *block, const char **ids, int n) {
    FILE *fp = fopen(path, "wb");
    uint8_t h[DS4_KVSTORE_FIXED_HEADER], tb[4];
    const uint64_t payload = 96;
    ds4_kvstore_fill_header(h, 4, reason, ext, 42, 3, 32768, 1764000000ull, 1764000100ull, payload);
    ds4_kvstore_le_put32(tb, (uint32_t)strlen(text));
    fwrite(h, 1, sizeof(h), fp);
    fwrite(tb, 1, sizeof(tb), fp);
    fwrite(text, 1, strlen(text), fp);
    for (uint64_t i = 0; i < payload; i++) fputc((int)((i * 7u + 3u) & 0xffu), fp);
    if (n && vec_tool_map_write(fp, text, block, ids, n) <= 0) {
        fprintf(stderr, "ds4's tool map writer wrote nothing\n");
        exit(1);
    }
    fclose(fp);
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s OUTDIR\n", argv[0]);
        return 2;
    }
    const char *d = vec_dsml();
    char text[2048], path[4096], sha[41];
    snprintf(text, sizeof(text),
             "<\xef\xbd\x9c" "begin\xe2\x96\x81of\xe2\x96\x81sentence\xef\xbd\x9c>You read files."
             "<\xef\xbd\x9cUser\xef\xbd\x9c>Open a.py<\xef\xbd\x9c" "Assistant\xef\xbd\x9c></think>"
             "%s\n<%sinvoke name=\"read_file\">\n<%sparameter name=\"path\" string=\"true\">a.py</%sparameter>\n"
             "</%sinvoke>\n</%stool_calls>", vec_dsml_block_start(), d, d, d, d, d);
    const char *block = strstr(text, vec_dsml_block_start());
    const char *ids[] = {"toolu_01ds4vector", "call_second_id"};

    char server_sha[41];
    ds4_kvstore_sha1_bytes_hex(text, strlen(text), server_sha);
    snprintf(path, sizeof(path), "%s/%s.kv", argv[1], server_sha);
    write_file(path, DS4_KVSTORE_REASON_COLD, DS4_KVSTORE_EXT_TOOL_MAP | DS4_KVSTORE_EXT_THINKING_VISIBLE,
               text, block, ids, 2);
    FILE *fp = fopen(path, "rb");
    ds4_kvstore_entry e = {0};
    uint32_t text_bytes = 0;
    if (!ds4_kvstore_read_header(fp, &e, &text_bytes)) return 1;
    fseeko(fp, (off_t)(text_bytes + e.payload_bytes), SEEK_CUR);
    int loaded = vec_tool_map_load(fp);
    fclose(fp);

    ds4_kvstore_sha1_bytes_hex(SESSION_TEXT, strlen(SESSION_TEXT), sha);
    snprintf(path, sizeof(path), "%s/%s.kv", argv[1], sha);
    write_file(path, DS4_KVSTORE_REASON_AGENT_SESSION, 0, SESSION_TEXT, NULL, NULL, 0);
    char *title = vec_session_title(path);

    /* A second session whose 70th title byte follows a space (ds4 drops it). */
    char quirk[512];
    snprintf(quirk, sizeof(quirk), "<\xef\xbd\x9cUser\xef\xbd\x9c>%s  yz and more words here"
             "<\xef\xbd\x9c" "Assistant\xef\xbd\x9c>", "abcdefghij abcdefghij abcdefghij abcdefghij "
             "abcdefghij abcdefghij abc");
    char quirk_sha[41];
    ds4_kvstore_sha1_bytes_hex(quirk, strlen(quirk), quirk_sha);
    snprintf(path, sizeof(path), "%s/%s.kv", argv[1], quirk_sha);
    write_file(path, DS4_KVSTORE_REASON_AGENT_SESSION, 0, quirk, NULL, NULL, 0);
    char *quirk_title = vec_session_title(path);

    snprintf(path, sizeof(path), "%s/expected.txt", argv[1]);
    fp = fopen(path, "w");
    fprintf(fp, "server.sha=%s\n", server_sha);
    fprintf(fp, "server.quant_bits=%u\nserver.reason=%u\nserver.ext_flags=%u\nserver.tokens=%u\n",
            e.quant_bits, e.reason, e.ext_flags, e.tokens);
    fprintf(fp, "server.text_bytes=%u\nserver.payload_bytes=%llu\n", text_bytes,
            (unsigned long long)e.payload_bytes);
    fprintf(fp, "server.tool_map_loaded=%d\nserver.tool_ids=%s,%s\n", loaded, ids[0], ids[1]);
    fprintf(fp, "session.sha=%s\nsession.title=%s\n", sha, title);
    fprintf(fp, "session2.sha=%s\nsession2.title=%s\n", quirk_sha, quirk_title);
    fclose(fp);
    free(title);
    free(quirk_title);
    return 0;
}
