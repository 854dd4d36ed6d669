"""Agent sessions (docs/semantics.md §9): save with a title, list, switch by hash prefix."""

import functools
import os

import numpy as np
import pytest

import kvstore
from kvstore import sessions
from kvstore.errors import AmbiguousSession, KVStoreError, SessionNotFound
from kvstore.format import ExtFlag, Reason, read_entry

from kvhelpers import colliding_texts, flip, make_store, make_tensors

# This file's saves: k (1, n, 4) float16 and v (1, n, 4) float32.
tensors = functools.partial(make_tensors, shape=(1, "n", 4))


def set_created(path, t):
    with open(path, "r+b") as f:
        f.seek(24)
        f.write(int(t).to_bytes(8, "little"))


def test_save_stores_session_with_title_and_system_checkpoint(store):
    sys_t = tensors(8, 1)
    e = sessions.save(store, "system prompt + conversation", np.arange(20), tensors(20), meta={"m": 1},
                      title="refactor the reader", system_text="system prompt", system_tokens=np.arange(8),
                      system_tensors=sys_t, system_meta={"s": 2})
    assert e.reason == Reason.AGENT_SESSION and e.ext_flags & ExtFlag.SESSION_TITLE
    assert sessions.read_title(e) == "refactor the reader"
    by_reason = {x.reason: x for x in store.entries()}
    assert set(by_reason) == {Reason.AGENT_SESSION, Reason.AGENT_SYSTEM}
    system = by_reason[Reason.AGENT_SYSTEM]
    assert system.tokens == 8 and sessions.read_title(system) is None
    # The system checkpoint is an ordinary lookup target for new sessions.
    hit = store.find("system prompt, then another conversation")
    assert hit is not None and hit.sha == system.sha
    ck = store.load(hit)
    assert ck.meta == {"s": 2} and np.array_equal(ck.tensors["v"], sys_t["v"])


def test_sessions_ignore_min_tokens_system_checkpoints_do_not(tmp_path):
    s = make_store(tmp_path / "kv", min_tokens=512)
    e = sessions.save(s, "short session", np.arange(20), tensors(20), title="tiny",
                      system_text="short", system_tokens=np.arange(5), system_tensors=tensors(5))
    assert e is not None and e.tokens == 20
    assert [x.reason for x in s.entries()] == [Reason.AGENT_SESSION]   # the system one was refused
    assert s.load(e) is None                                   # a lookup load keeps the rule...
    ck = sessions.switch(s, e.sha[:6])                         # ...a switch by name does not
    assert ck.tokens.tolist() == list(range(20))
    s.close()


def test_list_is_sessions_only_newest_first(store):
    store.save("a cold checkpoint", np.arange(10), tensors(10))
    a = sessions.save(store, "session a", np.arange(10), tensors(10), title="A")
    b = sessions.save(store, "session b", np.arange(12), tensors(12))
    c = sessions.save(store, "session c", np.arange(14), tensors(14), title="C")
    for e, t in ((a, 1_700_000_300), (b, 1_700_000_100), (c, 1_700_000_200)):
        set_created(e.path, t)
    fresh = make_store(store.path)                              # headers were edited behind the index
    got = sessions.list(fresh)
    assert [s.sha for s in got] == [a.sha, c.sha, b.sha]
    assert [s.title for s in got] == ["A", "C", None]
    assert [s.tokens for s in got] == [10, 14, 12]
    assert got[0].prefix == a.sha[:12] and got[0].hits == 0 and got[0].last_used == 0
    assert got[0].created_at == 1_700_000_300
    fresh.close()


def test_switch_loads_by_prefix_counts_a_hit_and_keeps_the_file(tmp_path):
    s = make_store(tmp_path / "kv", min_tokens=1, cold_max_tokens=10)
    t = tensors(50, 7)
    e = sessions.save(s, "a long session", np.arange(50), t, meta={"cache": ["KVCache"]}, title="long")
    for prefix in (e.sha[:4], e.sha[:9].upper(), e.sha):
        ck = sessions.switch(s, prefix)
        assert ck.entry.sha == e.sha and ck.meta == {"cache": ["KVCache"]}
        assert np.array_equal(ck.tensors["k"], t["k"]) and np.array_equal(ck.tensors["v"], t["v"])
        assert ck.trailers[3] == "long"
    assert os.path.exists(e.path)                  # 50 > cold_max_tokens, and still not consumed
    info = sessions.list(s)[0]
    assert info.hits == 3 and info.last_used > 0
    s.close()


def test_switch_into_mlx(store):
    mx = pytest.importorskip("mlx.core")
    t = tensors(6, 2)
    e = sessions.save(store, "mlx session", np.arange(6), t)
    ck = sessions.switch(store, e.sha[:8], into="mlx")
    assert isinstance(ck.tensors["k"], mx.array)
    assert np.array_equal(np.array(ck.tensors["v"]), t["v"])


def test_unknown_ambiguous_and_malformed_prefixes(store):
    cold = store.save("not a session", np.arange(4), tensors(4))
    a, b = colliding_texts(4)
    ea = sessions.save(store, a, np.arange(4), tensors(4))
    eb = sessions.save(store, b, np.arange(4), tensors(4))
    assert ea.sha[:4] == eb.sha[:4] and ea.sha != eb.sha
    with pytest.raises(AmbiguousSession) as exc:
        sessions.switch(store, ea.sha[:4])
    assert isinstance(exc.value, LookupError) and isinstance(exc.value, KVStoreError)
    assert set(exc.value.matches) == {ea.sha, eb.sha}
    assert ea.sha[:12] in str(exc.value) and eb.sha[:12] in str(exc.value)
    # One more digit tells them apart (unless they share it too).
    n = next(i for i in range(5, 41) if ea.sha[:i] != eb.sha[:i])
    assert sessions.switch(store, ea.sha[:n]).entry.sha == ea.sha
    missing = next(p for p in ("0000", "ffff", "abcd", "1234") if not any(
        e.sha.startswith(p) for e in store.entries()))
    with pytest.raises(SessionNotFound) as exc:
        sessions.switch(store, missing)
    assert isinstance(exc.value, LookupError) and isinstance(exc.value, KVStoreError)
    with pytest.raises(SessionNotFound):
        sessions.switch(store, cold.sha[:10])        # a cache checkpoint is not a session
    for bad in ("abc", "xyz1", "a" * 41, ""):
        with pytest.raises(ValueError):
            sessions.switch(store, bad)
    with pytest.raises(TypeError):
        sessions.switch(store, 1234)


def test_switch_explains_a_session_this_store_cannot_load(tmp_path):
    d = tmp_path / "kv"
    other = make_store(d, model_id=3)
    e = sessions.save(other, "model 3 session", np.arange(4), tensors(4))
    other.close()
    s = make_store(d)
    assert [x.sha for x in sessions.list(s)] == [e.sha]         # listed...
    with pytest.raises(SessionNotFound, match="model id 3"):
        sessions.switch(s, e.sha[:8])                           # ...not loadable here
    assert os.path.exists(e.path)
    s.close()


def test_corrupt_session_is_removed_and_reported(store):
    e = sessions.save(store, "fragile", np.arange(4), tensors(4))
    flip(e.path, e.trailer_offset - 1)
    with pytest.raises(SessionNotFound, match="vanished or was corrupt"):
        sessions.switch(store, e.sha[:8])
    assert not os.path.exists(e.path)


def test_resave_promotes_a_cached_checkpoint_and_updates_the_title(store):
    cold = store.save("same text", np.arange(6), tensors(6))
    assert sessions.list(store) == []
    e = sessions.save(store, "same text", np.arange(6), tensors(6), title="first")
    assert e.sha == cold.sha and e.reason == Reason.AGENT_SESSION
    assert read_entry(e.path).reason == Reason.AGENT_SESSION
    assert [(x.sha, x.title) for x in sessions.list(store)] == [(e.sha, "first")]
    sessions.save(store, "same text", np.arange(6), tensors(6), title="renamed")
    assert sessions.list(store)[0].title == "renamed"
    sessions.save(store, "same text", np.arange(6), tensors(6))          # no title: kept
    assert sessions.list(store)[0].title == "renamed"
    store.save("same text", np.arange(6), tensors(6), reason=Reason.CONTINUED)   # never demoted
    assert read_entry(e.path).reason == Reason.AGENT_SESSION


def test_bad_arguments_write_nothing(store):
    with pytest.raises(ValueError):
        sessions.save(store, "s", np.arange(4), tensors(4), title="x" * 5000,
                      system_text="sys", system_tokens=np.arange(2), system_tensors=tensors(2))
    with pytest.raises(TypeError):
        sessions.save(store, "s", np.arange(4), tensors(4), title=b"bytes")
    with pytest.raises(ValueError, match="together"):
        sessions.save(store, "s", np.arange(4), tensors(4), system_text="sys")
    assert store.entries() == []


def test_bad_title_section_is_dropped_session_still_loads(store):
    e = sessions.save(store, "titled", np.arange(4), tensors(4), title="label")
    flip(e.path, e.file_size - 1)                               # inside the title body
    assert sessions.read_title(read_entry(e.path)) is None
    assert sessions.list(store)[0].title is None
    ck = sessions.switch(store, e.sha[:8])
    assert ck.tokens.tolist() == [0, 1, 2, 3] and 3 not in ck.trailers


def test_list_reads_headers_fresh(store):
    """Hits land in place (another process); the index may not have seen them."""
    e = sessions.save(store, "busy", np.arange(4), tensors(4))
    store.entries()
    for _ in range(4):
        kvstore.format.touch(e.path)
    assert sessions.list(store)[0].hits == 4
