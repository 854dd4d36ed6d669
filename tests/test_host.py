"""kvstore.host: the calls that differ between Linux and macOS, each branch
run here (the macOS ones with the system call injected), and their users."""

import os
import types

import numpy as np
import pytest

from kvstore import host
from kvstore.payload import batch as batches, chains
from kvhelpers import make_store


# ---- prefetch ---------------------------------------------------------------------

def test_prefetch_on_macos_asks_f_rdadvise_with_a_radvisory_per_gib():
    calls = []
    ok = host.prefetch_macos(7, 4096, (5 << 29) + 10, fcntl_call=lambda *a: calls.append(a))
    assert ok
    # struct radvisory {off_t ra_offset; int ra_count;}: 16 bytes, in parts of at most 1 GiB.
    assert [(fd, cmd) for fd, cmd, _ in calls] == [(7, host.F_RDADVISE)] * 3
    assert all(len(arg) == 16 for _, _, arg in calls)
    parts = [host.RADVISORY.unpack(arg) for _, _, arg in calls]
    assert parts == [(4096, 1 << 30), (4096 + (1 << 30), 1 << 30), (4096 + (2 << 30), (1 << 29) + 10)]


def test_prefetch_on_macos_says_false_when_fcntl_fails():
    def refuse(*a):
        raise OSError(22, "Invalid argument")
    assert host.prefetch_macos(3, 0, 100, fcntl_call=refuse) is False


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="no posix_fadvise on this platform")
def test_prefetch_on_linux_asks_posix_fadvise_willneed(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(os, "posix_fadvise", lambda *a: calls.append(a))
    assert host.prefetch_posix(5, 10, 20)
    assert calls == [(5, 10, 20, os.POSIX_FADV_WILLNEED)]


def test_prefetch_picks_this_platforms_call_and_works_on_a_real_file(tmp_path):
    if host.LINUX:
        assert isinstance(host._prefetch, host.ReadThrough)
    else:
        assert host._prefetch is (host.prefetch_macos if host.MACOS else host.prefetch_posix)
    path = tmp_path / "f"
    path.write_bytes(b"x" * 65536)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert host.prefetch(fd, 0, 65536) is True
        assert host.prefetch(fd, 0, 0) is False          # nothing to ask for
    finally:
        os.close(fd)
    assert host.prefetch_none(0, 0, 10) is False


def _evicted_file(path, size, whole_cache=False):
    """A file of size random bytes, written, synced and dropped from the
    page cache; skips the test where the kernel keeps it cached.

    Args:
        whole_cache: drop the whole page cache (root only), as after a
            restart: a file dropped on its own (POSIX_FADV_DONTNEED) is
            read back in small folios whatever reads it (seen on 6.18).
    """
    path.write_bytes(os.urandom(size))
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    if whole_cache:
        try:
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("1")
        except OSError:
            os.close(fd)
            pytest.skip("dropping the page cache needs root")
        return fd               # not checked: a RWF_NOWAIT read of a missing page starts a small read-ahead
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    if any(host.cached_linux(fd, off) for off in range(0, size, 1 << 20)):
        os.close(fd)
        pytest.skip("the kernel kept the file cached after POSIX_FADV_DONTNEED")
    return fd


def _drain(read_through):
    pool = read_through._pool.take()
    if pool is not None:
        pool.shutdown(wait=True)


@pytest.mark.skipif(not (host.LINUX and hasattr(os, "RWF_NOWAIT")), reason="Linux's read-through")
def test_read_through_brings_a_range_into_the_page_cache_after_the_caller_closed_its_file(tmp_path):
    fd = _evicted_file(tmp_path / "f", 8 << 20)
    rt = host.ReadThrough()
    fds = len(os.listdir("/proc/self/fd"))
    assert rt(fd, 1 << 20, 3 << 20) is True
    os.close(fd)                              # the ask holds its own descriptor
    _drain(rt)
    assert len(os.listdir("/proc/self/fd")) <= fds          # and closed it (less the /dev/null kept open)
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        assert all(host.cached_linux(fd, off) for off in range(1 << 20, 4 << 20, 4096))
    finally:
        os.close(fd)


def test_read_through_hands_what_sendfile_could_not_read_to_the_fallback(tmp_path):
    sent, fell = [], []

    def sendfile(out, fd, off, n):
        if sent:
            raise OSError(22, "Invalid argument")
        sent.append((off, n))
        return 1000                             # a short transfer, then a refusal
    rt = host.ReadThrough(sendfile=sendfile, fallback=lambda fd, off, n: fell.append((off, n)))
    path = tmp_path / "f"
    path.write_bytes(b"x" * 5000)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert rt(fd, 100, 4000) is True
        _drain(rt)
    finally:
        os.close(fd)
    assert sent == [(100, 4000)] and fell == [(1100, 3000)]


def _large_folio_share(path):
    """The share of path's pages (all cached) that the page cache holds in
    large folios, from /proc/self/pagemap and /proc/kpageflags (COMPOUND_HEAD
    or _TAIL); None where this process cannot see page frames (not root)."""
    import ctypes
    import mmap
    import struct
    try:
        pagemap, flags = open("/proc/self/pagemap", "rb", buffering=0), open("/proc/kpageflags", "rb", buffering=0)
    except OSError:
        return None
    with pagemap, flags, open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        base = ctypes.c_char.from_buffer(m)
        addr, large, pages = ctypes.addressof(base), 0, len(m) // 4096
        for i in range(pages):
            m[i * 4096]                                     # maps the cached page, reads nothing
            pagemap.seek((addr // 4096 + i) * 8)
            entry, = struct.unpack("<Q", pagemap.read(8))
            pfn = entry & ((1 << 55) - 1)
            if not entry >> 63 or not pfn:
                del base
                m.close()
                return None
            flags.seek(pfn * 8)
            bits, = struct.unpack("<Q", flags.read(8))
            large += bool(bits & (3 << 15))
        del base
        m.close()
    return large / pages


@pytest.mark.skipif(not (host.LINUX and hasattr(os, "RWF_NOWAIT")), reason="Linux's read-through")
def test_read_through_caches_a_file_in_large_folios_as_the_files_own_reads_do(tmp_path):
    """What the read-through is for: pages asked for come in as large folios,
    which later loads copy out of faster than POSIX_FADV_WILLNEED's 4 KiB
    ones (none of those: 0% here).  Not all of them: asks read at once by
    several threads through one file's shared read-ahead state are taken
    now and then for small random reads, which the kernel reads in 4 KiB
    pages (16 MiB in 4 MiB asks on four threads: 47-98% large, 1 MiB asks
    97-98% but once 19%), so the bound is a quarter."""
    size = 16 << 20
    fd = _evicted_file(tmp_path / "f", size, whole_cache=True)
    try:
        for off in range(0, size, 1 << 20):                 # the reads' own: the control
            os.pread(fd, 1 << 20, off)
    finally:
        os.close(fd)
    share = _large_folio_share(tmp_path / "f")
    if share is None:
        pytest.skip("page frames are visible to root only")
    if share < 0.5:
        pytest.skip(f"this file system caches reads in large folios for {share:.0%} of the pages only")
    fd = _evicted_file(tmp_path / "f", size, whole_cache=True)
    rt = host.ReadThrough()
    ask = host.prefetch_ask(fd, chains.PREFETCH_ASK)             # as a chain load asks on this device
    try:
        for off in range(0, size, ask):
            rt(fd, off, min(ask, size - off))
        _drain(rt)
        assert all(host.cached_linux(fd, off) for off in range(0, size, 4096))
    finally:
        os.close(fd)
    assert _large_folio_share(tmp_path / "f") >= 0.25


# ---- a chain load asks for its blocks ahead of its reads ------------------------------

def _layout(sizes, restorable, snapshots):
    """A stand-in ChainLayout: blocks of the given file sizes, a snapshot tensor or not."""
    blocks = [(100 + i, types.SimpleNamespace(file_size=n, restorable=r))
              for i, (n, r) in enumerate(zip(sizes, restorable))]
    tensors = [types.SimpleNamespace(name="k")] + ([types.SimpleNamespace(name="window")] if snapshots else [])
    return types.SimpleNamespace(blocks=blocks, tensors=tensors, axes={"k": 2})


def _asked(monkeypatch):
    asked = []
    monkeypatch.setattr(host, "prefetch", lambda fd, off, n: asked.append((fd, off, n)) or True)
    monkeypatch.setattr(host, "_read_ahead_bytes", lambda fd: None)     # the stand-in fds have no device
    return asked


def _covered(asked):
    """{fd: [(start, end)]} of the asks, merged where they touch; fails on an overlap."""
    out = {}
    for fd, off, n in sorted(asked):
        spans = out.setdefault(fd, [])
        assert not spans or off >= spans[-1][1], f"asked twice: {fd} at {off}"
        if spans and off == spans[-1][1]:
            spans[-1] = (spans[-1][0], off + n)
        else:
            spans.append((off, off + n))
    return out


def test_the_prefetcher_stays_a_window_ahead_of_the_reads_in_parts(monkeypatch):
    asked = _asked(monkeypatch)
    ahead = chains.Prefetcher(_layout([10] * 8, [False] * 7 + [True], snapshots=False), limit=30, ask=4)
    assert [ahead.start(i) for i in (0, 1, 7)] == [0, 10, 70]
    ahead.advance(0)
    assert _covered(asked) == {100: [(0, 10)], 101: [(0, 10)], 102: [(0, 10)]}     # 30 bytes from 0
    assert max(n for _, _, n in asked) == 4                                        # in asks of 4 at most
    ahead.advance(5)                                                               # a read 5 bytes on
    assert _covered(asked)[103] == [(0, 5)]
    n = len(asked)
    ahead.advance(3)
    assert len(asked) == n                                                         # nothing asked twice
    for pos in range(10, 80, 10):
        ahead.advance(pos)
        assert max(fd * 10 + off + k for fd, off, k in asked) - 1000 == min(80, pos + 30)  # the window ahead
    assert _covered(asked) == {100 + i: [(0, 10)] for i in range(8)}               # each block once, whole
    # A block larger than the window is asked for as the reads go through it.
    asked.clear()
    ahead = chains.Prefetcher(_layout([50, 10], [False, True], snapshots=False), limit=30, ask=8)
    ahead.advance(0)
    assert _covered(asked) == {100: [(0, 30)]}
    ahead.advance(25)
    assert _covered(asked) == {100: [(0, 50)], 101: [(0, 5)]}


def test_a_chain_loads_jobs_move_the_window_to_their_place_before_they_read(tmp_path):
    # Each job of a Batch calls its pace with where it begins (the add's
    # place plus the jobs before it) before it reads; a large add is cut in
    # jobs of at most JOB_BYTES.
    data = np.arange(5 * (1 << 20), dtype=np.uint64).view(np.uint8)        # 40 MiB
    path = tmp_path / "f"
    path.write_bytes(data.tobytes())
    out = np.zeros_like(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        events = []
        batch = batches.Batch([memoryview(out)], verify=False)
        batch.pace = lambda pos: events.append(pos)
        piece = chains.Piece(fd, str(path), 0, 1 << 20, 40, 1 << 20, 0, 0, "tokens")
        batch.add([(0, piece)], pos=1000)
        batch.wait()
    finally:
        os.close(fd)
    assert np.array_equal(out, data)
    events.sort()
    assert len(events) == -(-data.nbytes // batches.JOB_BYTES) >= 3
    assert events[0] == 1000 and events[-1] < 1000 + data.nbytes
    steps = [b - a for a, b in zip(events, events[1:])]
    assert all(0 < d <= batches.JOB_BYTES for d in steps), steps


def test_the_prefetcher_leaves_earlier_restorable_blocks_of_a_chain_with_snapshots(monkeypatch):
    # An earlier turn's last block holds that turn's windows, which this load does not read.
    asked = _asked(monkeypatch)
    ahead = chains.Prefetcher(_layout([10, 10, 500, 10, 10], [False, False, True, False, True], snapshots=True),
                              limit=1000)
    ahead.advance(0)
    assert [fd for fd, _, _ in asked] == [100, 101, 103, 104]
    # Without snapshots every block is read whole.
    asked.clear()
    chains.Prefetcher(_layout([10, 10, 500, 10, 10], [False, False, True, False, True], snapshots=False),
                      limit=1000).advance(0)
    assert [fd for fd, _, _ in asked] == [100, 101, 102, 103, 104]


def test_prefetch_parts_asks_in_order_in_parts_and_stops_at_a_refusal(monkeypatch):
    asked = []
    monkeypatch.setattr(host, "prefetch", lambda fd, off, n: asked.append((off, n)) or True)
    assert host.prefetch_parts(7, 100, 350, 100) is True
    assert asked == [(100, 100), (200, 100), (300, 50)]
    asked.clear()
    assert host.prefetch_parts(7, 5, 5, 100) is True and asked == []
    monkeypatch.setattr(host, "prefetch", lambda fd, off, n: asked.append((off, n)) or off < 200)
    assert host.prefetch_parts(7, 0, 1000, 100) is False
    assert asked == [(0, 100), (100, 100), (200, 100)]       # nothing asked after the refusal


def test_an_ask_is_twice_the_devices_read_ahead_window_where_that_is_more(monkeypatch):
    asked = _asked(monkeypatch)
    windows = {3: None, 4: 128 << 10, 100: 8 << 20}
    monkeypatch.setattr(host, "_read_ahead_bytes", windows.get)
    assert host.prefetch_ask(3, 4 << 20) == 4 << 20             # not known
    assert host.prefetch_ask(4, 4 << 20) == 4 << 20             # a small window
    assert host.prefetch_ask(100, 4 << 20) == 16 << 20          # past the window: read whole
    # A chain load asks in those parts, with at least four of them ahead.
    monkeypatch.setattr(host, "cached", lambda fd, off: False)
    p = chains.Prefetcher(_layout([40 << 20], [True], snapshots=False))
    assert p.ask == 16 << 20 and p.limit == 64 << 20
    p.advance(0)
    assert asked == [(100, 0, 16 << 20), (100, 16 << 20, 16 << 20), (100, 32 << 20, 8 << 20)]


@pytest.mark.skipif(not host.LINUX, reason="sysfs is Linux's")
def test_the_read_ahead_window_of_a_real_file_is_its_devices(tmp_path):
    with open(tmp_path / "f", "wb") as f:
        got = host.read_ahead_bytes_linux(f.fileno())
    if got is None:
        pytest.skip("this file's device has no read-ahead window in sysfs (a tmpfs, an overlay)")
    assert got >= 0 and got % 1024 == 0
    assert host.read_ahead_bytes_linux(10 ** 6) is None          # not a descriptor


@pytest.mark.parametrize("into", ["numpy", "mlx"])
def test_a_cold_chain_load_asks_for_every_block_whole_and_loads_the_same(tmp_path, monkeypatch, into):
    if into == "mlx":
        pytest.importorskip("mlx.core")
    monkeypatch.setattr(host, "cached", lambda fd, off: False)         # as after a restart
    asked = []
    real = host.prefetch
    sizes = {}

    def ask(fd, off, n):
        st = os.fstat(fd)
        sizes[st.st_ino] = st.st_size
        asked.append((st.st_ino, off, n))
        return real(fd, off, n)
    monkeypatch.setattr(host, "prefetch", ask)
    rng = np.random.default_rng(1)
    k = rng.standard_normal((1, 2, 64, 8)).astype(np.float32)
    with make_store(tmp_path / "kv", layout="chain", block_tokens=16, min_tokens=1) as s:
        e = s.save(b"p" * 64, list(range(64)), {"k": k}, positional={"k": 2}, text_offsets=lambda i: i)
        assert e is not None
        ck = s.load(s.find(b"p" * 64), into=into)
    assert ck is not None and np.array_equal(np.array(ck.tensors["k"]), k)
    # Four blocks, each asked for once, whole (the window is far larger than the chain).
    spans = _covered(asked)
    assert len(spans) == 4 and all(v == [(0, sizes[ino])] for ino, v in spans.items()), asked


# ---- thread priority ---------------------------------------------------------------

def test_lowering_a_thread_on_macos_puts_it_in_the_utility_qos_class():
    calls = []
    assert host.lower_priority_macos(19, qos_call=lambda qos, rel: calls.append((qos, rel)) or 0)
    assert calls == [(0x11, 0)]                                       # QOS_CLASS_UTILITY, not background
    assert host.lower_priority_macos(19, qos_call=lambda qos, rel: 1) is False   # refused
    assert host.lower_thread_priority(0) is False                     # 0 changes nothing anywhere


def test_lowering_a_thread_on_linux_sets_its_own_niceness():
    import threading
    calls = []
    assert host.lower_priority_linux(7, setpriority=lambda *a: calls.append(a))
    assert calls == [(os.PRIO_PROCESS, threading.get_native_id(), 7)]

    def refuse(*a):
        raise PermissionError(1, "Operation not permitted")
    assert host.lower_priority_linux(7, setpriority=refuse) is False


# ---- boot time -------------------------------------------------------------------------

def test_boot_time_on_macos_reads_kern_boottime_without_a_process():
    import ctypes
    seen = []

    def sysctlbyname(name, buf, size_p, new, newlen):
        seen.append(name)
        raw = host.TIMEVAL.pack(1_700_000_000, 250_000)
        ctypes.memmove(buf, raw, len(raw))
        size_p._obj.value = len(raw)
        return 0
    assert host.boot_time_macos(sysctlbyname) == 1_700_000_000.25
    assert seen == [b"kern.boottime"]
    assert host.boot_time_macos(lambda *a: -1) == 0.0                 # unknown, not an error


def test_boot_time_on_linux_reads_proc_stat(tmp_path):
    stat = tmp_path / "stat"
    stat.write_bytes(b"cpu  1 2 3\nbtime 1712345678\nprocesses 9\n")
    assert host.boot_time_linux(str(stat)) == 1712345678.0
    assert host.boot_time_linux(str(tmp_path / "absent")) == 0.0
    if host.LINUX:
        assert abs(host.boot_time() - host.boot_time_linux()) < 1e-9 and host.boot_time() > 0


# ---- preallocation ----------------------------------------------------------------------

def test_preallocating_on_macos_asks_contiguous_then_any_blocks_then_sets_the_size():
    import errno
    calls, sizes = [], []

    def fcntl_call(fd, cmd, arg):
        flags, mode, off, length, _ = host.FSTORE.unpack(arg)
        calls.append((fd, cmd, flags, mode, off, length))
        if flags & host.F_ALLOCATECONTIG:
            raise OSError(errno.ENOSPC, "no contiguous run")
        return arg
    assert host.preallocate_macos(9, 1 << 20, "x", fcntl_call=fcntl_call, ftruncate=lambda fd, n: sizes.append(n))
    assert calls == [(9, host.F_PREALLOCATE, host.F_ALLOCATECONTIG | host.F_ALLOCATEALL, host.F_PEOFPOSMODE, 0, 1 << 20),
                     (9, host.F_PREALLOCATE, host.F_ALLOCATEALL, host.F_PEOFPOSMODE, 0, 1 << 20)]
    assert sizes == [1 << 20]


def test_preallocating_on_macos_fails_early_on_a_full_disk_and_steps_aside_where_unsupported():
    import errno

    from kvstore.errors import CheckpointOSError

    def full(fd, cmd, arg):
        raise OSError(errno.ENOSPC, "No space left on device")
    with pytest.raises(CheckpointOSError) as e:
        host.preallocate_macos(3, 4096, "/store/a.kv", fcntl_call=full, ftruncate=lambda *a: None)
    assert e.value.errno == errno.ENOSPC and e.value.filename == "/store/a.kv"

    def unsupported(fd, cmd, arg):
        raise OSError(errno.ENOTSUP, "Operation not supported")
    assert host.preallocate_macos(3, 4096, fcntl_call=unsupported, ftruncate=lambda *a: None) is False


def test_preallocating_here_allocates_and_sizes_the_file(tmp_path):
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        # Both platforms' filesystems here (ext4, tmpfs; APFS) allocate.
        assert host.preallocate(fd, 1 << 20, "f") is True
        assert os.fstat(fd).st_size == 1 << 20
    finally:
        os.close(fd)


# ---- the choice --------------------------------------------------------------------------

def test_each_platform_gets_its_own_calls():
    mac = host._choose(macos=True, linux=False)
    assert (mac["prefetch"], mac["lower_priority"], mac["boot_time"], mac["preallocate"], mac["cache_root"]) == \
        (host.prefetch_macos, host.lower_priority_macos, host.boot_time_macos, host.preallocate_macos,
         host.cache_root_macos)
    lin = host._choose(macos=False, linux=True)
    assert isinstance(lin["prefetch"], host.ReadThrough) or not hasattr(os, "sendfile")
    assert (lin["lower_priority"], lin["boot_time"], lin["preallocate"], lin["cache_root"]) == \
        (host.lower_priority_linux, host.boot_time_linux, host.preallocate_linux, host.cache_root_linux)
    other = host._choose(macos=False, linux=False)
    assert (other["lower_priority"], other["boot_time"], other["preallocate"]) == \
        (host.lower_priority_none, host.boot_time_none, host.preallocate_none)


def test_the_default_cache_folder_is_the_platforms_and_kept_out_of_backups_on_macos():
    assert host.cache_root_linux() == os.path.join("~", ".cache", "kvstore")
    # ~/Library/Caches: Time Machine leaves it out of backups.
    assert host.cache_root_macos() == os.path.join("~", "Library", "Caches", "kvstore")
    pytest.importorskip("mlx_lm")
    from kvstore.serve import server
    assert server.DEFAULT_CACHE_ROOT == os.path.join(host.default_cache_root(), "serve")


# ---- the tests' own platform differences ------------------------------------------------

def test_the_s3_servers_sockets_fit_a_unix_socket_path_on_macos(tmp_path):
    import kvhelpers
    deep = tmp_path / ("d" * 80) / ("e" * 80)               # as long as macOS's /private/var/folders/...
    deep.mkdir(parents=True)
    server = kvhelpers.WeedServer(deep, "weed", "b")
    try:
        assert all(len(p.encode()) < kvhelpers.SOCKET_PATH_MAX for p in server.sockets)
        assert all(str(deep) not in p for p in server.sockets)
    finally:
        server.stop()
    assert not os.path.exists(server.socket_dir)


def test_folds_case_tells_a_case_folding_filesystem(tmp_path, monkeypatch):
    import kvhelpers
    assert kvhelpers.folds_case(tmp_path) is False                      # ext4, tmpfs
    # As on APFS: any case of a name finds the file.
    real = os.path.isdir
    monkeypatch.setattr(os.path, "isdir", lambda p: real(p) or real(os.path.join(os.path.dirname(p),
                                                                                  os.path.basename(p).swapcase())))
    assert kvhelpers.folds_case(tmp_path) is True
    assert os.listdir(tmp_path) == []                                  # the probe is gone


@pytest.mark.skipif(not host.LINUX, reason="RWF_NOWAIT is Linux's")
def test_cached_tells_a_cached_page_from_an_evicted_one(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(os.urandom(1 << 20))
    fd = os.open(path, os.O_RDONLY)
    try:
        assert host.cached(fd, (1 << 20) - 1) is True                  # just written
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)             # clean pages dropped
        assert host.cached(fd, (1 << 20) - 1) is False
        os.pread(fd, 4096, (1 << 20) - 4096)
        assert host.cached(fd, (1 << 20) - 1) is True
    finally:
        os.close(fd)
    assert host.cached_unknown(0, 0) is None


def test_a_cached_block_is_not_asked_for(monkeypatch):
    asked = _asked(monkeypatch)
    monkeypatch.setattr(host, "cached", lambda fd, off: fd == 101)     # block 1 is warm
    chains.Prefetcher(_layout([10, 10, 10], [False, False, True], snapshots=False), limit=100).advance(0)
    assert [fd for fd, _, _ in asked] == [100, 102]
    # A warm block larger than the window: its later parts are not asked for either.
    asked.clear()
    ahead = chains.Prefetcher(_layout([10, 50, 10], [False, False, True], snapshots=False), limit=30)
    for pos in range(0, 70, 5):
        ahead.advance(pos)
    assert _covered(asked) == {100: [(0, 10)], 102: [(0, 10)]}
