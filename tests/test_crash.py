"""Crash safety (docs/semantics.md §6 and §11): writer processes killed with SIGKILL.

A child process saves 50 MB checkpoints (durable=True) in a loop and reports
each one through a pipe before (``begin``) and after (``done``) save()
returns.  The parent kills it at a random moment, chosen three ways in turn:
a delay drawn from the measured save duration, the moment the child is seen
inside fsync(), and the moment it leaves fsync() (rename, directory fsync).
Where each kill landed (the system call the child was in) is counted.

After every kill a new KVStore on the directory must see only complete,
CRC-valid checkpoints; every checkpoint reported done must still be there and
load with the tensors it was saved with (the data depends on a seed kept in
the manifest's meta); the one save that was in flight is either absent or
complete; temporary files are gone after the open (and were 0600, even under
umask 0).  The writer also replaces files (an incompatible save under the
same name, via rename) and retitles them (a compatible save whose trailer is
rewritten in place), so kills land in those paths too.

The second test kills a process that updates headers in place (load's hit
count, touch, a trailer rewrite, a session promotion): the header always
parses, the file always verifies and loads.  test_touch.py kills bare touch()
calls; this is the same through the store.
"""

import collections
import functools
import os
import platform
import random
import signal
import stat
import time

import numpy as np
import pytest

import kvstore
from kvstore import KVStore
from kvstore.format import Reason
from kvstore.files import verify_file
from kvhelpers import CTX, OPTS, make_tensors

MB = 1 << 20
CKPT_BYTES = 50 * MB
CTX_SIZE = 8192
KEEP_FILES = 3               # the parent deletes older checkpoints: disk use stays ~200 MB

# The system call a thread is in, from /proc/<pid>/task/<tid>/syscall.
_SYSCALLS = {
    "x86_64": {0: "read", 1: "write", 3: "close", 5: "fstat", 9: "mmap", 11: "munmap", 17: "pread64",
               18: "pwrite64", 73: "flock", 74: "fsync", 75: "fdatasync", 77: "ftruncate", 82: "rename",
               87: "unlink", 202: "futex", 217: "getdents64", 257: "openat", 262: "newfstatat",
               264: "renameat", 316: "renameat2", 28: "madvise", 285: "fallocate"},
    "aarch64": {63: "read", 64: "write", 57: "close", 80: "fstat", 222: "mmap", 215: "munmap",
                67: "pread64", 68: "pwrite64", 32: "flock", 82: "fsync", 83: "fdatasync", 46: "ftruncate",
                38: "renameat", 276: "renameat2", 35: "unlinkat", 98: "futex", 61: "getdents64",
                56: "openat", 233: "madvise", 47: "fallocate"},
}.get(platform.machine(), {})


def syscalls(pid):
    """(name, first argument) of the system call each thread of pid is in;
    ('running', None) for a thread on a CPU."""
    out = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/syscall") as f:
                words = f.read().split()
        except OSError:
            continue
        if not words or not words[0].lstrip("-").isdigit():
            out.append((words[0] if words else "?", None))
        elif int(words[0]) >= 0:
            out.append((_SYSCALLS.get(int(words[0]), f"sys_{words[0]}"),
                        int(words[1], 16) if len(words) > 1 else None))
    return out


def in_fsync(pid, fd=None):
    """The descriptor a thread of pid is fsync()ing (fd: that one only), or None."""
    for name, arg in syscalls(pid):
        if name in ("fsync", "fdatasync") and (fd is None or arg == fd):
            return arg
    return None


def fs_type(path):
    """The file system type of the mount holding path (Linux), or ""."""
    best, kind = "", ""
    try:
        with open("/proc/mounts") as f:
            for line in f:
                _, mnt, typ = line.split()[:3]
                if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                    best, kind = mnt, typ
    except OSError:
        pass
    return kind


def base_array(nbytes):
    """The 50 MB every checkpoint's data is derived from (shared by fork, never copied)."""
    n = nbytes // 4
    return (np.arange(n, dtype=np.uint32) * np.uint32(2654435761)).reshape(64, n // 64)


def tensors_for(base, seed):
    half = base.shape[1] // 2
    data = base ^ np.uint32(seed)
    return {"k": data[:, :half], "v": data[:, half:], "seed": np.array([seed], np.uint32)}


def tokens_for(seed):
    return (np.arange(256, dtype=np.uint32) * 7 + seed) % 50000


def check_loaded(ck, base, text, seeds):
    """ck holds text and the data of one of seeds; returns that seed."""
    assert ck is not None
    assert ck.text_bytes == text.encode()
    seed = ck.meta["seed"]
    assert seed in seeds, (seed, seeds)
    want = tensors_for(base, seed)
    for k, v in want.items():
        assert np.array_equal(ck.tensors[k], v), k
    assert np.array_equal(ck.tokens, tokens_for(seed))
    return seed


# ---- the writer ----------------------------------------------------------------------

def _writer(d, progress, base, plan):
    """Saves the checkpoints in plan until killed; reports begin/done lines
    appended to the file at progress (a write done survives the kill; a file,
    not a pipe, so that a spawned child has it too)."""
    os.umask(0)                      # the store's modes must not depend on it
    w = os.open(progress, os.O_WRONLY | os.O_APPEND)
    store = KVStore(d, budget_mb=0, **OPTS, durable=True)
    for i, (kind, name, text, seed, ctx, title) in enumerate(plan):
        os.write(w, f"begin {i}\n".encode())
        trailers = {3: title} if title else None
        e = store.save(text, tokens_for(seed), tensors_for(base, seed), meta={"seed": seed},
                       ctx_size=ctx, trailers=trailers)
        assert e is not None and e.name == name
        os.write(w, f"done {i}\n".encode())
    while True:
        time.sleep(1)


def read_progress(path):
    """The writer's lines so far."""
    with open(path, "rb") as f:
        return f.read()


def wait_for(pred, timeout, step=0.0002):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(step)
    return False


class Rounds:
    """The parent's view: which checkpoints exist, with which data, and the counts."""

    def __init__(self, d, base, rng, save_s):
        self.d, self.base, self.rng, self.save_s = d, base, rng, save_s
        self.known = collections.OrderedDict()   # name -> (text, seed, ctx) of completed saves
        self.counter = 0
        self.stats = collections.Counter()
        self.landed = collections.Counter()

    def plan(self, n=20):
        """The next saves a writer will attempt: mostly new texts, some replacements and retitles.

        Each is (kind, name, text, seed, ctx, title); ``seed`` is the data the
        file holds once that save is done.
        """
        state = dict(self.known)
        out = []
        for _ in range(n):
            self.counter += 1
            r = self.rng.random()
            if state and r < 0.2:
                name = self.rng.choice(sorted(state))
                text, _, ctx = state[name]
                # A smaller context than the stored one: incompatible, replaced by rename.
                out.append(("replace", name, text, self.counter, max(16, ctx // 2), None))
            elif state and r < 0.3:
                name = self.rng.choice(sorted(state))
                text, seed, ctx = state[name]
                # Same context: compatible, kept; only the trailer is rewritten in place.
                out.append(("retitle", name, text, seed, ctx, f"title {self.counter}"))
            else:
                text = f"crash test checkpoint {self.counter}: " + "x" * (self.counter % 300)
                name = kvstore.format.sha1(text.encode()).hex() + ".kv"
                out.append(("new", name, text, self.counter, CTX_SIZE, None))
            kind, name, text, seed, ctx, _ = out[-1]
            state[name] = (text, seed, ctx)
        return out

    def one(self, strategy):
        plan = self.plan()
        progress = f"{self.d}.progress"
        with open(progress, "wb"):
            pass
        p = CTX.Process(target=_writer, args=(self.d, progress, self.base, plan), daemon=True)
        p.start()
        try:
            self._kill_when(p, progress, strategy)
        finally:
            os.kill(p.pid, signal.SIGKILL)
            p.join(30)
            lines = read_progress(progress).decode().splitlines()
        assert p.exitcode == -signal.SIGKILL, (p.exitcode, lines[-3:])
        self.stats["kills"] += 1
        self.check(plan, lines)

    def _done_seen(self, progress):
        return b"done " in read_progress(progress)

    def _kill_when(self, p, progress, strategy):
        """Kills p at a moment chosen by strategy; counts the system call it was in.

        delay: a random delay from the start, up to about one save;
        second_save: a random delay after the first save is done;
        fsync: the moment a thread is seen inside fsync();
        after_fsync: the moment the first file fsync() ends (rename, the
        directory's fsync, what follows).
        """
        if strategy == "second_save" and not wait_for(lambda: self._done_seen(progress), 10 * self.save_s + 10):
            raise AssertionError("the writer never finished a save")
        if strategy in ("delay", "second_save") or not _SYSCALLS:
            time.sleep(self.rng.uniform(0, 1.2 * self.save_s) + 0.005)
        # On a file system whose fsync returns at once (tmpfs) it is never
        # seen: the kill then comes at a random moment after all.
        elif wait_for(lambda: in_fsync(p.pid) is not None, 3 * self.save_s + 0.2):
            fd = in_fsync(p.pid)
            if strategy == "after_fsync" and fd is not None:
                wait_for(lambda: in_fsync(p.pid, fd) is None, 10, step=0)
        calls = syscalls(p.pid)
        os.kill(p.pid, signal.SIGKILL)
        self.landed[_where([name for name, _ in calls])] += 1

    def check(self, plan, lines):
        d = self.d
        assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
        for n in os.listdir(d):
            if ".tmp." in n:
                self.stats["tmp_left_by_kill"] += 1
                assert stat.S_IMODE(os.stat(os.path.join(d, n)).st_mode) == 0o600, n
        done = [int(ln.split()[1]) for ln in lines if ln.startswith("done ")]
        begun = [int(ln.split()[1]) for ln in lines if ln.startswith("begin ")]
        for i in done:
            kind, name, text, seed, ctx, _ = plan[i]
            self.known[name] = (text, seed, ctx)
            self.known.move_to_end(name)
            self.stats["saves_" + kind] += 1
        in_flight = plan[begun[-1]] if len(begun) > len(done) else None
        if in_flight is not None:
            self.stats["killed_in_" + in_flight[0]] += 1
        with KVStore(d, budget_mb=0, **OPTS, durable=True) as s:
            left = [n for n in os.listdir(d) if ".tmp." in n]
            assert left == [], left                       # removed on open: the writer is dead
            names = set(n for n in os.listdir(d) if n.endswith(".kv"))
            assert names == set(e.name for e in s.entries()), "a visible .kv is not a valid envelope"
            missing = set(self.known) - names
            assert not missing, f"completed checkpoints lost: {missing}"
            extra = names - set(self.known)
            assert extra <= ({in_flight[1]} if in_flight is not None else set()), extra
            for n in names:
                assert verify_file(os.path.join(d, n)) is None, n
            # Full loads: what the kill may have touched, the last completed
            # save, and now and then one other at random (verify_file above
            # already checked every CRC of every file).
            to_load = {self.rng.choice(sorted(names))} if names and self.rng.random() < 0.2 else set()
            if in_flight is not None and in_flight[1] in names:
                to_load.add(in_flight[1])
            if done:
                to_load.add(plan[done[-1]][1])
            for n in sorted(to_load):
                # The data it may hold: the last completed save's, or the
                # interrupted one's if the kill came after its rename.
                seeds = set()
                if n in self.known:
                    text, seed, _ = self.known[n]
                    seeds.add(seed)
                if in_flight is not None and in_flight[1] == n:
                    _, _, text, seed, _, _ = in_flight
                    seeds.add(seed)
                ck = s.load(s.find(text + " and more"))
                got = check_loaded(ck, self.base, text, seeds)
                if n not in self.known or got != self.known[n][1]:
                    self.stats["interrupted_save_visible"] += 1
                self.known[n] = (text, got, ck.entry.ctx_size)
                self.stats["loads"] += 1
            self.stats["files_checked"] += len(names)
            while len(self.known) > KEEP_FILES:
                old, _ = self.known.popitem(last=False)
                os.unlink(os.path.join(d, old))


def _where(calls):
    """The most telling system call among a process's threads at the kill."""
    for name in ("fsync", "fdatasync", "rename", "renameat", "renameat2", "pwrite64", "write", "ftruncate",
                 "fallocate", "openat", "unlink", "pread64", "read", "flock", "getdents64", "mmap", "munmap"):
        if name in calls:
            return name
    return calls[0] if calls else "?"


def measure_save(d, base):
    with KVStore(d, budget_mb=0, **OPTS, durable=True) as s:
        times = []
        for seed in (10**6, 10**6 + 1, 10**6 + 2):
            t0 = time.perf_counter()
            e = s.save(f"calibration {seed}", tokens_for(seed), tensors_for(base, seed), meta={"seed": seed})
            times.append(time.perf_counter() - t0)
            os.unlink(e.path)
    return sorted(times)[1]


def run_kills(tmp_path, kills, seed):
    base = base_array(CKPT_BYTES)
    d = str(tmp_path / "kv")
    save_s = measure_save(d, base)
    rounds = Rounds(d, base, random.Random(seed), save_s)
    strategies = ["delay", "second_save", "fsync", "after_fsync"]
    t0 = time.monotonic()
    for i in range(kills):
        rounds.one(strategies[i % len(strategies)])
    dt = time.monotonic() - t0
    print(f"\ncrash: kills={rounds.stats['kills']} save_ms={save_s * 1e3:.0f} seconds={dt:.1f} "
          f"landed={dict(rounds.landed)} stats={dict(rounds.stats)} files_lost=0")
    return rounds


def test_sigkill_during_saves_loses_nothing(tmp_path):
    rounds = run_kills(tmp_path, kills=100, seed=6)
    assert rounds.stats["kills"] >= 100
    # The kills did land inside fsync (where the system call can be seen and
    # fsync takes time: not on a tmpfs).
    if _SYSCALLS and fs_type(str(tmp_path)) not in ("tmpfs", "ramfs"):
        assert rounds.landed["fsync"] + rounds.landed["fdatasync"] > 0, rounds.landed
    assert rounds.stats["saves_new"] > 0 and rounds.stats["tmp_left_by_kill"] > 0


@pytest.mark.soak
def test_soak_sigkill_during_saves(tmp_path):
    rounds = run_kills(tmp_path, kills=1000, seed=66)
    assert rounds.stats["kills"] == 1000


# ---- in-place updates --------------------------------------------------------------

SMALL_TEXT = "an agent session whose header is updated in place"


# small_tensors(): k, (8, 512) float16, always the same.
small_tensors = functools.partial(make_tensors, 512, 3, shape=(8, "n"), dtypes=("float16",), names=("k",))


def _updater(d, counter):
    store = KVStore(d, **OPTS, durable=False)
    i = 0
    while True:
        i += 1
        e = store.find(SMALL_TEXT + "?")
        step = i % 4
        if step == 0:
            store.load(e, min_tokens=1, consume=False)                  # touch inside
        elif step == 1:
            kvstore.format.touch(e.path)
        elif step == 2:
            # Compatible: kept, its trailer rewritten in place (lengths vary).
            store.save(SMALL_TEXT, [1, 2, 3], small_tensors(), trailers={3: "t" * (i % 97)})
        else:
            store.save(SMALL_TEXT, [1, 2, 3], small_tensors(), reason=Reason.AGENT_SESSION)
        counter.value = i


def run_header_kills(tmp_path, kills, seed):
    rng = random.Random(seed)
    d = str(tmp_path / "kv")
    with KVStore(d, **OPTS, durable=False) as s:
        e = s.save(SMALL_TEXT, [1, 2, 3], small_tensors(), trailers={3: "first"})
    hits = 0
    for _ in range(kills):
        counter = CTX.RawValue("q", 0)
        p = CTX.Process(target=_updater, args=(d, counter), daemon=True)
        p.start()
        assert wait_for(lambda: counter.value >= rng.randrange(1, 8), 30)
        time.sleep(rng.uniform(0, 0.01))
        os.kill(p.pid, signal.SIGKILL)
        p.join(30)
        assert p.exitcode == -signal.SIGKILL
        cur = kvstore.format.read_entry(e.path)                      # the header parses
        assert cur.hits >= hits and cur.tokens == 3
        hits = cur.hits
        assert verify_file(e.path) is None
        with KVStore(d, **OPTS, durable=False) as s:
            ck = s.load(s.find(SMALL_TEXT + "!"), consume=False)
            assert ck is not None and np.array_equal(ck.tensors["k"], small_tensors()["k"])
            title = ck.trailers.get(3)
            assert title is None or title == "first" or set(title) <= {"t"}, title
            hits += 1                                          # this load's own hit
    return hits


def test_sigkill_during_in_place_header_updates(tmp_path):
    assert run_header_kills(tmp_path, kills=40, seed=5) >= 40


@pytest.mark.soak
def test_soak_sigkill_during_in_place_header_updates(tmp_path):
    assert run_header_kills(tmp_path, kills=500, seed=55) >= 500
