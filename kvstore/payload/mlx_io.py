"""Every MLX call of the payload: MLX arrays as sources of a write, and loads into MLX memory.

The only module of kvstore.payload that imports MLX, and only inside the
functions that need it: a process that never touches an MLX array never
imports MLX.

A load into MLX presents the payload to mx.load as a virtual safetensors
file (kvstore.payload.whole.VirtualBlob, chains.ChainBlob) whose readinto()
lands the parallel reads in the arrays mx.load allocates.  That readinto()
is Python called from inside an MLX task, which is safe only while no other
thread runs MLX: a process where several do (kvstore serve) calls
set_mlx_threaded(True), and the memory then comes from mx.zeros, an MLX op
that never enters Python, before the same reads fill it.
"""

import copy

import numpy as np

from kvstore import _native
from kvstore.errors import CorruptCheckpoint
from kvstore.payload.buffers import bytes_view
from kvstore.payload.chains import ChainRead, read_chain_numpy, read_stream, tokens_view
from kvstore.payload.manifest import BLOCK_ALIGN, align
from kvstore.payload.pool import bulk_thread, check_crc
from kvstore.payload.whole import VirtualBlob, read_tensors_numpy

# Whether other threads may run MLX while a load into MLX runs (set_mlx_threaded).
_mlx_threaded = False


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


def host_tensors(tensors, dtypes=None):
    """(tensors with every MLX array replaced by its host_views view, the
    dtypes to record with bfloat16 added): what a writer slices and writes
    without running an MLX op per slice.  A dict without MLX arrays comes
    back as it is, and MLX is not imported.

    The views are made on the caller's thread and MLX stream, in one
    evaluation; the writer then only reads memory (a strided view, a KV
    buffer cut to its filled length, is copied contiguous by NumPy as it
    writes).  An MLX op on a writer's thread would queue behind a running
    prefill (seen: a save of 5.8 MB taking 17-24 s in kvstore serve), and
    MLX on the CPU is not safe for ops on two threads at once.  A view keeps
    today's data: an in-place update of the caller's array (cache[..., i:j]
    = x) cannot reuse a buffer still referenced.

    Returns:
        (dict name -> array, dict name -> recorded dtype).
    """
    dtypes = dict(dtypes or {})
    mlx = {k: a for k, a in tensors.items() if is_mlx_array(a)}
    if not mlx:
        return tensors, dtypes
    views = host_views(mlx)
    out = dict(tensors)
    for k, (view, recorded) in views.items():
        out[k] = view
        if recorded is not None:
            dtypes[k] = recorded
    return out, dtypes


def mlx_source(a):
    """An MLX array described for the writer, evaluated (kvstore.payload.plan.tensor_source).

    Returns:
        (dtype name, shape, nbytes, materialize): materialize() returns the
        array's bytes, a contiguous copy only when the array is strided.
    """
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
    return dtype, shape, nbytes, materialize


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


def _fill_blobs(srcs):
    """MLX memory for the blobs of srcs (VirtualBlob or ChainBlob objects)
    with their reads started into it, evaluated; the sources' wait() joins
    the reads."""
    import mlx.core as mx
    if _mlx_threaded:
        # The zero-fill touches every fresh page: bulk work, done on the
        # bulk thread's MLX stream (kvstore.payload.pool.bulk_thread).
        blobs = bulk_thread().submit(lambda: [_zeroed(src.size - len(src.head)) for src in srcs]).result()
        for src, blob in zip(srcs, blobs):
            src.seek(len(src.head))
            src.readinto(memoryview(blob))
    else:
        blobs = [mx.load(src, format="safetensors")["blob"] for src in srcs]
        mx.eval(blobs)
    return blobs


def _zeroed(n):
    """n bytes of zeroed MLX memory, evaluated on the calling thread's stream."""
    import mlx.core as mx
    # Filled 8 bytes at a time (MLX fills a uint8 array a byte at a time,
    # about twice as slow), then seen as the bytes asked for.
    blob = mx.zeros((-(-n // 8),), dtype=mx.uint64).view(mx.uint8)[:n]
    mx.eval(blob)
    return blob


def _filled(srcs, wait, path):
    """The blobs of srcs in MLX memory (_fill_blobs); every read joined
    (wait(), which raises the first failure) and checked on return."""
    try:
        blobs = _fill_blobs(srcs)
    except Exception as e:
        try:
            wait()          # never leave reads running into freed memory
        except Exception as failed:
            raise failed from None
        raise CorruptCheckpoint("bad_payload", path, f"mx.load failed: {type(e).__name__}") from None
    wait()
    return blobs


def load_blob(fd, entry, tensors, lo, hi, verify, defer):
    """The blob of tensors [lo, hi) in MLX memory; every read joined and checked on return."""
    src = VirtualBlob(fd, entry, tensors, lo, hi, verify, defer)
    return _filled([src], src.wait, entry.path)[0], src


# MLX's array dimensions are 32-bit ints: a blob of 2 GiB or more cannot be
# one uint8 array (mx.load then reads a wrapped size, and every CRC of the
# load fails as if the files were corrupt).  A larger load is cut into
# several blobs of whole tensors (blob_groups); only a single tensor that
# large goes through NumPy arrays and MLX copies of them.
MLX_BLOB_MAX = (1 << 31) - 1


def blob_groups(spans):
    """The blobs a load into MLX reads: [[index, ...], ...], consecutive runs
    of spans (each a tensor's (start, end) in the blob order, ascending)
    whose first start and last end are at most MLX_BLOB_MAX bytes apart;
    None when one tensor alone is larger."""
    groups, lo = [], None
    for i, (start, end) in enumerate(spans):
        if end - start > MLX_BLOB_MAX:
            return None
        if lo is None or end - lo > MLX_BLOB_MAX:
            groups.append([])
            lo = start
        groups[-1].append(i)
    return groups


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
    """Every tensor as an MLX array: views of blobs read straight into MLX's
    memory, one blob unless the tensors span more than MLX_BLOB_MAX bytes.

    The tensors of a blob share its buffer: it is freed when the last of them is.
    """
    import mlx.core as mx
    out = {}
    # mx.load's safetensors reader has no float64 (MLX keeps float64 on the
    # CPU only): those tensors are read through NumPy and copied into MLX.
    wide = copy.copy(manifest)
    wide.tensors = [t for t in manifest.tensors if t[1] == "float64"]
    direct = sorted((t for t in manifest.tensors if t[1] != "float64" and t[4]), key=lambda t: t[3])
    groups = blob_groups([(t[3], t[3] + t[4]) for t in direct])
    if groups is None:
        wide.tensors, groups = [t for t in manifest.tensors if t[4] or t[1] == "float64"], []   # all via NumPy
    for group in groups:
        out.update(_blob_tensors(mx, fd, entry, [direct[i] for i in group], verify))
    for name, dtype, shape, off, n, crc in manifest.tensors:
        if not n and dtype != "float64":
            out[name] = mx.zeros(shape, dtype=_mx_dtype(mx, dtype))
    arrays = read_tensors_numpy(fd, entry, wide, verify)
    out.update(_numpy_to_mlx(arrays, {t[0]: t[1] for t in wide.tensors}))
    if out:
        mx.eval(list(out.values()))
    return {t[0]: out[t[0]] for t in manifest.tensors}


def _blob_tensors(mx, fd, entry, rows, verify):
    """{name: MLX array} of manifest rows (ascending offsets, at most
    MLX_BLOB_MAX bytes from the first's start to the last's end): views of
    one blob read into MLX's memory."""
    lo, hi = rows[0][3], rows[-1][3] + rows[-1][4]
    blob, src = load_blob(fd, entry, rows, lo, hi, verify, defer=True)
    if src.address is not None and _native.buffer_address(memoryview(blob)) != src.address:
        # MLX did not read into the blob's own memory: no deferring.
        blob, src = load_blob(fd, entry, rows, lo, hi, verify, defer=False)
    out = {}
    for name, dtype, shape, off, n, crc in rows:
        a = blob[off - lo:off - lo + n]
        if src.partial and verify:
            check_crc(_native.crc32c(memoryview(a)), crc, entry.path, f"tensor {name!r}")
        out[name] = a.view(_mx_dtype(mx, dtype)).reshape(shape)
    return out


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
    tokens, tok_mv = tokens_view(layout)
    # mx.load's safetensors reader has no float64 (MLX keeps float64 on the
    # CPU only): those tensors are read through NumPy and copied into MLX.
    wide = {s: np.empty(t.shape, dtype=np.float64) for s, t in enumerate(layout.tensors)
            if t.dtype == "float64" and t.nbytes}
    others = {s: bytes_view(a.reshape(-1).view(np.uint8)) for s, a in wide.items()}
    others[-1] = tok_mv
    out = {}
    if direct:
        groups = blob_groups(_chain_spans(layout, direct))
        blobs = None if groups is None else _chain_blobs(layout, [[direct[i] for i in g] for g in groups],
                                                         others, verify)
        if blobs is None:
            # A tensor too large for one MLX array, or MLX did not hand
            # over a blob's own memory in one call.
            tokens, arrays = read_chain_numpy(layout, verify)
            out.update(_numpy_to_mlx({t.name: arrays[t.name] for t in layout.tensors if t.nbytes},
                                     {t.name: t.dtype for t in layout.tensors}))
        else:
            for src, blob in blobs:
                for s, at in zip(src.direct, src.places):
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
        read_stream(layout, buffers, slots, verify)
        for s, a in wide.items():
            out[layout.tensors[s].name] = mx.array(a, dtype=mx.float64)
    for t in layout.tensors:
        if not t.nbytes:
            out[t.name] = mx.zeros(t.shape, dtype=_mx_dtype(mx, t.dtype))
    if out:
        mx.eval(list(out.values()))
    return tokens.astype(np.uint32, copy=False), {t.name: out[t.name] for t in layout.tensors}


def _chain_spans(layout, direct):
    """(start, end) of each direct tensor where one ChainBlob of them all would place it."""
    spans, at = [], 0
    for s in direct:
        at = align(at, BLOCK_ALIGN)
        spans.append((at, at + layout.tensors[s].nbytes))
        at += layout.tensors[s].nbytes
    return spans


def _chain_blobs(layout, groups, others, verify):
    """[(ChainBlob, its MLX blob)], one per group of tensor slots, read in
    one pass (ChainRead; the reads also fill others: the token ids and the
    float64 tensors); None when MLX did not hand over every blob's own
    memory in one call (the caller reads through NumPy instead)."""
    read = ChainRead(layout, groups, others, verify)
    blobs = _filled(read.sources, read.wait, layout.target.path)
    for src, blob in zip(read.sources, blobs):
        if src.partial or src.address is None or _native.buffer_address(memoryview(blob)) != src.address:
            return None
    return list(zip(read.sources, blobs))
