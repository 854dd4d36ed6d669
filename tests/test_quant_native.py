"""kvstore._native.quantize / dequantize (csrc/quant.c) against their NumPy
twins in tests/reference.py, bit for bit: every dtype, both widths, the
group sizes a block may have, and the values that test the conversions
(half subnormals, the largest halves, constant groups, signs); the
dequantizer on each of its run-time-dispatched paths present here
(portable, and AVX2 on x86-64: the `quant` fixture)."""

import numpy as np
import pytest

from kvstore import _native

import reference

DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}


def values(dtype, n, seed):
    """n values of dtype as its stored array, mixed scales and edge cases."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n).astype(np.float32) * np.float32(10.0) ** rng.integers(-6, 5, n).astype(np.float32)
    x[: n // 8] = x[0]                                  # constant groups
    if dtype == "float16":
        x[n // 8: n // 4] = rng.uniform(-6e-5, 6e-5, n // 4 - n // 8)     # around the half subnormals
        x[-64:] = rng.choice([60000.0, -60000.0, 0.0], 64)
        return x.astype(np.float16)
    if dtype == "bfloat16":
        return (x.view(np.uint32) >> 16).astype(np.uint16)
    return x


def native(src, dtype, bits, group):
    count = src.nbytes // np.dtype(DTYPES[dtype]).itemsize
    w = np.dtype(DTYPES[dtype]).itemsize
    q, s, b = bytearray(count * bits // 8), bytearray(count // group * w), bytearray(count // group * w)
    ok = _native.quantize(memoryview(src).cast("B"), dtype, bits, group, q, s, b)
    return ok, bytes(q), bytes(s), bytes(b)


@pytest.fixture(params=_native.available()["quant"])
def quant(request):
    """Runs the test on one dequantizer path; the import-time one after."""
    before = _native.implementation()["quant"]
    _native.select(quant=request.param)
    try:
        yield request.param
    finally:
        _native.select(quant="portable" if before == "portable" else "auto")


def test_the_dequantizer_paths_are_named():
    av = _native.available()["quant"]
    assert av[0] == "portable" and set(av) <= {"portable", "x86"}
    names = {"portable": "portable", "x86": "avx2"}
    before = _native.implementation()["quant"]
    try:
        for name in av:
            _native.select(quant=name)
            assert _native.implementation()["quant"] == names[name]
        with pytest.raises(ValueError, match="'arm' is not available"):
            _native.select(quant="arm")
    finally:
        _native.select(quant="portable" if before == "portable" else "auto")


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("group", [64, 32, 16])
def test_quantize_and_dequantize_equal_the_numpy_twin(quant, dtype, bits, group):
    for seed in range(3):
        src = values(dtype, 64 * 40, seed)
        got = native(src, dtype, bits, group)
        want = reference.quantize(src, dtype, bits, group)
        assert got[0] and want[0]
        assert got[1] == want[1], "integers differ"
        assert got[2] == want[2], "scales differ"
        assert got[3] == want[3], "biases differ"
        out = np.empty_like(src)
        _native.dequantize(got[1], got[2], got[3], dtype, bits, group, memoryview(out).cast("B"))
        assert out.tobytes() == reference.dequantize(got[1], got[2], got[3], dtype, bits, group)


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_values_that_are_not_finite_are_refused(dtype):
    for bad in (np.nan, np.inf, -np.inf):
        x = np.ones(128, np.float32)
        x[77] = bad
        src = x.astype(np.float16) if dtype == "float16" else \
            (x.view(np.uint32) >> 16).astype(np.uint16) if dtype == "bfloat16" else x
        assert native(src, dtype, 8, 64)[0] is False
        assert reference.quantize(src, dtype, 8, 64)[0] is False


def test_a_range_past_the_dtype_is_refused():
    x = np.array([3e38, -3e38] * 32, np.float32)
    assert native(x, "float32", 8, 64)[0] is False      # max - min overflows float32
    assert reference.quantize(x, "float32", 8, 64)[0] is False
    # The half's extremes: the rounded-up scale would give back 65566, past 65504.
    h = np.array([65504.0, -65504.0] * 32, np.float16)
    assert native(h, "float16", 8, 64)[0] is False
    assert reference.quantize(h, "float16", 8, 64)[0] is False


def test_bad_arguments_name_the_value():
    src = memoryview(np.zeros(128, np.float32)).cast("B")
    with pytest.raises(ValueError, match="dtype 'int8'"):
        _native.quantize(src, "int8", 8, 64, bytearray(128), bytearray(8), bytearray(8))
    with pytest.raises(ValueError, match="bits=3"):
        _native.quantize(src, "float32", 3, 64, bytearray(128), bytearray(8), bytearray(8))
    with pytest.raises(ValueError, match="group=48"):
        _native.quantize(src, "float32", 8, 48, bytearray(128), bytearray(8), bytearray(8))
    with pytest.raises(ValueError, match="not whole groups of 64"):
        _native.quantize(src[:200], "float32", 8, 64, bytearray(50), bytearray(4), bytearray(4))
    with pytest.raises(ValueError, match="outputs of 100"):
        _native.quantize(src, "float32", 8, 64, bytearray(100), bytearray(8), bytearray(8))
    with pytest.raises(ValueError, match="inputs of 64"):
        _native.dequantize(bytearray(64), bytearray(8), bytearray(8), "float32", 8, 64, src)
