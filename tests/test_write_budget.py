"""The SSD write budget (docs/semantics.md §15): KVStore(max_write_mb_per_hour=N).

A token bucket of one hour's bytes, refilled at N MiB an hour, kept in the
directory's counters file so that every process draws from the same one.
When it runs low, saves are skipped in order of value (kvstore.policy
.write_allowed): continued waypoints, evict states and unknown reasons
first, then shutdown states, then agent sessions; cold and agent-system
anchors last.  A skipped save writes nothing and returns None.

The clock of the bucket is kvstore.counters.clock: the tests that need time
to pass set it instead of sleeping.
"""

import logging
import math
import os
import re

import numpy as np
import pytest

from kvstore import KVStore, counters, policy
from kvstore.format import Reason
from kvhelpers import CTX, checkpoint_files, make_store, make_tensors

MIB = 1 << 20
T0 = 1_800_000_000.0


def tensors(seed=0):
    return make_tensors(64, seed, dtypes=("float16", "float16"))


class Saver:
    """Saves of one size: texts of one length, the same tensors' shapes."""

    def __init__(self, store):
        self.store, self.n = store, 0

    def text(self):
        self.n += 1
        return f"budget text {self.n:05d}"

    def __call__(self, reason):
        return self.store.save(self.text(), [1, 2, 3], tensors(self.n), reason=reason)


def save_size(tmp_path, layout=None):
    """The file bytes of one Saver save in this layout (written in a scratch directory)."""
    kw = {} if layout is None else {"layout": layout}
    with make_store(tmp_path / "scratch", **kw) as s:
        sizes = {Saver(s)(Reason.COLD).file_size, Saver(s)(Reason.CONTINUED).file_size}
    assert len(sizes) == 1
    return sizes.pop()


def mb(nbytes):
    """The max_write_mb_per_hour that makes a capacity of exactly nbytes."""
    return nbytes / MIB


@pytest.fixture
def clock(monkeypatch):
    """kvstore.counters' clock, held still; now[0] += s lets s seconds pass."""
    now = [T0]
    monkeypatch.setattr(counters, "clock", lambda: now[0])
    return now


def available(store):
    return store.stats()["write_budget"]["available_bytes"]


# ---- the options ----------------------------------------------------------------------

@pytest.mark.parametrize("bad", [0, 0.0, -1, -0.5, math.nan, math.inf, -math.inf, "10", True, [1], 1e-9])
def test_bad_values_raise_value_error_naming_the_value(tmp_path, bad):
    d = tmp_path / "kv"
    with pytest.raises(ValueError, match=re.escape(repr(bad))):
        KVStore(d, max_write_mb_per_hour=bad)
    assert not d.exists()                                       # refused before anything is made


def test_no_budget_by_default(store):
    assert store.write_budget_bytes is None
    assert store.stats()["write_budget"] is None and store.counters()["write_budget"] is None
    for i in range(20):
        assert store.save(f"text {i}", [1, 2, 3], tensors(i), reason=Reason.CONTINUED) is not None
    assert store.stats()["stores_skipped_write_budget"] == 0


def test_a_new_bucket_starts_full_and_reports_its_rate(tmp_path, clock):
    with make_store(tmp_path / "kv", max_write_mb_per_hour=36) as s:
        assert s.stats()["write_budget"] == {"capacity_bytes": 36 * MIB, "available_bytes": 36 * MIB,
                                             "rate_bytes_per_s": 36 * MIB / 3600}
        assert s.counters()["write_budget"] == s.stats()["write_budget"]
        e = s.save("a text", [1, 2, 3], tensors())
        assert available(s) == 36 * MIB - e.file_size            # a whole file: its size
        assert s.save("a text", [1, 2, 3], tensors()).name == e.name     # kept: nothing written or taken
        assert available(s) == 36 * MIB - e.file_size


# ---- the order of value -----------------------------------------------------------------

def test_policy_floors():
    floors = {r: policy.write_budget_floor(r) for r in Reason}
    assert floors == {Reason.COLD: 0.0, Reason.AGENT_SYSTEM: 0.0, Reason.AGENT_SESSION: 0.1,
                      Reason.SHUTDOWN: 0.25, Reason.EVICT: 0.5, Reason.CONTINUED: 0.5, Reason.UNKNOWN: 0.5}
    assert policy.write_budget_floor(99) == 0.5                  # an unknown reason value
    cap = 1000
    for r, f in floors.items():
        assert policy.write_allowed(r, 100, 100 + f * cap, cap)
        assert not policy.write_allowed(r, 100, 100 + f * cap - 1, cap)
    # Whatever the level, a save of more than it never goes ahead.
    assert not policy.write_allowed(Reason.COLD, 1001, 1000, cap)
    with pytest.raises(ValueError):
        policy.write_allowed(Reason.COLD, -1, 1000, cap)


def test_saves_are_skipped_in_order_of_value(tmp_path, clock, caplog):
    S = save_size(tmp_path)
    C = 10 * S + S // 2                      # floors: continued 5.25 S, shutdown 2.6 S, session 1.05 S
    d = tmp_path / "kv"
    with caplog.at_level(logging.INFO, logger="kvstore"), make_store(d, max_write_mb_per_hour=mb(C)) as s:
        save = Saver(s)
        assert s.write_budget_bytes == C
        got = [save(Reason.CONTINUED) is not None for _ in range(6)]
        assert got == [True] * 5 + [False]                          # down to half the bucket
        assert available(s) == C - 5 * S
        # Evict states and unknown reasons share the waypoints' floor; a
        # shutdown state and an anchor of the same size still go in.
        assert save(Reason.EVICT) is None and save(Reason.UNKNOWN) is None
        assert [save(Reason.SHUTDOWN) is not None for _ in range(3)] == [True, True, False]
        assert save(Reason.CONTINUED) is None
        assert [save(Reason.AGENT_SESSION) is not None for _ in range(3)] == [True, True, False]
        assert available(s) == C - 9 * S
        assert save(Reason.COLD) is not None                        # anchors last
        assert save(Reason.COLD) is None and save(Reason.AGENT_SYSTEM) is None
        assert available(s) == C - 10 * S == S // 2
        kinds = sorted((e.reason.name.lower(), e.tokens) for e in s.entries())
        assert [k for k, _ in kinds] == ["agent_session"] * 2 + ["cold"] + ["continued"] * 5 + ["shutdown"] * 2
        st, c = s.stats(), s.counters()
        assert st["stores_skipped_write_budget"] == c["stores_skipped_write_budget"] == 8
        assert st["saves"] == c["saves"] == 10 and c["bytes_written"] == 10 * S
        assert st["refused"] == 0                                  # skipped is not refused
        assert c["write_budget"] == st["write_budget"]
    lines = [r.getMessage() for r in caplog.records if "store_skipped" in r.getMessage()]
    assert len(lines) == 8
    assert lines[0] == f"kvstore: store_skipped reason=continued why=write_budget bytes={S} available={C - 5 * S}"
    assert {re.search(r"reason=(\S+)", x).group(1) for x in lines} == {
        "continued", "evict", "unknown", "shutdown", "agent_session", "cold", "agent_system"}
    assert "budget text" not in caplog.text                          # never the prompt


def test_the_bucket_refills_over_time(tmp_path, clock):
    S = save_size(tmp_path)
    C = 10 * S + S // 2
    with make_store(tmp_path / "kv", max_write_mb_per_hour=mb(C)) as s:
        save = Saver(s)
        while save(Reason.COLD) is not None:
            pass
        low = available(s)
        assert low < S
        clock[0] += 1800                                            # half an hour: half the capacity
        assert available(s) == low + C // 2
        assert save(Reason.CONTINUED) is None                       # still under the waypoints' floor
        assert save(Reason.COLD) is not None
        clock[0] += 3600                                            # a whole hour: full, never more
        assert available(s) == C
        clock[0] += 10 * 3600
        assert available(s) == C
        assert save(Reason.CONTINUED) is not None
        assert available(s) == C - S


def test_refill_arithmetic():
    cap = 1000                                     # 1000 bytes an hour: one every 3.6 s
    assert counters.refill(0, 0, cap, 5_000_000) == (cap, 5_000_000)   # a new bucket starts full
    one_step = counters.refill(0, 1, cap, 1 + 36_000_000)
    assert one_step[0] == 10
    level, ts = 0, 1
    for k in range(1, 37):                         # refilled every second: no fraction lost
        level, ts = counters.refill(level, ts, cap, 1 + k * 1_000_000)
    assert level == 10
    assert counters.refill(500, 10_000_000, cap, 9_000_000) == (500, 9_000_000)   # the clock went back
    assert counters.refill(5000, 10_000_000, cap, 10_000_000) == (cap, 10_000_000)  # clamped to this capacity


def test_another_capacity_clamps_the_level(tmp_path, clock):
    d = tmp_path / "kv"
    with make_store(d, max_write_mb_per_hour=8) as big:
        assert available(big) == 8 * MIB
        with make_store(d, max_write_mb_per_hour=2) as small:
            assert small.stats()["write_budget"]["capacity_bytes"] == 2 * MIB
            assert available(small) == 2 * MIB
            assert available(big) == 2 * MIB                        # one bucket: its level went down
            assert big.counters()["write_budget"]["capacity_bytes"] == 8 * MIB        # its own
            assert counters.read_directory(d)["write_budget"]["capacity_bytes"] == 2 * MIB   # the last writer's


# ---- what a skip leaves ------------------------------------------------------------------

def test_a_skipped_save_leaves_no_file_and_no_temporary(tmp_path, clock):
    S = save_size(tmp_path)
    d = tmp_path / "kv"
    with make_store(d, max_write_mb_per_hour=mb(S + S // 2)) as s:
        assert s.save("the anchor", [1, 2, 3], tensors(), reason=Reason.COLD) is not None
        before = checkpoint_files(d, temporaries=True)
        assert s.save("a waypoint", [1, 2, 3], tensors(1), reason=Reason.CONTINUED) is None
        fut = s.save_async("a waypoint too", [1, 2, 3], tensors(2), reason=Reason.CONTINUED)
        assert fut.result() is None                                  # decided on the writer thread
        assert s.save("another anchor", [1, 2, 3], tensors(3), reason=Reason.COLD) is None
        s.flush()
        assert checkpoint_files(d, temporaries=True) == before
        assert [n for n in os.listdir(d) if ".tmp." in n] == []
        assert s.find("a waypoint, and more") is None
        st, c = s.stats(), s.counters()
        assert st["stores_skipped_write_budget"] == c["stores_skipped_write_budget"] == 3
        assert st["save_errors"] == 0 and c["saves"] == 1


def test_a_chain_takes_only_its_new_blocks(tmp_path, clock):
    d = tmp_path / "kv"
    words = [f"w{i} ".encode() for i in range(12)]
    offsets = [0]
    for w in words:
        offsets.append(offsets[-1] + len(w))
    text = b"".join(words)

    def kv(n):
        return {"k": np.arange(2 * n * 8, dtype=np.float16).reshape(1, 2, n, 8),
                "v": np.ones((1, 2, n, 8), dtype=np.float16)}
    with make_store(d, layout="chain", block_tokens=4, max_write_mb_per_hour=64) as s:
        full = available(s)
        first = s.save(text[:offsets[8]], np.arange(8), kv(8), positional={"k": 2, "v": 2},
                       text_offsets=offsets[:9])
        blocks = {e.name: e.file_size for e in s.entries()}
        assert first is not None and len(blocks) == 2
        assert full - available(s) == sum(blocks.values()) == s.counters()["bytes_written"]
        mid = available(s)
        longer = s.save(text, np.arange(12), kv(12), positional={"k": 2, "v": 2}, text_offsets=offsets)
        new = {e.name: e.file_size for e in s.entries() if e.name not in blocks}
        assert longer is not None and list(new) == [longer.name]        # one new block
        assert mid - available(s) == new[longer.name]                   # only its bytes
        assert s.counters()["bytes_written"] == sum(blocks.values()) + new[longer.name]
        assert s.stats()["bytes_saved"] == s.counters()["bytes_written"]
        mid = available(s)
        assert s.save(text, np.arange(12), kv(12), positional={"k": 2, "v": 2},
                      text_offsets=offsets) is not None                 # all there: nothing taken
        assert available(s) == mid


def test_a_chain_is_skipped_whole(tmp_path, clock):
    d = tmp_path / "kv"
    words = [f"w{i} ".encode() for i in range(12)]
    offsets = [0]
    for w in words:
        offsets.append(offsets[-1] + len(w))
    kv = {"k": np.ones((1, 2, 12, 64), dtype=np.float16)}
    with make_store(d, layout="chain", block_tokens=4, max_write_mb_per_hour=mb(16 << 10)) as s:
        assert s.save(b"".join(words), np.arange(12), kv, positional={"k": 2}, text_offsets=offsets,
                      reason=Reason.CONTINUED) is None
        assert checkpoint_files(d, temporaries=True) == []             # no block of it either
        assert s.stats()["stores_skipped_write_budget"] == 1


# ---- many processes ----------------------------------------------------------------------

def _waypoints(path, capacity, first, n, q):
    try:
        with make_store(path, max_write_mb_per_hour=mb(capacity)) as s:
            # Texts of the Saver's length: every save is one size.
            stored = sum(s.save(f"budget text {first + i:05d}", [1, 2, 3], tensors(i),
                                reason=Reason.CONTINUED) is not None for i in range(n))
            q.put((stored, s.stats()["stores_skipped_write_budget"]))
    except BaseException as e:
        q.put(repr(e))


def test_two_processes_share_one_bucket(tmp_path):
    # Real time here: at about 20 bytes a second the bucket refills far less
    # than one save's bytes while the test runs.
    d = str(tmp_path / "kv")
    S = save_size(tmp_path)
    C = 10 * S + S // 2
    with make_store(d, max_write_mb_per_hour=mb(C)) as s:
        save = Saver(s)
        assert [save(Reason.CONTINUED) is not None for _ in range(2)] == [True, True]
        q = CTX.Queue()
        procs = [CTX.Process(target=_waypoints, args=(d, C, first, 8, q)) for first in (10000, 20000)]
        for p in procs:
            p.start()
        got = [q.get(timeout=120) for _ in procs]
        for p in procs:
            p.join(30)
        assert all(isinstance(g, tuple) for g in got), got
        # 2 here and 3 in the children: the bucket went down to the floor
        # once, not once per process.
        assert sum(g[0] for g in got) == 3 and sum(g[1] for g in got) == 13
        assert save(Reason.CONTINUED) is None
        assert save(Reason.COLD) is not None
        c = s.counters()
        assert c["saves"] == 6 and c["stores_skipped_write_budget"] == 14
