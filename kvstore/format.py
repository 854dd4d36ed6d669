"""The .kv envelope (docs/format.md §2): header, reasons, flags, entries, touch.

A checkpoint file is a 48-byte header, a u32 text length, the prompt text
bytes, the payload and an optional trailer.  This module reads and writes the
envelope only; payloads are payload.py's and policy is policy.py's.
"""

import dataclasses
import enum
import os
import re
import stat
import struct
import time

from kvstore import _native
from kvstore.errors import CorruptCheckpoint, UnsafePath, os_error

HEADER_SIZE = 48
PREFIX_SIZE = 52                 # header + u32 text length
FORMAT_VERSION = 1

# Quant bits of the model weights a header may carry: ds4 writes 2 and 4 and
# keys on 2/4/5/6/8; 3 is common in MLX quantisation; 16 means unquantised
# half-precision weights.
VALID_QUANT_BITS = frozenset({2, 3, 4, 5, 6, 8, 16})

# Payload ABIs: 2 is ds4's own graph state (listed, never loaded here); 16 is
# kvstore's tensor payload (docs/format.md §3).
PAYLOAD_ABI_DS4 = 2
PAYLOAD_ABI_TENSORS = 16
LOADABLE_ABIS = frozenset({PAYLOAD_ABI_TENSORS})

_NAME_RE = re.compile(r"^[0-9a-fA-F]{40}\.kv$")

_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0) \
    | getattr(os, "O_NONBLOCK", 0)


class Reason(enum.IntEnum):
    """Why a checkpoint was saved (header byte 5)."""
    UNKNOWN = 0
    COLD = 1
    CONTINUED = 2
    EVICT = 3
    SHUTDOWN = 4
    AGENT_SYSTEM = 5
    AGENT_SESSION = 6


class ExtFlag(enum.IntFlag):
    """Trailer extensions present (header byte 6); unknown bits are kept."""
    TOOL_MAP = 1
    RESPONSES_VISIBLE = 2
    THINKING_VISIBLE = 4
    SESSION_TITLE = 8


def _reason(value):
    return Reason(value) if value <= Reason.AGENT_SESSION else Reason.UNKNOWN


_RANGES = {
    "quant_bits": 0xFF, "reason": 0xFF, "ext_flags": 0xFF, "model_id": 0xFF,
    "tokens": 0xFFFFFFFF, "hits": 0xFFFFFFFF, "ctx_size": 0xFFFFFFFF, "payload_abi": 0xFF,
    "created_at": 2**64 - 1, "last_used": 2**64 - 1, "payload_bytes": 2**64 - 1,
}


@dataclasses.dataclass
class Header:
    """The 48-byte header.  ``pack()`` writes it; ``unpack()`` applies docs/format.md §2."""
    quant_bits: int
    tokens: int
    ctx_size: int
    payload_bytes: int
    reason: Reason = Reason.UNKNOWN
    ext_flags: ExtFlag = ExtFlag(0)
    model_id: int = 0
    hits: int = 0
    payload_abi: int = PAYLOAD_ABI_TENSORS
    created_at: int = 0
    last_used: int = 0
    version: int = FORMAT_VERSION

    def pack(self):
        """Returns the 48 header bytes.

        Raises:
            ValueError: a field is out of its on-disk range, or tokens is 0 or
                quant_bits is not one of VALID_QUANT_BITS (docs/format.md §2).
        """
        for name, hi in _RANGES.items():
            v = int(getattr(self, name))
            if not 0 <= v <= hi:
                raise ValueError(f"Header.{name}={v} is outside 0..{hi}")
        if self.tokens == 0:
            raise ValueError("Header.tokens=0: a checkpoint holds at least one token")
        if self.quant_bits not in VALID_QUANT_BITS:
            raise ValueError(f"Header.quant_bits={self.quant_bits} is not one of {sorted(VALID_QUANT_BITS)}")
        if self.version != FORMAT_VERSION:
            raise ValueError(f"Header.version={self.version}; only {FORMAT_VERSION} is written")
        return _native.pack_header(
            self.version, self.quant_bits, int(self.reason), int(self.ext_flags), self.model_id,
            self.tokens, self.hits, self.ctx_size, self.payload_abi,
            self.created_at, self.last_used, self.payload_bytes)

    @classmethod
    def unpack(cls, buf, path=None):
        """Parses the first 48 bytes of buf.

        Raises:
            CorruptCheckpoint: short buffer, wrong magic, version != 1, zero
                tokens, or quant bits outside VALID_QUANT_BITS.
        """
        (version, quant, reason, ext, model_id, tokens, hits, ctx, abi,
         created, last_used, payload_bytes) = _native.parse_header(buf, path)
        if quant not in VALID_QUANT_BITS:
            raise CorruptCheckpoint("bad_quant_bits", path,
                                    f"quant bits {quant}, expected one of {sorted(VALID_QUANT_BITS)}")
        return cls(quant_bits=quant, tokens=tokens, ctx_size=ctx, payload_bytes=payload_bytes,
                   reason=_reason(reason), ext_flags=ExtFlag(ext), model_id=model_id, hits=hits,
                   payload_abi=abi, created_at=created, last_used=last_used, version=version)


@dataclasses.dataclass(frozen=True)
class Entry:
    """One validated .kv file as the index sees it (no payload read)."""
    sha: str
    path: str
    quant_bits: int
    reason: Reason
    ext_flags: ExtFlag
    model_id: int
    tokens: int
    hits: int
    ctx_size: int
    payload_abi: int
    created_at: int
    last_used: int
    payload_bytes: int
    text_bytes: int
    file_size: int
    mtime_ns: int = 0
    inode: int = 0
    # The prompt a lookup matched this entry against (set by KVStore.find so
    # that load can compare the stored text byte for byte); never printed.
    query: bytes = dataclasses.field(default=None, repr=False, compare=False)
    # The object key of a hit in the remote tier (KVStore.find), not yet
    # copied to ``path``: only sha, text_bytes and file_size are known until
    # load() fetches it.  None for a local file.
    remote: str = dataclasses.field(default=None, compare=False)

    @property
    def name(self):
        return os.path.basename(self.path)

    @property
    def text_offset(self):
        return PREFIX_SIZE

    @property
    def payload_offset(self):
        return PREFIX_SIZE + self.text_bytes

    @property
    def trailer_offset(self):
        return PREFIX_SIZE + self.text_bytes + self.payload_bytes

    @property
    def loadable(self):
        return self.payload_abi in LOADABLE_ABIS


def is_checkpoint_name(name):
    """True for 40 hex digits + '.kv' (uppercase hex accepted on read)."""
    return _NAME_RE.match(name) is not None


def open_checkpoint(path, flags=_OPEN_FLAGS):
    """Opens a checkpoint without following symlinks; returns (fd, os.stat_result).

    Raises:
        UnsafePath: a symlink, a directory or anything but a regular file.
        CheckpointMissing / CheckpointOSError: the open failed.
    """
    try:
        fd = os.open(path, flags)
    except OSError as e:
        raise os_error(e.errno, path, "open") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafePath(0, "open: not a regular file", os.fspath(path))
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def entry_from_fd(fd, st, path):
    """Reads and validates the envelope of an open checkpoint into an Entry."""
    prefix = os.pread(fd, PREFIX_SIZE, 0)
    if len(prefix) < PREFIX_SIZE:
        raise CorruptCheckpoint("truncated", path, f"file is {st.st_size} bytes, shorter than the 52-byte prefix")
    h = Header.unpack(prefix, path)
    (text_len,) = struct.unpack_from("<I", prefix, HEADER_SIZE)
    if not _native.envelope_fits(st.st_size, text_len, h.payload_bytes):
        raise CorruptCheckpoint(
            "truncated", path,
            f"file is {st.st_size} bytes; header says 52 + text {text_len} + payload {h.payload_bytes}")
    name = os.path.basename(os.fspath(path))
    sha = name[:-3].lower() if is_checkpoint_name(name) else ""
    return Entry(sha=sha, path=os.fspath(path), quant_bits=h.quant_bits, reason=h.reason,
                 ext_flags=h.ext_flags, model_id=h.model_id, tokens=h.tokens, hits=h.hits,
                 ctx_size=h.ctx_size, payload_abi=h.payload_abi, created_at=h.created_at,
                 last_used=h.last_used, payload_bytes=h.payload_bytes, text_bytes=text_len,
                 file_size=st.st_size, mtime_ns=st.st_mtime_ns, inode=st.st_ino)


def read_entry(path):
    """Reads and validates the envelope of the file at path (no payload read).

    Returns:
        Entry.

    Raises:
        CorruptCheckpoint: the envelope breaks a rule of docs/format.md §2.
        UnsafePath: path is a symlink, a directory or not a regular file.
        CheckpointMissing / CheckpointOSError: the file cannot be opened.
    """
    fd, st = open_checkpoint(path)
    try:
        return entry_from_fd(fd, st, path)
    finally:
        os.close(fd)


def touch(path, now=None):
    """Records a hit in place: hits + 1 and last_used = now, atomically.

    Two processes touching one file never lose an increment (an atomic add
    through a shared memory map).  The count saturates at 2**32 - 1.

    Args:
        path: the checkpoint file (symlinks are refused).
        now: unix seconds; defaults to the current time.

    Returns:
        the new hit count.
    """
    if now is None:
        now = int(time.time())
    if not 0 <= now < 2**64:
        raise ValueError(f"now={now} is outside 0..2**64-1")
    return _native.touch(path, now)
