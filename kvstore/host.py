"""What kvstore asks of the operating system where Linux and macOS differ, chosen in one place.

Each call has one function per platform and the one this process uses is
picked once, here, at import; the others stay importable so that tests on
one platform run the other's branch with the system call injected.

- prefetch: ask the kernel to start reading a file's range in the
  background (POSIX_FADV_WILLNEED on Linux; F_RDADVISE on macOS, which has
  no posix_fadvise).  A chain load asks it for the blocks ahead of its reads:
  on a cold disk the reads then find a deep queue of the kernel's own
  requests instead of two threads' worth (kvstore.payload.chains).
"""

import os
import struct
import sys

MACOS = sys.platform == "darwin"

# <sys/fcntl.h> on macOS: fcntl(fd, F_RDADVISE, struct radvisory *).
F_RDADVISE = 44
# struct radvisory { off_t ra_offset; int ra_count; }: 16 bytes on 64-bit macOS.
RADVISORY = struct.Struct("=qi4x")
# ra_count is an int: a longer range is asked for in parts of this size.
RDADVISE_MAX = 1 << 30


def prefetch_posix(fd, offset, length):
    """posix_fadvise(WILLNEED) of [offset, offset + length); True when asked."""
    try:
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_WILLNEED)
    except OSError:
        return False
    return True


def prefetch_macos(fd, offset, length, fcntl_call=None):
    """fcntl(F_RDADVISE) of [offset, offset + length), in parts of at most
    RDADVISE_MAX bytes; True when every part was asked for.

    Args:
        fcntl_call: the fcntl function (fcntl.fcntl; tests inject their own).
    """
    if fcntl_call is None:
        import fcntl
        fcntl_call = fcntl.fcntl
    end = offset + length
    try:
        while offset < end:
            n = min(end - offset, RDADVISE_MAX)
            fcntl_call(fd, F_RDADVISE, RADVISORY.pack(offset, n))
            offset += n
    except OSError:
        return False
    return True


def prefetch_none(fd, offset, length):
    """No way to ask: the reads alone fetch the data."""
    return False


def _choose_prefetch():
    if hasattr(os, "posix_fadvise") and hasattr(os, "POSIX_FADV_WILLNEED"):
        return prefetch_posix
    if MACOS:
        return prefetch_macos
    return prefetch_none


_prefetch = _choose_prefetch()


def prefetch(fd, offset, length):
    """Asks the kernel to read [offset, offset + length) of fd in the
    background, without waiting for it; False where nothing was asked (no
    way to on this platform, or the call failed: the reads fetch the data
    themselves)."""
    if length <= 0:
        return False
    return _prefetch(fd, offset, length)
