"""`kvstore session list`: the saved agent sessions of a directory, newest first (kvstore.sessions)."""

import json
import time

from kvstore import sessions
from kvstore.cli import keys, text
from kvstore.cli.local import directory
from kvstore.files import scan_directory


def cmd_session_list(args):
    d = directory(args.dir)
    found = sessions.from_entries(scan_directory(d)[0], keys.sealer(args), text=args.text)
    now = int(time.time())
    if args.json:
        print(json.dumps([{
            "sha": s.sha, "prefix": s.prefix, "title": s.title, "tokens": s.tokens, "hits": s.hits,
            "created_at": s.created_at, "last_used": s.last_used, "model_id": s.model_id,
            "file_size": s.file_size, "ds4": s.ds4,
        } for s in found], indent=2, ensure_ascii=False))
        return 0
    if not found:
        print(f"no agent sessions in {d}")
        return 0
    rows = [(s.prefix, text.printable(s.title, text.TITLE_COLUMN) or ("(ds4)" if s.ds4 else "-"), s.tokens, s.hits,
             "never" if not s.last_used else text.span(now - s.last_used) + " ago",
             text.age(s.created_at, now)) for s in found]
    print(text.table(rows, ("SHA", "TITLE", "TOKENS", "HITS", "USED", "AGE"), right={2, 3}))
    return 0


def add_parsers(sub):
    """`kvstore session list`."""
    s = sub.add_parser("session", help="agent sessions")
    ss = s.add_subparsers(dest="session_command", metavar="SUBCOMMAND", required=True)
    s = ss.add_parser("list", help="saved agent sessions, newest first")
    s.add_argument("dir", metavar="DIR")
    s.add_argument("--json", action="store_true")
    s.add_argument("--text", action="store_true",
                   help="title ds4-agent's sessions as its /list does: their first user turn (prompt text)")
    keys.add_key_argument(s)
    s.set_defaults(func=cmd_session_list)
