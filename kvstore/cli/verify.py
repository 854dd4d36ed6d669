"""`kvstore verify`: every file checked as a load would check it; --quarantine moves the bad ones aside.

The checks are the library's: kvstore.files.verify_file for a plain file,
kvstore.seal.Sealer.verify_file for a file sealed with the given key.  A
file with a foreign payload ABI (or sealed with another key) is checked to
its envelope only.  Without --quarantine nothing in the directory changes.
"""

import os
import sys

from kvstore import files
from kvstore.cli import keys, text
from kvstore.cli.local import directory
from kvstore.errors import CheckpointMissing, KVStoreError
from kvstore.files import QUARANTINE_DIR, checkpoint_names, describe_error
from kvstore.format import read_entry


def sizes(d):
    """name -> size of every checkpoint-named file in d, in name order (the total the bar counts to)."""
    out = {}
    for name in checkpoint_names(d):
        try:
            out[name] = os.lstat(os.path.join(d, name)).st_size
        except FileNotFoundError:
            pass
    return out


def check(path, sealer, progress):
    """Checks one file.

    Returns:
        (None or the one-line reason it is bad, whether a sound file is
        loadable here: this build's payload ABI, or sealed with this key).

    Raises:
        CheckpointMissing, FileNotFoundError: the file went away meanwhile.
    """
    try:
        e = read_entry(path)
    except CheckpointMissing:
        raise
    except (KVStoreError, OSError) as err:
        return describe_error(err), False
    if sealer is not None and sealer.owns(e):
        return sealer.verify_file(path, progress), True
    return (files.verify_file(path, progress) if e.loadable else None), e.loadable


def quarantine(d, path, before):
    """Moves a bad file aside, unless it was replaced since it was checked.

    Returns:
        (moved, what happened in a few words).
    """
    try:
        if not files.same_file(path, before):
            if not os.path.lexists(path):
                return False, "gone meanwhile"
            return False, "kept: replaced while it was checked"
        files.quarantine(path, d)               # never into a planted symlink
    except FileNotFoundError:
        return False, "gone meanwhile"
    except OSError as e:
        return False, f"kept: {os.strerror(e.errno) if e.errno else e}"
    return True, f"moved to {QUARANTINE_DIR}/"


def summary(d, checked, ok, foreign, bad):
    parts = [f"{ok} ok"]
    if foreign:
        parts.append(f"{foreign} foreign payload ABI (envelope only)")
    parts.append(f"{bad} corrupt")
    return f"verified {checked} file{'s' if checked != 1 else ''} in {d}: " + ", ".join(parts)


def cmd_verify(args):
    d = directory(args.dir)
    sealer = keys.sealer(args)
    todo = sizes(d)
    bar = text.Progress(sum(todo.values()), "verify", args.progress or sys.stderr.isatty())
    checked = ok = foreign = moved = done = 0
    bad = []
    for name, size in todo.items():
        bar.reach(done)
        done += size
        path = os.path.join(d, name)
        try:
            before = os.lstat(path)
            reason, loadable = check(path, sealer, bar.advance)
        except (CheckpointMissing, FileNotFoundError):
            continue                    # deleted while we checked: nothing to verify
        checked += 1
        bar.files = checked
        if reason is None:
            if loadable:
                ok += 1
            else:
                foreign += 1
            continue
        bad.append(name)
        note = ""
        if args.quarantine:
            went, what = quarantine(d, path, before)
            moved += went
            note = f"  ({what})"
        bar.clear()
        print(f"{name}: {reason}{note}", flush=True)
    bar.close()
    print(summary(d, checked, ok, foreign, len(bad)))
    if args.quarantine and bad:
        print(f"moved {moved} to {os.path.join(d, QUARANTINE_DIR)}")
    return 1 if bad else 0


def add_parsers(sub):
    """`kvstore verify`."""
    s = sub.add_parser("verify", help="check every envelope and payload CRC")
    s.add_argument("dir", metavar="DIR")
    s.add_argument("--quarantine", action="store_true", help=f"move bad files to DIR/{QUARANTINE_DIR}")
    s.add_argument("--progress", action="store_true", help="show the progress bar even when stderr is not a terminal")
    keys.add_key_argument(s)
    s.set_defaults(func=cmd_verify)
