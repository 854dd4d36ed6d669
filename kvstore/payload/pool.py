"""The I/O pool: a block's reads and writes cut into slices that threads run in parallel.

Each slice is read (or CRC'd) by its own thread with the GIL released, and
the slices' CRC32Cs are combined into the block's.  The threads may run at
a lower CPU priority (set_io_priority), and a forked child starts its own.
"""

import concurrent.futures
import contextlib
import gc
import os
import threading

from kvstore import _native
from kvstore.errors import CorruptCheckpoint
from kvstore.executors import LazyExecutor
from kvstore.host import lower_thread_priority, set_prefetch_priority
from kvstore.payload.buffers import bytes_view, pread_into

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
# ... in jobs of at most this many bytes each (a large block in several).
JOB_BYTES = 16 << 20

_io_nice = 0

# A load allocates thousands of small objects as it plans its reads (a
# Piece and a tuple per read, a manifest row per tensor and block), enough
# to set off a full collection of Python's cyclic garbage collector: in a
# process with MLX and mlx-lm imported (80,000 objects tracked) one holds
# the GIL for 40-45 ms, and the I/O threads wait for it to take their next
# reads (seen: a 0.78 GiB chain load 0.33 s with it, 0.27 s without).
# While any load runs the collector is paused (gc_paused); what it would
# have collected waits for the next collection after it.
_gc_lock = threading.Lock()
_gc_loads = 0               # loads running with the collector paused
_gc_resume = False          # the collector was on when the first of them began


_io = LazyExecutor(lambda: concurrent.futures.ThreadPoolExecutor(IO_THREADS, thread_name_prefix="kvstore-io",
                                                                 initializer=lower_thread_priority,
                                                                 initargs=(_io_nice,)))

# One thread for the bulk work a load does in MLX itself (the zero-fill of a
# blob's fresh pages, kvstore.payload.mlx_io): MLX runs a stream's work on a
# thread of its own, made by the first thread that uses the stream and at
# that thread's priority, so work made here yields the CPU as the I/O
# threads' does.  It takes the I/O threads' niceness when first used and
# keeps its thread for the process's life (a thread that ran MLX must not
# end before the interpreter: MLX aborts tearing down its stream).
_bulk = LazyExecutor(lambda: concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvstore-bulk",
                                                                   initializer=lower_thread_priority,
                                                                   initargs=(_io_nice,)))


def set_io_priority(nice):
    """Runs the payload I/O threads at CPU niceness `nice` (0: the process's own;
    on macOS any other value means the utility QoS class: kvstore.host).

    kvstore serve loads checkpoints while its generation thread decodes: at a
    lower priority the loads' copies and CRCs take the CPU time decoding
    leaves, not the other way round.  The read-ahead's threads
    (kvstore.host.ReadThrough) take the same niceness.  Threads already
    started are replaced.
    """
    global _io_nice
    if not 0 <= nice <= 19:
        raise ValueError(f"I/O thread niceness {nice!r} is not in 0..19")
    old = _io.take()
    _io_nice = nice
    set_prefetch_priority(nice)
    if old is not None:
        old.shutdown(wait=True)


@contextlib.contextmanager
def gc_paused():
    """Pauses Python's cyclic garbage collector while the block runs (a
    load, see _gc_loads); it resumes when the last such block ends, unless
    it was off when the first began."""
    global _gc_loads, _gc_resume
    with _gc_lock:
        if _gc_loads == 0:
            _gc_resume = gc.isenabled()
            gc.disable()
        _gc_loads += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_loads -= 1
            if _gc_loads == 0 and _gc_resume:
                gc.enable()


# One thread that packs a chained save's next block while the saving thread
# writes the current one (kvstore.payload.plan.PackAhead); the packing itself
# runs on the I/O threads.
_pack = LazyExecutor(lambda: concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvstore-pack"))


def pack_thread():
    """The executor (one thread) that packs a chained save's blocks ahead of their writes."""
    return _pack.get()


def io_pool():
    """The I/O threads' executor (IO_THREADS threads), shared with kvstore.seal's chunk jobs."""
    return _io.get()


def bulk_thread():
    """The executor (one thread, at the I/O threads' niceness) of a load's bulk MLX work."""
    return _bulk.get()


def slices(n):
    """[(start, end)] of the parallel slices of an n-byte block (page-aligned starts)."""
    parts = min(IO_THREADS, n // MIN_SLICE)
    if parts < 2:
        return [(0, n)]
    step = -(-n // parts) + 4095 & ~4095
    return [(a, min(n, a + step)) for a in range(0, n, step)]


def submit_slices(fn, fd, mv, offset, path, crc0):
    """Queues fn(fd, slice, offset, path, crc0) for every slice of mv."""
    pool = io_pool()
    return [(b - a, pool.submit(fn, fd, mv[a:b], offset + a, path, crc0)) for a, b in slices(mv.nbytes)]


def join_slices(jobs, crc0):
    """Waits for submit_slices's jobs; returns the CRC of the whole (None without crc0)."""
    crc = None
    for n, fut in jobs:
        c = fut.result()
        crc = c if crc is None else None if crc0 is None else _native.crc32c_combine(crc, c, n)
    return crc


def _parallel(fn, fd, mv, offset, path, crc0):
    """Runs fn(fd, slice, offset, path, crc0) over the slices of mv; joins the CRCs."""
    if len(slices(mv.nbytes)) == 1:
        return fn(fd, mv, offset, path, crc0)
    return join_slices(submit_slices(fn, fd, mv, offset, path, crc0), crc0)


def read_block(fd, buf, offset, path, verify):
    """Fills the writable byte buffer buf from fd at offset, in parallel slices.

    Returns the CRC32C of the bytes (None when verify is false).
    """
    return _parallel(pread_into, fd, bytes_view(buf), offset, path, 0 if verify else None)


def check_crc(crc, want, path, what):
    """Raises CorruptCheckpoint("crc") when a computed CRC (None: not computed) is not the manifest's."""
    if crc is not None and crc != want:
        raise CorruptCheckpoint("crc", path, f"{what} CRC mismatch")
