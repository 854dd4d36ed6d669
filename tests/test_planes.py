"""Byte planes (csrc/planes.c through kvstore._native): the filter that puts
byte p of every element of a block into plane p, and its inverse, against
the pure-Python twins in tests/reference.py, over pieces cut anywhere on
element boundaries (a chain block's tensor lies in memory as one run per
head)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore import _native

import reference


def cut(data, width, points):
    """data cut at the element boundaries points (sorted, in elements)."""
    n = len(data) // width
    edges = [0] + sorted({min(p, n) for p in points}) + [n]
    return [data[a * width:b * width] for a, b in zip(edges, edges[1:])]


@settings(max_examples=200, deadline=None)
@given(width=st.sampled_from([1, 2, 3, 4, 8]), elements=st.integers(0, 600),
       points=st.lists(st.integers(0, 600), max_size=5), seed=st.integers(0, 2**32 - 1))
def test_split_and_join_match_the_reference(width, elements, points, seed):
    data = np.random.default_rng(seed).integers(0, 256, elements * width, dtype=np.uint8).tobytes()
    pieces = cut(data, width, points)
    planes = [bytearray(elements) for _ in range(width)]
    _native.planes_split(pieces, planes)
    assert [bytes(p) for p in planes] == reference.planes_split(pieces, width)
    out = [bytearray(len(p)) for p in pieces]
    _native.planes_join([bytes(p) for p in planes], out)
    assert [bytes(b) for b in out] == reference.planes_join([bytes(p) for p in planes], [len(p) for p in pieces])
    assert b"".join(out) == data


def test_bfloat16_planes_are_the_high_and_low_bytes():
    a = np.array([0x3F80, 0xBF80, 0x4000, 0x0001], dtype="<u2")      # 1.0, -1.0, 2.0, a subnormal
    planes = [bytearray(4), bytearray(4)]
    _native.planes_split([a], planes)
    assert planes == [bytes([0x80, 0x80, 0x00, 0x01]), bytes([0x3F, 0xBF, 0x40, 0x00])]


def test_join_writes_into_strided_runs_of_an_array():
    """One tensor block joined straight into the token rows of a larger
    (heads, tokens, dim) array: the rows around it stay as they were."""
    heads, tokens, dim, lo, hi = 3, 10, 4, 2, 7
    src = np.arange(heads * (hi - lo) * dim, dtype=np.uint16).reshape(heads, hi - lo, dim) + 1
    planes = [bytearray(src.size), bytearray(src.size)]
    _native.planes_split([src], planes)
    dst = np.zeros((heads, tokens, dim), dtype=np.uint16)
    _native.planes_join(planes, [dst[h, lo:hi] for h in range(heads)])
    assert (dst[:, lo:hi] == src).all()
    assert not dst[:, :lo].any() and not dst[:, hi:].any()


@pytest.mark.parametrize("pieces, planes, message", [
    ([b"abc"], [3, 3], "piece 0 holds 3 bytes, not whole 2-byte elements"),
    ([b"ab", b"cd"], [3, 3], "pieces hold 2 elements, plane 0 3 bytes"),
    ([b"ab", b"cd"], [2, 1], "pieces hold 2 elements, plane 1 1 bytes"),
    ([b"ab"], [], "0 planes: an element is 1 to 16 bytes"),
    ([b"a" * 17], [1] * 17, "17 planes: an element is 1 to 16 bytes"),
])
def test_bad_shapes_are_refused_naming_the_values(pieces, planes, message):
    with pytest.raises(ValueError, match=message):
        _native.planes_split(pieces, [bytearray(n) for n in planes])
    with pytest.raises(ValueError, match=message):
        _native.planes_join([bytes(n) for n in planes], [bytearray(p) for p in pieces])


def test_split_and_join_refuse_read_only_destinations():
    with pytest.raises(BufferError):
        _native.planes_split([b"abcd"], [b"\0\0", bytearray(2)])
    with pytest.raises(BufferError):
        _native.planes_join([b"\0\0", b"\0\0"], [b"\0\0\0\0"])
