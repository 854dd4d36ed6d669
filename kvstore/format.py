"""The .kv envelope (docs/format.md §2): header, reasons, flags, entries, touch.

A checkpoint file is a 48-byte header, a u32 text length, the prompt text
bytes, the payload and an optional trailer.  This module reads and writes the
envelope only; payloads are kvstore.payload's and policy is kvstore.policy's.

A block of a chained checkpoint (payload ABI 17, docs/format.md §14) stores
only its own text segment and opens its payload with a 64-byte chain header
(parent digest, absolute token and text starts, flags): the index needs
those without reading payload data, and one read at open finds them.
"""

import dataclasses
import enum
import os
import re
import stat
import struct
import time

from kvstore import _native
# The digests and the CRC of the format, as the rest of it uses them
# (kvstore.format.sha1, .sha1_prefixes, .crc32c: csrc/, GIL released).
from kvstore._native import crc32c, sha1, sha1_prefixes  # noqa: F401
from kvstore.errors import CorruptCheckpoint, KVStoreError, UnsafePath, os_error

HEADER_SIZE = 48
PREFIX_SIZE = 52                 # header + u32 text length
FORMAT_VERSION = 1

# Quant bits of the model weights a header may carry: ds4 writes 2 and 4 and
# keys on 2/4/5/6/8; 3 is common in MLX quantisation; 16 means unquantised
# half-precision weights.
VALID_QUANT_BITS = frozenset({2, 3, 4, 5, 6, 8, 16})

# Payload ABIs: 2 is ds4's own graph state (listed, never loaded here); 16 is
# kvstore's tensor payload of a whole prefix (docs/format.md §3); 17 is one
# block of a chain (docs/format.md §14).
PAYLOAD_ABI_DS4 = 2
PAYLOAD_ABI_TENSORS = 16
PAYLOAD_ABI_CHAIN = 17

# Packed blocks (docs/format.md §20): a chain block with tensors stored as
# byte planes, table planes where they shrink (kvstore.payload.packing).
# ABI = the plain ABI + 192, so a reader that does not unpack them sees a
# foreign ABI (listed, counted in the budget, evictable, never loaded) and a
# chain stops before such a block: a shorter hit, never another block's
# bytes read as tensors.  ABI 81 (the plain ABI + 64) held zstd-compressed
# planes in builds before table planes: retired, a foreign ABI here.
TABLE_ABI_OFFSET = 192
PAYLOAD_ABI_TABLE_CHAIN = PAYLOAD_ABI_CHAIN + TABLE_ABI_OFFSET       # 209
PAYLOAD_ABI_ZSTD_CHAIN = PAYLOAD_ABI_CHAIN + 64                      # 81, retired
# Quantised blocks (§20): tensors stored lossy (kvstore.payload.quantizing).
# ABI = the plain ABI + 128: a build that knows packed blocks but not
# quantised ones sees a foreign ABI too, never a row it cannot read.
LOSSY_ABI_OFFSET = 128
PAYLOAD_ABI_LOSSY_CHAIN = PAYLOAD_ABI_CHAIN + LOSSY_ABI_OFFSET       # 145
# A whole file (ABI 16) packs and quantises its tensors the same way: 208, 144.
PAYLOAD_ABI_TABLE_TENSORS = PAYLOAD_ABI_TENSORS + TABLE_ABI_OFFSET   # 208
PAYLOAD_ABI_LOSSY_TENSORS = PAYLOAD_ABI_TENSORS + LOSSY_ABI_OFFSET   # 144
PACKED_BLOCK_ABIS = frozenset({PAYLOAD_ABI_TABLE_CHAIN, PAYLOAD_ABI_LOSSY_CHAIN})
PACKED_WHOLE_ABIS = frozenset({PAYLOAD_ABI_TABLE_TENSORS, PAYLOAD_ABI_LOSSY_TENSORS})
PACKED_ABIS = PACKED_BLOCK_ABIS | PACKED_WHOLE_ABIS
LOSSY_ABIS = frozenset({PAYLOAD_ABI_LOSSY_CHAIN, PAYLOAD_ABI_LOSSY_TENSORS})
LOADABLE_ABIS = frozenset({PAYLOAD_ABI_TENSORS, PAYLOAD_ABI_CHAIN}) | PACKED_ABIS

# Sealed checkpoints (docs/format.md §16): the same two layouts encrypted and
# authenticated with a store key (kvstore.seal).  ABI = inner ABI + 32, so a
# build (or a store) without the key sees a foreign ABI: listed, counted in
# the budget, evictable, never loaded.
SEALED_ABI_OFFSET = 32
PAYLOAD_ABI_SEALED = PAYLOAD_ABI_TENSORS + SEALED_ABI_OFFSET        # 48
PAYLOAD_ABI_SEALED_CHAIN = PAYLOAD_ABI_CHAIN + SEALED_ABI_OFFSET    # 49
# A sealed block whose inner payload is packed or quantised (§20): 241, 177;
# a sealed whole file of either: 240, 176.
SEALED_BLOCK_ABIS = frozenset({PAYLOAD_ABI_SEALED_CHAIN} | {a + SEALED_ABI_OFFSET for a in PACKED_BLOCK_ABIS})
SEALED_WHOLE_ABIS = frozenset({PAYLOAD_ABI_SEALED} | {a + SEALED_ABI_OFFSET for a in PACKED_WHOLE_ABIS})
SEALED_ABIS = SEALED_WHOLE_ABIS | SEALED_BLOCK_ABIS
# The ABIs of a chain's blocks: plain, sealed, packed and quantised.
BLOCK_ABIS = frozenset({PAYLOAD_ABI_CHAIN}) | PACKED_BLOCK_ABIS | SEALED_BLOCK_ABIS

# The clear seal head of a sealed file, at offset 52 (64 bytes):
#   0  "KVSL"   4  u8 version 1   5  u8 log2 of the chunk size   6  u16 0
#   8  key id (8 bytes)   16  file id (16 random bytes)   32  u64 sealed body length
#   40 u64 the inner payload length   48  u8 inner payload ABI   49  15 bytes 0
# A sealed chain block (ABI 49) follows it with a clear chain header whose
# parent is the parent's file name and whose token digests are zero.
SEAL_MAGIC = b"KVSL"
SEAL_VERSION = 1
# magic, version, log2 chunk size, 0, key id, file id, body length, inner payload
# length, inner ABI, (3 zero bytes), first chunk length, lookup tag
SEAL_HEAD = struct.Struct("<4sBBH8s16sQQB3xI8s")
SEAL_HEAD_SIZE = SEAL_HEAD.size                    # 64

# The chain header at the start of an ABI 17 payload (64 bytes):
#   0  "KVCB"   4  u16 version 1   6  u16 flags   8  parent digest (20 bytes, zeros: none)
#   28 u32 token start   32 u32 block grid (tokens)   36 u64 text start
#   44 8 bytes of SHA1 of the token ids [0, end) (u32 LE)   52 the same of [0, start)
#   60 u32 CRC32C of bytes 0..60
# The token digests let a block continue only a parent made from the same
# token ids: two tokenizations of one text share a name, never a chain.
CHAIN_MAGIC = b"KVCB"
CHAIN_VERSION = 1
CHAIN_HEAD = struct.Struct("<4sHH20sIIQ8s8sI")
CHAIN_HEAD_SIZE = CHAIN_HEAD.size                # 64
CHAIN_RESTORABLE = 1     # flag: this block and its ancestors give the whole state
CHAIN_END = 2            # flag: the last block a save wrote (a stored sequence ends here)
NO_PARENT = bytes(20)
TOKEN_DIGEST = 8         # bytes of each token digest kept

# Bytes read at once from the start of a file: the envelope, and for a
# chain block with a short text segment its chain header too (one pread).
HEAD_READ = 4096

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
    "model_tag": 0xFFFFFF,
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
    # Bytes 21..23 (ds4's reserved bytes, written 0 there): 24 bits naming the
    # model that made the checkpoint (kvstore.identity.ModelIdentity.tag); 0:
    # none recorded (ds4's files, kvstore's before model identities).
    model_tag: int = 0

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
            self.created_at, self.last_used, self.payload_bytes, self.model_tag)

    @classmethod
    def unpack(cls, buf, path=None):
        """Parses the first 48 bytes of buf.

        Raises:
            CorruptCheckpoint: short buffer, wrong magic, version != 1, zero
                tokens, or quant bits outside VALID_QUANT_BITS.
        """
        (version, quant, reason, ext, model_id, tokens, hits, ctx, abi,
         created, last_used, payload_bytes, model_tag) = _native.parse_header(buf, path)
        if quant not in VALID_QUANT_BITS:
            raise CorruptCheckpoint("bad_quant_bits", path,
                                    f"quant bits {quant}, expected one of {sorted(VALID_QUANT_BITS)}")
        return cls(quant_bits=quant, tokens=tokens, ctx_size=ctx, payload_bytes=payload_bytes,
                   reason=_reason(reason), ext_flags=ExtFlag(ext), model_id=model_id, hits=hits,
                   payload_abi=abi, created_at=created, last_used=last_used, version=version,
                   model_tag=model_tag)


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
    # A chain block (ABI 17) covers tokens [token_start, tokens) and text
    # bytes [text_start, text_bytes) of its sequence; its parent is the block
    # ending at token_start ("" for the first block).  text_bytes is always
    # the absolute length the name is the digest of.  0, 0, "" for ABI 16.
    token_start: int = 0
    text_start: int = 0
    parent: str = ""
    chain_flags: int = 0
    block_grid: int = 0
    token_digest: bytes = b""
    parent_token_digest: bytes = b""
    # A sealed file (ABI 48 or 49): the id of the key that sealed it (clear,
    # so that another key's files are foreign, never corrupt), and its lookup
    # tag (the first bytes of its name's inner hash, docs/format.md §16).
    # b"" otherwise.
    key_id: bytes = b""
    lookup_tag: bytes = b""
    # The header's model tag (0: the file names no model; docs/semantics.md §17).
    model_tag: int = 0

    @classmethod
    def from_header(cls, h, sha, path, text_bytes, file_size, **more):
        """The Entry of a file whose header is h (Header) and whose text is
        text_bytes long: the one place a header's fields become an entry's
        (a local file's, kvstore.format.entry_from_fd; a bucket object's,
        kvstore.remote.janitor).  more: the other fields (a chain block's,
        a sealed file's, the file's mtime and inode)."""
        return cls(sha=sha, path=path, quant_bits=h.quant_bits, reason=h.reason, ext_flags=h.ext_flags,
                   model_id=h.model_id, tokens=h.tokens, hits=h.hits, ctx_size=h.ctx_size,
                   payload_abi=h.payload_abi, created_at=h.created_at, last_used=h.last_used,
                   payload_bytes=h.payload_bytes, text_bytes=text_bytes, file_size=file_size,
                   model_tag=h.model_tag, **more)

    def but(self, cls=None, **changes):
        """This entry with some fields changed (as a cls, a subclass, when
        given): a copy of its fields, several times cheaper than
        dataclasses.replace, which a lookup pays per block."""
        out = object.__new__(cls or type(self))
        out.__dict__.update(self.__dict__, **changes)
        return out

    @property
    def name(self):
        return os.path.basename(self.path)

    @property
    def text_offset(self):
        return PREFIX_SIZE

    @property
    def segment_bytes(self):
        """The text bytes stored in this file (all of them, but for a chain block)."""
        return self.text_bytes - self.text_start

    @property
    def payload_offset(self):
        return PREFIX_SIZE + self.segment_bytes

    @property
    def trailer_offset(self):
        return self.payload_offset + self.payload_bytes

    @property
    def loadable(self):
        """A payload ABI this build loads."""
        return self.payload_abi in LOADABLE_ABIS

    @property
    def sealed(self):
        """Encrypted and authenticated with a store key (docs/format.md §16)."""
        return self.payload_abi in SEALED_ABIS

    @property
    def is_block(self):
        """A block of a chain, sealed or not (a sealed one's links are clear)."""
        return self.payload_abi in BLOCK_ABIS

    @property
    def packed(self):
        """Its tensors may be stored packed (docs/format.md §20)."""
        return self.payload_abi in PACKED_ABIS

    @property
    def lossy(self):
        """Its tensors may be stored quantised (docs/format.md §20)."""
        return self.payload_abi in LOSSY_ABIS

    @property
    def restorable(self):
        """Loadable as a whole state: an ABI 16 file, or a block that carries
        every snapshot its state needs (its chain gives the rest)."""
        if self.is_block:
            return bool(self.chain_flags & CHAIN_RESTORABLE)
        return self.loadable or self.sealed

    @property
    def ends_save(self):
        """A checkpoint a save asked for: an ABI 16 file, or the last block a chained save wrote."""
        return not self.is_block or bool(self.chain_flags & CHAIN_END)

    @property
    def tensors_offset(self):
        """Where the tensor payload (KVTP header, manifest, data) starts in the file."""
        return self.payload_offset + (CHAIN_HEAD_SIZE if self.is_block else 0)

    @property
    def tensors_bytes(self):
        return self.payload_bytes - (CHAIN_HEAD_SIZE if self.is_block else 0)

    @property
    def stored_tokens(self):
        """The token ids stored in this file (a block stores only its range)."""
        return self.tokens - self.token_start


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


def pack_chain_head(parent, token_start, text_start, grid, flags, token_digest, parent_token_digest):
    """The 64-byte chain header of an ABI 17 block.

    Args:
        parent: the parent's 20-byte digest (NO_PARENT for the first block).
        token_start, text_start: where the block starts in its sequence.
        grid: the chain's block size in tokens.
        flags: CHAIN_RESTORABLE | CHAIN_END bits.
        token_digest, parent_token_digest: TOKEN_DIGEST bytes of the SHA1 of
            the token ids up to the block's end and up to its start.
    """
    raw = CHAIN_HEAD.pack(CHAIN_MAGIC, CHAIN_VERSION, flags, parent, token_start, grid, text_start,
                          token_digest, parent_token_digest, 0)
    return raw[:-4] + _native.crc32c(raw[:-4]).to_bytes(4, "little")


def parse_chain_head(raw, tokens, path=None):
    """The fields of a block's chain header, as Entry keyword arguments.

    Raises:
        CorruptCheckpoint: bad magic, version or CRC, or a range that breaks
            the chain rules (a first block starts at 0, every other one after
            0 and before its end).
    """
    if len(raw) < CHAIN_HEAD_SIZE:
        raise CorruptCheckpoint("truncated", path, "chain header cut short")
    (magic, version, flags, parent, token_start, grid, text_start, token_digest, parent_token_digest,
     crc) = CHAIN_HEAD.unpack_from(raw)
    if magic != CHAIN_MAGIC:
        raise CorruptCheckpoint("bad_chain_header", path, "chain header is not KVCB")
    if _native.crc32c(bytes(raw[:CHAIN_HEAD_SIZE - 4])) != crc:
        raise CorruptCheckpoint("crc", path, "chain header CRC mismatch")
    if version != CHAIN_VERSION:
        raise CorruptCheckpoint("bad_chain_header", path, f"chain header version {version}, expected 1")
    if token_start >= tokens or grid == 0:
        raise CorruptCheckpoint("bad_chain_header", path,
                                f"block starts at token {token_start} of {tokens} (grid {grid})")
    if (parent == NO_PARENT) != (token_start == 0) or (token_start == 0 and text_start != 0):
        raise CorruptCheckpoint("bad_chain_header", path, "only a block at token 0 has no parent")
    return dict(parent="" if parent == NO_PARENT else parent.hex(), token_start=token_start,
                text_start=text_start, chain_flags=flags, block_grid=grid, token_digest=token_digest,
                parent_token_digest=parent_token_digest)


def parse_seal_heads(head, h, text_len, file_size, path=None):
    """The clear fields of a sealed file (its seal head, and a block's chain
    header), as Entry keyword arguments; only their structure is checked here,
    their authenticity by kvstore.seal with the key.

    Raises:
        CorruptCheckpoint: a head cut short or malformed.
    """
    at = PREFIX_SIZE + SEAL_HEAD_SIZE
    block = h.payload_abi in SEALED_BLOCK_ABIS
    if len(head) < at + (CHAIN_HEAD_SIZE if block else 0):
        raise CorruptCheckpoint("truncated", path, "sealed file shorter than its seal head")
    magic, version, _, _, key_id, _, body, _, inner, _, tag = SEAL_HEAD.unpack_from(head, PREFIX_SIZE)
    if magic != SEAL_MAGIC or version != SEAL_VERSION:
        raise CorruptCheckpoint("bad_seal_head", path, "seal head is not KVSL version 1")
    if inner != h.payload_abi - SEALED_ABI_OFFSET or body < text_len:
        raise CorruptCheckpoint("bad_seal_head", path, "seal head disagrees with the header")
    out = dict(key_id=key_id, lookup_tag=tag)
    if block:
        out.update(parse_chain_head(head[at:at + CHAIN_HEAD_SIZE], h.tokens, path))
    return out


def prefix_text_bytes(prefix):
    """The text length a file's 52-byte prefix gives (the u32 after the header)."""
    return struct.unpack_from("<I", prefix, HEADER_SIZE)[0]


def entry_from_fd(fd, st, path):
    """Reads and validates the envelope of an open checkpoint into an Entry.

    A chain block's chain header is read and checked too (one read when its
    text segment is short).
    """
    head = os.pread(fd, HEAD_READ, 0)
    if len(head) < PREFIX_SIZE:
        raise CorruptCheckpoint("truncated", path, f"file is {st.st_size} bytes, shorter than the 52-byte prefix")
    h = Header.unpack(head, path)
    text_len = prefix_text_bytes(head)
    if not _native.envelope_fits(st.st_size, text_len, h.payload_bytes):
        raise CorruptCheckpoint(
            "truncated", path,
            f"file is {st.st_size} bytes; header says 52 + text {text_len} + payload {h.payload_bytes}")
    chain = {}
    if h.payload_abi in SEALED_ABIS:
        chain = parse_seal_heads(head, h, text_len, st.st_size, path)
        text_len += chain.get("text_start", 0)
    elif h.payload_abi == PAYLOAD_ABI_CHAIN or h.payload_abi in PACKED_BLOCK_ABIS:
        at = PREFIX_SIZE + text_len
        if h.payload_bytes < CHAIN_HEAD_SIZE:
            raise CorruptCheckpoint("bad_payload", path, "block payload shorter than its chain header")
        raw = head[at:at + CHAIN_HEAD_SIZE]
        if len(raw) < CHAIN_HEAD_SIZE:
            raw = os.pread(fd, CHAIN_HEAD_SIZE, at)
        chain = parse_chain_head(raw, h.tokens, path)
        text_len += chain["text_start"]      # the absolute length the name covers
    name = os.path.basename(os.fspath(path))
    sha = name[:-3].lower() if is_checkpoint_name(name) else ""
    return Entry.from_header(h, sha, os.fspath(path), text_len, st.st_size, mtime_ns=st.st_mtime_ns,
                             inode=st.st_ino, **chain)


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


def envelope_now(path):
    """The envelope at path now, or None (missing, corrupt, unsafe): read_entry without the reasons."""
    try:
        return read_entry(path)
    except KVStoreError:
        return None


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
