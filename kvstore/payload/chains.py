"""Chain reads (ABI 17): a chain of blocks, root first, read into one set of tensors (docs/format.md §14).

A tensor that grows along the sequence ("axis" in the manifest) holds only
each block's own positions; a chain load allocates each such tensor once at
the chain's full length and reads every block's slice straight into place
(strided reads, one CRC per block and tensor).  Any other tensor is a
snapshot, read from the target block alone.
"""

import bisect
import dataclasses
import itertools
import math
import os
import threading

import numpy as np

from kvstore import _native, host
from kvstore.errors import CorruptCheckpoint
from kvstore.payload.batch import Batch
from kvstore.payload.buffers import bytes_view
from kvstore.payload.manifest import BLOCK_ALIGN, DTYPES, align, numpy_dtype, read_manifest
from kvstore.payload.pool import QUEUE_BYTES
from kvstore.payload.whole import VirtualBlob, safetensors_head
from kvstore.sources import sealed

class Piece:
    """One read of a chain load: count runs of run bytes, consecutive in the
    file from file_offset, landing every stride bytes from dst in a tensor.
    label names it in errors: "tokens", or (tensor name, block name).
    packed: (stored bytes, Form) of a packed block, which the file holds
    from file_offset as its stored bytes (kvstore.payload.forms), or None."""

    __slots__ = ("fd", "path", "file_offset", "run", "count", "stride", "dst", "crc", "label", "packed")

    def __init__(self, fd, path, file_offset, run, count, stride, dst, crc, label, packed=None):
        self.fd, self.path, self.file_offset = fd, path, file_offset
        self.run, self.count, self.stride, self.dst = run, count, stride, dst
        self.crc, self.label, self.packed = crc, label, packed

    @property
    def nbytes(self):
        return self.run * self.count

    @property
    def what(self):
        if isinstance(self.label, tuple):
            return f"tensor {self.label[0]!r} of {self.label[1][:12]}"
        return f"{self.label} of {os.path.basename(self.path)[:12]}"

    def __repr__(self):
        return (f"Piece({self.what}, at {self.file_offset}: {self.count} x {self.run} B "
                f"every {self.stride} from {self.dst})")


@dataclasses.dataclass
class ChainTensor:
    """A tensor of a chain load: its full dtype and shape."""
    name: str
    dtype: str
    shape: tuple
    nbytes: int


def _growing(m):
    """What a chain's blocks must agree on: the model that made them, each
    growing tensor's dtype, the dimensions before and after its axis, and
    the axis (kept on the manifest)."""
    g = m.__dict__.get("_growing")
    if g is None:
        g = m._growing = (m.model, {r[0]: (r[1], r[2][:m.axes[r[0]]], r[2][m.axes[r[0]] + 1:], m.axes[r[0]])
                                    for r in m.tensors if r[0] in m.axes})
    return g


class ChainLayout:
    """The read plan of a chain of blocks, root first, target last.

    A tensor with an "axis" in the target's manifest grows along the
    sequence: every block holds its own positions of it, and the whole
    tensor is the blocks' slices end to end along that axis.  Any other
    tensor of the target is a snapshot, read from the target alone.

    Only the root's and the target's manifests are read here (they give
    every tensor's full shape); pieces() reads the others one block at a
    time, so a load reads block k while the manifest of block k + 1 is
    parsed.

    Args:
        blocks: [(fd, Entry)], root first; the caller has checked that each
            block starts where its parent ends.
        heads: the first bytes of each block's file, read already (b"" for
            none; kvstore.chain.block_entry), or None.
        target_manifest: the target's Manifest, read already, or None.

    Raises:
        CorruptCheckpoint: from read_manifest, or "chain_mismatch" naming the
            first block that grows other tensors (names, dtypes, the other
            dimensions, the axes) than the root, so the consistent chain
            above it survives.
    """

    def __init__(self, blocks, heads=None, target_manifest=None):
        self.blocks = list(blocks)
        self.heads = list(heads) if heads is not None else [b""] * len(self.blocks)
        fd_t, target = self.blocks[-1]
        self.target = target
        m_t = target_manifest or read_manifest(fd_t, target, first=self.heads[-1])
        m_0 = m_t if len(self.blocks) == 1 else read_manifest(*self.blocks[0], first=self.heads[0])
        self._known = {0: m_0, len(self.blocks) - 1: m_t}
        self._reference = _growing(m_0)
        if _growing(m_t) != self._reference:
            for i in range(1, len(self.blocks)):        # blame the first that differs
                self._manifest(i)
        self.codecs = set()         # of the packed blocks read so far (pieces())
        self.tokens = target.tokens
        self.meta = m_t.meta
        self.model = m_t.model
        self.axes = dict(m_t.axes)
        self.tensors = []
        for name, dtype, shape, off, n, crc in m_t.tensors:
            if name in m_t.axes:
                a = m_t.axes[name]
                shape = shape[:a] + (self.tokens,) + shape[a + 1:]
            self.tensors.append(ChainTensor(name, dtype, tuple(shape), math.prod(shape) * DTYPES[dtype][0]))

    def _manifest(self, i):
        """Block i's manifest, checked against the root's growing tensors."""
        m = self._known.get(i)
        if m is None:
            fd, e = self.blocks[i]
            m = read_manifest(fd, e, cached=True, first=self.heads[i])
        if i and _growing(m) != self._reference:
            raise CorruptCheckpoint("chain_mismatch", self.blocks[i][1].path,
                                    "block grows other tensors (names, dtypes, shapes or axes) than its chain, "
                                    "or names another model")
        return m

    def pieces(self):
        """Yields every block's reads, root first: [(slot, Piece)], slot the
        tensor's index in self.tensors or -1 for the token ids (a uint32
        array of self.tokens).

        Raises:
            CorruptCheckpoint: from a block's manifest (see the class), when
                that block's turn comes.
        """
        last = len(self.blocks) - 1
        growing = []            # (slot, name, bytes per position, positions before the axis)
        for slot, t in enumerate(self.tensors):
            if t.name in self.axes:
                a = self.axes[t.name]
                growing.append((slot, t.name, math.prod(t.shape[a + 1:]) * DTYPES[t.dtype][0],
                                math.prod(t.shape[:a])))
        growing = [g for g in growing if g[2] and g[3]]
        for i, (fd, e) in enumerate(self.blocks):
            m = self._manifest(i)
            self.codecs.update(form.codec for _, form in m.packed.values())
            rows = m.rows
            path, at, start, stored = e.path, e.tensors_offset, e.token_start, e.stored_tokens
            name = os.path.basename(path)
            off, n, crc = m.tokens
            out = [(-1, Piece(fd, path, at + off, n, 1, n, 4 * start, crc, "tokens"))]
            if stored:
                for slot, t_name, inner, outer in growing:
                    row = rows[t_name]
                    out.append((slot, Piece(fd, path, at + row[3], stored * inner, outer, self.tokens * inner,
                                            start * inner, row[5], (t_name, name), m.packed.get(t_name))))
            if i == last:
                for slot, (t_name, dtype, shape, off, n, crc) in enumerate(m.tensors):
                    if t_name not in self.axes and n:
                        out.append((slot, Piece(fd, path, at + off, n, 1, n, 0, crc, (t_name, name),
                                                m.packed.get(t_name))))
            yield out


def read_stream(layout, buffers, slots, verify):
    """Reads layout.pieces() into buffers (slots[slot] is the index in
    buffers of a tensor slot, slots[-1] the tokens'), block by block: a
    block's reads start before the next block's manifest is read.  A bad
    manifest stops the queueing; the reads queued are joined, a failed one
    (an earlier block) raised first."""
    batch = Batch(buffers, verify)
    late = queue_pieces(layout, batch, slots)
    batch.wait()
    if late is not None:
        raise late


# How far ahead of its reads a chain load asks the kernel to read its blocks
# (host.prefetch), and in asks of at most how much.  The window follows the
# reads, not the planning (which runs ahead of them): each read job first
# moves it to its own place (Prefetcher.advance, from Batch's jobs).  A
# deeper window only lengthens the disk's queue, and the first blocks' reads
# then wait behind the later blocks' requests (seen here, DeepSeek-V3's
# latent at 9,192 tokens from a cold page cache: 0.48-0.62 s with 256 MiB
# ahead of the planning, 0.34-0.39 s with 64 MiB ahead of the reads, 16 or
# 32 MiB no better; bench/shapes.py).  An ask is cut in parts: on Linux
# each part is read through by one of kvstore.host's read-ahead threads,
# which then has it all in flight at once (see host.READ_THROUGH_THREADS
# for the sizes measured); where the ask is a POSIX_FADV_WILLNEED, Linux
# reads at most the device's readahead size (read_ahead_kb, or its largest
# request if that is larger; 8 MiB here) of one and drops the rest without
# a word: a 336 MiB block asked for whole came in as its first 8 MiB.  On a
# device whose read-ahead window is larger than half an ask, the asks are
# twice that window instead, and the window ahead at least four of them
# (kvstore.host.prefetch_ask says why).
PREFETCH_BYTES = 64 << 20
PREFETCH_ASK = 4 << 20


class Prefetcher:
    """Asks the kernel to read a chain's blocks ahead of the load's reads
    (host.prefetch), at most PREFETCH_BYTES beyond the furthest read begun,
    in asks of at most PREFETCH_ASK bytes (both larger on a device with a
    large read-ahead window: host.prefetch_ask).

    The blocks make one stream, in chain order: a block is in it whole when
    the load reads all of it and its last page is not cached already
    (host.cached): a block that holds only its slices of the growing
    tensors, or the target.  A restorable block before the target in a
    chain with snapshots (the sliding windows of an earlier turn's last
    block) holds snapshots this load does not read: it is left to the
    reads.  Sealed blocks read ahead on their own (kvstore.seal.source).
    advance() may be called from several threads.
    """

    def __init__(self, layout, limit=None, ask=None):
        snapshots = any(t.name not in layout.axes for t in layout.tensors)
        last = len(layout.blocks) - 1
        self.todo = [(i, fd, e.file_size) for i, (fd, e) in enumerate(layout.blocks)
                     if not sealed(fd) and (i == last or not snapshots or not e.restorable)]
        # (A chain's blocks share a directory, hence a device.)
        self.ask = ask if ask is not None else host.prefetch_ask(self.todo[0][1], PREFETCH_ASK) if self.todo else 0
        self.limit = max(PREFETCH_BYTES, 4 * self.ask) if limit is None else limit
        self.at = [i for i, _, _ in self.todo]
        self.ends = list(itertools.accumulate(size for _, _, size in self.todo))
        self.asked = 0                      # the stream's bytes before this are asked for
        self.warm = set()                   # todo indexes found cached when their first part came
        self.lock = threading.Lock()

    def start(self, i):
        """Where in the stream block i's reads begin."""
        k = bisect.bisect_left(self.at, i)
        return self.ends[k - 1] if k else 0

    def advance(self, pos):
        """A read at stream position pos begins: asks for what is not asked
        for yet up to pos + limit."""
        with self.lock:
            if not self.ends or pos >= self.ends[-1]:
                return
            lo, self.asked = self.asked, max(self.asked, min(pos + self.limit, self.ends[-1]))
            hi = self.asked
        self._ask(lo, hi)

    def _ask(self, lo, hi):
        """Asks for stream bytes [lo, hi), block by block and in parts."""
        k = bisect.bisect_right(self.ends, lo)
        while lo < hi and k < len(self.todo):
            _, fd, size = self.todo[k]
            begin = self.ends[k] - size
            a, b = lo - begin, min(hi, self.ends[k]) - begin
            if a == 0 and host.cached(fd, size - 1):        # a warm block: nothing to ask for,
                self.warm.add(k)                            # nor in the parts asked later
            if k not in self.warm:
                host.prefetch_parts(fd, a, b, self.ask)
            lo = self.ends[k]
            k += 1


def queue_pieces(layout, batch, slots):
    """Adds layout.pieces() to batch as the blocks come, at least QUEUE_BYTES
    at a time (small blocks are gathered: a pool job costs about as much as
    reading a small block).  Returns the exception of a bad manifest (which
    stops the queueing after the blocks before it are queued), or None.

    A sealed chain (kvstore.seal.SealedSource blocks) is planned whole
    before any of it is read: its plan is Python, and an I/O thread that
    needs the GIL between two chunks would wait for the planning thread to
    let it go (up to the interpreter's switch interval, 5 ms) while it plans.
    """
    pending, size, late, at = [], 0, None, 0
    step = QUEUE_BYTES if not layout.blocks or not sealed(layout.blocks[0][0]) else float("inf")
    ahead = Prefetcher(layout)
    ahead.advance(0)
    batch.pace = ahead.advance
    try:
        for i, pieces in enumerate(layout.pieces()):
            if not pending:
                at = ahead.start(i)
            for s, p in pieces:
                if slots[s] is not None:
                    pending.append((slots[s], p))
                    size += p.nbytes
            if size >= step:
                batch.add(pending, pos=at)
                pending, size = [], 0
    except Exception as e:
        late = e
    if pending:
        batch.add(pending, last=True, pos=at)
    return late


def tokens_view(layout):
    """(an empty uint32 array for the chain's token ids, a byte view of it)."""
    out = np.empty(layout.tokens, dtype="<u4")
    return out, bytes_view(out.view(np.uint8))


def read_chain_numpy(layout, verify=True):
    """A chain load into NumPy.

    Returns:
        (token ids as uint32, {name: array}) (bfloat16 as uint16 bits).
    """
    tokens, tok_mv = tokens_view(layout)
    out = {t.name: np.empty(t.shape, dtype=numpy_dtype(t.dtype)) for t in layout.tensors}
    buffers = [bytes_view(out[t.name].reshape(-1).view(np.uint8)) for t in layout.tensors] + [tok_mv]
    read_stream(layout, buffers, list(range(len(layout.tensors))) + [len(layout.tensors)], verify)
    return tokens.astype(np.uint32, copy=False), out


class ChainBlob(VirtualBlob):
    """One blob of a chain load into MLX (ChainRead): tensors MLX reads
    directly, as one safetensors blob for mx.load, each at a 64-byte aligned
    place.  readinto() hands the blob's memory to its ChainRead, which
    starts the reads once every blob of the load has its memory."""

    def __init__(self, read, layout, direct):
        """Args:
            read: the ChainRead the blob belongs to.
            direct: the slots of the tensors in the blob.
        """
        self.read, self.direct = read, direct
        self.places, at = [], 0
        for s in direct:
            at = align(at, BLOCK_ALIGN)
            self.places.append(at)
            at += layout.tensors[s].nbytes
        self.head = safetensors_head(at)
        self.size = len(self.head) + at
        self.defer = True
        self.pos = 0
        self.partial = False
        self.address = None
        self.error = None

    def _queue_all(self, mv):
        self.address = _native.buffer_address(mv)
        self.read.hand_over(self, mv)
        return mv.nbytes

    def _read_now(self, mv, rel):
        # MLX asked for the blob in parts: the caller reads through NumPy instead.
        self.partial = True
        return min(mv.nbytes, self.size - len(self.head) - rel)

    def wait(self):
        self.read.wait()


class ChainRead:
    """A chain load into blobs of MLX memory (kvstore.payload.mlx_io), read in one pass.

    Each blob (a ChainBlob, a virtual safetensors file for mx.load) hands
    over its memory as MLX allocates it; once every blob has, the reads of
    all of them and of the other buffers (the token ids, the float64
    tensors read through NumPy) are queued in one walk of the chain (see
    read_stream), so the I/O threads run from the first blob to the last
    without a pause and every block's manifest is parsed once.  A load
    whose blobs are not all handed over whole starts no read.
    """

    def __init__(self, layout, groups, others, verify):
        """Args:
            groups: [[tensor slot, ...], ...], one per blob.
            others: {slot: byte view} of the other non-empty tensors
                (slot -1 the tokens).
        """
        self.layout, self.others, self.verify = layout, others, verify
        self.sources = [ChainBlob(self, layout, slots) for slots in groups]
        self.memory = {}            # id(ChainBlob) -> its memoryview
        self.batch = None
        self.late = None
        self.error = None

    def hand_over(self, blob, mv):
        """blob's memory, whole; the reads start with the last blob's."""
        self.memory[id(blob)] = mv
        if len(self.memory) < len(self.sources):
            return
        slots = [None] * (len(self.layout.tensors) + 1)
        buffers = []
        for src in self.sources:
            mv = self.memory[id(src)]
            for s, at in zip(src.direct, src.places):
                slots[s] = len(buffers)
                buffers.append(mv[at:at + self.layout.tensors[s].nbytes])
        for s, view in self.others.items():
            slots[s] = len(buffers)
            buffers.append(view)
        self.batch = Batch(buffers, self.verify)
        self.late = queue_pieces(self.layout, self.batch, slots)     # raised by wait(), after the reads

    def wait(self):
        """Joins the reads (none if they never started); raises the first
        failure: a blob's readinto() first, then a read, then a bad manifest."""
        self.error = self.error or next((s.error for s in self.sources if s.error is not None), None)
        if self.batch is not None:
            batch, self.batch = self.batch, None
            try:
                batch.wait()
            except Exception as e:
                self.error = self.error or e
        self.error = self.error or self.late
        if self.error is not None:
            raise self.error
