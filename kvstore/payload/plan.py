"""Writing a payload: the Plan of where every block goes, and the one pass that writes it.

Writing is one pass over the arrays: one thread writes the blocks in order
while the I/O pool computes each block's CRC32C alongside, and the manifest,
written first with fixed-width placeholder CRCs, is rewritten in place with
the real values at the end (JSON allows the trailing spaces that keep its
length).  The same Plan writes a whole file (ABI 16) and a chain block
(ABI 17, after its 64-byte chain header).
"""

import json

import numpy as np

from kvstore import _native
from kvstore.format import PREFIX_SIZE
from kvstore.payload.buffers import bytes_view, pwrite_from, pwrite_pieces
from kvstore.payload.manifest import (BLOCK_ALIGN, DATA_ALIGN, DTYPES, MAGIC, PAYLOAD_HEADER, VERSION,
                                      align)
from kvstore.payload import forms
from kvstore.payload.mlx_io import is_mlx_array, mlx_source
from kvstore.payload.pool import io_pool, pack_thread, slices
from kvstore.sources import as_source

_CRC_PLACEHOLDER = 0xFFFFFFFF                 # widest u32 in decimal (10 digits)

# Blocks under SMALL_BLOCK bytes are written in batches of about SMALL_BATCH
# bytes, one native call each (Plan.write); a larger block has its CRC
# computed in parallel slices while it is written.
SMALL_BLOCK = 2 << 20
SMALL_BATCH = 8 << 20

# A strided view is written run by run, without a contiguous copy, when its
# contiguous runs are at least this long (a (1, 8, n, 128) float16 KV buffer
# cut along its sequence axis into 256-token blocks: 64 KiB runs) and not
# more than MAX_RUNS of them; otherwise it is copied contiguous first.
MIN_RUN = 16 << 10
MAX_RUNS = 4096
_LITTLE = np.little_endian


def tensor_source(name, a):
    """Describes an array for the writer without copying it.

    Returns:
        (dtype name, shape, nbytes, materialize) where materialize() returns
        the array's little-endian bytes as a list of flat contiguous buffers,
        in order.  They share memory with the array when they can: a strided
        view made of long contiguous runs (a KV buffer cut into a chain's
        blocks along its sequence axis) comes back as its runs; any other
        strided view is copied only when materialize() is called, so the
        writer holds at most a couple of such copies at once.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"tensor name {name!r} must be a non-empty str")
    if is_mlx_array(a):
        dtype, shape, nbytes, materialize = mlx_source(a)
    else:
        a = np.asarray(a)
        dtype = a.dtype.name
        # The shape before any reshaping: np.ascontiguousarray makes a 0-d
        # array 1-d, and a scalar must come back with shape ().
        shape = tuple(int(d) for d in a.shape)
        nbytes = int(a.nbytes)

        def materialize(a=a):
            runs = contiguous_runs(a)
            if runs is not None:
                return runs
            # The file is little-endian: a big-endian array is byte-swapped here.
            return [np.ascontiguousarray(a.reshape(-1), dtype=a.dtype.newbyteorder("<")).view(np.uint8)]
    if dtype not in DTYPES:
        raise ValueError(f"tensor {name!r}: dtype {dtype!r} is not one of {sorted(DTYPES)}")
    return dtype, shape, nbytes, materialize


def contiguous_runs(a):
    """A strided little-endian array's bytes as views of its contiguous runs,
    in order, without a copy; None for a contiguous array, or one whose runs
    are shorter than MIN_RUN or more than MAX_RUNS."""
    if a.flags.c_contiguous or a.dtype.byteorder == ">" or (a.dtype.byteorder == "=" and not _LITTLE):
        return None
    shape, strides = a.shape, a.strides
    # The contiguous run: the trailing axes whose strides are C's.
    k, run = a.ndim, a.itemsize
    while k and (shape[k - 1] == 1 or strides[k - 1] == run):
        k -= 1
        run *= shape[k]
    count = a.size * a.itemsize // run if run else 0
    if k == 0 or run < MIN_RUN or count > MAX_RUNS:
        return None
    try:
        # The leading axes as one, when that needs no copy (a cut along one axis).
        lead = a.reshape((count,) + shape[k:], copy=False)
    except (TypeError, ValueError):
        return None
    return [lead[i] for i in range(count)]


class Plan:
    """Where every block of one payload goes; built before anything is written.

    Args:
        text_len: the text bytes stored before the payload.
        tokens, tensors, meta: what the payload holds.
        axes: name -> the axis along which a tensor grows with the sequence
            (recorded in the manifest as "axis"); others are snapshots.
        head: bytes before the tensor payload within the payload (a chain
            block's 64-byte header).
        model: the identity of the model that made the state (recorded as
            "model"; docs/semantics.md §17), or None.
        exact: names of tensors a lossy codec leaves exact (a state quantised
            already); lossless packing still applies to them.
    """

    def __init__(self, text_len, tokens, tensors, meta, axes=None, head=0, cuts=None, dtypes=None, model=None,
                 exact=()):
        self.payload_start = PREFIX_SIZE + text_len + head
        self.exact = frozenset(exact)
        self.head = head
        self.tokens = np.ascontiguousarray(tokens, dtype="<u4").reshape(-1)
        self.sources = [(name,) + tensor_source(name, a) for name, a in tensors.items()]
        # A NumPy array of uint16 holds bfloat16 bits: dtypes names what to record.
        for i, (name, dtype, shape, nbytes, mat) in enumerate(self.sources):
            want = (dtypes or {}).get(name, dtype)
            if want != dtype:
                if not (want == "bfloat16" and dtype == "uint16"):
                    raise ValueError(f"tensor {name!r}: cannot record dtype {want!r} for {dtype!r} data")
                self.sources[i] = (name, want, shape, nbytes, mat)
        if meta is None:
            meta = {}
        if not isinstance(meta, dict):
            raise ValueError(f"meta must be a dict, not {type(meta).__name__}")
        self.meta = meta
        axes = axes or {}

        # Manifest with placeholder CRCs: its length is final from here on.
        self.manifest = {
            "version": VERSION,
            "tokens": {"offset": 0, "count": int(self.tokens.size), "crc32c": _CRC_PLACEHOLDER},
            "tensors": [],
            "meta": meta,
        }
        if cuts:
            self.manifest["cuts"] = [[int(t), int(n)] for t, n in sorted(cuts.items())]
        if model is not None:
            self.manifest["model"] = str(model)
        for name, dtype, shape, nbytes, _ in self.sources:
            row = {"name": name, "dtype": dtype, "shape": list(shape),
                   "offset": 0, "nbytes": nbytes, "crc32c": _CRC_PLACEHOLDER}
            if name in axes:
                if not 0 <= axes[name] < len(shape) or shape[axes[name]] != self.tokens.size:
                    raise ValueError(f"tensor {name!r}: axis {axes[name]} of shape {shape} does not "
                                     f"hold the {self.tokens.size} tokens of this payload")
                row["axis"] = int(axes[name])
            self.manifest["tensors"].append(row)
        self.packed = {}            # name -> the stored parts of a packed tensor (pack())
        self._lay_out()

    def _lay_out(self):
        """Every block's offset, the manifest's length and the payload's size."""
        # Offsets need M and M needs offsets: offsets have at most 20 digits,
        # so reserve that width, lay out, then serialise for real.
        for t in [self.manifest["tokens"]] + self.manifest["tensors"]:
            t["offset"] = 10**19
        try:
            self.manifest_len = len(self._encode())
        except (TypeError, ValueError) as e:
            raise ValueError(f"meta is not JSON-serialisable: {e}") from None
        P = self.payload_start
        self.data_offset = align(P + PAYLOAD_HEADER.size + self.manifest_len, DATA_ALIGN) - P
        at = self.data_offset
        self.manifest["tokens"]["offset"] = at
        at += self.tokens.nbytes
        for t in self.manifest["tensors"]:
            at = align(P + at, BLOCK_ALIGN) - P
            t["offset"] = at
            at += t["packed"]["stored"] if "packed" in t else t["nbytes"]
        self.payload_bytes = self.head + at      # the chain header counts as payload

    def pack(self, kv_codec):
        """Stores the tensors that kv_codec packs (kvstore.payload.forms) as
        packed blocks and lays the payload out again; returns the codecs
        used (empty when none shrank).  Until then payload_bytes is the raw
        size, a bound on the packed one.

        Each tensor is packed on the I/O pool (the planes split, the table planes and
        the quantising run mostly with the GIL released); the packed bytes
        are held until write().
        """
        todo = [(t, src) for t, src in zip(self.manifest["tensors"], self.sources)
                if forms.tries(kv_codec, src[1], src[3], "axis" in t and src[0] not in self.exact)]
        jobs = [io_pool().submit(forms.pack, kv_codec, src[1], DTYPES[src[1]][0], src[3],
                                 [bytes_view(b) for b in src[4]()])
                for _, src in todo]
        for (t, src), job in zip(todo, jobs):
            got = job.result()
            if got is not None:
                t["packed"], self.packed[src[0]] = got
        if self.packed:
            self._lay_out()
        return {t["packed"]["codec"] for t in self.manifest["tensors"] if "packed" in t}

    def tensor_bytes(self):
        """(raw, stored): the tensors' bytes as arrays and as this payload stores them."""
        rows = self.manifest["tensors"]
        return (sum(t["nbytes"] for t in rows),
                sum(t["packed"]["stored"] if "packed" in t else t["nbytes"] for t in rows))

    def packed_bytes(self, kv_codec):
        """The payload's size once packed, the plan left as it was: the
        packing is done and dropped (a save that would not fit its budget
        raw asks; pack() packs again when the block is written)."""
        if not self.pack(kv_codec):
            return self.payload_bytes
        size = self.payload_bytes
        for t in self.manifest["tensors"]:
            t.pop("packed", None)
        self.packed = {}
        self._lay_out()
        return size

    def _encode(self):
        return json.dumps(self.manifest, separators=(",", ":"), ensure_ascii=False,
                          allow_nan=False).encode("utf-8")

    def manifest_bytes(self):
        raw = self._encode()
        assert len(raw) <= self.manifest_len
        return raw + b" " * (self.manifest_len - len(raw))

    def write(self, fd, path, crc=True):
        """Writes the payload at its place in fd, CRC'ing every block as it goes.

        A file takes one writer at a time in the kernel, so the blocks are
        written in order, one job at a time on an I/O thread.  A large block
        is written while the pool computes the CRC32C of its slices (the CRC
        costs no wall time); small ones (a chain block's layers: hundreds of
        tensors of tens of KiB) go in batches of about SMALL_BATCH bytes, one
        native call each that writes and CRCs them with the GIL released (a
        job per tensor cost more in handing over than in writing).  Blocks
        that need a contiguous copy are materialised just before they are
        written.

        Args:
            crc: False writes 0 as every block's CRC (a sealed file's body,
                whose GCM tags check every byte: kvstore.seal).
        """
        P = self.payload_start
        m = self.manifest
        blocks = [(m["tokens"], lambda: [self.tokens])] + \
            [(t, (lambda parts=self.packed[src[0]]: parts) if src[0] in self.packed else src[4])
             for t, src in zip(m["tensors"], self.sources)]
        dst = as_source(fd)
        batch = _SmallBatch(dst, path, crc) if getattr(dst, "pwrite_blocks", None) else None
        for t, materialize in blocks:
            pieces = [bytes_view(b) for b in materialize()]
            if batch is not None and sum(p.nbytes for p in pieces) < SMALL_BLOCK:
                batch.add(t, P + t["offset"], pieces)
                continue
            if batch is not None:
                batch.flush()
            t["crc32c"] = _write_block(fd, path, pieces, P + t["offset"], crc)
        if batch is not None:
            batch.flush()
        raw = self.manifest_bytes()
        head = PAYLOAD_HEADER.pack(MAGIC, len(raw), self.data_offset, _native.crc32c(raw), 0)
        pwrite_from(fd, head + raw, P, path)


class _SmallBatch:
    """Small blocks of a payload gathered for one write job (Plan.write):
    their (offset, pieces), written and CRC'd by one native call on an I/O
    thread when about SMALL_BATCH bytes are gathered, and at flush()."""

    def __init__(self, dst, path, crc):
        self.dst, self.path, self.crc = dst, path, crc
        self.entries, self.jobs, self.nbytes = [], [], 0

    def add(self, t, at, pieces):
        self.entries.append(t)
        self.jobs.append((at, pieces))
        self.nbytes += sum(p.nbytes for p in pieces)
        if self.nbytes >= SMALL_BATCH:
            self.flush()

    def flush(self):
        if not self.jobs:
            return
        crcs = io_pool().submit(self.dst.pwrite_blocks, self.jobs, self.path, self.crc).result()
        for t, c in zip(self.entries, crcs):
            t["crc32c"] = c
        self.entries, self.jobs, self.nbytes = [], [], 0


def _write_block(fd, path, pieces, at, crc):
    """Writes one block's pieces from at while the pool CRCs them; the
    block's CRC32C (0 without crc).

    A plain file's bytes move on an I/O thread too (its Source's
    any_thread), so the calling thread, a store's writer, only waits: the
    copy into the page cache is the bulk of a save, and the I/O threads are
    the ones that yield the CPU to a serving loop (set_io_priority).
    """
    pool = io_pool()
    dst = as_source(fd)
    write = pwrite_from if len(pieces) == 1 else pwrite_pieces
    what = pieces[0] if len(pieces) == 1 else pieces
    job = pool.submit(write, dst, what, at, path) if getattr(dst, "any_thread", False) else None
    if len(pieces) == 1:
        parts = slices(pieces[0].nbytes) if crc else []
        futs = [pool.submit(_native.crc32c, pieces[0][a:b]) for a, b in parts]
    else:
        parts = [(0, sum(mv.nbytes for mv in pieces))] if crc else []
        futs = [pool.submit(_crc_of, pieces)] if crc else []
    if job is None:
        write(dst, what, at, path)
    else:
        job.result()
    value = 0
    for i, ((a, b), fut) in enumerate(zip(parts, futs)):
        c = fut.result()
        value = c if i == 0 else _native.crc32c_combine(value, c, b - a)
    return value


def _crc_of(pieces):
    value = 0
    for mv in pieces:
        value = _native.crc32c(mv, value)
    return value


class PackAhead:
    """The packing of a chained save's blocks, one block ahead of their
    writes: block k + 1 is packed (on pack_thread, its tensors on the I/O
    threads) while the saving thread writes block k.  At most two blocks'
    packed bytes are held at once.

    Args:
        kv_codec: the store's codec ("raw": nothing is packed).
        plans: the blocks' Plans, in the order they are written.
    """

    def __init__(self, kv_codec, plans):
        self.kv_codec, self.plans, self.ahead = kv_codec, plans, {}
        self._start(0)

    def _start(self, k):
        if self.kv_codec != "raw" and k < len(self.plans):
            self.ahead[k] = pack_thread().submit(self.plans[k].pack, self.kv_codec)

    def codecs(self, k):
        """Block k's Plan packed: the codecs its tensors were stored with
        (Plan.pack), once the packing of block k + 1 has been started."""
        if self.kv_codec == "raw":
            return ()
        got = self.ahead.pop(k).result()
        self._start(k + 1)
        return got
