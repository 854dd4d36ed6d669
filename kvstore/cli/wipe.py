"""`kvstore wipe`: overwrite then delete one checkpoint (and the blocks after it), or all of them.

Valid checkpoints go through KVStore.wipe; a full wipe also takes the files
that hold prompt text without being valid checkpoints (a bad envelope, the
quarantine), since wiping is about that text.
"""

import os

from kvstore import files
from kvstore.cli.local import directory, match, open_store
from kvstore.cli.text import UsageError
from kvstore.files import QUARANTINE_DIR, checkpoint_names


def cmd_wipe(args):
    d = directory(args.dir)
    names = checkpoint_names(d)
    qdir = os.path.join(d, QUARANTINE_DIR)
    quarantined = []
    if args.prefix is not None:
        targets = [os.path.join(d, match(names, args.prefix, d))]
        what = f"checkpoint {os.path.basename(targets[0])[:12]}"
    else:
        targets = [os.path.join(d, n) for n in names]
        if os.path.isdir(qdir) and not os.path.islink(qdir):
            quarantined = [os.path.join(qdir, n) for n in checkpoint_names(qdir)]
        what = f"all {len(targets)} checkpoint file{'s' if len(targets) != 1 else ''}"
        if quarantined:
            what += f" and {len(quarantined)} in {QUARANTINE_DIR}"
    if not args.yes:
        raise UsageError(f"wipe overwrites and deletes {what} in {d}; add --yes to confirm")
    store = open_store(d)
    try:
        valid = {e.name: e for e in store.entries()}
        n = 0
        for path in targets:
            e = valid.get(os.path.basename(path))
            n += store.wipe(e) if e is not None else files.wipe_file(path)
    finally:
        store.close()
    q = sum(files.wipe_file(path) for path in quarantined)
    print(f"wiped {n} checkpoint file{'s' if n != 1 else ''} in {d}"
          + (f" and {q} in {QUARANTINE_DIR}" if quarantined else ""))
    return 0


def add_parsers(sub):
    """`kvstore wipe`."""
    s = sub.add_parser("wipe", help="overwrite then delete one checkpoint, or all")
    s.add_argument("dir", metavar="DIR")
    s.add_argument("prefix", metavar="SHA-PREFIX", nargs="?")
    s.add_argument("--yes", action="store_true", help="really do it")
    s.set_defaults(func=cmd_wipe)
