"""Eviction and the disk budget through KVStore (docs/semantics.md §8): the budget
after every save, who goes first, the protected new file, tie-breaks, two
evicting processes, and the maximum age."""

import fcntl
import hashlib
import os
import struct
import time

import numpy as np
import pytest

import kvstore
from kvstore import Settings
from kvstore import store as store_mod
from kvhelpers import CTX, checkpoint_files, make_store

HALF_LIFE = Settings().hit_half_life_s
R = kvstore.format.Reason
TENSORS = {"k": np.arange(4096, dtype=np.float32)}      # every test file: 16 KiB of data


def name_of(text):
    return hashlib.sha1(text.encode()).hexdigest() + ".kv"


def disk_bytes(directory):
    return sum(os.stat(os.path.join(directory, n)).st_size for n in checkpoint_files(directory))


def patch_header(path, **fields):
    """Rewrites header fields of a file in place (the test's clock and hit history)."""
    with open(path, "r+b") as f:
        h = kvstore.format.Header.unpack(f.read(48))
        for k, v in fields.items():
            setattr(h, k, v)
        f.seek(0)
        f.write(h.pack())


def populate(directory, specs, **store_kw):
    """specs: [(text, reason, header fields)]; returns the common file size."""
    sizes = set()
    with make_store(directory, budget_mb=0, **store_kw) as s:
        for text, reason, fields in specs:
            e = s.save(text, [1, 2, 3, 4], TENSORS, reason=reason)
            patch_header(e.path, **fields)
            sizes.add(e.file_size)
    assert len(sizes) == 1, "test files must have equal sizes"
    return sizes.pop()


def budget_for(n_files, size):
    return (n_files * size + size // 2) / 2**20        # room for n files, not n + 1


def survivors(directory, texts):
    names = set(checkpoint_files(directory))
    return [t for t in texts if name_of(t) in names]


NOW = int(time.time())


# ---- the budget -------------------------------------------------------------

def test_budget_holds_after_every_save(tmp_path):
    d = tmp_path / "kv"
    size = populate(d, [("probe", R.COLD, {})])
    budget = budget_for(4, size)
    with make_store(d, budget_mb=budget) as s:
        for i in range(15):
            e = s.save(f"prompt number {i:02d}", [1, 2, 3, 4], TENSORS, reason=R.CONTINUED if i % 2 else R.COLD)
            assert e is not None and os.path.exists(e.path)        # the new file is never the victim
            assert disk_bytes(d) <= s.budget_bytes
            assert len(checkpoint_files(d)) == min(i + 2, 4)        # the probe file + i + 1
        assert s.stats()["evictions"] == 16 - 4
        assert s.stats()["bytes"] == disk_bytes(d)


def test_open_evicts_down_to_budget(tmp_path):
    d = tmp_path / "kv"
    texts = [f"text {i}" for i in range(6)]
    size = populate(d, [(t, R.COLD, {"created_at": NOW - 100 + i}) for i, t in enumerate(texts)])
    with make_store(d, budget_mb=budget_for(2, size)):
        assert survivors(d, texts) == texts[-2:]              # equal scores: oldest go first


def test_foreign_files_count_and_can_be_evicted(tmp_path):
    d = tmp_path / "kv"
    size = populate(d, [("ours", R.COLD, {})])
    foreign = os.path.join(d, hashlib.sha1(b"ds4 state").hexdigest() + ".kv")
    payload = bytes(size)
    h = kvstore.format.Header(quant_bits=2, tokens=1, ctx_size=4096, payload_bytes=len(payload),
                       reason=R.CONTINUED, payload_abi=2, created_at=NOW)
    with open(foreign, "wb") as f:
        f.write(h.pack() + struct.pack("<I", 9) + b"ds4 state" + payload)
    with make_store(d, budget_mb=budget_for(1, size)) as s:
        assert not os.path.exists(foreign)                   # 1 token per ~20 KB: lowest score
        assert checkpoint_files(d) == [name_of("ours")]
        assert s.stats()["evictions"] == 1


# ---- who goes first -------------------------------------------------------------

@pytest.mark.parametrize("reason, anchor", [
    (R.COLD, True), (R.EVICT, True), (R.SHUTDOWN, True),
    (R.CONTINUED, False), (R.UNKNOWN, False), (R.AGENT_SESSION, False), (R.AGENT_SYSTEM, False)])
def test_anchors_count_double(tmp_path, reason, anchor):
    d = tmp_path / "kv"
    # The candidate is older: on equal scores it would go first.
    size = populate(d, [("candidate", reason, {"created_at": NOW - 2000}),
                        ("waypoint", R.CONTINUED, {"created_at": NOW - 1000})])
    with make_store(d, budget_mb=budget_for(1, size)):
        assert survivors(d, ["candidate", "waypoint"]) == (["candidate"] if anchor else ["waypoint"])


def test_recent_hits_protect_and_decay(tmp_path):
    d = tmp_path / "kv"
    size = populate(d, [
        ("hit recently", R.CONTINUED, {"hits": 3, "last_used": NOW, "created_at": NOW - 9000}),
        ("hit long ago", R.CONTINUED, {"hits": 3, "last_used": NOW - 20 * HALF_LIFE, "created_at": NOW - 30 * HALF_LIFE}),
        ("never hit", R.CONTINUED, {"created_at": NOW - 100}),
    ])
    with make_store(d, budget_mb=budget_for(2, size)):
        # Decayed below 0.01 the old hits count for nothing, and its time is the oldest.
        assert survivors(d, ["hit recently", "hit long ago", "never hit"]) == ["hit recently", "never hit"]
    with make_store(d, budget_mb=budget_for(1, size)):
        assert survivors(d, ["hit recently", "never hit"]) == ["hit recently"]


def test_more_tokens_per_byte_survive(tmp_path):
    d = tmp_path / "kv"
    with make_store(d, budget_mb=0) as s:
        dense = s.save("dense", list(range(4000)), {"k": np.zeros(1024, np.float32)}, reason=R.CONTINUED)
        sparse = s.save("sparse", [1, 2], {"k": np.zeros(4096, np.float32)}, reason=R.CONTINUED)
    patch_header(dense.path, created_at=NOW - 5000)           # older: would lose a tie
    with make_store(d, budget_mb=(dense.file_size + sparse.file_size - 1) / 2**20):
        assert survivors(d, ["dense", "sparse"]) == ["dense"]


INCOMING = "conversation: system, user 1, assistant 1"
PREFIX = "conversation: system, user 1"


@pytest.mark.parametrize("case, evicted", [
    ("superseded", PREFIX),                    # 0.05 x: goes first although newer
    ("superseded_but_busy", "unrelated"),      # 9 recent hits: 10 x 0.455 of the base score
    ("prefix_is_anchor", "unrelated"),         # the scale is for continued waypoints only
    ("prefix_smaller_ctx", "unrelated"),       # incoming is less widely reusable: not superseded
    ("prefix_other_model", "unrelated"),
])
def test_superseded_waypoint_goes_first(tmp_path, case, evicted):
    d = tmp_path / "kv"
    reason = R.COLD if case == "prefix_is_anchor" else R.CONTINUED
    hits = {"hits": 9, "last_used": NOW} if case == "superseded_but_busy" else {}
    ctx = 4096 if case == "prefix_smaller_ctx" else 8192
    model = 1 if case == "prefix_other_model" else 0
    with make_store(d, budget_mb=0, model_id=model) as s:
        e = s.save(PREFIX, [1, 2, 3, 4], TENSORS, reason=reason, ctx_size=ctx)
        patch_header(e.path, created_at=NOW - 100, **hits)
    with make_store(d, budget_mb=0) as s:
        e = s.save("unrelated", [1, 2, 3, 4], TENSORS, reason=R.CONTINUED, ctx_size=8192)
        patch_header(e.path, created_at=NOW - 200)            # older: loses every tie
        size = e.file_size
    with make_store(d, budget_mb=budget_for(2, size)) as s:
        assert len(checkpoint_files(d)) == 2
        new = s.save(INCOMING, [1, 2, 3, 4, 5], TENSORS, reason=R.CONTINUED, ctx_size=8192)
        assert new is not None and os.path.exists(new.path)
        assert survivors(d, [PREFIX, "unrelated"]) == [t for t in [PREFIX, "unrelated"] if t != evicted]


def test_just_written_file_is_never_the_victim(tmp_path):
    d = tmp_path / "kv"
    size = populate(d, [(f"valued anchor {i}", R.COLD, {"hits": 50, "last_used": NOW - 10 + i})
                        for i in range(3)])
    with make_store(d, budget_mb=budget_for(3, size)) as s:
        new = s.save("worthless newcomer", [1, 2, 3, 4], TENSORS, reason=R.CONTINUED)
        assert os.path.exists(new.path)
        assert survivors(d, [f"valued anchor {i}" for i in range(3)]) == ["valued anchor 1", "valued anchor 2"]
        # Left to itself (no protection), the newcomer has the lowest score.
        s.budget_bytes = int(budget_for(2, size) * 2**20)
        s.evict()
        assert not os.path.exists(new.path)


def test_ties_go_to_older_last_used(tmp_path):
    d = tmp_path / "kv"
    size = populate(d, [
        # Created first, but used most recently: t = last_used.
        ("created first, used last", R.CONTINUED, {"created_at": NOW - 3000, "last_used": NOW - 50}),
        ("created second, never used", R.CONTINUED, {"created_at": NOW - 200}),
        ("created third, never used", R.CONTINUED, {"created_at": NOW - 100}),
    ])
    texts = ["created first, used last", "created second, never used", "created third, never used"]
    with make_store(d, budget_mb=budget_for(2, size)):
        assert survivors(d, texts) == [texts[0], texts[2]]
    with make_store(d, budget_mb=budget_for(1, size)):
        assert survivors(d, texts) == [texts[0]]


# ---- two processes ---------------------------------------------------------------

def _open_and_evict(path, budget_mb, q):
    try:
        with make_store(path, budget_mb=budget_mb):          # evicts on open, under the lock
            q.put(len(checkpoint_files(path)))
    except BaseException as e:
        q.put(repr(e))


def test_evictor_waits_for_the_directory_lock(tmp_path):
    d = tmp_path / "kv"
    texts = [f"locked {i}" for i in range(6)]
    size = populate(d, [(t, R.COLD, {"created_at": NOW - 100 + i}) for i, t in enumerate(texts)])
    lock = os.open(os.path.join(d, store_mod.LOCK_NAME), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        q = CTX.Queue()
        p = CTX.Process(target=_open_and_evict, args=(str(d), budget_for(3, size), q))
        p.start()
        time.sleep(0.5)
        assert p.is_alive()                                   # blocked on the lock
        assert len(checkpoint_files(d)) == 6                  # and deleted nothing
    finally:
        fcntl.flock(lock, fcntl.LOCK_UN)
        os.close(lock)
    assert q.get(timeout=30) == 3
    p.join(30)
    assert p.exitcode == 0
    assert survivors(d, texts) == texts[3:]


def _save_one(path, budget_mb, go, q):
    try:
        # Whole files: a chained save would wait for the lock before publishing.
        with make_store(path, budget_mb=budget_mb, layout="whole") as s:        # lists the directory now
            q.put("listed")
            go.wait(30)
            e = s.save("child's checkpoint", [1, 2, 3, 4], TENSORS, reason=R.COLD)
            q.put((e is not None, s.stats()["evictions"]))
    except BaseException as e:
        q.put(repr(e))


def test_second_evictor_relists_under_the_lock(tmp_path):
    """Evictor B (a child) saves while evictor A (this test, holding the lock)
    is at work.  A brings the directory back to budget; B must see that once
    it has the lock and delete nothing, not act on the listing it had."""
    d = tmp_path / "kv"
    texts = [f"older {i}" for i in range(4)]
    size = populate(d, [(t, R.COLD, {"created_at": NOW - 100 + i}) for i, t in enumerate(texts)])
    q, go = CTX.Queue(), CTX.Event()
    p = CTX.Process(target=_save_one, args=(str(d), budget_for(4, size), go, q))
    p.start()
    try:
        assert q.get(timeout=30) == "listed"
        lock = os.open(os.path.join(d, store_mod.LOCK_NAME), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            go.set()
            child_file = os.path.join(d, name_of("child's checkpoint"))
            deadline = time.monotonic() + 30
            while not os.path.exists(child_file):               # published; now waiting for the lock
                assert time.monotonic() < deadline and p.is_alive()
                time.sleep(0.01)
            time.sleep(0.3)
            assert p.is_alive() and len(checkpoint_files(d)) == 5
            os.unlink(os.path.join(d, name_of(texts[0])))        # A's eviction: back to 4 files
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
            os.close(lock)
        assert q.get(timeout=30) == (True, 0)
    finally:
        p.join(30)
    assert p.exitcode == 0
    assert survivors(d, texts) == texts[1:]
    assert os.path.exists(child_file)


# ---- maximum age -------------------------------------------------------------------

def test_max_age_removes_old_entries(tmp_path):
    d = tmp_path / "kv"
    populate(d, [
        ("used long ago", R.COLD, {"created_at": NOW - 90_000, "last_used": NOW - 7200, "hits": 4}),
        ("created long ago", R.COLD, {"created_at": NOW - 7200}),
        ("created long ago, used now", R.COLD, {"created_at": NOW - 90_000, "last_used": NOW - 10, "hits": 1}),
        ("fresh", R.CONTINUED, {"created_at": NOW - 10}),
    ])
    texts = ["used long ago", "created long ago", "created long ago, used now", "fresh"]
    with make_store(d, max_age_s=None):
        assert survivors(d, texts) == texts                  # no max age: nothing removed
    with make_store(d, max_age_s=3600) as s:               # budget is no issue
        assert survivors(d, texts) == texts[2:]
        assert s.stats()["evictions"] == 2


def test_max_age_counts_hits_made_after_listing(tmp_path):
    """A checkpoint in use is not aged out: hits update the header in place
    (touch), after the index has cached the entry, and they count."""
    d = tmp_path / "kv"
    with make_store(d, max_age_s=1) as s:
        idle = s.save("idle", [1, 2], TENSORS)
        busy = s.save("busy", [1, 2], TENSORS)
        while int(time.time()) < busy.created_at + 2:       # both are now older than max_age
            time.sleep(0.05)
        assert s.load(s.find("busy!")) is not None           # last_used = now
        new = s.save("newcomer", [1, 2], TENSORS)            # evicts by age, never the new file
        assert os.path.exists(new.path)
        assert not os.path.exists(idle.path)
        assert os.path.exists(busy.path)
