"""Disk full (docs/semantics.md §6 and §11): a save that cannot be written fails
cleanly.  None comes back, exactly one log line says why, no partial file is
left (no .kv, no temporary), and the store goes on serving hits.

Two ways to fill a disk:
- RLIMIT_FSIZE, set in a subprocess (SIGXFSZ ignored, so writes past the
  limit fail with EFBIG instead of killing it).  The limit is swept across
  every stage of a save (header, text, payload header, manifest, each block,
  trailer, the final ftruncate): the save succeeds exactly when the file fits.
- A small tmpfs, mounted when running as root (skipped otherwise): the free
  space is swept the same way and writes fail with ENOSPC.
Both also grow a kept file's trailer in place past the limit: the file is
left byte for byte as it was.

test_faults.py checks the basic case (one too-big save and save_async in a
forked child); these extend it to every stage, the log-line count, the
kept-file path and a real file system.
"""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from kvhelpers import listing

# The child: one store, one existing checkpoint to keep serving, then a
# sweep of limits.  It prints one JSON object.
CHILD = r"""
import json, logging, resource, signal, sys
import numpy as np
import kvstore
from kvstore import KVStore, Settings, payload

cfg = json.loads(sys.argv[1])
d = cfg["dir"]
sys.path.insert(0, cfg["helpers"])
from kvhelpers import listing, make_tensors
records = []

class Grab(logging.Handler):
    def emit(self, r):
        records.append((r.levelname, r.getMessage()))

log = logging.getLogger("kvstore")
log.addHandler(Grab())
log.setLevel(logging.DEBUG)
log.propagate = False

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]

def limit(n):
    resource.setrlimit(resource.RLIMIT_FSIZE, (n, hard))

TENSORS = make_tensors(seed=1, shape=((8, 700), (3, 1000), (0, 4)), dtypes=("float16", "uint32", "float32"),
                       names=("k", "v", "empty"))

out = {"cases": []}
store = KVStore(d, min_tokens=1, durable=True, budget_mb=0)
old = store.find(cfg["old_text"] + "!")
text = "a new prompt " + "t" * 3000
trailers = {0: {"call_%d" % i: "x" * 200 for i in range(20)}, 3: "title"}

# Where each stage of the new file starts (for the sweep to hit each one).
e_plan = payload.Plan(len(text), np.arange(50), TENSORS, {"m": 1})
P = e_plan.payload_start
raw_trailer, _ = kvstore.trailers.encode_trailer({0: trailers[0], 3: "title"})
size = P + e_plan.payload_bytes + len(raw_trailer)
marks = [0, 48, 52, P, P + 24, P + 24 + e_plan.manifest_len, P + e_plan.payload_bytes, size]
m = e_plan.manifest
marks += [P + t["offset"] for t in [m["tokens"]] + m["tensors"]]
limits = sorted({max(1, x + dx) for x in marks for dx in (-1, 0, 1)} | set(range(1, size + 2, 997)))
out["size"] = size
for L in limits:
    before = listing(d)
    del records[:]
    limit(L)
    fut = store.save_async if cfg["use_async"] and L % 2 else None
    if fut is not None:
        e = store.save_async(text, np.arange(50), TENSORS, meta={"m": 1}, trailers=trailers).result()
    else:
        e = store.save(text, np.arange(50), TENSORS, meta={"m": 1}, trailers=trailers)
    limit(hard)
    case = {"limit": L, "ok": e is not None, "records": list(records),
            "left": sorted(set(listing(d)) - set(before))}
    if e is not None:
        case["file_size"] = e.file_size
        store.wipe(e)
    ck = store.load(store.find(cfg["old_text"] + "!"))
    case["old_hits"] = None if ck is None else ck.entry.hits
    out["cases"].append(case)

# The kept-file path: the same text again, with a trailer that cannot fit.
path = store.find(cfg["old_text"] + "!").path
before = open(path, "rb").read()
del records[:]
limit(len(before) + 100)
e = store.save(cfg["old_text"], np.arange(5), {"k": np.ones(16, np.float32)},
               trailers={0: {"big": "y" * 50000}})
limit(hard)
out["kept"] = {"ok": e is not None, "records": list(records), "same": open(path, "rb").read() == before}
ck = store.load(store.find(cfg["old_text"] + "!"))
out["kept"]["loads"] = ck is not None and ck.trailers.get(3) == "old title"
store.close()
print(json.dumps(out))
"""


def _prepare(d):
    from kvstore import KVStore
    with KVStore(d, min_tokens=1, durable=False, budget_mb=0) as s:
        s.save("an old prompt", np.arange(5), {"k": np.ones(16, np.float32)}, trailers={3: "old title"})


def check_sweep(out, error):
    """The rules every case of a sweep keeps; returns (failed, succeeded) counts."""
    failed = succeeded = 0
    hits = 0
    for c in out["cases"]:
        assert c["old_hits"] == hits + 1, c                     # the old checkpoint still loads
        hits = c["old_hits"]
        if c["ok"]:
            succeeded += 1
            assert c["file_size"] == out["size"]
        else:
            failed += 1
            assert c["left"] == [], c                          # no .kv, no temporary
            msgs = [m for _, m in c["records"]]
            # Exactly one line, a warning with the reason, and nothing else.
            assert len(msgs) == 1, c
            assert "save_failed" in msgs[0] and f"error={error}" in msgs[0], msgs
            assert c["records"][0][0] == "WARNING"
    return failed, succeeded


def run_child(d, cwd, use_async):
    cfg = {"dir": d, "old_text": "an old prompt", "use_async": use_async,
           "helpers": os.path.dirname(os.path.abspath(__file__))}     # where kvhelpers.py is
    p = subprocess.run([sys.executable, "-c", CHILD, json.dumps(cfg)],
                       cwd=cwd, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout)


def check_kept(kept, error):
    assert not kept["ok"]
    assert len(kept["records"]) == 1 and f"error={error}" in kept["records"][0][1], kept
    assert kept["same"]                                        # the file byte for byte as it was
    assert kept["loads"]


def test_rlimit_fsize_every_stage(tmp_path):
    d = str(tmp_path / "kv")
    _prepare(d)
    out = run_child(d, str(tmp_path), use_async=True)
    failed, succeeded = check_sweep(out, "EFBIG")
    # Success exactly when the whole file fits under the limit.
    for c in out["cases"]:
        assert c["ok"] == (c["limit"] >= out["size"]), c
    assert failed > 30 and succeeded >= 1
    check_kept(out["kept"], "EFBIG")


# ---- a real full file system ----------------------------------------------------------

@pytest.fixture
def tmpfs(tmp_path):
    """A 2 MiB tmpfs mounted at tmp_path/mnt (root only); unmounted after."""
    if os.geteuid() != 0 or not shutil.which("mount"):
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m,mode=0700", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if p.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {p.stderr.strip()}")
    try:
        yield str(mnt)
    finally:
        if subprocess.run(["umount", str(mnt)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_full_tmpfs_every_stage(tmpfs, tmp_path):
    import logging

    import kvstore
    from kvstore import KVStore, payload

    d = os.path.join(tmpfs, "kv")
    _prepare(d)
    filler = os.path.join(tmpfs, "filler")
    records = []

    class Grab(logging.Handler):
        def emit(self, r):
            records.append((r.levelname, r.getMessage()))

    log = logging.getLogger("kvstore")
    grab = Grab()
    log.addHandler(grab)
    old_level = log.level
    log.setLevel(logging.DEBUG)

    def room(n):
        """Leaves about n bytes free on the tmpfs (page granularity)."""
        with open(filler, "ab"):
            pass
        os.truncate(filler, 0)
        st = os.statvfs(tmpfs)
        free = st.f_bavail * st.f_frsize
        if free > n:
            fd = os.open(filler, os.O_WRONLY)
            try:
                os.posix_fallocate(fd, 0, free - n)
            finally:
                os.close(fd)

    tensors = {"k": np.random.default_rng(1).standard_normal((8, 4000)).astype(np.float16),
               "v": np.arange(9000, dtype=np.uint32)}
    text = "a new prompt " + "t" * 6000
    try:
        with KVStore(d, min_tokens=1, durable=True, budget_mb=0) as s:
            plan = payload.Plan(len(text), np.arange(50), tensors, None)
            size = plan.payload_start + plan.payload_bytes
            cases = []
            hits = 0
            for n in list(range(0, size + 3 * 4096, 4096)) + [size + 64 * 1024]:
                room(n)
                before = listing(d)
                del records[:]
                e = s.save(text, np.arange(50), tensors) if n % 8192 else \
                    s.save_async(text, np.arange(50), tensors).result()
                cases.append((n, e is not None, list(records), sorted(set(listing(d)) - set(before))))
                if e is not None:
                    os.truncate(filler, 0)
                    assert s.wipe(e) == 1
                ck = s.load(s.find("an old prompt!"))
                assert ck is not None and ck.entry.hits == hits + 1
                hits += 1
            for n, ok, recs, left in cases:
                if not ok:
                    assert left == [], (n, left)
                    assert len(recs) == 1 and "save_failed" in recs[0][1] and "error=ENOSPC" in recs[0][1], \
                        (n, recs)
            assert [ok for _, ok, _, _ in cases][:3] == [False] * 3 and cases[-1][1], cases
            # The kept-file path: a trailer that cannot fit on the full disk.
            path = s.find("an old prompt!").path
            room(0)
            before = open(path, "rb").read()
            del records[:]
            e = s.save("an old prompt", np.arange(5), {"k": np.ones(16, np.float32)},
                       trailers={0: {"big": "y" * 200000}})
            after = open(path, "rb").read()
            assert e is None and len(records) == 1 and "error=ENOSPC" in records[0][1], records
            assert after == before
            os.truncate(filler, 0)
        # A store opened on the full disk serves hits too.
        room(0)
        with KVStore(d, min_tokens=1, durable=True, budget_mb=0) as s:
            assert s.load(s.find("an old prompt!")) is not None
            assert kvstore.format.read_entry(path).hits == hits + 1
    finally:
        log.removeHandler(grab)
        log.setLevel(old_level)
