"""Power cuts, simulated (tests/powerfs.py): a save that returned survives, nothing torn is loaded.

Each scenario runs a store's writing path on the power-loss mount, and the
power goes after a random number k of its writes, renames and syncs (k
drawn by a seeded generator from the calls a run without a cut makes).
What survives (the synced state; or, in the "reorder" mode, that plus a
random part of the pending pages and name changes) is copied out, and a
fresh KVStore opened on the copy must hold:

- every save that had returned before the cut, found and loaded bit-exact;
- nothing torn: every checkpoint it lists loads as the state its own token
  ids make (the tensors follow from the token ids), or is a miss the store
  logs (removed or quarantined);
- no temporary file after the open;
- counters that open, and a store that still saves and loads.

The default run makes CUTS_PER_SCENARIO cuts of every scenario, half in
each mode, and MACOS_CUTS_PER_SCENARIO with macOS's sequence (each step a
F_BARRIERFSYNC, a save ending with one F_FULLFSYNC), run here by mapping
those to fdatasync and fsync on a mount whose fdatasync is a barrier: what
survives is the flushed state and a random prefix of the barriers.
``pytest -m soak`` makes SOAK_CUTS_PER_SCENARIO.  A failure names
the seed, the scenario, k and the mode, and the filesystem's last calls;
POWER_CUT_SEED=<seed> replays it.
"""

import contextlib
import fcntl
import hashlib
import logging
import os
import random
import shutil

import numpy as np
import pytest

from kvstore import KVStore, files
from kvstore.format import Reason
from kvstore.errors import CorruptCheckpoint
from kvstore.exchange import export_checkpoint, import_checkpoint
from kvstore.format import is_checkpoint_name, read_entry
from kvstore.index import TORN_REASONS
from kvhelpers import S3_BUCKET
from powerfs import fuse_unavailable, mounted
from test_chain import Seq, kv_of, rows_of

pytestmark = pytest.mark.skipif(fuse_unavailable() is not None, reason=f"no FUSE mount: {fuse_unavailable()}")

SEED = int(os.environ.get("POWER_CUT_SEED", "20261202"))
CUTS_PER_SCENARIO = 12            # 11 scenarios: 132 cuts, 66 in each mode
SOAK_CUTS_PER_SCENARIO = 210      # 10 scenarios: 2,100 cuts
MACOS_CUTS_PER_SCENARIO = 6       # with macOS's sync sequence, in the "barrier" mode
F_FULLFSYNC = 51                  # <sys/fcntl.h> on macOS
BLOCK = 64                        # tokens per chain block: several blocks per save, small files
POS = {"k": 2, "p": 0}
KEY = bytes(range(32))
OPTS = dict(min_tokens=1)


def open_store(path, **kw):
    kw.setdefault("min_tokens", 1)
    kw.setdefault("block_tokens", BLOCK)
    kw.setdefault("durable", True)
    return KVStore(path, **kw)


def tensors_of(seq):
    return {"k": kv_of(seq.ids), "p": rows_of(seq.ids)}


def save(store, seq, **kw):
    return store.save(seq.text, seq.ids, tensors_of(seq), positional=POS, text_offsets=seq.offsets,
                      reason=kw.pop("reason", Reason.COLD), **kw)


def sequences(seed, count, lengths=(150, 230, 300)):
    """count sequences: the first grows through lengths, the others branch off it."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 1000, max(lengths))
    out = [Seq(ids[:n]) for n in lengths]
    for i in range(count - len(out)):
        branch = np.concatenate([ids[:100 + 10 * i], rng.integers(0, 1000, 60)])
        out.append(Seq(branch))
    return out[:count]


def block_names(seq):
    """The first 12 hex digits of the names of seq's chain blocks (a store without a key or model)."""
    ends = sorted({*range(BLOCK, len(seq) + 1, BLOCK), len(seq)})
    return {hashlib.sha1(seq.text[:seq.offsets[n]]).hexdigest()[:12] for n in ends}


def derived(ck):
    """True when a loaded checkpoint is the state its own token ids make (nothing torn)."""
    ids = np.asarray(ck.tokens)
    seq = Seq(ids)
    return (bytes(ck.text_bytes) == seq.text and np.array_equal(np.asarray(ck.tensors["k"]), kv_of(ids))
            and np.array_equal(np.asarray(ck.tensors["p"]), rows_of(ids)))


# ---- the scenarios: each writes through one path; done[dir] gets every save that returned ----

class Scenario:
    """A writing path: prepare() builds the starting directory (durable), run() writes on the mount."""
    stores = {"store": {}}            # directory -> KVStore arguments

    def prepare(self, root):
        pass

    def run(self, root, done):
        raise NotImplementedError


class ChainSaves(Scenario):
    """Durable chained saves, every block parent first, with the directory counters and a write budget."""
    stores = {"store": {"max_write_mb_per_hour": 64}}

    def run(self, root, done):
        with open_store(os.path.join(root, "store"), **self.stores["store"]) as s:
            for seq in sequences(1, 5):
                if save(s, seq) is not None:
                    done["store"].append(seq)


class WholeSaves(Scenario):
    """Durable whole-file saves."""
    stores = {"store": {"layout": "whole"}}

    def run(self, root, done):
        with open_store(os.path.join(root, "store"), layout="whole") as s:
            for seq in sequences(2, 4):
                if save(s, seq) is not None:
                    done["store"].append(seq)


class SealedSaves(Scenario):
    """Sealed chained saves (every file encrypted and authenticated)."""
    stores = {"store": {"key": KEY}}

    def run(self, root, done):
        with open_store(os.path.join(root, "store"), key=KEY) as s:
            for seq in sequences(3, 4):
                if save(s, seq) is not None:
                    done["store"].append(seq)


def _prepared(root, seqs, **kw):
    with open_store(os.path.join(root, "store"), **kw) as s:
        for seq in seqs:
            assert save(s, seq, **({"trailers": {3: "first"}} if seq is seqs[0] else {})) is not None


class Touches(Scenario):
    """Loads: each counts a hit in the header, rewritten in place (touch)."""

    def prepare(self, root):
        _prepared(root, sequences(4, 3))

    def run(self, root, done):
        done["store"].extend(sequences(4, 3))            # stored before the run
        with open_store(os.path.join(root, "store")) as s:
            for _ in range(3):
                for seq in sequences(4, 3):
                    e = s.find(seq.text)
                    assert e is not None and s.load(e, consume=False) is not None


class TrailerRewrites(Scenario):
    """A save of a stored text with a new title: the trailer rewritten in place."""

    def prepare(self, root):
        _prepared(root, sequences(5, 2))

    def run(self, root, done):
        seqs = sequences(5, 2)
        done["store"].extend(seqs)
        with open_store(os.path.join(root, "store")) as s:
            for title in ("second", "a third, longer title", "4"):
                assert save(s, seqs[0], trailers={3: title}) is not None


class Evictions(Scenario):
    """Saves past the budget (eviction), with an orphan block to sweep."""

    def prepare(self, root):
        seqs = sequences(6, 3)
        _prepared(root, seqs[:2])
        d = os.path.join(root, "store")
        with open_store(d) as s:
            first = [e for e in s.entries() if e.is_block and not e.parent]
        os.unlink(first[0].path)                        # the blocks after it are orphans

    def run(self, root, done):
        # A save the budget evicted since it returned is gone by design: the
        # check expects only those none of whose blocks were evicted.
        with kvstore_log() as log:
            try:
                with open_store(os.path.join(root, "store"), budget_mb=0.03) as s:
                    for seq in sequences(7, 6):
                        if save(s, seq) is not None:
                            done["store"].append(seq)
                    s.evict()
            finally:
                evicted = {line.split("file=")[1][:12] for line in log if "kvstore: evicted " in line}
                done["store"][:] = [q for q in done["store"] if not evicted & block_names(q)]


class Exchange(Scenario):
    """Export a stored sequence to one file, import it into another store."""
    stores = {"store": {}, "other": {"layout": "whole"}}

    def prepare(self, root):
        _prepared(root, sequences(8, 2))

    def run(self, root, done):
        seqs = sequences(8, 2)
        done["store"].extend(seqs)
        with open_store(os.path.join(root, "store")) as s, \
                open_store(os.path.join(root, "other"), layout="whole") as other:
            for i, seq in enumerate(seqs):
                path = os.path.join(root, f"export-{i}.kv")
                export_checkpoint(s, s.find(seq.text), path)
                if import_checkpoint(other, path) is not None:
                    done["other"].append(seq)


class OpenAfterCrash(Scenario):
    """A store opened on a directory a crash left temporary files and orphans in: the clean-up."""

    def prepare(self, root):
        seqs = sequences(9, 2)
        _prepared(root, seqs)
        d = os.path.join(root, "store")
        with open_store(d) as s:
            names = sorted(e.path for e in s.entries())
        for i, p in enumerate(names[:2]):
            shutil.copy(p, f"{p}.tmp.{4000 + i}.0badc0de")

    def run(self, root, done):
        seqs = sequences(9, 2)
        done["store"].extend(seqs)
        with open_store(os.path.join(root, "store")) as s:
            extra = sequences(10, 1)[0]
            if save(s, extra) is not None:
                done["store"].append(extra)


class UnsyncedSaves(Scenario):
    """Saves with durable=False: nothing is promised to survive, and what is
    torn (a name whose data never reached the disk) must be a logged miss."""
    stores = {"store": {"durable": False}}

    def run(self, root, done):
        with open_store(os.path.join(root, "store"), durable=False) as s:
            for seq in sequences(13, 4):
                save(s, seq)


class SessionSaves(Scenario):
    """Saves that replace a stored file: a session saved again and again under one name."""
    stores = {"store": {"layout": "whole"}}

    def run(self, root, done):
        seqs = sequences(11, 3)
        with open_store(os.path.join(root, "store"), layout="whole") as s:
            for seq in seqs:
                if save(s, seq, reason=Reason.EVICT) is not None:
                    done["store"].append(seq)
            for seq in seqs:                           # a second round: kept, nothing torn meanwhile
                assert save(s, seq, reason=Reason.EVICT) is not None


class RemoteFetch(Scenario):
    """Remote hits: each checkpoint fetched from the bucket and published into the directory."""
    identity = "power-cut-model@1"
    stores = {"store": {"model_identity": identity}}

    def __init__(self, server):
        self.server = server

    def remote(self, profile):
        return dict(remote=f"s3://{S3_BUCKET}/power-cuts", model_identity=self.identity,
                    remote_options={"endpoint_url": self.server.endpoint, "profile": profile,
                                    "refresh_interval_s": 3600, "max_attempts": 1})

    def prepare(self, root):
        with open_store(root + "-publisher", **self.remote("kvwriter")) as s:
            for seq in sequences(12, 3):
                assert save(s, seq) is not None
            assert s.remote.flush(30)

    def run(self, root, done):
        with open_store(os.path.join(root, "store"), **self.remote("kvreader")) as s:
            assert s.remote.refresh()
            for seq in sequences(12, 3):
                e = s.find(seq.text + b" and more")
                assert e is not None and e.remote is not None
                if s.load(e, consume=False) is not None:
                    done["store"].append(seq)


SCENARIOS = {c.__name__: c() for c in (ChainSaves, WholeSaves, SealedSaves, Touches, TrailerRewrites, Evictions,
                                        Exchange, OpenAfterCrash, SessionSaves, UnsyncedSaves)}


# ---- the harness -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def power(tmp_path_factory):
    with mounted(tmp_path_factory.mktemp("powerfs")) as fs:
        yield fs


@contextlib.contextmanager
def kvstore_log():
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logger = logging.getLogger("kvstore")
    handler, level = Keep(logging.INFO), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def starting_state(scenario, tmp):
    """The directory a run starts from (built off the mount, then taken as durable)."""
    root = tmp / f"start-{type(scenario).__name__}"
    if not root.exists():
        root.mkdir()
        scenario.prepare(str(root))
    return root


@contextlib.contextmanager
def macos_syncs():
    """kvstore.files as on macOS (SYNC_PRIMITIVE F_FULLFSYNC, STEP_PRIMITIVE
    F_BARRIERFSYNC), with those two fcntl calls made as the power-loss
    mount's barrier (fdatasync) and full flush (fsync)."""
    real = fcntl.fcntl
    ops = {files.F_BARRIERFSYNC: os.fdatasync, F_FULLFSYNC: os.fsync}

    def as_macos(fd, op, *args):
        if op in ops:
            ops[op](fd)
            return 0
        return real(fd, op, *args)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(files, "SYNC_PRIMITIVE", "F_FULLFSYNC")
        mp.setattr(files, "STEP_PRIMITIVE", "F_BARRIERFSYNC")
        mp.setattr(fcntl, "F_BARRIERFSYNC", files.F_BARRIERFSYNC, raising=False)
        mp.setattr(fcntl, "F_FULLFSYNC", F_FULLFSYNC, raising=False)
        mp.setattr(fcntl, "fcntl", as_macos)
        yield


def run_once(power, scenario, start, k=None, macos=False):
    """Runs scenario on a fresh mount (cut after k calls); returns (done, calls made, frozen).
    macos: with macOS's sync sequence (macos_syncs) on a mount with barriers."""
    power.reset(start, barriers=macos)
    if k is not None:
        power.arm(k)
    done = {d: [] for d in scenario.stores}
    try:
        with macos_syncs() if macos else contextlib.nullcontext():
            scenario.run(power.mount, done)
    except Exception:
        if not power.state()["frozen"]:
            raise                                     # a failure before any cut: a real one
    state = power.state()
    return done, state


def torn_files(d):
    """The checkpoint-named files in d whose envelope is torn (cut short, or no magic)."""
    out = []
    for name in os.listdir(d):
        if is_checkpoint_name(name):
            try:
                read_entry(os.path.join(d, name))
            except CorruptCheckpoint as e:
                if e.reason in TORN_REASONS:
                    out.append(name)
    return out


def check_survivor(dest, scenario, done, why):
    """The checks of the module docstring on one survived copy."""
    stats = {"confirmed": 0, "lost": 0, "torn_loaded": 0, "misses_logged": 0, "torn_removed": 0}
    for sub, kw in scenario.stores.items():
        d = dest / sub
        if not d.exists():
            assert not done[sub], f"{why}: the directory {sub} is gone with {len(done[sub])} saves that returned"
            continue
        torn = torn_files(d)
        with kvstore_log() as log, open_store(str(d), **kw) as s:
            temps = [n for n in os.listdir(d) if ".tmp." in n]
            assert not temps, f"{why}: temporary files left after the open: {temps}"
            for name in torn:                      # the debris of the cut: removed, and said so
                assert not os.path.exists(d / name), f"{why}: a torn file stays: {name}"
                assert any("kvstore: corrupt " in line and name[:12] in line for line in log), \
                    f"{why}: a torn file went without a log line: {name}"
                stats["torn_removed"] += 1
            for seq in done[sub]:
                e = s.find(seq.text)
                ok = e is not None and e.text_bytes == len(seq.text)
                ck = s.load(e, consume=False) if ok else None
                ok = ok and ck is not None and np.array_equal(np.asarray(ck.tokens), seq.ids) and derived(ck)
                stats["confirmed" if ok else "lost"] += 1
                assert ok, f"{why}: a save that returned before the cut is lost ({len(seq)} tokens in {sub})"
            for e in s.entries():
                ck = s.load(e, consume=False)
                if ck is None:
                    stats["misses_logged"] += 1
                    assert any(e.name[:12] in line for line in log), f"{why}: {e.name} unloadable, and no log line"
                elif not derived(ck):
                    stats["torn_loaded"] += 1
                    raise AssertionError(f"{why}: a torn checkpoint loaded: {e.name}")
            s.stats()
            s.counters()
            fresh = sequences(99, 4)[3]
            assert save(s, fresh) is not None, f"{why}: the store no longer saves"
            ck = s.load(s.find(fresh.text), consume=False)
            assert ck is not None and derived(ck), f"{why}: a new save does not load"
    return stats


def cuts(power, tmp, name, count, macos=False):
    """count cuts of a scenario, half "synced" and half "reorder" (macos: all
    "barrier", with macOS's sync sequence); the totals of their checks."""
    scenario = SCENARIOS[name]
    start = starting_state(scenario, tmp)
    _, full = run_once(power, scenario, start, macos=macos)
    total = full["ops"]
    assert total > 0
    rng = random.Random(f"{SEED}-{name}" + ("-macos" if macos else ""))
    totals = {"cuts": 0, "synced": 0, "reorder": 0, "barrier": 0, "confirmed": 0, "lost": 0, "torn_loaded": 0,
              "misses_logged": 0, "torn_removed": 0, "pages_pending": 0, "pages_kept": 0, "names_pending": 0,
              "names_kept": 0, "epochs_pending": 0, "epochs_kept": 0, "barriers": full["barriers"]}
    for i in range(count):
        k = rng.randint(1, total)
        mode = "barrier" if macos else ("synced", "reorder")[i % 2]
        done, state = run_once(power, scenario, start, k, macos)
        why = (f"seed {SEED} (POWER_CUT_SEED), scenario {name}, cut {i} after call {k} of {total}, mode {mode}; "
               f"the filesystem's last calls: {state['trace'][-12:]}")
        dest = tmp / f"survived-{name}-{i}"
        kept = power.survive(dest, mode, seed=rng.randrange(1 << 30))
        for key, v in [*check_survivor(dest, scenario, done, why).items(), *kept.items()]:
            totals[key] += v
        totals["cuts"] += 1
        totals[mode] += 1
        shutil.rmtree(dest)
    return totals


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_power_cuts(power, tmp_path, name):
    totals = cuts(power, tmp_path, name, CUTS_PER_SCENARIO)
    assert totals["cuts"] == CUTS_PER_SCENARIO and totals["lost"] == totals["torn_loaded"] == 0
    print(f"power cuts {name}: {totals}")


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_power_cuts_with_macos_barriers(power, tmp_path, name):
    """macOS's sequence (barriers, one full flush a save) keeps the same
    promises: a save that returned survives, nothing torn loads."""
    totals = cuts(power, tmp_path, name, MACOS_CUTS_PER_SCENARIO, macos=True)
    assert totals["cuts"] == MACOS_CUTS_PER_SCENARIO and totals["lost"] == totals["torn_loaded"] == 0
    # A save's steps are barriers (an in-place header rewrite is one full flush; unsynced saves sync nothing).
    assert (totals["barriers"] > 0) == (name not in ("Touches", "TrailerRewrites", "UnsyncedSaves")), totals
    print(f"power cuts {name} (macOS barriers): {totals}")


def test_power_cuts_in_a_remote_fetch(power, tmp_path, s3):
    SCENARIOS["RemoteFetch"] = RemoteFetch(s3)
    try:
        totals = cuts(power, tmp_path, "RemoteFetch", CUTS_PER_SCENARIO)
    finally:
        del SCENARIOS["RemoteFetch"]
    assert totals["lost"] == totals["torn_loaded"] == 0
    print(f"power cuts RemoteFetch: {totals}")


@pytest.mark.soak
@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_soak_power_cuts(power, tmp_path, name):
    totals = cuts(power, tmp_path, name, SOAK_CUTS_PER_SCENARIO)
    assert totals["lost"] == totals["torn_loaded"] == 0
    print(f"power cuts {name}: {totals}")
