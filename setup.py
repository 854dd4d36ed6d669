"""Build of kvstore's one compiled module, kvstore._native (Cython over csrc/).

There is no pure-Python fallback: a failed compile fails the install with the
compiler's message.  Optimisation flags come from KVSTORE_OPT_CFLAGS
(default -O2), e.g. KVSTORE_OPT_CFLAGS="-O0 -g" for a debug build.
"""

import os
import platform
import shlex

from Cython.Build import cythonize
from setuptools import Extension, setup

CSRC = ["csrc/dispatch.c", "csrc/cpu.c", "csrc/sha1.c", "csrc/crc32c.c",
        "csrc/header.c", "csrc/io.c", "csrc/planes.c", "csrc/quant.c",
        "csrc/table.c", "csrc/packed.c"]

opt_flags = shlex.split(os.environ.get("KVSTORE_OPT_CFLAGS", "-O2"))
extra = ["-std=gnu11", "-Wall", "-Wno-unused-function"]
if platform.machine().lower() in ("arm64", "aarch64") and platform.system() == "Linux":
    # The ARMv8 SHA1/CRC paths are compiled only for a target with the
    # extensions (Apple's compiler enables them by default).  The compiler
    # emits those instructions only where the intrinsics ask for them, and
    # csrc/cpu.c asks the CPU at run time before choosing that path, so a
    # core without them still runs the portable code.
    extra.append("-march=armv8-a+crc+crypto")

if platform.system() == "Darwin" and not os.environ.get("MACOSX_DEPLOYMENT_TARGET"):
    # preadv() (csrc/io.c) is macOS 11's; MLX itself needs macOS 14.  A
    # python.org build would otherwise target 10.9 and take the slower path.
    os.environ["MACOSX_DEPLOYMENT_TARGET"] = "11.0"

ext = Extension(
    "kvstore._native",
    sources=["kvstore/_native.pyx"] + CSRC,
    include_dirs=["csrc"],
    extra_compile_args=extra + opt_flags,
    depends=[p.replace(".c", ".h") for p in CSRC] + ["kvstore/_native.pxd", "kvstore/_native_forms.pxi",
                                                   "kvstore/_native_lookup.pxi"],
)

setup(
    ext_modules=cythonize([ext], language_level=3,
                          compiler_directives={"embedsignature": True}),
)
