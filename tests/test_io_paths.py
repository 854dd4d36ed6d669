"""The run-time-chosen I/O paths of csrc/io.c.

Reads: on Linux 5.14 and later each chunk's pages are mapped with
MADV_POPULATE_WRITE before the read fills them.  The bytes and CRCs must be
the same as a plain read, and no page outside the destination may be touched.

Writes: a new checkpoint's blocks are allocated with fallocate() before it
is written; where the filesystem cannot, the writes allocate as they go.
Both routes must give the same file.  A plain file's blocks are written by
the I/O threads (which a server runs at a lower CPU priority), not by the
thread that saves.
"""

import ctypes
import errno
import mmap
import os
import sys
import time

import numpy as np
import pytest

from kvstore import _native, host

import reference
from kvstore.errors import CheckpointOSError, CorruptCheckpoint
from kvhelpers import make_store

PAGE = mmap.PAGESIZE
LINUX = sys.platform.startswith("linux")
PORTABLE = os.environ.get("KVSTORE_PORTABLE", "") not in ("", "0")


def kernel_version():
    parts = os.uname().release.split(".")
    return int(parts[0]), int("".join(c for c in parts[1] if c.isdigit()) or 0)


def resident_pages(m):
    """mincore() of an anonymous mapping: one bool per page."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    n = len(m) // PAGE
    vec = ctypes.create_string_buffer(n)
    anchor = ctypes.c_char.from_buffer(m)
    try:
        if libc.mincore(ctypes.addressof(anchor), len(m), vec) != 0:
            raise OSError(ctypes.get_errno(), "mincore")
    finally:
        del anchor
    return [b & 1 == 1 for b in vec.raw]


def kernel_prefaults():
    return LINUX and kernel_version() >= (5, 14)


@pytest.fixture(params=["prefault", "plain"])
def read_route(request):
    """Runs a test with prefaulting on (where the kernel has it) and off."""
    on = request.param == "prefault"
    if on and not kernel_prefaults():
        pytest.skip("this kernel has no MADV_POPULATE_WRITE")
    assert _native.set_read_prefaults(on) is on
    try:
        yield request.param
    finally:
        _native.set_read_prefaults(not PORTABLE)


def test_prefaulting_is_on_where_the_kernel_has_it():
    # KVSTORE_PORTABLE=1 turns it off at import, with the portable hash paths.
    assert _native.read_prefaults() == (kernel_prefaults() and not PORTABLE)
    assert _native.set_read_prefaults(True) == kernel_prefaults()
    assert _native.set_read_prefaults(False) is False
    _native.set_read_prefaults(not PORTABLE)


@pytest.mark.parametrize("first,last", [(3 * PAGE + 100, 330 * PAGE + 17),     # unaligned both ends
                                        (4 * PAGE, 300 * PAGE),                # page-aligned
                                        (5 * PAGE + 1, 5 * PAGE + 99)])        # inside one page
def test_read_into_fresh_memory_touches_only_its_pages(tmp_path, read_route, first, last):
    # 340 pages: the larger cases span more than one 1 MiB read chunk.
    data = os.urandom(340 * PAGE)
    path = tmp_path / "data"
    path.write_bytes(data)
    m = mmap.mmap(-1, 340 * PAGE)            # anonymous: no page mapped yet
    try:
        if LINUX:
            assert not any(resident_pages(m))
        fd = os.open(path, os.O_RDONLY)
        try:
            view = memoryview(m)[first:last]
            crc = _native.pread_into(fd, view, 77, str(path), 0)
            view.release()
        finally:
            os.close(fd)
        want = data[77:77 + last - first]
        assert m[first:last] == want
        assert crc == reference.crc32c(want)
        if LINUX:
            touched = [i for i, r in enumerate(resident_pages(m)) if r]
            assert touched == list(range(first // PAGE, (last - 1) // PAGE + 1))
    finally:
        m.close()


def test_read_past_end_of_file_is_an_error(tmp_path, read_route):
    path = tmp_path / "short"
    path.write_bytes(os.urandom(3 * PAGE))
    m = mmap.mmap(-1, 8 * PAGE)
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            view = memoryview(m)
            with pytest.raises(CorruptCheckpoint) as e:
                _native.pread_into(fd, view, 0, str(path), 0)
            assert e.value.reason == "truncated"
            view.release()
        finally:
            os.close(fd)
    finally:
        m.close()


# ---- preallocation -----------------------------------------------------------

@pytest.mark.skipif(not LINUX, reason="fallocate() is Linux's")
def test_preallocate_sets_the_size_and_allocates_the_blocks(tmp_path):
    path = tmp_path / "f"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        assert _native.preallocate(fd, 5 * 1024 * 1024 + 3, str(path)) is True
        st = os.fstat(fd)
        assert st.st_size == 5 * 1024 * 1024 + 3
        assert st.st_blocks * 512 >= st.st_size
        assert os.pread(fd, 4096, 0) == bytes(4096)          # allocated, reads as zeros
        assert _native.preallocate(fd, 0, str(path)) is True  # nothing to do
    finally:
        os.close(fd)


@pytest.mark.skipif(LINUX, reason="Linux has fallocate()")
def test_preallocate_elsewhere_says_it_cannot(tmp_path):
    path = tmp_path / "f"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        assert _native.preallocate(fd, 4096, str(path)) is False
        assert os.fstat(fd).st_size == 0
    finally:
        os.close(fd)


@pytest.mark.skipif(not LINUX, reason="fallocate() is Linux's")
def test_preallocate_on_a_read_only_descriptor_is_an_error(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"")
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(CheckpointOSError) as e:
            _native.preallocate(fd, 4096, str(path))
        assert e.value.errno == 9 and "preallocate" in str(e.value)      # EBADF
    finally:
        os.close(fd)


def save_one(directory):
    tensors = {"k": np.arange(3 * 1024 * 1024, dtype=np.float16).reshape(3, 1024, 1024),
               "empty": np.zeros((0, 4), np.float32)}
    with make_store(directory) as s:
        e = s.save(b"a prompt" * 100, np.arange(700, dtype=np.uint32), tensors, meta={"m": 1})
        assert e is not None
        ck = s.load(s.find(b"a prompt" * 100 + b"!"))
        assert ck is not None and np.array_equal(ck.tensors["k"], tensors["k"])
        assert ck.tensors["empty"].shape == (0, 4)
        return open(e.path, "rb").read()


def test_a_save_without_preallocation_writes_the_same_file(tmp_path, monkeypatch):
    calls = []
    real = _native.preallocate

    def spy(fd, length, path=None):
        calls.append(length)
        return real(fd, length, path)

    monkeypatch.setattr(_native, "preallocate", spy)
    with_prealloc = save_one(tmp_path / "a")
    assert len(calls) == 1 and calls[0] == len(with_prealloc)
    # A filesystem that cannot preallocate: the writes allocate as they go.
    monkeypatch.setattr(_native, "preallocate", lambda fd, length, path=None: False)
    without = save_one(tmp_path / "b")
    # Equal but for the header's created_at and last_used (bytes 24-39): clock time.
    assert len(without) == len(with_prealloc)
    assert without[:24] + without[40:] == with_prealloc[:24] + with_prealloc[40:]


# ---- batched reads: a chain's slices into their places in whole tensors ----------------------

def _expected(src, buf_len, pieces):
    """What pread_pieces must leave in each buffer (0xee where nothing lands) and each piece's CRC."""
    want = [bytearray(b"\xee" * n) for n in buf_len]
    crcs = []
    for b, _, off, run, count, stride, dst in pieces:
        for i in range(count):
            want[b][dst + i * stride:dst + i * stride + run] = src[off + i * run:off + (i + 1) * run]
        crcs.append(reference.crc32c(src[off:off + count * run]))
    return want, crcs


@pytest.mark.parametrize("shape", [
    [(0, 50, 10, 1, 10, 0)],                                   # one plain run
    [(0, 0, 8, 3, 24, 8), (1, 100, 16, 2, 40, 0)],             # strided, two buffers
    [(0, 7, 4096 + 3, 5, 3 * 4096, 4096)],                     # runs across pages
    [(0, 64, 100, 130, 256, 0)],                               # more runs than one preadv takes
    [(0, 3, (1 << 20) + 5, 2, 3 << 20, 7)],                    # runs past the read chunk size
    [(0, 10, 0, 4, 0, 0), (0, 0, 32, 0, 64, 0)],               # empty runs, no runs
])
def test_batched_read_lands_every_run_in_place_with_each_piece_crc(tmp_path, read_route, shape):
    rng = np.random.default_rng(len(shape) * 7 + shape[0][2])
    src = rng.integers(0, 256, 8 << 20, dtype=np.uint8).tobytes()
    path = tmp_path / "f"
    path.write_bytes(src)
    fd = os.open(path, os.O_RDONLY)
    pieces = [(b, fd, off, run, count, stride, dst) for b, off, run, count, stride, dst in shape]
    sizes = [max([dst + (count - 1) * stride + run + 16 for b2, _, _, run, count, stride, dst in pieces
                  if b2 == b and count] + [16]) for b in range(2)]
    bufs = [bytearray(b"\xee" * n) for n in sizes]
    try:
        got = _native.pread_pieces(bufs, pieces, True)
        plain = [bytearray(b"\xee" * n) for n in sizes]
        unchecked = _native.pread_pieces(plain, pieces, False)
    finally:
        os.close(fd)
    want, crcs = _expected(src, sizes, pieces)
    assert bufs == want                                    # nothing outside the runs is touched
    assert got == [(0, c) for c in crcs]
    assert plain == want and unchecked == [(0, 0)] * len(pieces)


def test_batched_read_refuses_pieces_past_their_buffer(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(bytes(100))
    fd = os.open(path, os.O_RDONLY)
    try:
        for piece in [(0, fd, 0, 10, 3, 11, 0),          # 2 * 11 + 10 > 30
                      (0, fd, 0, 10, 1, 10, 25),         # past the end from 25
                      (0, fd, 0, 10, 2, 5, 0),           # runs would overlap
                      (1, fd, 0, 1, 1, 1, 0),            # no buffer 1
                      (-1, fd, 0, 1, 1, 1, 0),
                      (0, fd, 0, 1, 2, (1 << 64) - 1, 0)]:
            buf = bytearray(30)
            with pytest.raises(ValueError):
                _native.pread_pieces([buf], [(0, fd, 0, 5, 1, 5, 0), piece], True)
            assert buf == bytearray(30)                   # checked before any read
    finally:
        os.close(fd)


def test_batched_read_reports_each_failed_piece_and_reads_the_rest(tmp_path, read_route):
    path = tmp_path / "f"
    src = bytes(range(256)) * 4
    path.write_bytes(src)
    fd = os.open(path, os.O_RDONLY)
    bad = os.open(tmp_path, os.O_RDONLY)                     # a directory: read() fails with EISDIR
    buf = bytearray(4096)
    try:
        got = _native.pread_pieces([buf], [(0, fd, 1000, 60, 2, 100, 0),    # the file ends first
                                           (0, bad, 0, 8, 1, 8, 300),
                                           (0, fd, 8, 16, 4, 32, 400)], True)
    finally:
        os.close(fd)
        os.close(bad)
    assert got[0][0] != 0 and got[1][0] == -errno.EISDIR
    assert got[2] == (0, reference.crc32c(src[8:72]))
    assert all(buf[400 + i * 32:416 + i * 32] == src[8 + 16 * i:24 + 16 * i] for i in range(4))
    with pytest.raises(CorruptCheckpoint):
        _native.raise_status(got[0][0], str(path), "tensor 'x'")
    with pytest.raises(CheckpointOSError):
        _native.raise_status(got[1][0], str(path), "tensor 'x'")
    _native.raise_status(0, str(path))                     # nothing to raise


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread niceness is Linux's")
def test_io_threads_run_at_the_niceness_asked_for(tmp_path):
    import threading

    from kvstore import payload

    def nice_of_this_thread():
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    def read_ahead_nice(tmp):
        """The niceness of the thread a read-ahead ask runs on (host.prefetch)."""
        seen = []
        ahead = host._prefetch
        real, ahead.sendfile = ahead.sendfile, lambda out, fd, off, n: seen.append(nice_of_this_thread()) or n
        try:
            fd = os.open(tmp, os.O_RDONLY)
            try:
                assert host.prefetch(fd, 0, 10)
            finally:
                os.close(fd)
            for _ in range(200):
                if seen:
                    break
                time.sleep(0.01)
        finally:
            ahead.sendfile = real
        return seen[0]

    base = os.getpriority(os.PRIO_PROCESS, 0)
    tmp = os.path.join(tmp_path, "f")
    with open(tmp, "wb") as f:
        f.write(b"x" * 10)
    try:
        payload.set_io_priority(min(19, base + 7))
        assert payload.io_pool().submit(nice_of_this_thread).result() == min(19, base + 7)
        if isinstance(host._prefetch, host.ReadThrough):             # the read-ahead's threads too
            assert read_ahead_nice(tmp) == min(19, base + 7)
    finally:
        payload.set_io_priority(0)
    # Replaced threads start afresh at the process's own niceness.
    assert payload.io_pool().submit(nice_of_this_thread).result() == base
    if isinstance(host._prefetch, host.ReadThrough):
        assert read_ahead_nice(tmp) == base
    with pytest.raises(ValueError, match="20"):
        payload.set_io_priority(20)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread niceness is Linux's")
def test_lowering_one_threads_priority_leaves_the_others():
    import threading

    from kvstore import payload

    seen = {}

    def worker():
        seen["ok"] = payload.lower_thread_priority(11)
        seen["nice"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    base = os.getpriority(os.PRIO_PROCESS, 0)
    assert seen == {"ok": True, "nice": max(11, base)} or base > 11
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == base
    assert payload.lower_thread_priority(0) is False


def test_copy_runs_lands_every_run_and_refuses_runs_that_do_not_fit():
    # A sealed chain's rows, decrypted in a scratch chunk, copied to their places.
    src = bytes(range(256)) * 4
    dst = bytearray(b"\xee" * 2000)
    _native.copy_runs(dst, 7, src, 3, 10, 5, 100)
    for r in range(5):
        assert dst[7 + 100 * r:17 + 100 * r] == src[3 + 10 * r:13 + 10 * r]
        assert dst[17 + 100 * r:7 + 100 * (r + 1)] == b"\xee" * 90
    _native.copy_runs(dst, 0, src, 0, 0, 5, 1)                 # nothing to copy
    with pytest.raises(ValueError, match="do not fit"):
        _native.copy_runs(dst, 1900, src, 0, 10, 2, 100)        # the second run passes dst
    with pytest.raises(ValueError, match="do not fit"):
        _native.copy_runs(dst, 0, src, 0, 10, 2, 5)             # runs that overlap
    with pytest.raises(ValueError, match="pass a source"):
        _native.copy_runs(dst, 0, src, 1000, 10, 3, 10)
    with pytest.raises(ValueError, match="pass a source"):
        _native.copy_runs(dst, 0, src, 2000, 1, 1, 1)


@pytest.mark.parametrize("layout", ["whole", "chain"])
def test_a_saves_bytes_are_written_by_the_io_threads(tmp_path, monkeypatch, layout):
    import threading

    from kvstore import sources
    seen = []
    for name in ("pwrite_from", "pwrite_pieces"):
        real = getattr(sources.FdSource, name)

        def record(self, bufs, offset, path=None, real=real, name=name):
            n = memoryview(bufs).nbytes if name == "pwrite_from" else sum(memoryview(b).nbytes for b in bufs)
            seen.append((n, threading.current_thread().name))
            return real(self, bufs, offset, path)
        monkeypatch.setattr(sources.FdSource, name, record)
    real_blocks = sources.FdSource.pwrite_blocks

    def record_blocks(self, blocks, path=None, crc=True):
        seen.append((sum(memoryview(b).nbytes for _, bufs in blocks for b in bufs), threading.current_thread().name))
        return real_blocks(self, blocks, path, crc)
    monkeypatch.setattr(sources.FdSource, "pwrite_blocks", record_blocks)
    rng = np.random.default_rng(3)
    tensors = {"k": rng.standard_normal((2, 600, 64)).astype(np.float32),
               "v": rng.standard_normal((2, 600, 64)).astype(np.float32)}
    with make_store(tmp_path / "d", layout=layout) as s:
        entry = s.save("t" * 600, np.arange(600), tensors, positional={"k": 1, "v": 1})
        assert entry is not None
        got = s.load(s.find("t" * 600))
        assert all(np.array_equal(got.tensors[k], tensors[k]) for k in tensors)
    bulk = [name for n, name in seen if n >= 64 << 10]
    assert bulk and all(name.startswith("kvstore-io") for name in bulk), seen
