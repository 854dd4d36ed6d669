"""Concurrency (docs/semantics.md §11): real processes sharing one directory.

Four processes run 500 random operations each (save, save_async, find, load,
touch, evict, wipe) on one directory whose budget forces eviction all along.
Every save carries, in its meta, a unique id and the seed its tensors were
made from, so every load is checked against the data it must hold, and hit
counts can be audited per file (not per name: a name is evicted and stored
again many times).

At the end:
- no exception other than a KVStoreError subclass escaped (None returns are
  the documented misses and refusals);
- no load returned data other than what its file was saved with;
- the directory is within budget and holds only valid, CRC-clean files;
- every surviving file's hit count equals the successful loads of that file
  plus the touches the test made on it (a touch is attributed to a file only
  when the same file id is seen at the name before and after it; the few
  touches that race a replacement are allowed as a margin for the two files
  involved).

A second test races lookups against deletions (unlink, wipe, evict) and
replacements: a lookup whose file vanishes is a miss, never an exception.
"""

import collections
import functools
import os
import random
import time
import traceback

import numpy as np
import pytest

import kvstore
from kvstore import KVStore
from kvstore import payload
from kvstore.errors import KVStoreError
from kvstore.format import entry_from_fd, open_checkpoint
from kvstore.files import verify_file
from kvhelpers import CTX, OPTS, make_tensors

N_GROUPS = 6
# Texts of one group are prefixes of one another, so a lookup may land on a
# shorter checkpoint than the prompt's own.
TEXTS = [f"concurrency group {t % N_GROUPS}: " + "turn. " * (t // N_GROUPS + 1) for t in range(24)]
ELEMS = 6000                       # two uint32 tensors of 24 KB: a file is ~52 KB
BUDGET_MB = 0.5                    # about nine files: eviction on most saves


def tokens_for(seed):
    return (np.arange(40, dtype=np.uint32) + seed) % 60000


# tensors_for(seed=s): k (6, 1000) and v (750, 8), uint32, the data of seed s.
tensors_for = functools.partial(make_tensors, shape=((6, ELEMS // 6), (ELEMS // 8, 8)), dtypes=("uint32", "uint32"))


def check_checkpoint(ck, prompt):
    """ck holds exactly what the save recorded in its meta; returns the file id."""
    t, seed, uid = ck.meta["t"], ck.meta["seed"], ck.meta["uid"]
    assert ck.text_bytes == TEXTS[t].encode()
    assert prompt.startswith(ck.text_bytes)
    assert np.array_equal(ck.tokens, tokens_for(seed))
    want = tensors_for(seed=seed)
    assert sorted(ck.tensors) == sorted(want)
    for k, v in want.items():
        assert np.array_equal(ck.tensors[k], v), k
    return uid


def uid_at(path):
    """The file id of the checkpoint now at path, or None."""
    try:
        fd, st = open_checkpoint(path)
    except KVStoreError:
        return None
    try:
        e = entry_from_fd(fd, st, path)
        return payload.read_manifest(fd, e).meta.get("uid")
    except KVStoreError:
        return None
    finally:
        os.close(fd)


OPS = {"save": 20, "save_async": 10, "find": 15, "load": 25, "touch": 10, "evict": 5, "wipe": 5}


def _worker(d, wid, n_ops, seed, out):
    rng = random.Random(seed)
    loads, touches = collections.Counter(), collections.Counter()
    ambiguous, errors, counts, raised = [], [], collections.Counter(), collections.Counter()
    futures = []
    names, weights = list(OPS), list(OPS.values())

    def settle(fut):
        try:
            r = fut.result(timeout=60)
            counts["save_async_" + ("ok" if r is not None else "none")] += 1
        except KVStoreError as e:
            raised["save_async", type(e).__name__] += 1

    try:
        store = KVStore(d, budget_mb=BUDGET_MB, **OPTS, durable=False)
        for i in range(n_ops):
            op = rng.choices(names, weights)[0]
            t = rng.randrange(len(TEXTS))
            prompt = TEXTS[t].encode() + b" and the rest of the request"
            counts[op] += 1
            try:
                if op in ("save", "save_async"):
                    s = rng.randrange(2**31)
                    kw = dict(meta={"t": t, "seed": s, "uid": f"{wid}-{i}-{rng.getrandbits(48):x}"},
                              ctx_size=rng.choice([4096, 8192]))
                    if rng.random() < 0.25:
                        kw["trailers"] = {3: f"title {i}"}
                    if op == "save":
                        r = store.save(TEXTS[t], tokens_for(s), tensors_for(seed=s), **kw)
                        counts["save_" + ("ok" if r is not None else "none")] += 1
                    else:
                        futures.append(store.save_async(TEXTS[t], tokens_for(s), tensors_for(seed=s), **kw))
                elif op == "find":
                    e = store.find(prompt)
                    counts["find_" + ("hit" if e is not None else "miss")] += 1
                    assert e is None or e.text_bytes <= len(prompt)
                elif op == "load":
                    e = store.find(prompt)
                    ck = store.load(e) if e is not None else None
                    if ck is not None:
                        loads[check_checkpoint(ck, prompt)] += 1
                    counts["load_" + ("ok" if ck is not None else "none")] += 1
                elif op == "touch":
                    e = store.find(prompt)
                    if e is not None:
                        before = uid_at(e.path)
                        kvstore.format.touch(e.path)
                        after = uid_at(e.path)
                        if before is not None and before == after:
                            touches[before] += 1
                        else:
                            ambiguous.append((before, after))
                elif op == "evict":
                    store.evict()
                elif op == "wipe":
                    e = store.find(prompt)
                    if e is not None:
                        store.wipe(e)
            except KVStoreError as e:
                raised[op, type(e).__name__] += 1
            while futures and (futures[0].done() or len(futures) > 8):
                settle(futures.pop(0))
        for fut in futures:
            settle(fut)
        store.close()
    except BaseException:
        errors.append(traceback.format_exc())
    out.put(dict(loads=loads, touches=touches, ambiguous=ambiguous, errors=errors, counts=counts,
                 raised=raised))


def run_processes(targets, result_timeout, join_timeout):
    """Starts one process per (function, args), each putting one result on the
    queue passed as its last argument; returns the results once all exited 0."""
    out = CTX.Queue()
    procs = [CTX.Process(target=fn, args=(*args, out)) for fn, args in targets]
    for p in procs:
        p.start()
    results = [out.get(timeout=result_timeout) for _ in procs]
    for p in procs:
        p.join(join_timeout)
        assert p.exitcode == 0
    return results


def run_workers(d, n_procs, n_ops, seed):
    return run_processes([(_worker, (d, w, n_ops, seed * 100 + w)) for w in range(n_procs)], 600, 60)


def audit(d, results):
    errors = [e for r in results for e in r["errors"]]
    assert not errors, errors[0]
    raised = collections.Counter()
    for r in results:
        raised.update(r["raised"])
    # The serving calls never raise: a race is a miss, a refusal or a fresh
    # save.  touch() on a file deleted or being wiped raises its documented
    # CheckpointMissing / CorruptCheckpoint.
    assert {op for op, _ in raised} <= {"touch"}, raised
    assert {name for _, name in raised} <= {"CheckpointMissing", "CorruptCheckpoint"}, raised
    loads, touches = collections.Counter(), collections.Counter()
    margin = collections.Counter()
    counts = collections.Counter()
    for r in results:
        loads.update(r["loads"])
        touches.update(r["touches"])
        counts.update(r["counts"])
        for before, after in r["ambiguous"]:
            for uid in {before, after} - {None}:
                margin[uid] += 1
    files = sorted(n for n in os.listdir(d) if n.endswith(".kv"))
    assert not [n for n in os.listdir(d) if ".tmp." in n]
    total = 0
    audited = collections.Counter()
    for n in files:
        path = os.path.join(d, n)
        assert verify_file(path) is None, n
        e = kvstore.format.read_entry(path)
        total += e.file_size
        uid = uid_at(path)
        want = loads[uid] + touches[uid]
        assert want <= e.hits <= want + margin[uid], (n, uid, e.hits, loads[uid], touches[uid], margin[uid])
        audited["files"] += 1
        audited["hits"] += e.hits
    assert total <= BUDGET_MB * 1024 * 1024, (total, files)
    with KVStore(d, budget_mb=BUDGET_MB, **OPTS) as s:
        assert sorted(e.name for e in s.entries()) == files
    counts.update({f"{op}_raised_{name}": n for (op, name), n in raised.items()})
    return counts, audited, sum(len(r["ambiguous"]) for r in results)


def random_operations(tmp_path, ops, seed, label):
    """4 processes x ops random operations, audited; returns the counts."""
    d = str(tmp_path / "kv")
    t0 = time.monotonic()
    results = run_workers(d, 4, ops, seed=seed)
    counts, audited, ambiguous = audit(d, results)
    print(f"\n{label}: procs=4 ops={4 * ops} seconds={time.monotonic() - t0:.1f} "
          f"ambiguous_touches={ambiguous} audited={dict(audited)} counts={dict(sorted(counts.items()))}")
    return counts


def test_four_processes_random_operations(tmp_path):
    counts = random_operations(tmp_path, 500, 1, "concurrency")
    # The run did what it is for: saves were evicted, loads hit, touches landed.
    assert counts["load_ok"] > 50 and counts["save_ok"] > 50
    assert sum(c for k, c in counts.items() if k.startswith("touch")) > 0


@pytest.mark.soak
def test_soak_four_processes_random_operations(tmp_path):
    random_operations(tmp_path, 25000, 2, "concurrency soak")


# ---- lookups racing deletions ----------------------------------------------------------

RACE_TEXTS = [f"racing text {i} " * 3 for i in range(6)]


def _race_worker(role, d, seconds, seed, out):
    """Runs role's step (below) in a loop for seconds; puts (role, counts, traceback or None)."""
    step = {"deleter": _delete_step, "reader": _read_step}[role]
    rng = random.Random(seed)
    n = collections.Counter()
    try:
        store = KVStore(d, **OPTS, durable=False, budget_mb=0)
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            step(store, d, rng, n)
        out.put((role, dict(n), None))
    except BaseException:
        out.put((role, dict(n), traceback.format_exc()))


def _delete_step(store, d, rng, n):
    t = rng.randrange(len(RACE_TEXTS))
    s = rng.randrange(2**31)
    e = store.save(RACE_TEXTS[t], tokens_for(s), tensors_for(seed=s),
                   meta={"t": t, "seed": s, "uid": str(s)}, ctx_size=rng.choice([4096, 8192]))
    how = rng.choice(["unlink", "wipe", "evict", "replace"])
    n[how] += 1
    try:
        if how == "unlink":
            os.unlink(e.path)
        elif how == "wipe":
            store.wipe(e)
        elif how == "evict":
            with KVStore(d, **OPTS, durable=False, budget_mb=0.01):
                pass                                   # opening evicts to the budget
        # "replace": the next save of this text (another context) renames over it
    except FileNotFoundError:
        pass


def _read_step(store, d, rng, n):
    t = rng.randrange(len(RACE_TEXTS))
    prompt = RACE_TEXTS[t].encode() + b"?"
    e = store.find(prompt)
    if e is None:
        n["find_miss"] += 1
        return
    ck = store.load(e)                               # never raises: None is the miss
    if ck is None:
        n["found_then_missed"] += 1
    else:
        check_checkpoint_race(ck, prompt)
        n["loaded"] += 1


def check_checkpoint_race(ck, prompt):
    t, s = ck.meta["t"], ck.meta["seed"]
    assert ck.text_bytes == RACE_TEXTS[t].encode() and prompt.startswith(ck.text_bytes)
    assert np.array_equal(ck.tokens, tokens_for(s))
    assert all(np.array_equal(ck.tensors[k], v) for k, v in tensors_for(seed=s).items())


def test_lookup_racing_deletion_is_a_miss(tmp_path):
    race(tmp_path, seconds=4)


@pytest.mark.soak
def test_soak_lookup_racing_deletion_is_a_miss(tmp_path):
    race(tmp_path, seconds=60)


def race(tmp_path, seconds):
    d = str(tmp_path / "kv")
    got = run_processes([(_race_worker, ("deleter", d, seconds, 1)),
                         (_race_worker, ("reader", d, seconds, 2))], 120, 30)
    for role, n, err in got:
        assert err is None, f"{role}: {err}"
    reader = next(n for role, n, _ in got if role == "reader")
    print(f"\nrace: {got}")
    assert reader.get("loaded", 0) > 0
    # The race happened: lookups found files that were gone (or zeroed) by the load.
    assert reader.get("found_then_missed", 0) > 0, reader


# ---- races pinned down in one process ---------------------------------------------------
#
# Two interleavings the random run above meets only now and then, forced here
# by doing the other process's step from inside the first one's (the trailer
# parse is the last step of a load before the hit is recorded, and the first
# step of an in-place trailer rewrite).

def _replacement_file(tmp_path, text, seed):
    """The bytes another process would rename over text's file: same name, other data."""
    with KVStore(tmp_path / "elsewhere", **OPTS, durable=False) as other:
        e = other.save(text, tokens_for(seed), tensors_for(seed=seed), meta={"t": 0, "seed": seed, "uid": "new"},
                       ctx_size=1024)
        return e.path


def _run_once_inside(monkeypatch, step):
    real = kvstore.trailers.parse_trailer
    done = []

    def parse(*a, **kw):
        if not done:
            done.append(True)
            step()
        return real(*a, **kw)
    monkeypatch.setattr(kvstore.trailers, "parse_trailer", parse)
    return done


def test_hit_counts_on_the_file_loaded_not_on_its_replacement(tmp_path, monkeypatch):
    text = TEXTS[0]
    new_path = _replacement_file(tmp_path, text, seed=2)
    with KVStore(tmp_path / "kv", **OPTS, durable=False) as s:
        old = s.save(text, tokens_for(1), tensors_for(seed=1), meta={"t": 0, "seed": 1, "uid": "old"},
                     trailers={3: "a title"})
        found = s.find(text + "?")
        done = _run_once_inside(monkeypatch, lambda: os.replace(new_path, old.path))
        ck = s.load(found)
        assert done
        assert ck is not None and ck.meta["uid"] == "old"       # the load stands...
        assert ck.entry.hits == 0                              # ...uncounted: its file is gone
        assert kvstore.format.read_entry(old.path).hits == 0           # the replacement got no phantom hit
        ck = s.load(s.find(text + "?"))
        assert ck.meta["uid"] == "new" and ck.entry.hits == 1


def test_save_over_a_file_being_wiped_writes_a_fresh_one(tmp_path, monkeypatch):
    text = TEXTS[1]
    with KVStore(tmp_path / "kv", **OPTS, durable=False) as s:
        old = s.save(text, tokens_for(1), tensors_for(seed=1), meta={"t": 1, "seed": 1, "uid": "old"},
                     trailers={3: "first"})

        def wipe_started():                                   # another process's wipe, half done
            with open(old.path, "r+b") as f:
                f.write(bytes(4096))
        done = _run_once_inside(monkeypatch, wipe_started)
        # Compatible, so save() starts rewriting the trailer in place; the
        # header turns to zeros under it.  Once this raised CorruptCheckpoint.
        e = s.save(text, tokens_for(1), tensors_for(seed=1), meta={"t": 1, "seed": 1, "uid": "fresh"},
                   trailers={3: "second"})
        assert done and e is not None
        ck = s.load(s.find(text + "?"))
        assert ck.meta["uid"] == "fresh" and ck.trailers == {3: "second"}
        check_checkpoint(ck, (text + "?").encode())


def test_save_whose_file_is_wiped_as_soon_as_visible(tmp_path, monkeypatch):
    """Another process may wipe a checkpoint the moment its rename makes it
    visible: save() still returns the entry it wrote (once it raised
    CorruptCheckpoint reading the file back after the rename)."""
    real = {"rename": os.rename, "link": os.link}

    def publish_then_wipe(how):
        def run(src, dst, *a, **kw):
            real[how](src, dst, *a, **kw)
            if str(dst).endswith(".kv"):
                with open(dst, "r+b") as f:
                    f.write(bytes(os.path.getsize(dst)))
        return run
    with KVStore(tmp_path / "kv", **OPTS, durable=True) as s:
        # A new file appears by rename (whole layout) or by link (a new chain block).
        monkeypatch.setattr(os, "rename", publish_then_wipe("rename"))
        monkeypatch.setattr(os, "link", publish_then_wipe("link"))
        e = s.save(TEXTS[2], tokens_for(3), tensors_for(seed=3), meta={"t": 2, "seed": 3, "uid": "x"})
        monkeypatch.undo()
        assert e is not None and e.tokens == 40 and e.name == kvstore.format.sha1(TEXTS[2].encode()).hex() + ".kv"
        found = s.find(TEXTS[2] + "?")                         # the zeroed file is a miss
        assert found is None or s.load(found) is None
