"""Temporary files: which ones are debris (docs/semantics.md §11).

A checkpoint is written under ``<name>.tmp.<pid>.<random>`` and renamed into
place (kvstore.publish.TempFile).  A crash or a power loss leaves the
temporary name behind; when a store opens, every one whose writer is gone
is removed: its process has exited, the file predates the machine's boot
(a restart killed every writer, and the pid may be another process's now),
it is this process's own but no write of this process has it open, or it
is more than a day old (a writer on another host of a shared mount).
"""

import os
import re
import time

from kvstore import host

# A temporary file is "<40 hex>.kv.tmp.<pid>.<random>" (or the directory's
# model registry's, ".models.tmp...", or its index snapshot's, ".index.tmp...").  One whose writer is
# gone is debris of a crash; one older than this is removed even if its pid
# is alive again (pid reuse, or a writer on another host of a shared mount).
TMP_RE = re.compile(r"^(?:[0-9a-fA-F]{40}\.kv|\.models|\.index)\.tmp\.(\d+)\.[0-9a-f]+$")
STALE_TMP_AGE_S = 24 * 3600


# The temporary files this process is writing now (kvstore.publish.TempFile):
# one of its own pid that is not among them is stale (left by a write that
# failed, or by an earlier process that had the same pid).
_live_temps = set()


def track(path):
    """path is a temporary file this process is writing."""
    _live_temps.add(os.path.abspath(path))


def untrack(path):
    """path is no longer written by this process (published or removed)."""
    _live_temps.discard(os.path.abspath(path))


def boot_time():
    """When this machine booted (seconds since the epoch), or None where unknown.

    A temporary file older than the boot was left by a writer the machine's
    restart killed, whatever process has its pid now.
    """
    global _boot_time
    if _boot_time is None:
        _boot_time = _read_boot_time()
    return _boot_time or None


_boot_time = None


def _read_boot_time():
    return host.boot_time()


def _writer_gone(path, pid, mtime):
    """True when no process is writing the temporary file at path (of pid, last written at mtime)."""
    if pid == os.getpid():
        return os.path.abspath(path) not in _live_temps
    booted = boot_time()
    return (booted is not None and mtime < booted) or not _pid_alive(pid)


def _pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_temps(directory, now=None, names=None):
    """Removes temporary files whose writer is gone (or that are over a day old):
    its process has exited, the file predates the machine's boot, or it is
    this process's own and no write of this process has it open.

    Args:
        directory: the store directory.
        now: unix seconds (default: now).
        names: the names to look at, from a listing just made (the index's
            first: a directory of 100,000 blocks is then listed once); None
            lists the directory.

    Returns:
        the names removed.
    """
    now = time.time() if now is None else now
    if names is None:
        names = [n for n in os.listdir(directory) if ".tmp." in n]
    removed = []
    for name in names:
        m = TMP_RE.match(name)
        if not m:
            continue
        path = os.path.join(directory, name)
        try:
            mtime = os.lstat(path).st_mtime
        except OSError:
            continue
        if _writer_gone(path, int(m.group(1)), mtime) or now - mtime > STALE_TMP_AGE_S:
            try:
                os.unlink(path)
                removed.append(name)
            except OSError:
                pass
    return removed
