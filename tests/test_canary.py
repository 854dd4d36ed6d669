"""The canary (kvstore/mlx/canary.py): a restored state checked against the live model.

Every architecture's own state passes and another model's fails in
test_mlx_architectures.py, and the whole paths (PromptCache, kvstore serve)
in test_mlx.py and test_serve.py.  Here: the rules one by one, on a small
llama: the distance and its tolerance per dtype, a stored KV dtype the model
does not write, quantised KV caches, the head canary of a cache that cannot
go back a token, and what a verdict logs.
"""

import dataclasses

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

import backend  # noqa: E402

from mlx_lm.models import cache as mlc  # noqa: E402

from kvstore.demo import model as mlx_model  # noqa: E402
from kvstore.mlx import canary, tensors_to_cache  # noqa: E402
from kvstore.mlx.codecs import cache_state  # noqa: E402

LLAMA = dict(layers=2, hidden=64, heads=2, kv_heads=1, head_dim=32)
N = 96


@pytest.fixture(scope="module")
def ids():
    rng = np.random.default_rng(11)
    return [int(i) for i in rng.integers(len(mlx_model.SPECIAL_TOKENS), mlx_model.VOCAB_SIZE, N)]


def filled(model, ids, quantize_bits=None):
    cache = mlx_model.make_cache(model)
    mlx_model.prefill(model, cache, ids, step=32)
    if quantize_bits:
        cache = [c.to_quantized(group_size=32, bits=quantize_bits) for c in cache]
    return cache


def copy_of(cache, dtype=None):
    """A restore of cache: its state through the codec, as a load would give it (optionally cast)."""
    tensors, meta, _ = cache_state(cache)
    tensors = {k: mx.array(v if dtype is None or not mx.issubdtype(v.dtype, mx.floating) else v.astype(dtype))
               for k, v in tensors.items()}
    mx.eval(tensors)
    return tensors_to_cache(tensors, meta)


def test_own_state_passes_the_tail_canary_and_the_cache_holds_every_token_again(ids):
    model = mlx_model.make_model(seed=0, **LLAMA)
    restored = copy_of(filled(model, ids))
    v = canary.check(model, restored, ids)
    assert v.ok and v.kind == "tail" and v.applies and v.compared == 4      # 2 layers x keys, values
    assert v.distance <= backend.own_state_bound()
    assert all(c.offset == N for c in restored)
    assert "canary=tail" in v.words() and "distance=" in v.words()


def test_another_models_state_fails_and_says_which_slot(ids):
    model = mlx_model.make_model(seed=0, **LLAMA)
    other = mlx_model.make_model(seed=1, **LLAMA)
    v = canary.check(model, copy_of(filled(other, ids)), ids)
    assert not v.ok and v.kind == "tail" and v.reason == "distance" and v.distance > 0.5
    assert v.worst in {"0.0", "0.1", "1.0", "1.1"}
    assert "why=distance" in v.words()


def test_a_state_in_another_kv_dtype_fails_on_its_dtype(ids):
    # The same weights' state, cast to float16: the distance alone is small
    # (the recomputed row is written back into the float16 buffer), the
    # dtype is not the model's.
    model = mlx_model.make_model(seed=0, **LLAMA)
    v = canary.check(model, copy_of(filled(model, ids), mx.float16), ids)
    assert not v.ok and v.reason == "dtype"
    assert canary.kv_dtypes(model) == {"float32"}


def test_a_replaced_last_block_fails():
    # Damage a canary is for: the rows before the last token came from
    # another state (a spliced chain), so the recomputed row differs.
    model = mlx_model.make_model(seed=0, **LLAMA)
    rng = np.random.default_rng(3)
    a = [int(i) for i in rng.integers(10, 500, N)]
    b = a[:N // 2] + [int(i) for i in rng.integers(10, 500, N // 2)]
    tensors, meta, positional = cache_state(filled(model, a))
    other, _, _ = cache_state(filled(model, b))
    spliced = {k: mx.concatenate([tensors[k][..., :N // 2, :], other[k][..., N // 2:, :]], axis=2)
               if k in positional else tensors[k] for k in tensors}
    mx.eval(spliced)
    v = canary.check(model, tensors_to_cache(spliced, meta), a)
    assert not v.ok and v.reason == "distance"


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_kv_caches_compare_dequantized_rows(ids, bits):
    model = mlx_model.make_model(seed=0, **LLAMA)
    other = mlx_model.make_model(seed=1, **LLAMA)
    own = copy_of(filled(model, ids, bits))
    assert all(type(c) is mlc.QuantizedKVCache for c in own)
    rows = canary.rows(own, N - 1, N)
    assert sorted(rows) == ["0.0", "0.3", "1.0", "1.3"]           # keys and values, dequantised
    assert all(kind == "q:float32" and r.shape == (1, 1, 1, 32) for kind, r in rows.values())
    v = canary.check(model, own, ids)
    assert v.ok and v.kind == "tail", v
    v = canary.check(model, copy_of(filled(other, ids, bits)), ids)
    assert not v.ok and v.distance > canary.QUANTIZED_TOLERANCE, v


def test_a_cache_that_cannot_go_back_gets_the_head_canary(ids):
    # A sliding-window layer whose window has wrapped cannot be trimmed:
    # the first HEAD_TOKENS tokens are recomputed from nothing and compared
    # in the full-attention layer, which keeps them.
    kw = dict(LLAMA, sliding_window=16)
    model = mlx_model.make_model(seed=0, **kw)
    other = mlx_model.make_model(seed=1, **kw)
    own = filled(model, ids)
    assert not mlc.can_trim_prompt_cache(own)
    v = canary.check(model, own, ids)
    assert v.ok and v.kind == "head" and v.compared == 2, v       # the full-attention layer's keys, values
    v = canary.check(model, filled(other, ids), ids)
    assert not v.ok and v.kind == "head", v


def test_no_positional_rows_means_not_applicable():
    # A state with nothing to compare (every layer a window that has wrapped).
    model = mlx_model.make_model(seed=0, **LLAMA)
    cache = mlx_model.rotating_cache(model, 16, keep=0)
    mlx_model.prefill(model, cache, list(range(10, 60)), step=16)
    v = canary.check(model, cache, list(range(10, 60)))
    assert v.ok and not v.applies and v.kind == "none" and v.words() == "canary=none"


def test_compare_rules():
    s = {"0.0": ("float16", np.ones((1, 2, 1, 4), np.float32))}
    assert canary.compare(s, s).ok and canary.compare(s, s).distance == 0
    near = {"0.0": ("float16", np.full((1, 2, 1, 4), 1.01, np.float32))}
    far = {"0.0": ("float16", np.full((1, 2, 1, 4), 1.5, np.float32))}
    assert canary.compare(s, near).ok                         # 1% < float16's 2.5%
    assert not canary.compare(s, far).ok
    assert not canary.compare({"0.0": ("float32", s["0.0"][1])}, {"0.0": ("float32", near["0.0"][1])}).ok
    assert canary.compare(s, s, kv_dtypes={"bfloat16"}).reason == "dtype"
    assert canary.compare(s, {"9.9": s["0.0"]}).kind == "none"           # nothing in common
    assert dataclasses.replace(canary.compare(s, far), kind="tail").words().endswith("why=distance")
