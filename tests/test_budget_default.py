"""The default disk budget, derived from the directory's filesystem, and the
warning when one session's chain takes more than half the budget
(docs/semantics.md §8)."""

import logging
import shutil

import numpy as np
import pytest

from kvstore import files, policy
from kvstore.policy import default_budget_bytes
from kvstore.settings import DEFAULT_BUDGET_MAX_BYTES, DEFAULT_BUDGET_MIN_BYTES

from kvhelpers import make_store

GiB = 1 << 30


@pytest.mark.parametrize("filesystem, budget", [
    (0, DEFAULT_BUDGET_MIN_BYTES),                   # floors at 4 GiB
    (39 * GiB, DEFAULT_BUDGET_MIN_BYTES),            # 10 % would be 3.9 GiB
    (100 * GiB, 10 * GiB),
    (252 * GiB, int(252 * GiB * 0.1)),
    (640 * GiB, 64 * GiB),
    (8 << 40, DEFAULT_BUDGET_MAX_BYTES),             # caps at 64 GiB
])
def test_default_budget_is_a_tenth_of_the_filesystem_within_bounds(filesystem, budget):
    assert default_budget_bytes(filesystem) == budget


def test_default_budget_refuses_a_negative_size():
    with pytest.raises(ValueError, match="filesystem_bytes"):
        default_budget_bytes(-1)


def test_a_store_without_budget_derives_it_from_its_filesystem(tmp_path, monkeypatch):
    with make_store(tmp_path / "real") as s:
        assert s.budget_bytes == default_budget_bytes(shutil.disk_usage(tmp_path).total)
        assert s.budget_derived and s.stats()["budget_derived"] is True
    # The filesystem's size is the one input: a larger disk, a larger budget.
    monkeypatch.setattr(files, "filesystem_bytes", lambda path: 300 * GiB)
    with make_store(tmp_path / "big") as s:
        assert s.budget_bytes == 30 * GiB and s.budget_derived


def test_a_budget_given_is_kept_and_not_derived(tmp_path, monkeypatch):
    monkeypatch.setattr(files, "filesystem_bytes", lambda path: pytest.fail("a set budget reads no filesystem"))
    with make_store(tmp_path / "kv", budget_mb=100) as s:
        assert s.budget_bytes == 100 << 20 and not s.budget_derived
        assert s.stats()["budget_derived"] is False
    with make_store(tmp_path / "kv", budget_mb=0) as s:
        assert s.budget_bytes == 0 and not s.budget_derived     # unlimited, as before


def test_setting_the_budget_replaces_the_derived_one(tmp_path):
    with make_store(tmp_path / "kv") as s:
        s.budget_bytes = 5 << 20
        assert s.budget_bytes == 5 << 20 and not s.budget_derived


@pytest.mark.parametrize("bad", [-1, float("nan"), -0.5])
def test_a_bad_budget_is_an_error_naming_it(tmp_path, bad):
    with pytest.raises(ValueError, match=r"budget_mb="):
        make_store(tmp_path / "kv", budget_mb=bad)


def _save(s, n, text=b"w" * 10_000, row=4096):
    """A chain of n tokens, 4 KiB of KV a token (10 bytes of text each)."""
    kv = np.ones((n, row // 4), dtype=np.float32)
    return s.save(text[:n * 10], list(range(n)), {"kv": kv}, positional={"kv": 0},
                  text_offsets=lambda i: i * 10)


@pytest.mark.store_args(layout="chain", block_tokens=64, budget_mb=4)
def test_a_chain_past_half_the_budget_is_logged_and_counted_once(store, caplog):
    caplog.set_level(logging.INFO, logger="kvstore")
    assert _save(store, 256) is not None                       # ~1 MiB: under half of 4 MiB
    assert store.stats()["chains_over_half_budget"] == 0
    assert _save(store, 640) is not None                       # ~2.5 MiB: past half
    assert store.stats()["chains_over_half_budget"] == 1
    lines = [r.getMessage() for r in caplog.records if "chain_over_half_budget" in r.getMessage()]
    assert len(lines) == 1 and "tokens=640" in lines[0] and f"budget={4 << 20}" in lines[0]
    assert "www" not in lines[0]                               # no prompt text in the log
    assert _save(store, 704) is not None                       # still over half: not counted again
    assert store.stats()["chains_over_half_budget"] == 1


@pytest.mark.store_args(layout="chain", block_tokens=64, budget_mb=0)
def test_an_unlimited_budget_never_warns(store):
    assert _save(store, 640) is not None
    assert store.stats()["chains_over_half_budget"] == 0


def test_over_half_budget_is_the_crossing_only():
    assert policy.over_half_budget(40, 60, 100)
    assert policy.over_half_budget(50, 51, 100)
    assert not policy.over_half_budget(51, 60, 100)            # already over
    assert not policy.over_half_budget(10, 50, 100)            # exactly half is not over
    assert not policy.over_half_budget(0, 10 ** 12, 0)         # unlimited
