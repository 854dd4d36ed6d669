"""mlx-lm caches <-> kvstore payloads (kvstore/mlx/codecs.py).

Every supported cache class goes through a real KVStore and back; caches
that a model fills are then continued with the original and the restored
cache side by side, and the logits must be bit-identical.
"""

import json
import os

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

import kvstore  # noqa: E402
from mlx_lm.models import cache as mlc  # noqa: E402

from kvstore import mlx as kvmlx  # noqa: E402
from kvstore.mlx.codecs import CACHE_CLASSES  # noqa: E402
from kvstore.mlx import cache_to_tensors, load_prompt_cache, save_prompt_cache, tensors_to_cache  # noqa: E402

from kvstore.demo import model as mlx_model  # noqa: E402


@pytest.fixture(scope="module")
def ids():
    """A fixed stream of non-special token ids: prompt, then continuation."""
    rng = np.random.default_rng(7)
    return [int(i) for i in rng.integers(len(mlx_model.SPECIAL_TOKENS), mlx_model.VOCAB_SIZE, 1200)]


def assert_same_cache(a, b):
    """Same classes, same meta (offsets, meta_state), same filled arrays bit for bit."""
    assert [type(x) for x in a] == [type(x) for x in b]
    ta, ma = cache_to_tensors(a)
    tb, mb = cache_to_tensors(b)
    assert ma == mb
    assert sorted(ta) == sorted(tb)
    for k in ta:
        assert ta[k].dtype == tb[k].dtype, k
        assert ta[k].shape == tb[k].shape, k
        assert mx.array_equal(ta[k], tb[k]).item(), k


def round_trip(store, tok, tokens, cache):
    """save_prompt_cache + load_prompt_cache with a longer prompt; checks what comes back."""
    text = tok.token_bytes(tokens)
    entry = save_prompt_cache(store, text, tokens, cache, None)
    assert entry is not None and entry.tokens == len(tokens)
    got = load_prompt_cache(store, text + b" and more", None)
    assert got is not None
    restored, stored_tokens, text_bytes = got
    assert text_bytes == text
    assert stored_tokens.dtype == np.uint32 and stored_tokens.tolist() == list(tokens)
    assert_same_cache(cache, restored)
    return restored, entry


def continue_both(model, a, b, tokens, chunks):
    """Feeds the same tokens through both caches chunk by chunk; logits must match bit for bit."""
    at = 0
    for n in chunks:
        x = mx.array([tokens[at:at + n]])
        la, lb = model(x, cache=a), model(x, cache=b)
        assert mx.array_equal(la, lb).item(), f"logits differ after {at + n} continuation tokens"
        at += n
    assert at == len(tokens)


CHUNKS = [5, 1, 1, 1, 40, 1, 1]          # multi-token and single-token steps


# ---- caches filled by a model --------------------------------------------

@pytest.mark.parametrize("n", [1, 256, 300])
def test_kvcache_round_trip_and_continue(store, tok, ids, n):
    model = mlx_model.make_model()
    cache = mlx_model.make_cache(model)
    mlx_model.prefill(model, cache, ids[:n])
    restored, _ = round_trip(store, tok, ids[:n], cache)
    for c in restored:
        assert type(c) is mlc.KVCache and c.offset == n
        assert c.keys.shape[2] == n           # only the filled part came back
    more = ids[n:n + sum(CHUNKS)]
    continue_both(model, cache, restored, more, CHUNKS)
    # Past the original's 256-step buffer too.
    continue_both(model, cache, restored, ids[700:700 + 260], [250, 1, 9])


def test_rotating_from_sliding_model_prompt_longer_than_window(store, tok, ids):
    model = mlx_model.make_model(layers=3, sliding_window=32)
    cache = mlx_model.make_cache(model)
    assert [type(c) for c in cache] == [mlc.RotatingKVCache, mlc.RotatingKVCache, mlc.KVCache]
    mlx_model.prefill(model, cache, ids[:100])          # one chunk, 100 > 32
    restored, _ = round_trip(store, tok, ids[:100], cache)
    r = restored[0]
    assert (r.offset, r.keep, r.max_size, r._idx) == (cache[0].offset, cache[0].keep, 32, cache[0]._idx)
    continue_both(model, cache, restored, ids[100:100 + 70], [1] * 40 + [20, 1, 1, 8])


@pytest.mark.parametrize("prompt, step, decode", [
    (100, 16, 10),      # rotated: the write index sits inside the window
    (10, None, 5),      # short: the in-place buffer is only partly filled
    (47, None, 1),      # one short of the window after the decode step
])
def test_rotating_keep4_max_kv_size(store, tok, ids, prompt, step, decode):
    model = mlx_model.make_model()
    cache = mlx_model.rotating_cache(model, max_kv_size=48, keep=4)
    mlx_model.prefill(model, cache, ids[:prompt], step=step)
    n = prompt
    for t in ids[prompt:prompt + decode]:
        model(mx.array([[t]]), cache=cache)
        n += 1
    mx.eval([c.keys for c in cache])
    restored, _ = round_trip(store, tok, ids[:n], cache)
    for c, r in zip(cache, restored):
        assert (r.offset, r.keep, r.max_size, r._idx) == (c.offset, c.keep, c.max_size, c._idx)
        assert r.keys.shape[2] == min(c.offset, c.keys.shape[2])
    # Enough single steps to wrap the window (twice for the short prompt).
    continue_both(model, cache, restored, ids[n:n + 110], [1] * 60 + [30] + [1] * 20)


def test_quantized_round_trip_and_continue(store, tok, ids):
    # head_dim 64: mx.quantize wants the last axis divisible by the group size.
    model = mlx_model.make_model(hidden=128, heads=2, kv_heads=1)
    cache = mlx_model.make_cache(model)
    mlx_model.prefill(model, cache, ids[:300])
    qcache = [c.to_quantized(group_size=64, bits=8) for c in cache]
    restored, entry = round_trip(store, tok, ids[:300], qcache)
    for r in restored:
        assert type(r) is mlc.QuantizedKVCache
        assert (r.group_size, r.bits, r.offset) == (64, 8, 300)
        assert [a.shape[2] for a in (*r.keys, *r.values)] == [300] * 6
    continue_both(model, qcache, restored, ids[300:300 + sum(CHUNKS)], CHUNKS)
    continue_both(model, qcache, restored, ids[700:700 + 260], [250, 1, 9])


def test_quantized_grown_by_update_and_fetch(store, tok):
    c = mlc.QuantizedKVCache(group_size=32, bits=4)
    rng = np.random.default_rng(1)
    for n in (7, 1, 1, 30):
        k = mx.array(rng.standard_normal((1, 2, n, 64)).astype(np.float16))
        v = mx.array(rng.standard_normal((1, 2, n, 64)).astype(np.float16))
        c.update_and_fetch(k, v)
    restored, _ = round_trip(store, tok, list(range(5, 5 + c.offset)), [c])
    r = restored[0]
    k = mx.array(rng.standard_normal((1, 2, 3, 64)).astype(np.float16))
    for x, y in zip(c.update_and_fetch(k, k), r.update_and_fetch(k, k)):
        for p, q in zip(x, y):
            assert mx.array_equal(p, q).item()


def test_mixed_cache_file_names_classes(store, tok, ids):
    """Meta lists one class per layer, JSON-clean, offsets equal to the token count."""
    model = mlx_model.make_model(layers=3, sliding_window=16)
    cache = mlx_model.make_cache(model)
    mlx_model.prefill(model, cache, ids[:40])
    tensors, meta = cache_to_tensors(cache)
    assert json.loads(json.dumps(meta)) == meta
    assert meta["version"] == 1
    assert [m["class"] for m in meta["layers"]] == ["RotatingKVCache", "RotatingKVCache", "KVCache"]
    assert all(m["offset"] == 40 and m["n_state"] == 2 and m["state_is_none"] == [False, False]
               for m in meta["layers"])
    assert sorted(tensors) == ["0.0", "0.1", "1.0", "1.1", "2.0", "2.1"]


# ---- caches filled by hand -------------------------------------------------

def _rand(rng, shape, dtype=np.float32):
    return mx.array(rng.standard_normal(shape).astype(dtype))


ARRAYS_CLASSES = [n for n in ("ArraysCache", "MambaCache") if n in CACHE_CLASSES]


@pytest.mark.parametrize("name", ARRAYS_CLASSES)
@pytest.mark.parametrize("padding", [False, True])
def test_arrays_cache_with_none_slot(store, tok, name, padding):
    rng = np.random.default_rng(2)
    cls = CACHE_CLASSES[name]
    c = cls(size=3) if name == "ArraysCache" else cls()
    slots = [_rand(rng, (1, 3, 8)), None, _rand(rng, (1, 4, 4)).astype(mx.bfloat16)]
    c.cache = (slots + [None] * len(c.cache))[:len(c.cache)]
    if padding:
        c.left_padding = mx.array([2])
        c.lengths = mx.array([5])
    restored, _ = round_trip(store, tok, [9, 10, 11], [c])
    r = restored[0]
    assert type(r) is cls
    assert len(r.cache) == len(c.cache)
    assert [x is None for x in r.cache] == [x is None for x in c.cache]
    for x, y in zip(c.cache, r.cache):
        if x is not None:
            assert x.dtype == y.dtype and mx.array_equal(x, y).item()
    if padding:
        assert mx.array_equal(r.left_padding, c.left_padding).item()
        assert mx.array_equal(r.lengths, c.lengths).item()
    else:
        assert r.left_padding is None and r.lengths is None
    _, meta = cache_to_tensors([c])
    assert meta["layers"][0]["offset"] is None
    assert meta["layers"][0]["state_is_none"][1] is True


def test_empty_arrays_cache(store, tok):
    c = mlc.ArraysCache(size=2)
    restored, _ = round_trip(store, tok, [5], [c])
    assert restored[0].cache == [None, None] and restored[0].empty()


@pytest.mark.skipif("ChunkedKVCache" not in CACHE_CLASSES, reason="no ChunkedKVCache in this mlx-lm")
def test_chunked_kv_cache(store, tok):
    rng = np.random.default_rng(3)
    c = mlc.ChunkedKVCache(chunk_size=64)
    for n in (50, 30, 1):
        c.maybe_trim_front()
        c.update_and_fetch(_rand(rng, (1, 2, n, 16)), _rand(rng, (1, 2, n, 8)))
    assert c.start_position > 0
    restored, _ = round_trip(store, tok, list(range(5, 5 + c.offset)), [c])
    r = restored[0]
    assert (r.offset, r.start_position, r.chunk_size) == (c.offset, c.start_position, 64)
    for n in (1, 40):
        r.maybe_trim_front()
        c.maybe_trim_front()
        k, v = _rand(rng, (1, 2, n, 16)), _rand(rng, (1, 2, n, 8))
        for x, y in zip(c.update_and_fetch(k, v), r.update_and_fetch(k, v)):
            assert mx.array_equal(x, y).item()


def test_concatenate_kv_cache(store, tok):
    rng = np.random.default_rng(4)
    c = mlc.ConcatenateKVCache()
    c.update_and_fetch(_rand(rng, (1, 2, 9, 16)), _rand(rng, (1, 2, 9, 16)))
    restored, _ = round_trip(store, tok, list(range(5, 14)), [c])
    k, v = _rand(rng, (1, 2, 2, 16)), _rand(rng, (1, 2, 2, 16))
    for x, y in zip(c.update_and_fetch(k, v), restored[0].update_and_fetch(k, v)):
        assert mx.array_equal(x, y).item()


@pytest.mark.skipif("CacheList" not in CACHE_CLASSES, reason="no CacheList in this mlx-lm")
def test_cache_list(store, tok):
    rng = np.random.default_rng(5)
    conv = mlc.ArraysCache(size=2)
    conv[0] = _rand(rng, (1, 3, 8))
    kv = mlc.KVCache()
    kv.update_and_fetch(_rand(rng, (1, 2, 20, 16)), _rand(rng, (1, 2, 20, 16)))
    plain = mlc.KVCache()
    plain.update_and_fetch(_rand(rng, (1, 2, 20, 16)), _rand(rng, (1, 2, 20, 16)))
    cache = [mlc.CacheList(conv, kv), plain]
    restored, _ = round_trip(store, tok, list(range(5, 25)), cache)
    r = restored[0]
    assert [type(x) for x in r.caches] == [mlc.ArraysCache, mlc.KVCache]
    assert r.caches[0][1] is None and r.caches[1].keys.shape[2] == 20
    k, v = _rand(rng, (1, 2, 1, 16)), _rand(rng, (1, 2, 1, 16))
    for x, y in zip(kv.update_and_fetch(k, v), r.caches[1].update_and_fetch(k, v)):
        assert mx.array_equal(x, y).item()


def test_empty_kv_caches_round_trip_without_store():
    cache = [mlc.KVCache(), mlc.RotatingKVCache(max_size=8, keep=2), mlc.QuantizedKVCache()]
    tensors, meta = cache_to_tensors(cache)
    assert tensors == {}
    restored = tensors_to_cache(tensors, json.loads(json.dumps(meta)))
    assert all(c.keys is None and c.offset == 0 for c in restored)
    assert (restored[1].max_size, restored[1].keep) == (8, 2)
    k = mx.ones((1, 1, 3, 64))
    assert restored[0].update_and_fetch(k, k)[0].shape == (1, 1, 3, 64)


def test_tensors_are_snapshots_of_in_place_updated_caches(ids):
    """The tensors of a save queued for later must not change when the cache moves on."""
    model = mlx_model.make_model()
    full = mlx_model.make_cache(model)
    mlx_model.prefill(model, full, ids[:256])          # buffer exactly full: no slice needed
    rot = mlx_model.rotating_cache(model, max_kv_size=48)
    mlx_model.prefill(model, rot, ids[:60])
    model(mx.array([ids[60:61]]), cache=rot)
    arrays = mlc.ArraysCache(size=1)
    arrays[0] = mx.ones((1, 4))
    cache = [*full, *rot, arrays]
    tensors, _ = cache_to_tensors(cache)
    mx.eval(list(tensors.values()))
    before = {k: np.array(v) for k, v in tensors.items()}
    for c in full:
        c.trim(10)                                     # then overwrite inside the buffer
    model(mx.array([ids[300:305]]), cache=full)
    for t in ids[305:310]:
        model(mx.array([[t]]), cache=rot)
    arrays[0][...] = 5.0
    mx.eval([c.keys for c in full + rot], arrays[0])
    for k, v in tensors.items():
        assert np.array_equal(np.array(v), before[k]), k


# ---- size on disk -----------------------------------------------------------

def test_file_smaller_than_mlx_lm_save(store, tok, ids, tmp_path):
    model = mlx_model.make_model()
    cache = mlx_model.make_cache(model)
    mlx_model.prefill(model, cache, ids[:300])
    assert cache[0].keys.shape[2] == 512                 # mlx-lm's 256-step buffer
    entry = save_prompt_cache(store, tok.token_bytes(ids[:300]), ids[:300], cache, None)
    theirs = str(tmp_path / "mlx_lm.safetensors")
    mlc.save_prompt_cache(theirs, cache)
    ours = os.path.getsize(entry.path)
    assert ours == entry.file_size
    assert ours < os.path.getsize(theirs)
    # The tensor bytes are exactly the 300 filled positions.
    tensors, _ = cache_to_tensors(cache)
    assert sum(a.nbytes for a in tensors.values()) == 2 * 2 * (1 * 2 * 300 * 16 * 4)


# ---- refusals and corruption -------------------------------------------------

def test_miss_returns_none(store):
    assert load_prompt_cache(store, "nothing stored", None) is None


def test_token_count_must_match_offsets(store):
    c = mlc.KVCache()
    c.update_and_fetch(mx.zeros((1, 1, 4, 8)), mx.zeros((1, 1, 4, 8)))
    with pytest.raises(ValueError, match="4 tokens"):
        save_prompt_cache(store, b"abc", [1, 2, 3], [c], None)
    assert store.entries() == []


def test_unsupported_class_is_a_type_error(store):
    c = mlc.BatchKVCache([0])
    assert not kvmlx.supported([c])
    assert kvmlx.supported([mlc.KVCache()])
    with pytest.raises(TypeError, match="BatchKVCache"):
        save_prompt_cache(store, b"abc", [1], [c], None)


def _kv_meta(n=6):
    c = mlc.KVCache()
    c.update_and_fetch(mx.arange(2 * n * 8, dtype=mx.float32).reshape(1, 2, n, 8), mx.ones((1, 2, n, 8)))
    return cache_to_tensors([c])


@pytest.mark.parametrize("name", ["os.system", "__import__", "BatchKVCache", "_BaseCache", "", None, 3])
def test_unknown_class_raises_corrupt(name):
    tensors, meta = _kv_meta()
    meta["layers"][0]["class"] = name
    with pytest.raises(kvstore.CorruptCheckpoint) as ei:
        tensors_to_cache(tensors, meta)
    assert ei.value.reason == "unknown_cache_class"
    assert isinstance(ei.value, ValueError)


def _drop_tensor(t, m):
    del t["0.1"]


def _extra_tensor(t, m):
    t["7.0"] = mx.zeros(1)


def _none_mismatch(t, m):
    m["layers"][0]["state_is_none"] = [False, True]


def _offset_mismatch(t, m):
    m["layers"][0]["offset"] = 7


def _negative_offset(t, m):
    m["layers"][0]["offset"] = -1


def _bool_offset(t, m):
    m["layers"][0]["offset"] = True


def _version(t, m):
    m["version"] = 2


def _no_layers(t, m):
    del m["layers"]


def _n_state(t, m):
    m["layers"][0]["n_state"] = 3


def _values_wrong_shape(t, m):
    t["0.1"] = mx.zeros((1, 3, 6, 8))


def _rotating_idx(t, m):
    m["layers"][0].update({"class": "RotatingKVCache", "meta_state": {"keep": 0, "max_size": 8, "idx": 9}})


def _rotating_missing_field(t, m):
    m["layers"][0].update({"class": "RotatingKVCache", "meta_state": {"keep": 0, "max_size": 8}})


@pytest.mark.parametrize("mutate", [_drop_tensor, _extra_tensor, _none_mismatch, _offset_mismatch,
                                    _negative_offset, _bool_offset, _version, _no_layers, _n_state,
                                    _values_wrong_shape, _rotating_idx, _rotating_missing_field])
def test_inconsistent_meta_raises_corrupt(mutate):
    tensors, meta = _kv_meta()
    mutate(tensors, meta)
    with pytest.raises(kvstore.CorruptCheckpoint) as ei:
        tensors_to_cache(tensors, meta)
    assert ei.value.reason == "bad_cache_meta"


def test_tensors_must_be_mlx():
    tensors, meta = _kv_meta()
    with pytest.raises(TypeError, match="into='mlx'"):
        tensors_to_cache({k: np.asarray(v) for k, v in tensors.items()}, meta)


@pytest.mark.parametrize("quarantine", [False, True])
def test_unknown_class_in_file_is_a_miss_and_removed(tmp_path, quarantine):
    store = kvstore.KVStore(tmp_path / "kv", min_tokens=1, quarantine=quarantine)
    tensors, meta = _kv_meta()
    meta["layers"][0]["class"] = "Exploit"
    entry = store.save(b"prompt text", list(range(6)), tensors, meta=meta)
    assert entry is not None
    assert load_prompt_cache(store, b"prompt text, longer", None) is None
    assert not os.path.exists(entry.path)
    assert store.entries() == []
    assert store.stats()["corrupt"] == 1
    assert os.path.exists(tmp_path / "kv" / ".quarantine" / entry.name) == quarantine
    store.close()


def test_offset_not_token_count_in_file_is_a_miss(store):
    tensors, meta = _kv_meta(6)
    entry = store.save(b"prompt", list(range(5)), tensors, meta=meta)   # 5 ids, 6 cached
    assert load_prompt_cache(store, b"prompt", None) is None
    assert not os.path.exists(entry.path)


# ---- the test helper itself ------------------------------------------------------

def test_tokenizer_bytes_and_chat(tok):
    text = tok.render_chat([{"role": "system", "content": "Be brief."},
                            {"role": "user", "content": "Héllo — 日本 ✓"}])
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.token_bytes(ids) == text.encode("utf-8")
    assert ids[0] == tok.bos_id and tok.user_id in ids and ids[-2] == tok.assistant_id
    assert tok.vocab_size <= mlx_model.VOCAB_SIZE
    assert len({tok.bos_id, tok.eos_id, tok.user_id, tok.assistant_id, tok.system_id}) == 5


def test_write_model_dir_loads_offline(tmp_path, tok):
    import mlx_lm
    model, mtok = mlx_model.write_model_dir(tmp_path / "m", seed=3)
    loaded, wrapper = mlx_lm.load(str(tmp_path / "m"))
    x = mx.array([mtok.encode("The cache is on disk.")])
    assert mx.array_equal(model(x), loaded(x)).item()
    msgs = [{"role": "user", "content": "hi"}]
    rendered = wrapper.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert rendered == mtok.render_chat(msgs)
    assert wrapper.encode("hello world", add_special_tokens=False) == mtok.encode("hello world")
    assert wrapper.eos_token_id == mtok.eos_id
