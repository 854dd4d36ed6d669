"""`kvstore explain DIR PROMPT_FILE`: where a prompt leaves what DIR holds.

The prompt file holds the bytes a lookup hashes: the rendered prompt (a
server's keys are its chat template's output; with --cache-salt, the
tenant's key prefix is put in front, as kvstore serve does).  The answer is
kvstore.divergence's, read without opening a store (nothing in DIR is
written) and without the model (every model's checkpoints are walked by
their stored text): the deepest stored block
that is a prefix of the prompt, the byte where the prompt parts from the
stored sequence that follows it furthest, and how much that sequence held
past it.  Text is shown only with --text: a few bytes of the prompt either
side of that byte.
"""

import functools
import json

from kvstore import codec as codec_mod
from kvstore import tenants
from kvstore.cli import keys
from kvstore.cli.local import directory
from kvstore.cli.text import UsageError
from kvstore.divergence import divergence_by_text
from kvstore.index import DirectoryIndex
from kvstore.reader import read_segment

# Bytes of the prompt shown either side of the divergence with --text.
CONTEXT_BYTES = 24


def _prompt(path, salt):
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise UsageError(f"{path}: {e.strerror or e}") from None
    if salt is None:
        return data, 0
    try:
        head = tenants.key_prefix(tenants.tag(tenants.check_salt(salt)))
    except ValueError as e:
        raise UsageError(f"--cache-salt: {e}") from None
    return head + data, len(head)


def _codec(args):
    path = keys.key_file(args)
    if path is None:
        return codec_mod.make_codec(None, None)
    keys.sealer(args)                               # a bad key file is a usage error
    from kvstore import seal
    return codec_mod.make_codec(seal.load_key(path), None, accept_unsealed=True)


def cmd_explain(args):
    d = directory(args.dir)
    data, head = _prompt(args.prompt, args.cache_salt)
    codec = _codec(args)
    # Read only, every model's files: the stored text is walked, since the
    # names of files that name their model are keyed by the model itself.
    index = DirectoryIndex(d, journal=False)
    index.refresh(force=True)
    entries = list(index.entries.values())
    found = divergence_by_text(entries, data, functools.partial(read_segment, codec))
    if found is None and keys.key_file(args) is None and any(e.key_id for e in entries):
        raise UsageError(f"{d} holds sealed checkpoints, whose text needs their key "
                         f"(--key FILE or ${keys.KEY_ENV})")
    report = None if found is None else {
        "prompt_bytes": len(data) - head, "shared_bytes": found.shared_bytes - head,
        "shared_tokens": found.shared_tokens, "byte": found.byte - head, "parted": found.parted,
        "stored_bytes": found.stored_bytes - head, "stored_tokens": found.stored_tokens}
    if report is not None and args.text:
        report["before"], report["after"] = _around(data, found.byte)
    if args.json:
        print(json.dumps(report))
    else:
        _print(report, len(data) - head)
    return 0


def _around(data, byte):
    """The prompt's bytes either side of byte, as text (undecodable bytes as \\x escapes)."""
    show = lambda b: b.decode("utf-8", "backslashreplace")        # noqa: E731
    return show(data[max(0, byte - CONTEXT_BYTES):byte]), show(data[byte:byte + CONTEXT_BYTES])


def _print(r, n):
    if r is None:
        print(f"no stored block is a prefix of the prompt ({n} bytes): nothing shares its first block")
        return
    print(f"shared: {r['shared_tokens']} tokens, the first {r['shared_bytes']} of {n} bytes "
          "(the deepest stored block that is a prefix of the prompt)")
    if r["parted"]:
        print(f"parted at byte {r['byte']}: the stored sequence through that point holds {r['stored_tokens']} "
              f"tokens ({r['stored_bytes']} bytes), {r['stored_bytes'] - r['byte']} bytes of them past it")
    else:
        print(f"the prompt goes on past the end of what is stored (byte {r['byte']}); nothing stored parts from it")
    if "before" in r:
        print(f"text: {r['before']!r} | {r['after']!r}")


def add_parsers(sub):
    """`kvstore explain`."""
    s = sub.add_parser("explain", help="where a prompt leaves the checkpoints DIR holds (a miss explained)")
    s.add_argument("dir", metavar="DIR")
    s.add_argument("prompt", metavar="PROMPT_FILE", help="the prompt's bytes as a lookup sees them (rendered)")
    s.add_argument("--text", action="store_true",
                   help=f"show {CONTEXT_BYTES} bytes of the prompt either side of where it parts")
    s.add_argument("--cache-salt", metavar="SALT", help="the tenant's cache_salt of a kvstore serve directory")
    s.add_argument("--json", action="store_true", help="one JSON object (null: nothing shared)")
    keys.add_key_argument(s)
    s.set_defaults(func=cmd_explain)
