"""Micro benchmarks with pytest-benchmark; peers share a group so they print together.

    pytest bench/ --benchmark-only
    pytest bench/ --benchmark-only --benchmark-group-by=group --benchmark-columns=min,median,ops

The side-by-side ratios with targets come from ``python -m bench``;
this file is for regression tracking (``--benchmark-autosave`` /
``--benchmark-compare``).
"""

import hashlib
import struct
import zlib

import pytest

import kvstore
from foundation import ds4_prefixes_rehash, naive_prefixes_copy, touch_ds4_fopen, touch_ds4_os
from store import ENTRY_CTX_SIZE, ds4_find_text_prefix, ds4_refresh


# ---------------------------------------------------------------- SHA1, 400 KB

@pytest.mark.benchmark(group="sha1 400 KB")
def test_sha1_400k(benchmark, prompt):
    assert benchmark(kvstore.format.sha1, prompt) == hashlib.sha1(prompt).digest()


@pytest.mark.benchmark(group="sha1 400 KB")
def test_hashlib_sha1_400k(benchmark, prompt):
    benchmark(lambda: hashlib.sha1(prompt).digest())


# ---------------------------------------------------------------- SHA1 of 1000 prefixes

@pytest.mark.benchmark(group="sha1_prefixes 400 KB x 1000")
def test_sha1_prefixes_random(benchmark, prompt, prefix_lengths):
    digests = benchmark(kvstore.format.sha1_prefixes, prompt, prefix_lengths)
    assert digests == naive_prefixes_copy(prompt, prefix_lengths)


@pytest.mark.benchmark(group="sha1_prefixes 400 KB x 1000")
def test_sha1_prefixes_sorted(benchmark, prompt, prefix_lengths):
    benchmark(kvstore.format.sha1_prefixes, prompt, sorted(prefix_lengths))


@pytest.mark.benchmark(group="sha1_prefixes 400 KB x 1000")
def test_hashlib_one_pass_400k(benchmark, prompt):
    """The floor: one hashlib pass over the whole prompt."""
    benchmark(lambda: hashlib.sha1(prompt).digest())


@pytest.mark.benchmark(group="sha1_prefixes 400 KB x 1000")
def test_hashlib_copy_per_length(benchmark, prompt, prefix_lengths):
    benchmark(naive_prefixes_copy, prompt, prefix_lengths)


@pytest.mark.benchmark(group="sha1_prefixes 400 KB x 100 (ds4 rehash)")
def test_sha1_prefixes_100(benchmark, prompt, prefix_lengths):
    benchmark(kvstore.format.sha1_prefixes, prompt, prefix_lengths[:100])


@pytest.mark.benchmark(group="sha1_prefixes 400 KB x 100 (ds4 rehash)")
def test_ds4_rehash_100(benchmark, prompt, prefix_lengths):
    benchmark(ds4_prefixes_rehash, prompt, prefix_lengths[:100])


# ---------------------------------------------------------------- CRC32C

@pytest.mark.benchmark(group="crc32c")
def test_crc32c(benchmark, payload):
    benchmark(kvstore.format.crc32c, payload)


@pytest.mark.benchmark(group="crc32c")
def test_zlib_crc32(benchmark, payload):
    benchmark(zlib.crc32, payload)


# ---------------------------------------------------------------- header and envelope

HEADER = kvstore.format.Header(quant_bits=4, tokens=8192, ctx_size=32768, payload_bytes=123_456_789,
                        reason=kvstore.format.Reason.CONTINUED, hits=7, created_at=1_700_000_000,
                        last_used=1_700_000_100)


@pytest.mark.benchmark(group="header")
def test_header_pack(benchmark):
    assert len(benchmark(HEADER.pack)) == 48


@pytest.mark.benchmark(group="header")
def test_header_unpack(benchmark):
    buf = HEADER.pack()
    assert benchmark(kvstore.format.Header.unpack, buf) == HEADER


# Peer: the same 48-byte layout with struct alone, no validation (docs/format.md §2).
_STRUCT = struct.Struct("<3sBBBBBIIIB3xQQQ")


@pytest.mark.benchmark(group="header")
def test_struct_pack_peer(benchmark):
    args = (b"KVC", 1, 4, 2, 0, 0, 8192, 7, 32768, 16, 1_700_000_000, 1_700_000_100, 123_456_789)
    assert benchmark(_STRUCT.pack, *args) == HEADER.pack()


@pytest.mark.benchmark(group="header")
def test_struct_unpack_peer(benchmark):
    buf = HEADER.pack()
    assert benchmark(_STRUCT.unpack_from, buf)[6] == 8192


@pytest.mark.benchmark(group="read_entry")
def test_read_entry(benchmark, checkpoint):
    assert benchmark(kvstore.format.read_entry, checkpoint).tokens == 100


# ---------------------------------------------------------------- touch

@pytest.mark.benchmark(group="touch")
def test_touch(benchmark, checkpoint):
    benchmark(kvstore.format.touch, checkpoint)
    assert kvstore.format.read_entry(checkpoint).hits > 0


@pytest.mark.benchmark(group="touch")
def test_touch_ds4_os(benchmark, checkpoint):
    benchmark(touch_ds4_os, checkpoint)


@pytest.mark.benchmark(group="touch")
def test_touch_ds4_fopen(benchmark, checkpoint):
    benchmark(touch_ds4_fopen, checkpoint)



# ---------------------------------------------------------------- find at N entries (400 KB prompt)

DS4_MAX_ENTRIES = 1000           # ds4's loop costs ~1 s a call at 10,000: python -m bench measures it there


@pytest.mark.benchmark(group="find")
def test_find_miss(benchmark, lookup):
    benchmark.group = f"find, N={lookup.n:,}"
    assert benchmark(lookup.store.find, lookup.miss_prompt) is None


@pytest.mark.benchmark(group="find")
def test_find_hit(benchmark, lookup):
    benchmark.group = f"find, N={lookup.n:,}"
    assert benchmark(lookup.store.find, lookup.hit_prompt).sha == lookup.real.sha


@pytest.mark.benchmark(group="find")
def test_ds4_find_miss(benchmark, lookup):
    if lookup.n > DS4_MAX_ENTRIES:
        pytest.skip(f"ds4's loop at {lookup.n:,} entries: see python -m bench")
    benchmark.group = f"find, N={lookup.n:,}"
    entries = ds4_refresh(lookup.directory)
    assert benchmark(ds4_find_text_prefix, entries, lookup.miss_prompt, lookup.store.settings.min_tokens,
                     ENTRY_CTX_SIZE) == -1
