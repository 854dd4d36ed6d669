"""tests/c/test_native.c built straight from csrc/: natively, and for aarch64
under qemu so the ARMv8 SHA1/CRC32C paths run on an x86 host too."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from kvstore import _native

ROOT = Path(__file__).resolve().parent.parent
CSRC = sorted(str(p) for p in (ROOT / "csrc").glob("*.c"))
TEST_C = str(ROOT / "tests" / "c" / "test_native.c")
SUMMARY = re.compile(r"^(\d+) passed, (\d+) failed$", re.M)
HW_LINE = re.compile(r"^sha1 hardware paths: (\d+), crc32c hardware paths: (\d+), table hardware paths: (\d+)$",
                     re.M)


def build_and_run(compiler, flags, exe, runner=()):
    assert CSRC, "no csrc/*.c found"
    subprocess.run([compiler, *flags, "-I", str(ROOT / "csrc"), TEST_C, *CSRC, "-o", str(exe)],
                   check=True, capture_output=True, text=True, timeout=180)
    return subprocess.run([*runner, str(exe)], capture_output=True, text=True, timeout=180)


def check_output(run):
    assert run.returncode == 0, run.stdout + run.stderr
    summary = SUMMARY.search(run.stdout)
    assert summary, run.stdout
    assert int(summary.group(2)) == 0 and "0 failed" in run.stdout, run.stdout + run.stderr
    assert int(summary.group(1)) > 1000          # the checks ran, not an empty main
    hw = HW_LINE.search(run.stdout)
    assert hw, run.stdout
    return int(hw.group(1)), int(hw.group(2)), int(hw.group(3))


def test_native_c_paths(tmp_path):
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler (cc or gcc) on PATH")
    run = build_and_run(compiler, ["-O2"], tmp_path / "test_native")
    sha_hw, crc_hw, table_hw = check_output(run)
    # Same CPU, same probes: the C test saw the hardware paths the module sees.
    av = _native.available()
    assert sha_hw == len(av["sha1"]) - 1
    assert crc_hw == len(av["crc32c"]) - 1
    assert table_hw == len(av["table"]) - 1


def test_aarch64_c_paths_under_qemu(tmp_path):
    missing = [t for t in ("aarch64-linux-gnu-gcc", "qemu-aarch64") if shutil.which(t) is None]
    if missing:
        pytest.skip(f"{' and '.join(missing)} not on PATH: the ARMv8 paths are not checked")
    run = build_and_run("aarch64-linux-gnu-gcc", ["-O2", "-march=armv8-a+crc+crypto", "-static"],
                        tmp_path / "test_native_aarch64", runner=["qemu-aarch64"])
    assert check_output(run) == (1, 1, 1), run.stdout          # NEON decodes table planes


@pytest.mark.parametrize("target", [110000, 101500])
def test_macos_branches_of_the_c_build_and_run_for_arm64_under_qemu(tmp_path, target):
    """csrc/ as Apple clang sees it on an Apple Silicon Mac (__APPLE__ set,
    __linux__ not): the macOS branches (no page population, no fallocate,
    the ARM features promised by the compiler flags instead of read from
    the auxiliary vector; preadv for a deployment target of macOS 11, which
    setup.py sets, pread run by run below it) are built with glibc standing
    in for libSystem's POSIX calls and run under qemu.  Apple's own headers
    and compiler are what only a Mac checks."""
    missing = [t for t in ("aarch64-linux-gnu-gcc", "qemu-aarch64") if shutil.which(t) is None]
    if missing:
        pytest.skip(f"{' and '.join(missing)} not on PATH: the macOS branches are not checked")
    (tmp_path / "apple").mkdir()
    (tmp_path / "apple" / "AvailabilityMacros.h").write_text(f"#define MAC_OS_X_VERSION_MIN_REQUIRED {target}\n")
    flags = ["-O2", "-march=armv8-a+crc+crypto", "-static", "-U__linux__", "-D__APPLE__", "-D__MACH__",
             "-Werror=implicit-function-declaration", "-I", str(tmp_path / "apple")]
    run = build_and_run("aarch64-linux-gnu-gcc", flags, tmp_path / "test_native_macos", runner=["qemu-aarch64"])
    assert check_output(run) == (1, 1, 1), run.stdout
