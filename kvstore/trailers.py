"""Trailer sections after the payload (docs/format.md §10).

A checkpoint file may end with a trailer: a sequence of sections, each owned
by one bit of the header's extension-flags byte.  Each section is framed as

    u8  ext-bit index (0..7)
    3   reserved bytes, written 0, ignored on read
    u64 body length
    u32 CRC32C of the body
        body

This module owns that framing and the hooks that turn a Python value into a
section body and back (one hook per ext bit, in an explicit registry).  It
does not read or write files and does not set the header's flags byte: callers
pass the trailer bytes in and out, and put the bitmask that encode_trailer /
parse_trailer return into the header.

Reading is forgiving on purpose: a trailer is an extra, the checkpoint stays
usable without it.  A section whose CRC or decode fails is dropped with one
key=value log line (never its content, which may hold prompt text); a
truncated section ends parsing.  parse_trailer never raises for bad bytes and
never allocates more than the buffer it is given.
"""

import dataclasses
import json
import logging
import os
import struct
from typing import Protocol

from kvstore import ds4
from kvstore._native import crc32c
from kvstore.format import ExtFlag
from kvstore.sources import as_source

__all__ = [
    "SECTION_HEADER", "MAX_BIT", "TITLE_MAX_BYTES",
    "TrailerHook", "ToolMapHook", "TitleHook", "Section",
    "register", "hooks", "encode_trailer", "parse_trailer", "trailer_size",
]

# 16 bytes: bit, reserved (pad bytes: written 0, skipped on read), body length, CRC32C.
SECTION_HEADER = struct.Struct("<B3xQI")

# The header's extension-flags field is one byte (docs/format.md §2), so a section
# can be owned by bits 0..7 only.
MAX_BIT = 7

# A session title is a label for `list` (docs/semantics.md §9), not a document; 4 KiB
# is far past any title a person types and keeps a hostile file from turning
# the listing into a dump of prompt text.
TITLE_MAX_BYTES = 4096

_log = logging.getLogger("kvstore")


def _is_bit_index(bit):
    """True for an ext-bit index 0..MAX_BIT (an int, not a bool)."""
    return not isinstance(bit, bool) and isinstance(bit, int) and 0 <= bit <= MAX_BIT


class TrailerHook(Protocol):
    """What a hook for one ext bit provides.

    Attributes:
        bit: the ext-flag bit index (0..7) whose section this hook owns.
    """
    bit: int

    def encode(self, value) -> bytes:
        """Returns the section body for value (raises TypeError/ValueError on a bad value)."""

    def decode(self, body: bytes) -> object:
        """Returns the value for a section body; raises ValueError on a bad body."""


_HOOKS = {}


def register(hook):
    """Registers the hook that owns ext bit ``hook.bit``.

    Args:
        hook: an object with ``bit``, ``encode(value)`` and ``decode(body)``.

    Returns:
        hook, so this can be used as a decorator on an instance factory.

    Raises:
        ValueError: the bit is outside 0..7 or already has a hook.
        TypeError: the hook lacks encode or decode.
    """
    bit = getattr(hook, "bit", None)
    if not _is_bit_index(bit):
        raise ValueError(f"trailer hook bit={bit!r} is not an ext-flag bit index 0..{MAX_BIT}")
    if not callable(getattr(hook, "encode", None)) or not callable(getattr(hook, "decode", None)):
        raise TypeError(f"trailer hook {hook!r} needs encode(value) and decode(body)")
    bit = int(bit)
    if bit in _HOOKS:
        raise ValueError(f"ext bit {bit} already has a trailer hook: {_HOOKS[bit]!r}")
    _HOOKS[bit] = hook
    return hook


def hooks():
    """Returns a copy of the registry: {bit: hook}."""
    return dict(_HOOKS)


class ToolMapHook:
    """Ext bit 0: tool-call id -> exact tool-call text, so tool calls replay byte-exactly.

    The body is a compact UTF-8 JSON object with sorted keys, so one map always
    encodes to the same bytes.
    """
    bit = 0

    def encode(self, value):
        _check_str_map(value, TypeError)
        return json.dumps(value, sort_keys=True, separators=(",", ":"),
                          ensure_ascii=False).encode("utf-8")

    def decode(self, body):
        try:
            # Decode UTF-8 ourselves: json.loads(bytes) would also guess UTF-16/32.
            value = json.loads(bytes(body).decode("utf-8"), object_pairs_hook=_unique_pairs)
        except RecursionError:
            # Deep nesting ("[[[[…") exhausts the JSON scanner's stack; still just a bad body.
            raise ValueError("tool map body is nested too deeply") from None
        _check_str_map(value, ValueError)
        return value

    def __repr__(self):
        return "ToolMapHook()"


def _unique_pairs(pairs):
    out = dict(pairs)
    if len(out) != len(pairs):
        raise ValueError("tool map body repeats a key")
    return out


def _check_str_map(value, exc):
    if not isinstance(value, dict):
        raise exc(f"tool map must be a dict of str -> str, got {type(value).__name__}")
    for k, v in value.items():
        if not isinstance(k, str) or not isinstance(v, str):
            # Types only: the keys and values are tool-call content.
            raise exc(f"tool map must be a dict of str -> str, has {type(k).__name__} -> {type(v).__name__}")


class TitleHook:
    """Ext bit 3: the agent-session title (docs/semantics.md §9), UTF-8, at most TITLE_MAX_BYTES."""
    bit = ExtFlag.SESSION_TITLE.bit_length() - 1   # 3

    def encode(self, value):
        if not isinstance(value, str):
            raise TypeError(f"session title must be a str, got {type(value).__name__}")
        body = value.encode("utf-8")
        if len(body) > TITLE_MAX_BYTES:
            raise ValueError(f"session title is {len(body)} bytes in UTF-8, "
                             f"over the {TITLE_MAX_BYTES}-byte limit")
        return body

    def decode(self, body):
        if len(body) > TITLE_MAX_BYTES:
            raise ValueError(f"session title is {len(body)} bytes, over the {TITLE_MAX_BYTES}-byte limit")
        return bytes(body).decode("utf-8")

    def __repr__(self):
        return "TitleHook()"


register(ToolMapHook())
register(TitleHook())


@dataclasses.dataclass(frozen=True)
class Section:
    """One trailer section as on disk: its ext bit and its raw body."""
    bit: int
    body: bytes


def bit_index(key):
    """Maps a values key (a bit index, or a single-bit ExtFlag) to its bit index."""
    if isinstance(key, ExtFlag):
        v = int(key)
        if v <= 0 or v & (v - 1) or v > 1 << MAX_BIT:
            raise ValueError(f"trailer key {key!r} is not a single ext flag")
        return v.bit_length() - 1
    if not _is_bit_index(key):
        raise ValueError(f"trailer key {key!r} is not an ext-bit index 0..{MAX_BIT} or an ExtFlag")
    return int(key)


def _plan(values, keep):
    """The sections to write, in bit order: [(bit, body)], validated."""
    bodies = {}
    given = set()
    for key, value in values.items():
        bit = bit_index(key)
        if bit in given:
            raise ValueError(f"trailer values give ext bit {bit} twice (as {key!r} and another key)")
        given.add(bit)
        if value is None:
            continue          # None: no section for this bit (and no kept one either)
        hook = _HOOKS.get(bit)
        if hook is None:
            raise ValueError(f"ext bit {bit} has no trailer hook; cannot encode a value for it")
        body = hook.encode(value)
        if not isinstance(body, (bytes, bytearray, memoryview)):
            raise TypeError(f"trailer hook {hook!r} returned {type(body).__name__}, not bytes")
        bodies[bit] = bytes(body)
    kept = set()
    for s in keep:
        bit = s.bit
        if not _is_bit_index(bit):
            raise ValueError(f"kept section bit={bit!r} is not an ext-bit index 0..{MAX_BIT}")
        if bit in kept:
            raise ValueError(f"kept sections hold ext bit {bit} twice")
        kept.add(bit)
        # A bit the caller gave a value for, or one a hook here understands, is
        # the caller's to write: only sections this build cannot read pass through.
        if bit in given or bit in _HOOKS:
            continue
        bodies[bit] = bytes(s.body)
    return sorted(bodies.items())


def encode_trailer(values, keep=()):
    """Builds a trailer.

    Args:
        values: {bit: value}; bit is an index 0..7 or a single-bit ExtFlag, and
            value is encoded by that bit's hook.  A value of None writes no
            section for the bit (and drops a kept one).
        keep: raw sections from an older file (parse_trailer's second result).
            Those whose bit has no value in ``values`` and no hook here are
            written back byte for byte; the others are ignored.

    Returns:
        (trailer bytes, ext-flags bitmask of the sections written).

    Raises:
        ValueError: a bad key, a bit given twice, a value for a bit with no hook,
            or a value the hook rejects.
        TypeError: a value of the wrong type for its hook.
    """
    parts = []
    flags = 0
    for bit, body in _plan(values, keep):
        parts.append(SECTION_HEADER.pack(bit, len(body), crc32c(body)))
        parts.append(body)
        flags |= 1 << bit
    return b"".join(parts), flags


def trailer_size(values, keep=()):
    """The byte size encode_trailer(values, keep) returns, with the same checks.

    Returns:
        len(encode_trailer(values, keep)[0]), without joining the trailer.
    """
    return sum(SECTION_HEADER.size + len(body) for _, body in _plan(values, keep))


def parse_trailer(buf, path=None, log=_log):
    """Reads a trailer; bad sections are dropped and logged, never raised.

    Args:
        buf: the trailer bytes (any buffer: bytes, bytearray, memoryview, mmap).
        path: the checkpoint file, named in log lines only.
        log: where drop lines go (one key=value warning per event).

    Returns:
        (values, sections, flags): ``values`` maps each good bit that has a hook
        to its decoded value; ``sections`` lists every good section raw, in file
        order, for encode_trailer(keep=...); ``flags`` is the bitmask of the good
        sections.  A section is good when its bit is 0..7 and not already taken,
        its CRC matches, and its hook (if any) decodes it.
    """
    name = "-" if path is None else os.path.basename(os.fspath(path))
    if ds4.is_tool_map(buf):
        # ds4-server's tool map: not framed, told apart by its first byte (kvstore.ds4).
        try:
            return {0: ds4.parse_tool_map(buf)}, [], 1
        except ValueError:
            log.warning("kvstore: trailer_drop file=%s bit=0 reason=ds4_tool_map offset=0 length=%d",
                        name, len(buf))
            return {}, [], 0
    values = {}
    sections = []
    flags = 0

    def drop(bit, reason, offset, **kv):
        extra = "".join(f" {k}={v}" for k, v in kv.items())
        log.warning("kvstore: trailer_drop file=%s bit=%s reason=%s offset=%d%s",
                    name, bit, reason, offset, extra)

    with memoryview(buf) as raw, raw.cast("B") as view:
        for bit, section_at, start, end, crc in _framed_sections(view, drop):
            reason = _frame_fault(view, bit, start, end, crc, flags)
            if reason is not None:
                drop(bit, reason, section_at, length=end - start)
                continue
            body = bytes(view[start:end])
            hook = _HOOKS.get(bit)
            if hook is not None:
                try:
                    values[bit] = hook.decode(body)
                except Exception as e:   # noqa: BLE001 - a bad body must not break a load
                    # The type only: messages can quote the body.
                    drop(bit, "decode", section_at, length=end - start, error=type(e).__name__)
                    continue
            sections.append(Section(bit, body))
            flags |= 1 << bit
    return values, sections, flags


def _framed_sections(view, drop):
    """The sections framed in view, in order: (bit, section offset, body start,
    body end, CRC32C the header records).  A truncated header or body ends
    the walk with one drop(bit, reason, offset, **kv) call."""
    size = len(view)
    at = 0
    while at < size:
        if size - at < SECTION_HEADER.size:
            # The first byte of a short header is still the bit, if there is one.
            drop(view[at], "truncated_header", at, bytes=size - at)
            return
        bit, length, crc = SECTION_HEADER.unpack_from(view, at)
        start = at + SECTION_HEADER.size
        # Python ints: start + length cannot wrap, even for length near 2**64.
        if length > size - start:
            drop(bit, "truncated_body", at, length=length, avail=size - start)
            return
        yield bit, at, start, start + length, crc
        at = start + length


def _frame_fault(view, bit, start, end, crc, flags):
    """Why a framed section cannot be kept (its bit is no ext bit, is taken in
    flags, or its body fails its CRC), or None."""
    if bit > MAX_BIT:
        return "bad_bit"
    if flags & (1 << bit):
        return "duplicate"
    if crc32c(view[start:end]) != crc:
        return "crc"
    return None


def trailer_sections(fd, entry):
    """The framing of a checkpoint's trailer, read header by header.

    Only the 16-byte section headers are read, never the bodies, so a large
    trailer costs nothing to walk.  Parsing stops where parse_trailer stops:
    at a truncated section header or body.

    Args:
        fd: the open checkpoint, or a sealed file's plain view (an object
            with pread(n, offset): kvstore.seal.SealedSource).
        entry: its Entry (from read_entry or entry_from_fd; a sealed file's
            plain one).

    Yields:
        (bit, body offset in the file, body length, CRC32C the header records);
        a bit above 7 is yielded as read (parse_trailer drops such sections).
    """
    hdr = SECTION_HEADER.size
    at, end = entry.trailer_offset, entry.file_size
    while end - at >= hdr:
        raw = as_source(fd).pread(hdr, at)
        if len(raw) < hdr:
            return
        bit, length, crc = SECTION_HEADER.unpack(raw)
        if length > end - at - hdr:
            return
        yield bit, at + hdr, length, crc
        at += hdr + length
