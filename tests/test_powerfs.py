"""The power-loss filesystem (tests/powerfs.py) keeps what a disk keeps, and no more."""

import errno
import os

import pytest

from powerfs import fuse_unavailable, mounted

pytestmark = pytest.mark.skipif(fuse_unavailable() is not None, reason=f"no FUSE mount: {fuse_unavailable()}")


@pytest.fixture(scope="module")
def fs(tmp_path_factory):
    with mounted(tmp_path_factory.mktemp("powerfs")) as fs:
        yield fs


def write(path, data, sync_file=True):
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        os.write(fd, data)
        if sync_file:
            os.fsync(fd)
    finally:
        os.close(fd)


def sync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read(path):
    with open(path, "rb") as f:
        return f.read()


def test_a_synced_file_and_name_survive(fs, tmp_path):
    fs.reset()
    write(os.path.join(fs.mount, "a"), b"x" * 10000)
    sync_dir(fs.mount)
    for mode in ("synced", "reorder"):
        fs.survive(tmp_path / mode, mode, seed=1)
        assert read(tmp_path / mode / "a") == b"x" * 10000


def test_an_unsynced_write_does_not_survive(fs, tmp_path):
    seed = tmp_path / "seed"
    seed.mkdir()
    (seed / "a").write_bytes(b"old" * 2000)
    fs.reset(seed)
    fd = os.open(os.path.join(fs.mount, "a"), os.O_WRONLY)
    os.pwrite(fd, b"new" * 2000, 0)
    os.close(fd)
    assert read(os.path.join(fs.mount, "a")) == b"new" * 2000          # the live file has it
    fs.survive(tmp_path / "after", "synced", seed=1)
    assert read(tmp_path / "after" / "a") == b"old" * 2000


def test_a_new_file_without_a_directory_sync_is_gone(fs, tmp_path):
    fs.reset()
    write(os.path.join(fs.mount, "a"), b"data")                         # the file synced, not its name
    fs.survive(tmp_path / "after", "synced", seed=1)
    assert os.listdir(tmp_path / "after") == []


def test_a_rename_without_a_directory_sync_may_be_undone(fs, tmp_path):
    seed = tmp_path / "seed"
    seed.mkdir()
    (seed / "a").write_bytes(b"old")
    outcomes = set()
    for s in range(16):
        fs.reset(seed)
        write(os.path.join(fs.mount, "a.tmp"), b"new")
        os.rename(os.path.join(fs.mount, "a.tmp"), os.path.join(fs.mount, "a"))
        dest = tmp_path / f"reorder-{s}"
        fs.survive(dest, "reorder", seed=s)
        outcomes.add((read(dest / "a"), tuple(sorted(os.listdir(dest)))))
        if s == 0:
            fs.survive(tmp_path / "synced", "synced", seed=s)
            assert sorted(os.listdir(tmp_path / "synced")) == ["a"]
            assert read(tmp_path / "synced" / "a") == b"old"
    # The rename either happened whole or not at all: never a torn "a".
    assert {o[0] for o in outcomes} == {b"old", b"new"}


def test_a_synced_rename_survives(fs, tmp_path):
    seed = tmp_path / "seed"
    seed.mkdir()
    (seed / "a").write_bytes(b"old")
    fs.reset(seed)
    write(os.path.join(fs.mount, "a.tmp"), b"new")
    os.rename(os.path.join(fs.mount, "a.tmp"), os.path.join(fs.mount, "a"))
    sync_dir(fs.mount)
    for s in range(4):
        fs.survive(tmp_path / str(s), "reorder", seed=s)
        assert os.listdir(tmp_path / str(s)) == ["a"] and read(tmp_path / str(s) / "a") == b"new"


def test_an_unlink_without_a_directory_sync_may_be_undone(fs, tmp_path):
    seed = tmp_path / "seed"
    seed.mkdir()
    (seed / "a").write_bytes(b"keep me")
    fs.reset(seed)
    os.unlink(os.path.join(fs.mount, "a"))
    fs.survive(tmp_path / "after", "synced", seed=1)
    assert read(tmp_path / "after" / "a") == b"keep me"


def test_reorder_keeps_a_random_part_of_the_pending_pages(fs, tmp_path):
    seed = tmp_path / "seed"
    seed.mkdir()
    (seed / "a").write_bytes(b"\0" * 8 * 4096)
    kept = set()
    for s in range(8):
        fs.reset(seed)
        fd = os.open(os.path.join(fs.mount, "a"), os.O_WRONLY)
        os.pwrite(fd, b"\xff" * 8 * 4096, 0)
        os.close(fd)
        fs.survive(tmp_path / str(s), "reorder", seed=s)
        data = read(tmp_path / str(s) / "a")
        pages = tuple(data[i * 4096] for i in range(8))
        assert all(data[i * 4096:(i + 1) * 4096] in (b"\0" * 4096, b"\xff" * 4096) for i in range(8))
        kept.add(sum(p == 0xFF for p in pages))
    assert len(kept) > 1 and max(kept) > 0                 # some pages, not all or nothing every time


def test_the_cut_freezes_the_mount(fs, tmp_path):
    fs.reset()
    fs.arm(3)                                 # create, write, fsync: then the power goes
    write(os.path.join(fs.mount, "a"), b"data")
    with pytest.raises(OSError) as e:
        write(os.path.join(fs.mount, "b"), b"more")
    assert e.value.errno == errno.EIO
    assert fs.state()["frozen"]
    fs.survive(tmp_path / "after", "synced", seed=1)
    assert os.listdir(tmp_path / "after") == []          # a's name was never synced


def barrier(path, data=None):
    """fdatasync of a file (written first, when data is given) or a directory: a barrier on a mount with barriers."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600) if data is not None else os.open(path, os.O_RDONLY)
    try:
        if data is not None:
            os.write(fd, data)
        os.fdatasync(fd)
    finally:
        os.close(fd)


def tree(d):
    return {n: read(os.path.join(d, n)) for n in sorted(os.listdir(d))}


def test_barriers_keep_a_prefix_of_their_epochs(fs, tmp_path):
    """With barriers, an fdatasync orders and does not flush: what survives
    is a prefix of the barriers, in their order, never a later one without
    an earlier one (a name without its data, b without a)."""
    prefixes = [{}, {}, {"a": b"A" * 5000}, {"a": b"A" * 5000}, {"a": b"A" * 5000, "b": b"B" * 300}]
    seen = set()
    for s in range(24):
        fs.reset(barriers=True)
        barrier(os.path.join(fs.mount, "a"), b"A" * 5000)       # epoch 1: a's data
        barrier(fs.mount)                                       # epoch 2: the name a
        barrier(os.path.join(fs.mount, "b"), b"B" * 300)        # epoch 3: b's data
        barrier(fs.mount)                                       # epoch 4: the name b
        fs.survive(tmp_path / f"synced-{s}", "synced", seed=s)
        assert os.listdir(tmp_path / f"synced-{s}") == []       # nothing flushed
        kept = fs.survive(tmp_path / f"barrier-{s}", "barrier", seed=s)
        assert kept["epochs_pending"] == 4
        got = tree(tmp_path / f"barrier-{s}")
        assert got == prefixes[kept["epochs_kept"]], (kept, got)
        seen.add(kept["epochs_kept"])
    assert len(seen) >= 3                                      # the prefix is drawn, not fixed


def test_a_full_flush_makes_every_barrier_durable(fs, tmp_path):
    fs.reset(barriers=True)
    barrier(os.path.join(fs.mount, "a"), b"A" * 5000)
    barrier(fs.mount)
    write(os.path.join(fs.mount, "b"), b"B" * 300)             # fsync: the full flush
    sync_dir(fs.mount)
    for mode in ("synced", "barrier"):
        fs.survive(tmp_path / mode, mode, seed=1)
        assert tree(tmp_path / mode) == {"a": b"A" * 5000, "b": b"B" * 300}


def test_without_barriers_an_fdatasync_is_durable(fs, tmp_path):
    fs.reset()
    barrier(os.path.join(fs.mount, "a"), b"A" * 5000)
    barrier(fs.mount)
    fs.survive(tmp_path / "after", "synced", seed=1)
    assert tree(tmp_path / "after") == {"a": b"A" * 5000}
