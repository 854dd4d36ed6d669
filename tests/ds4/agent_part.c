/* ds4_agent.c's session title behind a plain function (tests/ds4/gen_vectors.c).
 * Its main() is renamed; nothing else is changed. */
#define main ds4_agent_main
#include "ds4_agent.c"
#undef main

/* The title ds4-agent's /list shows for a session file. */
char *vec_session_title(const char *path) { return agent_session_title_from_file(path); }
