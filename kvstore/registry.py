"""The directory's registry of models (docs/semantics.md §17): ``<dir>/.models``.

A file's header names its model by a 24-bit tag only; the registry maps each
tag to the model's identity and a label for people, and says when a store
last opened the directory with it, so that kvstore ls and kvstore stats can
name the models whose files they count.  It is JSON, written whole under the
directory's exclusive lock (a temporary file, renamed into place), at most
once a day per model.  Nothing is matched through it: a lost or damaged
registry only leaves the models unnamed.
"""

import logging
import time

from kvstore import sidecars
from kvstore.identity import TAG_MAX, tag_hex

log = logging.getLogger("kvstore")

REGISTRY = ".models"
# An update is skipped while a model's "last seen" is this recent: opening a
# store then writes nothing.
REFRESH_S = 24 * 3600
# A registry larger than this is not read (a hostile or broken file).
MAX_REGISTRY_BYTES = 1 << 20


def read_registry(directory):
    """{tag: {"identity", "label", "seen"}} of a store directory ({} when none or unreadable)."""
    try:
        rows = sidecars.read_json(directory, REGISTRY, MAX_REGISTRY_BYTES) or {}
    except ValueError:
        log.warning("kvstore: model_registry_unreadable file=%s", REGISTRY)
        return {}
    out = {}
    for key, row in rows.items():
        try:
            tag = int(key, 16)
        except ValueError:
            continue
        if isinstance(row, dict) and isinstance(row.get("identity"), str) and 0 < tag <= TAG_MAX:
            seen = row.get("seen")
            out[tag] = {"identity": row["identity"], "label": str(row.get("label") or ""),
                        "seen": seen if type(seen) is int else 0}
    return out


def record(directory, identity, durable=True, now=None):
    """Notes in the directory's registry that identity uses it; True when written.

    The caller holds the directory's exclusive lock, so two writers never
    lose each other's rows.  A registry that cannot be written is logged,
    never fatal.
    """
    now = int(time.time() if now is None else now)
    rows = read_registry(directory)
    have = rows.get(identity.tag)
    label = identity.label or (have or {}).get("label", "")
    if have is not None and have["identity"] == identity.fingerprint and have["label"] == label \
            and 0 <= now - have["seen"] < REFRESH_S:
        return False
    if have is not None and have["identity"] != identity.fingerprint:
        # Two identities with one 24-bit tag: their files stay apart by name
        # and manifest; the registry names the latest.
        log.warning("kvstore: model_tag_shared tag=%s", tag_hex(identity.tag))
    rows[identity.tag] = {"identity": identity.fingerprint, "label": label, "seen": now}
    try:
        sidecars.write_json(directory, REGISTRY, {tag_hex(t): r for t, r in rows.items()}, durable)
    except OSError as e:
        log.warning("kvstore: model_registry_not_written errno=%s", e.errno)
        return False
    return True


def describe_tag(tag, registry):
    """How kvstore ls and stats name a model tag: its label, else its identity, else its hex."""
    if not tag:
        return "-"
    row = registry.get(tag)
    if row is None:
        return tag_hex(tag)
    return row["label"] or row["identity"]


def summarize(entries, rows):
    """The models whose files a directory holds, the most bytes first.

    Args:
        entries: the directory's Entries (every valid envelope).
        rows: read_registry() of the directory.

    Returns:
        [{"tag": six hex digits or "-", "name", "identity" (None when not
        known), "entries", "bytes", "last_seen" (unix seconds or None)}].
    """
    by_tag = {}
    for e in entries:
        n, b = by_tag.get(e.model_tag, (0, 0))
        by_tag[e.model_tag] = (n + 1, b + e.file_size)
    out = []
    for tag, (n, b) in by_tag.items():
        row = rows.get(tag) if tag else None
        out.append({"tag": tag_hex(tag), "name": describe_tag(tag, rows) if tag else "(none named)",
                    "identity": row["identity"] if row else None, "entries": n, "bytes": b,
                    "last_seen": row["seen"] if row else None})
    return sorted(out, key=lambda r: (-r["bytes"], r["tag"]))


__all__ = ["REGISTRY", "read_registry", "record", "describe_tag", "summarize"]
