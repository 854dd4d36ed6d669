"""Bad input (docs/format.md §2, §3, §10 and docs/semantics.md §12): hypothesis properties over the
envelope header, the payload header, the manifest JSON and the trailer
sections of a real checkpoint file.

The checks themselves live in tests/fuzz/fuzz_parsers.py, the atheris target,
so that the coverage-guided fuzzer and these properties judge a file alike:
only KVStoreError subclasses come out of a parser, load() returns None for a
bad file, a file load() accepts is one verify_file() accepts, and what it
returns is what the manifest describes.  Here, on top: the memory a load or a
verify allocates stays under the file's size plus a small constant, a file
whose manifest CRC was left alone loads the original tensors or nothing, and
the last test runs the atheris target itself for a few seconds.

Already covered elsewhere, not repeated: header parsing against the reference
parser and envelope length overflow (test_format.py), parse_trailer on random
and mutated bytes (test_trailers.py), one hand-made manifest fault per rule
(test_faults.py).
"""

import importlib.util
import json
import logging
import os
import struct
import subprocess
import sys
import tracemalloc

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvstore
from kvhelpers import index_of
from kvstore import payload
from kvstore import files
from kvstore.errors import CorruptCheckpoint
from kvstore.format import read_entry

FUZZ_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fuzz")
TARGET_SCRIPT = os.path.join(FUZZ_DIR, "fuzz_parsers.py")

_spec = importlib.util.spec_from_file_location("fuzz_parsers", TARGET_SCRIPT)
fp = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fp)

PAYLOAD_HEAD = struct.Struct("<4sIQII")

# What a load or a verify may allocate beyond the file's own size: Python
# objects for the manifest and the entry, log records, small buffers.
MEMORY_SLACK = 1 << 20

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                      HealthCheck.too_slow])


@pytest.fixture(scope="module")
def target():
    t = fp.Target()
    yield t
    t.close()


def bounded_check(target, blob, expect_original=False, name=None):
    """check_file under tracemalloc: the readers allocate at most the file plus MEMORY_SLACK.

    The file keeps the good checkpoint's name unless name says otherwise (a
    damaged file on disk keeps its name).  check_file keeps copies of the blob
    for its own comparisons, so the peak is measured around the library calls
    only (read_entry, verify_file, load).
    """
    name = name or target.name
    path = os.path.join(target.store.path, name)
    with open(path, "wb") as f:
        f.write(blob)
    # Log records are left out of the count (check_file below runs with
    # them): pytest keeps every one, and the growth of its list would be
    # charged to whichever load happened to trigger it.
    logger = logging.getLogger("kvstore")
    logger.disabled = True
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        try:
            e = read_entry(path)
        except kvstore.KVStoreError:
            e = None
        files.verify_file(path)
        if e is not None and e.loadable and e.model_id == 0:
            target.store.load(e)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
        logger.disabled = False
        if os.path.lexists(path):
            os.unlink(path)
        index_of(target.store).discard(name)
    assert peak < len(blob) + MEMORY_SLACK, (peak, len(blob))
    return fp.check_file(target, blob, expect_original, name=name)


def checked_ranges(target):
    """File ranges every bit of which a check covers: text, payload header, manifest, blocks."""
    e = target.entry
    P = e.payload_offset
    _, mlen, _, _, _ = PAYLOAD_HEAD.unpack_from(target.good, P)
    m = good_manifest(target)
    out = [(e.text_offset, P), (P, P + 20), (P + 24, P + 24 + mlen),
           (P + m["tokens"]["offset"], P + m["tokens"]["offset"] + 4 * m["tokens"]["count"])]
    out += [(P + t["offset"], P + t["offset"] + t["nbytes"]) for t in m["tensors"]]
    return out


# ---- strategies -------------------------------------------------------------------

OP_KINDS = {"flip": 0, "truncate": 1, "edge": 2, "manifest_bytes": 3, "manifest_edit": 4,
            "trailer": 5, "insert": 6, "delete": 7}


def ops(kinds=tuple(OP_KINDS), max_ops=4):
    op = st.tuples(st.sampled_from([OP_KINDS[k] for k in kinds]), st.integers(0, 2**20),
                   st.integers(0, 2**16), st.binary(max_size=300))
    return st.lists(op, min_size=1, max_size=max_ops)


def near(x):
    return st.integers(max(0, x - 3), x + 3)


EDGE_VALUES = st.one_of(st.integers(0, 4200), near(2**31), near(2**32), near(2**63), near(2**64 - 4))

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12)


# ---- whole files ------------------------------------------------------------------

@settings(max_examples=1000, **SETTINGS)
@given(ops())
def test_mutated_checkpoint_is_refused_or_loads_what_it_says(target, ops):
    blob, recomputed = fp.mutate(target, ops)
    bounded_check(target, blob, expect_original=not recomputed)


@settings(max_examples=500, **SETTINGS)
@given(ops(kinds=("flip",), max_ops=3))
def test_bit_flips_are_refused_or_load_the_original(target, ops):
    blob, recomputed = fp.mutate(target, ops)
    assert not recomputed
    outcome = bounded_check(target, blob, expect_original=True)
    flipped = [a % len(blob) for _, a, _, _ in ops]
    # A flip in the text, the payload header, the manifest or a data block is
    # always caught (no one-bit error passes a CRC32C or the name's SHA1); a
    # flip in the hit count, a timestamp, reserved bytes, padding or the
    # trailer does not matter.
    ranges = checked_ranges(target)
    if any(a <= f < b for f in flipped for a, b in ranges) and len(set(flipped)) == len(flipped):
        assert outcome != "loaded", flipped


@settings(max_examples=150, **SETTINGS)
@given(st.sampled_from(["text_len", "payload_bytes", "tokens", "manifest_len", "data_offset",
                        "trailer_len"]), EDGE_VALUES)
def test_length_fields_near_2_32_and_2_64(target, field, value):
    e = target.entry
    P, T = e.payload_offset, e.trailer_offset
    off, size = {"text_len": (48, 4), "payload_bytes": (40, 8), "tokens": (8, 4),
                 "manifest_len": (P + 4, 4), "data_offset": (P + 8, 8), "trailer_len": (T + 4, 8)}[field]
    value %= 1 << (8 * size)
    blob = bytearray(target.good)
    old = int.from_bytes(blob[off:off + size], "little")
    blob[off:off + size] = value.to_bytes(size, "little")
    outcome = bounded_check(target, bytes(blob), expect_original=True)
    if value == old or field == "trailer_len":
        assert outcome == "loaded"                  # a bad trailer costs the section only
    elif field in ("manifest_len", "data_offset", "tokens"):
        assert outcome == "refused"


@settings(max_examples=100, **SETTINGS)
@given(st.integers(0, 10**6))
def test_truncation_anywhere(target, cut):
    e = target.entry
    cut %= len(target.good) + 1
    outcome = bounded_check(target, target.good[:cut], expect_original=True)
    assert outcome == ("loaded" if cut >= e.trailer_offset else "refused")


def test_every_truncation_of_the_envelope_and_payload_head(target):
    """Exhaustive where the parsers branch: the prefix, text, payload header and manifest."""
    e = target.entry
    _, mlen, _, _, _ = PAYLOAD_HEAD.unpack_from(target.good, e.payload_offset)
    for cut in range(0, e.payload_offset + 24 + mlen + 2):
        assert fp.check_file(target, target.good[:cut]) == "refused", cut


# ---- the manifest -----------------------------------------------------------------

def manifest_file(target, manifest):
    """The good file with manifest (bytes, or a JSON value) put in with a valid CRC."""
    raw = manifest if isinstance(manifest, bytes) else json.dumps(manifest).encode()
    blob = bytearray(target.good)
    if not fp._fix_manifest(blob, raw):
        return None
    return bytes(blob)


def good_manifest(target):
    return fp._manifest_of(bytearray(target.good))


@settings(max_examples=200, **SETTINGS)
@given(st.binary(max_size=2000))
def test_manifest_random_bytes(target, raw):
    fp.check_manifest(raw, target.entry, 4024)
    blob = manifest_file(target, raw)
    if blob is not None:
        bounded_check(target, blob)


@settings(max_examples=200, **SETTINGS)
@given(json_values)
def test_manifest_any_json_value(target, value):
    raw = json.dumps(value).encode()
    fp.check_manifest(raw, target.entry, 4024)
    blob = manifest_file(target, value)
    if blob is not None:
        assert bounded_check(target, blob) == "refused"


@settings(max_examples=300, **SETTINGS)
@given(st.integers(0, 4), st.sampled_from(["offset", "nbytes", "crc32c", "count", "dtype", "shape", "name"]),
       st.one_of(json_values, EDGE_VALUES, st.sampled_from(fp.JSON_VALUES),
                 st.lists(st.one_of(st.integers(0, 64), near(2**31), near(2**32), near(2**63)), max_size=6),
                 st.sampled_from(sorted(payload.DTYPES) + ["float8", "Float16", "object", "<f2"])))
def test_manifest_field_set_to_anything(target, block, key, value):
    """Wrong dtypes, shapes, offsets, counts and CRCs, with the manifest's CRC made valid."""
    m = good_manifest(target)
    b = ([m["tokens"]] + m["tensors"])[block]
    b[key] = value
    blob = manifest_file(target, m)
    if blob is not None:
        bounded_check(target, blob)


def _layout(target):
    m = good_manifest(target)
    return m, [m["tokens"]] + m["tensors"]


@settings(max_examples=200, **SETTINGS)
@given(st.integers(0, 4), st.integers(0, 4), st.integers(-300, 300))
def test_overlapping_blocks_are_refused(target, i, j, delta):
    m, blocks = _layout(target)
    size = [4 * b["count"] if "count" in b else b["nbytes"] for b in blocks]
    blocks[i]["offset"] = blocks[j]["offset"] + delta
    blob = manifest_file(target, m)
    spans = sorted((b["offset"], n) for b, n in zip(blocks, size) if n)
    overlaps = any(a + n > c for (a, n), (c, _) in zip(spans, spans[1:]))
    outcome = bounded_check(target, blob)
    if overlaps or delta % 64:
        assert outcome == "refused"


@settings(max_examples=200, **SETTINGS)
@given(st.integers(0, 4), st.one_of(near(4672 - 72), near(2**32), near(2**63), near(2**64)),
       st.sampled_from(["offset", "nbytes"]))
def test_blocks_pointing_past_the_end_are_refused(target, i, value, key):
    m, blocks = _layout(target)
    e = target.entry
    b = blocks[i]
    if key == "nbytes" and i == 0:
        key = "count"                              # the token block's size is 4 * count
    b[key] = value
    n = 4 * b["count"] if "count" in b else b["nbytes"]
    blob = manifest_file(target, m)
    outcome = bounded_check(target, blob)
    if b["offset"] + n > e.payload_bytes:
        assert outcome == "refused"


@pytest.mark.parametrize("manifest", [
    pytest.param(b"\xff\xfe" + b'{"version": 1}', id="invalid_utf8"),
    pytest.param(b'{"version": 1, "tokens": {"count": 8', id="cut_short"),
    pytest.param(b'{"version": 1,,}', id="invalid_json"),
    pytest.param(b'{"version": 1, "x": ' + b"9" * 5000 + b"}", id="huge_int_literal"),
    pytest.param(b"[" * 3000 + b"]" * 3000, id="deep_list"),
    pytest.param(b'{"a":' * 3000 + b"1" + b"}" * 3000, id="deep_object"),
    pytest.param(b'"\\ud800"', id="lone_surrogate"),
    pytest.param(b"NaN", id="nan"),
])
def test_manifest_that_is_not_a_manifest(target, manifest):
    with pytest.raises(CorruptCheckpoint):
        payload.Manifest(manifest, target.entry, 4024)
    blob = manifest_file(target, manifest)
    if blob is not None:             # (the huge literal does not fit before the data)
        assert bounded_check(target, blob) == "refused"


@pytest.mark.parametrize("edit", [
    pytest.param({"dtype": []}, id="unhashable_dtype"),
    pytest.param({"dtype": {"a": 1}}, id="dict_dtype"),
    pytest.param({"shape": [0, 2**62, 2]}, id="empty_but_unallocatable"),
    pytest.param({"shape": [0] + [2**31] * 15}, id="empty_many_huge_dims"),
    pytest.param({"shape": [0, 2**64]}, id="dim_past_u64"),
    pytest.param({"crc32c": 5}, id="empty_block_nonzero_crc"),
    pytest.param({"shape": [0, 9.0]}, id="float_dim"),
    pytest.param({"shape": [True, 0]}, id="bool_dim"),
    pytest.param({"shape": [0] * 17}, id="too_many_dims"),
    pytest.param({"nbytes": -1}, id="negative"),
])
def test_regressions_on_the_empty_tensor(target, edit):
    """The tensor 'e' (shape (0, 9)) with one field made impossible: found by the
    fuzzers, each once escaped load() as TypeError/ValueError/RecursionError or
    made verify_file and load() disagree."""
    m = good_manifest(target)
    t = next(t for t in m["tensors"] if t["name"] == "e")
    t.update(edit)
    raw = json.dumps(m).encode()
    with pytest.raises(CorruptCheckpoint):
        payload.Manifest(raw, target.entry, 4024)
    assert bounded_check(target, manifest_file(target, m)) == "refused"


def test_manifest_shapes_that_stay_allocatable_still_load(target):
    """The shape bound refuses only what NumPy cannot create: a wide empty tensor loads."""
    m = good_manifest(target)
    t = next(t for t in m["tensors"] if t["name"] == "e")
    t["shape"] = [0, 2**31 - 1, 2**20]
    assert bounded_check(target, manifest_file(target, m)) == "loaded"


# ---- the trailer inside a file ------------------------------------------------------

@settings(max_examples=150, **SETTINGS)
@given(st.lists(st.tuples(st.integers(0, 255), st.one_of(st.integers(0, 600), near(2**32), near(2**64 - 4)),
                          st.booleans(), st.binary(max_size=80)), max_size=4),
       st.binary(max_size=20))
def test_trailer_sections_never_cost_the_checkpoint(target, sections, tail):
    """Sections with any bit, any length (up to 2**64 - 1), good or bad CRCs,
    then garbage: the checkpoint loads with its original tensors every time."""
    raw = b""
    for bit, length, good_crc, body in sections:
        crc = kvstore.format.crc32c(body) if good_crc else kvstore.format.crc32c(body) ^ 1
        raw += struct.pack("<B3xQI", bit, length % 2**64, crc) + body
    blob = target.good[:target.entry.trailer_offset] + raw + tail
    assert bounded_check(target, blob, expect_original=True) == "loaded"


# ---- the coverage-guided target ------------------------------------------------------

def test_atheris_target_runs(tmp_path):
    """tests/fuzz/fuzz_parsers.py stays runnable: a few seconds of coverage-guided fuzzing."""
    pytest.importorskip("atheris")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    p = subprocess.run([sys.executable, TARGET_SCRIPT, "-runs=3000", "-max_total_time=20",
                        "-print_final_stats=1", str(corpus)],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "Done" in p.stderr and "number_of_executed_units" in p.stderr
    assert not list(tmp_path.glob("crash-*"))


# ---- soak ----------------------------------------------------------------------------

@pytest.mark.soak
@settings(max_examples=50000, **SETTINGS)
@given(ops(max_ops=6))
def test_soak_mutated_checkpoints(target, ops):
    blob, recomputed = fp.mutate(target, ops)
    bounded_check(target, blob, expect_original=not recomputed)
