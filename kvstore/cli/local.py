"""What the directory commands share: the DIR argument, hash prefixes, a store that evicts nothing on open.

The directory commands live one group to a module, each registering its
own sub-commands (add_parsers): listing (ls), inspection (inspect), verify,
evict, stats, wipe, exchange (export, import), sessions (session list) and
keys (--key, key new).

The listing commands (ls, inspect, stats, session list, verify without
--quarantine, evict --dry-run) never write to the directory: they read the
envelopes themselves (kvstore.files.scan_directory) instead of opening a
KVStore, whose constructor evicts down to its budget and removes stale
temporary files.  The rules stay where they live: the eviction order in
kvstore.policy and kvstore.evictor, the file checks and the walk up a
chain in kvstore.files, sessions in kvstore.sessions.
"""

import os

from kvstore import sessions
from kvstore.cli.text import UsageError
from kvstore.errors import UnsafePath
from kvstore.store import KVStore


def directory(path):
    """The directory argument, checked: UsageError if it is not an existing directory."""
    if not os.path.exists(path):
        raise UsageError(f"{path}: no such directory")
    if not os.path.isdir(path):
        raise UsageError(f"{path}: not a directory")
    if not os.access(path, os.R_OK | os.X_OK):
        raise UsageError(f"{path}: permission denied")
    return path


def match(names, prefix, where):
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


def open_store(d, key=None, **kw):
    """A KVStore over d that evicts nothing on open (budget 0 = unlimited)."""
    try:
        return KVStore(d, budget_mb=0, key=key, **kw)
    except UnsafePath:
        raise UsageError(f"{d}: not a directory (kvstore never follows symlinks)") from None
