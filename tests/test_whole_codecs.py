"""Codecs on whole files (layout="whole": payload ABI 208 packed, 144
quantised, 240 and 176 sealed; docs/format.md §20).

A whole file packs or quantises each tensor as one block, in the forms a
chain block uses; every store reads it into NumPy and MLX (lossless bit for
bit, lossy within the codec's error, snapshots and integers exact).  An
older build sees a foreign file; damage is found by the stored bytes' CRC;
the budget counts stored bytes; export writes a raw ABI 16 file.
"""

import os

import numpy as np
import pytest

from kvstore import files
from kvstore.format import (LOSSY_ABI_OFFSET, PAYLOAD_ABI_LOSSY_TENSORS, PAYLOAD_ABI_TABLE_TENSORS,
                            PAYLOAD_ABI_TENSORS, SEALED_ABI_OFFSET)
from kvhelpers import checkpoint_files, flip, make_store
from test_packed import TOKENS, dir_bytes, manifest_of, older_build, rewrite_abi, same, save, state
from test_quantized import ERROR, rel

CODECS = ("lossless", "q8", "q4")


def whole(path, **kw):
    return make_store(path, layout="whole", **kw)


def abi_of(codec, sealed):
    abi = PAYLOAD_ABI_TABLE_TENSORS if codec == "lossless" else PAYLOAD_ABI_LOSSY_TENSORS
    return abi + SEALED_ABI_OFFSET if sealed else abi


def as_numpy(a):
    if type(a).__module__.startswith("mlx"):
        import mlx.core as mx
        return np.array(a.view(mx.uint16)) if a.dtype == mx.bfloat16 else np.array(a)
    return np.asarray(a)


def check_restored(ck, tensors, codec, into):
    """Lossless: every tensor bit for bit; lossy: K and V within the codec's
    error, the snapshot and the positions exact; Checkpoint.lossy says which."""
    assert ck is not None and ck.tokens.size == TOKENS
    assert list(np.asarray(ck.tokens)) == list(range(TOKENS))
    assert ck.lossy == ("" if codec == "lossless" else codec)
    for name, want in tensors.items():
        got = as_numpy(ck.tensors[name])
        assert got.shape == want.shape, name
        if codec != "lossless" and name in ("k", "v"):
            assert 0 < rel(got, want) <= ERROR[codec], name
        else:
            assert same(ck.tensors[name], want, into), name


@pytest.mark.parametrize("into", ["numpy", "mlx"])
@pytest.mark.parametrize("sealed", [False, True], ids=["plain", "sealed"])
@pytest.mark.parametrize("codec", CODECS)
def test_a_whole_file_is_packed_and_loads_back(tmp_path, codec, sealed, into):
    if into == "mlx":
        pytest.importorskip("mlx.core")
    key = None
    if sealed:
        pytest.importorskip("cryptography")
        key = os.urandom(32)
    with whole(tmp_path / "raw", key=key, kv_codec="raw") as s:
        _, _, e = save(s)
        assert e.payload_abi == PAYLOAD_ABI_TENSORS + (SEALED_ABI_OFFSET if sealed else 0)
    with whole(tmp_path / "c", key=key, kv_codec=codec) as s:
        text, tensors, e = save(s)
        assert e.payload_abi == abi_of(codec, sealed)
        assert [x.payload_abi for x in s.entries()] == [e.payload_abi]
        assert s.stats()["kv_ratio"] < (0.8 if codec == "lossless" else 0.6)
        assert s.verify_file(e.path) is None
    assert dir_bytes(tmp_path / "c") < (0.85 if codec == "lossless" else 0.65) * dir_bytes(tmp_path / "raw")
    # Any store with the key reads it, whatever it writes.
    with whole(tmp_path / "c", key=key, kv_codec="raw") as s:
        check_restored(s.load(s.find(text + b"more"), into=into), tensors, codec, into)


@pytest.mark.parametrize("codec", CODECS)
def test_the_manifest_packs_each_tensor_as_one_block(tmp_path, codec):
    with whole(tmp_path, kv_codec=codec) as s:
        _, tensors, e = save(s)
    m = manifest_of(e)
    want = {"k", "v", "window"} if codec == "lossless" else {"k", "v"}    # lossy: positional rows only
    assert set(m.packed) == want
    for name, (stored, form) in m.packed.items():
        assert form.codec == ("table-planes" if codec == "lossless" else codec)
        assert stored < tensors[name].nbytes


def test_a_whole_file_that_does_not_shrink_stays_abi_16(tmp_path):
    noise = np.random.default_rng(5).integers(0, 1 << 16, (1, 4, 128, 64), dtype=np.uint16)
    with whole(tmp_path, kv_codec="lossless") as s:
        e = s.save(b"x" * 128, list(range(128)), {"k": noise}, {}, positional={"k": 2}, dtypes={"k": "bfloat16"})
        assert e.payload_abi == PAYLOAD_ABI_TENSORS
        assert (s.load(s.find(b"x" * 128)).tensors["k"] == noise).all()


@pytest.mark.parametrize("codec", CODECS)
def test_an_older_build_sees_a_foreign_file(tmp_path, monkeypatch, codec):
    """A build from before whole packed files: listed and counted, never
    loaded (a miss), never stored bytes read as tensors."""
    with whole(tmp_path, kv_codec=codec) as s:
        text, _, _ = save(s)
    older_build(monkeypatch, packed=(209, 145))
    with whole(tmp_path) as s:
        assert s.find(text) is None
        assert len(s.entries()) == len(checkpoint_files(tmp_path)) == 1


def test_damage_to_a_packed_whole_file_is_found_and_removed(tmp_path):
    with whole(tmp_path, kv_codec="lossless") as s:
        text, _, e = save(s)
        m = manifest_of(e)
        k = next(r for r in m.tensors if r[0] == "k")
        flip(e.path, e.tensors_offset + k[3] + m.packed["k"][0] - 1)      # the last stored byte of k
        assert files.verify_file(e.path).startswith("crc:")
        assert s.load(s.find(text)) is None
        assert not os.path.exists(e.path)


def test_a_quantised_row_under_the_lossless_abi_is_corrupt(tmp_path):
    """The ABI says which codecs a row may name: q8 rows in an ABI 208 file
    (or packed rows in an ABI 16 one) are bad_manifest, never read."""
    with whole(tmp_path, kv_codec="q8") as s:
        text, _, e = save(s)
    rewrite_abi(e.path, PAYLOAD_ABI_TABLE_TENSORS)
    assert "packed is not a block of table-planes" in files.verify_file(e.path)
    rewrite_abi(e.path, PAYLOAD_ABI_TENSORS)
    assert "packed in a file whose ABI packs nothing" in files.verify_file(e.path)
    rewrite_abi(e.path, PAYLOAD_ABI_TENSORS + LOSSY_ABI_OFFSET)
    assert files.verify_file(e.path) is None


def test_a_whole_file_over_the_budget_raw_but_not_packed_is_kept(tmp_path):
    with whole(tmp_path / "probe", kv_codec="lossless", budget_mb=0) as s:
        save(s)
    packed = dir_bytes(tmp_path / "probe")
    slack = -(-packed // 100)
    with whole(tmp_path / "fits", kv_codec="lossless", budget_mb=(packed + slack) / 2**20) as s:
        text, tensors, e = save(s)
        assert e.payload_abi == PAYLOAD_ABI_TABLE_TENSORS and dir_bytes(tmp_path / "fits") == packed
    with whole(tmp_path / "tight", kv_codec="lossless", budget_mb=(packed + slack - 1) / 2**20) as s:
        text, ids, tensors, axes, dtypes = state()
        assert s.save(text, ids, tensors, {}, positional=axes, dtypes=dtypes) is None
        assert checkpoint_files(tmp_path / "tight") == []


def test_export_writes_a_raw_abi_16_file_any_build_imports(tmp_path):
    from kvstore.exchange import export_checkpoint, import_checkpoint
    with whole(tmp_path / "a", kv_codec="lossless") as s:
        text, tensors, e = save(s)
        out = export_checkpoint(s, s.find(text), tmp_path / "out.kv")
    assert out.payload_abi == PAYLOAD_ABI_TENSORS and files.verify_file(str(tmp_path / "out.kv")) is None
    with whole(tmp_path / "b") as s:
        import_checkpoint(s, tmp_path / "out.kv")
        ck = s.load(s.find(text))
        assert all(same(ck.tensors[k], v, "numpy") for k, v in tensors.items())
