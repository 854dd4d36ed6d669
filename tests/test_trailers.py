"""Trailer sections (docs/format.md §10): framing, hooks, preservation, damage."""

import logging
import mmap
import struct
import tracemalloc

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore import trailers
from kvstore.format import ExtFlag

import reference
from kvstore.trailers import (SECTION_HEADER, Section, TitleHook, ToolMapHook, encode_trailer,
                              hooks, parse_trailer, register, trailer_size)

SECRET = "hunter2-PROMPT-SECRET"
TOOL_MAP = {"call_b": '{"name":"grep","args":["é", "x"]}', "call_a": "ls -la\n\t\u2603"}
TITLE = "refactor the parser \u2014 day 2"

# The framing written out by hand, with the pure-Python CRC twin, so the module
# is checked against the spec rather than against itself.
_FRAME = struct.Struct("<B3sQI")


def frame(bit, body, crc=None, reserved=b"\0\0\0", length=None):
    crc = reference.crc32c(body) if crc is None else crc
    return _FRAME.pack(bit, reserved, len(body) if length is None else length, crc) + body


def drop_records(caplog):
    return [r for r in caplog.records if "trailer_drop" in r.getMessage()]


def assert_secret_absent(caplog, secret=SECRET):
    for r in caplog.records:
        for text in (r.getMessage(), repr(r.args), r.exc_text or "", str(r.msg)):
            assert secret not in text
            assert secret.encode().hex() not in text


# --- hooks and round trips -------------------------------------------------------

def test_section_header_is_16_bytes():
    assert SECTION_HEADER.size == 16


def test_builtin_hooks_registered_on_their_bits():
    h = hooks()
    assert isinstance(h[0], ToolMapHook) and h[0].bit == 0
    assert isinstance(h[3], TitleHook) and h[3].bit == 3
    h.clear()                       # a copy: the registry itself is untouched
    assert set(hooks()) >= {0, 3}


def test_round_trip_both_hooks():
    buf, flags = encode_trailer({0: TOOL_MAP, 3: TITLE})
    assert flags == ExtFlag.TOOL_MAP | ExtFlag.SESSION_TITLE == 0b1001
    assert trailer_size({0: TOOL_MAP, 3: TITLE}) == len(buf)
    values, sections, got_flags = parse_trailer(buf)
    assert values == {0: TOOL_MAP, 3: TITLE}
    assert got_flags == flags
    assert [s.bit for s in sections] == [0, 3]
    # The tool-call text comes back exactly, not merely equal after normalisation.
    for k, v in TOOL_MAP.items():
        assert values[0][k] == v and type(values[0][k]) is str


def test_tool_map_body_is_compact_sorted_utf8_json():
    buf, _ = encode_trailer({0: {"b": "2", "a": "\u00e9"}})
    body = '{"a":"\u00e9","b":"2"}'.encode("utf-8")
    assert buf == frame(0, body)


@pytest.mark.parametrize("title", ["", "x", "\u00e9" * 2048, "a" * trailers.TITLE_MAX_BYTES])
def test_title_round_trip_edges(title):
    buf, flags = encode_trailer({3: title})
    assert buf == frame(3, title.encode("utf-8"))
    assert parse_trailer(buf)[0] == {3: title}
    assert flags == 8


def test_empty_tool_map_round_trip():
    buf, flags = encode_trailer({0: {}})
    assert parse_trailer(buf) == ({0: {}}, [Section(0, b"{}")], 1)


def test_empty_trailer():
    assert encode_trailer({}) == (b"", 0)
    assert trailer_size({}) == 0
    assert parse_trailer(b"") == ({}, [], 0)


def test_sections_written_in_bit_order():
    buf, _ = encode_trailer({3: TITLE, 0: TOOL_MAP})
    assert buf[0] == 0
    assert [s.bit for s in parse_trailer(buf)[1]] == [0, 3]


# --- keys: ints and ExtFlags -----------------------------------------------------

def test_extflag_and_int_keys_both_accepted():
    by_flag = encode_trailer({ExtFlag.TOOL_MAP: TOOL_MAP, ExtFlag.SESSION_TITLE: TITLE})
    by_int = encode_trailer({0: TOOL_MAP, 3: TITLE})
    mixed = encode_trailer({ExtFlag.TOOL_MAP: TOOL_MAP, 3: TITLE})
    assert by_flag == by_int == mixed
    assert trailer_size({ExtFlag.SESSION_TITLE: TITLE}) == len(encode_trailer({3: TITLE})[0])


def test_int_key_is_a_bit_index_not_a_flag_value():
    # ExtFlag.SESSION_TITLE == 8, but the int 8 is not a bit index.
    with pytest.raises(ValueError, match="8"):
        encode_trailer({8: TITLE})
    # ExtFlag.TOOL_MAP == 1, but the int 1 is bit 1 (visible responses, no hook here).
    with pytest.raises(ValueError, match="bit 1"):
        encode_trailer({1: TOOL_MAP})


@pytest.mark.parametrize("values", [
    {0: TOOL_MAP, ExtFlag.TOOL_MAP: TOOL_MAP},                   # one bit twice
    {ExtFlag.TOOL_MAP | ExtFlag.SESSION_TITLE: TITLE},           # not a single flag
    {ExtFlag(0): TITLE},
    {-1: TITLE},
    {True: TOOL_MAP},
    {"0": TOOL_MAP},
])
def test_bad_keys_raise_value_error(values):
    with pytest.raises(ValueError):
        encode_trailer(values)
    with pytest.raises(ValueError):
        trailer_size(values)


def test_value_for_bit_without_hook_raises_naming_the_bit():
    with pytest.raises(ValueError, match="bit 5"):
        encode_trailer({5: b"raw"})
    with pytest.raises(ValueError, match="bit 2"):
        encode_trailer({ExtFlag.THINKING_VISIBLE: "x"})


@pytest.mark.parametrize("bad", [["a"], {"a": 1}, {1: "a"}, "text"])
def test_tool_map_rejects_non_str_maps(bad):
    with pytest.raises(TypeError):
        encode_trailer({0: bad})


def test_title_over_limit_raises_value_error():
    with pytest.raises(ValueError, match="4096"):
        encode_trailer({3: "a" * (trailers.TITLE_MAX_BYTES + 1)})
    # The limit is in UTF-8 bytes, not characters: 1366 * 3 = 4098 bytes.
    with pytest.raises(ValueError, match="4098"):
        encode_trailer({ExtFlag.SESSION_TITLE: "\u20ac" * 1366})
    with pytest.raises(ValueError):
        trailer_size({3: "a" * (trailers.TITLE_MAX_BYTES + 1)})
    with pytest.raises(TypeError):
        encode_trailer({3: b"bytes title"})


def test_over_limit_title_on_disk_is_dropped(caplog):
    big = frame(3, b"a" * (trailers.TITLE_MAX_BYTES + 1))
    with caplog.at_level(logging.WARNING, logger="kvstore"):
        assert parse_trailer(frame(0, b"{}") + big) == ({0: {}}, [Section(0, b"{}")], 1)
    assert "reason=decode" in drop_records(caplog)[0].getMessage()


# --- registry --------------------------------------------------------------------

def test_duplicate_registration_raises_naming_the_bit():
    with pytest.raises(ValueError, match="bit 0"):
        register(ToolMapHook())
    with pytest.raises(ValueError, match="bit 3"):
        register(TitleHook())
    assert isinstance(hooks()[0], ToolMapHook)


@pytest.mark.parametrize("bit", [-1, 8, 255, None, "3", True])
def test_register_rejects_bad_bits(bit, monkeypatch):
    monkeypatch.setattr(trailers, "_HOOKS", dict(trailers._HOOKS))

    class Hook:
        def encode(self, value):
            return value

        def decode(self, body):
            return body
    h = Hook()
    h.bit = bit
    with pytest.raises(ValueError):
        register(h)


class _UpperHook:
    bit = 6

    def encode(self, value):
        return value.encode("ascii")

    def decode(self, body):
        if body != body.upper():
            raise ValueError("not upper case")
        return body.decode("ascii")


def test_registered_hook_is_used_and_old_unknown_section_is_replaced(monkeypatch):
    monkeypatch.setattr(trailers, "_HOOKS", dict(trailers._HOOKS))
    old = frame(6, b"OLD")
    assert parse_trailer(old)[0] == {}            # no hook yet: raw only
    register(_UpperHook())
    assert 6 in hooks()
    assert parse_trailer(old)[0] == {6: "OLD"}
    # With a hook for bit 6, a kept bit-6 section is the caller's to write.
    buf, flags = encode_trailer({6: "NEW"}, keep=parse_trailer(old)[1])
    assert buf == frame(6, b"NEW") and flags == 1 << 6
    assert encode_trailer({}, keep=[Section(6, b"OLD")]) == (b"", 0)


def test_hook_raising_anything_on_decode_drops_the_section(monkeypatch, caplog):
    monkeypatch.setattr(trailers, "_HOOKS", dict(trailers._HOOKS))

    class Buggy:
        bit = 7

        def encode(self, value):
            return value

        def decode(self, body):
            raise TypeError(f"cannot handle {body!r}")
    register(Buggy())
    with caplog.at_level(logging.WARNING, logger="kvstore"):
        values, sections, flags = parse_trailer(frame(7, SECRET.encode()) + frame(3, b"t"))
    assert values == {3: "t"} and flags == 8
    assert "reason=decode" in caplog.text and "error=TypeError" in caplog.text
    assert_secret_absent(caplog)


# --- unknown sections are preserved ----------------------------------------------

def test_unknown_sections_preserved_byte_exactly():
    unknown5 = frame(5, bytes(range(256)) * 3)
    unknown7 = frame(7, b"")
    unknown1 = frame(1, b"\x00\xff visible responses from a newer build")
    old = frame(0, b'{"id":"old"}') + unknown1 + frame(3, b"old title") + unknown5 + unknown7
    values, sections, flags = parse_trailer(old)
    assert values == {0: {"id": "old"}, 3: "old title"}
    assert flags == 0b10101011

    new_values = {ExtFlag.SESSION_TITLE: "new title", 0: values[0]}
    buf, new_flags = encode_trailer(new_values, keep=sections)
    assert new_flags == flags
    assert trailer_size(new_values, keep=sections) == len(buf)
    assert buf == frame(0, b'{"id":"old"}') + unknown1 + frame(3, b"new title") + unknown5 + unknown7
    # Through a second generation too.
    again, _ = encode_trailer(parse_trailer(buf)[0], keep=parse_trailer(buf)[1])
    assert again == buf


def test_known_bits_are_not_taken_from_keep():
    # A hooked bit with no value is gone on rewrite: keep carries unknown sections only.
    old = frame(0, b'{"a":"b"}') + frame(3, b"title") + frame(4, b"u")
    _, sections, _ = parse_trailer(old)
    assert encode_trailer({}, keep=sections) == (frame(4, b"u"), 1 << 4)


def test_none_value_removes_a_kept_unknown_section():
    keep = [Section(4, b"u"), Section(5, b"v")]
    assert encode_trailer({5: None, 3: None}, keep=keep) == (frame(4, b"u"), 1 << 4)


@pytest.mark.parametrize("keep", [
    [Section(4, b"a"), Section(4, b"b")],
    [Section(8, b"a")],
    [Section(-1, b"a")],
])
def test_bad_keep_raises(keep):
    with pytest.raises(ValueError):
        encode_trailer({}, keep=keep)


# --- damage ----------------------------------------------------------------------

def _three_sections():
    s0 = frame(0, b'{"call_1":"ls"}')
    s5 = frame(5, b"unknown body")
    s3 = frame(3, f"title with {SECRET}".encode())
    return s0, s5, s3


@pytest.mark.parametrize("where", ["body", "crc_field", "body_first_byte", "body_last_byte"])
def test_crc_flip_drops_only_that_section(where, caplog):
    s0, s5, s3 = _three_sections()
    bad = bytearray(s3)
    i = {"body": 16 + 11, "crc_field": 12, "body_first_byte": 16, "body_last_byte": len(s3) - 1}[where]
    bad[i] ^= 0x01
    with caplog.at_level(logging.DEBUG, logger="kvstore"):
        values, sections, flags = parse_trailer(s0 + bytes(bad) + s5, path="/d/" + "ab" * 20 + ".kv")
    assert values == {0: {"call_1": "ls"}}
    assert sections == [Section(0, b'{"call_1":"ls"}'), Section(5, b"unknown body")]
    assert flags == 0b100001
    drops = drop_records(caplog)
    assert len(drops) == 1
    msg = drops[0].getMessage()
    assert msg.startswith("kvstore: trailer_drop ")
    assert f"file={'ab' * 20}.kv" in msg and "bit=3" in msg and "reason=crc" in msg
    assert "/d/" not in msg
    assert_secret_absent(caplog)


def test_bad_body_with_good_crc_is_dropped_without_its_text(caplog):
    bad_json = frame(0, f'["{SECRET}"]'.encode())
    dup_keys = frame(0, f'{{"a":"{SECRET}","a":"x"}}'.encode())
    bad_utf8 = frame(3, SECRET.encode() + b"\xff\xfe")
    nested = frame(0, b"[" * 100_000)
    ok = frame(5, b"fine")
    with caplog.at_level(logging.WARNING, logger="kvstore"):
        for bad in (bad_json, dup_keys, bad_utf8, nested):
            values, sections, flags = parse_trailer(bad + ok)
            assert (values, sections, flags) == ({}, [Section(5, b"fine")], 1 << 5)
    drops = drop_records(caplog)
    assert len(drops) == 4
    assert all("reason=decode" in r.getMessage() for r in drops)
    assert_secret_absent(caplog)


@pytest.mark.parametrize("body", [b"[" * 100_000, b'{"a":' * 100_000, b"\xff", b"[]", b'{"a":1}',
                                  b'{"a":"x","a":"y"}', "\"\u00e9\"".encode("utf-16")])
def test_tool_map_decode_raises_value_error_on_bad_bodies(body):
    with pytest.raises(ValueError):
        ToolMapHook().decode(body)


def test_duplicate_and_out_of_range_bits_are_dropped_and_parsing_continues(caplog):
    first = frame(3, b"first")
    buf = frame(9, b"nine") + first + frame(3, b"second") + frame(0, b"{}")
    with caplog.at_level(logging.WARNING, logger="kvstore"):
        values, sections, flags = parse_trailer(buf)
    assert values == {3: "first", 0: {}}
    assert sections == [Section(3, b"first"), Section(0, b"{}")]
    assert flags == 0b1001
    reasons = [r.getMessage() for r in drop_records(caplog)]
    assert len(reasons) == 2
    assert "bit=9 reason=bad_bit" in reasons[0] and "bit=3 reason=duplicate" in reasons[1]


def test_bad_first_copy_lets_a_good_second_copy_through():
    buf = frame(3, b"first", crc=0) + frame(3, b"second")
    assert parse_trailer(buf)[0] == {3: "second"}


def test_reserved_bytes_ignored_on_read_and_zero_on_write():
    buf = frame(3, b"t", reserved=b"\x01\x02\x03")
    values, sections, _ = parse_trailer(buf)
    assert values == {3: "t"}
    assert encode_trailer(values)[0] == frame(3, b"t")


def test_every_truncation_of_two_sections(caplog):
    s0 = frame(0, b'{"call_1":"echo hi"}')
    s3 = frame(3, TITLE.encode())
    full = s0 + s3
    with caplog.at_level(logging.WARNING, logger="kvstore"):
        for cut in range(len(full) + 1):
            caplog.clear()
            values, sections, flags = parse_trailer(full[:cut])
            want = {}
            if cut >= len(s0):
                want[0] = {"call_1": "echo hi"}
            if cut == len(full):
                want[3] = TITLE
            assert values == want, cut
            assert {s.bit for s in sections} == set(want), cut
            for s in sections:
                assert s.body == {0: s0[16:], 3: s3[16:]}[s.bit], cut
            assert flags == sum(1 << b for b in want), cut
            # A cut inside a section is logged once; a cut on a boundary is not.
            expect_log = cut not in (0, len(s0), len(full))
            assert len(drop_records(caplog)) == int(expect_log), cut


@pytest.mark.parametrize("length", [2**64 - 1, 2**64 - 16, 2**63, 2**32, 10**6])
def test_huge_length_ends_parsing_without_allocating(length, caplog):
    good = frame(0, b"{}")
    buf = good + frame(3, b"short body", length=length)
    tracemalloc.start()
    try:
        with caplog.at_level(logging.WARNING, logger="kvstore"):
            values, sections, flags = parse_trailer(buf)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert (values, flags) == ({0: {}}, 1)
    assert peak < 64 * 1024
    msg = drop_records(caplog)[0].getMessage()
    assert "reason=truncated_body" in msg and f"length={length}" in msg


def test_parse_accepts_any_buffer_and_releases_it():
    raw, _ = encode_trailer({0: TOOL_MAP, 3: TITLE})
    ba = bytearray(raw)
    assert parse_trailer(ba)[0] == {0: TOOL_MAP, 3: TITLE}
    ba.extend(b"more")               # BufferError if parse still held an export
    assert parse_trailer(memoryview(raw)[: len(raw)])[0] == {0: TOOL_MAP, 3: TITLE}
    m = mmap.mmap(-1, len(raw))
    m.write(raw)
    assert parse_trailer(m)[0] == {0: TOOL_MAP, 3: TITLE}
    m.close()                        # BufferError if an export were still open


# --- fuzz ------------------------------------------------------------------------

def _check_result(buf, result):
    values, sections, flags = result
    assert isinstance(values, dict) and isinstance(sections, list) and isinstance(flags, int)
    assert flags == sum(1 << s.bit for s in sections)
    assert len({s.bit for s in sections}) == len(sections)
    assert all(0 <= s.bit <= 7 and isinstance(s.body, bytes) for s in sections)
    assert set(values) <= {s.bit for s in sections}
    assert sum(16 + len(s.body) for s in sections) <= len(buf)
    # Every returned section is framed somewhere in buf with its CRC.
    for s in sections:
        assert _FRAME.pack(s.bit, b"", len(s.body), reference.crc32c(s.body))[4:] + s.body in bytes(buf)


_QUIET = logging.getLogger("kvstore.test.fuzz")
_QUIET.addHandler(logging.NullHandler())
_QUIET.propagate = False


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=512))
def test_fuzz_random_bytes_never_raise(buf):
    _check_result(buf, parse_trailer(buf, log=_QUIET))


_sections = st.lists(st.tuples(st.integers(0, 255), st.binary(max_size=64), st.booleans()), max_size=5)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_sections, st.integers(2**64 - 2**16, 2**64 - 1) | st.integers(0, 2**64 - 1),
       st.binary(max_size=64))
def test_fuzz_framed_sections_with_huge_lengths(parts, length, tail):
    buf = b"".join(frame(b, body, crc=None if good else 0xDEADBEEF) for b, body, good in parts)
    buf += _FRAME.pack(tail[0] if tail else 3, b"\0\0\0", length, 0) + tail
    _check_result(buf, parse_trailer(buf, log=_QUIET))


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.text(max_size=20), st.text(max_size=40), max_size=6),
       st.text(max_size=100), st.data())
def test_fuzz_mutated_trailer_never_raises(tool_map, title, data):
    buf = bytearray(encode_trailer({0: tool_map, 3: title})[0])
    assert parse_trailer(bytes(buf), log=_QUIET)[0] == {0: tool_map, 3: title}
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(buf) - 1))
        buf[i] = data.draw(st.integers(0, 255))
    _check_result(buf, parse_trailer(bytes(buf), log=_QUIET))
