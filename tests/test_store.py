"""KVStore save/load semantics (docs/semantics.md §5, §6, §11, §12; docs/format.md §10): refusals, keeping
compatible files, hit updates, consumption, async saves, stats, permissions,
stale temporaries, wipe, close, and no prompt text in the logs."""

import concurrent.futures
import functools
import hashlib
import logging
import os
import stat
import subprocess
import sys
import time

import numpy as np
import pytest

import kvstore
from kvstore import trailers as trailer_mod
from kvstore.store import KVStore
from kvhelpers import OPTS, checkpoint_files, flip, make_store, make_tensors

SECRET = "TOP-SECRET prompt ☂ 4242"      # must never reach a log line


# This file's saves: k (2, n) float16 and v (n,) int32.
small_tensors = functools.partial(make_tensors, n=64, shape=((2, "n"), ("n",)), dtypes=("float16", "int32"))


def trailer_of(path):
    e = kvstore.format.read_entry(path)
    with open(path, "rb") as f:
        f.seek(e.trailer_offset)
        raw = f.read()
    return e, raw, trailer_mod.parse_trailer(raw)


def messages(caplog):
    return [r.getMessage() for r in caplog.records if r.name.startswith("kvstore")]


# ---- refusals (docs/semantics.md §6) ----------------------------------------------------

def test_refuses_too_few_tokens(tmp_path, caplog):
    caplog.set_level(logging.DEBUG, logger="kvstore")
    with make_store(tmp_path / "kv", min_tokens=8) as s:
        assert s.save("short prompt", list(range(7)), small_tensors()) is None
        assert s.save("empty tokens", [], small_tensors()) is None
        assert s.stats()["refused"] == 2 and s.stats()["saves"] == 0
        assert checkpoint_files(s.path, temporaries=True) == []
        lines = [m for m in messages(caplog) if "save_refused" in m]
        assert len(lines) == 2
        assert "reason=min_tokens" in lines[0] and "tokens=7" in lines[0] and "min_tokens=8" in lines[0]
        assert s.save("long enough prompt", list(range(8)), small_tensors()) is not None


def test_refuses_over_budget(tmp_path, caplog):
    caplog.set_level(logging.DEBUG, logger="kvstore")
    text, tokens, tensors = "budget prompt", list(range(10)), small_tensors(n=4096)
    with make_store(tmp_path / "probe", budget_mb=0) as probe:       # 0: unlimited
        size = probe.save(text, tokens, tensors).file_size
    slack = -(-size // 100)                                         # 1 %, rounded up
    with make_store(tmp_path / "tight", budget_mb=(size + slack - 1) / 2**20) as s:
        assert s.save(text, tokens, tensors) is None
        assert checkpoint_files(s.path, temporaries=True) == []
        line = [m for m in messages(caplog) if "save_refused" in m][-1]
        assert "reason=budget" in line and f"budget={size + slack - 1}" in line
    with make_store(tmp_path / "fits", budget_mb=(size + slack) / 2**20) as s:
        e = s.save(text, tokens, tensors)
        assert e is not None and e.file_size == size and os.path.exists(e.path)


def test_refusal_leaves_existing_checkpoints(tmp_path):
    with make_store(tmp_path / "kv", budget_mb=1) as s:
        keep = s.save("kept", [1, 2], small_tensors())
        assert s.save("far too big", [1, 2], {"x": np.zeros(2 << 20, np.uint8)}) is None
        assert checkpoint_files(s.path, temporaries=True) == [keep.name]


# ---- an existing file (docs/semantics.md §6, docs/format.md §10) ---------------------------------

def test_compatible_existing_file_is_kept(store):
    e1 = store.save("same text", [1, 2, 3], small_tensors(seed=1))
    before = open(e1.path, "rb").read()
    ino = os.stat(e1.path).st_ino
    e2 = store.save("same text", [1, 2, 3], small_tensors(seed=2))  # no trailers: nothing to rewrite
    assert e2 is not None and e2.sha == e1.sha
    assert os.stat(e1.path).st_ino == ino
    assert open(e1.path, "rb").read() == before
    ck = store.load(store.find("same text"))
    assert np.array_equal(ck.tensors["k"], small_tensors(seed=1)["k"])  # the first save's state


def test_kept_file_gets_only_its_trailer_rewritten(store):
    tool_map = {"call_1": '{"name":"ls","arguments":{"path":"/"}}', "call_2": "ünïcode ✓"}
    e1 = store.save("agent session", [5, 6, 7], small_tensors(seed=3))
    body_before = open(e1.path, "rb").read()[:e1.trailer_offset]
    ino = os.stat(e1.path).st_ino

    e2 = store.save("agent session", [5, 6, 7], small_tensors(seed=3),
                    trailers={kvstore.format.ExtFlag.TOOL_MAP: tool_map, kvstore.format.ExtFlag.SESSION_TITLE: "fix the build"})
    assert e2 is not None
    assert os.stat(e1.path).st_ino == ino
    entry, raw, (values, sections, flags) = trailer_of(e1.path)
    assert raw and values == {0: tool_map, 3: "fix the build"}
    assert entry.ext_flags & kvstore.format.ExtFlag.TOOL_MAP and entry.ext_flags & kvstore.format.ExtFlag.SESSION_TITLE
    after = open(e1.path, "rb").read()
    assert after[7:entry.trailer_offset] == body_before[7:]            # only the ext-flags byte changed before it
    assert after[:6] == body_before[:6]

    ck = store.load(store.find("agent session, continued"))
    assert ck.trailers == {0: tool_map, 3: "fix the build"}


def test_unknown_trailer_sections_are_preserved(store):
    e = store.save("forward compat", [1, 2], small_tensors(), trailers={kvstore.format.ExtFlag.SESSION_TITLE: "old"})
    # A section for ext bit 6, which this build has no hook for.
    body = b"\x00opaque future section\xff"
    section = trailer_mod.SECTION_HEADER.pack(6, len(body), kvstore.format.crc32c(body)) + body
    with open(e.path, "r+b") as f:
        f.seek(0, os.SEEK_END)
        f.write(section)
        f.seek(6)
        flags = f.read(1)[0]
        f.seek(6)
        f.write(bytes([flags | 1 << 6]))
    ino = os.stat(e.path).st_ino

    assert store.save("forward compat", [1, 2], small_tensors(),
                      trailers={kvstore.format.ExtFlag.SESSION_TITLE: "new", kvstore.format.ExtFlag.TOOL_MAP: {"a": "b"}})
    assert os.stat(e.path).st_ino == ino
    entry, raw, (values, sections, flags) = trailer_of(e.path)
    assert values == {0: {"a": "b"}, 3: "new"}
    assert trailer_mod.Section(6, body) in sections
    assert entry.ext_flags & (1 << 6)
    assert store.load(store.find("forward compat")) is not None


def test_trailers_on_first_save(store):
    e = store.save("fresh with trailer", [1], small_tensors(), trailers={0: {"id": "text"}})
    assert e.ext_flags == kvstore.format.ExtFlag.TOOL_MAP
    assert trailer_of(e.path)[2][0] == {0: {"id": "text"}}
    assert store.load(store.find("fresh with trailer")).trailers == {0: {"id": "text"}}


@pytest.mark.parametrize("first, second", [
    (dict(model_id=0), dict(model_id=3)),
    (dict(ctx_size=8192), dict(ctx_size=4096)),
    (dict(quant_bits=4), dict(quant_bits=8, reject_different_quant=True)),
])
def test_incompatible_existing_file_is_replaced(tmp_path, first, second):
    d = tmp_path / "kv"
    with make_store(d, **first) as a:
        e1 = a.save("contested text", [1, 2, 3], small_tensors(seed=1))
    ino = os.stat(e1.path).st_ino
    with make_store(d, **second) as b:
        e2 = b.save("contested text", [1, 2, 3, 4], small_tensors(seed=2))
        assert e2 is not None and e2.path == e1.path
        assert os.stat(e2.path).st_ino != ino
        h = kvstore.format.read_entry(e2.path)
        assert h.tokens == 4
        assert h.model_id == second.get("model_id", 0)
        assert h.ctx_size == (second.get("ctx_size") or 0)
        assert h.quant_bits == second.get("quant_bits", 16)
        ck = b.load(b.find("contested text"))
        assert np.array_equal(ck.tensors["k"], small_tensors(seed=2)["k"])
        assert checkpoint_files(d, temporaries=True) == [e1.name]


def test_smaller_context_file_is_kept_by_larger_store(tmp_path):
    d = tmp_path / "kv"
    with make_store(d, ctx_size=2048) as a:
        e1 = a.save("context text", [1, 2], small_tensors(seed=1))
    ino = os.stat(e1.path).st_ino
    with make_store(d, ctx_size=8192) as b:
        assert b.save("context text", [1, 2], small_tensors(seed=2)) is not None
        assert os.stat(e1.path).st_ino == ino
        assert kvstore.format.read_entry(e1.path).ctx_size == 2048


# ---- load (docs/semantics.md §5) -----------------------------------------------------

def test_load_touches_header(store):
    e = store.save("touch me", [1, 2], small_tensors())
    h0 = kvstore.format.read_entry(e.path)
    assert h0.hits == 0 and h0.last_used == 0 and h0.created_at > 0
    t0 = int(time.time())
    ck = store.load(store.find("touch me please"))
    h1 = kvstore.format.read_entry(e.path)
    assert h1.hits == 1 and ck.entry.hits == 1
    assert t0 <= h1.last_used <= int(time.time())
    assert h1.created_at == h0.created_at
    store.load(store.find("touch me again"))
    assert kvstore.format.read_entry(e.path).hits == 2


def test_effective_prompt_parts(store):
    tokens = [101, 7, 2**31 + 5]
    store.save("stored part", tokens, small_tensors())
    prompt = "stored part, then the suffix ✓"
    ck = store.load(store.find(prompt))
    assert ck.tokens.tolist() == tokens
    assert ck.text_bytes == b"stored part"
    assert prompt.encode()[len(ck.text_bytes):] == ", then the suffix ✓".encode()


def test_long_checkpoint_is_consumed_after_load(tmp_path):
    # Whole files only: a chain is never consumed (its blocks are the
    # parents of what the live session stores next; tests/test_chain.py).
    with make_store(tmp_path / "kv", min_tokens=1, cold_max_tokens=10, layout="whole") as s:
        long_e = s.save("long one", list(range(11)), small_tensors())
        edge_e = s.save("edge one", list(range(10)), small_tensors())
        assert s.load(s.find("long one!")) is not None and os.path.exists(long_e.path)    # asked nothing
        ck = s.load(s.find("long one!"), consume=True)
        assert ck is not None and ck.tokens.size == 11
        assert not os.path.exists(long_e.path)
        assert s.find("long one!") is None
        assert s.load(s.find("edge one!"), consume=True) is not None
        assert os.path.exists(edge_e.path)                   # == cold_max_tokens stays
        assert s.stats()["consumed"] == 1


# ---- save_async (docs/semantics.md §6) -------------------------------------------------------

def test_save_async_captures_arrays_at_call_time(store):
    k = np.arange(4096, dtype=np.float32)
    tokens = np.arange(1, 33, dtype=np.uint32)
    fut = store.save_async("async prompt", tokens, {"k": k})
    assert isinstance(fut, concurrent.futures.Future)
    k[:] = -1.0                                            # the caller reuses its buffers at once
    tokens[:] = 0
    e = fut.result(timeout=30)
    assert isinstance(e, kvstore.format.Entry)
    ck = store.load(store.find("async prompt"))
    assert np.array_equal(ck.tensors["k"], np.arange(4096, dtype=np.float32))
    assert ck.tokens.tolist() == list(range(1, 33))


def test_save_async_mlx(store):
    mx = pytest.importorskip("mlx.core")
    a = mx.arange(100).astype(mx.bfloat16)
    e = store.save_async("async mlx", [1, 2], {"a": a}).result(timeout=30)
    ck = store.load(store.find("async mlx"), into="mlx")
    assert e is not None and mx.array_equal(ck.tensors["a"], a).item()


def test_save_async_of_strided_mlx_views_runs_no_mlx_op_on_the_writer(tmp_path, monkeypatch):
    # KV buffers cut to their filled length are strided views; a chained
    # save slices them again per block.  The copy happens on the caller's
    # thread: an MLX op on the writer's thread would queue behind whatever
    # the caller's stream runs (a prefill) and MLX on the CPU is not safe
    # for ops on two threads at once.
    mx = pytest.importorskip("mlx.core")
    import threading
    buf = {"k": mx.random.normal((1, 2, 512, 8)).astype(mx.bfloat16), "v": mx.random.normal((1, 2, 512, 8))}
    views = {n: a[..., :300, :] for n, a in buf.items()}
    mx.eval(views)
    assert not memoryview(views["v"]).c_contiguous
    caller, on_writer = threading.get_ident(), []
    real = mx.contiguous

    def spy(*a, **kw):
        if threading.get_ident() != caller:
            on_writer.append(1)
        return real(*a, **kw)
    monkeypatch.setattr(mx, "contiguous", spy)
    with make_store(tmp_path / "kv", layout="chain", block_tokens=128) as s:
        text = "x" * 300
        e = s.save_async(text, np.arange(300), views, positional={"k": 2, "v": 2},
                         text_offsets=list(range(301))).result(timeout=30)
        assert e is not None and e.tokens == 300 and e.token_start == 256      # three blocks
        ck = s.load(s.find(text + " and more"), into="mlx")
    assert on_writer == []
    assert ck.dtypes["k"] == "bfloat16" and ck.tensors["k"].dtype == mx.bfloat16
    for n in views:
        assert mx.array_equal(ck.tensors[n], views[n]).item(), n


def test_try_submit_never_waits_for_a_full_writer(tmp_path):
    # A serving loop queues its saves with try_submit: when the writer's
    # queue is full the call returns None at once instead of blocking.
    import threading

    from kvstore.writer import DEFAULT_QUEUE_SIZE
    started, release = threading.Event(), threading.Event()
    with make_store(tmp_path / "d") as s:
        running = s.submit(lambda: started.set() or release.wait(60))
        assert started.wait(30)
        queued = [s.try_submit(lambda i=i: i) for i in range(DEFAULT_QUEUE_SIZE + 2)]
        try:
            # One is running; the queue holds DEFAULT_QUEUE_SIZE more.
            assert [f is not None for f in queued] == [True] * DEFAULT_QUEUE_SIZE + [False] * 2
        finally:
            release.set()
        assert running.result(timeout=30) is True
        assert [f.result(timeout=30) for f in queued if f is not None] == \
            [i for i, f in enumerate(queued) if f is not None]


def test_save_async_refusal_and_error_come_through_the_future(tmp_path):
    with make_store(tmp_path / "kv", min_tokens=5) as s:
        assert s.save_async("few", [1, 2], small_tensors()).result(timeout=30) is None
        with pytest.raises(ValueError):
            s.save_async("bad meta", list(range(9)), small_tensors(), meta={"x": {1}}).result(timeout=30)
        assert s.save_async("fine", list(range(9)), small_tensors()).result(timeout=30) is not None


def _async_batch(s, n, prefix):
    big = np.random.default_rng(0).standard_normal(1 << 20).astype(np.float32)    # 4 MiB each
    return [s.save_async(f"{prefix} {i}", [1, 2, 3], {"x": big}) for i in range(n)]


def test_flush_waits_for_queued_saves(tmp_path):
    with KVStore(tmp_path / "kv", **OPTS, durable=True) as s:
        futs = _async_batch(s, 6, "flush")
        s.flush()
        assert all(f.done() for f in futs)
        assert len(checkpoint_files(s.path, temporaries=True)) == 6
        assert [f.result().name for f in futs] == [
            hashlib.sha1(f"flush {i}".encode()).hexdigest() + ".kv" for i in range(6)]


def test_close_waits_for_queued_saves(tmp_path):
    s = KVStore(tmp_path / "kv", **OPTS, durable=True)
    futs = _async_batch(s, 6, "close")
    s.close()
    assert all(f.done() and f.result() is not None for f in futs)
    assert len(checkpoint_files(tmp_path / "kv", temporaries=True)) == 6


# ---- stats ---------------------------------------------------------------------

def test_stats_counters(tmp_path):
    with make_store(tmp_path / "kv", budget_mb=0.1) as s:
        st = s.stats()
        for k in ("hits", "misses", "loads", "bytes_loaded", "saves", "evictions", "corrupt"):
            assert st[k] == 0, k
        assert s.find("nothing here") is None
        e = s.save("counted", [1, 2], small_tensors(n=1024))
        ck = s.load(s.find("counted, hit"))
        st = s.stats()
        assert (st["misses"], st["saves"], st["hits"], st["loads"]) == (1, 1, 1, 1)
        assert st["bytes_loaded"] == e.file_size
        assert st["entries"] == 1 and st["bytes"] == e.file_size and st["budget_bytes"] == int(0.1 * 2**20)

        # Corrupt one tensor byte: a miss and a corrupt file.
        bad = s.save("corrupted", [1, 2], small_tensors(n=1024))
        flip(bad.path, bad.file_size - 10, 0x40)
        assert s.load(s.find("corrupted")) is None
        st = s.stats()
        assert st["corrupt"] == 1 and st["misses"] == 2 and st["hits"] == 1

        # Enough saves to exceed 100 KiB: evictions counted.
        for i in range(30):
            s.save(f"filler {i}", [1, 2], small_tensors(seed=i, n=1024))
        st = s.stats()
        assert st["saves"] == 32
        assert st["evictions"] == 31 + 1 - st["entries"] - st["corrupt"]
        assert st["evictions"] > 0
        assert ck is not None


# ---- permissions, temporaries (docs/semantics.md §11, §12) --------------------------------------------

@pytest.mark.parametrize("umask", [0o000, 0o022, 0o077, 0o277])
def test_modes_whatever_the_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        with KVStore(tmp_path / "a" / "kv", **OPTS, quarantine=True) as s:
            e = s.save("perm", [1, 2], small_tensors())
            e2 = s.save("perm2", [1, 2], small_tensors())
            flip(e2.path, e2.file_size - 1, 0x40)            # corrupt: goes to .quarantine
            ck = s.load(s.find("perm2"))
            assert ck is None or ck.text_bytes == b"perm"    # a miss, or the shorter hit
            mode = lambda p: stat.S_IMODE(os.stat(p).st_mode)
            assert mode(s.path) == 0o700
            assert mode(e.path) == 0o600
            assert mode(os.path.join(s.path, ".quarantine")) & 0o077 == 0
            assert mode(os.path.join(s.path, ".quarantine", e2.name)) == 0o600
            for name in os.listdir(s.path):
                p = os.path.join(s.path, name)
                if os.path.isfile(p):
                    assert mode(p) & 0o077 == 0, name
    finally:
        os.umask(old)


def _dead_pid():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


@pytest.fixture
def live():
    """A process that is alive for the test (its pid names other writers' temporaries)."""
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield p
    p.kill()
    p.wait()


def test_stale_temporaries_removed_on_open(tmp_path, live):
    d = tmp_path / "kv"
    with make_store(d) as s:
        good = s.save("survivor", [1, 2], small_tensors())
    sha = hashlib.sha1(b"x").hexdigest()
    dead = d / f"{sha}.kv.tmp.{_dead_pid()}.1a2b3c4d"
    alive = d / f"{sha}.kv.tmp.{live.pid}.deadbeef"
    alive_but_old = d / f"{sha}.kv.tmp.{live.pid}.0badf00d"
    unrelated = d / "notes.kv.tmp.1.ab"
    for p in (dead, alive, alive_but_old, unrelated):
        p.write_bytes(b"partial")
    old = time.time() - 3 * 24 * 3600
    os.utime(alive_but_old, (old, old))
    with make_store(d) as s:
        assert not dead.exists()
        assert alive.exists()
        assert not alive_but_old.exists()
        assert unrelated.exists()
        assert good.path in [e.path for e in s.entries()]


def test_temporaries_left_before_the_boot_or_by_this_process_are_removed(tmp_path, live):
    # After a power cut every writer died with the machine, and their pids
    # may belong to other processes now (this one included): a temporary
    # file older than the boot, or of this process's pid but open in no write
    # of this process, is debris.  Found by tests/test_power_cuts.py.
    from kvstore import publish, temps
    d = tmp_path / "kv"
    with make_store(d):
        pass
    sha = hashlib.sha1(b"x").hexdigest()
    before_boot = d / f"{sha}.kv.tmp.{live.pid}.0badf00d"
    mine = d / f"{sha}.kv.tmp.{os.getpid()}.1a2b3c4d"
    alive = d / f"{sha}.kv.tmp.{live.pid}.deadbeef"
    for p in (before_boot, mine, alive):
        p.write_bytes(b"partial")
    booted = temps.boot_time()
    assert booted is not None and booted < time.time()
    os.utime(before_boot, (booted - 60, booted - 60))
    with publish.TempFile(d / f"{sha}.kv") as writing:        # this process's own write, in progress
        with make_store(d):
            assert not before_boot.exists() and not mine.exists()
            assert alive.exists() and os.path.exists(writing.path)


def test_wipe_overwrites_then_unlinks(tmp_path):
    with make_store(tmp_path / "kv") as s:
        e1 = s.save(SECRET + " one", [1, 2], small_tensors(seed=1))
        e2 = s.save(SECRET + " two", [1, 2], small_tensors(seed=2))
        e3 = s.save("not wiped", [1, 2], small_tensors(seed=3))
        # Hard links see the inode's bytes after the name is gone.
        for e in (e1, e2):
            os.link(e.path, tmp_path / (e.name + ".witness"))
        assert s.wipe(s.find(SECRET + " one!")) == 1
        assert not os.path.exists(e1.path) and os.path.exists(e2.path)
        w1 = (tmp_path / (e1.name + ".witness")).read_bytes()
        assert len(w1) == e1.file_size and w1 == bytes(len(w1))
        assert SECRET.encode() not in w1
        assert s.wipe() == 2
        assert checkpoint_files(s.path, temporaries=True) == []
        w2 = (tmp_path / (e2.name + ".witness")).read_bytes()
        assert w2 == bytes(e2.file_size)
        assert s.find(SECRET + " two!") is None and s.find("not wiped") is None
        assert e3.name not in os.listdir(s.path)


# ---- close -------------------------------------------------------------------------

def test_context_manager_closes(tmp_path):
    with make_store(tmp_path / "kv") as s:
        s.save("ctx", [1], small_tensors())
    with pytest.raises(kvstore.StoreClosed):
        s.find("ctx")


def test_everything_after_close_raises_store_closed(tmp_path):
    s = make_store(tmp_path / "kv")
    e = s.save("closing", [1, 2], small_tensors())
    s.close()
    s.close()                                              # idempotent
    calls = [lambda: s.find("closing"), lambda: s.load(e), lambda: s.save("x", [1], {}),
             lambda: s.save_async("x", [1], {}), s.entries, s.evict, s.stats, s.wipe]
    for call in calls:
        with pytest.raises(kvstore.StoreClosed):
            call()
    assert issubclass(kvstore.StoreClosed, RuntimeError)
    assert os.path.exists(e.path)                          # close deletes nothing


# ---- privacy (docs/semantics.md §12) -------------------------------------------------------------

def test_no_prompt_text_in_logs(tmp_path, caplog):
    caplog.set_level(logging.DEBUG, logger="kvstore")
    secrets = [SECRET, "hunter2-password-in-prompt", "tool-result-SECRET-77"]
    d = tmp_path / "kv"
    with make_store(d, min_tokens=2, cold_max_tokens=5, budget_mb=0.05,
                    quarantine=True) as s:
        s.save(secrets[0], [1], small_tensors())                         # refused: min_tokens
        s.save(secrets[0], [1, 2], {"x": np.zeros(1 << 20, np.uint8)})  # refused: budget
        e = s.save(secrets[0], [1, 2], small_tensors(),
                   trailers={0: {"call": secrets[2]}, 3: secrets[1]})
        s.save(secrets[0], [1, 2], small_tensors(), trailers={3: secrets[1] + "!"})    # kept
        s.load(s.find(secrets[0] + secrets[1]))                          # hit
        s.find(secrets[1])                                               # miss
        s.save_async(secrets[1], list(range(9)), small_tensors()).result()   # consumed on load
        s.load(s.find(secrets[1] + " more"), consume=True)
        for i in range(8):                                               # evictions
            s.save(f"{secrets[2]} {i}", [1, 2], small_tensors(seed=i, n=2048))
        bad = s.save(secrets[1] + " corrupt", [1, 2], small_tensors())
        with open(bad.path, "r+b") as f:
            f.seek(bad.file_size - 3)
            f.write(b"\xff\xfe\xfd")
        s.load(s.find(secrets[1] + " corrupt!"))                         # corrupt, quarantined
        with open(e.path, "r+b") as f:                                   # a trailer section dropped
            f.seek(e.file_size - 1)
            f.write(b"\x00")
        found = s.find(secrets[0] + "x")
        if found is not None:
            s.load(found)
        s.wipe()
    with make_store(d, max_age_s=0) as s:
        s.save(secrets[0], [1, 2], small_tensors())
    kinds = {m.split()[1] for m in messages(caplog)}
    assert {"save_refused", "saved", "save_kept", "hit", "evicted", "corrupt", "trailer_drop"} <= kinds
    for r in caplog.records:
        text = r.getMessage() + repr(r.args) + (r.exc_text or "")
        for secret in secrets:
            assert secret not in text, r.getMessage()
            assert secret.encode("utf-8").hex() not in text
        assert "TOP-SECRET" not in text and "hunter2" not in text


@pytest.mark.skipif(sys.platform == "darwin", reason="a fork after MLX has loaded Metal is unsafe on macOS")
def test_store_works_in_a_forked_child_after_parallel_io(tmp_path):
    """A child forked after the parent used the I/O pool and the writer can save and load."""
    import multiprocessing as mp

    big = {"k": np.arange(3 << 20, dtype=np.float32)}          # 12 MiB: sliced over the pool
    with kvstore.KVStore(tmp_path / "s", min_tokens=1) as store:
        store.save("parent text", np.arange(4), big)
        assert store.load(store.find("parent text")) is not None
        store.save_async("parent async", np.arange(4), big).result()

        def child(q):
            e = store.save("child text", np.arange(4), big)
            ck = store.load(store.find("child text"))
            fut = store.save_async("child async", np.arange(4), big)
            q.put((e is not None, ck is not None and np.array_equal(ck.tensors["k"], big["k"]),
                   fut.result(timeout=30) is not None))

        ctx = mp.get_context("fork")
        q = ctx.Queue()
        p = ctx.Process(target=child, args=(q,))
        p.start()
        p.join(60)
        assert p.exitcode == 0, "child hung or failed"
        assert q.get(timeout=5) == (True, True, True)
