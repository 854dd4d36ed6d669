"""The directory's cumulative counters (docs/semantics.md §15): <dir>/.counters.

Every process using a directory adds to the same counters, across restarts;
`kvstore stats --json` reads them from another process.  The file is
best-effort and never fails a save or a load: garbage, a truncated file, a
planted symlink, a directory in its place or a read-only directory are each
one log line, and counting resumes where it can.
"""

import json
import logging
import math
import multiprocessing
import os
import shutil
import stat
import struct
import subprocess
import sys
import tempfile

import numpy as np
import pytest

from kvstore import counters
from kvstore.counters import BUCKETS, COUNTER_NAMES, COUNTERS_NAME, FILE_SIZE, HISTOGRAMS, SLOTS
from kvstore.format import Reason
import kvhelpers
from kvhelpers import CTX, checkpoint_files, drop_root, flip, make_store, make_tensors

TEXT = "a system prompt and a user turn"
PROMPT = TEXT + ", and the rest of the request"


def tensors(seed=0):
    return make_tensors(64, seed, dtypes=("float16", "float16"))


def counters_path(store_or_dir):
    d = store_or_dir.path if hasattr(store_or_dir, "path") else os.fspath(store_or_dir)
    return os.path.join(d, COUNTERS_NAME)


def zeros():
    return counters.describe([0] * len(SLOTS))


def slots_on_disk(path):
    """(magic, version, slot count, {name: value}) of a counters file."""
    raw = open(path, "rb").read()
    magic, version, count = struct.unpack_from("<4sHH", raw)
    values = struct.unpack_from(f"<{count}Q", raw, 8)
    return magic, version, count, dict(zip(SLOTS, values))


def plain(c):
    """The plain counters of a counters() dict."""
    return {k: c[k] for k in COUNTER_NAMES}


def json_form(c):
    """counters() as `kvstore stats --json` writes it (+Inf as a string)."""
    out = dict(c)
    for h in HISTOGRAMS:
        out[h] = dict(c[h], buckets=[["+Inf" if le == math.inf else le, n] for le, n in c[h]["buckets"]])
    return out


# ---- the layout ---------------------------------------------------------------------

def test_a_fresh_directory_starts_at_zero(tmp_path):
    assert counters.read_directory(tmp_path) == zeros()          # no file: zeros, nothing created
    assert os.listdir(tmp_path) == []
    with make_store(tmp_path / "kv") as s:
        c = s.counters()
        assert c == zeros()
        assert all(c[k] == 0 for k in COUNTER_NAMES)
        for h in HISTOGRAMS:
            assert c[h]["count"] == 0 and c[h]["sum_s"] == 0
            assert [le for le, _ in c[h]["buckets"]] == [float(b) for b in BUCKETS]
            assert c[h]["buckets"][-1][0] == float("inf")
            assert all(type(le) is float for le, _ in c[h]["buckets"])
        assert c["write_budget"] is None and s.stats()["write_budget"] is None
        st = os.lstat(counters_path(s))
        assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600


def test_file_layout_and_slot_order(store):
    e = store.save(TEXT, [1, 2, 3], tensors())
    magic, version, count, values = slots_on_disk(counters_path(store))
    assert (magic, version, count) == (b"KVCT", 1, len(SLOTS))
    assert os.path.getsize(counters_path(store)) == FILE_SIZE == 8 + 8 * len(SLOTS)
    # Append-only: the first names and their order never change.
    assert SLOTS[:10] == ("saves", "bytes_written", "loads", "bytes_read", "hits", "misses", "evictions",
                          "bytes_evicted", "corrupt", "stores_skipped_write_budget")
    assert SLOTS[10:27] == counters.histogram_slots("load_seconds")
    assert SLOTS[27:44] == counters.histogram_slots("save_seconds")
    assert SLOTS[44:47] == ("write_budget_level_bytes", "write_budget_refill_us", "write_budget_capacity_bytes")
    # Added later, after the budget's slots: the canary's (docs/semantics.md §17).
    assert SLOTS[47:] == ("canary_checks", "canary_failures")
    assert values["saves"] == 1 and values["bytes_written"] == e.file_size
    assert values["save_seconds_count"] == 1


def test_umask_does_not_widen_the_mode(tmp_path):
    old = os.umask(0)
    try:
        with make_store(tmp_path / "kv") as s:
            s.save(TEXT, [1, 2, 3], tensors())
            assert stat.S_IMODE(os.stat(counters_path(s)).st_mode) == 0o600
    finally:
        os.umask(old)


def test_a_newer_builds_longer_file_keeps_its_slots(store):
    store.save(TEXT, [1, 2, 3], tensors())
    path = counters_path(store)
    raw = bytearray(open(path, "rb").read())
    extra = struct.pack("<3Q", 11, 22, 33)                      # three slots this build does not know
    struct.pack_into("<H", raw, 6, len(SLOTS) + 3)
    with open(path, "wb") as f:
        f.write(bytes(raw) + extra)
    assert store.load(store.find(PROMPT)) is not None
    raw = open(path, "rb").read()
    assert struct.unpack_from("<H", raw, 6)[0] == len(SLOTS) + 3      # the count stays
    assert raw[-24:] == extra                                         # and their values
    assert store.counters()["loads"] == 1 and store.counters()["saves"] == 1


def test_an_older_builds_shorter_file_is_extended(store):
    path = counters_path(store)
    with open(path, "wb") as f:                                 # an older build knew 4 names
        f.write(b"KVCT" + struct.pack("<HH", 1, 4) + struct.pack("<4Q", 5, 500, 7, 700))
    c = store.counters()
    assert plain(c) == dict(plain(zeros()), saves=5, bytes_written=500, loads=7, bytes_read=700)
    e = store.save(TEXT, [1, 2, 3], tensors())
    _, _, count, values = slots_on_disk(path)
    assert count == len(SLOTS)
    assert values["saves"] == 6 and values["bytes_written"] == 500 + e.file_size and values["loads"] == 7


# ---- what is counted --------------------------------------------------------------------

def test_every_operation_counts_in_both_places(tmp_path):
    with make_store(tmp_path / "kv", budget_mb=0.2) as s:
        assert s.find("nothing stored yet") is None
        e = s.save(TEXT, [1, 2, 3], tensors())
        assert s.load(s.find(PROMPT)) is not None
        bad = s.save("to be corrupted", [1, 2, 3], tensors(1))
        flip(bad.path, bad.file_size - 10, 0x40)
        assert s.load(s.find("to be corrupted, and more")) is None
        for i in range(8):                                      # over 0.2 MiB: evictions
            s.save(f"filler {i}", [1, 2, 3], make_tensors(4096, i, dtypes=("float16", "float16")))
        st, c = s.stats(), s.counters()
        assert st["evictions"] > 0 and st["corrupt"] == 1 and st["misses"] >= 2
        # One rule for both: the process's stats and the directory's counters agree.
        assert c["saves"] == st["saves"] == 10
        assert c["bytes_written"] == st["bytes_saved"] >= e.file_size
        assert (c["loads"], c["hits"]) == (st["loads"], st["hits"]) == (1, 1)
        assert c["bytes_read"] == st["bytes_loaded"] == e.file_size
        assert c["misses"] == st["misses"]
        assert c["evictions"] == st["evictions"] and c["bytes_evicted"] == st["bytes_evicted"] > 0
        assert c["corrupt"] == st["corrupt"] == 1
        assert c["stores_skipped_write_budget"] == st["stores_skipped_write_budget"] == 0


def test_histograms_are_cumulative_and_count_every_operation(store):
    for i in range(5):
        store.save(f"{TEXT} {i}", [1, 2, 3], tensors(i))
    for i in range(3):
        assert store.load(store.find(f"{TEXT} {i} and more")) is not None
    c, st = store.counters(), store.stats()
    for h, n, total in (("save_seconds", 5, st["save_s"]), ("load_seconds", 3, st["load_s"])):
        buckets = c[h]["buckets"]
        counts = [k for _, k in buckets]
        assert counts == sorted(counts)                          # cumulative: never decreasing
        assert counts[-1] == c[h]["count"] == n
        assert [le for le, _ in buckets] == sorted(le for le, _ in buckets)
        assert c[h]["sum_s"] == pytest.approx(total, abs=n * 1e-6)
    # Each observation lands in the first bucket whose bound holds it.
    other = counters.DirectoryCounters(store.path)               # another opener of the same file
    other.add(load_seconds=0.3, save_seconds=99.0)
    other.add(load_seconds=0.005)                                # a bound is inclusive (le)
    other.close()
    c2 = store.counters()
    before = dict((le, k) for le, k in c["load_seconds"]["buckets"])
    after = dict((le, k) for le, k in c2["load_seconds"]["buckets"])
    assert after[0.25] - before[0.25] == after[0.005] - before[0.005] == 1
    assert after[0.5] - before[0.5] == 2
    save = dict((le, k) for le, k in c2["save_seconds"]["buckets"])
    assert save[10.0] == 5 and save[float("inf")] == 6 == c2["save_seconds"]["count"]
    assert c2["load_seconds"]["sum_s"] == pytest.approx(c["load_seconds"]["sum_s"] + 0.305, abs=1e-5)


def test_counts_survive_a_close_and_add_up_after_a_reopen(tmp_path):
    d = tmp_path / "kv"
    with make_store(d) as s:
        e = s.save(TEXT, [1, 2, 3], tensors())
        assert s.load(s.find(PROMPT)) is not None
    with make_store(d) as s:
        assert s.stats()["saves"] == 0                            # a new process's own stats
        c = s.counters()
        assert (c["saves"], c["loads"], c["bytes_written"]) == (1, 1, e.file_size)
        assert s.load(s.find(PROMPT)) is not None
        s.save("another text", [1, 2, 3], tensors(1))
        c = s.counters()
        assert (c["saves"], c["loads"], c["hits"]) == (2, 2, 2)
        assert c["load_seconds"]["count"] == 2 and c["save_seconds"]["count"] == 2
    assert plain(counters.read_directory(d)) == plain(c)


def test_wipe_leaves_the_counters(tmp_path):
    d = tmp_path / "kv"
    with make_store(d) as s:
        s.save(TEXT, [1, 2, 3], tensors())
        s.save("another text", [1, 2, 3], tensors(1))
        before = s.counters()
        assert s.wipe() >= 2
        assert checkpoint_files(d) == []
        assert s.counters() == before                              # wipe is not an eviction
    p = subprocess.run([sys.executable, "-m", "kvstore", "wipe", str(d), "--yes"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert os.path.exists(counters_path(d))
    assert plain(counters.read_directory(d)) == plain(before)


# ---- many processes ---------------------------------------------------------------------

def _saver(path, tag, n, q):
    try:
        with make_store(path) as s:
            for i in range(n):
                s.save(f"{tag} text {i}", [1, 2, 3], tensors(i))
                assert s.load(s.find(f"{tag} text {i} and more")) is not None
                assert s.find(f"{tag} nothing {i}") is None
            q.put(s.stats())
    except BaseException as e:
        q.put(repr(e))


def test_two_processes_saving_and_loading_at_once_add_up(tmp_path):
    d = str(tmp_path / "kv")
    make_store(d).close()
    q = CTX.Queue()
    n = 25
    procs = [CTX.Process(target=_saver, args=(d, tag, n, q)) for tag in ("left", "right")]
    for p in procs:
        p.start()
    got = [q.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(30)
    assert all(isinstance(g, dict) for g in got), got
    c = counters.read_directory(d)
    assert c["saves"] == 2 * n == sum(g["saves"] for g in got)
    assert c["loads"] == c["hits"] == 2 * n
    assert c["misses"] == 2 * n
    assert c["bytes_written"] == sum(g["bytes_saved"] for g in got)
    assert c["bytes_read"] == sum(g["bytes_loaded"] for g in got)
    assert c["save_seconds"]["count"] == c["load_seconds"]["count"] == 2 * n
    with make_store(d) as s:
        assert s.counters() == counters.read_directory(d)
        assert c["bytes_written"] == sum(e.file_size for e in s.entries())     # nothing evicted


def _hammer(dc, n, q):
    try:
        for _ in range(n):
            dc.add(saves=1, bytes_written=3)
        q.put("ok")
    except BaseException as e:
        q.put(repr(e))


@pytest.mark.skipif(sys.platform == "darwin", reason="a fork after MLX has loaded Metal is unsafe on macOS")
def test_no_increment_is_lost_across_processes_and_a_fork(tmp_path):
    # The children use the parent's own counters object, opened before the
    # fork: each must open the file again (a shared descriptor would share
    # the lock), and the parent keeps counting meanwhile.
    n = 1500
    with make_store(tmp_path / "kv") as s:
        dc = counters.DirectoryCounters(s.path)
        dc.add(saves=0)
        fork = multiprocessing.get_context("fork")         # the object itself goes to the children
        q = fork.Queue()
        procs = [fork.Process(target=_hammer, args=(dc, n, q)) for _ in range(3)]
        for p in procs:
            p.start()
        _hammer(dc, n, q)
        assert [q.get(timeout=120) for _ in range(4)] == ["ok"] * 4
        for p in procs:
            p.join(30)
        c = s.counters()
        assert (c["saves"], c["bytes_written"]) == (4 * n, 12 * n)
        dc.close()


def _racer(d, barrier, n, q):
    try:
        barrier.wait(30)
        dc = counters.DirectoryCounters(d)            # every one of them may be the creator
        for _ in range(n):
            dc.add(loads=1, load_seconds=0.001)
        dc.close()
        q.put("ok")
    except BaseException as e:
        q.put(repr(e))


def test_processes_creating_the_file_at_once(tmp_path):
    # A creator writes no header; a racer that took the file for a bad one
    # would have reset it, and counts would be lost.
    n, k = 200, 4
    for attempt in range(3):
        d = tmp_path / f"fresh{attempt}"
        d.mkdir()
        barrier, q = CTX.Barrier(k), CTX.Queue()
        procs = [CTX.Process(target=_racer, args=(str(d), barrier, n, q)) for _ in range(k)]
        for p in procs:
            p.start()
        assert [q.get(timeout=60) for _ in procs] == ["ok"] * k
        for p in procs:
            p.join(30)
        c = counters.read_directory(d)
        assert c["loads"] == c["load_seconds"]["count"] == n * k
        assert os.listdir(d) == [COUNTERS_NAME]                   # no temporary left


# ---- a damaged, missing or hostile counters file ----------------------------------------

@pytest.mark.parametrize("content", [b"garbage, not a counters file at all " * 3, b"KVC",
                                     b"KVCT" + struct.pack("<HH", 1, len(SLOTS)) + bytes(20),
                                     b"KVCT" + struct.pack("<HH", 9, len(SLOTS)) + bytes(8 * len(SLOTS))],
                         ids=["garbage", "short", "truncated", "version"])
def test_a_bad_file_reads_as_zeros_and_is_rewritten(tmp_path, caplog, content):
    d = tmp_path / "kv"
    make_store(d).close()
    with open(counters_path(d), "wb") as f:
        f.write(content)
    assert counters.read_directory(d) == zeros()
    with caplog.at_level(logging.INFO, logger="kvstore"):
        with make_store(d) as s:
            assert s.counters() == zeros()                          # a reader changes nothing
            e = s.save(TEXT, [1, 2, 3], tensors())
            assert e is not None
            ck = s.load(s.find(PROMPT))
            assert ck is not None and np.array_equal(ck.tensors["k"], tensors()["k"])
            c = s.counters()
            assert (c["saves"], c["loads"], c["bytes_written"]) == (1, 1, e.file_size)
    resets = [r.getMessage() for r in caplog.records if "counters_reset" in r.getMessage()]
    assert len(resets) == 1, resets
    assert "file=.counters" in resets[0]
    assert slots_on_disk(counters_path(d))[:3] == (b"KVCT", 1, len(SLOTS))


def test_a_file_garbled_while_a_store_is_open(store, caplog):
    store.save(TEXT, [1, 2, 3], tensors())
    with open(counters_path(store), "r+b") as f:
        f.write(b"\xff" * 12)
    assert store.counters()["saves"] == 0
    with caplog.at_level(logging.INFO, logger="kvstore"):
        assert store.load(store.find(PROMPT)) is not None
    assert "counters_reset" in caplog.text
    c = store.counters()
    assert (c["saves"], c["loads"]) == (0, 1)


def test_a_symlink_at_counters_is_not_followed(tmp_path, caplog):
    d = tmp_path / "kv"
    d.mkdir(mode=0o700)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_bytes(b"do not touch")
    os.symlink(elsewhere, d / COUNTERS_NAME)
    dangling = tmp_path / "kv2"
    dangling.mkdir(mode=0o700)
    os.symlink(tmp_path / "not-there", dangling / COUNTERS_NAME)
    with caplog.at_level(logging.INFO, logger="kvstore"):
        for path in (d, dangling):
            with make_store(path) as s:
                e = s.save(TEXT, [1, 2, 3], tensors())
                assert e is not None and s.load(s.find(PROMPT)) is not None
                c = s.counters()                          # this process's counts, in memory
                assert (c["saves"], c["loads"], c["bytes_written"]) == (1, 1, e.file_size)
            assert os.path.islink(path / COUNTERS_NAME)
            assert counters.read_directory(path) == zeros()
    assert elsewhere.read_bytes() == b"do not touch"
    assert not (tmp_path / "not-there").exists()
    lines = [r.getMessage() for r in caplog.records if "counters_unavailable" in r.getMessage()]
    assert len(lines) == 2 and all("errno=ELOOP" in x and "action=process_only" in x for x in lines), lines


def test_a_directory_in_its_place_never_fails_a_save_or_a_load(tmp_path, caplog):
    d = tmp_path / "kv"
    (d / COUNTERS_NAME).mkdir(parents=True)
    with caplog.at_level(logging.INFO, logger="kvstore"):
        with make_store(d) as s:
            assert s.save(TEXT, [1, 2, 3], tensors()) is not None
            assert s.save_async("another text", [1, 2, 3], tensors(1)).result() is not None
            assert s.load(s.find(PROMPT)) is not None
            assert s.counters()["saves"] == 2
    assert sum("counters_unavailable" in r.getMessage() for r in caplog.records) == 1
    assert counters.read_directory(d) == zeros()


def _read_only_child(path, q):
    try:
        drop_root()
        out = {"euid": os.geteuid()}
        d = os.path.join(path, "kv")
        with make_store(d) as s:
            s.save(TEXT, [1, 2, 3], tensors())
        # A counters file this user cannot write: counted in memory.
        os.chmod(os.path.join(d, COUNTERS_NAME), 0o400)
        with make_store(d) as s:
            out["save_ro_file"] = s.save("another text", [1, 2, 3], tensors(1)) is not None
            out["load_ro_file"] = s.load(s.find(PROMPT)) is not None
            out["counted_ro_file"] = (s.counters()["saves"], s.counters()["loads"])
        os.chmod(os.path.join(d, COUNTERS_NAME), 0o600)
        # A directory made read-only under an open store: loads still load and count.
        with make_store(d) as s:
            os.chmod(d, 0o500)
            out["save"] = s.save("a third text", [1, 2, 3], tensors(2))
            ck = s.load(s.find(PROMPT))
            out["load"] = ck is not None and np.array_equal(ck.tensors["k"], tensors()["k"])
            out["counted"] = (s.counters()["saves"], s.counters()["loads"])
        out["read"] = counters.read_directory(d)["loads"]
        os.chmod(d, 0o700)
        q.put(out)
    except BaseException as e:
        q.put(repr(e))


@pytest.mark.skipif(kvhelpers.SPAWNED_AS_ROOT, reason="a spawned child that drops root cannot import from "
                    "root's private folders (kvhelpers.SPAWNED_AS_ROOT)")
def test_a_read_only_directory_or_file_still_loads(tmp_path):
    base = tempfile.mkdtemp(prefix="kvstore-ro-")          # reachable by an unprivileged child
    try:
        if os.geteuid() == 0:
            os.chown(base, 65534, 65534)
        q = CTX.Queue()
        p = CTX.Process(target=_read_only_child, args=(base, q))
        p.start()
        out = q.get(timeout=60)
        p.join(30)
        if isinstance(out, str) and "PermissionError" in out and "setuid" in out.lower():
            pytest.skip("cannot drop root privileges here")
        assert isinstance(out, dict), out
        assert out["euid"] != 0
        assert out["save_ro_file"] is True and out["load_ro_file"] is True
        assert out["counted_ro_file"] == (1, 1)                # this process's, in memory
        assert out["save"] is None and out["load"] is True
        assert out["counted"] == (1, 1)                        # the file from before, plus this load
        assert out["read"] == 1
    finally:
        shutil.rmtree(base, ignore_errors=True)


# ---- the command line ---------------------------------------------------------------------

def test_kvstore_stats_json_shows_the_same_numbers(tmp_path):
    d = tmp_path / "kv"
    with make_store(d, max_write_mb_per_hour=64) as s:
        s.save(TEXT, [1, 2, 3], tensors())
        s.save("another text", [1, 2, 3], tensors(1), reason=Reason.CONTINUED)
        assert s.load(s.find(PROMPT)) is not None
        assert s.find("a miss") is None
        mine = s.counters()
        before = set(os.listdir(d))
        p = subprocess.run([sys.executable, "-m", "kvstore", "stats", "--json", str(d)], cwd=tmp_path,
                           capture_output=True, text=True, timeout=60)
        assert p.returncode == 0, p.stderr
        assert set(os.listdir(d)) == before
        shown = json.loads(p.stdout)["directory"]              # valid JSON: +Inf as a string
        budget, shown_budget = mine.pop("write_budget"), shown.pop("write_budget")
        assert shown == json_form(mine)
        assert shown["load_seconds"]["buckets"][-1][0] == "+Inf"
        assert shown_budget["capacity_bytes"] == budget["capacity_bytes"] == 64 << 20
        assert shown_budget["rate_bytes_per_s"] == pytest.approx(budget["rate_bytes_per_s"])
        # The bucket refills while the other process starts: by at most a minute's worth.
        assert 0 <= shown_budget["available_bytes"] - budget["available_bytes"] <= (64 << 20) // 60
        p = subprocess.run([sys.executable, "-m", "kvstore", "stats", str(d)], cwd=tmp_path,
                           capture_output=True, text=True, timeout=60)
        assert p.returncode == 0, p.stderr
        for want in ("directory counters", "  saves                   2", "  loads                   1",
                     "  bytes written           ", "  corrupt                 0",
                     "  skipped (write budget)  0", "of 64.0 MiB available"):
            assert want in p.stdout, (want, p.stdout)
        assert TEXT not in p.stdout
