"""The .kv envelope (docs/format.md §2): Header pack/unpack, reading rules, read_entry."""

import dataclasses
import errno
import hashlib
import os
import struct
import threading
import tracemalloc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvstore
from kvstore import _native

import reference
from kvstore.format import VALID_QUANT_BITS

U32, U64 = 2**32 - 1, 2**64 - 1
FIELDS = ("version", "quant_bits", "reason", "ext_flags", "model_id", "tokens", "hits",
          "ctx_size", "payload_abi", "created_at", "last_used", "payload_bytes", "model_tag")


def header_fields(reason=st.integers(0, 6)):
    """Hypothesis strategy: kwargs of a Header that pack() accepts."""
    return st.fixed_dictionaries(dict(
        quant_bits=st.sampled_from(sorted(VALID_QUANT_BITS)),
        reason=reason,
        ext_flags=st.integers(0, 255),
        model_id=st.integers(0, 255),
        tokens=st.integers(1, U32),
        hits=st.integers(0, U32),
        ctx_size=st.integers(0, U32),
        payload_abi=st.integers(0, 255),
        created_at=st.integers(0, U64),
        last_used=st.integers(0, U64),
        payload_bytes=st.integers(0, U64),
        model_tag=st.integers(0, 0xFFFFFF),
    ))


def valid_header(**kw):
    values = dict(quant_bits=4, tokens=100, ctx_size=4096, payload_bytes=12345,
                  reason=kvstore.format.Reason.CONTINUED, ext_flags=kvstore.format.ExtFlag.TOOL_MAP, model_id=3,
                  hits=9, payload_abi=16, created_at=1_700_000_000, last_used=1_700_000_500)
    values.update(kw)
    return kvstore.format.Header(**values)


def patched(buf, offset, value_bytes):
    b = bytearray(buf)
    b[offset:offset + len(value_bytes)] = value_bytes
    return bytes(b)


# ---- Header.pack / unpack -------------------------------------------------

@settings(max_examples=300)
@given(header_fields(reason=st.integers(0, 255)))
def test_pack_matches_reference(fields):
    packed = kvstore.format.Header(**fields).pack()
    assert type(packed) is bytes and len(packed) == 48
    assert packed == reference.pack_header(1, *(fields[f] for f in FIELDS[1:]))


@settings(max_examples=300)
@given(header_fields())
def test_pack_unpack_round_trip(fields):
    h = kvstore.format.Header(**fields)
    back = kvstore.format.Header.unpack(h.pack())
    assert back == h
    assert isinstance(back.reason, kvstore.format.Reason) and isinstance(back.ext_flags, kvstore.format.ExtFlag)
    assert back.version == 1
    assert back.pack() == h.pack()


def test_pack_layout_is_little_endian_at_spec_offsets():
    h = valid_header(quant_bits=8, reason=kvstore.format.Reason.SHUTDOWN, ext_flags=0b1010, model_id=7,
                     tokens=0x01020304, hits=0x05060708, ctx_size=0x090A0B0C, payload_abi=16,
                     created_at=0x1112131415161718, last_used=0x2122232425262728,
                     payload_bytes=0x3132333435363738)
    b = h.pack()
    assert b[0:3] == b"KVC" and b[3] == 1 and b[4] == 8 and b[5] == 4 and b[6] == 0b1010 and b[7] == 7
    assert b[8:12] == bytes([4, 3, 2, 1])
    assert b[12:16] == bytes([8, 7, 6, 5])
    assert b[16:20] == bytes([0x0C, 0x0B, 0x0A, 0x09])
    assert b[20] == 16 and b[21:24] == b"\0\0\0"
    assert valid_header(model_tag=0x0A0B0C).pack()[21:24] == bytes([0x0C, 0x0B, 0x0A])
    assert b[24:32] == bytes(range(0x18, 0x10, -1))
    assert b[32:40] == bytes(range(0x28, 0x20, -1))
    assert b[40:48] == bytes(range(0x38, 0x30, -1))


@settings(max_examples=300)
@given(st.binary(min_size=45, max_size=45), st.sampled_from([b"KVC", b"KVD", b"kvc"]),
       st.sampled_from([0, 1, 1, 2]))
def test_unpack_agrees_with_reference_parser(rest, magic, version):
    buf = magic + bytes([version]) + rest
    try:
        ref = reference.parse_header(buf)
    except ValueError as e:
        with pytest.raises(kvstore.CorruptCheckpoint) as ei:
            kvstore.format.Header.unpack(buf)
        assert ei.value.reason == str(e)
        return
    if ref[1] not in VALID_QUANT_BITS:
        with pytest.raises(kvstore.CorruptCheckpoint, match="bad_quant_bits"):
            kvstore.format.Header.unpack(buf)
        return
    h = kvstore.format.Header.unpack(buf)
    got = tuple(int(getattr(h, f)) for f in FIELDS)
    want = list(ref)
    want[2] = want[2] if want[2] <= 6 else 0
    assert got == tuple(want)


@pytest.mark.parametrize("magic", [b"KVD", b"kvc", b"\0\0\0", b"CVK", b"KV\0"])
def test_unpack_wrong_magic(magic):
    buf = patched(valid_header().pack(), 0, magic)
    with pytest.raises(kvstore.CorruptCheckpoint) as ei:
        kvstore.format.Header.unpack(buf)
    assert isinstance(ei.value, ValueError) and isinstance(ei.value, kvstore.KVStoreError)
    assert ei.value.reason == "bad_magic" and "bad_magic" in str(ei.value)


@pytest.mark.parametrize("version", [0, 2, 3, 255])
def test_unpack_wrong_version(version):
    buf = patched(valid_header().pack(), 3, bytes([version]))
    with pytest.raises(kvstore.CorruptCheckpoint) as ei:
        kvstore.format.Header.unpack(buf)
    assert ei.value.reason == "bad_version"
    assert "bad_version" in str(ei.value) and f"version {version}" in str(ei.value)


def test_unpack_zero_tokens():
    buf = patched(valid_header().pack(), 8, bytes(4))
    with pytest.raises(kvstore.CorruptCheckpoint) as ei:
        kvstore.format.Header.unpack(buf)
    assert ei.value.reason == "zero_tokens" and "zero_tokens" in str(ei.value)


@pytest.mark.parametrize("bits", [0, 1, 7, 9, 15, 17, 32, 255])
def test_unpack_bad_quant_bits(bits):
    buf = patched(valid_header().pack(), 4, bytes([bits]))
    with pytest.raises(kvstore.CorruptCheckpoint) as ei:
        kvstore.format.Header.unpack(buf, path="/x/y.kv")
    msg = str(ei.value)
    assert ei.value.reason == "bad_quant_bits" and "bad_quant_bits" in msg
    assert f"quant bits {bits}," in msg and "/x/y.kv" in msg


@pytest.mark.parametrize("bits", sorted(VALID_QUANT_BITS))
def test_unpack_every_valid_quant_bits(bits):
    assert kvstore.format.Header.unpack(valid_header(quant_bits=bits).pack()).quant_bits == bits


@pytest.mark.parametrize("n", [0, 1, 3, 47])
def test_unpack_short_buffer(n):
    with pytest.raises(kvstore.CorruptCheckpoint, match="truncated") as ei:
        kvstore.format.Header.unpack(valid_header().pack()[:n])
    assert ei.value.reason == "truncated" and f"header is {n} bytes" in str(ei.value)


def test_unpack_ignores_bytes_after_header_and_takes_any_buffer():
    b = valid_header().pack()
    want = kvstore.format.Header.unpack(b)
    assert kvstore.format.Header.unpack(b + b"\xff" * 10) == want
    assert kvstore.format.Header.unpack(bytearray(b)) == want
    assert kvstore.format.Header.unpack(memoryview(b"..." + b)[3:]) == want


@pytest.mark.parametrize("byte", [7, 8, 100, 255])
def test_unpack_unknown_reason_reads_as_unknown(byte):
    h = kvstore.format.Header.unpack(patched(valid_header().pack(), 5, bytes([byte])))
    assert h.reason is kvstore.format.Reason.UNKNOWN


@pytest.mark.parametrize("byte,reason", list(enumerate(kvstore.format.Reason)))
def test_unpack_known_reasons(byte, reason):
    assert kvstore.format.Header.unpack(patched(valid_header().pack(), 5, bytes([byte]))).reason is reason


def test_bytes_21_to_23_are_the_model_tag_and_nothing_else():
    # ds4 writes them 0 (reserved); kvstore keeps its 24-bit model tag there.
    b = valid_header().pack()
    assert kvstore.format.Header.unpack(b).model_tag == 0
    for junk, tag in ((b"\xff\xff\xff", 0xFFFFFF), (b"\x01\x00\x00", 1), (b"\x00\x00\x80", 0x800000)):
        h = kvstore.format.Header.unpack(patched(b, 21, junk))
        assert h.model_tag == tag
        assert dataclasses.replace(h, model_tag=0) == kvstore.format.Header.unpack(b)


def test_unpack_keeps_unknown_ext_flag_bits():
    b = patched(valid_header().pack(), 6, b"\xf5")
    h = kvstore.format.Header.unpack(b)
    assert int(h.ext_flags) == 0xF5
    assert kvstore.format.ExtFlag.TOOL_MAP in h.ext_flags and kvstore.format.ExtFlag.THINKING_VISIBLE in h.ext_flags
    assert kvstore.format.ExtFlag.RESPONSES_VISIBLE not in h.ext_flags
    assert h.pack()[6] == 0xF5


def test_reason_and_flag_values_are_the_spec_bytes():
    assert [int(r) for r in kvstore.format.Reason] == list(range(7))
    assert [r.name for r in kvstore.format.Reason] == ["UNKNOWN", "COLD", "CONTINUED", "EVICT", "SHUTDOWN",
                                               "AGENT_SYSTEM", "AGENT_SESSION"]
    assert (int(kvstore.format.ExtFlag.TOOL_MAP), int(kvstore.format.ExtFlag.RESPONSES_VISIBLE),
            int(kvstore.format.ExtFlag.THINKING_VISIBLE), int(kvstore.format.ExtFlag.SESSION_TITLE)) == (1, 2, 4, 8)


@pytest.mark.parametrize("field,value", [
    ("quant_bits", 256), ("quant_bits", -1), ("quant_bits", 7), ("quant_bits", 0),
    ("reason", 256), ("ext_flags", 256), ("model_id", 256), ("model_id", -1),
    ("tokens", 0), ("tokens", 2**32), ("hits", 2**32), ("hits", -1), ("ctx_size", 2**32),
    ("payload_abi", 256), ("created_at", 2**64), ("created_at", -1), ("last_used", 2**64),
    ("payload_bytes", 2**64), ("payload_bytes", -5), ("version", 2), ("version", 0),
])
def test_pack_rejects_out_of_range_naming_field(field, value):
    h = valid_header(**{field: value})
    with pytest.raises(ValueError) as ei:
        h.pack()
    assert f"Header.{field}={value}" in str(ei.value)


def test_pack_accepts_extremes():
    h = valid_header(tokens=U32, hits=U32, ctx_size=U32, created_at=U64, last_used=U64,
                     payload_bytes=U64, model_id=255, payload_abi=255, ext_flags=255)
    assert kvstore.format.Header.unpack(h.pack()) == h


# ---- envelope_fits --------------------------------------------------------

@pytest.mark.parametrize("size,text,payload,ok", [
    (52, 0, 0, True), (51, 0, 0, False), (0, 0, 0, False),
    (62, 10, 0, True), (62, 10, 1, False), (62, 0, 10, True), (62, 0, 11, False),
    (100, U32, 0, False), (52 + U32, U32, 0, True), (51 + U32, U32, 0, False),
    (100, 0, U64, False), (U64, U32, U64 - 52 - U32, True), (U64, U32, U64 - 52 - U32 + 1, False),
    # sums that wrap a 64-bit (or 32-bit) add to something small
    (100, 10, U64 - 61 + 1, False), (100, U32, U64 - 52 - U32 + 5, False),
    (100, U32 - 40, 0, False), (U64, 0, U64, False), (U64, 0, U64 - 52, True),
])
def test_envelope_fits(size, text, payload, ok):
    assert _native.envelope_fits(size, text, payload) is ok


# ---- read_entry -----------------------------------------------------------

TEXT = "The system prompt. Héllo → tokens".encode()
PAYLOAD = bytes(range(256)) * 3 + b"tail"
TRAILER = b"TRAILER-SECTIONS"


def test_read_entry_every_field(checkpoint_file):
    path = checkpoint_file(TEXT, PAYLOAD, TRAILER, quant_bits=8, reason=kvstore.format.Reason.AGENT_SESSION,
                           ext_flags=kvstore.format.ExtFlag.SESSION_TITLE | kvstore.format.ExtFlag.TOOL_MAP,
                           model_id=2, tokens=4321, hits=17, ctx_size=65536, payload_abi=16,
                           created_at=1_600_000_000, last_used=1_600_000_999)
    e = kvstore.format.read_entry(path)
    assert isinstance(e, kvstore.format.Entry)
    assert e.sha == hashlib.sha1(TEXT).hexdigest()
    assert e.path == path and e.name == os.path.basename(path)
    assert (e.quant_bits, e.reason, e.model_id, e.tokens, e.hits, e.ctx_size, e.payload_abi) == \
        (8, kvstore.format.Reason.AGENT_SESSION, 2, 4321, 17, 65536, 16)
    assert e.ext_flags == kvstore.format.ExtFlag.SESSION_TITLE | kvstore.format.ExtFlag.TOOL_MAP
    assert (e.created_at, e.last_used) == (1_600_000_000, 1_600_000_999)
    assert e.payload_bytes == len(PAYLOAD)
    assert e.text_bytes == len(TEXT)
    assert e.file_size == 52 + len(TEXT) + len(PAYLOAD) + len(TRAILER) == os.path.getsize(path)
    assert e.loadable is True
    assert e.text_offset == 52
    assert e.payload_offset == 52 + len(TEXT)
    assert e.trailer_offset == 52 + len(TEXT) + len(PAYLOAD)
    with open(path, "rb") as f:
        blob = f.read()
    assert blob[e.text_offset:e.payload_offset] == TEXT
    assert blob[e.payload_offset:e.trailer_offset] == PAYLOAD
    assert blob[e.trailer_offset:] == TRAILER


def test_read_entry_uppercase_name_and_pathlike(checkpoint_file, tmp_path):
    sha = hashlib.sha1(TEXT).hexdigest()
    path = checkpoint_file(TEXT, PAYLOAD, name=sha.upper() + ".kv")
    e = kvstore.format.read_entry(tmp_path / (sha.upper() + ".kv"))
    assert e.sha == sha
    assert e.path == path and isinstance(e.path, str)


def test_read_entry_empty_text_payload_and_trailer(checkpoint_file):
    path = checkpoint_file(b"", b"", b"")
    e = kvstore.format.read_entry(path)
    assert (e.text_bytes, e.payload_bytes, e.file_size) == (0, 0, 52)


def test_read_entry_ds4_abi2_is_a_valid_envelope(checkpoint_file):
    # ds4 writes quant bits 2 or 4 and its own graph-state payload (ABI 2).
    path = checkpoint_file(b"<|begin|>system", b"\x02" * 999, quant_bits=2, payload_abi=2,
                           reason=kvstore.format.Reason.EVICT, ext_flags=kvstore.format.ExtFlag.TOOL_MAP, tokens=5)
    e = kvstore.format.read_entry(path)
    assert e.payload_abi == 2 and e.loadable is False
    assert (e.quant_bits, e.reason, e.tokens, e.payload_bytes) == (2, kvstore.format.Reason.EVICT, 5, 999)


@pytest.mark.parametrize("abi,loadable", [(16, True), (2, False), (0, False), (15, False), (18, False)])
def test_loadable_only_for_abi16_and_17(checkpoint_file, abi, loadable):
    assert kvstore.format.read_entry(checkpoint_file(payload_abi=abi)).loadable is loadable


def test_abi17_without_a_chain_header_is_corrupt(checkpoint_file):
    # An ABI 17 payload opens with the 64-byte "KVCB" chain header.
    with pytest.raises(kvstore.CorruptCheckpoint) as e:
        kvstore.format.read_entry(checkpoint_file(payload_abi=17, payload=b"\x00" * 80))
    assert e.value.reason == "bad_chain_header"
    with pytest.raises(kvstore.CorruptCheckpoint) as e:
        kvstore.format.read_entry(checkpoint_file(payload_abi=17, payload=b"\x00" * 10))
    assert e.value.reason == "bad_payload"


def test_read_entry_reason_above_6_is_unknown(checkpoint_file):
    e = kvstore.format.read_entry(checkpoint_file(reason=9))
    assert e.reason is kvstore.format.Reason.UNKNOWN


def test_read_entry_reserved_bytes_and_unknown_flags(checkpoint_file, envelope):
    header = patched(patched(valid_header(payload_bytes=len(PAYLOAD)).pack(), 21, b"\xaa\xbb\xcc"), 6, b"\xc1")
    e = kvstore.format.read_entry(checkpoint_file(TEXT, PAYLOAD, header=header))
    assert int(e.ext_flags) == 0xC1 and e.tokens == 100


def corrupt(excinfo, path, reason):
    """Asserts a CorruptCheckpoint for path with reason, shown in the message."""
    err = excinfo.value
    assert isinstance(err, kvstore.CorruptCheckpoint) and isinstance(err, ValueError)
    assert err.reason == reason and err.path == os.fspath(path)
    assert os.fspath(path) in str(err) and reason in str(err)


def test_read_entry_every_truncation(tmp_path, envelope):
    blob = envelope(b"hello", b"12345678", b"")
    assert len(blob) == 65
    path = tmp_path / ("ab" * 20 + ".kv")
    for n in range(len(blob)):
        path.write_bytes(blob[:n])
        with pytest.raises(kvstore.CorruptCheckpoint) as ei:
            kvstore.format.read_entry(path)
        corrupt(ei, path, "truncated")
    path.write_bytes(blob)
    assert kvstore.format.read_entry(path).file_size == 65


@pytest.mark.parametrize("offset,value,reason", [
    (0, b"XVC", "bad_magic"), (3, b"\x02", "bad_version"), (8, bytes(4), "zero_tokens"),
    (4, b"\x07", "bad_quant_bits"), (4, b"\x00", "bad_quant_bits"), (4, b"\x11", "bad_quant_bits"),
])
def test_read_entry_bad_header(tmp_path, envelope, offset, value, reason):
    path = tmp_path / ("cd" * 20 + ".kv")
    path.write_bytes(patched(envelope(TEXT, PAYLOAD), offset, value))
    with pytest.raises(kvstore.CorruptCheckpoint) as ei:
        kvstore.format.read_entry(path)
    corrupt(ei, path, reason)


@pytest.mark.parametrize("text_len,payload_bytes", [
    (len(TEXT) + 1, len(PAYLOAD)),                  # text one byte past the end
    (len(TEXT), len(PAYLOAD) + 1),                  # payload one byte past the end
    (U32, 0), (U32, len(PAYLOAD)), (2**31, 0),
    (0, U64), (len(TEXT), U64), (U32, U64), (0, 2**63), (0, 2**32),
    # values whose 64-bit sum 52 + text + payload wraps to less than the file size
    (len(TEXT), 2**64 - 52 - len(TEXT) + 1),
    (U32, 2**64 - 52 - U32 + 10),
    (0, 2**64 - 52),
    # 52 + text wraps a 32-bit add
    (2**32 - 52 + 1, 0),
])
def test_read_entry_lengths_past_end_no_overflow_no_allocation(tmp_path, envelope, text_len, payload_bytes):
    path = tmp_path / ("ef" * 20 + ".kv")
    path.write_bytes(envelope(TEXT, PAYLOAD, text_len=text_len, payload_bytes=payload_bytes))
    tracemalloc.start()
    try:
        with pytest.raises(kvstore.CorruptCheckpoint) as ei:
            kvstore.format.read_entry(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    corrupt(ei, path, "truncated")
    assert peak < 256 * 1024, f"read_entry allocated {peak} bytes for a bad length"
    assert str(payload_bytes) in str(ei.value) and str(text_len) in str(ei.value)


def test_read_entry_exact_fit_and_trailer_slack(tmp_path, envelope):
    path = tmp_path / ("01" * 20 + ".kv")
    path.write_bytes(envelope(TEXT, PAYLOAD, TRAILER, payload_bytes=len(PAYLOAD) + len(TRAILER)))
    assert kvstore.format.read_entry(path).payload_bytes == len(PAYLOAD) + len(TRAILER)


def unsafe(excinfo, path, words):
    err = excinfo.value
    assert isinstance(err, kvstore.errors.UnsafePath) and isinstance(err, OSError)
    assert isinstance(err, kvstore.KVStoreError)
    assert os.fspath(path) in str(err) and words in str(err)


def test_read_entry_symlink_refused(checkpoint_file, tmp_path):
    target = checkpoint_file()
    link = tmp_path / ("9" * 40 + ".kv")
    os.symlink(target, link)
    with pytest.raises(kvstore.errors.UnsafePath) as ei:
        kvstore.format.read_entry(link)
    unsafe(ei, link, "symlink")
    assert ei.value.errno == errno.ELOOP
    assert kvstore.format.read_entry(target).tokens == 7     # the target itself is fine


def test_read_entry_dangling_symlink_refused(tmp_path):
    link = tmp_path / ("8" * 40 + ".kv")
    os.symlink(tmp_path / "nowhere.kv", link)
    with pytest.raises(kvstore.errors.UnsafePath) as ei:
        kvstore.format.read_entry(link)
    unsafe(ei, link, "symlink")


def test_read_entry_directory_refused(tmp_path):
    d = tmp_path / ("7" * 40 + ".kv")
    d.mkdir()
    with pytest.raises(kvstore.errors.UnsafePath) as ei:
        kvstore.format.read_entry(d)
    unsafe(ei, d, "not a regular file")


def test_read_entry_fifo_refused_without_blocking(tmp_path):
    fifo = tmp_path / ("6" * 40 + ".kv")
    os.mkfifo(fifo)
    # No writer: a blocking open would hang forever, so read in a thread and,
    # if it is stuck, open the write end to release it before failing.
    result = []

    def read():
        try:
            result.append(kvstore.format.read_entry(fifo))
        except BaseException as e:     # noqa: B036 - handed to the main thread
            result.append(e)

    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(5)
    if t.is_alive():
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        t.join(5)
        pytest.fail("read_entry blocked opening a FIFO")
    assert isinstance(result[0], kvstore.errors.UnsafePath), result
    with pytest.raises(kvstore.errors.UnsafePath) as ei:
        raise result[0]
    unsafe(ei, fifo, "not a regular file")


def test_read_entry_missing(tmp_path):
    path = tmp_path / ("5" * 40 + ".kv")
    with pytest.raises(kvstore.errors.CheckpointMissing) as ei:
        kvstore.format.read_entry(path)
    err = ei.value
    assert isinstance(err, FileNotFoundError) and isinstance(err, kvstore.CheckpointOSError)
    assert isinstance(err, kvstore.KVStoreError)
    assert err.errno == errno.ENOENT and err.filename == os.fspath(path)
    assert os.fspath(path) in str(err) and "No such file" in str(err)


def test_read_entry_no_fd_leak(tmp_path, checkpoint_file):
    good = checkpoint_file()
    bad = tmp_path / ("4" * 40 + ".kv")
    bad.write_bytes(b"KVC" + bytes(60))
    d = tmp_path / "dir"
    d.mkdir()
    before = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else None
    for _ in range(200):
        kvstore.format.read_entry(good)
        for p in (bad, d):
            with pytest.raises(kvstore.KVStoreError):
                kvstore.format.read_entry(p)
    if before is not None:
        assert len(os.listdir("/proc/self/fd")) == before


def test_header_prefix_struct_of_written_file(checkpoint_file):
    # The u32 text length sits at offset 48, right after the header.
    path = checkpoint_file(TEXT, PAYLOAD)
    with open(path, "rb") as f:
        blob = f.read()
    assert struct.unpack_from("<I", blob, 48)[0] == len(TEXT)
    assert kvstore.format.Header.unpack(blob[:48]).payload_bytes == len(PAYLOAD)


def _near(hi):
    """Integers in 0..hi, weighted to both ends where overflow lives."""
    return st.one_of(st.integers(0, 200), st.integers(hi - 200, hi), st.integers(0, hi))


@settings(max_examples=500)
@given(_near(U64), _near(U32), _near(U64))
def test_envelope_fits_property(size, text, payload):
    assert _native.envelope_fits(size, text, payload) is (52 + text + payload <= size)
