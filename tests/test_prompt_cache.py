"""PromptCache policy (docs/semantics.md §7) on a byte-level toy engine.

The toy engine's tokens are bytes and its "KV state" is the list of tokens it
has prefilled, so every restore can be checked exactly: the state loaded from
disk must be the tokens of the stored text.  Byte 0x01 opens a user turn and
0x02 an assistant turn.  The MLX engine runs the same flows in test_mlx.py.
"""

import numpy as np
import pytest

import kvstore
from kvstore.settings import Settings
from kvstore import policy
from kvstore.prompt_cache import PromptCache
from kvhelpers import ToyEngine, stored

USER, ASSISTANT = 1, 2

OPTS = Settings(min_tokens=64, cold_max_tokens=5000, continued_interval_tokens=200,
                       boundary_trim_tokens=8, boundary_align_tokens=64)
STEP = 64          # prefill step == alignment, as ds4 uses 2048 for both

# The store fixture (conftest.py), with this file's options and a 64 MB budget.
pytestmark = pytest.mark.store_args(settings=OPTS, budget_mb=64)


def chat(system, *turns):
    """Renders system + alternating user/assistant turns as bytes."""
    out = bytes(system)
    for i, t in enumerate(turns):
        out += bytes([USER if i % 2 == 0 else ASSISTANT]) + t
    return out


def text(n, seed):
    rng = np.random.default_rng(seed)
    return bytes(rng.integers(32, 127, n, dtype=np.uint8))


def check_invariants(pc, engine, req):
    """The live state is exactly the effective prompt, and chunks end at aligned ends."""
    assert engine.state == req.tokens
    assert pc.live_tokens == req.tokens
    for start, n in engine.chunks:
        end = start + n
        assert end == len(req.tokens) or end % STEP == 0 or end == req.cold_target, (start, n)


def test_cold_store_at_the_chat_anchor(store):
    system = text(300, 1)
    prompt = chat(system, b"hello there", b"hi", b"how are you?")
    engine = ToyEngine()
    pc = PromptCache(store, engine, prefill_step=STEP)
    req = pc.begin(prompt)
    assert req.source == "none" and req.reused == 0
    # The last user marker before the first assistant marker is at len(system).
    assert req.cold_target == len(system) == policy.chat_anchor_pos(list(prompt), USER, ASSISTANT, OPTS)
    pc.prefill(req)
    check_invariants(pc, engine, req)
    # The waypoint at 256 (the continued step) comes first; the anchor at 300.
    assert stored(store) == [("cold", len(system)), ("continued", 256)]
    assert req.stored == [("continued", 256), ("cold", len(system))]
    assert store.find(prompt).text_bytes == len(system)


def test_cold_store_without_markers_uses_store_len(store):
    prompt = text(1000, 2)                     # no marker bytes (32..126)
    engine = ToyEngine()
    pc = PromptCache(store, engine, prefill_step=STEP)
    req = pc.begin(prompt)
    assert req.cold_target == policy.store_len(1000, OPTS) == 960   # (1000-8) // 64 * 64
    pc.prefill(req)
    check_invariants(pc, engine, req)
    assert stored(store) == [("cold", 960), ("continued", 256), ("continued", 512), ("continued", 768)]


def test_anchor_below_min_tokens_falls_back_to_store_len(store):
    prompt = chat(text(20, 3), text(700, 4), b"ok")      # user marker at 20 < min_tokens
    pc = PromptCache(store, ToyEngine(), prefill_step=STEP)
    req = pc.begin(prompt)
    assert req.cold_target == policy.store_len(len(prompt), OPTS)


def test_waypoints_at_every_continued_step(store):
    # continued step = 200 rounded up to the alignment 64 -> 256.
    assert policy.continued_step(OPTS) == 256
    prompt = text(1100, 5)
    engine = ToyEngine()
    pc = PromptCache(store, engine, prefill_step=STEP)
    req = pc.begin(prompt)
    pc.prefill(req)
    check_invariants(pc, engine, req)
    cold = policy.store_len(1100, OPTS)         # 1088, not on a 256 frontier
    assert stored(store) == sorted([("continued", 256), ("continued", 512), ("continued", 768),
                                    ("continued", 1024), ("cold", cold)])


def test_cold_anchor_on_the_frontier_suppresses_the_waypoint(store):
    prompt = chat(text(512, 6), text(300, 7), b"reply")   # anchor at 512 == 2 * 256
    pc = PromptCache(store, ToyEngine(), prefill_step=STEP)
    req = pc.begin(prompt)
    assert req.cold_target == 512 and len(prompt) == 819
    pc.prefill(req)
    assert stored(store) == [("cold", 512), ("continued", 256), ("continued", 768)]


def test_failed_cold_store_restores_the_waypoint(store, monkeypatch):
    prompt = chat(text(512, 8), text(300, 9), b"reply")
    real_save = store.save

    def refuse_cold(*a, **kw):
        if kw.get("reason") == kvstore.format.Reason.COLD:
            return None
        return real_save(*a, **kw)
    monkeypatch.setattr(store, "save", refuse_cold)
    pc = PromptCache(store, ToyEngine(), prefill_step=STEP)
    req = pc.begin(prompt)
    pc.prefill(req)
    assert stored(store) == [("continued", 256), ("continued", 512), ("continued", 768)]


def test_disk_hit_builds_the_effective_prompt_from_stored_tokens(store, tmp_path):
    system = text(400, 10)
    first = chat(system, b"question one", b"answer")
    pc = PromptCache(store, ToyEngine(), prefill_step=STEP)
    pc.prefill(pc.begin(first))

    # A new process (new PromptCache, new engine, same directory).
    engine2 = ToyEngine()
    with kvstore.KVStore(tmp_path / "kv", settings=OPTS, budget_mb=64) as store2:
        pc2 = PromptCache(store2, engine2, prefill_step=STEP)
        second = chat(system, b"a different question", b"x")
        req = pc2.begin(second)
        assert req.source == "disk"
        assert req.reused == len(system)
        assert req.tokens == list(second)
        assert engine2.state == list(system)          # exactly the stored state
        assert req.load_ms >= 0
        pc2.prefill(req)
        check_invariants(pc2, engine2, req)
        assert req.prefilled == len(second) - len(system)


def test_memory_hit_reuses_the_live_session(store):
    system = text(300, 11)
    turn1 = chat(system, b"first question")
    engine = ToyEngine()
    pc = PromptCache(store, engine, prefill_step=STEP)
    pc.prefill(pc.begin(turn1))
    pc.extend(list(b"\x02generated answer"))         # the engine generated these
    engine.state += list(b"\x02generated answer")
    turn2 = turn1 + b"\x02generated answer" + b"\x01second question"
    engine.chunks = []
    req = pc.begin(turn2)
    assert req.source == "memory"
    assert req.reused == len(turn1) + len(b"\x02generated answer")
    pc.prefill(req)
    check_invariants(pc, engine, req)
    assert req.prefilled == len(b"\x01second question")


def test_prompt_equal_to_the_live_text_refeeds_the_last_token(store):
    prompt = text(200, 12)
    engine = ToyEngine()
    pc = PromptCache(store, engine, prefill_step=STEP)
    pc.prefill(pc.begin(prompt))
    engine.chunks = []
    req = pc.begin(prompt)
    assert req.source == "memory"
    logits = pc.prefill(req)
    assert logits == ("logits", 200) and req.prefilled == 1
    check_invariants(pc, engine, req)


def test_evict_before_a_disk_load_replaces_the_live_session(store):
    a = chat(text(300, 13), b"session A question", b"ans")
    b = chat(text(500, 14), b"session B question", b"ans")
    pc = PromptCache(store, ToyEngine(), prefill_step=STEP)
    pc.prefill(pc.begin(b))                  # stores B's anchor (500)
    pc.prefill(pc.begin(a))                  # cold A: live is now A (full prompt)
    live_a = len(pc.live_tokens)
    before = stored(store)
    req = pc.begin(b + b"\x01more")          # disk hit on B replaces live A
    assert req.source == "disk"
    after = stored(store)
    assert ("evict", live_a) in after and ("evict", live_a) not in before


def test_small_live_session_is_not_evicted(store):
    pc = PromptCache(store, ToyEngine(), prefill_step=STEP)
    b = chat(text(500, 15), b"q", b"a")
    pc.prefill(pc.begin(b))
    pc.prefill(pc.begin(text(30, 16)))       # live session of 30 < min_tokens
    req = pc.begin(b + b"\x01more")
    assert req.source == "disk"
    assert all(r != "evict" for r, _ in stored(store))


def test_shutdown_stores_the_live_session(store):
    prompt = text(700, 17)
    pc = PromptCache(store, ToyEngine(), prefill_step=STEP)
    pc.prefill(pc.begin(prompt))
    pc.close()
    assert ("shutdown", 700) in stored(store)


def test_prompt_over_cold_max_tokens_gets_no_cold_store(tmp_path):
    opts = dict(min_tokens=64, cold_max_tokens=500, continued_interval_tokens=100_000,
                           boundary_trim_tokens=8, boundary_align_tokens=64)
    with kvstore.KVStore(tmp_path / "kv", **opts) as s:
        pc = PromptCache(s, ToyEngine(), prefill_step=STEP)
        req = pc.begin(text(800, 18))
        assert req.cold_target == 0
        pc.prefill(req)
        assert s.entries() == []


def test_store_skipped_mid_character(store):
    # A boundary inside a multi-byte character is not stored (its suffix could
    # not be tokenized on its own); the cut falls back to no store.
    prompt = ("€" * 400).encode()            # 1200 bytes of 3-byte characters
    engine = ToyEngine()
    pc = PromptCache(store, engine, prefill_step=STEP)
    req = pc.begin(prompt)
    pc.prefill(req)
    lengths = sorted(e.text_bytes for e in store.entries())
    # The waypoint frontiers 256, 512 and 1024 fall inside characters and are
    # skipped; 768 and the cold cut 1152 (multiples of 3) are stored.
    assert lengths == [768, 1152]
