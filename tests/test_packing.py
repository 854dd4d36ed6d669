"""Packed blocks (kvstore.payload.packing): a block's byte planes, each a
zstd frame or raw, rebuilt exactly, and a damaged or lying frame refused
before anything is written where it would land."""

import numpy as np
import pytest

from kvstore.errors import CorruptCheckpoint
from kvstore.payload import packing

zstandard = pytest.importorskip("zstandard")


def bfloat16_bits(n, seed=0, scale=1.0):
    """n bfloat16 values of a normal distribution, as their uint16 bits."""
    f = np.random.default_rng(seed).standard_normal(n).astype(np.float32) * scale
    return (f.view(np.uint32) >> 16).astype(np.uint16)


def roundtrip(pieces, width):
    planes, parts = packing.pack(pieces, width)
    stored = b"".join(bytes(p) for p in parts)
    assert len(stored) == packing.stored_size(planes)
    assert packing.check_planes(planes, width, sum(memoryview(p).nbytes for p in pieces)) is None
    out = [bytearray(memoryview(p).nbytes) for p in pieces]
    packing.unpack(stored, planes, out, "f.kv", "tensor 'k'")
    assert b"".join(out) == b"".join(bytes(memoryview(p).cast("B")) for p in pieces)
    return planes, stored


def test_bfloat16_keeps_its_mantissa_raw_and_packs_its_exponent():
    a = bfloat16_bits(1 << 18)
    planes, stored = roundtrip([a[:1000], a[1000:]], 2)
    assert planes[0] == ["raw", a.size]                 # the low byte: the mantissa
    assert planes[1][0] == "zstd" and planes[1][1] < 0.6 * a.size
    assert len(stored) < 0.8 * a.nbytes


def test_random_bytes_stay_raw_and_zeros_pack_to_almost_nothing():
    noise = np.random.default_rng(1).integers(0, 256, 1 << 18, dtype=np.uint8)
    planes, _ = roundtrip([noise], 2)
    assert [k for k, _ in planes] == ["raw", "raw"]
    planes, stored = roundtrip([np.zeros(1 << 18, np.uint8)], 4)
    assert [k for k, _ in planes] == ["zstd"] * 4 and len(stored) < 200


@pytest.mark.parametrize("width", [1, 2, 4, 8])
def test_every_width_and_an_empty_block(width):
    roundtrip([np.arange(3000 * width, dtype=np.uint8) % 7], width)
    planes, stored = roundtrip([b""], width)
    assert planes == [["raw", 0]] * width and stored == b""


def test_a_block_joins_into_the_rows_of_a_larger_array():
    heads, tokens, dim, lo, hi = 4, 64, 32, 16, 48
    src = bfloat16_bits(heads * (hi - lo) * dim).reshape(heads, hi - lo, dim)
    planes, parts = packing.pack([src], 2)
    dst = np.zeros((heads, tokens, dim), np.uint16)
    packing.unpack(b"".join(bytes(p) for p in parts), planes, [dst[h, lo:hi] for h in range(heads)], "f", "k")
    assert (dst[:, lo:hi] == src).all() and not dst[:, :lo].any() and not dst[:, hi:].any()


def packed_zeros(n=4096):
    planes, parts = packing.pack([np.zeros(n, np.uint16)], 2)
    return planes, b"".join(bytes(p) for p in parts), n


@pytest.mark.parametrize("damage, message", [
    (lambda s: s[:-1], "stored bytes, its planes"),
    (lambda s: b"\0" * len(s), "does not decompress"),
])
def test_damaged_stored_bytes_are_corrupt(damage, message):
    planes, stored, n = packed_zeros()
    out = bytearray(2 * n)
    with pytest.raises(CorruptCheckpoint, match=message):
        packing.unpack(damage(stored), planes, [out], "f.kv", "tensor 'k'")
    assert not any(out)


def test_a_frame_claiming_another_size_is_refused_before_it_is_decompressed():
    n = 4096
    big = zstandard.ZstdCompressor().compress(bytes(4 * n))        # says 4n bytes, one plane is n
    planes = [["zstd", len(big)], ["zstd", len(big)]]
    with pytest.raises(CorruptCheckpoint, match=f"holds {4 * n} bytes, not {n}"):
        packing.unpack(big + big, planes, [bytearray(2 * n)], "f.kv", "tensor 'k'")
    sizeless = zstandard.ZstdCompressor(write_content_size=False).compress(bytes(n))
    with pytest.raises(CorruptCheckpoint, match="holds -1 bytes"):
        packing.unpack(sizeless * 2, [["zstd", len(sizeless)]] * 2, [bytearray(2 * n)], "f.kv", "k")


def test_trailing_bytes_after_a_frame_are_refused():
    n = 4096
    frame = zstandard.ZstdCompressor().compress(bytes(n)) + b"xx"
    with pytest.raises(CorruptCheckpoint, match="does not decompress"):
        packing.unpack(frame * 2, [["zstd", len(frame)]] * 2, [bytearray(2 * n)], "f.kv", "k")


@pytest.mark.parametrize("planes, message", [
    ([["raw", 50]], "not a list of 2"),
    ([["raw", 50], ["lz4", 10]], "is not"),
    ([["raw", 49], ["zstd", 10]], "is not"),
    ([["raw", 50], ["zstd", -1]], "is not"),
    ([["raw", 50], ["zstd", 1.5]], "is not"),
    ("raw", "not a list"),
])
def test_bad_plane_descriptions_are_named(planes, message):
    assert message in packing.check_planes(planes, 2, 100)
