"""SHA1, one-pass prefix SHA1 and CRC32C: C against hashlib, known vectors and
tests/reference.py, on every compiled path (the `impl` fixture)."""

import functools
import hashlib
import hmac
import json
import mmap
import os
import random
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvstore
from kvstore import _native

import reference

# The impl fixture switches a global once per test, not per example.
HSETTINGS = settings(suppress_health_check=[HealthCheck.function_scoped_fixture],
                     deadline=None, max_examples=150)

BLOCK_EDGES = [55, 56, 63, 64, 65, 119, 120, 127, 128]


def rand_bytes(n, seed=0):
    return random.Random(seed).randbytes(n)


BUF = rand_bytes(300_000 + 16, seed=1)


@functools.lru_cache(maxsize=None)
def ref_crc(off, n):
    """reference.crc32c of BUF[off:off+n], computed once for all impls (it is slow)."""
    return reference.crc32c(BUF[off:off + n])


# ---- selection ------------------------------------------------------------

EXPECTED_NAMES = {"portable": ("portable", "portable", "portable", "portable"),
                  "x86": ("sha-ni", "sse4.2", "ssse3", "avx2"),
                  "avx512": (None, "avx512-vpclmulqdq", None, None), "arm": ("armv8", "armv8", "neon", None)}


def test_implementation_reports_selection(impl):
    got = _native.implementation()
    if impl.sha1:
        assert got["sha1"] == EXPECTED_NAMES[impl.sha1][0]
    if impl.crc32c:
        assert got["crc32c"] == EXPECTED_NAMES[impl.crc32c][1]


def test_available_always_has_portable():
    av = _native.available()
    assert av["sha1"][0] == "portable" and av["crc32c"][0] == "portable"
    assert set(av["sha1"]) <= {"portable", "x86", "arm"}
    assert set(av["crc32c"]) <= {"portable", "x86", "avx512", "arm"}


def test_select_auto_picks_fastest_available(impl):
    before = _native.implementation()
    _native.select(sha1="auto", crc32c="auto", table="auto", quant="auto")
    av = _native.available()
    try:
        assert _native.implementation() == {
            "sha1": EXPECTED_NAMES[av["sha1"][-1]][0],
            "crc32c": EXPECTED_NAMES[av["crc32c"][-1]][1],
            "table": EXPECTED_NAMES[av["table"][-1]][2],
            "quant": EXPECTED_NAMES[av["quant"][-1]][3],
        }
    finally:
        _native.select(**{k: "portable" if before[k] == "portable" else "auto" for k in ("table", "quant")})


@pytest.mark.parametrize("kw", [{"sha1": "nope"}, {"crc32c": "nope"}, {"sha1": "X86"},
                                {"crc32c": ""}])
def test_select_unknown_name_raises(impl, kw):
    before = _native.implementation()
    with pytest.raises(ValueError, match=repr(next(iter(kw.values())))):
        _native.select(**kw)
    assert _native.implementation() == before


def test_select_positional_is_sha1(impl):
    with pytest.raises(ValueError, match="unknown sha1 implementation 'nope'"):
        _native.select("nope")
    _native.select("portable")
    assert _native.implementation()["sha1"] == "portable"


@pytest.mark.parametrize("which", ["sha1", "crc32c"])
def test_select_unavailable_raises_and_keeps_selection(impl, which):
    missing = [n for n in ("x86", "avx512", "arm") if n not in _native.available()[which]]
    assert missing, "an x86 and an arm path cannot both run on one CPU"
    before = _native.implementation()
    for name in missing:
        with pytest.raises(ValueError, match=f"{name!r} is not available"):
            _native.select(**{which: name})
        assert _native.implementation() == before


@pytest.mark.parametrize("env,forced", [("1", True), ("0", False), ("", False)])
def test_kvstore_portable_env_forces_portable_at_import(env, forced, tmp_path):
    code = "import json, kvstore._native as n; print(json.dumps(n.implementation()))"
    # cwd away from the source tree: `python -c` puts the cwd first on sys.path,
    # and the repository's un-built kvstore/ must not shadow the installed one.
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=tmp_path, env={**os.environ, "KVSTORE_PORTABLE": env}).stdout
    impls = json.loads(out)
    if forced:
        assert impls == {"sha1": "portable", "crc32c": "portable", "table": "portable", "quant": "portable"}
    else:
        av = _native.available()
        assert impls == {"sha1": EXPECTED_NAMES[av["sha1"][-1]][0],
                         "crc32c": EXPECTED_NAMES[av["crc32c"][-1]][1],
                         "table": EXPECTED_NAMES[av["table"][-1]][2],
                         "quant": EXPECTED_NAMES[av["quant"][-1]][3]}


# ---- sha1 -----------------------------------------------------------------

SHA1_VECTORS = [
    (b"", "da39a3ee5e6b4b0d3255bfef95601890afd80709"),
    (b"abc", "a9993e364706816aba3e25717850c26c9cd0d89d"),
    (b"abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq",
     "84983e441c3bd26ebaae4aa1f95129e5e54670f1"),
    (b"abcdefghbcdefghicdefghijdefghijkefghijklfghijklmghijklmnhijklmnoijklmnopjklmnopqklmnopqrl"
     b"mnopqrsmnopqrstnopqrstu", "a49b2446a02c645bf419f995b67091253a04a259"),
    (b"a" * 1_000_000, "34aa973cd4c4daa4f61eeb2bdbad27316534016f"),
]


@pytest.mark.parametrize("data,digest", SHA1_VECTORS, ids=lambda v: str(len(v)) if isinstance(v, bytes) else None)
def test_sha1_known_vectors(impl, data, digest):
    assert kvstore.format.sha1(data).hex() == digest


def test_sha1_every_length_to_300(impl):
    for n in range(301):
        d = BUF[:n]
        got = kvstore.format.sha1(d)
        assert type(got) is bytes and len(got) == 20
        assert got == hashlib.sha1(d).digest(), n
        assert got == reference.sha1(d), n


@pytest.mark.parametrize("edge", BLOCK_EDGES)
@pytest.mark.parametrize("blocks", [0, 1, 7])
def test_sha1_block_boundaries(impl, edge, blocks):
    n = edge + 64 * blocks
    for off in range(8):
        d = BUF[off:off + n]
        assert kvstore.format.sha1(d) == hashlib.sha1(d).digest(), (n, off)


@pytest.mark.parametrize("n", [3 * 2**20 + 17, 8 * 2**20])
def test_sha1_large_buffer(impl, n):
    d = rand_bytes(n, seed=n)
    assert kvstore.format.sha1(d) == hashlib.sha1(d).digest()


def test_sha1_unaligned_memoryview_slices(impl):
    mv = memoryview(BUF)
    for off in range(1, 8):
        for n in [0, 1, 63, 64, 65, 1000, 4096 + 3, 100_001]:
            assert kvstore.format.sha1(mv[off:off + n]) == hashlib.sha1(BUF[off:off + n]).digest(), (off, n)


def test_sha1_buffer_kinds(impl, tmp_path):
    data = BUF[:5000]
    want = hashlib.sha1(data).digest()
    assert kvstore.format.sha1(bytearray(data)) == want
    assert kvstore.format.sha1(memoryview(data)) == want
    assert kvstore.format.sha1(memoryview(data[:4096]).cast("I")) == hashlib.sha1(data[:4096]).digest()
    p = tmp_path / "blob"
    p.write_bytes(data)
    with open(p, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        assert kvstore.format.sha1(m) == want


@pytest.mark.parametrize("dtype", [np.uint8, np.int8, np.uint16, np.int32, np.uint32,
                                   np.float16, np.float32, np.float64, np.complex64, np.bool_])
def test_sha1_numpy_arrays(impl, dtype):
    raw = np.frombuffer(BUF[:4800], dtype=np.uint8)
    if dtype is np.bool_:
        arr = (raw & 1).astype(np.bool_).reshape(40, 120)
    else:
        arr = raw.view(dtype).reshape(4, -1)        # 2-d, C-contiguous
    assert arr.flags.c_contiguous
    assert kvstore.format.sha1(arr) == hashlib.sha1(arr.tobytes()).digest()
    assert kvstore.format.sha1_prefixes(arr, [arr.nbytes, 1]) == [hashlib.sha1(arr.tobytes()).digest(),
                                                         hashlib.sha1(arr.tobytes()[:1]).digest()]
    assert kvstore.format.crc32c(arr) == reference.crc32c(arr.tobytes())


def test_sha1_refuses_non_contiguous_buffer(impl):
    # Hashing a strided view's underlying memory would name the wrong bytes.
    arr = np.arange(100, dtype=np.uint32)[::2]
    with pytest.raises((BufferError, ValueError)):
        kvstore.format.sha1(arr)
    with pytest.raises((BufferError, ValueError)):
        kvstore.format.crc32c(arr)


def test_sha1_rejects_non_buffer(impl):
    with pytest.raises(TypeError):
        kvstore.format.sha1("text")
    with pytest.raises(TypeError):
        kvstore.format.crc32c([1, 2, 3])


@HSETTINGS
@given(st.binary(max_size=2000))
def test_sha1_property(impl, data):
    assert kvstore.format.sha1(data) == hashlib.sha1(data).digest()


# ---- sha1_prefixes --------------------------------------------------------

def hashlib_prefixes(data, lengths):
    return [hashlib.sha1(bytes(data[:n])).digest() for n in lengths]


def test_prefixes_unsorted_with_repeats_and_ends(impl):
    data = BUF[:1000]
    lengths = [1000, 0, 64, 63, 64, 999, 0, 500, 128, 1, 1000, 65, 56, 55, 57, 119, 120, 121]
    assert kvstore.format.sha1_prefixes(data, lengths) == hashlib_prefixes(data, lengths)


def test_prefixes_every_length_dense(impl):
    # Every cut in a row: many prefixes end inside one block, which is the
    # path where two pending digests are finished together.
    data = BUF[:300]
    asc = list(range(301))
    assert kvstore.format.sha1_prefixes(data, asc) == hashlib_prefixes(data, asc)
    shuffled = asc * 2
    random.Random(3).shuffle(shuffled)
    assert kvstore.format.sha1_prefixes(data, shuffled) == hashlib_prefixes(data, shuffled)
    desc = asc[::-1]
    assert kvstore.format.sha1_prefixes(data, desc) == hashlib_prefixes(data, desc)


def test_prefixes_large_data_few_lengths(impl):
    data = rand_bytes(3 * 2**20 + 5, seed=11)
    lengths = [len(data), 17, 2**20, 2**20 + 1, 64 * 1000, 64 * 1000 - 9, len(data) - 1]
    assert kvstore.format.sha1_prefixes(data, lengths) == hashlib_prefixes(data, lengths)


def test_prefixes_empty_and_single(impl):
    assert kvstore.format.sha1_prefixes(b"abc", []) == []
    assert kvstore.format.sha1_prefixes(b"", []) == []
    assert kvstore.format.sha1_prefixes(b"", [0]) == [hashlib.sha1(b"").digest()]
    assert kvstore.format.sha1_prefixes(b"abc", [3]) == [hashlib.sha1(b"abc").digest()]
    assert kvstore.format.sha1_prefixes(b"abc", (0,)) == [hashlib.sha1(b"").digest()]


def test_prefixes_accepts_any_iterable_of_ints(impl):
    data = BUF[:700]
    want = hashlib_prefixes(data, [5, 700, 64])
    assert kvstore.format.sha1_prefixes(data, (n for n in [5, 700, 64])) == want
    assert kvstore.format.sha1_prefixes(data, (5, 700, 64)) == want
    assert kvstore.format.sha1_prefixes(data, np.array([5, 700, 64], dtype=np.int64)) == want
    assert kvstore.format.sha1_prefixes(data, [np.uint32(5), np.int16(700), np.uint64(64)]) == want
    assert kvstore.format.sha1_prefixes(bytearray(data), range(0, 701, 100)) == hashlib_prefixes(data, range(0, 701, 100))


def test_prefixes_unaligned_memoryview(impl):
    mv = memoryview(BUF)
    for off in range(1, 8):
        view = mv[off:off + 777]
        lengths = [777, 0, 64, 700, 65]
        assert kvstore.format.sha1_prefixes(view, lengths) == hashlib_prefixes(BUF[off:off + 777], lengths)


@pytest.mark.parametrize("bad,index", [([-1], 0), ([3, 11], 1), ([10, 0, 2**70], 2),
                                       ([0, -2**70], 1), ([5, 10, 11, 3], 2)])
def test_prefixes_bad_length_names_value(impl, bad, index):
    with pytest.raises(ValueError) as ei:
        kvstore.format.sha1_prefixes(b"0123456789", bad)
    msg = str(ei.value)
    assert f"length {bad[index]!r} at index {index}" in msg
    assert "0..10" in msg


@HSETTINGS
@given(st.data())
def test_prefixes_property(impl, data):
    d = data.draw(st.binary(max_size=1500), label="data")
    lengths = data.draw(st.lists(st.integers(0, len(d)), max_size=40), label="lengths")
    assert kvstore.format.sha1_prefixes(d, lengths) == [hashlib.sha1(d[:n]).digest() for n in lengths]
    assert kvstore.format.sha1_prefixes(d, lengths) == reference.sha1_prefixes(d, lengths)


@HSETTINGS
@given(st.data())
def test_prefixes_property_sorted_block_cuts(impl, data):
    # Ascending lengths near block edges: the pass keeps up to two pending
    # digests while the main state advances.
    nblocks = data.draw(st.integers(0, 40))
    d = BUF[:64 * nblocks + data.draw(st.integers(0, 63))]
    cuts = data.draw(st.lists(st.integers(0, nblocks).flatmap(
        lambda b: st.sampled_from([64 * b - 1, 64 * b, 64 * b + 1, 64 * b + 55, 64 * b + 56])),
        max_size=30))
    lengths = sorted(c for c in cuts if 0 <= c <= len(d))
    assert kvstore.format.sha1_prefixes(d, lengths) == hashlib_prefixes(d, lengths)


# ---- keyed (HMAC-SHA1) names: sealed stores ------------------------------------

HMAC_VECTORS = [  # RFC 2202 test cases 1, 2 and 6 (a key longer than a block)
    (b"\x0b" * 20, b"Hi There", "b617318655057264e28bc0b6fb378c8ef146be00"),
    (b"Jefe", b"what do ya want for nothing?", "effcdf6ae5eb2fa2d27416d5f184df9c259a7c79"),
    (b"\xaa" * 80, b"Test Using Larger Than Block-Size Key - Hash Key First",
     "aa4ae5e15272d00e95705637ce8a3b55ed402112"),
]


@pytest.mark.parametrize("key,data,digest", HMAC_VECTORS)
def test_hmac_sha1_known_vectors(impl, key, data, digest):
    assert kvstore.format.sha1(data, key).hex() == digest
    assert kvstore.format.sha1_prefixes(data, [len(data)], key) == [bytes.fromhex(digest)]


@HSETTINGS
@given(st.data())
def test_keyed_prefixes_property(impl, data):
    key = data.draw(st.binary(min_size=1, max_size=100), label="key")
    d = data.draw(st.binary(max_size=1500), label="data")
    lengths = data.draw(st.lists(st.integers(0, len(d)), max_size=40), label="lengths")
    want = [hmac.new(key, d[:n], "sha1").digest() for n in lengths]
    assert kvstore.format.sha1_prefixes(d, lengths, key) == want
    asc = np.array(sorted(set(lengths)), dtype=np.uint64)
    names = b"".join(hmac.new(key, d[:int(n)], "sha1").digest() for n in asc)
    assert _native.sha1_prefix_matches(d, asc, names, key) == list(range(len(asc)))
    # The same names are not SHA1 names, nor names under another key.
    assert _native.sha1_prefix_matches(d, asc, names) == []
    assert _native.sha1_prefix_matches(d, asc, names, key + b"x") == []


def keyed_chain(key):
    """A forest of one chain of four nodes over BUF[:5000] and its HMAC-SHA1
    names under key: (data, lengths, first_child, next_sibling, names)."""
    data = BUF[:5000]
    lengths = np.array([100, 700, 2000, 4999], dtype=np.uint64)
    first_child = np.array([1, 2, 3, -1], np.int32)
    next_sibling = np.full(4, -1, np.int32)
    keyed = b"".join(hmac.new(key, data[:int(n)], "sha1").digest() for n in lengths)
    return data, lengths, first_child, next_sibling, keyed


def test_keyed_forest_matches_one_chain_and_not_a_plain_one(impl):
    key = bytes(range(32))
    data, lengths, first_child, next_sibling, keyed = keyed_chain(key)
    plain = b"".join(hashlib.sha1(data[:int(n)]).digest() for n in lengths)
    assert _native.sha1_forest_matches(data, lengths, keyed, 0, first_child, next_sibling, key) == [0, 1, 2, 3]
    assert _native.sha1_forest_matches(data, lengths, keyed, 0, first_child, next_sibling) == []
    assert _native.sha1_forest_matches(data, lengths, plain, 0, first_child, next_sibling, key) == []
    # A node whose parent does not match is not tried.
    broken = keyed[:20] + bytes(20) + keyed[40:]
    assert _native.sha1_forest_matches(data, lengths, broken, 0, first_child, next_sibling, key) == [0]


def inner_hash(key, data):
    """HMAC-SHA1's inner hash, SHA1(key ^ ipad || data), by hashlib (a key of <= 64 bytes)."""
    return hashlib.sha1(bytes(b ^ 0x36 for b in key.ljust(64, b"\0")) + data).digest()


@HSETTINGS
@given(st.data())
def test_lookup_tags_pass_over_only_lengths_that_cannot_match(impl, data):
    key = data.draw(st.binary(min_size=1, max_size=64), label="key")
    d = data.draw(st.binary(max_size=1500), label="data")
    asc = np.array(sorted(set(data.draw(st.lists(st.integers(0, len(d)), min_size=1, max_size=40)))), np.uint64)
    cuts = [int(n) for n in asc]
    inner = kvstore.format.sha1_prefixes(d, cuts, key, inner=True)
    assert inner == [inner_hash(key, d[:n]) for n in cuts]
    names = b"".join(hmac.new(key, d[:n], "sha1").digest() for n in cuts)
    T = _native.LOOKUP_TAG
    tags = bytearray(b"".join(x[:T] for x in inner))
    everything = list(range(len(cuts)))
    assert _native.sha1_prefix_matches(d, asc, names, key, tags) == everything
    # A wrong tag passes its length over; a tag of zeros (none: a bucket's
    # entry) is confirmed by the name alone.
    wrong = data.draw(st.integers(0, len(cuts) - 1), label="wrong")
    tags[T * wrong] ^= 0x80
    assert _native.sha1_prefix_matches(d, asc, names, key, tags) == [i for i in everything if i != wrong]
    tags[T * wrong:T * wrong + T] = bytes(T)
    assert _native.sha1_prefix_matches(d, asc, names, key, tags) == everything
    # A right tag with a wrong name is no match.
    tags[T * wrong:T * wrong + T] = inner[wrong][:T]
    bad = bytearray(names)
    bad[20 * wrong] ^= 1
    assert _native.sha1_prefix_matches(d, asc, bytes(bad), key, tags) == [i for i in everything if i != wrong]


def test_lookup_tags_in_the_forest(impl):
    key = bytes(range(32))
    data, lengths, first_child, next_sibling, keyed = keyed_chain(key)
    T = _native.LOOKUP_TAG
    tags = bytearray(b"".join(inner_hash(key, data[:int(n)])[:T] for n in lengths))
    assert _native.sha1_forest_matches(data, lengths, keyed, 0, first_child, next_sibling, key, tags) == [0, 1, 2, 3]
    tags[T * 2] ^= 1           # node 2 is passed over, and so is its child
    assert _native.sha1_forest_matches(data, lengths, keyed, 0, first_child, next_sibling, key, tags) == [0, 1]
    tags[T * 2:T * 3] = bytes(T)
    assert _native.sha1_forest_matches(data, lengths, keyed, 0, first_child, next_sibling, key, tags) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="tags hold"):
        _native.sha1_forest_matches(data, lengths, keyed, 0, first_child, next_sibling, key, bytes(T))


def test_inner_hashes_need_a_key(impl):
    with pytest.raises(ValueError, match="needs a key"):
        kvstore.format.sha1_prefixes(b"abc", [1], inner=True)


def test_empty_hmac_key_is_refused(impl):
    with pytest.raises(ValueError, match="0 bytes"):
        kvstore.format.sha1(b"abc", b"")


# ---- many lengths: digests finished many at a time ------------------------------
#
# With more stored lengths than blocks of data, the x86-64 path on a CPU with
# AVX-512 finishes the digests sixteen at a time beside the pass over the data
# (csrc/sha1.c, the wide pass); with fewer, and on the other paths, a digest
# at a time beside it.  Each must give the reference's digests for every
# remainder mod 64 (one padding block or two) and for the data's last bytes.

def dense_lengths(size, per_block, seed):
    """Random lengths in 0..size, about per_block per 64-byte block (at least
    16), in random order, a tenth of them repeated, the ends included."""
    rng = random.Random(seed)
    lengths = [rng.randint(0, size) for _ in range(max(16, per_block * (size // 64 + 1)))]
    lengths += rng.sample(lengths, len(lengths) // 10) + [size, 0]
    rng.shuffle(lengths)
    return lengths


def hmac_prefixes(key, data, lengths):
    """(inner hashes, HMAC-SHA1s) of data[:n] for n in lengths, on _reference
    (a key of <= 64 bytes): the inner hash of data[:n] is the SHA1 of the
    first 64 + n bytes of (key ^ ipad) || data."""
    pad = key.ljust(64, b"\0")
    inner = reference.sha1_prefixes(bytes(b ^ 0x36 for b in pad) + data, [64 + n for n in lengths])
    opad = bytes(b ^ 0x5C for b in pad)
    return inner, [hashlib.sha1(opad + x).digest() for x in inner]


def without(n, i):
    return [k for k in range(n) if k != i]


@pytest.mark.parametrize("size,per_block", [(50, 1), (64 * 40, 2), (64 * 40 + 17, 3), (100_003, 2),
                                            (100_003, 1), (300, 40)])
def test_prefixes_many_lengths(impl, size, per_block):
    data = rand_bytes(size, seed=size)
    lengths = dense_lengths(size, per_block, seed=size + per_block)
    assert kvstore.format.sha1_prefixes(data, lengths) == reference.sha1_prefixes(data, lengths)
    asc = sorted(set(lengths))
    names = bytearray(b"".join(reference.sha1_prefixes(data, asc)))
    assert _native.sha1_prefix_matches(data, np.array(asc, np.uint64), bytes(names)) == list(range(len(asc)))
    wrong = len(asc) // 2
    names[20 * wrong + 19] ^= 1
    assert _native.sha1_prefix_matches(data, np.array(asc, np.uint64), bytes(names)) == without(len(asc), wrong)


@pytest.mark.parametrize("rems", [(0, 55), (55, 56), (56, 63), (63, 1)])
def test_prefixes_many_lengths_two_remainders(impl, rems):
    # Two lengths in every block, each a fixed remainder: whole steps of
    # jobs that need one padding block, or two, or a mix.
    data = rand_bytes(64 * 300 + 30, seed=sum(rems))
    lengths = [64 * b + r for b in range(301) for r in rems if 64 * b + r <= len(data)]
    assert kvstore.format.sha1_prefixes(data, lengths) == reference.sha1_prefixes(data, lengths)


@pytest.mark.parametrize("per_block", [1, 3])
def test_keyed_prefixes_many_lengths(impl, per_block):
    key = bytes(range(7, 47))
    data = rand_bytes(64 * 300 + 9, seed=5)
    lengths = dense_lengths(len(data), per_block, seed=6)
    inner, names = hmac_prefixes(key, data, lengths)
    assert names[:3] == [hmac.new(key, data[:n], "sha1").digest() for n in lengths[:3]]
    assert kvstore.format.sha1_prefixes(data, lengths, key, inner=True) == inner
    assert kvstore.format.sha1_prefixes(data, lengths, key) == names
    asc = sorted(set(lengths))
    inner, names = hmac_prefixes(key, data, asc)
    lens, joined = np.array(asc, np.uint64), b"".join(names)
    assert _native.sha1_prefix_matches(data, lens, joined, key) == list(range(len(asc)))
    assert _native.sha1_prefix_matches(data, lens, b"".join(inner), key, inner=True) == list(range(len(asc)))
    T = _native.LOOKUP_TAG
    tags = bytearray(b"".join(x[:T] for x in inner))
    tags[T * 5] ^= 1
    assert _native.sha1_prefix_matches(data, lens, joined, key, bytes(tags)) == without(len(asc), 5)


# ---- crc32c ---------------------------------------------------------------

CRC_VECTORS = [  # RFC 3720 B.4 and the common check value
    (b"123456789", 0xE3069283),
    (b"", 0),
    (bytes(32), 0x8A9136AA),
    (b"\xff" * 32, 0x62A8AB43),
    (bytes(range(32)), 0x46DD794E),
    (bytes(range(31, -1, -1)), 0x113FDB5C),
]


@pytest.mark.parametrize("data,crc", CRC_VECTORS)
def test_crc32c_known_vectors(impl, data, crc):
    assert kvstore.format.crc32c(data) == crc
    assert reference.crc32c(data) == crc


def test_crc32c_every_length_and_odd_offsets(impl):
    for off in (0, 1, 3, 5, 7):
        for n in range(301):
            assert kvstore.format.crc32c(BUF[off:off + n]) == ref_crc(off, n), (off, n)


# 511-769: the fold's start (512) and its 256-byte steps; 767-769 and 24575-24577:
# the three-stream slices.
@pytest.mark.parametrize("n", [511, 512, 513, 767, 768, 769, 1000, 1024, 1279, 24575, 24576, 24577,
                               100000])
def test_crc32c_path_thresholds(impl, n):
    mv = memoryview(BUF)
    for off in range(8):
        assert kvstore.format.crc32c(mv[off:off + n]) == ref_crc(off, n), (n, off)


def test_crc32c_large_buffer(impl):
    # Reference-checked 300 kB blocks joined with combine() give the CRC of
    # the whole 6 MB buffer, built from repeats of them.
    block = BUF[:300_000]
    c = ref_crc(0, 300_000)
    whole = block * 20 + BUF[:17]
    want = 0
    for _ in range(20):
        want = _native.crc32c_combine(want, c, len(block))
    want = _native.crc32c_combine(want, ref_crc(0, 17), 17)
    assert kvstore.format.crc32c(whole) == want
    assert kvstore.format.crc32c(memoryview(whole)[3:]) == kvstore.format.crc32c(BUF[3:300_000] + block * 19 + BUF[:17])


def test_crc32c_buffer_kinds(impl):
    data = BUF[:4096]
    want = ref_crc(0, 4096)
    assert kvstore.format.crc32c(bytearray(data)) == want
    assert kvstore.format.crc32c(memoryview(data).cast("Q")) == want
    assert kvstore.format.crc32c(np.frombuffer(data, dtype=np.float32).reshape(32, 32)) == want


def test_crc32c_continue_argument(impl):
    assert kvstore.format.crc32c(b"56789", kvstore.format.crc32c(b"1234")) == 0xE3069283
    assert kvstore.format.crc32c(b"", 0xDEADBEEF) == 0xDEADBEEF
    with pytest.raises(OverflowError):
        kvstore.format.crc32c(b"x", 2**32)
    with pytest.raises(OverflowError):
        kvstore.format.crc32c(b"x", -1)


@HSETTINGS
@given(st.binary(max_size=3000), st.binary(max_size=3000))
def test_crc32c_incremental_property(impl, a, b):
    assert kvstore.format.crc32c(b, kvstore.format.crc32c(a)) == kvstore.format.crc32c(a + b)


@HSETTINGS
@given(st.binary(max_size=1000))
def test_crc32c_matches_reference_property(impl, data):
    assert kvstore.format.crc32c(data) == reference.crc32c(data)


@HSETTINGS
@given(st.binary(max_size=5000), st.binary(max_size=5000))
def test_crc32c_combine_property(impl, a, b):
    ca, cb = kvstore.format.crc32c(a), kvstore.format.crc32c(b)
    assert _native.crc32c_combine(ca, cb, len(b)) == kvstore.format.crc32c(a + b)


def test_crc32c_combine_edges(impl):
    a, b = BUF[:1234], BUF[1234:100_000]
    assert _native.crc32c_combine(kvstore.format.crc32c(a), kvstore.format.crc32c(b), len(b)) == ref_crc(0, 100_000)
    assert _native.crc32c_combine(0x12345678, 0, 0) == 0x12345678   # b empty
    assert _native.crc32c_combine(0, kvstore.format.crc32c(b), len(b)) == kvstore.format.crc32c(b)   # a empty
    # Zero-byte runs of any length: crc(a + zeros(n)) from combine.
    for n in (1, 7, 8, 255, 256, 8192, 65537):
        z = bytes(n)
        assert _native.crc32c_combine(kvstore.format.crc32c(a), kvstore.format.crc32c(z), n) == kvstore.format.crc32c(a + z)


@HSETTINGS
@given(st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1),
       st.integers(0, 2**62), st.integers(0, 2**62))
def test_crc32c_combine_huge_lengths_associative(impl, ca, cb, cc, lb, lc):
    # crc(a||b||c) joined either way must agree, for lengths no buffer here
    # could hold: checks the x^(8n) power for 64-bit n.
    left = _native.crc32c_combine(_native.crc32c_combine(ca, cb, lb), cc, lc)
    right = _native.crc32c_combine(ca, _native.crc32c_combine(cb, cc, lc), lb + lc)
    assert left == right


def test_crc32c_combine_every_power_of_two_length(impl):
    # Shifting by 2^k bytes twice is shifting by 2^(k+1) bytes, for every
    # bit of a 64-bit length (a wrong period of the x^(2^k) table breaks
    # lengths >= 2^29 here, which no in-memory test reaches).
    for c in (1, 0xE3069283, 0xFFFFFFFF):
        for k in range(63):
            twice = _native.crc32c_combine(_native.crc32c_combine(c, 0, 2**k), 0, 2**k)
            assert twice == _native.crc32c_combine(c, 0, 2**(k + 1)), k


# ---- sha1_forest_matches: the chain lookup ------------------------------------------------

def forest_reference(data, lengths, digests, first_root, first_child, next_sibling):
    """The nodes whose digest matches, a node tried only where its parent matched (hashlib)."""
    def siblings(i):
        while i >= 0:
            yield i
            i = int(next_sibling[i])
    out, todo = [], [r for r in siblings(first_root) if lengths[r] <= len(data)]
    while todo:
        i = todo.pop()
        if hashlib.sha1(bytes(data[:lengths[i]])).digest() == digests[20 * i:20 * i + 20]:
            out.append(i)
            todo += [k for k in siblings(int(first_child[i])) if lengths[i] < lengths[k] <= len(data)]
    return sorted(out)


def random_forest(rng, data, n_chains=6, depth=12):
    """Chains of prefixes of data (true digests) with a few wrong nodes hung among them."""
    lengths, digests, parents = [], b"", []
    for _ in range(n_chains):
        at, parent = 0, -1
        for _ in range(int(rng.integers(1, depth))):
            at += int(rng.integers(1, 200))
            node = len(lengths)
            lengths.append(at)
            good = rng.random() > 0.15
            digests += hashlib.sha1(data[:at]).digest() if good else bytes(rng.integers(0, 256, 20, dtype=np.uint8))
            parents.append(parent)
            parent = node if rng.random() > 0.2 else parent
    n = len(lengths)
    first_child, next_sibling, first_root = np.full(n, -1, np.int32), np.full(n, -1, np.int32), -1
    for i in range(n):
        if parents[i] < 0:
            next_sibling[i], first_root = first_root, i
        else:
            next_sibling[i], first_child[parents[i]] = first_child[parents[i]], i
    return np.array(lengths, dtype=np.uint64), digests, first_root, first_child, next_sibling


@pytest.mark.parametrize("seed", range(8))
def test_forest_matches_the_reference(impl, seed):
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, 3000, dtype=np.uint8).tobytes()
    forest = random_forest(rng, data)
    got = sorted(_native.sha1_forest_matches(data, *forest))
    assert got == forest_reference(data, *forest)
    # A prompt that stops inside the forest: nodes past its end are never tried.
    short = data[:int(forest[0].max()) // 2]
    assert sorted(_native.sha1_forest_matches(short, *forest)) == forest_reference(short, *forest)


def test_forest_tries_a_node_only_below_a_match(impl):
    data = b"x" * 500
    # Node 1 is a true prefix digest, but hangs under a root that does not match.
    lengths = np.array([10, 20], dtype=np.uint64)
    digests = b"\0" * 20 + hashlib.sha1(data[:20]).digest()
    assert _native.sha1_forest_matches(data, lengths, digests, 0, np.array([1, -1], np.int32),
                                       np.array([-1, -1], np.int32)) == []
    # As a root of its own it matches.
    assert _native.sha1_forest_matches(data, lengths, digests, 0, np.array([-1, -1], np.int32),
                                       np.array([1, -1], np.int32)) == [1]


def test_forest_survives_malformed_links(impl):
    data = b"abc" * 10
    lengths = np.array([3, 6], dtype=np.uint64)
    digests = hashlib.sha1(data[:3]).digest() + hashlib.sha1(data[:6]).digest()
    good = (0, np.array([1, -1], np.int32), np.array([-1, -1], np.int32))
    assert _native.sha1_forest_matches(data, lengths, digests, *good) == [0, 1]
    # A cycle among siblings, an index out of range: the walk ends, nothing is read out of bounds.
    assert _native.sha1_forest_matches(data, lengths, digests, 0, np.array([1, -1], np.int32),
                                       np.array([1, 0], np.int32)) == [0, 1]
    assert _native.sha1_forest_matches(data, lengths, digests, 0, np.array([9, -1], np.int32),
                                       np.array([-1, -1], np.int32)) == [0]
    with pytest.raises(ValueError):
        _native.sha1_forest_matches(data, lengths, digests[:39], *good)
    with pytest.raises(ValueError):
        _native.sha1_forest_matches(data, lengths, digests, 0, np.array([1], np.int32), np.array([-1], np.int32))
