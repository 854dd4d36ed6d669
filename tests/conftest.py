"""Shared fixtures: one run per compiled hashing path, and checkpoint files on disk."""

import hashlib
import os
import struct
from dataclasses import dataclass

import pytest

import kvstore
from kvstore import _native

_AVAILABLE = _native.available()
# Every path name the build can run for either hot path, portable first.
_IMPL_NAMES = [n for n in ("portable", "x86", "avx512", "arm")
               if n in _AVAILABLE["sha1"] or n in _AVAILABLE["crc32c"]]


def default_selection():
    """What the binding selects at import: KVSTORE_PORTABLE=1 forces portable."""
    return "portable" if os.environ.get("KVSTORE_PORTABLE", "") not in ("", "0") else "auto"


@dataclass(frozen=True)
class Impl:
    """The paths a test runs on; None where that hot path lacks this one."""
    name: str
    sha1: str | None
    crc32c: str | None


@pytest.fixture(params=_IMPL_NAMES)
def impl(request):
    """Runs the test once per run-time-dispatched path present on this machine.

    SHA1 and CRC32C are both switched to the path where it exists; the one
    without it stays portable.  The import-time selection is restored after.
    """
    name = request.param
    chosen = Impl(name,
                  name if name in _AVAILABLE["sha1"] else None,
                  name if name in _AVAILABLE["crc32c"] else None)
    _native.select(sha1=chosen.sha1 or "portable", crc32c=chosen.crc32c or "portable")
    try:
        yield chosen
    finally:
        restore = default_selection()
        _native.select(sha1=restore, crc32c=restore)


def make_envelope(text=b"hello world", payload=b"\x00payload\xff", trailer=b"", *,
                  header=None, text_len=None, **fields):
    """The bytes of a .kv file: 48-byte header, u32 text length, text, payload, trailer.

    Args:
        header: raw 48 header bytes to use instead of packing ``fields`` (for
            headers that Header.pack refuses to write).
        text_len: the u32 written as the text length (default len(text)).
        fields: kvstore.Header fields; defaults make a valid ABI-16 header
            whose payload_bytes is len(payload).
    """
    if header is None:
        values = dict(quant_bits=4, tokens=7, ctx_size=32768, payload_bytes=len(payload),
                      reason=kvstore.Reason.COLD, created_at=1_700_000_000,
                      last_used=1_700_000_100)
        values.update(fields)
        header = kvstore.Header(**values).pack()
    assert len(header) == 48
    tl = len(text) if text_len is None else text_len
    return header + struct.pack("<I", tl) + text + payload + trailer


def checkpoint_name(text):
    """The file name SPEC section 2 gives the checkpoint of text."""
    return hashlib.sha1(text).hexdigest() + ".kv"


def write_checkpoint(directory, text=b"hello world", payload=b"\x00payload\xff", trailer=b"", *,
                     name=None, **kw):
    """Writes make_envelope(...) to directory/name (default sha1(text).kv); returns the path."""
    path = os.path.join(os.fspath(directory), name or checkpoint_name(text))
    with open(path, "wb") as f:
        f.write(make_envelope(text, payload, trailer, **kw))
    return path


@pytest.fixture
def checkpoint_file(tmp_path):
    """A factory: checkpoint_file(text=..., payload=..., trailer=..., name=..., **header_fields)
    writes a checkpoint into tmp_path and returns its path (str)."""
    def make(*args, **kw):
        return write_checkpoint(tmp_path, *args, **kw)
    return make


@pytest.fixture
def envelope():
    """make_envelope, for tests that need the bytes rather than a file."""
    return make_envelope
