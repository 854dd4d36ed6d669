"""The `kvstore` command line: look after a directory of checkpoints.

    kvstore ls DIR [--json] [--budget-mb N]       one row per checkpoint, best kept first
    kvstore inspect FILE|SHA-PREFIX [--dir DIR] [--text]
    kvstore verify DIR [--quarantine] [--progress]
    kvstore evict DIR --budget-mb N [--dry-run]
    kvstore stats DIR [--json] [--budget-mb N]
    kvstore wipe DIR [SHA-PREFIX] --yes
    kvstore session list DIR [--json]
    kvstore ls --remote s3://BUCKET/PREFIX [--endpoint-url URL] [--json]
    kvstore remote gc --remote s3://BUCKET/PREFIX --budget-gb N [--dry-run]

What this module owns: argument parsing, the read-only directory scan and the
text and JSON layouts.  The rules themselves stay where they live (the
eviction score in policy.py, eviction, wipe and the file checks in
store.py, sessions in sessions.py).

The listing commands (ls, inspect, stats, session list, verify without
--quarantine, evict --dry-run) never write to the directory: they read the
envelopes themselves instead of opening a KVStore, whose constructor evicts
down to its budget and removes stale temporary files.

The prompt text in each file is prompt content (SPEC section 12): only
`inspect --text` prints it.  Session titles are labels a person gave, and are
shown with control characters replaced.

Exit status: 0 success; 1 a corrupt checkpoint was found (verify, inspect) or
the disk failed; 2 a usage error (missing directory, unknown or ambiguous
prefix, bad number, wipe without --yes).  Errors are one line on stderr,
``kvstore: error: ...``; set KVSTORE_DEBUG=1 to see the traceback of an
unexpected one.
"""

import argparse
import collections
import json
import logging
import math
import os
import sys
import time
import unicodedata

from kvstore import __version__, policy, sessions
from kvstore import remote as remote_mod
from kvstore.errors import CheckpointMissing, CorruptCheckpoint, KVStoreError, UnsafePath
from kvstore.format import (ExtFlag, Reason, entry_from_fd, is_checkpoint_name, open_checkpoint,
                            read_entry)
from kvstore.payload import read_manifest
from kvstore.store import (DEFAULT_BUDGET_MB, QUARANTINE_DIR, KVStore, move_aside, section_crc,
                           trailer_sections, verify_file, wipe_file)

PROG = "kvstore"

# Titles are shown whole in `inspect` and cut to this many characters in
# table rows, so one long label cannot push the other columns off screen.
TITLE_COLUMN = 40

# The progress bar redraws at most this often: a terminal that repaints for
# every 4 MiB chunk would spend more time drawing than verifying.
PROGRESS_INTERVAL_S = 0.1
PROGRESS_WIDTH = 30

log = logging.getLogger("kvstore")


class UsageError(Exception):
    """A mistake in the command line or its arguments: exit status 2."""


class _Parser(argparse.ArgumentParser):
    """argparse, but an error is one line (no usage dump) and never exits by itself."""

    def error(self, message):
        raise UsageError(message)


# ---- small formatting helpers -----------------------------------------------

def _reason_name(reason):
    return Reason(reason).name.lower().replace("_", "-")


def _flag_names(flags):
    flags = int(flags)
    names = [f.name.lower().replace("_", "-") for f in ExtFlag if flags & f]
    unknown = flags & ~sum(int(f) for f in ExtFlag)
    if unknown:
        names.append(f"unknown-0x{unknown:02x}")
    return names


def _size(n):
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _span(seconds):
    seconds = max(0, int(seconds))
    for unit, width in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= width:
            return f"{seconds // width}{unit}"
    return f"{seconds}s"


def _age(t, now):
    return "?" if not t else _span(now - t)


def _used(e, now):
    return "never" if not e.last_used else _span(now - e.last_used) + " ago"


def _stamp(t, now):
    if not t:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) + f" ({_span(now - t)} ago)"


def _printable(s, limit=None):
    """A user label made safe for a terminal: control characters become '?'."""
    if s is None:
        return ""
    s = "".join("?" if unicodedata.category(c).startswith("C") else c for c in s)
    if limit is not None and len(s) > limit:
        s = s[:limit - 1] + "…"
    return s


def _abi(e):
    return str(e.payload_abi) if e.loadable else f"{e.payload_abi}(foreign)"


def _table(rows, header, right=()):
    """Left-aligned columns (right-aligned where named), two spaces apart."""
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    out = []
    for r in [header] + rows:
        cells = [str(c).rjust(w) if i in right else str(c).ljust(w)
                 for i, (c, w) in enumerate(zip(r, widths))]
        out.append("  ".join(cells).rstrip())
    return "\n".join(out)


def _budget_line(total, budget):
    if not budget:
        return f"{_size(total)} (no budget)"
    return f"{_size(total)} of {_size(budget)} budget ({100.0 * total / budget:.1f}%)"


class _Progress:
    """A one-line progress bar on stderr (only when it is a terminal, or asked for)."""

    def __init__(self, total, label, enabled, stream=None):
        self.total, self.label, self.enabled = max(total, 1), label, enabled
        self.stream = stream or sys.stderr
        self.done = 0
        self.files = 0
        self._last = 0.0
        self._width = 0

    def advance(self, n):
        self.done += n
        now = time.monotonic()
        if self.enabled and now - self._last >= PROGRESS_INTERVAL_S:
            self._last = now
            self._draw()

    def _draw(self):
        frac = min(1.0, self.done / self.total)
        fill = int(frac * PROGRESS_WIDTH)
        line = (f"{self.label} [{'#' * fill}{'.' * (PROGRESS_WIDTH - fill)}] {frac * 100:3.0f}% "
                f"{_size(self.done)}/{_size(self.total)} files {self.files}")
        self.stream.write("\r" + line.ljust(self._width))
        self.stream.flush()
        self._width = len(line)

    def reach(self, done):
        """Sets the bytes done (at the end of a file: skipped padding and trailers count)."""
        self.done = max(self.done, done)
        self.advance(0)

    def clear(self):
        """Erases the bar (before another line is printed to the terminal)."""
        if self.enabled and self._width:
            self.stream.write("\r" + " " * self._width + "\r")
            self.stream.flush()
            self._width = 0
            self._last = 0.0

    def close(self):
        if self.enabled:
            self.done = self.total
            self._draw()
            self.stream.write("\n")
            self.stream.flush()


# ---- reading a directory without opening a KVStore ---------------------------

def _directory(path):
    """The directory argument, checked: UsageError if it is not an existing directory."""
    if not os.path.exists(path):
        raise UsageError(f"{path}: no such directory")
    if not os.path.isdir(path):
        raise UsageError(f"{path}: not a directory")
    if not os.access(path, os.R_OK | os.X_OK):
        raise UsageError(f"{path}: permission denied")
    return path


def _names(d):
    with os.scandir(d) as it:
        return sorted(de.name for de in it if is_checkpoint_name(de.name))


def _error_line(err):
    if isinstance(err, CorruptCheckpoint):
        return f"{err.reason}: {err.detail}" if err.detail else err.reason
    if isinstance(err, UnsafePath):
        return "unsafe_path: not a regular file (kvstore never follows symlinks)"
    if isinstance(err, OSError) and err.errno:
        return f"unreadable: {os.strerror(err.errno)}"
    return f"unreadable: {err}"


def _scan(d):
    """(valid entries, [(name, reason)] for files named like checkpoints with a bad envelope)."""
    entries, bad = [], []
    for name in _names(d):
        try:
            entries.append(read_entry(os.path.join(d, name)))
        except CheckpointMissing:
            continue                    # deleted while we listed
        except (KVStoreError, OSError) as e:
            bad.append((name, _error_line(e)))
    return entries, bad


class _DirectoryView:
    """The read-only part of KVStore that sessions.list needs: entries()."""

    def __init__(self, path):
        self.path = path

    def entries(self):
        return _scan(self.path)[0]


def _match(names, prefix, where):
    """The one name starting with a hex prefix (4+ digits); UsageError otherwise."""
    p = prefix.lower()
    if not (sessions.MIN_PREFIX <= len(p) <= 40 and all(c in "0123456789abcdef" for c in p)):
        raise UsageError(f"{prefix!r} is not a file and not a hash prefix "
                         f"({sessions.MIN_PREFIX} to 40 hex digits)")
    found = sorted(n for n in names if n.lower().startswith(p))
    if not found:
        raise UsageError(f"no checkpoint in {where} starts with {p!r}")
    if len(found) > 1:
        raise UsageError(f"prefix {p!r} is ambiguous in {where}: it matches "
                         + ", ".join(n[:12] for n in found[:8])
                         + (f" and {len(found) - 8} more" if len(found) > 8 else "")
                         + "; give more digits")
    return found[0]


def _rank(entries, now):
    """Entries with their eviction scores, the best kept first (the next victim last)."""
    scored = [(policy.eviction_score(e, now), e) for e in entries]
    scored.sort(key=lambda se: (-se[0], -(se[1].last_used or se[1].created_at), se[1].name))
    return scored


# ---- commands -----------------------------------------------------------------

def _budget_bytes(mb):
    return int(mb * 1024 * 1024)


def cmd_ls(args):
    if args.remote:
        if args.dir is not None:
            raise UsageError("ls takes DIR or --remote, not both")
        return cmd_remote_ls(args)
    if args.dir is None:
        raise UsageError("ls needs DIR (or --remote s3://BUCKET/PREFIX)")
    d = _directory(args.dir)
    entries, bad = _scan(d)
    now = int(time.time())
    ranked = _rank(entries, now)
    titles = {e.name: sessions.read_title(e) for e in entries}
    if args.json:
        out = [{
            "sha": e.sha, "prefix": e.sha[:12], "reason": _reason_name(e.reason),
            "tokens": e.tokens, "hits": e.hits, "ctx_size": e.ctx_size, "quant_bits": e.quant_bits,
            "model_id": e.model_id, "payload_abi": e.payload_abi, "loadable": e.loadable,
            "file_size": e.file_size, "created_at": e.created_at, "last_used": e.last_used,
            "age_s": max(0, now - e.created_at) if e.created_at else None,
            "idle_s": max(0, now - e.last_used) if e.last_used else None,
            "title": titles[e.name], "score": score,
        } for score, e in ranked]
        print(json.dumps(out, indent=2, ensure_ascii=False))
        return 0
    budget = _budget_bytes(args.budget_mb)
    if ranked:
        rows = [(e.sha[:12], _reason_name(e.reason), e.tokens, e.hits, e.ctx_size, e.quant_bits,
                 e.model_id, _abi(e), _size(e.file_size), _age(e.created_at, now), _used(e, now),
                 _printable(titles[e.name], TITLE_COLUMN))
                for _, e in ranked]
        print(_table(rows, ("SHA", "REASON", "TOKENS", "HITS", "CTX", "QUANT", "MODEL", "ABI",
                            "SIZE", "AGE", "USED", "TITLE"), right={2, 3, 4, 5, 6, 8}))
    else:
        print(f"no checkpoints in {d}")
    total = sum(e.file_size for e in entries)
    foreign = sum(1 for e in entries if not e.loadable)
    print(f"{len(entries)} checkpoint{'s' if len(entries) != 1 else ''}, {_budget_line(total, budget)}")
    if foreign:
        print(f"{foreign} with a foreign payload ABI: listed and counted in the budget, not loadable")
    if bad:
        print(f"{len(bad)} file{'s' if len(bad) != 1 else ''} with a bad envelope "
              f"(not counted; see `kvstore verify`)")
    return 0


def _inspect_target(args):
    target = args.target
    if os.path.lexists(target):
        if os.path.isdir(target):
            raise UsageError(f"{target}: is a directory (give a .kv file or a hash prefix)")
        return target
    if os.sep in target or target.endswith(".kv"):
        raise UsageError(f"{target}: no such file")
    d = _directory(args.dir)
    return os.path.join(d, _match(_names(d), target, d))


def cmd_inspect(args):
    path = _inspect_target(args)
    now = int(time.time())
    try:
        fd, st = open_checkpoint(path)
    except CheckpointMissing:
        raise UsageError(f"{path}: no such file") from None
    except UnsafePath:
        raise UsageError(f"{path}: not a regular file (kvstore never follows symlinks)") from None
    status = 0
    try:
        try:
            e = entry_from_fd(fd, st, path)
        except CorruptCheckpoint as err:
            print(f"{PROG}: error: {os.path.basename(path)}: corrupt envelope: {_error_line(err)}",
                  file=sys.stderr)
            return 1
        flags = _flag_names(e.ext_flags)
        rows = [
            ("file", path),
            ("sha", e.sha or "-  (the file name is not 40 hex + .kv)"),
            ("version", 1),
            ("quant bits", e.quant_bits),
            ("reason", f"{_reason_name(e.reason)} ({int(e.reason)})"),
            ("ext flags", f"0x{int(e.ext_flags):02x}" + (f" ({', '.join(flags)})" if flags else "")),
            ("model id", e.model_id),
            ("tokens", e.tokens),
            ("hits", e.hits),
            ("ctx size", e.ctx_size),
            ("payload abi", f"{e.payload_abi} (loadable)" if e.loadable
             else f"{e.payload_abi} (foreign: listed and counted, not loadable by this build)"),
            ("created", _stamp(e.created_at, now)),
            ("last used", _stamp(e.last_used, now) if e.last_used else "never"),
            ("text", f"{e.text_bytes} bytes"),
            ("payload", f"{e.payload_bytes} bytes"),
            ("trailer", f"{e.file_size - e.trailer_offset} bytes"),
            ("file size", f"{e.file_size} bytes ({_size(e.file_size)})"),
        ]
        w = max(len(k) for k, _ in rows)
        for k, v in rows:
            print(f"{k.ljust(w)}  {v}")
        if e.loadable:
            try:
                m = read_manifest(fd, e)
            except CorruptCheckpoint as err:
                print(f"manifest: corrupt ({_error_line(err)})")
                status = 1
            else:
                print("manifest:")
                print(f"  tokens: count={e.tokens} bytes={4 * e.tokens} offset={m.tokens[0]} "
                      f"crc32c=0x{m.tokens[2]:08x}")
                trows = [(_printable(name), dtype, "(" + ", ".join(str(x) for x in shape)
                          + ("," if len(shape) == 1 else "") + ")", n)
                         for name, dtype, shape, _, n, _ in m.tensors]
                print(f"  tensors ({len(trows)}):")
                if trows:
                    print("\n".join("    " + line for line in
                                    _table(trows, ("NAME", "DTYPE", "SHAPE", "BYTES"), right={3}).split("\n")))
                print(f"  meta keys: {', '.join(_printable(k) for k in sorted(m.meta)) or '-'}")
        sections = list(trailer_sections(fd, e))
        print(f"trailer sections ({len(sections)}):")
        for bit, off, length, crc in sections:
            name = ExtFlag(1 << bit).name.lower().replace("_", "-") if bit < 4 else "unknown"
            ok = section_crc(fd, off, length, path) == crc
            print(f"  bit {bit} ({name})  length {length}  crc {'ok' if ok else 'BAD (dropped on load)'}")
        title = sessions.read_title(e)
        if title is not None:
            print(f"title: {_printable(title)}")
        if args.text:
            print("text:")
            sys.stdout.flush()
            _copy_text(fd, e, sys.stdout.buffer)
            sys.stdout.buffer.write(b"\n")
            sys.stdout.buffer.flush()
    finally:
        os.close(fd)
    return status


def _copy_text(fd, e, out, chunk=1 << 20):
    """Writes the stored prompt text to out, a bounded chunk at a time."""
    for off in range(0, e.text_bytes, chunk):
        data = os.pread(fd, min(chunk, e.text_bytes - off), e.text_offset + off)
        if not data:
            break
        out.write(data)


def cmd_verify(args):
    d = _directory(args.dir)
    names = _names(d)
    sizes = {}
    for name in names:
        try:
            sizes[name] = os.lstat(os.path.join(d, name)).st_size
        except FileNotFoundError:
            pass
    show = args.progress or sys.stderr.isatty()
    bar = _Progress(sum(sizes.values()), "verify", show)
    checked = ok = foreign = 0
    bad = []
    moved = 0
    done = 0
    for name in names:
        if name not in sizes:
            continue
        bar.reach(done)
        done += sizes[name]
        path = os.path.join(d, name)
        try:
            before = os.lstat(path)
            try:
                e = read_entry(path)
            except CheckpointMissing:
                raise
            except (KVStoreError, OSError) as err:
                reason = _error_line(err)
            else:
                reason = None if not e.loadable else verify_file(path, bar.advance)
        except (CheckpointMissing, FileNotFoundError):
            continue                    # deleted while we checked: nothing to verify
        checked += 1
        bar.files = checked
        if reason is None:
            if e.loadable:
                ok += 1
            else:
                foreign += 1
            continue
        bad.append(name)
        note = ""
        if args.quarantine:
            done, what = _quarantine(d, path, before)
            moved += done
            note = f"  ({what})"
        bar.clear()
        print(f"{name}: {reason}{note}", flush=True)
    bar.close()
    parts = [f"{ok} ok"]
    if foreign:
        parts.append(f"{foreign} foreign payload ABI (envelope only)")
    parts.append(f"{len(bad)} corrupt")
    print(f"verified {checked} file{'s' if checked != 1 else ''} in {d}: " + ", ".join(parts))
    if args.quarantine and bad:
        print(f"moved {moved} to {os.path.join(d, QUARANTINE_DIR)}")
    return 1 if bad else 0


def _quarantine(d, path, before):
    """Moves a bad file aside, unless it was replaced since it was checked.

    Returns:
        (moved, what happened in a few words).
    """
    qdir = os.path.join(d, QUARANTINE_DIR)
    try:
        now = os.lstat(path)
        if (now.st_ino, now.st_dev) != (before.st_ino, before.st_dev):
            return False, "kept: replaced while it was checked"
        os.makedirs(qdir, mode=0o700, exist_ok=True)
        move_aside(path, qdir)                  # never into a planted symlink
    except FileNotFoundError:
        return False, "gone meanwhile"
    except OSError as e:
        return False, f"kept: {os.strerror(e.errno) if e.errno else e}"
    return True, f"moved to {QUARANTINE_DIR}/"


def _open_store(d):
    """A KVStore over d that evicts nothing on open (budget 0 = unlimited)."""
    try:
        return KVStore(d, budget_mb=0)
    except UnsafePath:
        raise UsageError(f"{d}: not a directory (kvstore never follows symlinks)") from None


def cmd_evict(args):
    d = _directory(args.dir)
    if args.budget_mb <= 0:
        raise UsageError("evict --budget-mb must be > 0 (to remove every checkpoint use `kvstore wipe`)")
    budget = _budget_bytes(args.budget_mb)
    entries, _ = _scan(d)
    before = sum(e.file_size for e in entries)
    now = int(time.time())
    if args.dry_run:
        # The loop of KVStore.evict, deleting nothing: the same victims in the same order.
        left, total, victims = [*entries], before, []
        while total > budget and left:
            v = policy.pick_victim(left, now)
            left.remove(v)
            victims.append(v)
            total -= v.file_size
        verb = "would evict"
    else:
        store = _open_store(d)
        # Opened with no budget so that the constructor deletes nothing; the
        # explicit pass below evicts to the given one and reports its victims.
        store.budget_bytes = budget
        try:
            victims = store.evict()
            total = store.stats()["bytes"]
        finally:
            store.close()
        verb = "evicted"
    for v in victims:
        print(f"{verb} {v.sha[:12] or v.name}  {_reason_name(v.reason)}  tokens {v.tokens}  "
              f"hits {v.hits}  {_size(v.file_size)}")
    freed = sum(v.file_size for v in victims)
    print(f"{verb} {len(victims)} checkpoint{'s' if len(victims) != 1 else ''} ({_size(freed)}); "
          f"{'would leave' if args.dry_run else 'now'} {_budget_line(total, budget)}"
          f" (was {_size(before)})")
    return 0


def cmd_stats(args):
    d = _directory(args.dir)
    entries, bad = _scan(d)
    now = int(time.time())
    budget = _budget_bytes(args.budget_mb)
    total = sum(e.file_size for e in entries)
    by_reason = collections.Counter(_reason_name(e.reason) for e in entries)
    times = [e.created_at for e in entries if e.created_at]
    out = {
        "dir": os.path.abspath(d),
        "entries": len(entries),
        "bytes": total,
        "budget_bytes": budget,
        "budget_use": (total / budget) if budget else None,
        "by_reason": {r: by_reason[r] for r in sorted(by_reason)},
        "hits": sum(e.hits for e in entries),
        "tokens": sum(e.tokens for e in entries),
        "not_loadable": sum(1 for e in entries if not e.loadable),
        "bad_envelopes": len(bad),
        "oldest": min(times) if times else None,
        "newest": max(times) if times else None,
    }
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    rows = [
        ("entries", f"{out['entries']}" + (f" ({out['not_loadable']} with a foreign payload ABI)"
                                           if out["not_loadable"] else "")),
        ("bytes", _budget_line(total, budget)),
        ("by reason", ", ".join(f"{r} {n}" for r, n in out["by_reason"].items()) or "-"),
        ("hits", out["hits"]),
        ("tokens", out["tokens"]),
        ("oldest", _stamp(out["oldest"], now)),
        ("newest", _stamp(out["newest"], now)),
    ]
    if bad:
        rows.append(("bad envelopes", f"{len(bad)} (see `kvstore verify`)"))
    w = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k.ljust(w)}  {v}")
    return 0


def cmd_wipe(args):
    """Valid checkpoints go through KVStore.wipe; a full wipe also takes the
    files that hold prompt text without being valid checkpoints (a bad
    envelope, the quarantine), since wiping is about that text."""
    d = _directory(args.dir)
    names = _names(d)
    qdir = os.path.join(d, QUARANTINE_DIR)
    quarantined = []
    if args.prefix is not None:
        targets = [os.path.join(d, _match(names, args.prefix, d))]
        what = f"checkpoint {os.path.basename(targets[0])[:12]}"
    else:
        targets = [os.path.join(d, n) for n in names]
        if os.path.isdir(qdir) and not os.path.islink(qdir):
            quarantined = [os.path.join(qdir, n) for n in _names(qdir)]
        what = f"all {len(targets)} checkpoint file{'s' if len(targets) != 1 else ''}"
        if quarantined:
            what += f" and {len(quarantined)} in {QUARANTINE_DIR}"
    if not args.yes:
        raise UsageError(f"wipe overwrites and deletes {what} in {d}; add --yes to confirm")
    store = _open_store(d)
    try:
        valid = {e.name: e for e in store.entries()}
        n = 0
        for path in targets:
            e = valid.get(os.path.basename(path))
            n += store.wipe(e) if e is not None else wipe_file(path)
    finally:
        store.close()
    q = sum(wipe_file(path) for path in quarantined)
    print(f"wiped {n} checkpoint file{'s' if n != 1 else ''} in {d}"
          + (f" and {q} in {QUARANTINE_DIR}" if quarantined else ""))
    return 0


def cmd_session_list(args):
    d = _directory(args.dir)
    found = sessions.list(_DirectoryView(d))
    now = int(time.time())
    if args.json:
        print(json.dumps([{
            "sha": s.sha, "prefix": s.prefix, "title": s.title, "tokens": s.tokens, "hits": s.hits,
            "created_at": s.created_at, "last_used": s.last_used, "model_id": s.model_id,
            "file_size": s.file_size,
        } for s in found], indent=2, ensure_ascii=False))
        return 0
    if not found:
        print(f"no agent sessions in {d}")
        return 0
    rows = [(s.prefix, _printable(s.title, TITLE_COLUMN) or "-", s.tokens, s.hits,
             "never" if not s.last_used else _span(now - s.last_used) + " ago",
             _age(s.created_at, now)) for s in found]
    print(_table(rows, ("SHA", "TITLE", "TOKENS", "HITS", "USED", "AGE"), right={2, 3}))
    return 0


# ---- the remote tier (an S3-compatible bucket) --------------------------------------

def _bucket(args):
    """The bucket named by --remote; UsageError for a bad URL or a missing boto3."""
    if not args.remote:
        raise UsageError("--remote s3://BUCKET/PREFIX is required")
    try:
        return remote_mod.Bucket(args.remote, remote_mod.options_from_args(args))
    except (ValueError, ImportError) as e:
        raise UsageError(str(e)) from None
    except Exception as e:                 # noqa: BLE001 - a profile or region that does not resolve
        raise UsageError(f"{args.remote}: {_remote_failure(e)}") from None


def _remote_failure(exc):
    f = remote_mod.classify(exc)
    status = f" (HTTP {f.status})" if f.status else ""
    hint = {remote_mod.DENIED: "; check the credentials (AWS_PROFILE, --profile, AWS_ACCESS_KEY_ID, "
                               "~/.aws/credentials) and the identity's permissions",
            remote_mod.UNAVAILABLE: "; check --endpoint-url and that the store is reachable"}.get(f.kind, "")
    return f"{f.kind}: {f.code}{status}{hint}"


def _remote_call(args, fn, *a, **kw):
    try:
        return fn(*a, **kw)
    except remote_mod.RemoteError:
        raise
    except Exception as e:                 # noqa: BLE001 - one line, classified
        raise remote_mod.RemoteError(f"{args.remote}: {_remote_failure(e)}") from None


def cmd_remote_ls(args):
    bucket = _bucket(args)
    objects = _remote_call(args, remote_mod.list_objects, bucket)
    now = time.time()
    objects.sort(key=lambda o: (-o.modified, o.key))
    if args.json:
        print(json.dumps([{"key": o.key, "sha": o.sha, "fingerprint": o.fingerprint, "text_bytes": o.text_bytes,
                           "size": o.size, "modified": o.modified} for o in objects], indent=2))
        return 0
    if objects:
        rows = [(o.sha[:12], o.fingerprint[:12], o.text_bytes, _size(o.size), _span(now - o.modified) + " ago")
                for o in objects]
        print(_table(rows, ("SHA", "MODEL", "TEXT", "SIZE", "UPLOADED"), right={2, 3}))
    total = sum(o.size for o in objects)
    models = len({o.fingerprint for o in objects})
    print(f"{len(objects)} object{'s' if len(objects) != 1 else ''}, {_size(total)} in {args.remote}"
          + (f" ({models} model{'s' if models != 1 else ''})" if objects else ""))
    return 0


def cmd_remote_gc(args):
    bucket = _bucket(args)
    budget = int(args.budget_gb * 2**30)
    max_age = None if args.max_age_days is None else args.max_age_days * 86400
    victims, before, after = _remote_call(args, remote_mod.gc, bucket, budget, dry_run=args.dry_run,
                                          max_age_s=max_age, min_age_s=args.min_age_s)
    verb = "would delete" if args.dry_run else "deleted"
    for o, e in victims:
        what = (f"{_reason_name(e.reason)}  tokens {e.tokens}  hits {e.hits}" if e is not None
                else "expired" if max_age is not None and time.time() - o.modified > max_age else "unreadable header")
        print(f"{verb} {o.sha[:12]}  {what}  {_size(o.size)}")
    print(f"{verb} {len(victims)} object{'s' if len(victims) != 1 else ''} ({_size(before - after)}); "
          f"{'would leave' if args.dry_run else 'now'} {_budget_line(after, budget)} (was {_size(before)})")
    if not args.dry_run:
        n = _remote_call(args, remote_mod.abort_stale_uploads, bucket)
        if n:
            print(f"aborted {n} stale multipart upload{'s' if n != 1 else ''}")
    return 0


# ---- parser ---------------------------------------------------------------------

def _megabytes(text):
    try:
        v = float(text)
    except ValueError:
        v = math.nan
    if not math.isfinite(v) or v < 0:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: expected a number of MiB >= 0")
    return v


def _gigabytes(text):
    try:
        v = float(text)
    except ValueError:
        v = math.nan
    if not math.isfinite(v) or v <= 0:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: expected a number of GiB > 0")
    return v


def _add_demo(subparsers):
    """Hook for `kvstore demo`, which lives in kvstore.demo (another module).

    When kvstore.demo is importable, its ``add_parser(subparsers)`` adds a
    `demo` subparser and sets ``func`` (args -> exit status) with
    set_defaults.  Without the module, or without its dependencies, there is
    no demo command and nothing else changes.  kvstore.demo should import
    MLX inside its handler: this hook runs on every `kvstore` invocation.
    """
    try:
        from kvstore import demo
    except ImportError:
        return
    add = getattr(demo, "add_parser", None)
    if callable(add):
        add(subparsers)


def build_parser():
    """The argparse parser of the `kvstore` command."""
    p = _Parser(prog=PROG, description="Look after a directory of kvstore KV-cache checkpoints.")
    p.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    p.add_argument("-v", "--verbose", action="store_true", help="log every store event (key=value lines)")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)

    s = sub.add_parser("ls", help="list checkpoints, best kept first (or a bucket's, with --remote)")
    s.add_argument("dir", metavar="DIR", nargs="?")
    s.add_argument("--json", action="store_true", help="a JSON list of objects")
    s.add_argument("--budget-mb", type=_megabytes, default=DEFAULT_BUDGET_MB,
                   help=f"budget shown against the total (default {DEFAULT_BUDGET_MB}; 0: none)")
    remote_mod.add_arguments(s)
    s.set_defaults(func=cmd_ls)

    s = sub.add_parser("inspect", help="show one checkpoint's header, manifest and trailer")
    s.add_argument("target", metavar="FILE|SHA-PREFIX")
    s.add_argument("--dir", default=".", help="directory to search for a hash prefix (default: .)")
    s.add_argument("--text", action="store_true", help="also print the stored prompt text")
    s.set_defaults(func=cmd_inspect)

    s = sub.add_parser("verify", help="check every envelope and payload CRC")
    s.add_argument("dir", metavar="DIR")
    s.add_argument("--quarantine", action="store_true", help=f"move bad files to DIR/{QUARANTINE_DIR}")
    s.add_argument("--progress", action="store_true", help="show the progress bar even when stderr is not a terminal")
    s.set_defaults(func=cmd_verify)

    s = sub.add_parser("evict", help="delete lowest-score checkpoints until DIR fits a budget")
    s.add_argument("dir", metavar="DIR")
    s.add_argument("--budget-mb", type=_megabytes, required=True)
    s.add_argument("--dry-run", action="store_true", help="print what would go, delete nothing")
    s.set_defaults(func=cmd_evict)

    s = sub.add_parser("stats", help="totals: entries, bytes, reasons, hits, ages")
    s.add_argument("dir", metavar="DIR")
    s.add_argument("--json", action="store_true")
    s.add_argument("--budget-mb", type=_megabytes, default=DEFAULT_BUDGET_MB)
    s.set_defaults(func=cmd_stats)

    s = sub.add_parser("wipe", help="overwrite then delete one checkpoint, or all")
    s.add_argument("dir", metavar="DIR")
    s.add_argument("prefix", metavar="SHA-PREFIX", nargs="?")
    s.add_argument("--yes", action="store_true", help="really do it")
    s.set_defaults(func=cmd_wipe)

    s = sub.add_parser("session", help="agent sessions")
    ss = s.add_subparsers(dest="session_command", metavar="SUBCOMMAND", required=True)
    s = ss.add_parser("list", help="saved agent sessions, newest first")
    s.add_argument("dir", metavar="DIR")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_session_list)

    s = sub.add_parser("remote", help="the shared bucket of the remote tier: ls, gc")
    rs = s.add_subparsers(dest="remote_command", metavar="SUBCOMMAND", required=True)
    s = rs.add_parser("ls", help="list the bucket's checkpoints, newest first")
    remote_mod.add_arguments(s)
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_remote_ls)
    s = rs.add_parser("gc", help="delete lowest-score objects until the bucket fits a budget "
                                 "(the one janitor: clients never delete)")
    remote_mod.add_arguments(s)
    s.add_argument("--budget-gb", type=_gigabytes, required=True, help="GiB for every object under the prefix")
    s.add_argument("--max-age-days", type=float, default=None,
                   help="also delete objects uploaded longer ago than this")
    s.add_argument("--min-age-s", type=float, default=remote_mod.GC_MIN_AGE_S,
                   help=f"keep objects younger than this (default {remote_mod.GC_MIN_AGE_S:g}): "
                        "another host may be about to find them")
    s.add_argument("--dry-run", action="store_true", help="print what would go, delete nothing")
    s.set_defaults(func=cmd_remote_gc)

    _add_demo(sub)
    # `kvstore serve` takes mlx_lm.server's options as well as its own, so
    # main() hands its arguments to kvstore.serve untouched; this entry only
    # lists it in --help.
    sub.add_parser("serve", add_help=False,
                   help="mlx-lm's OpenAI-compatible server with this disk tier (kvstore serve --help)")
    return p


def _error(message):
    print(f"{PROG}: error: {message}", file=sys.stderr)


def main(argv=None):
    """Runs the `kvstore` command line; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:
        # mlx-lm's server sets up logging (its --log-level) itself.
        from kvstore import serve
        return serve.main(argv[1:])
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    old_level, old_propagate = log.level, log.propagate
    log.addHandler(handler)
    log.propagate = False
    log.setLevel(logging.WARNING)
    try:
        try:
            args = build_parser().parse_args(argv)
        except SystemExit as e:          # --help, --version
            return e.code if isinstance(e.code, int) else 0
        if args.verbose:
            log.setLevel(logging.INFO)
        return args.func(args)
    except UsageError as e:
        _error(e)
        return 2
    except KeyboardInterrupt:
        _error("interrupted")
        return 130
    except BrokenPipeError:
        # `kvstore ls DIR | head`: the reader left; say nothing more.
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return 1
    except (KVStoreError, OSError) as e:
        _error(f"{e.filename}: {e.strerror}" if isinstance(e, OSError) and e.filename and e.strerror else e)
        return 1
    except Exception as e:                 # noqa: BLE001 - one line, never a traceback
        if os.environ.get("KVSTORE_DEBUG"):
            raise
        _error(f"unexpected {type(e).__name__}: {e} (set KVSTORE_DEBUG=1 for the traceback)")
        return 1
    finally:
        log.removeHandler(handler)
        log.setLevel(old_level)
        log.propagate = old_propagate
