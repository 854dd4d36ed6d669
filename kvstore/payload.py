"""Tensor payloads: ABI 16 (a whole prefix) and the blocks of ABI 17 chains (docs/format.md §3, §14).

Layout, offsets relative to the payload start P = 52 + text length:

    0   "KVTP"                 magic
    4   u32 M                  manifest length
    8   u64 D                  data offset; P + D is a multiple of 4096
    16  u32                    CRC32C of the manifest bytes
    20  u32                    reserved, 0
    24  M bytes                manifest, UTF-8 JSON
    D   ...                    token ids (u32 LE), then each tensor; every
                               block starts at a file offset that is a
                               multiple of 64

Writing is one pass over the arrays: one thread writes the blocks in order
while the I/O pool computes each block's CRC32C alongside, and the manifest,
written first with fixed-width placeholder CRCs, is rewritten in place with
the real values at the end (JSON allows the trailing spaces that keep its
length).

Reading streams every block straight into its destination array and checks
its CRC as it lands; nothing reads the payload into an intermediate buffer.
For MLX the destination arrays are allocated by mx.load itself: the reader
presents the payload to mx.load as a virtual safetensors file whose
readinto() calls land, in parallel chunks with the GIL released, in the new
arrays' own memory (see bench/README.md for why this beats zero-fill-then-read).
That readinto() is Python called from inside an MLX task, which is safe only
while no other thread runs MLX: a process where several do (kvstore serve)
calls set_mlx_threaded(True), and the memory then comes from mx.zeros, an
MLX op that never enters Python, before the same reads fill it.

An ABI 17 block holds the same structure after its 64-byte chain header.  A
tensor that grows along the sequence ("axis" in the manifest) holds only the
block's own positions; read_chain allocates each such tensor once at the
chain's full length and reads every block's slice straight into place
(strided reads, one CRC per block and tensor).
"""

import atexit
import collections
import concurrent.futures
import copy
import dataclasses
import io
import json
import math
import os
import struct
import sys
import threading

import numpy as np

from kvstore import _native
from kvstore.errors import CorruptCheckpoint
from kvstore.format import PREFIX_SIZE
from kvstore.sources import as_source

MAGIC = b"KVTP"
PAYLOAD_HEADER = struct.Struct("<4sIQII")     # 24 bytes
VERSION = 1

# File-offset alignment of the data start (a page, so the data can be mapped
# or read with O_DIRECT) and of every block (a cache line / SIMD width).
DATA_ALIGN = 4096
BLOCK_ALIGN = 64

# NumPy (and MLX) refuse an array whose dimensions, zeros taken as one,
# multiply past a signed 64-bit byte count, even when a zero dimension makes it
# empty: a manifest shape like [0, 2**62] is corruption, not an empty tensor.
MAX_ARRAY_BYTES = 2**63 - 1

# No manifest this big is ever written (a 400-layer model with 10 tensors per
# layer is ~0.5 MB); a larger length field is corruption, not a manifest.
MAX_MANIFEST_BYTES = 64 << 20

# Parallel I/O: a block of at least 2 MiB is split into up to IO_THREADS
# slices of at least 1 MiB, each read (or written) and CRC'd by its own
# thread with the GIL released.  Most of the cost of a load is the kernel
# touching fresh pages of the destination arrays, and that parallelises;
# a KV block of a 7B-class model is 4 MiB per layer and tensor, so the split
# happens within a tensor.  The pool is small: the work is memory-bound.
MIN_SLICE = 1 << 20
IO_THREADS = max(1, min(4, os.cpu_count() or 1))
# A chain load hands blocks to the I/O threads at least this many bytes at a time.
QUEUE_BYTES = MIN_SLICE * IO_THREADS

# Whether other threads may run MLX while a load into MLX runs (set_mlx_threaded).
_mlx_threaded = False

_CRC_PLACEHOLDER = 0xFFFFFFFF                 # widest u32 in decimal (10 digits)

# dtype name (MLX's) -> (item size, safetensors code)
DTYPES = {
    "bool": (1, "BOOL"), "uint8": (1, "U8"), "uint16": (2, "U16"),
    "uint32": (4, "U32"), "uint64": (8, "U64"), "int8": (1, "I8"),
    "int16": (2, "I16"), "int32": (4, "I32"), "int64": (8, "I64"),
    "float16": (2, "F16"), "bfloat16": (2, "BF16"), "float32": (4, "F32"),
    "float64": (8, "F64"), "complex64": (8, "C64"),
}


def _align(x, a):
    return (x + a - 1) // a * a


# ---- sources: numpy or MLX arrays as flat byte buffers -------------------

def is_mlx_array(a):
    """True for an MLX array (told apart by its module, so MLX need not be imported)."""
    return type(a).__module__.startswith("mlx")


def host_views(arrays):
    """{name: (a NumPy view of an MLX array's memory, strides and all, the
    dtype to record for it or None)} of a dict of MLX arrays, evaluated on
    the calling thread in one mx.eval.  NumPy has no bfloat16: such an array
    comes back as its uint16 bit patterns (an MLX view, no copy), and
    "bfloat16" is the dtype to record (Plan's dtypes).  No copy: a view
    keeps the array's buffer alive, so an in-place update of the array's
    owner (cache[..., i:j] = x) cannot reuse it."""
    import mlx.core as mx
    names = {k: str(a.dtype).rsplit(".", 1)[-1] for k, a in arrays.items()}
    out = {k: a.view(mx.uint16) if names[k] == "bfloat16" else a for k, a in arrays.items()}
    mx.eval(list(out.values()))
    return {k: (np.asarray(a), names[k] if names[k] == "bfloat16" else None) for k, a in out.items()}


def tensor_source(name, a):
    """Describes an array for the writer without copying it.

    Returns:
        (dtype name, shape, nbytes, materialize) where materialize() returns
        the flat contiguous little-endian byte buffer.  The buffer shares
        memory with the array when it can; a strided view (a KV buffer sliced
        to its filled length, say) is copied only when materialize() is
        called, so the writer holds at most a couple of such copies at once.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"tensor name {name!r} must be a non-empty str")
    if is_mlx_array(a):
        import mlx.core as mx
        mx.eval(a)
        dtype = str(a.dtype).rsplit(".", 1)[-1]
        shape = tuple(int(d) for d in a.shape)
        nbytes = int(a.nbytes)

        def materialize(a=a):
            view = memoryview(a)
            if not view.c_contiguous:
                a = mx.contiguous(a)
                mx.eval(a)
                view = memoryview(a)
            return view
    else:
        a = np.asarray(a)
        dtype = a.dtype.name
        # The shape before any reshaping: np.ascontiguousarray makes a 0-d
        # array 1-d, and a scalar must come back with shape ().
        shape = tuple(int(d) for d in a.shape)
        nbytes = int(a.nbytes)

        def materialize(a=a):
            # The file is little-endian: a big-endian array is byte-swapped here.
            return np.ascontiguousarray(a.reshape(-1), dtype=a.dtype.newbyteorder("<")).view(np.uint8)
    if dtype not in DTYPES:
        raise ValueError(f"tensor {name!r}: dtype {dtype!r} is not one of {sorted(DTYPES)}")
    return dtype, shape, nbytes, materialize


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
            "model"; docs/format.md §17), or None.
    """

    def __init__(self, text_len, tokens, tensors, meta, axes=None, head=0, cuts=None, dtypes=None, model=None):
        self.payload_start = PREFIX_SIZE + text_len + head
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
        # Offsets need M and M needs offsets: offsets have at most 20 digits,
        # so reserve that width, lay out, then serialise for real.
        for t in [self.manifest["tokens"]] + self.manifest["tensors"]:
            t["offset"] = 10**19
        try:
            self.manifest_len = len(self._encode())
        except (TypeError, ValueError) as e:
            raise ValueError(f"meta is not JSON-serialisable: {e}") from None
        P = self.payload_start
        self.data_offset = _align(P + PAYLOAD_HEADER.size + self.manifest_len, DATA_ALIGN) - P
        at = self.data_offset
        self.manifest["tokens"]["offset"] = at
        at += self.tokens.nbytes
        for t in self.manifest["tensors"]:
            at = _align(P + at, BLOCK_ALIGN) - P
            t["offset"] = at
            at += t["nbytes"]
        self.payload_bytes = head + at           # the chain header counts as payload

    def _encode(self):
        return json.dumps(self.manifest, separators=(",", ":"), ensure_ascii=False,
                          allow_nan=False).encode("utf-8")

    def manifest_bytes(self):
        raw = self._encode()
        assert len(raw) <= self.manifest_len
        return raw + b" " * (self.manifest_len - len(raw))

    def write(self, fd, path, crc=True):
        """Writes the payload at its place in fd, CRC'ing every block as it goes.

        A file takes one writer at a time in the kernel, so this thread does
        all the writing, in order, while the pool computes the CRC32C of each
        block's slices (GIL released): the CRC costs no wall time.  Blocks
        that need a contiguous copy are materialised one at a time, just
        before they are written.

        Args:
            crc: False writes 0 as every block's CRC (a sealed file's body,
                whose GCM tags check every byte: kvstore.seal).
        """
        P = self.payload_start
        m = self.manifest
        blocks = [(m["tokens"], lambda: self.tokens)] + \
            [(t, src[4]) for t, src in zip(m["tensors"], self.sources)]
        pool = _get_pool()
        for t, materialize in blocks:
            mv = bytes_view(materialize())
            parts = _slices(mv.nbytes) if crc else []
            crcs = [pool.submit(_native.crc32c, mv[a:b]) for a, b in parts]
            pwrite_from(fd, mv, P + t["offset"], path)
            value = 0
            for i, ((a, b), fut) in enumerate(zip(parts, crcs)):
                c = fut.result()
                value = c if i == 0 else _native.crc32c_combine(value, c, b - a)
            t["crc32c"] = value
        raw = self.manifest_bytes()
        head = PAYLOAD_HEADER.pack(MAGIC, len(raw), self.data_offset, _native.crc32c(raw), 0)
        pwrite_from(fd, head + raw, P, path)


# ---- reading --------------------------------------------------------------

# The longest model identity a manifest may carry (kvstore.identity.MAX_IDENTITY_CHARS).
MAX_MODEL_CHARS = 1024


class Manifest:
    """A validated manifest: every offset and length bounded by the payload."""

    @property
    def rows(self):
        """The tensor rows by name."""
        rows = self.__dict__.get("_rows")
        if rows is None:
            rows = self._rows = {r[0]: r for r in self.tensors}
        return rows

    def __init__(self, raw, entry, data_offset):
        path = entry.path
        self.axes = {}
        self.cuts = {}
        try:
            m = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            raise CorruptCheckpoint("bad_manifest", path, "manifest is not UTF-8 JSON") from None
        except RecursionError:
            # Deep nesting ("[[[[…") exhausts the JSON scanner's stack.
            raise CorruptCheckpoint("bad_manifest", path, "manifest JSON is nested too deeply") from None
        if not isinstance(m, dict) or m.get("version") != VERSION:
            raise CorruptCheckpoint("bad_manifest", path, "manifest version is not 1")
        limit = entry.tensors_bytes
        base = entry.tensors_offset
        stored = entry.stored_tokens
        blocks = []

        def label(i):
            return "tokens" if i < 0 else f"tensor {i}"

        def block(d, i):
            # i: the tensor's index, -1 for the tokens (names the block in errors).
            if not isinstance(d, dict):
                raise CorruptCheckpoint("bad_manifest", path, f"{label(i)} is not an object")
            off, n, crc = d.get("offset"), d.get("nbytes"), d.get("crc32c")
            if type(off) is not int or type(n) is not int or type(crc) is not int or min(off, n, crc) < 0:
                k = next(k for k, v in (("offset", off), ("nbytes", n), ("crc32c", crc))
                         if type(v) is not int or v < 0)
                raise CorruptCheckpoint("bad_manifest", path, f"{label(i)}.{k} is not a non-negative int")
            if crc > 0xFFFFFFFF or (n == 0 and crc != 0):
                # An empty block's CRC32C is 0: the readers skip empty blocks, so
                # any other value is a manifest that verify and load would judge apart.
                raise CorruptCheckpoint("bad_manifest", path, f"{label(i)}.crc32c out of range")
            if off < data_offset or n > limit or off > limit - n:
                raise CorruptCheckpoint("bad_manifest", path, f"{label(i)} lies outside the payload data")
            if (base + off) % BLOCK_ALIGN:
                raise CorruptCheckpoint("bad_manifest", path, f"{label(i)} is not {BLOCK_ALIGN}-byte aligned")
            blocks.append((off, n, i))
            return off, n, crc

        tok = m.get("tokens")
        if not isinstance(tok, dict) or type(tok.get("count")) is not int:
            raise CorruptCheckpoint("bad_manifest", path, "tokens block missing")
        if tok["count"] != stored:
            raise CorruptCheckpoint("token_count", path,
                                    f"manifest has {tok['count']} tokens, header {stored}")
        self.tokens = block(dict(tok, nbytes=4 * tok["count"]), -1)

        tensors = m.get("tensors")
        if not isinstance(tensors, list):
            raise CorruptCheckpoint("bad_manifest", path, "tensors is not a list")
        self.tensors = []
        names = set()
        for i, t in enumerate(tensors):
            if not isinstance(t, dict):
                raise CorruptCheckpoint("bad_manifest", path, f"tensor {i} is not an object")
            name, dtype, shape = t.get("name"), t.get("dtype"), t.get("shape")
            if not isinstance(name, str) or name in names:
                raise CorruptCheckpoint("bad_manifest", path, f"tensor {i} has a missing or repeated name")
            names.add(name)
            item = DTYPES.get(dtype, (None,))[0] if isinstance(dtype, str) else None
            if item is None:
                raise CorruptCheckpoint("bad_manifest", path, f"tensor {i} has unknown dtype")
            if not isinstance(shape, list) or len(shape) > 16:
                raise CorruptCheckpoint("bad_manifest", path, f"tensor {i} has a bad shape")
            size, nonzero = 1, 1
            for d in shape:
                if type(d) is not int or d < 0:
                    raise CorruptCheckpoint("bad_manifest", path, f"tensor {i} has a bad shape")
                size *= d
                nonzero *= d or 1
            if nonzero * item > MAX_ARRAY_BYTES:
                raise CorruptCheckpoint("bad_manifest", path, f"tensor {i} has a bad shape")
            off, n, crc = block(t, i)
            if size * item != n:
                raise CorruptCheckpoint("bad_manifest", path, f"tensor {i} nbytes does not match its shape")
            if "axis" in t:
                axis = t["axis"]
                if type(axis) is not int or not 0 <= axis < len(shape) or shape[axis] != stored:
                    raise CorruptCheckpoint("bad_manifest", path,
                                            f"tensor {i}: axis {axis!r} does not hold the file's tokens")
                self.axes[name] = axis
            self.tensors.append((name, dtype, tuple(shape), off, n, crc))
        blocks.sort()
        for (o1, n1, w1), (o2, _, w2) in zip(blocks, blocks[1:]):
            if o1 + n1 > o2:
                raise CorruptCheckpoint("bad_manifest", path, f"{label(w1)} overlaps {label(w2)}")
        meta = m.get("meta", {})
        if not isinstance(meta, dict):
            raise CorruptCheckpoint("bad_manifest", path, "meta is not an object")
        self.meta = meta
        # Optional: where the sequence may be cut into blocks (an exported
        # chain's boundaries): [[tokens, text length], ...], both growing.
        cuts = m.get("cuts", [])
        if not isinstance(cuts, list) or len(cuts) > entry.stored_tokens or not all(
                isinstance(c, list) and len(c) == 2 and all(type(v) is int and v > 0 for v in c) for c in cuts):
            raise CorruptCheckpoint("bad_manifest", path, "cuts is not a list of [tokens, text length] pairs")
        self.cuts = {t: n for t, n in cuts if t <= entry.stored_tokens}
        # Optional: the identity of the model that made the state (docs/format.md §17).
        model = m.get("model")
        if model is not None and (not isinstance(model, str) or not 0 < len(model) <= MAX_MODEL_CHARS):
            raise CorruptCheckpoint("bad_manifest", path, "model is not a string of 1..1024 characters")
        self.model = model


# Validated manifests of chain blocks met before, by their bytes and the
# geometry they were checked against (see read_manifest's cached).
_MANIFESTS = collections.OrderedDict()
_MANIFESTS_MAX = 4096
_manifests_lock = threading.Lock()


def read_manifest(fd, entry, cached=False):
    """Reads and validates the payload header and manifest of an open checkpoint.

    cached: a manifest with the same bytes, checked against the same file
    geometry before, is not parsed again (its CRC is checked as always).
    For a chain's middle blocks, whose tensors and tokens only are read:
    the Manifest returned may be shared, and must not be changed.
    """
    path, P = entry.path, entry.tensors_offset
    if entry.tensors_bytes < PAYLOAD_HEADER.size:
        raise CorruptCheckpoint("bad_payload", path, "payload shorter than its header")
    head = pread(fd, PAYLOAD_HEADER.size, P)
    if len(head) < PAYLOAD_HEADER.size:
        raise CorruptCheckpoint("truncated", path, "payload header cut short")
    magic, mlen, data_offset, mcrc, _ = PAYLOAD_HEADER.unpack(head)
    if magic != MAGIC:
        raise CorruptCheckpoint("bad_payload_magic", path, "payload is not KVTP")
    if mlen > MAX_MANIFEST_BYTES or PAYLOAD_HEADER.size + mlen > entry.tensors_bytes:
        raise CorruptCheckpoint("bad_payload", path, f"manifest length {mlen} exceeds the payload")
    if data_offset < PAYLOAD_HEADER.size + mlen or data_offset > entry.tensors_bytes \
            or (P + data_offset) % DATA_ALIGN:
        raise CorruptCheckpoint("bad_payload", path, f"data offset {data_offset} is invalid")
    raw = pread(fd, mlen, P + PAYLOAD_HEADER.size)
    if len(raw) != mlen:
        raise CorruptCheckpoint("truncated", path, "manifest cut short")
    if _native.crc32c(raw) != mcrc:
        raise CorruptCheckpoint("crc", path, "manifest CRC mismatch")
    if not cached:
        return Manifest(raw, entry, data_offset)
    key = (raw, data_offset, P, entry.tensors_bytes, entry.stored_tokens)
    with _manifests_lock:
        m = _MANIFESTS.get(key)
        if m is not None:
            _MANIFESTS.move_to_end(key)
            return m
    m = Manifest(raw, entry, data_offset)
    with _manifests_lock:
        _MANIFESTS[key] = m
        while len(_MANIFESTS) > _MANIFESTS_MAX:
            _MANIFESTS.popitem(last=False)
    return m


_pool = None
_pool_lock = threading.Lock()
_io_nice = 0


def lower_thread_priority(nice):
    """Gives the calling thread CPU niceness `nice` (0-19; higher yields more).

    Linux only (there a thread is its own schedulable task); elsewhere, or
    when the kernel refuses, nothing changes.

    Returns:
        True when the thread's niceness is now `nice`.
    """
    if nice <= 0 or not sys.platform.startswith("linux") or not hasattr(os, "setpriority"):
        return False
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except OSError:
        return False
    return True


def set_io_priority(nice):
    """Runs the payload I/O threads at CPU niceness `nice` (0: the process's own).

    kvstore serve loads checkpoints while its generation thread decodes: at a
    lower priority the loads' copies and CRCs take the CPU time decoding
    leaves, not the other way round.  Threads already started are replaced.
    """
    global _pool, _io_nice
    if not 0 <= nice <= 19:
        raise ValueError(f"I/O thread niceness {nice!r} is not in 0..19")
    with _pool_lock:
        old, _pool, _io_nice = _pool, None, nice
    if old is not None:
        old.shutdown(wait=True)


def _get_pool():
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = concurrent.futures.ThreadPoolExecutor(IO_THREADS, thread_name_prefix="kvstore-io",
                                                          initializer=lower_thread_priority,
                                                          initargs=(_io_nice,))
            atexit.register(_pool.shutdown, wait=True)
        return _pool


def io_pool():
    """The I/O threads' executor (IO_THREADS threads), shared with kvstore.seal's chunk jobs."""
    return _get_pool()


def _forget_pool_after_fork():
    # A forked child inherits the pool object but none of its threads: work
    # submitted to it would wait forever.  The child starts its own.
    global _pool, _pool_lock
    _pool = None
    _pool_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool_after_fork)


def pread_into(src, buf, offset, path=None, crc=None):
    """Fills buf from src at offset: src is a file descriptor, or an object
    with the same pread_into method (a sealed file's authenticated plain
    view, kvstore.seal.SealedSource).  Returns the CRC as _native.pread_into."""
    return as_source(src).pread_into(buf, offset, path, crc)


def pwrite_from(dst, buf, offset, path=None):
    """Writes buf to dst at offset: dst is a file descriptor, or an object
    with the same pwrite_from method (the in-memory image kvstore.seal
    encrypts before anything reaches the disk)."""
    return as_source(dst).pwrite_from(buf, offset, path)


def pread(src, n, offset):
    """os.pread for a file descriptor or a source with pread_into."""
    return as_source(src).pread(n, offset)


def _slices(n):
    parts = min(IO_THREADS, n // MIN_SLICE)
    if parts < 2:
        return [(0, n)]
    step = -(-n // parts) + 4095 & ~4095
    return [(a, min(n, a + step)) for a in range(0, n, step)]


def _submit(fn, fd, mv, offset, path, crc0):
    """Queues fn(fd, slice, offset, path, crc0) for every slice of mv."""
    pool = _get_pool()
    return [(b - a, pool.submit(fn, fd, mv[a:b], offset + a, path, crc0)) for a, b in _slices(mv.nbytes)]


def _join(jobs, crc0):
    """Waits for _submit's jobs; returns the CRC of the whole (None without crc0)."""
    crc = None
    for n, fut in jobs:
        c = fut.result()
        crc = c if crc is None else None if crc0 is None else _native.crc32c_combine(crc, c, n)
    return crc


def _parallel(fn, fd, mv, offset, path, crc0):
    """Runs fn(fd, slice, offset, path, crc0) over the slices of mv; joins the CRCs."""
    if len(_slices(mv.nbytes)) == 1:
        return fn(fd, mv, offset, path, crc0)
    return _join(_submit(fn, fd, mv, offset, path, crc0), crc0)


def bytes_view(buf):
    """buf's bytes as one flat memoryview (format "B", 1-D) of its memory."""
    mv = memoryview(buf)
    if mv.nbytes == 0:
        # cast() refuses a shape with a zero in it (an MLX array of shape
        # (0, 4)); an empty block has no bytes to move either way.
        return memoryview(bytearray())
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")


def read_block(fd, buf, offset, path, verify):
    """Fills the writable byte buffer buf from fd at offset, in parallel slices.

    Returns the CRC32C of the bytes (None when verify is false).
    """
    return _parallel(pread_into, fd, bytes_view(buf), offset, path, 0 if verify else None)


def _check(crc, want, path, what):
    if crc is not None and crc != want:
        raise CorruptCheckpoint("crc", path, f"{what} CRC mismatch")


def read_tokens(fd, entry, manifest, verify=True):
    """The token ids as a numpy uint32 array, CRC-checked."""
    off, n, crc = manifest.tokens
    out = np.empty(n // 4, dtype="<u4")
    got = read_block(fd, out.view(np.uint8), entry.tensors_offset + off, entry.path, verify)
    _check(got, crc, entry.path, "tokens")
    return out.astype(np.uint32, copy=False)


def _numpy_dtype(dtype):
    if dtype == "bfloat16":
        # NumPy has no bfloat16: the bits come back as uint16 (documented).
        return np.dtype("<u2")
    return np.dtype(dtype).newbyteorder("<")


def read_tensors_numpy(fd, entry, manifest, verify=True):
    """Every tensor as a numpy array (bfloat16 as its uint16 bit pattern).

    The reads of every tensor are queued at once (parallel slices, CRC'd as
    they land), then joined: no tensor waits for the previous one.
    """
    out, pending = {}, []
    crc0 = 0 if verify else None
    for name, dtype, shape, off, n, crc in manifest.tensors:
        a = np.empty(shape, dtype=_numpy_dtype(dtype))
        if n:
            jobs = _submit(pread_into, fd, bytes_view(a.reshape(-1).view(np.uint8)),
                           entry.tensors_offset + off, entry.path, crc0)
            pending.append((name, crc, jobs))
        out[name] = a
    error = None
    for name, crc, jobs in pending:          # every job joined, even after a failure
        try:
            _check(_join(jobs, crc0), crc, entry.path, f"tensor {name!r}")
        except Exception as e:
            error = error or e
    if error is not None:
        raise error
    return out


class _VirtualBlob(io.RawIOBase):
    """The payload's tensor data seen as a safetensors file of one uint8 blob, for mx.load.

    mx.load allocates the blob (no fill) and calls readinto() with the new
    array's own memory.  In deferred mode this object queues the parallel
    preads of every tensor at once (each slice CRC'd as it lands, into the
    blob at the tensor's offset) and returns, so MLX's bookkeeping and the
    reads overlap and Python is entered once per load, not once per tensor;
    the tensors are then views of the blob (no copy).  wait() joins the
    reads and checks every CRC; the caller checks that the buffer MLX handed
    over is the blob's final memory.  A read that is not the whole blob in
    one call is served at once, without CRCs: the caller then checks every
    tensor's CRC from the blob after the load.

    Args:
        tensors: manifest rows of the tensors to read (none empty).
        lo, hi: the payload-relative byte range the blob covers.
    """

    def __init__(self, fd, entry, tensors, lo, hi, verify, defer):
        self.fd, self.entry, self.tensors, self.lo, self.verify, self.defer = fd, entry, tensors, lo, verify, defer
        header = {"blob": {"dtype": "U8", "shape": [hi - lo], "data_offsets": [0, hi - lo]}}
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self.head = struct.pack("<Q", len(raw)) + raw
        self.size = len(self.head) + hi - lo
        self.pos = 0
        self.partial = False      # data read other than whole-in-one-call: CRCs checked after
        self.pending = []         # (name, crc, jobs)
        self.address = None       # of the buffer the deferred reads go into
        self.error = None

    def readable(self):
        return True

    def seekable(self):
        return True

    def seek(self, pos, whence=0):
        self.pos = pos if whence == 0 else self.pos + pos if whence == 1 else self.size + pos
        return self.pos

    def tell(self):
        return self.pos

    def readinto(self, b):
        mv = bytes_view(b)
        n, done = mv.nbytes, 0
        try:
            while done < n and self.pos < self.size:
                if self.pos < len(self.head):
                    k = min(n - done, len(self.head) - self.pos)
                    mv[done:done + k] = self.head[self.pos:self.pos + k]
                elif self.defer and done == 0 and self.pos == len(self.head) and n == self.size - self.pos:
                    k = self._queue_all(mv)
                else:
                    k = self._read_now(mv[done:], self.pos - len(self.head))
                self.pos += k
                done += k
        except Exception as e:      # mx.load would mask it: keep it
            self.error = self.error or e
            raise
        return done

    def _queue_all(self, mv):
        crc0 = 0 if self.verify else None
        if type(self.fd) is not int:
            # A sealed file's view decrypts whole chunks: one read of the
            # blob's range (its tags vouch for every byte; no CRCs).
            self.pending.append(("blob", None, _submit(pread_into, self.fd, mv, self.entry.tensors_offset + self.lo,
                                                       self.entry.path, None)))
            self.address = _native.buffer_address(mv)
            return mv.nbytes
        for name, dtype, shape, off, n, crc in self.tensors:
            at = off - self.lo
            jobs = _submit(_native.pread_into, self.fd, mv[at:at + n], self.entry.tensors_offset + off,
                           self.entry.path, crc0)
            self.pending.append((name, crc, jobs))
        self.address = _native.buffer_address(mv)
        return mv.nbytes

    def _read_now(self, mv, rel):
        k = min(mv.nbytes, self.size - len(self.head) - rel)
        read_block(self.fd, mv[:k], self.entry.tensors_offset + self.lo + rel, self.entry.path, False)
        self.partial = True
        return k

    def wait(self):
        """Joins the deferred reads; raises the first failure."""
        for name, crc, jobs in self.pending:
            try:
                got = _join(jobs, 0 if self.verify else None)
                _check(got, crc, self.entry.path, f"tensor {name!r}")
            except Exception as e:
                self.error = self.error or e
        if self.error is not None:
            raise self.error


def set_mlx_threaded(on):
    """Says whether more than one thread of this process runs MLX (default: no).

    mx.load, which allocates the arrays of a load into MLX, calls the
    reader's readinto() from inside an MLX task, so that task waits for the
    GIL; a thread that waits for MLX while it holds the GIL (mlx-lm reading
    a token back, for one) then deadlocks with it.  With on=True the memory
    comes from mx.zeros instead, an op that never enters Python, and the same
    parallel reads fill it afterwards: a load costs the zero-fill more
    (bench/README.md), and no MLX task waits for Python.  kvstore serve turns
    it on: its HTTP threads load while the generation thread decodes.

    Returns:
        the previous setting.
    """
    global _mlx_threaded
    old, _mlx_threaded = _mlx_threaded, bool(on)
    return old


def _fill_blob(src):
    """MLX memory for src's blob (a _VirtualBlob) with src's reads started
    into it, evaluated; src.wait() joins the reads."""
    import mlx.core as mx
    if _mlx_threaded:
        # Filled 8 bytes at a time (MLX fills a uint8 array a byte at a
        # time, about twice as slow), then seen as the bytes asked for.
        n = src.size - len(src.head)
        blob = mx.zeros((-(-n // 8),), dtype=mx.uint64).view(mx.uint8)[:n]
        mx.eval(blob)
        src.seek(len(src.head))
        src.readinto(memoryview(blob))
    else:
        blob = mx.load(src, format="safetensors")["blob"]
        mx.eval(blob)
    return blob


def _mx_load_blob(fd, entry, tensors, lo, hi, verify, defer):
    """The blob of tensors [lo, hi) in MLX memory; every read joined and checked on return."""
    src = _VirtualBlob(fd, entry, tensors, lo, hi, verify, defer)
    try:
        blob = _fill_blob(src)
    except Exception as e:
        try:
            src.wait()          # never leave reads running into freed memory
        except Exception:
            pass
        if src.error is not None:
            raise src.error from None
        raise CorruptCheckpoint("bad_payload", entry.path, f"mx.load failed: {type(e).__name__}") from None
    src.wait()
    return blob, src


def _mx_dtype(mx, name):
    return mx.bool_ if name == "bool" else getattr(mx, name)


def _numpy_to_mlx(arrays, dtypes):
    """MLX copies of tensors a NumPy load returned (bfloat16 as uint16 bits).

    Args:
        arrays: {name: numpy array}.
        dtypes: {name: the stored dtype name} (Checkpoint.dtypes).
    """
    import mlx.core as mx
    out = {}
    for name, a in arrays.items():
        dtype = dtypes.get(name)
        if dtype == "float64":
            out[name] = mx.array(a, dtype=mx.float64)
        elif dtype == "bfloat16":
            out[name] = mx.array(a).view(mx.bfloat16)
        else:
            out[name] = mx.array(a)
    return out


def read_tensors_mlx(fd, entry, manifest, verify=True):
    """Every tensor as an MLX array: views of one blob read straight into MLX's memory.

    The tensors share that one buffer: it is freed when the last of them is.
    """
    import mlx.core as mx
    out = {}
    # mx.load's safetensors reader has no float64 (MLX keeps float64 on the
    # CPU only): those tensors are read through NumPy and copied into MLX.
    wide = copy.copy(manifest)
    wide.tensors = [t for t in manifest.tensors if t[1] == "float64"]
    direct = [t for t in manifest.tensors if t[1] != "float64" and t[4]]
    if direct:
        lo = min(t[3] for t in direct)
        hi = max(t[3] + t[4] for t in direct)
        blob, src = _mx_load_blob(fd, entry, direct, lo, hi, verify, defer=True)
        if src.address is not None and _native.buffer_address(memoryview(blob)) != src.address:
            # MLX did not read into the blob's own memory: no deferring.
            blob, src = _mx_load_blob(fd, entry, direct, lo, hi, verify, defer=False)
        for name, dtype, shape, off, n, crc in direct:
            a = blob[off - lo:off - lo + n]
            if src.partial and verify:
                _check(_native.crc32c(memoryview(a)), crc, entry.path, f"tensor {name!r}")
            out[name] = a.view(_mx_dtype(mx, dtype)).reshape(shape)
    for name, dtype, shape, off, n, crc in manifest.tensors:
        if not n and dtype != "float64":
            out[name] = mx.zeros(shape, dtype=_mx_dtype(mx, dtype))
    for name, a in read_tensors_numpy(fd, entry, wide, verify).items():
        out[name] = mx.array(a, dtype=mx.float64)
    if out:
        mx.eval(list(out.values()))
    return {t[0]: out[t[0]] for t in manifest.tensors}


# ---- chains (ABI 17) -----------------------------------------------------------

class Piece:
    """One read of a chain load: count runs of run bytes, consecutive in the
    file from file_offset, landing every stride bytes from dst in a tensor.
    label names it in errors: "tokens", or (tensor name, block name)."""

    __slots__ = ("fd", "path", "file_offset", "run", "count", "stride", "dst", "crc", "label")

    def __init__(self, fd, path, file_offset, run, count, stride, dst, crc, label):
        self.fd, self.path, self.file_offset = fd, path, file_offset
        self.run, self.count, self.stride, self.dst = run, count, stride, dst
        self.crc, self.label = crc, label

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

    Raises:
        CorruptCheckpoint: from read_manifest, or "chain_mismatch" naming the
            first block that grows other tensors (names, dtypes, the other
            dimensions, the axes) than the root, so the consistent chain
            above it survives.
    """

    def __init__(self, blocks):
        self.blocks = list(blocks)
        fd_t, target = self.blocks[-1]
        self.target = target
        m_t = read_manifest(fd_t, target)
        m_0 = m_t if len(self.blocks) == 1 else read_manifest(*self.blocks[0])
        self._known = {0: m_0, len(self.blocks) - 1: m_t}
        self._reference = _growing(m_0)
        if _growing(m_t) != self._reference:
            for i in range(1, len(self.blocks)):        # blame the first that differs
                self._manifest(i)
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
            m = read_manifest(fd, e, cached=True)
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
        for i, (fd, e) in enumerate(self.blocks):
            m = self._manifest(i)
            rows = m.rows
            at, start, stored, name = e.tensors_offset, e.token_start, e.stored_tokens, e.name
            off, n, crc = m.tokens
            out = [(-1, Piece(fd, e.path, at + off, n, 1, n, 4 * start, crc, "tokens"))]
            if stored:
                for slot, t_name, inner, outer in growing:
                    if inner and outer:
                        row = rows[t_name]
                        out.append((slot, Piece(fd, e.path, at + row[3], stored * inner, outer, self.tokens * inner,
                                                start * inner, row[5], (t_name, name))))
            if i == last:
                for slot, (t_name, dtype, shape, off, n, crc) in enumerate(m.tensors):
                    if t_name not in self.axes and n:
                        out.append((slot, Piece(fd, e.path, at + off, n, 1, n, 0, crc, (t_name, name))))
            yield out


class _Batch:
    """The reads of a chain load, handed to the I/O threads as they come.

    Each add() cuts its pieces (by runs) into parts of at most an even share
    of their bytes and deals the parts, in file order, into at most
    IO_THREADS jobs of about equal size: each job reads its parts in one
    native call with the GIL released.  wait() joins the parts' CRCs per
    piece (in file order) and checks them, first piece first.
    """

    def __init__(self, buffers, verify):
        """Args:
            buffers: writable byte views the pieces land in.
            verify: check every piece's CRC32C.
        """
        self.buffers = buffers
        self.verify = verify
        self.pieces = []            # Piece, in the order added
        self.jobs = []              # (future, [(piece index, bytes)])

    def add(self, pieces, last=False):
        """Queues [(buffer index, Piece)].  last: no more will come; a first
        and last add that fits one job runs at once, on the calling thread."""
        first = len(self.pieces)
        self.pieces.extend(p for _, p in pieces)
        total = sum(p.nbytes for _, p in pieces)
        jobs = max(1, min(IO_THREADS, total // MIN_SLICE))
        share = max(1, -(-total // jobs))
        src = pieces[0][1].fd if pieces else 0
        if type(src) is not int and jobs > 1:
            # A sealed chain's blocks are kvstore.seal.SealedSource objects,
            # which decrypt and authenticate the chunks they read: the work
            # is planned once, chunk by chunk, and each job takes an equal
            # run of whole chunks (no per-piece results: the tags vouch).
            work = src.chunk_work(self.buffers, [(b, p.fd, p.file_offset, p.run, p.count, p.stride, p.dst)
                                                 for b, p in pieces])
            pool = _get_pool()
            for j in range(jobs):
                share = work[len(work) * j // jobs:len(work) * (j + 1) // jobs]
                self.jobs.append((pool.submit(src.read_chunks, self.buffers, share), []))
            return
        groups, size = [[]], 0
        for i, (b, p) in enumerate(pieces, first):
            step = max(1, p.count if p.nbytes <= share else share // p.run)
            for run0 in range(0, p.count, step):
                if size >= share and len(groups) < jobs:
                    groups.append([])
                    size = 0
                k = min(step, p.count - run0)
                groups[-1].append((i, k * p.run, (b, p.fd, p.file_offset + run0 * p.run, p.run, k, p.stride,
                                                  p.dst + run0 * p.stride)))
                size += k * p.run
        groups = [g for g in groups if g]
        read = as_source(src).read_pieces
        if last and not self.jobs and len(groups) == 1:
            g = groups[0]
            self.jobs.append((_Done(read, self.buffers, [part[2] for part in g], self.verify),
                              [part[:2] for part in g]))
            return
        pool = _get_pool()
        for g in groups:
            self.jobs.append((pool.submit(read, self.buffers, [part[2] for part in g],
                                          self.verify), [part[:2] for part in g]))

    def wait(self):
        """Waits for every read; raises for the first piece that failed
        (CorruptCheckpoint for a short file or a CRC mismatch, OSError)."""
        status = [0] * len(self.pieces)
        crcs = [None] * len(self.pieces)
        error = None
        for fut, parts in self.jobs:
            try:
                results = fut.result()
            except Exception as e:      # every job joined, even after a failure
                error = error or e
                continue
            for (i, n), (rc, crc) in zip(parts, results):
                if rc:
                    status[i] = status[i] or rc
                elif crcs[i] is None:
                    crcs[i] = crc
                else:
                    crcs[i] = _native.crc32c_combine(crcs[i], crc, n)
        self.jobs = []
        if error is not None:
            raise error
        for p, rc, crc in zip(self.pieces, status, crcs):
            if rc:
                _native.raise_status(rc, p.path, p.what)
            if self.verify:
                if (crc or 0) != p.crc:
                    _check(crc or 0, p.crc, p.path, p.what)


class _Done:
    """A job run at once, in the caller's thread (a load too small to share out)."""

    def __init__(self, fn, *args):
        try:
            self.value, self.error = fn(*args), None
        except Exception as e:
            self.value, self.error = None, e

    def result(self):
        if self.error is not None:
            raise self.error
        return self.value


def _read_stream(layout, buffers, slots, verify):
    """Reads layout.pieces() into buffers (slots[slot] is the index in
    buffers of a tensor slot, slots[-1] the tokens'), block by block: a
    block's reads start before the next block's manifest is read.  A bad
    manifest stops the queueing; the reads queued are joined, a failed one
    (an earlier block) raised first."""
    batch = _Batch(buffers, verify)
    late = _queue(layout, batch, slots)
    batch.wait()
    if late is not None:
        raise late


def _queue(layout, batch, slots):
    """Adds layout.pieces() to batch as the blocks come, at least QUEUE_BYTES
    at a time (small blocks are gathered: a pool job costs about as much as
    reading a small block).  Returns the exception of a bad manifest (which
    stops the queueing after the blocks before it are queued), or None."""
    pending, size, late = [], 0, None
    try:
        for pieces in layout.pieces():
            for s, p in pieces:
                if slots[s] is not None:
                    pending.append((slots[s], p))
                    size += p.nbytes
            if size >= QUEUE_BYTES:
                batch.add(pending)
                pending, size = [], 0
    except Exception as e:
        late = e
    if pending:
        batch.add(pending, last=True)
    return late


def _tokens_view(layout):
    out = np.empty(layout.tokens, dtype="<u4")
    return out, bytes_view(out.view(np.uint8))


def read_chain_numpy(layout, verify=True):
    """A chain load into NumPy.

    Returns:
        (token ids as uint32, {name: array}) (bfloat16 as uint16 bits).
    """
    tokens, tok_mv = _tokens_view(layout)
    out = {t.name: np.empty(t.shape, dtype=_numpy_dtype(t.dtype)) for t in layout.tensors}
    buffers = [bytes_view(out[t.name].reshape(-1).view(np.uint8)) for t in layout.tensors] + [tok_mv]
    _read_stream(layout, buffers, list(range(len(layout.tensors))) + [len(layout.tensors)], verify)
    return tokens.astype(np.uint32, copy=False), out


class _ChainBlob(_VirtualBlob):
    """The tensors of a chain load MLX reads directly, as one safetensors blob
    for mx.load: each at a 64-byte aligned place.  When MLX hands over the
    blob's memory, the load's reads start (block by block, see
    _read_stream) into it and into the other buffers (the token ids, the
    float64 tensors read through NumPy)."""

    def __init__(self, layout, direct, others, verify):
        """Args:
            direct: the slots of the tensors in the blob.
            others: {slot: byte view} of the other non-empty tensors
                (slot -1 the tokens).
        """
        self.layout, self.direct, self.others, self.verify = layout, direct, others, verify
        self.places, at = [], 0
        for s in direct:
            at = _align(at, BLOCK_ALIGN)
            self.places.append(at)
            at += layout.tensors[s].nbytes
        header = {"blob": {"dtype": "U8", "shape": [at], "data_offsets": [0, at]}}
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self.head = struct.pack("<Q", len(raw)) + raw
        self.size = len(self.head) + at
        self.defer = True
        self.pos = 0
        self.partial = False
        self.address = None
        self.error = None
        self.late = None
        self.batch = None

    def _queue_all(self, mv):
        buffers = [mv[at:at + self.layout.tensors[s].nbytes] for s, at in zip(self.direct, self.places)]
        slots = [None] * (len(self.layout.tensors) + 1)
        for i, s in enumerate(self.direct):
            slots[s] = i
        for s, view in self.others.items():
            slots[s] = len(buffers)
            buffers.append(view)
        self.batch = _Batch(buffers, self.verify)
        self.address = _native.buffer_address(mv)
        self.late = _queue(self.layout, self.batch, slots)     # raised by wait(), after the reads
        return mv.nbytes

    def _read_now(self, mv, rel):
        # MLX asked for the blob in parts: the caller reads through NumPy instead.
        self.partial = True
        return min(mv.nbytes, self.size - len(self.head) - rel)

    def wait(self):
        if self.batch is not None:
            batch, self.batch = self.batch, None
            try:
                batch.wait()
            except Exception as e:
                self.error = self.error or e
        self.error = self.error or self.late
        if self.error is not None:
            raise self.error


def read_chain_mlx(layout, verify=True):
    """A chain load into MLX: the tensors are views of one blob that mx.load
    (or mx.zeros, see set_mlx_threaded) allocates and every block's slices
    fill in place.

    Returns:
        (token ids as a numpy uint32 array, {name: mx.array}).
    """
    import mlx.core as mx
    n = len(layout.tensors)
    direct = [s for s, t in enumerate(layout.tensors) if t.dtype != "float64" and t.nbytes]
    tokens, tok_mv = _tokens_view(layout)
    # mx.load's safetensors reader has no float64 (MLX keeps float64 on the
    # CPU only): those tensors are read through NumPy and copied into MLX.
    wide = {s: np.empty(t.shape, dtype=np.float64) for s, t in enumerate(layout.tensors)
            if t.dtype == "float64" and t.nbytes}
    others = {s: bytes_view(a.reshape(-1).view(np.uint8)) for s, a in wide.items()}
    others[-1] = tok_mv
    out = {}
    if direct:
        src = _ChainBlob(layout, direct, others, verify)
        try:
            blob = _fill_blob(src)
        except Exception as e:
            try:
                src.wait()          # never leave reads running into freed memory
            except Exception:
                pass
            if src.error is not None:
                raise src.error from None
            raise CorruptCheckpoint("bad_payload", layout.target.path,
                                    f"mx.load failed: {type(e).__name__}") from None
        src.wait()
        if src.partial or src.address is None or _native.buffer_address(memoryview(blob)) != src.address:
            # MLX did not hand over the blob's own memory in one call.
            tokens, arrays = read_chain_numpy(layout, verify)
            out.update(_numpy_to_mlx({t.name: arrays[t.name] for t in layout.tensors if t.nbytes},
                                    {t.name: t.dtype for t in layout.tensors}))
        else:
            for s, at in zip(direct, src.places):
                t = layout.tensors[s]
                out[t.name] = blob[at:at + t.nbytes].view(_mx_dtype(mx, t.dtype)).reshape(t.shape)
            for s, a in wide.items():
                out[layout.tensors[s].name] = mx.array(a, dtype=mx.float64)
    else:
        slots = [None] * (n + 1)
        buffers = []
        for s, view in others.items():
            slots[s] = len(buffers)
            buffers.append(view)
        _read_stream(layout, buffers, slots, verify)
        for s, a in wide.items():
            out[layout.tensors[s].name] = mx.array(a, dtype=mx.float64)
    for t in layout.tensors:
        if not t.nbytes:
            out[t.name] = mx.zeros(t.shape, dtype=_mx_dtype(mx, t.dtype))
    if out:
        mx.eval(list(out.values()))
    return tokens.astype(np.uint32, copy=False), {t.name: out[t.name] for t in layout.tensors}
