"""The sdist that `python -m build --sdist` makes from this tree: it carries
everything the build needs (csrc's C sources and headers, the Cython
binding's .pyx, .pxd and .pxi files, setup.py) and the py.typed marker, and
nothing a build makes (Cython's kvstore/_native.c, compiled .so files); and
`twine check` passes on it.  MANIFEST.in decides what goes in.

.ci/run installs `build` and `twine`; without `build` the tests skip, without
`twine` only the twine check does.  The build runs in pip's isolated build
environment, so it installs setuptools and Cython (pip's cache, else the
index).  .ci/run also builds the wheel and installs the sdist in a fresh
environment to run the demo; that is too slow for a test."""

import glob
import importlib.util
import os
import subprocess
import sys
import tarfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tail(run, n=6000):
    return (run.stdout[-n:] + "\n" + run.stderr[-n:]).strip()


@pytest.fixture(scope="module")
def sdist(tmp_path_factory):
    """The path of the sdist built from the source tree into a temporary directory."""
    if importlib.util.find_spec("build") is None:
        pytest.skip("the `build` module is not installed (pip install build; .ci/run installs it)")
    out = tmp_path_factory.mktemp("sdist")
    run = subprocess.run([sys.executable, "-m", "build", "--sdist", "--outdir", str(out), ROOT],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, _tail(run)
    made = glob.glob(os.path.join(out, "*.tar.gz"))
    assert len(made) == 1, made
    return made[0]


@pytest.fixture(scope="module")
def members(sdist):
    """The sdist's file names, without the leading kvstore-VERSION/ directory."""
    with tarfile.open(sdist) as tar:
        names = [m.name for m in tar.getmembers() if m.isfile()]
    tops = {name.split("/", 1)[0] for name in names}
    assert len(tops) == 1, tops
    return {name.split("/", 1)[1] for name in names if "/" in name}


def _tree(pattern):
    """The source tree's files matching pattern, relative to the root."""
    found = sorted(os.path.relpath(p, ROOT).replace(os.sep, "/") for p in glob.glob(os.path.join(ROOT, pattern)))
    assert found, f"no {pattern} in the source tree"
    return found


def test_the_sdist_carries_everything_the_build_needs(members):
    needed = (_tree("csrc/*.c") + _tree("csrc/*.h") + _tree("kvstore/*.pyx") + _tree("kvstore/*.pxd")
              + _tree("kvstore/*.pxi"))
    for name in ("kvstore/_native.pyx", "kvstore/_native.pxd"):
        assert name in needed
    needed += ["setup.py", "pyproject.toml", "README.md", "PKG-INFO", "kvstore/py.typed"]
    missing = [name for name in needed if name not in members]
    assert not missing, f"the sdist lacks {missing}"
    # The Python package itself, and the tests.
    assert "kvstore/__init__.py" in members
    assert "tests/test_packaging.py" in members


def test_the_sdist_carries_nothing_a_build_makes(members):
    compiled = sorted(name for name in members
                      if name.endswith((".so", ".pyd", ".dylib", ".o", ".pyc")) or "__pycache__/" in name)
    assert not compiled, compiled
    # Cython's output: remade from _native.pyx by every build.  The tree
    # has it (setup.py cythonizes whenever it runs, the sdist build too).
    assert "kvstore/_native.c" not in members
    # The C sources the sdist does carry are csrc's own, nothing else.
    c_files = sorted(name for name in members if name.endswith(".c") and not name.startswith("tests/"))
    assert c_files == _tree("csrc/*.c")


def test_twine_check_passes_on_the_sdist(sdist):
    if importlib.util.find_spec("twine") is None:
        pytest.skip("twine is not installed (pip install twine; .ci/run installs it)")
    run = subprocess.run([sys.executable, "-m", "twine", "check", "--strict", sdist],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, _tail(run)
    assert "PASSED" in run.stdout, _tail(run)
