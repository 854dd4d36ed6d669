"""Payload ABI 16 through KVStore (docs/format.md §3): every dtype from NumPy and
MLX, into NumPy and MLX, odd shapes, non-contiguous inputs, meta JSON, and the
byte layout of the file as written."""

import gc
import hashlib
import json
import os
import struct

import numpy as np
import pytest

import reference
from kvstore.payload import DTYPES
from kvhelpers import checkpoint_files, make_store

mx = pytest.importorskip("mlx.core")

NUMPY_DTYPES = sorted(d for d in DTYPES if d != "bfloat16")   # NumPy has no bfloat16
PAYLOAD_HEAD = struct.Struct("<4sIQII")
HEADER = struct.Struct("<3sBBBBBIIIB3xQQQI")                   # 48-byte header + u32 text length


def sample(dtype, shape, seed=0):
    """Deterministic values of dtype that survive every cast (small integers)."""
    rng = np.random.default_rng(seed)
    if dtype == "bool":
        return rng.integers(0, 2, size=shape).astype(bool)
    if dtype == "complex64":
        return (rng.integers(-50, 50, size=shape) + 1j * rng.integers(-50, 50, size=shape)).astype(np.complex64)
    lo = 0 if dtype.startswith("uint") else -100
    return rng.integers(lo, 100, size=shape).astype(dtype)


def mx_dtype(name):
    return mx.bool_ if name == "bool" else getattr(mx, name)


def mlx_sample(dtype, shape, seed=0):
    if dtype == "bfloat16":
        return mx.array(sample("float32", shape, seed)).astype(mx.bfloat16)
    return mx.array(sample(dtype, shape, seed), dtype=mx_dtype(dtype))


def bits(a):
    """The values of an MLX array as NumPy, bfloat16 as its uint16 bit pattern."""
    if a.dtype == mx.bfloat16:
        return np.array(a.view(mx.uint16))
    return np.array(a)


def round_trip(store, text, tensors, into, tokens=(1, 2, 3), meta=None):
    entry = store.save(text, list(tokens), tensors, meta=meta)
    assert entry is not None
    found = store.find(text + " and what follows")
    assert found is not None and found.sha == entry.sha
    ck = store.load(found, into=into)
    assert ck is not None
    assert ck.tokens.dtype == np.uint32
    assert ck.tokens.tolist() == list(tokens)
    return ck


def check_numpy_result(got, want_np):
    assert isinstance(got, np.ndarray)
    assert got.shape == want_np.shape
    assert got.dtype == want_np.dtype
    assert np.array_equal(got, want_np)


def check_mlx_result(got, want_dtype, want_bits):
    assert isinstance(got, mx.array)
    assert got.dtype == want_dtype
    assert tuple(got.shape) == want_bits.shape
    assert np.array_equal(bits(got), want_bits)


# ---- every dtype ------------------------------------------------------------

@pytest.mark.parametrize("dtype", NUMPY_DTYPES)
@pytest.mark.parametrize("into", ["numpy", "mlx"])
def test_numpy_source_round_trip(store, dtype, into):
    tensors = {"k": sample(dtype, (2, 3, 5), 1), "v": sample(dtype, (7,), 2)}
    ck = round_trip(store, f"numpy {dtype}", tensors, into)
    assert set(ck.tensors) == set(tensors)
    for name, want in tensors.items():
        if into == "numpy":
            check_numpy_result(ck.tensors[name], want)
        else:
            check_mlx_result(ck.tensors[name], mx_dtype(dtype), want)


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("into", ["numpy", "mlx"])
def test_mlx_source_round_trip(store, dtype, into):
    tensors = {"k": mlx_sample(dtype, (2, 3, 5), 3), "v": mlx_sample(dtype, (9,), 4)}
    ck = round_trip(store, f"mlx {dtype}", tensors, into)
    assert set(ck.tensors) == set(tensors)
    for name, src in tensors.items():
        want = bits(src)
        if into == "numpy":
            got = ck.tensors[name]
            assert isinstance(got, np.ndarray)
            # NumPy has no bfloat16: the bits come back as uint16 (documented).
            assert got.dtype == (np.dtype(np.uint16) if dtype == "bfloat16" else want.dtype)
            assert got.shape == want.shape
            assert np.array_equal(got, want)
        else:
            check_mlx_result(ck.tensors[name], mx_dtype(dtype), want)


def test_bfloat16_bits_are_exact(store):
    # Values whose bfloat16 patterns cover sign, exponent extremes, subnormals and NaN.
    pattern = np.array([0x0000, 0x8000, 0x3F80, 0xBF80, 0x7F7F, 0xFF7F, 0x0001, 0x007F,
                        0x7F80, 0xFF80, 0x7FC0, 0x4049], dtype=np.uint16)
    src = mx.array(pattern).view(mx.bfloat16)
    ck = round_trip(store, "bf16 bits", {"x": src}, "numpy")
    assert ck.tensors["x"].dtype == np.uint16
    assert ck.tensors["x"].tolist() == pattern.tolist()
    ck = store.load(store.find("bf16 bits"), into="mlx")
    assert ck.tensors["x"].dtype == mx.bfloat16
    assert np.array(ck.tensors["x"].view(mx.uint16)).tolist() == pattern.tolist()


# ---- shapes -----------------------------------------------------------------

@pytest.mark.parametrize("into", ["numpy", "mlx"])
def test_zero_size_and_scalar_shapes_numpy(store, into):
    tensors = {
        "first_empty": np.zeros((0, 4), np.float16),
        "scalar": np.array(2.5, np.float32),
        "numpy_scalar": np.int32(-7),
        "middle": sample("int16", (3, 4)),
        "inner_empty": np.zeros((3, 0, 2), np.int32),
        "last_empty": np.zeros((0,), np.uint8),       # a zero-byte block at the very end
    }
    ck = round_trip(store, "odd shapes np", tensors, into)
    for name, src in tensors.items():
        want = np.asarray(src)
        got = ck.tensors[name]
        if into == "numpy":
            check_numpy_result(got, want)
        else:
            check_mlx_result(got, mx_dtype(want.dtype.name), want)


@pytest.mark.parametrize("into", ["numpy", "mlx"])
def test_zero_size_and_scalar_shapes_mlx(store, into):
    tensors = {
        "first_empty": mx.zeros((0, 4), dtype=mx.float16),
        "scalar": mx.array(2.5, dtype=mx.float32),
        "middle": mlx_sample("int16", (3, 4)),
        "inner_empty": mx.zeros((3, 0, 2), dtype=mx.bfloat16),
        "last_empty": mx.zeros((0,), dtype=mx.uint8),
    }
    ck = round_trip(store, "odd shapes mx", tensors, into)
    for name, src in tensors.items():
        got = ck.tensors[name]
        if into == "numpy":
            want = bits(src)
            assert got.shape == want.shape and np.array_equal(got, want)
        else:
            check_mlx_result(got, src.dtype, bits(src))


def test_no_tensors(store):
    ck = round_trip(store, "tokens only", {}, "numpy", tokens=range(40))
    assert ck.tensors == {}
    ck = store.load(store.find("tokens only"), into="mlx")
    assert ck.tensors == {} and ck.tokens.tolist() == list(range(40))


@pytest.mark.parametrize("into", ["numpy", "mlx"])
def test_many_tensors(store, into):
    tensors = {f"layers.{i}.{kv}": sample("float16", (1, 2, i % 5 + 1, 8), i * 2 + (kv == "v"))
               for i in range(120) for kv in ("k", "v")}
    tensors["ünïcode name ✓"] = sample("int8", (5,))
    ck = round_trip(store, "many tensors", tensors, into, tokens=range(1000, 1300))
    assert list(ck.tensors) == list(tensors)         # order kept, nothing extra
    for name, want in tensors.items():
        got = ck.tensors[name]
        assert np.array_equal(got if into == "numpy" else np.array(got), want), name


# ---- meta -----------------------------------------------------------------

def test_meta_json_round_trip(store):
    meta = {
        "classes": ["KVCache", "RotatingKVCache"],
        "states": [{"offset": 4096, "step": 256, "keep": 4}, {"max_size": 512}],
        "unicode": "prompt-free ✓ — ü",
        "nested": {"a": [1, 2.5, -3e-7, True, False, None], "b": {}},
        "big": 2**63 - 1,
    }
    ck = round_trip(store, "meta", {"x": np.arange(4, dtype=np.int32)}, "numpy", meta=meta)
    assert ck.meta == meta
    assert store.load(store.find("meta"), into="mlx").meta == meta


def test_meta_defaults_to_empty(store):
    assert round_trip(store, "no meta", {}, "numpy").meta == {}


@pytest.mark.parametrize("meta", [{"x": {1, 2}}, {"nan": float("nan")}, ["not", "a", "dict"], {"f": print}])
def test_meta_that_is_not_json_object_is_refused(store, meta, tmp_path):
    with pytest.raises(ValueError):
        store.save("bad meta", [1, 2], {}, meta=meta)
    assert checkpoint_files(tmp_path / "kv", temporaries=True) == []


@pytest.mark.parametrize("array", [np.zeros(3, dtype=object), np.array(["a", "b"]),
                                   np.zeros(2, dtype=np.float16).view("V2")])
def test_unsupported_dtype_is_refused(store, tmp_path, array):
    with pytest.raises(ValueError, match="dtype"):
        store.save("bad dtype", [1], {"x": array})
    assert checkpoint_files(tmp_path / "kv", temporaries=True) == []
    assert store.find("bad dtype") is None


# ---- non-contiguous inputs ---------------------------------------------------

def test_non_contiguous_numpy_inputs(store):
    base = sample("float32", (6, 8, 10), 7)
    tensors = {
        "transposed": base.transpose(2, 0, 1),
        "strided": base[:, ::3, 1::2],
        "reversed": base[::-1, :, ::-2],
        "fortran": np.asfortranarray(base),
        "broadcast": np.broadcast_to(np.arange(5, dtype=np.int64), (4, 5)),
        "big_endian": sample("int32", (3, 4)).astype(">i4"),
    }
    assert not any(t.flags.c_contiguous for k, t in tensors.items() if k not in ("big_endian",))
    ck = round_trip(store, "non contiguous np", tensors, "numpy")
    for name, src in tensors.items():
        got = ck.tensors[name]
        assert got.shape == src.shape, name
        assert np.array_equal(got, src), name
        assert got.flags.c_contiguous
    ck = store.load(store.find("non contiguous np"), into="mlx")
    for name, src in tensors.items():
        assert np.array_equal(np.array(ck.tensors[name]), src), name


def test_non_contiguous_mlx_inputs(store):
    base = mx.array(sample("float32", (6, 8, 10), 8))
    tensors = {
        "slice": base[:, 2:5, :],
        "strided": base[::2, :, 1::3],
        "transposed": mx.transpose(base, (2, 0, 1)),
        "swapped_bf16": mx.swapaxes(base.astype(mx.bfloat16), 0, 2),
        "broadcast": mx.broadcast_to(mx.arange(5), (4, 5)),
    }
    ck = round_trip(store, "non contiguous mx", tensors, "numpy")
    for name, src in tensors.items():
        assert np.array_equal(ck.tensors[name], bits(src)), name
    ck = store.load(store.find("non contiguous mx"), into="mlx")
    for name, src in tensors.items():
        check_mlx_result(ck.tensors[name], src.dtype, bits(src))


# ---- file layout (docs/format.md §3) ---------------------------------------------

def parse(path):
    raw = open(path, "rb").read()
    (magic, version, quant, reason, ext, model, tokens, hits, ctx, abi,
     created, last_used, payload_bytes, text_len) = HEADER.unpack_from(raw, 0)
    assert magic == b"KVC" and version == 1
    P = 52 + text_len
    pmagic, mlen, data_off, mcrc, reserved = PAYLOAD_HEAD.unpack_from(raw, P)
    manifest_raw = raw[P + 24:P + 24 + mlen]
    return dict(raw=raw, tokens=tokens, abi=abi, payload_bytes=payload_bytes, text=raw[52:P], P=P,
                pmagic=pmagic, mlen=mlen, data_off=data_off, mcrc=mcrc, reserved=reserved,
                manifest_raw=manifest_raw, manifest=json.loads(manifest_raw))


@pytest.mark.store_args(layout="whole")
@pytest.mark.parametrize("text_len", [1, 29, 4000, 4020, 4096 - 52, 9000])
def test_file_layout(store, text_len):
    text = (b"0123456789abcdef" * 600)[:text_len - 1] + b"\xff"      # not UTF-8 on purpose
    tokens = list(range(7, 7 + 123))                                 # 492 bytes: odd end of block
    tensors = {"a": sample("float16", (3, 5, 7), 1), "b": sample("int8", (13,), 2),
               "c": sample("float64", (2, 3), 3), "d": np.zeros((0, 3), np.float32),
               "e": sample("uint64", (5,), 4)}
    entry = store.save(text, tokens, tensors, meta={"m": 1})
    f = parse(entry.path)
    raw, P = f["raw"], f["P"]

    assert f["text"] == text and entry.text_bytes == len(text)
    assert entry.name == hashlib.sha1(text).hexdigest() + ".kv"
    assert f["abi"] == 16
    assert f["pmagic"] == b"KVTP"
    assert f["reserved"] == 0
    assert (P + f["data_off"]) % 4096 == 0
    assert f["data_off"] >= 24 + f["mlen"]
    assert f["mcrc"] == reference.crc32c(f["manifest_raw"])
    assert P + f["payload_bytes"] == len(raw) == entry.file_size     # no trailer

    m = f["manifest"]
    assert m["version"] == 1 and m["meta"] == {"m": 1}
    assert m["tokens"]["count"] == f["tokens"] == len(tokens) == entry.tokens
    blocks = [("tokens", m["tokens"]["offset"], 4 * m["tokens"]["count"], m["tokens"]["crc32c"],
               np.array(tokens, dtype="<u4").tobytes())]
    assert [t["name"] for t in m["tensors"]] == list(tensors)
    for t in m["tensors"]:
        src = np.ascontiguousarray(tensors[t["name"]])
        assert t["dtype"] == src.dtype.name and t["shape"] == list(src.shape)
        assert t["nbytes"] == src.nbytes
        blocks.append((t["name"], t["offset"], t["nbytes"], t["crc32c"], src.astype(src.dtype.newbyteorder("<")).tobytes()))
    assert m["tokens"]["offset"] == f["data_off"]                    # data starts with the token ids
    end = 0
    for name, off, n, crc, want in blocks:
        assert (P + off) % 64 == 0, name
        assert off >= end, f"{name} overlaps the block before"
        assert off + n <= f["payload_bytes"]
        block = raw[P + off:P + off + n]
        assert block == want, name
        assert crc == reference.crc32c(block), name
        end = off + n


@pytest.mark.store_args(layout="whole")
def test_manifest_token_count_equals_header(store):
    for n in (1, 2, 1000, 4097):
        e = store.save(f"count {n}", np.arange(n, dtype=np.int64), {})
        f = parse(e.path)
        assert f["manifest"]["tokens"]["count"] == f["tokens"] == n
        assert store.load(store.find(f"count {n}")).tokens.tolist() == list(range(n))


def test_token_ids_full_u32_range(store):
    tokens = np.array([0, 1, 2**31, 2**32 - 1], dtype=np.uint64)
    ck = round_trip(store, "u32 range", {}, "numpy", tokens=tokens.tolist())
    assert ck.tokens.tolist() == tokens.tolist()


def test_payload_larger_than_one_io_slice(store):
    # 6 MiB + odd bytes: large enough that reads and writes are split into slices.
    big = np.random.default_rng(5).integers(0, 2**32, size=(6 << 20) // 4 + 3, dtype=np.uint32)
    ck = round_trip(store, "big", {"big": big, "tail": np.arange(3, dtype=np.uint8)}, "numpy")
    assert np.array_equal(ck.tensors["big"], big)
    ck = store.load(store.find("big"), into="mlx")
    assert np.array_equal(np.array(ck.tensors["big"]), big)
    assert isinstance(ck.tensors["big"], mx.array)


def _force_route(monkeypatch, route):
    """Makes read_tensors_mlx take one of its three routes; returns a list of the defer flags used."""
    from kvstore import payload
    from kvstore.payload import mlx_io
    used = []
    load = mlx_io.load_blob

    def spy(fd, entry, tensors, lo, hi, verify, defer):
        defer = defer and route != "sync"
        used.append(defer)
        return load(fd, entry, tensors, lo, hi, verify, defer=defer)
    monkeypatch.setattr(mlx_io, "load_blob", spy)
    if route == "address_mismatch":
        queue = payload.VirtualBlob._queue_all

        def moved(self, mv):                 # as if MLX had copied out of the buffer it handed over
            n = queue(self, mv)
            self.address += 4096
            return n
        monkeypatch.setattr(payload.VirtualBlob, "_queue_all", moved)
    return used


@pytest.mark.store_args(layout="whole")
@pytest.mark.parametrize("route", ["deferred", "sync", "address_mismatch"])
def test_mlx_read_routes_give_the_same_arrays_and_check_every_crc(store, monkeypatch, route):
    rng = np.random.default_rng(11)
    tensors = {"big": rng.integers(0, 2**32, size=(3 << 20) // 4 + 5, dtype=np.uint32),
               "half": sample("float16", (7, 300), 2), "b16": mlx_sample("bfloat16", (4, 33), 3),
               "empty": np.zeros((0, 5), np.int16), "wide": sample("float64", (3,), 4)}
    entry = store.save("routes", [1, 2, 3], tensors)
    used = _force_route(monkeypatch, route)
    ck = store.load(store.find("routes"), into="mlx")
    assert used == {"deferred": [True], "sync": [False], "address_mismatch": [True, False]}[route]
    for name, src in tensors.items():
        got = ck.tensors[name]
        assert isinstance(got, mx.array) and tuple(got.shape) == tuple(src.shape)
        check_mlx_result(got, src.dtype if isinstance(src, mx.array) else mx_dtype(src.dtype.name), bits(src))
    # One flipped byte inside a tensor: a corrupt file on every route.
    m = parse(entry.path)
    t = next(t for t in m["manifest"]["tensors"] if t["name"] == "half")
    at = m["P"] + t["offset"] + 17
    raw = bytearray(m["raw"])
    raw[at] ^= 0x40
    with open(entry.path, "r+b") as f:
        f.seek(at)
        f.write(raw[at:at + 1])
    assert store.load(store.find("routes"), into="mlx") is None
    assert store.stats()["corrupt"] == 1


@pytest.fixture
def mlx_threaded():
    """payload.set_mlx_threaded(True) for one test (kvstore serve's setting)."""
    from kvstore import payload
    old = payload.set_mlx_threaded(True)
    yield
    payload.set_mlx_threaded(old)


def _reader_threads(monkeypatch):
    """The threads that run the MLX blob's readinto() (Python called by mx.load), as a set."""
    import threading
    from kvstore import payload
    seen = set()
    readinto = payload.VirtualBlob.readinto

    def spy(self, b):
        seen.add(threading.get_ident())
        return readinto(self, b)
    monkeypatch.setattr(payload.VirtualBlob, "readinto", spy)
    return seen


def _save_both_layouts(tmp_path, tensors, n):
    """The same state saved whole (ABI 16) and as a chain of 256-token blocks; yields (store, text)."""
    from kvhelpers import make_store
    text = bytes(range(65, 91)) * (n // 26) + b"z" * (n % 26)
    for layout in ("whole", "chain"):
        store = make_store(tmp_path / layout, layout=layout)
        kw = {"positional": {k: 1 for k in tensors}, "text_offsets": list(range(n + 1))} if layout == "chain" else {}
        assert store.save(text, np.arange(n), tensors, **kw) is not None
        yield store, text


def test_threaded_mlx_loads_run_no_python_inside_mlx(tmp_path, monkeypatch, mlx_threaded):
    # mx.load calls readinto() from an MLX thread; a threaded process must never.
    import threading
    rng = np.random.default_rng(3)
    n = 600
    tensors = {"k": rng.integers(0, 2**16, size=(2, n, 700), dtype=np.uint16).view(np.float16),
               "v": rng.standard_normal((2, n, 9)).astype(np.float32)}
    for store, text in _save_both_layouts(tmp_path, tensors, n):
        seen = _reader_threads(monkeypatch)
        ck = store.load(store.find(text), into="mlx")
        assert ck is not None and ck.entry.is_block == (store.settings.layout == "chain")
        assert seen <= {threading.get_ident()}, store.settings.layout
        for k, a in tensors.items():
            assert isinstance(ck.tensors[k], mx.array)
            assert np.array_equal(np.array(ck.tensors[k]).view(np.uint8), a.view(np.uint8)), (store.settings.layout, k)
        store.close()


def test_default_mlx_loads_let_mx_load_read(tmp_path, monkeypatch):
    # The fast route the threaded setting gives up: mx.load hands its own
    # memory to readinto() from one of MLX's threads.
    import threading
    tensors = {"k": np.ones((2, 600, 64), np.float16)}
    for store, text in _save_both_layouts(tmp_path, tensors, 600):
        seen = _reader_threads(monkeypatch)
        ck = store.load(store.find(text), into="mlx")
        assert ck is not None and np.array_equal(np.array(ck.tensors["k"]), tensors["k"])
        assert seen - {threading.get_ident()}, store.settings.layout
        store.close()


def test_threaded_mlx_loads_zero_fill_on_the_bulk_thread(tmp_path, monkeypatch, mlx_threaded):
    # The zero-fill of a threaded load's fresh memory is bulk work: it runs
    # on the bulk thread (at the I/O threads' niceness, with its own MLX
    # stream), not on the loading thread, whose priority a server keeps.
    import threading

    from kvstore.payload import mlx_io
    seen = []
    zeroed = mlx_io._zeroed

    def spy(n):
        seen.append(threading.current_thread().name)
        return zeroed(n)
    monkeypatch.setattr(mlx_io, "_zeroed", spy)
    rng = np.random.default_rng(5)
    tensors = {"k": rng.standard_normal((2, 600, 64)).astype(np.float32)}
    for store, text in _save_both_layouts(tmp_path, tensors, 600):
        ck = store.load(store.find(text), into="mlx")
        assert np.array_equal(np.array(ck.tensors["k"]), tensors["k"])
    assert len(seen) == 2 and all(name.startswith("kvstore-bulk") for name in seen), seen


@pytest.mark.store_args(layout="whole")
def test_threaded_mlx_load_of_a_corrupt_file_is_a_miss(store, mlx_threaded):
    e = store.save("corrupt threaded", [1, 2, 3], {"a": np.arange(4096, dtype=np.float32)})
    m = parse(e.path)
    at = m["P"] + m["manifest"]["tensors"][0]["offset"] + 100
    with open(e.path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 1]))
    assert store.load(store.find("corrupt threaded"), into="mlx") is None
    assert store.stats()["corrupt"] == 1


# ---- a strided view written as its contiguous runs ----------------------------------

def kv_slices(seed=3):
    """KV buffers (1, 4, 64, 128) float16 cut along the sequence axis: runs of
    32 rows x 256 B = 8 KiB, then of 96 rows = 24 KiB (above MIN_RUN)."""
    base = sample("float16", (1, 4, 256, 128), seed)
    return {"short_runs": base[:, :, 8:40, :], "long_runs": base[:, :, 100:196, :],
            "two_axes": base[:, 1:3, 100:196, :]}


def test_contiguous_runs_are_views_in_order():
    from kvstore.payload import plan
    t = kv_slices()
    runs = plan.contiguous_runs(t["long_runs"])
    assert runs is not None and len(runs) == 4
    assert all(np.shares_memory(r, t["long_runs"]) and r.flags.c_contiguous for r in runs)
    assert b"".join(r.tobytes() for r in runs) == np.ascontiguousarray(t["long_runs"]).tobytes()
    assert plan.contiguous_runs(t["short_runs"]) is None          # runs under MIN_RUN: copied
    assert plan.contiguous_runs(t["two_axes"]) is not None        # (1, 2) leading axes merge
    assert plan.contiguous_runs(sample("float16", (2, 3, 64, 128))[:, 1:, 10:60]) is None  # no merge
    assert plan.contiguous_runs(sample("float16", (256, 128))) is None                    # contiguous
    assert plan.contiguous_runs(sample("int32", (64, 128)).astype(">i4")[::2]) is None    # big-endian


@pytest.mark.parametrize("sealed", [False, True])
def test_strided_views_are_written_as_runs_and_read_back_exact(tmp_path, monkeypatch, sealed):
    import kvstore
    from kvstore import sources
    from kvstore.payload import plan
    written = []
    real = plan.pwrite_pieces

    def spy(dst, bufs, offset, path=None):
        written.append(len(bufs))
        return real(dst, bufs, offset, path)
    monkeypatch.setattr(plan, "pwrite_pieces", spy)
    # A plain file's small tensors go in batches, one native call each.
    batched = []
    real_blocks = sources.FdSource.pwrite_blocks

    def spy_blocks(self, blocks, path=None, crc=True):
        batched.extend(len(bufs) for _, bufs in blocks)
        return real_blocks(self, blocks, path, crc)
    monkeypatch.setattr(sources.FdSource, "pwrite_blocks", spy_blocks)
    tensors = {**kv_slices(), "plain": sample("int32", (7, 5))}
    key = os.urandom(32) if sealed else None
    with kvstore.KVStore(tmp_path / "s", min_tokens=1, layout="whole", key=key) as store:
        e = store.save("strided text", [1, 2, 3], tensors)
        assert e is not None and store.verify_file(e.path) is None
        ck = store.load(store.find("strided text and more"), into="numpy")
    assert ck is not None
    for name, want in tensors.items():
        assert np.array_equal(ck.tensors[name], want), name
    # long_runs (4 runs) and two_axes (2) as views of their runs; the rest
    # (the tokens, short_runs, plain) copied into one buffer each.
    if sealed:                                  # the sealing sink takes no batch
        assert sorted(written) == [2, 4] and batched == []
    else:
        assert written == [] and sorted(batched) == [1, 1, 1, 2, 4]


def test_a_batch_of_blocks_lands_at_its_offsets_with_each_crc(tmp_path):
    from kvstore import _native
    rng = np.random.default_rng(5)
    # 70 spans in the first block: more than one vectored write (64).
    first = [rng.integers(0, 256, int(n), dtype=np.uint8) for n in rng.integers(1, 5000, 70)]
    second = [b"tail", bytearray(b"x" * 3)]
    at = sum(a.nbytes for a in first) + 100
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        crcs = _native.pwrite_blocks(fd, [(0, first), (at, second)], "f")
        assert _native.pwrite_blocks(fd, [(0, first)], "f", crc=False) == [0]
    finally:
        os.close(fd)
    data = (tmp_path / "f").read_bytes()
    one = b"".join(a.tobytes() for a in first)
    assert data[:len(one)] == one and data[at:] == b"tailxxx"
    assert crcs == [_native.crc32c(one), _native.crc32c(b"tailxxx")]
    ro = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        with pytest.raises(OSError) as err:
            _native.pwrite_blocks(ro, [(0, [b"abc"])], "the-file")
        assert "the-file" in str(err.value)
    finally:
        os.close(ro)


# ---- loads too large for one MLX array ------------------------------------------------

def _save_big(store, text, n_tensors, rows, distinct=False):
    """A chain (or whole file) of n_tensors (1, 8, rows, 4096) uint8 tensors,
    every one the same data (or, with distinct, tensor i the data + i)."""
    base = np.arange(8 * rows * 4096, dtype=np.uint32).astype(np.uint8).reshape(1, 8, rows, 4096)
    tensors = {f"t{i}": base + np.uint8(i) if distinct else base for i in range(n_tensors)}
    e = store.save(text, list(range(rows)), tensors, positional={k: 2 for k in tensors},
                   text_offsets=lambda i: i)
    assert e is not None and e.tokens == rows
    return tensors


def _round_trip_into_mlx(tmp_path, layout, threaded, n_tensors, rows):
    """Saves n_tensors distinct (1, 8, rows, 4096) tensors, loads them into
    MLX (threaded or not) and checks each came back whole and in its place."""
    from kvstore.payload import mlx_io
    old = mlx_io.set_mlx_threaded(threaded)
    try:
        with make_store(tmp_path / "kv", layout=layout, block_tokens=rows // 2) as s:
            want = _save_big(s, b"b" * rows, n_tensors, rows, distinct=True)
            ck = s.load(s.find(b"b" * rows), into="mlx")
            assert ck is not None and s.stats()["corrupt"] == 0
            for name, a in want.items():
                assert np.array_equal(np.array(ck.tensors[name]), a), name
    finally:
        mlx_io.set_mlx_threaded(old)


@pytest.mark.parametrize("layout", ["chain", "whole"])
@pytest.mark.parametrize("threaded", [False, True])
def test_a_load_larger_than_one_mlx_array_is_read_into_several(tmp_path, monkeypatch, layout, threaded):
    # MLX's shapes are 32-bit: a blob of 2 GiB or more cannot be one array.
    # A load past the limit (here lowered to 2.5 MiB) is read into several
    # blobs of whole tensors, each within the limit, straight into MLX's
    # memory; each tensor comes back whole and in its place.
    pytest.importorskip("mlx.core")
    from kvstore.payload import mlx_io
    assert mlx_io.MLX_BLOB_MAX < 2 ** 31
    monkeypatch.setattr(mlx_io, "MLX_BLOB_MAX", 5 << 19)
    blobs = []
    fill = mlx_io._fill_blobs

    def spy(srcs):
        blobs.extend(src.size - len(src.head) for src in srcs)
        return fill(srcs)
    monkeypatch.setattr(mlx_io, "_fill_blobs", spy)
    to_mlx = mlx_io._numpy_to_mlx
    monkeypatch.setattr(mlx_io, "_numpy_to_mlx", lambda arrays, dtypes: to_mlx(arrays, dtypes) if not arrays
                        else pytest.fail(f"no NumPy route: {sorted(arrays)}"))
    _round_trip_into_mlx(tmp_path, layout, threaded, 5, 32)              # 5 tensors of 1 MiB
    assert len(blobs) == 3 and max(blobs) <= 5 << 19, blobs


@pytest.mark.parametrize("threaded", [False, True])
def test_a_chain_load_into_several_blobs_reads_them_in_one_pass(tmp_path, monkeypatch, threaded):
    # The blobs' memory is allocated first; then one walk of the chain
    # queues the reads of all of them (one Batch: the I/O threads never wait
    # for the next blob), and each block's manifest is read once, not once
    # per blob.
    pytest.importorskip("mlx.core")
    from kvstore.payload import batch, chains, mlx_io
    monkeypatch.setattr(mlx_io, "MLX_BLOB_MAX", 5 << 19)
    batches, manifests = [], []
    batch_init, read_manifest = batch.Batch.__init__, chains.read_manifest

    def count_batch(self, *a, **kw):
        batches.append(self)
        batch_init(self, *a, **kw)

    def count_manifest(fd, e, **kw):
        manifests.append(e.path)
        return read_manifest(fd, e, **kw)
    monkeypatch.setattr(batch.Batch, "__init__", count_batch)
    monkeypatch.setattr(chains, "read_manifest", count_manifest)
    old = mlx_io.set_mlx_threaded(threaded)
    try:
        with make_store(tmp_path / "kv", layout="chain", block_tokens=8) as s:
            want = _save_big(s, b"b" * 32, 5, 32, distinct=True)          # 4 blocks, 3 blobs
            batches.clear(), manifests.clear()
            ck = s.load(s.find(b"b" * 32), into="mlx")
            assert ck is not None and s.stats()["corrupt"] == 0
            for name, a in want.items():
                assert np.array_equal(np.array(ck.tensors[name]), a), name
    finally:
        mlx_io.set_mlx_threaded(old)
    assert len(batches) == 1
    assert len(manifests) == len(set(manifests)) == 4, manifests


@pytest.mark.parametrize("layout", ["chain", "whole"])
def test_the_garbage_collector_is_paused_while_a_load_reads(tmp_path, monkeypatch, layout):
    # A full collection holds the GIL for tens of milliseconds in a large
    # process: not while the I/O threads wait for their next reads.  It
    # resumes after the load, and stays off if it was off.
    from kvstore import payload
    from kvstore.payload import chains, whole
    seen = []
    for mod, name in ((chains, "read_stream"), (whole, "read_block")):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, real=real, **kw: (seen.append(gc.isenabled()), real(*a, **kw))[1])
    assert gc.isenabled()
    with make_store(tmp_path / "kv", layout=layout, block_tokens=8) as s:
        want = _save_big(s, b"b" * 32, 2, 32)
        assert np.array_equal(s.load(s.find(b"b" * 32)).tensors["t1"], want["t1"])
        assert seen and not any(seen)
        assert gc.isenabled()
        gc.disable()
        try:
            assert s.load(s.find(b"b" * 32)) is not None
            assert not gc.isenabled()
        finally:
            gc.enable()
    with payload.gc_paused():
        with payload.gc_paused():
            pass
        assert not gc.isenabled()            # until the last of overlapping loads ends
    assert gc.isenabled()


@pytest.mark.parametrize("layout", ["chain", "whole"])
@pytest.mark.parametrize("threaded", [False, True])
def test_a_tensor_larger_than_one_mlx_array_goes_through_numpy(tmp_path, monkeypatch, layout, threaded):
    pytest.importorskip("mlx.core")
    from kvstore.payload import mlx_io
    monkeypatch.setattr(mlx_io, "MLX_BLOB_MAX", 1 << 20)
    monkeypatch.setattr(mlx_io, "_fill_blobs", lambda srcs: pytest.fail("no blob past MLX_BLOB_MAX"))
    _round_trip_into_mlx(tmp_path, layout, threaded, 4, 128)             # 4 tensors of 4 MiB


def test_a_state_of_over_2_gib_loads_into_mlx(tmp_path):
    # 2.25 GiB of tensors (one 64 MiB array stored 36 times): past MLX's
    # 32-bit sizes, the load must not read a wrapped size and call the
    # files corrupt (it removed them).
    pytest.importorskip("mlx.core")
    with make_store(tmp_path / "kv", block_tokens=1024) as s:
        base = _save_big(s, b"g" * 2048, 36, 2048)["t0"]
        ck = s.load(s.find(b"g" * 2048), into="mlx")
        assert ck is not None and s.stats()["corrupt"] == 0
        for i in (0, 17, 35):
            assert np.array_equal(np.array(ck.tensors[f"t{i}"]), base)
        del ck
