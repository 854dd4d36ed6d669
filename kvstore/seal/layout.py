"""What a sealed file is (docs/format.md §16): its offsets, chunk grid, clear heads and what each tag binds.

    [0, 52)              the plain header with its ABI + 32, and the text length: clear
    [52, 116)            the seal head: clear
    [116, 180)           a block's chain header, its token digests zeroed: clear
    [BODY_OFFSET, +body) the plain file after its prefix, in GCM chunks (a Grid)
    then                 one 16-byte tag per chunk

The body is exactly the bytes of the unsealed file after its 52-byte prefix
(its payload CRC fields 0: the tags check every byte).  A chunk's tag binds
(its AAD) the file name, every header field that never changes in place,
the seal head (file id, lengths, chunk grid, lookup tag), a block's clear
chain header, the chunk index and whether it is the last: a truncated,
reordered, renamed, re-headed or spliced file fails to authenticate.

This module lays those bytes out and checks them; it holds no key and runs
no cipher.
"""

import collections
import dataclasses
import os
import struct

from kvstore import _native
from kvstore.errors import CorruptCheckpoint
from kvstore.format import (CHAIN_HEAD_SIZE, SEALED_BLOCK_ABIS, PREFIX_SIZE, SEAL_HEAD, SEAL_HEAD_SIZE,
                            SEAL_MAGIC, SEAL_VERSION, SEALED_ABI_OFFSET, SEALED_ABIS, TOKEN_DIGEST, Header,
                            pack_chain_head, parse_chain_head)

FILE_ID_BYTES = 16
TAG_BYTES = 16

# Chunks of 1 MiB: a load has work for every I/O thread from a block of a
# few MiB on (a 256-token block of a 1B model is 8 MiB), a chunk stays in
# L2 while it is read and decrypted, and the tags cost 16 bytes per MiB.
CHUNK_LOG2 = 20
CHUNK_BYTES = 1 << CHUNK_LOG2
# Chunk sizes a reader accepts (the seal head names the writer's).
MIN_CHUNK_LOG2, MAX_CHUNK_LOG2 = 12, 30

# The sealed body starts one page after the 52-byte prefix, so its offsets
# keep the plain file's alignment modulo 4096 (tensor data page- and
# cache-line-aligned, as §3 lays it out); the clear heads sit in that page.
BODY_OFFSET = PREFIX_SIZE + 4096

_CHUNK_AAD = struct.Struct("<QB")
_NONCE = struct.Struct("<Q4x")


class Grid:
    """Where the chunks of a sealed body lie: chunk 0 is [0, first), then
    one every size bytes; the last may be short.

    A writer puts the first boundary where the tensor data starts (modulo
    the chunk size), so the text, a block's chain header and the manifest
    make up the first chunk alone (a short one, unless the text is longer
    than a chunk) and tensor data starts on a chunk boundary: a load
    authenticates the heads of a file without decrypting any tensor bytes,
    and decrypts the tensors in whole chunks where they land.

    Args:
        body: the body's length (> 0).
        size: the chunk size.
        first: chunk 0's length, 1 to size (clipped to the body).
    """

    __slots__ = ("body", "size", "first", "count")

    def __init__(self, body, size, first):
        self.body, self.size, self.first = body, size, min(first, body)
        self.count = 1 + -(-(body - self.first) // size)

    @classmethod
    def for_data_at(cls, body, data_start, size=CHUNK_BYTES):
        """The writer's grid: a boundary at body offset data_start."""
        return cls(body, size, data_start % size or size)

    def of(self, x):
        """The chunk that holds body offset x; self.count for x >= body."""
        if x >= self.body:
            return self.count
        return 0 if x < self.first else 1 + (x - self.first) // self.size

    def span(self, i):
        """(lo, hi): chunk i's body range."""
        if i == 0:
            return 0, self.first
        lo = self.first + (i - 1) * self.size
        return lo, min(self.body, lo + self.size)

    def covering(self, lo, hi):
        """The chunks that hold bytes of [lo, hi), as a range."""
        return range(self.of(lo), self.of(hi - 1) + 1) if hi > lo else range(0)


def sealed_size(grid):
    """A sealed file's length: the clear page, the body, one tag per chunk."""
    return BODY_OFFSET + grid.body + TAG_BYTES * grid.count


def tags_offset(grid):
    """Where a sealed file's tag table starts: right after the body."""
    return BODY_OFFSET + grid.body


def chunk_nonce(i):
    """Chunk i's 12-byte GCM nonce: its index (each file has a key of its own)."""
    return _NONCE.pack(i)


def chunk_aad(aad, i, chunks):
    """What chunk i's tag binds: the file's common AAD, the chunk index and
    whether it is the last (a truncated file fails)."""
    return aad + _CHUNK_AAD.pack(i, i == chunks - 1)


def common_aad(name, prefix, clear):
    """What every chunk's tag binds besides its index: the file name, the
    52-byte prefix without the two fields a hit rewrites in place (hit count,
    last-used time), the seal head and a block's clear chain header."""
    p = bytearray(prefix)
    p[12:16] = bytes(4)          # hit count (kvs_touch_fd)
    p[32:40] = bytes(8)          # last-used time (kvs_touch_fd)
    return bytes(name) + bytes(p) + bytes(clear)


def clear_chain_head(head, tokens):
    """A block's chain header as it stands in the clear: the parent's name
    and the ranges stay (eviction goes leaves first without the key), the
    token digests are zeroed (they would confirm a guessed prompt)."""
    f = parse_chain_head(head, tokens)
    parent = bytes.fromhex(f["parent"]) if f["parent"] else bytes(20)
    return pack_chain_head(parent, f["token_start"], f["text_start"], f["block_grid"], f["chain_flags"],
                           bytes(TOKEN_DIGEST), bytes(TOKEN_DIGEST))


def clear_heads(header, text_len, grid, key_id, file_id, head=b"", lookup_tag=b""):
    """The clear bytes of a sealed file ahead of its body: (prefix, clear).

    Args:
        header: the plain file's Header (ABI 16 or 17); the prefix carries
            it with the sealed ABI (48 or 49) and the sealed payload length.
        text_len: the text's length in bytes.
        grid: the body's chunks (Grid.for_data_at).
        key_id, file_id: the key's id and the file's random id.
        head: a block's plain chain header (b"" for a whole file).
        lookup_tag: the name's lookup tag (b"": none).

    Returns:
        (the 52-byte prefix, the seal head and a block's clear chain header).
    """
    outer = dataclasses.replace(header, payload_abi=header.payload_abi + SEALED_ABI_OFFSET,
                                payload_bytes=sealed_size(grid) - PREFIX_SIZE - text_len)
    seal_head = SEAL_HEAD.pack(SEAL_MAGIC, SEAL_VERSION, CHUNK_LOG2, 0, key_id, file_id, grid.body,
                               header.payload_bytes, header.payload_abi, grid.first,
                               lookup_tag or bytes(_native.LOOKUP_TAG))
    clear = seal_head + (clear_chain_head(head, header.tokens) if head else b"")
    prefix = outer.pack() + text_len.to_bytes(4, "little")
    return prefix, clear


def file_aad(path, prefix, clear):
    """The common AAD of a file about to be published at path (named by its basename)."""
    return common_aad(bytes.fromhex(os.path.basename(path)[:40]), prefix, clear)


# A sealed file's clear heads, parsed and checked: the outer Header, the
# body's Grid, the file id, the plain file's payload length and ABI, and the
# common AAD of its chunks.
SealHead = collections.namedtuple("SealHead", "header grid file_id inner_payload inner_abi aad")


def parse_seal_head(head, st, entry, key_id):
    """The seal head's fields, checked against the file and the key.

    Args:
        head: the file's first BODY_OFFSET bytes.
        st: its os.stat_result (the size is checked against the seal head).
        entry: its Entry (the name the tags bind, the path errors name).
        key_id: the reader's key id.

    Returns:
        SealHead.

    Raises:
        CorruptCheckpoint: ``truncated``, ``bad_seal_head``, or
            ``auth_failed`` for a file sealed with another key.
    """
    path = entry.path
    if len(head) < PREFIX_SIZE + SEAL_HEAD_SIZE:
        raise CorruptCheckpoint("truncated", path, "sealed file shorter than its seal head")
    h = Header.unpack(head, path)
    if h.payload_abi not in SEALED_ABIS:
        raise CorruptCheckpoint("bad_seal_head", path, "not a sealed file")
    (_, _, log2, _, file_key_id, file_id, body, inner_payload, inner_abi,
     first, _) = SEAL_HEAD.unpack_from(head, PREFIX_SIZE)
    if file_key_id != key_id:
        raise CorruptCheckpoint("auth_failed", path, "sealed with another key")
    if not MIN_CHUNK_LOG2 <= log2 <= MAX_CHUNK_LOG2:
        raise CorruptCheckpoint("bad_seal_head", path, f"chunk size 2**{log2}")
    if not 0 < first <= 1 << log2:
        raise CorruptCheckpoint("bad_seal_head", path, f"first chunk of {first} bytes")
    clear_len = SEAL_HEAD_SIZE + (CHAIN_HEAD_SIZE if h.payload_abi in SEALED_BLOCK_ABIS else 0)
    if body == 0:
        raise CorruptCheckpoint("bad_seal_head", path, "empty sealed body")
    grid = Grid(body, 1 << log2, first)
    if st.st_size != sealed_size(grid):
        raise CorruptCheckpoint("truncated", path, f"sealed file is {st.st_size} bytes; its seal head "
                                f"says {sealed_size(grid)}")
    aad = common_aad(bytes.fromhex(entry.sha), head[:PREFIX_SIZE], head[PREFIX_SIZE:PREFIX_SIZE + clear_len])
    return SealHead(h, grid, file_id, inner_payload, inner_abi, aad)


def read_tags(fd, path, grid):
    """The file's tag table (TAG_BYTES per chunk).

    Raises:
        CorruptCheckpoint: ``truncated``, the table cut short.
    """
    tags = os.pread(fd, TAG_BYTES * grid.count, tags_offset(grid))
    if len(tags) != TAG_BYTES * grid.count:
        raise CorruptCheckpoint("truncated", path, "tag table cut short")
    return tags
