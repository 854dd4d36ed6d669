"""Durable writes: one function picks the sync primitive (F_FULLFSYNC on macOS, fsync
elsewhere), every durable path goes through it, and stats say which one is in use."""

import ast
import errno
import fcntl
import json
import os
import pathlib
import re
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import kvstore
from kvstore import files
from kvstore.format import read_entry

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("platform,expect", [("darwin", "F_FULLFSYNC"), ("linux", "fsync"),
                                             ("freebsd14", "fsync")])
def test_the_primitive_is_chosen_by_platform(platform, expect):
    assert files.sync_primitive(platform) == expect


def test_this_platform_uses_its_primitive():
    assert files.SYNC_PRIMITIVE == files.sync_primitive(sys.platform)
    assert files.SYNC_PRIMITIVE == ("F_FULLFSYNC" if sys.platform == "darwin" else "fsync")


def test_fullfsync_where_the_platform_has_it_else_fsync(tmp_path):
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.write(fd, b"x")
        before = files.sync_fallbacks()
        got = files.sync_fd(fd, primitive="F_FULLFSYNC")
        if hasattr(fcntl, "F_FULLFSYNC"):
            assert got in ("F_FULLFSYNC", "fsync")       # fsync where this filesystem refuses it
        else:
            assert got == "fsync"
            assert files.sync_fallbacks() == before + 1
    finally:
        os.close(fd)


def test_a_refused_fullfsync_falls_back_to_fsync(tmp_path, monkeypatch):
    # An fcntl command the kernel does not know fails with EINVAL, as
    # F_FULLFSYNC does on filesystems that refuse it: the sync still happens.
    monkeypatch.setattr(fcntl, "F_FULLFSYNC", 0x7FFF, raising=False)
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        with pytest.raises(OSError) as e:
            fcntl.fcntl(fd, 0x7FFF)
        assert e.value.errno in (errno.EINVAL, errno.ENOTTY)
        before = files.sync_fallbacks()
        assert files.sync_fd(fd, primitive="F_FULLFSYNC") == "fsync"
        assert files.sync_fallbacks() == before + 1
    finally:
        os.close(fd)


def test_other_errors_are_not_hidden(tmp_path, monkeypatch):
    monkeypatch.setattr(fcntl, "F_FULLFSYNC", 0x7FFF, raising=False)
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    os.close(fd)
    with pytest.raises(OSError) as e:
        files.sync_fd(fd, primitive="F_FULLFSYNC")       # a closed descriptor
    assert e.value.errno == errno.EBADF


@pytest.mark.skipif(not hasattr(os, "fdatasync"), reason="no fdatasync on this platform")
def test_data_only_uses_fdatasync_outside_macos(tmp_path):
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        assert files.sync_fd(fd, data_only=True, primitive="fsync") == "fdatasync"
        assert files.sync_fd(fd, primitive="fsync") == "fsync"
    finally:
        os.close(fd)


def _sync_calls(tree):
    """(line, what) of every direct sync call in a module's AST."""
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
        if name in ("fsync", "fdatasync", "sync"):
            out.append((node.lineno, name))
        if name == "fcntl" and any("FULLFSYNC" in ast.dump(a) for a in node.args):
            out.append((node.lineno, "F_FULLFSYNC"))
    return out


def test_every_durable_path_goes_through_sync_fd():
    stray = []
    for path in sorted((ROOT / "kvstore").rglob("*.py")):
        tree = ast.parse(path.read_text())
        allowed = set()
        if path.name == "files.py":
            fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "sync_fd")
            allowed = {line for line, _ in _sync_calls(fn)}
        stray += [f"{path.relative_to(ROOT)}:{line} calls {what}" for line, what in _sync_calls(tree)
                  if line not in allowed]
    for path in sorted((ROOT / "csrc").glob("*.[ch]")):
        for i, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("//")[0]
            if re.search(r"\b(fsync|fdatasync|F_FULLFSYNC)\s*\(", code) and not code.lstrip().startswith("*"):
                stray.append(f"{path.relative_to(ROOT)}:{i} calls a sync")
    assert not stray, "syncs outside kvstore.files.sync_fd:\n" + "\n".join(stray)


def test_a_durable_save_syncs_file_and_directory_through_sync_fd(tmp_path, monkeypatch):
    calls = []
    real = files.sync_fd

    def spy(fd, data_only=False, primitive=None):
        calls.append(os.path.basename(os.readlink(f"/proc/self/fd/{fd}")) if os.path.exists("/proc/self/fd")
                     else fd)
        return real(fd, data_only, primitive)
    monkeypatch.setattr(files, "sync_fd", spy)
    ts = {"k": np.arange(64, dtype=np.float16)}
    with kvstore.KVStore(tmp_path / "d", min_tokens=1) as store:
        e = store.save("durable text", [1, 2, 3], ts)
        assert store.stats()["sync"] == files.SYNC_PRIMITIVE
    # The directory made for the store (in its parent), the new file, then the directory.
    assert len(calls) == 3
    if os.path.exists("/proc/self/fd"):
        assert calls[0] == tmp_path.name and calls[1].startswith(e.name + ".tmp.") and calls[2] == "d"
    calls.clear()
    with kvstore.KVStore(tmp_path / "n", min_tokens=1, durable=False) as store:
        store.save("not durable", [1, 2, 3], ts)
        assert store.stats()["sync"] == "none"
    assert calls == []


def test_kvstore_stats_names_the_primitive(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    out = subprocess.run([sys.executable, "-m", "kvstore", "stats", str(d), "--json"], capture_output=True,
                         text=True, check=True, cwd=tmp_path).stdout
    assert json.loads(out)["sync"] == files.SYNC_PRIMITIVE
    out = subprocess.run([sys.executable, "-m", "kvstore", "stats", str(d)], capture_output=True,
                         text=True, check=True, cwd=tmp_path).stdout
    assert re.search(rf"^sync\s+{files.SYNC_PRIMITIVE} ", out, re.M)


def test_a_durable_chained_save_syncs_blocks_while_writing_and_links_them_in_order(tmp_path, monkeypatch):
    """The data of a chained save's first block is synced while the later
    blocks are still being written (the disk and the CPU work at once), yet
    each block is linked into place only after its own data sync returned
    and after the directory sync that made its parent's link durable."""
    from kvstore import publish
    d = tmp_path / "d"
    events, lock, waited = [], threading.Lock(), []
    real_sync, real_link, real_rename = files.sync_fd, os.link, os.rename
    n_blocks = 5

    def log(*ev):
        with lock:
            events.append(ev)

    def temps_now():
        return sorted(p for p in os.listdir(d) if ".kv.tmp." in p)

    def spy_sync(fd, data_only=False, primitive=None):
        name = os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))
        with lock:
            first = ".kv.tmp." in name and not waited
            waited.append(name)
        if first:
            # The first block's sync starts before the last block is written,
            # and waits, up to 10 s, for the last block's temporary file: it
            # comes only if writing goes on meanwhile.
            log("first_sync_before_last_staged", len(temps_now()) < n_blocks)
            deadline = time.monotonic() + 10
            while len(temps_now()) < n_blocks and time.monotonic() < deadline:
                time.sleep(0.005)
            log("all_staged_during_first_sync", len(temps_now()) == n_blocks)
        r = real_sync(fd, data_only, primitive)
        log("sync", name.split(".tmp.")[0] if ".kv.tmp." in name else "dir:" + name)
        return r

    def spy_link(src, dst, *a, **kw):
        log("link", os.path.basename(os.fspath(dst)))
        return real_link(src, dst, *a, **kw)

    def spy_rename(src, dst, *a, **kw):
        log("link", os.path.basename(os.fspath(dst)))
        return real_rename(src, dst, *a, **kw)

    if not os.path.exists("/proc/self/fd"):
        pytest.skip("names a descriptor's file through /proc/self/fd")
    ids = np.arange(n_blocks * 4, dtype=np.uint32)
    text = b"".join(f"t{i} ".encode() for i in ids)
    offsets = [0] + [sum(len(f"t{j} ") for j in range(i + 1)) for i in range(ids.size)]
    kv = {"k": np.repeat(ids[None, None, :, None], 8, axis=3).astype(np.float16)}
    with kvstore.KVStore(d, min_tokens=1, block_tokens=4) as store:
        assert store.settings.layout == "chain" and store.settings.durable
        monkeypatch.setattr(files, "sync_fd", spy_sync)
        monkeypatch.setattr(publish.os, "link", spy_link)
        monkeypatch.setattr(publish.os, "rename", spy_rename)
        last = store.save(text, ids, kv, positional={"k": 2}, text_offsets=offsets)
        monkeypatch.undo()
        assert last is not None and last.tokens == ids.size
    assert ("first_sync_before_last_staged", True) in events, events
    assert ("all_staged_during_first_sync", True) in events, events
    links = [i for i, e in enumerate(events) if e[0] == "link"]
    assert len(links) == n_blocks
    linked = [events[i][1] for i in links]
    for k, i in enumerate(links):
        # Its own data sync returned before its link ...
        assert ("sync", linked[k]) in events[:i], (linked[k], events)
        # ... and the directory was synced between the previous link and this one.
        if k:
            between = events[links[k - 1] + 1:i]
            assert ("sync", "dir:d") in between, (k, events)
    assert events[-1] == ("sync", "dir:d")
    # Parent first: each block names the one linked before it.
    parents = [read_entry(str(d / name)).parent for name in linked]
    assert parents == [""] + [name[:-3] for name in linked[:-1]]


@pytest.mark.parametrize("platform,expect", [("darwin", "F_BARRIERFSYNC"), ("linux", "fsync")])
def test_the_steps_of_a_save_are_barriers_on_macos(platform, expect):
    assert files.step_primitive(platform) == expect
    assert files.STEP_PRIMITIVE == files.step_primitive(sys.platform)


def test_a_refused_barrier_is_a_full_flush(tmp_path, monkeypatch):
    calls = []

    def fake_fcntl(fd, op, *a):
        calls.append(op)
        if op == 85:
            raise OSError(errno.ENOTSUP, "Operation not supported")
        return 0
    monkeypatch.setattr(fcntl, "F_BARRIERFSYNC", 85, raising=False)
    monkeypatch.setattr(fcntl, "F_FULLFSYNC", 51, raising=False)
    monkeypatch.setattr(fcntl, "fcntl", fake_fcntl)
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        assert files.sync_fd(fd, primitive="F_BARRIERFSYNC") == "F_FULLFSYNC"
    finally:
        os.close(fd)
    assert calls == [85, 51]


def test_a_durable_chained_save_on_macos_orders_its_steps_and_flushes_once(tmp_path, monkeypatch):
    """macOS's sequence, run here with fcntl recorded: each block's data and
    each link a barrier, in the chain's order, and one full flush, the
    save's last step (docs/semantics.md §11)."""
    if not os.path.exists("/proc/self/fd"):
        pytest.skip("names a descriptor's file through /proc/self/fd")
    from kvstore import publish
    events = []
    monkeypatch.setattr(fcntl, "F_BARRIERFSYNC", 85, raising=False)
    monkeypatch.setattr(fcntl, "F_FULLFSYNC", 51, raising=False)

    def fake_fcntl(fd, op, *a):
        name = os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))
        events.append(({85: "barrier", 51: "flush"}[op], name.split(".tmp.")[0] if ".kv.tmp." in name
                       else "dir:" + name))
        return 0

    def spy_link(src, dst, *a, **kw):
        events.append(("link", os.path.basename(os.fspath(dst))))
        return real_link(src, dst, *a, **kw)
    real_link = os.link
    d = tmp_path / "d"
    n_blocks = 5
    ids = np.arange(n_blocks * 4, dtype=np.uint32)
    text = b"".join(f"t{i} ".encode() for i in ids)
    offsets = [0] + [sum(len(f"t{j} ") for j in range(i + 1)) for i in range(ids.size)]
    kv = {"k": np.repeat(ids[None, None, :, None], 8, axis=3).astype(np.float16)}
    with kvstore.KVStore(d, min_tokens=1, block_tokens=4) as store:
        monkeypatch.setattr(files, "SYNC_PRIMITIVE", "F_FULLFSYNC")
        monkeypatch.setattr(files, "STEP_PRIMITIVE", "F_BARRIERFSYNC")
        monkeypatch.setattr(fcntl, "fcntl", fake_fcntl)
        monkeypatch.setattr(publish.os, "link", spy_link)
        last = store.save(text, ids, kv, positional={"k": 2}, text_offsets=offsets)
        monkeypatch.undo()
        assert last is not None and last.tokens == ids.size
    links = [i for i, e in enumerate(events) if e[0] == "link"]
    assert len(links) == n_blocks
    linked = [events[i][1] for i in links]
    for k, i in enumerate(links):
        assert ("barrier", linked[k]) in events[:i], events          # its data ordered before its link
        if k:
            assert ("barrier", "dir:d") in events[links[k - 1] + 1:i], events   # the parent's link before it
    # One full flush, of the directory, after the last link: the save's end.
    assert [e for e in events if e[0] == "flush"] == [("flush", "dir:d")] and events[-1] == ("flush", "dir:d")
