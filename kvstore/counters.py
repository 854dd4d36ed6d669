"""The directory's cumulative counters and its SSD write budget (docs/semantics.md §15).

KVStore.stats() counts what one process did since it opened the store.  The
numbers an operator wants (how much did this cache write today, how often
does it hit, how slow are loads) belong to the directory: every process that
uses it, across restarts.  They live in one small fixed-layout file,
``<dir>/.counters``:

    0   4 bytes   magic "KVCT"
    4   u16       version, 1
    6   u16       slot count
    8   u64[...]  one little-endian slot per name of SLOTS, in that order

SLOTS is append-only: a later build may add names at the end (and writes the
larger count); an older build reading a longer file keeps and writes only
the slots it knows, never the count.  A change is flock(LOCK_EX), one pread
and one pwrite of the header and slots, unlock; a read takes LOCK_SH.

The same file holds the write budget's token bucket (its level, the time of
its last refill and the capacity of the last process that used it), updated
under the same lock, so every process on the directory draws from one
bucket.  Which saves may draw is policy's (kvstore.policy.write_allowed);
the arithmetic of the bucket is here.

Counting is best-effort and never fails a caller: a file that cannot be
opened (a planted symlink, a read-only directory, not a regular file) makes
this process count in memory; a short or garbled file reads as zeros and the
next writer rewrites it; each problem is one log line.  The file is not a
checkpoint (its name does not match the checkpoint pattern, so scans, the
budget, eviction and wipe never see it) and holds no prompt text.
"""

import bisect
import errno
import fcntl
import logging
import math
import numbers
import os
import stat
import struct
import threading
import time

log = logging.getLogger("kvstore")

COUNTERS_NAME = ".counters"
MAGIC = b"KVCT"
VERSION = 1
HEAD = struct.Struct("<4sHH")          # magic, version, slot count
U64_MAX = 2**64 - 1

# The plain counters, all monotonic.
_FIRST_COUNTERS = ("saves", "bytes_written", "loads", "bytes_read", "hits", "misses", "evictions",
                   "bytes_evicted", "corrupt", "stores_skipped_write_budget")
# Counters added since (their slots follow the write budget's): restores the
# canary checked, and those it found made by another model or damaged
# (kvstore.mlx.canary, docs/semantics.md §17).
_LATER_COUNTERS = ("canary_checks", "canary_failures")
COUNTER_NAMES = _FIRST_COUNTERS + _LATER_COUNTERS

# Latency histograms: Prometheus's default buckets (prometheus_client's
# Histogram.DEFAULT_BUCKETS), so a scrape of them needs no re-bucketing.  The
# file keeps each bucket's own count (not cumulative: one slot changes per
# observation), then the count and the sum in microseconds.
HISTOGRAMS = ("load_seconds", "save_seconds")
BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, math.inf)


def histogram_slots(name):
    """The slot names of one histogram: a count per bucket, the count, the sum in µs."""
    return tuple(f"{name}_bucket_{i}" for i in range(len(BUCKETS))) + (f"{name}_count", f"{name}_sum_us")


# The write budget's token bucket: its level in bytes, the time of its last
# refill in µs since the epoch (0: never used, a new bucket starts full) and
# the capacity of the process that changed it last (so that `kvstore stats`,
# which has no budget of its own, can show it).
BUDGET_SLOTS = ("write_budget_level_bytes", "write_budget_refill_us", "write_budget_capacity_bytes")

# Append-only: never reorder, never remove; new names go at the end.
SLOTS = (_FIRST_COUNTERS + histogram_slots("load_seconds") + histogram_slots("save_seconds") + BUDGET_SLOTS
         + _LATER_COUNTERS)
INDEX = {name: i for i, name in enumerate(SLOTS)}
# name -> (slot of each bucket, of the count, of the sum)
_HISTOGRAM_INDEX = {h: ([INDEX[n] for n in histogram_slots(h)[:-2]], INDEX[f"{h}_count"], INDEX[f"{h}_sum_us"])
                    for h in HISTOGRAMS}
FILE_SIZE = HEAD.size + 8 * len(SLOTS)

# The write budget allows one hour's bytes at most (the bucket's capacity)
# and refills at that rate: a burst of a full hour's writes is allowed,
# the long-run rate is the budget.
BUDGET_WINDOW_S = 3600
_US_PER_WINDOW = BUDGET_WINDOW_S * 1_000_000

_SAFE = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0)

# The clock of the write budget, in seconds since the epoch (tests replace it).
clock = time.time


def _now_us():
    return max(0, int(clock() * 1_000_000))


# ---- the write budget's arithmetic ----------------------------------------------

def budget_capacity(mb_per_hour):
    """The write budget's capacity in bytes (one hour's allowance) for KVStore(max_write_mb_per_hour=).

    Args:
        mb_per_hour: MiB per hour, a finite number > 0; None for no budget.

    Returns:
        the capacity in bytes (>= 1), or None.

    Raises:
        ValueError: anything else (0, negative, NaN, infinite, not a number,
            or less than one byte an hour); the message shows the value.
    """
    if mb_per_hour is None:
        return None
    if isinstance(mb_per_hour, bool) or not isinstance(mb_per_hour, numbers.Real):
        raise ValueError(f"max_write_mb_per_hour={mb_per_hour!r} is not a number")
    if not (math.isfinite(mb_per_hour) and mb_per_hour > 0):
        raise ValueError(f"max_write_mb_per_hour={mb_per_hour!r} must be a finite number > 0")
    capacity = int(mb_per_hour * 1024 * 1024)
    if not 1 <= capacity < 2**63:
        raise ValueError(f"max_write_mb_per_hour={mb_per_hour!r} is outside 1 byte .. 2**63 bytes an hour")
    return capacity


def refill(level, refilled_us, capacity, now_us):
    """The bucket after refilling it at capacity bytes per hour up to now.

    Args:
        level: the bytes in the bucket at refilled_us.
        refilled_us: when it was last refilled (µs since the epoch); 0 for a
            new bucket, which starts full.
        capacity: this process's capacity in bytes (the level is clamped to
            it: a process with a smaller budget sees at most its own).
        now_us: the time now, µs since the epoch.

    Returns:
        (level, refilled_us) now.  Only whole bytes are added, and the time
        stamp moves on only by the time they took, so frequent refills lose
        no fraction of a byte; a clock that went back refills nothing.
    """
    if refilled_us == 0:
        return capacity, now_us
    level = min(level, capacity)
    if now_us <= refilled_us:
        return level, now_us
    add = (now_us - refilled_us) * capacity // _US_PER_WINDOW
    if level + add >= capacity:
        return capacity, now_us
    return level + add, refilled_us + add * _US_PER_WINDOW // capacity


# ---- the file ---------------------------------------------------------------------

def _parse(raw):
    """(slots as a list of len(SLOTS) ints, the file's slot count, why it is bad or None)."""
    if not raw:
        return [0] * len(SLOTS), len(SLOTS), None
    if len(raw) < HEAD.size:
        return [0] * len(SLOTS), len(SLOTS), "truncated"
    magic, version, count = HEAD.unpack_from(raw)
    if magic != MAGIC or version != VERSION:
        return [0] * len(SLOTS), len(SLOTS), "bad_header"
    known = min(count, len(SLOTS))
    if len(raw) < HEAD.size + 8 * known:
        return [0] * len(SLOTS), len(SLOTS), "truncated"
    slots = list(struct.unpack_from(f"<{known}Q", raw, HEAD.size)) + [0] * (len(SLOTS) - known)
    # A newer build's longer file keeps its count (its slots past ours stay).
    return slots, max(count, len(SLOTS)), None


def _pack(slots, count):
    return HEAD.pack(MAGIC, VERSION, count) + struct.pack(f"<{len(SLOTS)}Q", *slots)


def _read_locked(fd):
    """The slots of the open file under a shared lock (zeros for a short or bad file)."""
    fcntl.flock(fd, fcntl.LOCK_SH)
    try:
        raw = os.pread(fd, FILE_SIZE, 0)
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
    return _parse(raw)[0]


def describe(slots, capacity=None, now_us=None):
    """The counters as KVStore.counters() returns them.

    Args:
        slots: a list of len(SLOTS) ints.
        capacity: the write budget's capacity to report (a store's own), or
            None for the one recorded in the file (None when none was).
        now_us: the time to refill the bucket to (default now).

    Returns:
        {counter name: int} for COUNTER_NAMES; for each histogram {"buckets":
        [[le, cumulative count], ...] (le a float, the last float("inf")),
        "count": n, "sum_s": seconds}; and "write_budget": None or
        {"capacity_bytes", "available_bytes", "rate_bytes_per_s"}.
    """
    out = {name: slots[INDEX[name]] for name in COUNTER_NAMES}
    for h in HISTOGRAMS:
        names = histogram_slots(h)
        run, buckets = 0, []
        for le, name in zip(BUCKETS, names):
            run += slots[INDEX[name]]
            buckets.append([float(le), run])
        out[h] = {"buckets": buckets, "count": slots[INDEX[names[-2]]], "sum_s": slots[INDEX[names[-1]]] / 1e6}
    cap = capacity or slots[INDEX["write_budget_capacity_bytes"]]
    if not cap:
        out["write_budget"] = None
    else:
        level, _ = refill(slots[INDEX["write_budget_level_bytes"]], slots[INDEX["write_budget_refill_us"]], cap,
                          _now_us() if now_us is None else now_us)
        out["write_budget"] = {"capacity_bytes": cap, "available_bytes": level,
                               "rate_bytes_per_s": cap / BUDGET_WINDOW_S}
    return out


def read_directory(directory):
    """A directory's counters, read without creating or changing anything (for `kvstore stats`).

    Returns:
        describe()'s dict: zeros when the directory has no counters file (or
        an unreadable one), the write budget as the file last recorded it.
    """
    try:
        fd = os.open(os.path.join(directory, COUNTERS_NAME), os.O_RDONLY | _SAFE)
    except OSError:
        return describe([0] * len(SLOTS))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return describe([0] * len(SLOTS))
        return describe(_read_locked(fd))
    except OSError:
        return describe([0] * len(SLOTS))
    finally:
        os.close(fd)


class DirectoryCounters:
    """The counters file of one directory, open for one store.

    Every method is safe from any thread and never raises for the file:
    when it cannot be used the counts of this process are kept in memory
    (one log line says so), so the write budget still holds within it.

    Args:
        directory: the store's directory (existing).
    """

    def __init__(self, directory):
        self.path = os.path.join(directory, COUNTERS_NAME)
        self._lock = threading.Lock()
        self._fd = None
        self._pid = None
        self._memory = None         # the slots, when the file cannot be used
        self._warned = set()
        self._closed = False
        with self._lock:
            self._open()

    # -- opening ----------------------------------------------------------------

    def _open(self):
        """Opens (creating if missing) the file; on failure counts in memory."""
        self._pid = os.getpid()
        try:
            self._fd = _open_or_create(self.path)
        except OSError as e:
            self._fd = None
            self._memory = [0] * len(SLOTS)
            self._warn("open", "kvstore: counters_unavailable errno=%s action=process_only file=%s",
                       errno.errorcode.get(e.errno, e.errno), COUNTERS_NAME)

    def _after_fork(self):
        """A forked child opens the file again: flock belongs to the open
        file, and one shared with the parent would let both hold the lock at
        once.  (Its lock is new too: another thread of the parent may have
        held the old one at the fork.)"""
        if self._pid != os.getpid():
            self._lock = threading.Lock()
            self._fd = None
            self._memory = None
            with self._lock:
                self._open()

    def _warn(self, what, msg, *args):
        if what not in self._warned:
            self._warned.add(what)
            log.warning(msg, *args)

    # -- changes ----------------------------------------------------------------

    def _update(self, change):
        """Applies change(slots) -> result to the slots, under the file's
        exclusive lock; returns its result (None if the file failed)."""
        if self._closed:
            return None
        self._after_fork()
        with self._lock:
            fd = self._fd
            if fd is None:
                return change(self._memory)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                try:
                    slots, count, bad = _parse(os.pread(fd, FILE_SIZE, 0))
                    if bad is not None:
                        log.warning("kvstore: counters_reset reason=%s file=%s", bad, COUNTERS_NAME)
                    result = change(slots)
                    os.pwrite(fd, _pack(slots, count), 0)
                finally:
                    fcntl.flock(fd, fcntl.LOCK_UN)
            except OSError as e:
                # Counting is best-effort: this change is lost, the caller's
                # save or load stands.
                self._warn("write", "kvstore: counters_failed errno=%s file=%s",
                           errno.errorcode.get(e.errno, e.errno), COUNTERS_NAME)
                return None
            return result

    def add(self, **deltas):
        """Adds to counters (COUNTER_NAMES) and observes histograms (HISTOGRAMS, in seconds).

        Example: ``add(saves=1, bytes_written=n, save_seconds=0.012)``.
        """
        steps = []
        for name, value in deltas.items():
            if name in _HISTOGRAM_INDEX:
                buckets, count, total = _HISTOGRAM_INDEX[name]
                seconds = max(0.0, float(value))
                steps += [(buckets[bisect.bisect_left(BUCKETS, seconds)], 1), (count, 1),
                          (total, int(round(seconds * 1e6)) if math.isfinite(seconds) else 0)]
            else:
                steps.append((INDEX[name], int(value)))

        def change(slots):
            for i, v in steps:
                slots[i] = min(U64_MAX, slots[i] + v)
        self._update(change)

    def take(self, nbytes, capacity, allow):
        """Takes nbytes from the write budget's bucket if allow(available) says so.

        Refill, decision and withdrawal happen under one lock, so two
        processes never spend the same bytes.

        Args:
            nbytes: the bytes a save is about to write.
            capacity: this process's capacity in bytes (budget_capacity()).
            allow: callable(available bytes) -> bool: the policy's decision.

        Returns:
            (taken, available bytes before the withdrawal).  When the file
            fails meanwhile the save goes ahead: (True, None).
        """
        now = _now_us()

        def change(slots):
            lv, ts = INDEX["write_budget_level_bytes"], INDEX["write_budget_refill_us"]
            level, slots[ts] = refill(slots[lv], slots[ts], capacity, now)
            ok = bool(allow(level))
            slots[lv] = level - nbytes if ok else level
            slots[INDEX["write_budget_capacity_bytes"]] = capacity
            return ok, level
        got = self._update(change)
        return (True, None) if got is None else got

    # -- reading ----------------------------------------------------------------

    def snapshot(self):
        """Every slot by name, now (zeros for a short or garbled file)."""
        if self._closed:
            return dict.fromkeys(SLOTS, 0)
        self._after_fork()
        with self._lock:
            fd = self._fd
            if fd is None:
                return dict(zip(SLOTS, self._memory))
            try:
                return dict(zip(SLOTS, _read_locked(fd)))
            except OSError as e:
                self._warn("read", "kvstore: counters_failed errno=%s file=%s",
                           errno.errorcode.get(e.errno, e.errno), COUNTERS_NAME)
                return dict.fromkeys(SLOTS, 0)

    def report(self, capacity=None):
        """describe() of the slots now; capacity: the store's write budget, if it has one."""
        snap = self.snapshot()
        return describe([snap[name] for name in SLOTS], capacity)

    def close(self):
        with self._lock:
            self._closed = True
            if self._fd is not None and self._pid == os.getpid():
                os.close(self._fd)
            self._fd = None

    def __del__(self):
        fd = getattr(self, "_fd", None)
        if fd is not None and getattr(self, "_pid", None) == os.getpid():
            try:
                os.close(fd)
            except OSError:
                pass


def _open_or_create(path):
    """The counters file opened read-write, created 0600 if missing; never
    through a symlink, never anything but a regular file (OSError)."""
    flags = os.O_RDWR | _SAFE
    for _ in range(3):
        try:
            fd = os.open(path, flags)
        except FileNotFoundError:
            try:
                # The creator writes nothing here: the first change writes
                # the header under the lock, and a reader of the empty file
                # meanwhile sees zeros.
                fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o600)
            except FileExistsError:
                continue                    # another process made it first: open that one
            try:
                os.fchmod(fd, 0o600)        # whatever the umask
            except OSError:
                os.close(fd)
                raise
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise OSError(errno.EINVAL, "not a regular file", path)
        except OSError:
            os.close(fd)
            raise
        return fd
    raise OSError(errno.EEXIST, "the counters file keeps changing", path)


__all__ = ["DirectoryCounters", "read_directory", "describe", "refill", "budget_capacity", "histogram_slots",
           "COUNTERS_NAME", "COUNTER_NAMES", "HISTOGRAMS", "BUCKETS", "SLOTS", "BUDGET_WINDOW_S", "FILE_SIZE"]
