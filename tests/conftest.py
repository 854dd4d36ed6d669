"""Shared fixtures: one run per compiled hashing path, checkpoint files on disk, an open
store and the MLX tests' tokenizer.  The plain helpers they use are in kvhelpers.py."""

import os
from dataclasses import dataclass

import pytest

from kvstore import _native
from kvhelpers import make_envelope, make_store, write_checkpoint

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


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "store_args(**kw): arguments the store fixture passes on to make_store")


@pytest.fixture
def store(request, tmp_path):
    """An open make_store(tmp_path / "kv") (min_tokens=1, no fsync), closed after the test.

    A module or test marked ``pytest.mark.store_args(**kw)`` gets make_store(..., **kw).
    """
    marker = request.node.get_closest_marker("store_args")
    with make_store(tmp_path / "kv", **(marker.kwargs if marker else {})) as s:
        yield s


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    """The offline demo tokenizer (kvstore.demo.model), trained once per module."""
    from kvstore.demo import model as mlx_model
    return mlx_model.make_tokenizer(tmp_path_factory.mktemp("tok"))
