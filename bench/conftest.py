"""Fixtures for the pytest-benchmark micro benchmarks (``pytest bench/ --benchmark-only``).

bench/ is outside the project's testpaths (pyproject: ["tests"]), so a plain
``pytest`` from the repository root never collects these.
"""

import os
import random
import sys

import pytest

# bench/ holds plain scripts too (foundation.py); import them by name.
sys.path.insert(0, os.path.dirname(__file__))

from foundation import PREFIX_LENGTHS, PROMPT_BYTES, SEED, make_checkpoint  # noqa: E402

MiB = 1024 * 1024


# Each fixture seeds its own generator, so its data does not depend on which
# benchmarks were selected or in what order they ran.
@pytest.fixture(scope="session")
def prompt():
    return random.Random(SEED).randbytes(PROMPT_BYTES)


@pytest.fixture(scope="session")
def prefix_lengths():
    """1000 distinct prefix lengths of the 400 KB prompt, in random order."""
    return random.Random(SEED + 1).sample(range(1, PROMPT_BYTES + 1), PREFIX_LENGTHS)


@pytest.fixture(scope="session", params=[1, 64], ids=["1MiB", "64MiB"])
def payload(request):
    return random.Random(SEED + 2).randbytes(request.param * MiB)


@pytest.fixture
def checkpoint(tmp_path):
    path = str(tmp_path / ("0" * 40 + ".kv"))
    make_checkpoint(path)
    return path


@pytest.fixture(scope="session", params=[10, 100, 1000, 10000], ids=lambda n: f"N{n}")
def lookup(request, tmp_path_factory):
    """A store directory of N checkpoints (bench/store.py's LookupDir: sparse entries)."""
    from store import LookupDir
    d = LookupDir(str(tmp_path_factory.mktemp("lookup") / "store"), random.Random(SEED + 3))
    d.grow(request.param)
    yield d
    d.close()
