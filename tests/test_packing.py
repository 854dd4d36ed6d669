"""Packed blocks (kvstore.payload.packing): a block's byte planes, each a
table plane (csrc/table.h) or raw, rebuilt exactly by every decoder this
machine has, and a damaged or lying plane refused before anything is
written where it would land."""

import os
import struct

import numpy as np
import pytest

from kvstore import _native
from kvstore.errors import CorruptCheckpoint
from kvstore.payload import packing


@pytest.fixture(params=_native.available()["table"])
def decoder(request):
    """Each table decoder this machine can run (portable, SSSE3 or NEON), selected for the test."""
    before = _native.implementation()["table"]
    _native.select(table=request.param)
    yield request.param
    _native.select(table=restore(before))


def restore(before):
    """The select() name that brings the table decoder named before back."""
    return "portable" if before == "portable" else "auto"


def bfloat16_bits(n, seed=0, scale=1.0):
    """n bfloat16 values of a normal distribution, as their uint16 bits."""
    f = np.random.default_rng(seed).standard_normal(n).astype(np.float32) * scale
    return (f.view(np.uint32) >> 16).astype(np.uint16)


def roundtrip(pieces, width):
    planes, parts = packing.pack(pieces, width)
    stored = b"".join(bytes(p) for p in parts)
    nbytes = sum(memoryview(p).nbytes for p in pieces)
    assert len(stored) == packing.stored_size(planes)
    assert packing.check_planes(planes, width, nbytes) is None
    out = bytearray(nbytes)
    packing.unpack(stored, planes, out, (0, nbytes, 1, 0), "f.kv", "tensor 'k'")
    assert bytes(out) == b"".join(bytes(memoryview(p).cast("B")) for p in pieces)
    return planes, stored


def test_bfloat16_keeps_its_mantissa_raw_and_tables_its_exponent(decoder):
    a = bfloat16_bits(1 << 18)
    planes, stored = roundtrip([a[:1000], a[1000:]], 2)
    assert planes[0] == ["raw", a.size]                 # the low byte: the mantissa
    assert planes[1][0] == "table" and planes[1][1] < 0.51 * a.size
    assert len(stored) < 0.76 * a.nbytes


def test_random_bytes_stay_raw_and_a_constant_tables_to_half(decoder):
    noise = np.random.default_rng(1).integers(0, 256, 1 << 18, dtype=np.uint8)
    planes, _ = roundtrip([noise], 2)
    assert [k for k, _ in planes] == ["raw", "raw"]
    n = 1 << 16
    planes, stored = roundtrip([np.zeros(4 * n, np.uint8)], 4)
    assert planes == [["table", 20 + n // 2]] * 4


@pytest.mark.parametrize("width", [1, 2, 4, 8])
def test_every_width_and_an_empty_block(width, decoder):
    roundtrip([np.arange(3000 * width, dtype=np.uint8) % 7], width)
    planes, stored = roundtrip([b""], width)
    assert planes == [["raw", 0]] * width and stored == b""


@pytest.mark.parametrize("values", [17, 40, 120])
def test_values_past_the_table_come_back_as_exceptions(values, decoder):
    """A plane of more than 16 values: 16 of them in the table (drawn from a
    sample: near the 16 most common), every other byte an exception (5
    bytes each), all rebuilt; past about 0.08 of the plane in exceptions the
    table no longer pays and the plane is raw."""
    rng = np.random.default_rng(values)
    n = 1 << 15
    weights = 0.5 ** (np.arange(values) / 2)
    hi = rng.choice(values, n, p=weights / weights.sum()).astype(np.uint16)
    a = (hi << 8 | rng.integers(0, 256, n).astype(np.uint16)) + 0x3000
    planes, stored = roundtrip([a], 2)
    plane = (a >> 8).astype(np.uint8)
    fewest = n - int(np.sort(np.bincount(plane, minlength=256))[::-1][:16].sum())
    if planes[1][0] == "raw":
        assert 20 + n // 2 + 5 * fewest > packing.PLANE_KEEP * n
        return
    table = np.frombuffer(stored, np.uint8, 16, offset=n)
    exceptions = int(np.isin(plane, table, invert=True).sum())
    assert planes[1] == ["table", 20 + n // 2 + 5 * exceptions]
    assert exceptions <= 1.5 * fewest + 16


def test_a_block_joins_into_the_rows_of_a_larger_array(decoder):
    """A chain block's tensor lands as one run per head, stride apart, and
    runs of an odd element count start later runs on an odd element."""
    heads, tokens, dim, lo, hi = 4, 64, 33, 16, 47
    src = bfloat16_bits(heads * (hi - lo) * dim).reshape(heads, hi - lo, dim)
    src[0, 0, :3] = [0x7F80, 0xFF80, 0x0001]            # values past the table: exceptions
    planes, parts = packing.pack([src], 2)
    assert planes[1][0] == "table" and planes[1][1] > 20 + src.size // 2
    dst = np.zeros((heads, tokens, dim), np.uint16)
    run = (hi - lo) * dim * 2
    packing.unpack(b"".join(bytes(p) for p in parts), planes, memoryview(dst).cast("B"),
                   (lo * dim * 2, run, heads, tokens * dim * 2), "f", "k")
    assert (dst[:, lo:hi] == src).all() and not dst[:, :lo].any() and not dst[:, hi:].any()


def packed(n=4096):
    """A bfloat16 block with a few exceptions: (planes, stored bytes, n)."""
    a = bfloat16_bits(n)
    a[[5, 100, 1000]] = [0x7F80, 0xFF80, 0x0001]
    planes, parts = packing.pack([a], 2)
    assert planes[1][0] == "table"
    return planes, b"".join(bytes(p) for p in parts), n


def exceptions_at(stored, n):
    """(offset of the table plane's exception places, their count) in stored."""
    head = n                                            # the raw mantissa plane first
    (e,) = struct.unpack_from("<I", stored, head + 16)
    return head + 20 + (n + 1) // 2, e


def lie_about_count(s, n):
    b = bytearray(s)
    struct.pack_into("<I", b, n + 16, 2)
    return bytes(b)


def swap_places(s, n):
    at, e = exceptions_at(s, n)
    b = bytearray(s)
    b[at:at + 4], b[at + 4:at + 8] = s[at + 4:at + 8], s[at:at + 4]
    return bytes(b)


def place_outside(s, n):
    at, e = exceptions_at(s, n)
    b = bytearray(s)
    struct.pack_into("<I", b, at + 4 * (e - 1), n)
    return bytes(b)


def place_not_coded_15(s, n):
    at, e = exceptions_at(s, n)
    b = bytearray(s)
    struct.pack_into("<I", b, at, 6)                    # element 6 has a table value
    return bytes(b)


@pytest.mark.parametrize("damage", [lie_about_count, swap_places, place_outside, place_not_coded_15])
def test_a_table_plane_that_does_not_hold_is_corrupt_before_a_byte_lands(damage, decoder):
    planes, stored, n = packed()
    out = bytearray(2 * n)
    with pytest.raises(CorruptCheckpoint) as e:
        packing.unpack(damage(stored, n), planes, out, (0, 2 * n, 1, 0), "f.kv", "tensor 'k'")
    assert e.value.reason == "bad_payload"
    assert not any(out)


def test_stored_bytes_of_another_size_are_corrupt():
    planes, stored, n = packed()
    out = bytearray(2 * n)
    with pytest.raises(CorruptCheckpoint, match="stored bytes, its planes"):
        packing.unpack(stored[:-1], planes, out, (0, 2 * n, 1, 0), "f.kv", "tensor 'k'")
    assert not any(out)


def test_every_decoder_rebuilds_the_same_bytes():
    """The SIMD decoders against the portable one and the source, in runs of
    37 elements (odd starts, and lengths that leave the vector loops a head
    and a tail) and in runs of 4,096 (whole vectors)."""
    n = 37 * 270
    a = bfloat16_bits(n)
    a[::101] = 0x7F80                                   # exceptions spread over the runs
    planes, parts = packing.pack([a], 2)
    stored = b"".join(bytes(p) for p in parts)
    before = _native.implementation()["table"]
    for elements in (37, n // 2, n):
        count = n // elements
        for impl in _native.available()["table"]:
            _native.select(table=impl)
            try:
                out = bytearray(2 * n + 2 * count + 1)     # a byte between runs, one after the last
                packing.unpack(stored, planes, out, (1, 2 * elements, count, 2 * elements + 2), "f", "k")
            finally:
                _native.select(table=restore(before))
            got = b"".join(out[1 + r * (2 * elements + 2):1 + r * (2 * elements + 2) + 2 * elements]
                           for r in range(count))
            assert got == a.tobytes(), (impl, elements)
            assert out[0] == 0 and not any(out[1 + r * (2 * elements + 2) + 2 * elements] for r in range(count))


@pytest.mark.parametrize("planes, message", [
    ([["raw", 50]], "not a list of 2"),
    ([["raw", 50], ["zstd", 10]], "is not"),
    ([["raw", 49], ["table", 10]], "is not"),
    ([["raw", 50], ["table", -1]], "is not"),
    ([["raw", 50], ["table", 1.5]], "is not"),
    ("raw", "not a list"),
])
def test_bad_plane_descriptions_are_named(planes, message):
    assert message in packing.check_planes(planes, 2, 100)


def test_a_chain_loads_packed_blocks_in_one_native_call(tmp_path):
    """_native.read_packed (csrc/packed.h), what a chain load's I/O thread
    calls for its table-plane blocks: a good block lands whole; one whose
    CRC is not the expected one, or whose planes lie, lands nothing (the
    first is reported by its CRC, the second as bad_payload)."""
    planes, stored, n = packed()
    lying = lie_about_count(stored, n)
    path = tmp_path / "blocks"
    path.write_bytes(stored + lying)
    crc = _native.crc32c(stored)
    native = [(kind == "table", length) for kind, length in planes]
    fd = os.open(path, os.O_RDONLY)
    try:
        out = [bytearray(2 * n + 8) for _ in range(3)]
        got = _native.read_packed(out, [
            (0, fd, 0, len(stored), native, 8, 2 * n, 1, 0, crc),
            (1, fd, 0, len(stored), native, 0, 2 * n, 1, 0, crc ^ 1),
            (2, fd, len(stored), len(lying), native, 0, 2 * n, 1, 0, _native.crc32c(lying)),
        ], verify=True)
    finally:
        os.close(fd)
    want = bytearray(2 * n)
    packing.unpack(stored, planes, want, (0, 2 * n, 1, 0), "f", "k")
    assert got[0] == (0, crc) and bytes(out[0][8:]) == bytes(want) and not any(out[0][:8])
    assert got[1] == (0, crc) and not any(out[1])                  # the caller compares crc with want
    assert got[2][0] != 0 and not any(out[2])
    with pytest.raises(CorruptCheckpoint) as e:
        _native.raise_status(got[2][0], "f.kv", "tensor 'k'")
    assert e.value.reason == "bad_payload"
