"""Chained checkpoints (payload ABI 17, docs/format.md §14): cutting a save into blocks, reading a chain.

A stored sequence is a chain of blocks.  Blocks end at multiples of the grid
(block_tokens), except the last block a save writes, which ends where the
save ends.  Each block is one .kv file named by the SHA1 of the whole text up
to its end, as an ABI 16 file would be, so the one-pass lookup finds the
longest stored block unchanged; it stores only its own range: its token ids,
its text segment, the slices of the tensors that grow along the sequence,
and (when it is the end of a save, or the state has nothing else) the
snapshots of the rest.

This module plans the blocks of a save (plan_blocks), builds what each block
holds (block_tensors), checks whether a block on disk is the one a save would
write (same_block), and opens a chain for a load (open_chain).  The store
decides which blocks to write, holds the directory lock, and evicts.
"""

import collections
import dataclasses
import os
import struct
import threading

import numpy as np

from kvstore import _native, files, payload
from kvstore.errors import CheckpointMissing, CorruptCheckpoint, KVStoreError
from kvstore.files import RDWR_FLAGS
from kvstore.format import (CHAIN_END, CHAIN_HEAD_SIZE, CHAIN_RESTORABLE, HEAD_READ, HEADER_SIZE, NO_PARENT,
                            PREFIX_SIZE, TOKEN_DIGEST, entry_from_fd, open_checkpoint)
from kvstore.forest import chain_link_ok
from kvstore.names import names_of
from kvstore.sources import as_source



@dataclasses.dataclass(frozen=True)
class BlockPlan:
    """One block of a save: tokens [token_start, tokens), text [text_start, text_bytes)."""
    sha: str
    parent: str                  # "" for the first block
    token_start: int
    tokens: int
    text_start: int
    text_bytes: int
    token_digest: bytes
    parent_token_digest: bytes
    last: bool                   # the end of the save
    lookup_tag: bytes = b""      # a sealed store's (kvstore.names.names_of)

    @property
    def name(self):
        return self.sha + ".kv"

    def flags(self, restorable):
        return (CHAIN_RESTORABLE if restorable else 0) | (CHAIN_END if self.last else 0)

    @property
    def parent_digest(self):
        return bytes.fromhex(self.parent) if self.parent else NO_PARENT


def cut_points(n, grid, text_offsets, text_len):
    """[(token end, text end)] of the blocks a save of n tokens is cut into.

    Cuts fall on multiples of grid; a cut that adds no text (tokens that
    render to nothing) is left out, since a block and its parent would share
    a name.

    Args:
        n: the save's token count.
        grid: block_tokens.
        text_offsets: None (one block: the store cannot cut without them), a
            sequence of n + 1 byte lengths (text_offsets[i]: bytes of the text
            of the first i tokens), a callable i -> that length, or a dict
            {i: length} that knows only some cut points (the others are
            passed over).
        text_len: the save's text length (text_offsets[n] must equal it).

    Raises:
        ValueError: offsets that go down, pass the text, or miss its end.
    """
    if text_offsets is None:
        return [(n, text_len)]
    if isinstance(text_offsets, dict):
        get = {n: text_len, **text_offsets}.get
    elif callable(text_offsets):
        get = text_offsets
    else:
        if len(text_offsets) != n + 1:
            raise ValueError(f"text_offsets holds {len(text_offsets)} values; {n} tokens need {n + 1}")
        get = text_offsets.__getitem__
    end = int(get(n))
    if end != text_len:
        raise ValueError(f"text_offsets[{n}]={end} is not the text length {text_len}")
    cuts, prev = [], 0
    for c in range(grid, n, grid):
        off = get(c)
        if off is None:
            continue
        off = int(off)
        if not 0 <= off <= text_len or off < prev:
            raise ValueError(f"text_offsets[{c}]={off} is outside {prev}..{text_len} (offsets must not go down)")
        if off == prev or off == text_len:
            continue
        cuts.append((c, off))
        prev = off
    cuts.append((n, text_len))
    return cuts


def plan_blocks(text, tokens, grid, text_offsets=None, name_key=None):
    """The blocks a save of (text, tokens) is cut into, first block first.

    Names come from one SHA1 pass over the text (HMAC-SHA1 under name_key,
    a sealed store's, when given, and their lookup tags), token digests from
    one pass over the token ids.
    """
    n = int(tokens.size)
    cuts = cut_points(n, grid, text_offsets, len(text))
    names, tags = names_of(text, [t for _, t in cuts], name_key)
    raw = np.ascontiguousarray(tokens, dtype="<u4").view(np.uint8)
    digests = [d[:TOKEN_DIGEST] for d in _native.sha1_prefixes(raw, [0] + [4 * c for c, _ in cuts])]
    out, prev = [], ""
    for i, ((tok, txt), name) in enumerate(zip(cuts, names)):
        start_tok, start_txt = (0, 0) if i == 0 else cuts[i - 1]
        out.append(BlockPlan(sha=name.hex(), parent=prev, token_start=start_tok, tokens=tok,
                             text_start=start_txt, text_bytes=txt, token_digest=digests[i + 1],
                             parent_token_digest=digests[i], last=i == len(cuts) - 1, lookup_tag=tags[i]))
        prev = name.hex()
    return out


def slice_along(a, axis, start, stop):
    """a[..., start:stop, ...] along axis: a view for numpy and MLX arrays alike."""
    return a[(slice(None),) * axis + (slice(start, stop),)]


def block_tensors(tensors, axes, block, snapshots):
    """What a block holds: its slice of every growing tensor, and the snapshots if asked."""
    out = {}
    for name, a in tensors.items():
        if name in axes:
            out[name] = slice_along(a, axes[name], block.token_start, block.tokens)
        elif snapshots:
            out[name] = a
    return out


def same_block(entry, block, parent_ok=True):
    """True when the block on disk (entry) is the one this save would write:
    the same range, text and token ids, continuing the same parent."""
    return (entry is not None and entry.is_block and parent_ok and entry.sha == block.sha
            and entry.parent == block.parent and entry.token_start == block.token_start
            and entry.tokens == block.tokens and entry.text_start == block.text_start
            and entry.text_bytes == block.text_bytes and entry.token_digest == block.token_digest
            and entry.parent_token_digest == block.parent_token_digest)


# A block's envelope parsed once: the parse (entry_from_fd) is a function of
# the bytes it reads, the file's size and its path, so a block read again
# with the same bytes is not parsed again.  The hit count and last-used time
# (header bytes 12..16 and 32..40, which kvs_touch_fd changes in place on
# every load) are left out of the key and taken from the bytes read now.
# The parse costs about 10 us a block; the keys hold the bytes read (at most
# HEAD_READ each: 4 MiB for _ENVELOPES_MAX of them, 64 chains of 16 blocks).
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_ENVELOPES = collections.OrderedDict()
_ENVELOPES_MAX = 1024
_envelopes_lock = threading.Lock()


def block_entry(fd, st, path):
    """(Entry of an open checkpoint, the first bytes of the file):
    entry_from_fd, parsed again only when the envelope's bytes change.

    The bytes returned hold the envelope, and for a plain block with a
    short text segment its text and payload header too (HEAD_READ).

    Raises:
        CorruptCheckpoint: as entry_from_fd.
    """
    head = os.pread(fd, HEAD_READ, 0)
    if len(head) < PREFIX_SIZE or PREFIX_SIZE + _U32.unpack_from(head, HEADER_SIZE)[0] + CHAIN_HEAD_SIZE > len(head):
        # Short (entry_from_fd says why), or a chain header past the bytes
        # read (entry_from_fd reads it): parsed as it is.
        return entry_from_fd(fd, st, path), head
    key = (path, st.st_dev, st.st_ino, st.st_size, head[:12], head[16:32], head[40:])
    with _envelopes_lock:
        e = _ENVELOPES.get(key)
        if e is not None:
            _ENVELOPES.move_to_end(key)
    if e is None:
        e = entry_from_fd(fd, st, path)
        with _envelopes_lock:
            _ENVELOPES[key] = e
            while len(_ENVELOPES) > _ENVELOPES_MAX:
                _ENVELOPES.popitem(last=False)
    # The fields that change in place, from the bytes just read.
    return e.but(hits=_U32.unpack_from(head, 12)[0], last_used=_U64.unpack_from(head, 32)[0],
                 mtime_ns=st.st_mtime_ns), head


def open_block(path):
    """(fd, stat, writable) of a checkpoint: opened read-write when the file
    allows it, so that the load's hit is recorded through the same
    descriptor (the file just read, never a newer one renamed over its
    name), else read-only.

    Raises:
        as open_checkpoint (of a read-only open).
    """
    try:
        fd, st = open_checkpoint(path, RDWR_FLAGS)
        return fd, st, True
    except CheckpointMissing:
        raise
    except KVStoreError:
        pass                # read-only (a file or mount we may not write): the read-only open says why else
    fd, st = open_checkpoint(path)
    return fd, st, False


class OpenChain:
    """The files of a chain, open, their envelopes re-read and their links checked.

    Use as a context manager (closes every file).  ``blocks`` is
    [(fd, stat, Entry)], first block first.

    name_key is the kvstore.names.NameKey of the blocks' names (None:
    SHA1).  For a sealed chain, opener(fd, stat, Entry) gives (a source of
    the block's plain bytes, a kvstore.seal.SealedSource that authenticates
    what it reads; the plain Entry) (kvstore.seal.Sealer.source); ``blocks``
    then holds the sources, their entries keeping the sealed files' paths
    and names.

    Raises:
        CheckpointMissing: a block vanished since the lookup.
        CorruptCheckpoint: a block is corrupt or no longer continues its parent
            (``path`` names the block).
    """

    def __init__(self, chain, opener=None, name_key=None):
        self.blocks = []
        self._held = []
        self._files = []        # (the file's own descriptor, opened read-write), per block
        self._heads = []        # a plain block's first bytes (block_entry), b"" for a sealed one
        self._name_key = name_key
        try:
            prev = None
            for e in chain:
                fd, st, writable = open_block(e.path)
                self.blocks.append((fd, st, None))
                self._files.append((fd, writable))
                cur, head = block_entry(fd, st, e.path)
                if opener is not None:
                    # The sealed file stays open (its inode is not reused
                    # before its hit is recorded); reads go through the source.
                    self._held.append(fd)
                    self.blocks.pop()
                    fd, cur = opener(fd, st, cur)
                    self.blocks.append((fd, st, cur))
                    head = b""
                self._heads.append(head)
                if not cur.is_block or (prev is None and cur.parent) or \
                        (prev is not None and not chain_link_ok(cur, prev)):
                    raise CorruptCheckpoint("broken_chain", e.path, "block does not continue its parent")
                self.blocks[-1] = (fd, st, cur)
                prev = cur
        except BaseException:
            self.close()
            raise

    @property
    def entries(self):
        return [e for _, _, e in self.blocks]

    def text(self):
        """The whole text: every block's segment, checked against its name."""
        parts = []
        for (fd, _, e), head in zip(self.blocks, self._heads):
            end = PREFIX_SIZE + e.segment_bytes
            seg = head[PREFIX_SIZE:end] if end <= len(head) else payload.pread(fd, e.segment_bytes, PREFIX_SIZE)
            if len(seg) != e.segment_bytes:
                raise CorruptCheckpoint("truncated", e.path, "text cut short")
            parts.append(seg)
        text = b"".join(parts)
        names, _ = names_of(text, [e.text_bytes for e in self.entries], self._name_key)
        for (_, _, e), d in zip(self.blocks, names):
            if d.hex() != e.sha:
                raise CorruptCheckpoint("text_hash", e.path, "stored text does not hash to the file name")
        return text

    def layout(self):
        """The read plan of every token and tensor (kvstore.payload.ChainLayout)."""
        return payload.ChainLayout([(fd, e) for fd, _, e in self.blocks], self._heads)

    def record_hits(self):
        """Adds one hit and sets the last-used time in place on every block
        whose name still holds the file read (kvstore.files.record_hit,
        through the descriptors held open).

        Returns:
            the new hit counts, first block first (a block whose name is
            gone or holds another file, or whose hit could not be recorded,
            keeps its count: the load stands, uncounted).
        """
        return [files.record_hit(e.path, st, e.hits, fd if writable else None)
                for (fd, writable), (_, st, e) in zip(self._files, self.blocks)]

    def close(self):
        for fd, _, _ in self.blocks:
            as_source(fd).close()
        for fd in self._held:
            os.close(fd)
        self.blocks = []
        self._held = []
        self._files = []
        self._heads = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


__all__ = ["BlockPlan", "cut_points", "plan_blocks", "slice_along", "block_tensors",
           "same_block", "block_entry", "open_block", "OpenChain"]
