"""Pins (docs/semantics.md §19): prefixes kept through eviction for a lifetime, in ``<dir>/.pins``.

A pin names one checkpoint file (its name, the SHA1 the file is named by),
the unix second its lifetime ends, and the tenant tag of whoever pinned it
(hex, "" for none: a tag, never a salt nor any prompt text).  Until then
eviction never chooses the pinned file nor, for a chain block, any block
before it (its prefix); they still count toward the budget.  Pinned bytes
may never exceed a share of the budget: a pin past that share is refused
(kvstore.errors.PinRefused), never granted by removing another pin.

The file is JSON, written whole under the directory's exclusive lock (a
temporary file renamed into place, 0600), as the model registry is.  Pins
of files no longer there and pins past their lifetime are dropped at the
next write.  A lost or damaged pins file only unpins: nothing is matched
through it.
"""

import dataclasses
import logging
import re

from kvstore import sidecars

log = logging.getLogger("kvstore")

PINS = ".pins"
# A pins file larger than this is not read (a hostile or broken file).
MAX_PINS_BYTES = 4 << 20
# The lifetimes clients name (Anthropic's cache_control "ttl"), in seconds.
TTL_NAMES = {"5m": 300, "1h": 3600}
_SHA = re.compile(r"[0-9a-f]{40}")
_TAG = re.compile(r"(?:[0-9a-f]{2}){0,32}")


@dataclasses.dataclass(frozen=True)
class Pin:
    """One pin: the file it keeps, until when, and for whom."""
    sha: str            # the pinned file's name (without .kv)
    until: int          # unix seconds: the lifetime's end
    tenant: str = ""    # the tenant's tag as hex ("" for none)
    created: int = 0    # unix seconds
    tokens: int = 0     # the pinned prefix's length in tokens
    bytes: int = 0      # the bytes it keeps: the file and, for a chain block, its ancestors

    def row(self):
        return {"until": self.until, "tenant": self.tenant, "created": self.created, "tokens": self.tokens,
                "bytes": self.bytes}


def parse_ttl(value):
    """Seconds of a pin's lifetime: "5m" or "1h" (a cache_control ttl), or a positive number of seconds.

    Raises:
        ValueError: any other value, named in the message.
    """
    if isinstance(value, str):
        if value in TTL_NAMES:
            return TTL_NAMES[value]
        raise ValueError(f"ttl {value!r} is not one of {', '.join(repr(k) for k in TTL_NAMES)} "
                         "or a number of seconds")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 \
            or value == float("inf"):
        raise ValueError(f"ttl {value!r} must be a positive number of seconds")
    return value


def read_pins(directory, now):
    """{sha: Pin} of the pins in a store directory still alive at now (unix seconds); {} when none."""
    try:
        rows = sidecars.read_json(directory, PINS, MAX_PINS_BYTES) or {}
    except ValueError:
        log.warning("kvstore: pins_unreadable file=%s", PINS)
        return {}
    out = {}
    for sha, row in rows.items():
        pin = _pin_of(sha, row)
        if pin is not None and pin.until > now:
            out[sha] = pin
    return out


def _pin_of(sha, row):
    """The Pin a file's row describes, or None when the row is not one."""
    if not (isinstance(sha, str) and _SHA.fullmatch(sha) and isinstance(row, dict)):
        return None
    ints = [row.get(k, 0) for k in ("until", "created", "tokens", "bytes")]
    tenant = row.get("tenant", "")
    if any(type(v) is not int or v < 0 for v in ints) or not (isinstance(tenant, str) and _TAG.fullmatch(tenant)):
        return None
    until, created, tokens, size = ints
    return Pin(sha, until, tenant, created, tokens, size)


def write_pins(directory, pins, durable=True):
    """Writes {sha: Pin} as the directory's pins file (the caller holds its exclusive lock).

    Raises:
        OSError: it could not be written (the pins in force stay those of the file there).
    """
    sidecars.write_json(directory, PINS, {sha: p.row() for sha, p in pins.items()}, durable)


def kept(pins, entries):
    """(shas, bytes) that pins keep: each pinned file present and every chain
    block before it, each counted once.

    Args:
        pins: iterable of Pin (or of shas).
        entries: {sha: Entry} of the directory.
    """
    shas, total = set(), 0
    for p in pins:
        sha = getattr(p, "sha", p)
        while sha and sha in entries and sha not in shas:
            e = entries[sha]
            shas.add(sha)
            total += e.file_size
            sha = e.parent if e.is_block else ""
    return frozenset(shas), total


def present(directory, entries, now):
    """(the live pins of the files among entries, the latest lifetime first;
    the bytes they keep, chain blocks before them included)."""
    by_sha = {e.sha: e for e in entries}
    live = sorted((p for p in read_pins(directory, now).values() if p.sha in by_sha), key=lambda p: (-p.until, p.sha))
    return live, kept(live, by_sha)[1]


__all__ = ["PINS", "Pin", "parse_ttl", "read_pins", "write_pins", "kept", "present", "TTL_NAMES"]
