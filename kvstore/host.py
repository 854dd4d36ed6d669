"""What kvstore asks of the operating system where Linux and macOS differ, chosen in one place.

Each call has one function per platform, and the one this process uses is
picked once, here, at import (``_choose``); the others stay importable, so
that tests on one platform run the other's branch with its system call
injected.

- prefetch: have a file's range read into the page cache in the
  background: on Linux by reading it through (sendfile to /dev/null) on
  four threads of its own (ReadThrough: POSIX_FADV_WILLNEED would leave it
  in 4 KiB pages, slower to copy out of); F_RDADVISE on macOS, which has
  no posix_fadvise; POSIX_FADV_WILLNEED on other POSIX systems.  A chain
  load asks for the blocks ahead of its reads: on a cold disk the reads
  then find a deep queue of the kernel's own requests instead of two
  threads' worth (kvstore.payload.chains).  cached says
  whether a file's page is in the page cache already (a one-byte preadv
  with RWF_NOWAIT on Linux; macOS cannot say), so that a warm load does not
  pay for asking.
- lower_thread_priority: let the calling thread yield the CPU to decoding:
  a thread's own niceness on Linux (a thread is a task there); on macOS,
  where niceness is the process's, the utility QoS class
  (pthread_set_qos_class_self_np), Apple's class for work a user waits on
  without watching it.  The background class is not used: it also throttles
  the thread's disk I/O, and a load is what a request waits for.
- boot_time: /proc/stat's btime on Linux; sysctlbyname("kern.boottime") on
  macOS (no process started, nothing on PATH needed).
- preallocate: a new file's blocks in one call before it is written
  (fallocate on Linux, in csrc/io.c; F_PREALLOCATE and ftruncate on macOS),
  so that a full disk fails the save before any data is written.
- default_cache_root: where kvstore serve keeps checkpoints by default:
  ~/.cache/kvstore on Linux; on macOS
  ~/Library/Caches/kvstore, the platform's cache folder, which Time Machine
  does not back up (multi-GB checkpoints would fill its backups).
"""

import concurrent.futures
import errno
import os
import struct
import sys
import threading

from kvstore import _native
from kvstore.errors import CheckpointOSError
from kvstore.executors import LazyExecutor

MACOS = sys.platform == "darwin"
LINUX = sys.platform.startswith("linux")


# ---- prefetch -----------------------------------------------------------------------

# <sys/fcntl.h> on macOS: fcntl(fd, F_RDADVISE, struct radvisory *).
F_RDADVISE = 44
# struct radvisory { off_t ra_offset; int ra_count; }: 16 bytes on 64-bit macOS.
RADVISORY = struct.Struct("=qi4x")
# ra_count is an int: a longer range is asked for in parts of this size.
RDADVISE_MAX = 1 << 30


def _fcntl(fcntl_call):
    if fcntl_call is None:
        import fcntl
        fcntl_call = fcntl.fcntl
    return fcntl_call


def prefetch_posix(fd, offset, length):
    """posix_fadvise(WILLNEED) of [offset, offset + length); True when asked."""
    try:
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_WILLNEED)
    except OSError:
        return False
    return True


# On Linux a range is asked for by reading it, on READ_THROUGH_THREADS
# background threads, through sendfile to /dev/null: the kernel's own read
# path, which brings the pages in as large folios (and reads ahead of
# itself), without copying them anywhere.  POSIX_FADV_WILLNEED brings them
# in one 4 KiB page at a time (order-0 folios), and every later load copies
# out of the page cache slower for it: a warm load of Llama-3.1-8B at 33,768
# tokens (4.1 GiB) after a cold one took 1.76-1.82 s after WILLNEED,
# 1.02-1.08 s after the read-through, mlx-lm's 1.18-1.51 s (its reads bring
# large folios).  Each thread waits for its ask's reads, so the threads
# and the size of an ask (kvstore.payload.chains.PREFETCH_ASK) set how much
# the disk has queued: cold, Qwen3-32B's KV at 9,192 tokens (2.2 GiB) took
# 1.64-2.06 s with two threads asking 1 MiB each, 0.96-1.07 s with four
# asking 4 MiB, mlx-lm's 1.21-1.41 s; DeepSeek-V3's latent (0.6 GiB)
# 0.41-0.47, 0.30-0.32 and 0.38-0.41 s (bench/shapes.py's child load, this
# VM).  Each ask holds a dup of the file descriptor, so a load that closes
# its files first is safe.
READ_THROUGH_THREADS = 4


def _read_through(fd, offset, length, sendfile, null, fallback):
    """Reads [offset, offset + length) of fd into the page cache (sendfile to
    null); where the file system cannot, asks fallback instead.  Closes fd."""
    try:
        end = offset + length
        while offset < end:
            n = sendfile(null, fd, offset, end - offset)
            if n <= 0:
                break
            offset += n
    except OSError:
        fallback(fd, offset, end - offset)
    finally:
        os.close(fd)


class ReadThrough:
    """Asks for files' ranges by reading them through on background threads
    (Linux; see READ_THROUGH_THREADS).  Calls it like a prefetch function."""

    def __init__(self, threads=READ_THROUGH_THREADS, sendfile=None, fallback=None):
        """Args:
            sendfile: os.sendfile (tests inject their own).
            fallback: what asks for a range sendfile cannot read (prefetch_posix).
        """
        self.sendfile = os.sendfile if sendfile is None else sendfile
        self.fallback = prefetch_posix if fallback is None else fallback
        self.nice = 0
        self._null = None
        self._null_lock = threading.Lock()          # asks come from several I/O threads
        self._pool = LazyExecutor(lambda: concurrent.futures.ThreadPoolExecutor(
            threads, thread_name_prefix="kvstore-readahead", initializer=lower_thread_priority,
            initargs=(self.nice,)))

    def set_nice(self, nice):
        """Runs the threads at niceness nice (lower_thread_priority) from the
        next ask on; threads already started finish their asks and end."""
        self.nice = nice
        old = self._pool.take()
        if old is not None:
            old.shutdown(wait=False)

    def __call__(self, fd, offset, length):
        """Queues [offset, offset + length) of fd; True when queued."""
        try:
            if self._null is None:
                with self._null_lock:
                    if self._null is None:
                        self._null = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
            own = os.dup(fd)
        except OSError:
            return self.fallback(fd, offset, length)
        try:
            self._pool.get().submit(_read_through, own, offset, length, self.sendfile, self._null, self.fallback)
        except RuntimeError:                    # the interpreter is shutting down
            os.close(own)
            return False
        return True


# An ask no longer than the device's read-ahead window is read by the
# kernel as a read-ahead of its own: in window-sized steps, one after the
# other, and several threads' asks within one file share one read-ahead
# state (some then come in 4 KiB pages).  An ask past the window is read
# whole, in parallel requests.  Cold, Llama-3.3-70B's KV at 9,192 tokens
# (2.8 GiB, 36 files) on a disk with an 8 MiB window: asks of 4 MiB
# 1.68-2.70 s (median 1.98 of 6), of 16 MiB 1.47-2.62 s (1.60 of 12),
# mlx-lm's 1.79-1.94 s (1.83); gpt-oss-20b's at 33,768 tokens 0.47 against
# 0.62 s, DeepSeek-V3's latent at 9,192 the same (bench/shapes.py's child
# load, this VM, an Intel Xeon; `dd` reads mlx-lm's file at 2.0 GB/s).
_read_ahead_of = {}


def read_ahead_bytes_linux(fd):
    """The read-ahead window of the device under fd's file (sysfs), or None."""
    try:
        dev = os.fstat(fd).st_dev
    except OSError:
        return None
    if dev not in _read_ahead_of:
        found = None
        name = f"{os.major(dev)}:{os.minor(dev)}"
        for path in (f"/sys/class/bdi/{name}/read_ahead_kb", f"/sys/dev/block/{name}/queue/read_ahead_kb",
                     f"/sys/dev/block/{name}/../queue/read_ahead_kb"):     # a partition: its disk's
            try:
                with open(path) as f:
                    found = int(f.read()) * 1024
                break
            except (OSError, ValueError):
                continue
        _read_ahead_of[dev] = found
    return _read_ahead_of[dev]


def read_ahead_bytes_unknown(fd):
    return None


def prefetch_ask(fd, least):
    """How many bytes one prefetch() ask of fd's file should cover: least,
    or twice the device's read-ahead window where that is known and more
    (see above)."""
    window = _read_ahead_bytes(fd)
    return max(least, 2 * window) if window else least


def set_prefetch_priority(nice):
    """Runs this platform's prefetch threads, where it has any (Linux's
    ReadThrough), at niceness nice, as the payload's I/O threads run."""
    if isinstance(_prefetch, ReadThrough):
        _prefetch.set_nice(nice)


def prefetch_macos(fd, offset, length, fcntl_call=None):
    """fcntl(F_RDADVISE) of [offset, offset + length), in parts of at most
    RDADVISE_MAX bytes; True when every part was asked for.

    Args:
        fcntl_call: the fcntl function (fcntl.fcntl; tests inject their own).
    """
    fcntl_call = _fcntl(fcntl_call)
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


def cached_linux(fd, offset):
    """Whether the byte at offset of fd is in the page cache: a one-byte
    preadv with RWF_NOWAIT, which fails with EAGAIN rather than wait for
    the disk; None where the filesystem cannot say."""
    try:
        return os.preadv(fd, [bytearray(1)], offset, os.RWF_NOWAIT) == 1
    except BlockingIOError:
        return False
    except OSError:
        return None


def cached_unknown(fd, offset):
    return None


def cached(fd, offset):
    """True when the page holding byte offset of fd is in the page cache,
    False when it is not, None where this platform cannot tell.  A reader
    asks for a file ahead (prefetch) only when it is not cached already:
    asking walks every page of the range, a cost a warm load would pay for
    nothing."""
    return _cached(fd, offset)


def prefetch(fd, offset, length):
    """Asks the kernel to read [offset, offset + length) of fd in the
    background, without waiting for it; False where nothing was asked (no
    way to on this platform, or the call failed: the reads fetch the data
    themselves)."""
    if length <= 0:
        return False
    return _prefetch(fd, offset, length)


def prefetch_parts(fd, lo, hi, part):
    """prefetch() of [lo, hi) in asks of at most part bytes, in order,
    stopping at the first one refused (what one refused, the rest would be
    too: the reads fetch the data themselves).  True when every part was
    asked for."""
    for at in range(lo, hi, part):
        if not prefetch(fd, at, min(part, hi - at)):
            return False
    return True


# ---- thread priority ------------------------------------------------------------------

# <sys/qos.h>: qos_class_t values.
QOS_CLASS_UTILITY = 0x11


def lower_priority_linux(nice, setpriority=None):
    """Gives the calling thread niceness nice (setpriority on its thread id); True when it took."""
    setpriority = os.setpriority if setpriority is None else setpriority
    try:
        setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except OSError:
        return False
    return True


def lower_priority_macos(nice, qos_call=None):
    """Puts the calling thread in the utility QoS class; True when it took.

    Args:
        qos_call: pthread_set_qos_class_self_np(qos_class, relative_priority)
            -> 0 on success (libSystem's, through ctypes; tests inject their own).
    """
    if qos_call is None:
        import ctypes
        import ctypes.util
        try:
            qos_call = ctypes.CDLL(ctypes.util.find_library("c")).pthread_set_qos_class_self_np
        except (OSError, AttributeError, TypeError):
            return False
    return qos_call(QOS_CLASS_UTILITY, 0) == 0


def lower_priority_none(nice):
    return False


def lower_thread_priority(nice):
    """Lets the calling thread yield the CPU to the process's other work.

    Args:
        nice: 0-19 (higher yields more); 0 changes nothing.  On macOS any
            nice above 0 means the utility QoS class.

    Returns:
        True when the thread's priority is now lowered.
    """
    if nice <= 0:
        return False
    return _lower_priority(nice)


# ---- boot time ------------------------------------------------------------------------

# struct timeval { time_t tv_sec; suseconds_t tv_usec; }: 16 bytes on 64-bit macOS.
TIMEVAL = struct.Struct("=qi4x")


def boot_time_linux(path="/proc/stat"):
    """btime from /proc/stat, or 0.0 where it cannot be read."""
    try:
        with open(path, "rb") as f:
            for line in f:
                if line.startswith(b"btime "):
                    return float(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0.0


def boot_time_macos(sysctlbyname=None):
    """kern.boottime through sysctlbyname, or 0.0 where it cannot be read.

    Args:
        sysctlbyname: libSystem's (through ctypes; tests inject their own),
            called as (name, buffer, size pointer, None, 0) -> 0 on success.
    """
    import ctypes
    if sysctlbyname is None:
        import ctypes.util
        try:
            sysctlbyname = ctypes.CDLL(ctypes.util.find_library("c")).sysctlbyname
        except (OSError, AttributeError, TypeError):
            return 0.0
    buf = ctypes.create_string_buffer(TIMEVAL.size)
    size = ctypes.c_size_t(TIMEVAL.size)
    if sysctlbyname(b"kern.boottime", buf, ctypes.byref(size), None, ctypes.c_size_t(0)) != 0 \
            or size.value < TIMEVAL.size:
        return 0.0
    sec, usec = TIMEVAL.unpack(buf.raw)
    return sec + usec / 1e6


def boot_time_none():
    return 0.0


def boot_time():
    """When this machine booted (seconds since the epoch), or 0.0 where unknown."""
    return _boot_time()


# ---- preallocation ------------------------------------------------------------------

# <sys/fcntl.h> on macOS: fcntl(fd, F_PREALLOCATE, fstore_t *).
F_PREALLOCATE = 42
F_ALLOCATECONTIG, F_ALLOCATEALL = 0x2, 0x4
F_PEOFPOSMODE = 3
# fstore_t { u_int32_t fst_flags; int fst_posmode; off_t fst_offset; off_t fst_length; off_t fst_bytesalloc; }
FSTORE = struct.Struct("=Iiqqq")
# Errors that mean "this filesystem or file cannot", not "no room".
NO_PREALLOCATE = frozenset(getattr(errno, n) for n in ("EOPNOTSUPP", "ENOTSUP", "ENOSYS", "EINVAL", "ENODEV",
                                                       "EPERM", "ESPIPE", "ENOTTY") if hasattr(errno, n))


def preallocate_linux(fd, length, path=None):
    """fallocate (csrc/io.c); see preallocate."""
    return _native.preallocate(fd, length, path)


def preallocate_macos(fd, length, path=None, fcntl_call=None, ftruncate=None):
    """F_PREALLOCATE (contiguous first, then anywhere), then ftruncate to
    length; see preallocate.

    Args:
        fcntl_call, ftruncate: fcntl.fcntl and os.ftruncate (tests inject their own).
    """
    fcntl_call = _fcntl(fcntl_call)
    ftruncate = os.ftruncate if ftruncate is None else ftruncate
    if length <= 0:
        return True
    try:
        try:
            fcntl_call(fd, F_PREALLOCATE, FSTORE.pack(F_ALLOCATECONTIG | F_ALLOCATEALL, F_PEOFPOSMODE, 0, length, 0))
        except OSError:
            fcntl_call(fd, F_PREALLOCATE, FSTORE.pack(F_ALLOCATEALL, F_PEOFPOSMODE, 0, length, 0))
        ftruncate(fd, length)
    except OSError as e:
        if e.errno in NO_PREALLOCATE:
            return False
        raise CheckpointOSError(e.errno, f"preallocate: {os.strerror(e.errno)}",
                                path if path is not None else f"fd {fd}") from None
    return True


def preallocate_none(fd, length, path=None):
    return False


def preallocate(fd, length, path=None):
    """Allocates a new file's first length bytes and sets its size.

    Returns:
        True when allocated, False where the filesystem or platform cannot
        (the writes then allocate as they go).

    Raises:
        CheckpointOSError: no room (ENOSPC, EDQUOT, EFBIG) or an I/O error.
    """
    return _preallocate(fd, length, path)


# ---- the default cache folder -----------------------------------------------------------

def cache_root_linux():
    return os.path.join("~", ".cache", "kvstore")


def cache_root_macos():
    return os.path.join("~", "Library", "Caches", "kvstore")


def default_cache_root():
    """The folder kvstore keeps checkpoints in by default (with ~ not yet expanded)."""
    return _cache_root()


# ---- the choice, made once ------------------------------------------------------------

def _choose(macos=MACOS, linux=LINUX):
    """{call: the function this platform uses}: macOS's, Linux's (or, for
    prefetch, any POSIX system's with posix_fadvise), or the fallback."""
    has_fadvise = hasattr(os, "posix_fadvise") and hasattr(os, "POSIX_FADV_WILLNEED")
    return {
        "prefetch": prefetch_macos if macos else ReadThrough() if linux and hasattr(os, "sendfile") else
        prefetch_posix if has_fadvise else prefetch_none,
        "cached": cached_linux if linux and hasattr(os, "RWF_NOWAIT") else cached_unknown,
        "read_ahead_bytes": read_ahead_bytes_linux if linux else read_ahead_bytes_unknown,
        "lower_priority": lower_priority_macos if macos else
        lower_priority_linux if linux and hasattr(os, "setpriority") else lower_priority_none,
        "boot_time": boot_time_macos if macos else boot_time_linux if linux else boot_time_none,
        "preallocate": preallocate_macos if macos else preallocate_linux if linux else preallocate_none,
        "cache_root": cache_root_macos if macos else cache_root_linux,
    }


_chosen = _choose()
_prefetch = _chosen["prefetch"]
_cached = _chosen["cached"]
_read_ahead_bytes = _chosen["read_ahead_bytes"]
_lower_priority = _chosen["lower_priority"]
_boot_time = _chosen["boot_time"]
_preallocate = _chosen["preallocate"]
_cache_root = _chosen["cache_root"]
