"""Pins (kvstore.pins, docs/semantics.md §19) through KVStore: a pinned prefix
outlives eviction that removes everything else, keeps a chain's earlier
blocks, survives a restart, expires, is refused past the budget's pinned
share, and bad input is refused by name."""

import json
import logging
import os
import time

import numpy as np
import pytest

import kvstore
from kvstore import Settings, PinRefused, pins
from kvhelpers import checkpoint_files, make_store

TENSORS = {"k": np.arange(4096, dtype=np.float32)}      # 16 KiB of data a file


def save_whole(store, text):
    return store.save(text, [1, 2, 3, 4], TENSORS)


def whole_store(path, budget_mb=0, **opts):
    return make_store(path, budget_mb=budget_mb, layout="whole", min_tokens=1, **opts)


def file_size(tmp_path):
    with whole_store(tmp_path / "probe") as s:
        return save_whole(s, "probe text").file_size


def mb(n_bytes):
    return n_bytes / 2**20


def present(store):
    return {e.sha for e in store.entries()}


def test_pinned_prefix_survives_an_eviction_that_removes_everything_else(tmp_path):
    size = file_size(tmp_path)
    d = tmp_path / "d"
    with whole_store(d, budget_mb=mb(4.5 * size)) as s:
        pinned = save_whole(s, "the system prompt everyone shares")
        p = s.pin("the system prompt everyone shares", 3600)
        assert p.sha == pinned.sha and p.bytes == pinned.file_size and p.until >= time.time() + 3599
        # The pinned file is the oldest and never hit: without the pin it
        # would be the first to go.
        others = [save_whole(s, f"request {i}") for i in range(12)]
        kept = present(s)
    assert pinned.sha in kept
    assert len(kept) <= 4 and {e.sha for e in others[:8]}.isdisjoint(kept)
    # The pin is the directory's, not the store's.
    with whole_store(d, budget_mb=0) as s:
        assert [q.sha for q in s.pins()] == [pinned.sha]


def test_pins_survive_a_restart_and_bind_every_process(tmp_path):
    size = file_size(tmp_path)
    d = tmp_path / "d"
    with whole_store(d) as s:
        pinned = save_whole(s, "pinned before the restart")
        s.pin(b"pinned before the restart", "1h", tenant="ab" * 8)
    assert (d / pins.PINS).exists() and os.stat(d / pins.PINS).st_mode & 0o777 == 0o600
    # Another process, with a budget that holds two files, saving five more.
    with whole_store(d, budget_mb=mb(2.5 * size)) as s:
        assert [(q.sha, q.tenant) for q in s.pins()] == [(pinned.sha, "ab" * 8)]
        for i in range(5):
            save_whole(s, f"after restart {i}")
        assert pinned.sha in present(s)


def test_a_pin_keeps_the_chain_blocks_before_it(tmp_path):
    d = tmp_path / "d"
    text = b"".join(f"t{i:03d} ".encode() for i in range(16))            # 16 tokens, 5 bytes each
    offsets = [5 * i for i in range(17)]
    kv = np.arange(16 * 64, dtype=np.float32).reshape(1, 1, 16, 64)
    with make_store(d, budget_mb=0, layout="chain", block_tokens=4, min_tokens=1) as s:
        leaf = s.save(text, np.arange(16, dtype=np.uint32), {"k": kv}, positional={"k": 2}, text_offsets=offsets)
        blocks = {e.sha: e for e in s.entries()}
        assert len(blocks) == 4 and leaf.is_block
        p = s.pin(text, 600)
        assert p.bytes == sum(e.file_size for e in blocks.values())
        size = max(e.file_size for e in blocks.values())
    # Over a budget of one block, with other files to choose from: none of the chain goes.
    with make_store(d, budget_mb=mb(size), layout="whole", min_tokens=1) as s:
        for i in range(3):
            save_whole(s, f"another {i}")
        assert set(blocks) <= present(s)
        ck = s.load(s.find(text + b" and more"))
        assert ck.entry.tokens == 16 and np.array_equal(ck.tensors["k"], kv)


def test_pins_past_the_share_are_refused_and_no_pin_is_removed_for_them(tmp_path):
    size = file_size(tmp_path)
    d = tmp_path / "d"
    # Room for 10 files; pins may keep half: 5.
    with whole_store(d, budget_mb=mb(10 * size), max_pinned_share=0.5) as s:
        granted = []
        for i in range(5):
            save_whole(s, f"pin me {i}")
            granted.append(s.pin(f"pin me {i}", 300).sha)
        save_whole(s, "one too many")
        with pytest.raises(PinRefused) as e:
            s.pin("one too many", 300)
        assert e.value.reason == "share"
        assert "pinned share" in str(e.value) and str(int(0.5 * s.budget_bytes)) in str(e.value)
        assert sorted(q.sha for q in s.pins()) == sorted(granted)
        # Pinning one already pinned again adds nothing, so it is granted.
        assert s.pin("pin me 0", 600).sha == granted[0]
        assert set(granted) <= present(s)


def test_zero_share_refuses_every_pin(tmp_path):
    with whole_store(tmp_path / "d", budget_mb=10, max_pinned_share=0) as s:
        save_whole(s, "anything")
        with pytest.raises(PinRefused, match="pinned share"):
            s.pin("anything", 60)
        assert s.pins() == []


def test_a_lifetime_past_the_limit_is_cut_to_it_and_a_pin_is_extended_never_shortened(tmp_path):
    with whole_store(tmp_path / "d", max_pin_ttl_s=600) as s:
        save_whole(s, "capped")
        t0 = time.time()
        p = s.pin("capped", "1h")
        assert t0 + 599 <= p.until <= time.time() + 601
        s2 = whole_store(tmp_path / "d2")
        with s2:
            save_whole(s2, "long")
            long = s2.pin("long", 3600).until
            assert s2.pin("long", 60).until == long            # never shortened
            assert s2.pin("long", 7200).until >= long + 3599   # extended


def test_an_expired_pin_no_longer_protects(tmp_path, monkeypatch):
    size = file_size(tmp_path)
    d = tmp_path / "d"
    with whole_store(d) as s:
        pinned = save_whole(s, "short-lived pin")
        s.pin("short-lived pin", 60)
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + 120)
    with whole_store(d, budget_mb=mb(1.5 * size)) as s:
        assert s.pins() == []
        save_whole(s, "newer")
        assert pinned.sha not in present(s)


def test_a_pinned_file_outlives_the_maximum_age(tmp_path, monkeypatch):
    d = tmp_path / "d"
    with whole_store(d) as s:
        pinned = save_whole(s, "kept past the age")
        loose = save_whole(s, "not pinned")
        s.pin("kept past the age", 3 * 3600)
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + 3600)
    with make_store(d, budget_mb=0, layout="whole", max_age_s=600) as s:
        kept = present(s)
    assert pinned.sha in kept and loose.sha not in kept


def test_refused_pins_name_what_is_wrong(tmp_path):
    with whole_store(tmp_path / "d") as s:
        save_whole(s, "stored prefix")
        with pytest.raises(PinRefused) as e:
            s.pin("stored prefix and more", 60)           # no file holds exactly this
        assert e.value.reason == "not_stored"
        with pytest.raises(PinRefused):
            s.pin("stored", 60)                           # a prefix of a file is not a file
        for bad in ("10m", "", 0, -5, float("nan"), float("inf"), True, None):
            with pytest.raises(ValueError, match="ttl"):
                s.pin("stored prefix", bad)
        assert s.pins() == []


def test_options_refuse_bad_pin_settings():
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="max_pinned_share"):
            Settings(max_pinned_share=bad)
    for bad in (0, -1, float("inf")):
        with pytest.raises(ValueError, match="max_pin_ttl_s"):
            Settings(max_pin_ttl_s=bad)
    with pytest.raises(TypeError, match="max_pinned_share"):
        Settings(max_pinned_share="half")


def test_wipe_and_unpin_lift_pins(tmp_path):
    with whole_store(tmp_path / "d") as s:
        a = save_whole(s, "wiped")
        b = save_whole(s, "unpinned")
        s.pin("wiped", 60)
        s.pin("unpinned", 60)
        assert s.wipe(a) == 1
        assert [q.sha for q in s.pins()] == [b.sha]
        assert s.unpin(b) is True and s.unpin(b) is False
        assert s.pins() == []
        assert json.loads((tmp_path / "d" / pins.PINS).read_text()) == {}


def test_a_damaged_pins_file_only_unpins(tmp_path, caplog):
    size = file_size(tmp_path)
    d = tmp_path / "d"
    with whole_store(d) as s:
        pinned = save_whole(s, "pinned")
        s.pin("pinned", 3600)
    (d / pins.PINS).write_bytes(b"{not json")
    caplog.set_level(logging.WARNING, logger="kvstore")
    with whole_store(d, budget_mb=mb(1.5 * size)) as s:
        save_whole(s, "newer")
        assert pinned.sha not in present(s)
    assert "pins_unreadable" in caplog.text
    rows = {"0" * 40: {"until": "soon"}, "zz": {}, "1" * 40: {"until": 2**40, "tenant": "not hex"}}
    (d / pins.PINS).write_text(json.dumps(rows))
    assert pins.read_pins(str(d), time.time()) == {}


def test_pins_hold_tags_and_names_only(tmp_path):
    secret = "a prompt nobody may read back"
    with whole_store(tmp_path / "d") as s:
        save_whole(s, secret)
        s.pin(secret, 60, tenant="0f" * 8)
    raw = (tmp_path / "d" / pins.PINS).read_text()
    assert secret not in raw and "prompt" not in raw
    assert set(json.loads(raw)) == {n[:-3] for n in checkpoint_files(tmp_path / "d")}


def test_pin_on_a_closed_store_is_refused(tmp_path):
    s = whole_store(tmp_path / "d")
    s.close()
    with pytest.raises(kvstore.StoreClosed):
        s.pin("x", 60)


def test_kvstore_evict_spares_pins_in_the_dry_run_and_the_real_run(tmp_path, capsys):
    from kvstore import cli
    size = file_size(tmp_path)
    d = tmp_path / "d"
    with whole_store(d) as s:
        pinned = save_whole(s, "pinned through the command line")
        s.pin("pinned through the command line", 3600)
        others = [save_whole(s, f"other {i}") for i in range(4)]
    budget = f"{mb(1.5 * size):.6f}"
    assert cli.main(["evict", str(d), "--budget-mb", budget, "--dry-run"]) == 0
    dry = capsys.readouterr().out
    assert pinned.sha[:12] not in dry and all(o.sha[:12] in dry for o in others)
    assert cli.main(["evict", str(d), "--budget-mb", budget]) == 0
    assert set(n[:-3] for n in checkpoint_files(d)) == {pinned.sha}
