"""Quantised chain blocks (kv_codec="q8"/"q4", payload ABI 145, docs/format.md §20).

A store that quantises writes each chain block's positional float tensors
(K, V, latents) group-wise affine at 8 or 4 bits a value; snapshots and
integer tensors stay exact.  Every store reads them back, within the
codec's error; Checkpoint.lossy says so, and the canary then uses the
codec's tolerance: the model's own state passes, another model's fails.
A build that knows only packed blocks (ABI 209) sees ABI 145 as foreign.
"""

import os
import re

import numpy as np
import pytest

from kvstore import files
from kvstore.format import PAYLOAD_ABI_CHAIN, PAYLOAD_ABI_LOSSY_CHAIN, PAYLOAD_ABI_TABLE_CHAIN
from kvstore.payload import quantizing
from kvhelpers import checkpoint_files, make_store
from test_packed import BLOCK, TOKENS, dir_bytes, manifest_of, older_build, rewrite_abi, save, state

# Relative L2 error of normal values, groups of 64: 8 bits ~0.0055, 4 bits ~0.09.
ERROR = {"q8": 0.01, "q4": 0.12}
RATIO = {"q8": 0.55, "q4": 0.30}


def f32_of(a, dtype):
    a = np.asarray(a)
    if dtype == "bfloat16":
        return (a.astype(np.uint32) << 16).view(np.float32)
    return a.astype(np.float32)


def rel(got, want, dtype="bfloat16"):
    g, w = f32_of(got, dtype), f32_of(want, dtype)
    return float(np.linalg.norm(g - w) / np.linalg.norm(w))


def stored_bytes(raw, dtype):
    if dtype == "bfloat16":
        return (raw.view(np.uint32) >> 16).astype(np.uint16)
    return raw.astype(dtype)


@pytest.mark.parametrize("codec", ["q8", "q4"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_a_block_round_trips_within_the_codecs_error(codec, dtype):
    x = np.random.default_rng(1).standard_normal(64 * 96).astype(np.float32) * 3 + 0.5
    raw = stored_bytes(x, dtype)
    mv = memoryview(raw).cast("B")
    desc, parts = quantizing.pack([mv[:1000 * 2], mv[1000 * 2:]], dtype, codec)     # pieces cut mid-group
    stored = b"".join(bytes(memoryview(p).cast("B")) for p in parts)
    assert len(stored) == quantizing.stored_size(raw.size, dtype, quantizing.BITS[codec], desc["group"])
    if dtype != "float32":
        assert len(stored) <= RATIO[codec] * raw.nbytes
    out = np.zeros_like(raw)
    o = memoryview(out).cast("B")
    w = raw.itemsize * 96                                       # runs of 96 elements: they end mid-group
    quantizing.Form(codec, dtype, desc["group"]).unpack(stored, o, (0, w, raw.size // 96, w), "p", "w")
    assert rel(out, raw, dtype) <= ERROR[codec]
    # Every value inside its group's range: the ends are kept within one step.
    g, w = f32_of(out, dtype).reshape(-1, 64), f32_of(raw, dtype).reshape(-1, 64)
    step = (w.max(1) - w.min(1)) / ((1 << quantizing.BITS[codec]) - 1)
    assert (np.abs(g - w) <= step[:, None] * 0.51 + np.abs(w) * 2 ** -7 + 1e-6).all()


@pytest.mark.parametrize("codec", ["q8", "q4"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_chain_reads_quantised_blocks_in_one_native_call(tmp_path, codec, dtype):
    """_native.read_packed takes quantised blocks as a chain load's I/O
    thread hands them (runs of whole groups, strided): the runs land as
    Form.unpack restores them, bit for bit; a block whose stored length
    lies lands nothing (bad_payload); runs that cut a group are refused
    (the load restores those with Form.unpack)."""
    from kvstore import _native
    from kvstore.errors import CorruptCheckpoint
    x = np.random.default_rng(2).standard_normal(4 * 128).astype(np.float32)
    raw = stored_bytes(x, dtype)
    desc, parts = quantizing.pack([memoryview(raw).cast("B")], dtype, codec)
    stored = b"".join(bytes(memoryview(p).cast("B")) for p in parts)
    form = quantizing.Form(codec, dtype, desc["group"])
    run = 128 * raw.itemsize                                 # 4 runs of 128 values, 3 runs' room apart
    native = form.native_for(run)
    assert native == ("quant", quantizing.BITS[codec], dtype, desc["group"]) and form.native_for(run // 2 + 8) is None
    path = tmp_path / "blocks"
    path.write_bytes(stored + stored[:-1])
    fd = os.open(path, os.O_RDONLY)
    try:
        out = [bytearray(12 * run + 8) for _ in range(2)]
        got = _native.read_packed(out, [
            (0, fd, 0, len(stored), native, 8, run, 4, 3 * run, _native.crc32c(stored)),
            (1, fd, len(stored), len(stored) - 1, native, 0, run, 4, 3 * run, _native.crc32c(stored[:-1])),
        ], verify=True)
        with pytest.raises(ValueError, match="whole groups"):
            _native.read_packed(out, [(0, fd, 0, len(stored), native, 0, run // 2 + 8, 4, run, 0)])
    finally:
        os.close(fd)
    want = bytearray(12 * run + 8)
    form.unpack(stored, memoryview(want), (8, run, 4, 3 * run), "f", "k")
    assert got[0] == (0, _native.crc32c(stored)) and out[0] == want and any(want)
    assert got[1][0] != 0 and not any(out[1])
    with pytest.raises(CorruptCheckpoint) as e:
        _native.raise_status(got[1][0], "f.kv", "tensor 'k'")
    assert e.value.reason == "bad_payload"


def test_constant_groups_and_unquantisable_blocks():
    flat = np.full(4096, 1.5, np.float32)
    desc, parts = quantizing.pack([memoryview(flat).cast("B")], "float32", "q4")
    out = np.zeros_like(flat)
    quantizing.Form("q4", "float32", desc["group"]).unpack(
        b"".join(bytes(memoryview(p).cast("B")) for p in parts), memoryview(out).cast("B"),
        (0, out.nbytes, 1, 0), "p", "w")
    assert (out == flat).all()                       # a zero range is exact
    bad = flat.copy()
    bad[7] = np.nan
    assert quantizing.pack([memoryview(bad).cast("B")], "float32", "q8") is None
    huge = np.full(4096, 3e38, np.float32)
    huge[::2] = -3e38                                # a range past float32's largest value
    assert quantizing.pack([memoryview(stored_bytes(huge, "bfloat16")).cast("B")], "bfloat16", "q8") is None


@pytest.mark.parametrize("codec", ["q8", "q4"])
@pytest.mark.parametrize("into", ["numpy", "mlx"])
def test_a_quantised_chain_is_smaller_and_loads_within_the_error(tmp_path, codec, into):
    if into == "mlx":
        mx = pytest.importorskip("mlx.core")
    with make_store(tmp_path / "raw", block_tokens=BLOCK, kv_codec="raw") as s:
        save(s)
    with make_store(tmp_path / "q", block_tokens=BLOCK, kv_codec=codec) as s:
        text, tensors, e = save(s)
        assert e.payload_abi == PAYLOAD_ABI_LOSSY_CHAIN
    assert dir_bytes(tmp_path / "q") < (RATIO[codec] + 0.12) * dir_bytes(tmp_path / "raw")
    with make_store(tmp_path / "q") as s:           # any store reads them
        ck = s.load(s.find(text), into=into)
        assert ck.lossy == codec and ck.tokens.size == TOKENS
        got = {k: np.array(v.view(mx.uint16)) if into == "mlx" and v.dtype == mx.bfloat16 else np.asarray(v)
               for k, v in ck.tensors.items()}
        for name in ("k", "v"):
            assert got[name].shape == tensors[name].shape and got[name].dtype == np.uint16
            assert 0 < rel(got[name], tensors[name]) <= ERROR[codec], name
        assert (got["pos"] == tensors["pos"]).all()             # integers stay exact
        assert (got["window"] == tensors["window"]).all()       # so do snapshots
    with make_store(tmp_path / "raw") as s:
        assert s.load(s.find(text)).lossy == ""
    assert all(files.verify_file(str(tmp_path / "q" / n)) is None for n in checkpoint_files(tmp_path / "q"))


def test_the_manifest_names_the_codec_and_group(tmp_path):
    with make_store(tmp_path, block_tokens=BLOCK, kv_codec="q4") as s:
        _, _, e = save(s)
    m = manifest_of(e)
    assert set(m.packed) == {"k", "v"}
    n = dict((r[0], r[4]) for r in m.tensors)["k"]
    stored, form = m.packed["k"]
    assert (form.codec, form.dtype, form.group) == ("q4", "bfloat16", 64)
    assert stored == n // 4 + 2 * 2 * (n // 2 // 64)


def test_a_build_without_abi_145_misses_cleanly(tmp_path, monkeypatch):
    """A build that loads packed blocks (209) but not quantised ones: the
    quantised blocks are foreign files, the raw chain before them a hit."""
    with make_store(tmp_path, block_tokens=BLOCK, kv_codec="raw") as s:
        save(s, n=130, snapshot=False)
    with make_store(tmp_path, block_tokens=BLOCK, kv_codec="q8") as s:
        text, tensors, _ = save(s, snapshot=False)
    older_build(monkeypatch, packed=(PAYLOAD_ABI_TABLE_CHAIN,))
    with make_store(tmp_path) as s:
        hit = s.find(text)
        assert hit is not None and hit.tokens == 130 and hit.payload_abi == PAYLOAD_ABI_CHAIN
        ck = s.load(hit)
        assert ck.lossy == "" and (ck.tensors["k"] == tensors["k"][:, :, :130]).all()
        assert len(s.entries()) == len(checkpoint_files(tmp_path))


@pytest.mark.parametrize("abi", [PAYLOAD_ABI_CHAIN, PAYLOAD_ABI_TABLE_CHAIN])
def test_a_quantised_row_under_another_abi_is_corrupt(tmp_path, abi):
    """Only ABI 145 may hold quantised rows: under 209 or 17 the file is bad_manifest."""
    with make_store(tmp_path, block_tokens=BLOCK, kv_codec="q8") as s:
        text, _, e = save(s)
    rewrite_abi(e.path, abi)
    assert ("packed in a file whose ABI packs nothing" if abi == PAYLOAD_ABI_CHAIN
            else "packed is not a block of table-planes") in files.verify_file(e.path)
    with make_store(tmp_path) as s:
        ck = s.load(s.find(text))
        assert ck is None or ck.tokens.size < TOKENS


def test_serve_takes_disk_kv_bits(tmp_path):
    from kvstore.serve import options, server
    p = options.build_parser()
    opts, _ = p.parse_known_args(["--model", str(tmp_path), "--disk-kv-bits", "4"])
    assert opts.disk_kv_bits == 4
    assert server.main(["--model", str(tmp_path), "--disk-kv-bits", "8", "--kv-codec", "lossless"]) == 2
    whole, _ = p.parse_known_args(["--model", str(tmp_path), "--disk-kv-bits", "4", "--layout", "whole"])
    assert options.check(whole) is None
    assert (whole.settings.kv_codec, whole.settings.layout) == ("q4", "whole")


def test_inspect_names_each_tensors_codec(tmp_path):
    import subprocess
    import sys
    with make_store(tmp_path, block_tokens=BLOCK, kv_codec="q8") as s:
        _, _, e = save(s)
    # From outside the repository: the source tree would shadow the installed package.
    p = subprocess.run([sys.executable, "-m", "kvstore", "inspect", e.path], capture_output=True, text=True,
                       timeout=60, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    rows = {m.group(1): m.groups()[1:] for m in
            re.finditer(r"^    (\S+) .* (\d+) +(\d+) +(\S+) +(?:axis \d+|snapshot)$", p.stdout, re.M)}
    assert rows["k"][2] == "q8" and rows["pos"][2] == "raw" and rows["window"][2] == "raw", p.stdout
    assert int(rows["k"][1]) < 0.55 * int(rows["k"][0])


def test_ls_says_what_the_codecs_stored(tmp_path):
    import subprocess
    import sys
    for codec in ("q8", "raw"):
        with make_store(tmp_path / codec, block_tokens=BLOCK, kv_codec=codec) as s:
            save(s)
    run = lambda d: subprocess.run([sys.executable, "-m", "kvstore", "ls", str(d)],   # noqa: E731
                                   capture_output=True, text=True, timeout=60, cwd=tmp_path).stdout
    line = re.search(r"^(\d+) packed blocks \(q8\): their tensors take ([\d.]+) of their raw bytes",
                     run(tmp_path / "q8"), re.M)
    assert line and int(line.group(1)) == len(checkpoint_files(tmp_path / "q8")), run(tmp_path / "q8")
    assert 0.4 < float(line.group(2)) < 0.7          # k and v at 0.53, the exact tensors at 1
    assert "packed block" not in run(tmp_path / "raw")


def test_stats_say_what_the_saves_stored_of_the_tensors_bytes(tmp_path):
    with make_store(tmp_path / "raw", block_tokens=BLOCK, kv_codec="raw") as s:
        assert s.stats()["kv_ratio"] is None                   # nothing saved yet
        save(s)
        assert s.stats()["kv_ratio"] == 1.0
    with make_store(tmp_path / "q4", block_tokens=BLOCK, kv_codec="q4") as s:
        save(s)
        st = s.stats()
        # k and v quantised (0.28), the window snapshot and positions raw.
        assert 0.28 < st["kv_ratio"] < 0.45 and st["kv_stored_bytes"] < st["kv_raw_bytes"]


@pytest.mark.parametrize("codec", ["lossless", "q8"])
def test_a_sealed_store_packs_before_it_encrypts(tmp_path, codec):
    """kv_codec with a key: the blocks are packed (or quantised), then
    sealed (ABI 241 or 177: 209 or 145 + 32); the same key reads them back,
    a store without it sees foreign files."""
    pytest.importorskip("cryptography")
    import kvstore
    key = os.urandom(32)
    with kvstore.KVStore(tmp_path / "raw", key=key, block_tokens=BLOCK, durable=False,
                         min_tokens=1) as s:
        save(s)
    with kvstore.KVStore(tmp_path / "s", key=key, block_tokens=BLOCK, durable=False, kv_codec=codec,
                         min_tokens=1) as s:
        text, tensors, e = save(s)
        inner = PAYLOAD_ABI_TABLE_CHAIN if codec == "lossless" else PAYLOAD_ABI_LOSSY_CHAIN
        assert e.payload_abi == inner + 32
        assert s.stats()["kv_ratio"] < 0.8
    assert dir_bytes(tmp_path / "s") < 0.8 * dir_bytes(tmp_path / "raw")
    with kvstore.KVStore(tmp_path / "s", key=key, durable=False, min_tokens=1) as s:
        ck = s.load(s.find(text))
        assert ck is not None and ck.tokens.size == TOKENS and ck.lossy == ("" if codec == "lossless" else codec)
        for name in ("k", "v"):
            got = np.asarray(ck.tensors[name])
            assert (got == tensors[name]).all() if codec == "lossless" else rel(got, tensors[name]) <= ERROR[codec]
        assert (np.asarray(ck.tensors["window"]) == tensors["window"]).all()
        mx = pytest.importorskip("mlx.core")
        into_mlx = s.load(s.find(text), into="mlx")         # the MLX read path: the same values
        assert into_mlx.lossy == ck.lossy
        assert (np.array(into_mlx.tensors["k"].view(mx.uint16)) == np.asarray(ck.tensors["k"])).all()
    with make_store(tmp_path / "s") as s:               # no key: foreign files, a miss
        assert s.find(text) is None


def test_tensors_named_exact_stay_exact_under_a_lossy_codec(tmp_path):
    text, ids, tensors, axes, dtypes = state()
    for codec in ("q8", "lossless"):
        with make_store(tmp_path / codec, block_tokens=BLOCK, kv_codec=codec) as s:
            e = s.save(text, ids, tensors, {"layers": 1}, positional=axes, text_offsets=lambda i: 7 * i,
                       dtypes=dtypes, exact={"k"})
            packed = {name: form.codec for name, (_, form) in manifest_of(e).packed.items()}
            got = s.load(s.find(text)).tensors
        if codec == "q8":
            assert packed == {"v": "q8"}                  # k kept exact, v quantised
            assert (np.asarray(got["k"]) == tensors["k"]).all()
        else:
            assert "k" in packed                          # lossless packing is exact: it still applies


def test_a_quantized_kv_cache_is_never_quantised_again(tmp_path):
    """mlx-lm's QuantizedKVCache (kvstore serve --kv-bits) holds 8-bit words
    and float scales and biases: a q8 store keeps all of them exact (quantising
    a scale again would move every value of its group) and restores them bit
    for bit."""
    mx = pytest.importorskip("mlx.core")
    from mlx_lm.models import cache as mlc
    from kvstore import mlx as kvmlx
    from kvstore.demo.model import make_model
    from test_mlx_architectures import model_store
    model = make_model(0, head_dim=64, hidden=128, heads=2, kv_heads=1)
    ids = list(range(5, 700))
    cache = mlc.make_prompt_cache(model)
    model(mx.array([ids]), cache=cache)
    quantized = [c.to_quantized(group_size=64, bits=8) for c in cache]
    tensors, meta, _ = kvmlx.codecs.cache_state(quantized)
    assert kvmlx.codecs.quantized_names(meta) == set(tensors)
    text = bytes(i % 200 + 32 for i in ids)
    with model_store(tmp_path, model, kv_codec="q8", block_tokens=256) as store:   # scales of 1 KiB a block
        e = kvmlx.save_prompt_cache(store, text, ids, quantized, model, text_offsets=list(range(len(ids) + 1)))
        assert e is not None and len(store.entries()) > 2
        assert all(manifest_of(b).packed == {} for b in store.entries())      # every block
        assert store.load(store.find(text)).lossy == ""
        restored = kvmlx.load_prompt_cache(store, text, model, check=False)[0]
    want, got = kvmlx.codecs.cache_state(quantized)[0], kvmlx.codecs.cache_state(restored)[0]
    assert all(np.array_equal(np.array(got[k]), np.array(want[k])) for k in want)


class _ExactEngine:
    """A ToyEngine with snapshots whose KV rows it says are quantised already."""

    def exact_names(self, meta):
        return {"kv"}


def test_prompt_cache_passes_the_engines_exact_names(tmp_path):
    from kvstore.prompt_cache import PromptCache
    from kvhelpers import ToyEngine
    prompt = bytes(range(32, 127)) * 8                  # no chat markers: stored at store_len
    codecs = {}
    for name, engine in (("plain", ToyEngine(snapshots=True)),
                         ("exact", type("E", (_ExactEngine, ToyEngine), {})(snapshots=True))):
        with make_store(tmp_path / name, kv_codec="q8") as store:
            pc = PromptCache(store, engine, prefill_step=64)
            pc.prefill(pc.begin(prompt))
            store.flush()
            codecs[name] = {n: form.codec for e in store.entries() for n, (_, form) in manifest_of(e).packed.items()}
    assert codecs["plain"] == {"kv": "q8"} and codecs["exact"] == {}
