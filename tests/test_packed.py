"""Packed chain blocks (kv_codec="lossless", payload ABI 209, docs/format.md §20).

A store that packs writes each chain block's float tensors as byte planes,
table planes wherever that shrinks them; every store reads them, into NumPy
and MLX, bit for bit.  A block whose tensors do not shrink stays ABI 17.
A reader that does not know ABI 209 (an older build) sees foreign files: a
miss, or the raw chain prefix before the first packed block.  Damage to a
packed block is found by its CRC (of the stored bytes) like any other.
"""

import dataclasses
import os

import numpy as np
import pytest

from kvstore import files
from kvstore.format import PAYLOAD_ABI_CHAIN, PAYLOAD_ABI_TABLE_CHAIN, PAYLOAD_ABI_ZSTD_CHAIN, HEADER_SIZE, Header
from kvstore.payload import read_manifest
from kvhelpers import checkpoint_files, flip, make_store


BLOCK = 64
TOKENS = 300


def bf16(shape, seed):
    """Normal bfloat16 values as their uint16 bits (what a KV cache holds)."""
    f = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    return (f.view(np.uint32) >> 16).astype(np.uint16)


def state(n=TOKENS, seed=0, snapshot=True):
    """(text, token ids, tensors, axes, dtypes): two growing KV tensors, their
    positions, and a snapshot (a sliding window) unless snapshot=False."""
    text = b"".join(b"w%05d " % i for i in range(n))
    # The first n tokens of one session, whatever n: a longer save continues a shorter one.
    tensors = {"k": np.ascontiguousarray(bf16((1, 4, TOKENS, 64), seed)[:, :, :n]),
               "v": np.ascontiguousarray(bf16((1, 4, TOKENS, 64), seed + 1)[:, :, :n]),
               "pos": np.arange(n, dtype=np.int32)}
    if snapshot:
        tensors["window"] = bf16((1, 4, 32, 64), seed + 2)
    axes = {"k": 2, "v": 2, "pos": 0}
    return text, list(range(n)), tensors, axes, {"k": "bfloat16", "v": "bfloat16", "window": "bfloat16"}


def save(store, n=TOKENS, seed=0, snapshot=True):
    text, ids, tensors, axes, dtypes = state(n, seed, snapshot)
    e = store.save(text, ids, tensors, {"layers": 1}, positional=axes, text_offsets=lambda i: 7 * i, dtypes=dtypes)
    assert e is not None
    return text, tensors, e


def manifest_of(e):
    """The checked manifest of the file of Entry e."""
    fd = os.open(e.path, os.O_RDONLY)
    try:
        return read_manifest(fd, e)
    finally:
        os.close(fd)


def rewrite_abi(path, abi):
    """The file's header rewritten to say payload ABI abi (the body as it was)."""
    with open(path, "r+b") as f:
        h = Header.unpack(f.read(HEADER_SIZE))
        f.seek(0)
        f.write(dataclasses.replace(h, payload_abi=abi).pack())


def dir_bytes(path):
    return sum(os.path.getsize(os.path.join(path, n)) for n in checkpoint_files(path))


def same(got, want, into):
    if into == "mlx":
        import mlx.core as mx
        got = np.array(got.view(mx.uint16)) if got.dtype == mx.bfloat16 else np.array(got)
    return got.dtype == want.dtype and got.shape == want.shape and (np.asarray(got) == want).all()


@pytest.mark.parametrize("into", ["numpy", "mlx"])
def test_packed_chain_is_smaller_and_loads_bit_exact(tmp_path, into):
    if into == "mlx":
        pytest.importorskip("mlx.core")
    raw, packed = tmp_path / "raw", tmp_path / "packed"
    with make_store(raw, block_tokens=BLOCK, kv_codec="raw") as s:
        save(s)
    with make_store(packed, block_tokens=BLOCK, kv_codec="lossless") as s:
        assert s.settings.kv_codec == "lossless"
        text, tensors, e = save(s)
        assert e.payload_abi == PAYLOAD_ABI_TABLE_CHAIN
        assert {x.payload_abi for x in s.entries()} == {PAYLOAD_ABI_TABLE_CHAIN}
    assert dir_bytes(packed) < 0.85 * dir_bytes(raw)
    with make_store(packed) as s:                 # any store reads them; this one writes raw
        hit = s.find(text + b"more")
        assert hit is not None and hit.tokens == TOKENS
        ck = s.load(hit, into=into)
        assert list(np.asarray(ck.tokens)) == list(range(TOKENS))
        for name, want in tensors.items():
            assert same(ck.tensors[name], want, into), name
    assert [files.verify_file(str(packed / n)) for n in checkpoint_files(packed)] == \
        [None] * len(checkpoint_files(packed))


def test_the_manifest_records_each_packed_tensor(tmp_path):
    with make_store(tmp_path, block_tokens=BLOCK, kv_codec="lossless") as s:
        _, _, e = save(s)
    m = manifest_of(e)
    assert set(m.packed) == {"k", "v", "window"}            # int32 positions stay raw
    for name, (stored, form) in m.packed.items():
        planes = form.planes
        n = dict((r[0], r[4]) for r in m.tensors)[name]
        assert stored == sum(length for _, length in planes) < n
        assert planes[0] == ("raw", n // 2) and planes[1][0] == "table"    # mantissa raw, exponent packed


def test_incompressible_blocks_stay_abi_17(tmp_path):
    noise = np.random.default_rng(5).integers(0, 1 << 16, (1, 4, 128, 64), dtype=np.uint16)
    with make_store(tmp_path, block_tokens=BLOCK, kv_codec="lossless") as s:
        e = s.save(b"x" * 128, list(range(128)), {"k": noise}, {}, positional={"k": 2},
                   text_offsets=lambda i: i, dtypes={"k": "bfloat16"})
        assert {x.payload_abi for x in s.entries()} == {PAYLOAD_ABI_CHAIN}
        ck = s.load(s.find(b"x" * 128))
        assert (ck.tensors["k"] == noise).all() and e.payload_abi == PAYLOAD_ABI_CHAIN


def test_raw_and_packed_blocks_make_one_chain(tmp_path):
    """A raw store's chain continued by a packed one, and the other way round."""
    with make_store(tmp_path / "a", block_tokens=BLOCK, kv_codec="raw") as s:
        save(s, n=130)
    with make_store(tmp_path / "a", block_tokens=BLOCK, kv_codec="lossless") as s:
        text, tensors, _ = save(s)
        abis = sorted(x.payload_abi for x in s.entries())
        assert abis[0] == PAYLOAD_ABI_CHAIN and abis[-1] == PAYLOAD_ABI_TABLE_CHAIN
        ck = s.load(s.find(text))
        assert ck is not None and all(same(ck.tensors[k], v, "numpy") for k, v in tensors.items())
    with make_store(tmp_path / "b", block_tokens=BLOCK, kv_codec="lossless") as s:
        save(s, n=130)
    with make_store(tmp_path / "b", block_tokens=BLOCK, kv_codec="raw") as s:
        text, tensors, _ = save(s)
        ck = s.load(s.find(text))
        assert ck.tokens.size == TOKENS and all(same(ck.tensors[k], v, "numpy") for k, v in tensors.items())


def older_build(monkeypatch, packed=()):
    """What a build from before ABI 209 knows: ABIs 16 and 17 load, 17 and 49
    are blocks; packed=(209,): one from before ABI 145 (test_quantized)."""
    from kvstore import codec, format, index, index_snapshot
    loadable, blocks = frozenset({16, 17, *packed}), frozenset({17, 49, *packed})
    monkeypatch.setattr(format, "LOADABLE_ABIS", loadable)
    monkeypatch.setattr(format, "BLOCK_ABIS", blocks)
    monkeypatch.setattr(format, "PACKED_ABIS", frozenset(packed))
    monkeypatch.setattr(format, "PACKED_BLOCK_ABIS", frozenset(packed))     # no chain head read for the others
    monkeypatch.setattr(index, "LOADABLE_ABIS", loadable)
    monkeypatch.setattr(index_snapshot, "BLOCK_ABIS", tuple(sorted(blocks)))
    monkeypatch.setattr(codec.PlainCodec, "abis", loadable)


def test_a_reader_without_abi_209_misses_cleanly(tmp_path, monkeypatch):
    """To an older build the packed blocks are foreign files: a lookup
    stops at the last raw block before them, and loads it."""
    with make_store(tmp_path, block_tokens=BLOCK, kv_codec="raw") as s:
        save(s, n=130, snapshot=False)                # raw blocks to 128 tokens (and the leaf, 130)
    with make_store(tmp_path, block_tokens=BLOCK, kv_codec="lossless") as s:
        text, tensors, _ = save(s, snapshot=False)    # packed blocks from 128 on
    older_build(monkeypatch)
    with make_store(tmp_path) as s:
        hit = s.find(text)
        assert hit is not None and hit.tokens == 130 and hit.payload_abi == PAYLOAD_ABI_CHAIN
        ck = s.load(hit)
        assert same(ck.tensors["k"], tensors["k"][:, :, :130], "numpy")
        assert len(s.entries()) == len(checkpoint_files(tmp_path))        # listed, counted, kept


def test_a_retired_zstd_block_is_a_foreign_file(tmp_path):
    """ABI 81 (zstd planes, builds before table planes) is no longer read:
    such a block is listed and counted, and a lookup stops before it."""
    with make_store(tmp_path, block_tokens=BLOCK, kv_codec="raw") as s:
        save(s, n=130, snapshot=False)
    with make_store(tmp_path, block_tokens=BLOCK, kv_codec="lossless") as s:
        text, tensors, e = save(s, snapshot=False)
    packed_files = [p for p in (os.path.join(tmp_path, n) for n in checkpoint_files(tmp_path))
                    if read_abi(p) == PAYLOAD_ABI_TABLE_CHAIN]
    assert packed_files
    for p in packed_files:
        rewrite_abi(p, PAYLOAD_ABI_ZSTD_CHAIN)
    with make_store(tmp_path) as s:
        hit = s.find(text)
        assert hit is not None and hit.tokens == 130 and hit.payload_abi == PAYLOAD_ABI_CHAIN
        assert len(s.entries()) == len(checkpoint_files(tmp_path))
        assert sum(x.payload_abi == PAYLOAD_ABI_ZSTD_CHAIN for x in s.entries()) == len(packed_files)


def read_abi(path):
    """The payload ABI in a checkpoint file's header."""
    with open(path, "rb") as f:
        return Header.unpack(f.read(HEADER_SIZE)).payload_abi


def test_damage_to_a_packed_block_is_found_and_falls_back(tmp_path, caplog):
    with make_store(tmp_path, block_tokens=BLOCK, kv_codec="lossless") as s:
        text, tensors, e = save(s, snapshot=False)      # every block restorable: a fallback is a hit
        m = manifest_of(e)
        k = next(r for r in m.tensors if r[0] == "k")
        flip(e.path, e.tensors_offset + k[3] + m.packed["k"][0] - 1)       # the last stored byte
        assert files.verify_file(e.path).startswith("crc:")
        ck = s.load(s.find(text))
        assert ck is not None and ck.tokens.size == 256      # the chain before the damaged block
        assert same(ck.tensors["k"], tensors["k"][:, :, :256], "numpy")
        assert not os.path.exists(e.path)


def test_a_packed_manifest_under_abi_17_is_corrupt(tmp_path):
    """The ABI says a block may be packed: a packed row in an ABI 17 file is
    bad_manifest, never stored bytes read as raw tensors."""
    with make_store(tmp_path, block_tokens=BLOCK, kv_codec="lossless") as s:
        text, _, e = save(s)
    rewrite_abi(e.path, PAYLOAD_ABI_CHAIN)
    assert "packed in a file whose ABI packs nothing" in files.verify_file(e.path)
    with make_store(tmp_path) as s:
        ck = s.load(s.find(text))
        assert ck is None or ck.tokens.size < TOKENS


def test_bad_settings_are_refused_naming_the_value(tmp_path):
    with pytest.raises(ValueError, match="kv_codec='zip' is not one of raw, lossless, q8, q4"):
        make_store(tmp_path / "a", kv_codec="zip")


def test_a_chain_over_the_budget_raw_but_not_packed_is_kept(tmp_path):
    """The budget counts stored bytes: a chain whose raw size is over it and
    whose packed size is under it is stored (each block packed once to
    learn its size), and one over it packed too is refused."""
    with make_store(tmp_path / "raw", block_tokens=BLOCK, kv_codec="raw", budget_mb=0) as s:
        save(s)
    with make_store(tmp_path / "probe", block_tokens=BLOCK, kv_codec="lossless", budget_mb=0) as s:
        save(s)
    raw, packed = dir_bytes(tmp_path / "raw"), dir_bytes(tmp_path / "probe")
    assert packed < 0.85 * raw
    slack = -(-packed // 100)
    with make_store(tmp_path / "fits", block_tokens=BLOCK, kv_codec="lossless",
                    budget_mb=(packed + slack) / 2**20) as s:
        text, tensors, e = save(s)
        assert dir_bytes(tmp_path / "fits") == packed
        ck = s.load(s.find(text))
        assert all(same(ck.tensors[k], v, "numpy") for k, v in tensors.items())
    with make_store(tmp_path / "tight", block_tokens=BLOCK, kv_codec="lossless",
                    budget_mb=(packed + slack - 1) / 2**20) as s:
        text, ids, tensors, axes, dtypes = state()
        assert s.save(text, ids, tensors, {}, positional=axes, text_offsets=lambda i: 7 * i, dtypes=dtypes) is None
        assert checkpoint_files(tmp_path / "tight") == []
