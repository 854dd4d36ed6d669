"""kvstore.host: the calls that differ between Linux and macOS, each branch
run here (the macOS ones with the system call injected), and their users."""

import os
import types

import numpy as np
import pytest

from kvstore import Options, host
from kvstore.payload import chains
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
    want = host.prefetch_macos if host.MACOS else host.prefetch_posix
    assert host._choose_prefetch() is want
    path = tmp_path / "f"
    path.write_bytes(b"x" * 65536)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert host.prefetch(fd, 0, 65536) is True
        assert host.prefetch(fd, 0, 0) is False          # nothing to ask for
    finally:
        os.close(fd)
    assert host.prefetch_none(0, 0, 10) is False


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
    return asked


def test_the_prefetcher_stays_a_window_ahead_of_the_blocks_queued(monkeypatch):
    asked = _asked(monkeypatch)
    ahead = chains.Prefetcher(_layout([10] * 8, [False] * 7 + [True], snapshots=False), limit=30)
    ahead.advance(0)
    assert asked == [(100, 0, 10), (101, 0, 10), (102, 0, 10)]          # 30 bytes from block 0 on
    ahead.advance(1)
    assert asked[3:] == [(103, 0, 10)]
    ahead.advance(1)
    assert len(asked) == 4                                             # nothing asked twice
    for i in range(2, 8):
        ahead.advance(i)
        assert asked[-1][0] == 100 + min(7, i + 2)                      # always the window ahead
    assert [fd for fd, _, _ in asked] == list(range(100, 108))          # each block once
    # A block larger than the window is still asked for when its turn comes.
    asked.clear()
    ahead = chains.Prefetcher(_layout([50, 10], [False, True], snapshots=False), limit=30)
    ahead.advance(0)
    assert asked == [(100, 0, 50)]


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


@pytest.mark.parametrize("into", ["numpy", "mlx"])
def test_a_chain_load_asks_for_every_block_whole_and_loads_the_same(tmp_path, monkeypatch, into):
    if into == "mlx":
        pytest.importorskip("mlx.core")
    asked = []
    real = host.prefetch
    monkeypatch.setattr(host, "prefetch", lambda fd, off, n: asked.append((os.fstat(fd).st_size, off, n))
                        or real(fd, off, n))
    rng = np.random.default_rng(1)
    k = rng.standard_normal((1, 2, 64, 8)).astype(np.float32)
    with make_store(tmp_path / "kv", layout="chain", block_tokens=16, options=Options(min_tokens=1)) as s:
        e = s.save(b"p" * 64, list(range(64)), {"k": k}, positional={"k": 2}, text_offsets=lambda i: i)
        assert e is not None
        ck = s.load(s.find(b"p" * 64), into=into)
    assert ck is not None and np.array_equal(np.array(ck.tensors["k"]), k)
    # Four blocks, each asked for once, whole.
    assert len(asked) == 4 and all(off == 0 and n == size for size, off, n in asked), asked
