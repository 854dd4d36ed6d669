"""The index snapshot (kvstore/index_snapshot.py, docs/semantics.md §4): an open reads no envelope it need not.

A store keeps its index in ``<dir>/.index`` so that the next open starts
from it instead of reading every file's envelope.  The files stay the
truth: whatever happens to the snapshot (a crash while it is written, cut
short, damaged, copied from another directory, written before the boot)
or to the files behind its back (added, removed, replaced, with the
journal or without it), a store opened on the directory holds the same
index as a listing of the directory made from scratch.
"""

import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import kvstore
from kvstore import index, index_snapshot
from kvstore.format import Reason
from kvstore.format import read_entry
from kvstore.index import DirectoryIndex
from kvstore.index_snapshot import SNAPSHOT_NAME
from kvstore.journal import JOURNAL_NAME
from kvhelpers import index_of, checkpoint_files, folds_case, make_store, make_tensors

BLOCK = 8                 # tokens per chain block: many small blocks
CHAIN_TOKENS = 10 * BLOCK


@pytest.fixture(autouse=True)
def small_snapshots(monkeypatch):
    """Keeps a snapshot for the tests' small directories too."""
    monkeypatch.setattr(index, "SNAPSHOT_MIN_ENTRIES", 1)


@pytest.fixture
def reads(monkeypatch):
    """Counts the envelopes the index reads."""
    count = {"n": 0}
    real = index.read_entry

    def spy(path):
        count["n"] += 1
        return real(path)
    monkeypatch.setattr(index, "read_entry", spy)
    return count


def chain_of(j, n=CHAIN_TOKENS):
    """(text, token ids, text offsets) of chain j: its own words from the first byte."""
    ids = np.arange(n, dtype=np.uint32) + np.uint32(1000 * j)
    words = [f"c{j}w{t}{'x' * (t % 3)} ".encode() for t in ids.tolist()]
    return b"".join(words), ids, np.cumsum([0] + [len(w) for w in words])


def save_chain(store, j, n=CHAIN_TOKENS):
    text, ids, offsets = chain_of(j, n)
    e = store.save(text, ids, {"k": (ids % 251).astype(np.uint8)[:, None]}, positional={"k": 0},
                   text_offsets=offsets, reason=Reason.SHUTDOWN)
    assert e is not None
    return e


def open_store(path, **kw):
    kw.setdefault("block_tokens", BLOCK)
    kw.setdefault("layout", "chain")
    return make_store(path, **kw)


def fill(path, chains=6, whole=3):
    """A directory of chains of blocks and whole files; returns the entries saved last."""
    saved = []
    with open_store(path) as s:
        saved += [save_chain(s, j) for j in range(chains)]
    with open_store(path, layout="whole") as s:
        saved += [s.save(f"a whole prompt number {i}", list(range(8)), make_tensors(8, seed=i)) for i in range(whole)]
    return saved


def state(idx):
    """What an index holds: its entries, the forest (each node's parent, and
    the nodes its lists reach), orphans, torn files and bytes."""
    f = idx._forest
    parents = {f.entry[i].sha: (f.entry[int(f.parent[i])].sha if f.parent[i] >= 0 else None)
               for i in range(f.n) if f.entry[i] is not None}
    linked, todo = set(), [f.first_root]
    while todo:
        i = todo.pop()
        while i >= 0:
            linked.add(f.entry[i].sha)
            todo.append(int(f.first_child[i]))
            i = int(f.next_sibling[i])
    return {"entries": dict(idx.entries), "forest": parents, "linked": linked, "blocks": idx._blocks,
            "orphans": sorted(e.sha for e in idx.orphans), "torn": idx.torn, "bytes": idx.total_bytes(),
            "by_sha": sorted(idx._by_sha)}


def cold(store):
    """The index a listing of the store's directory makes from scratch (no journal, no snapshot)."""
    idx = DirectoryIndex(store.path, index_of(store).fits, index_of(store).min_tokens, index_of(store).keys, journal=False)
    idx.refresh()
    return idx


def assert_as_listed(store):
    got, want = state(index_of(store)), state(cold(store))
    assert got["entries"].keys() == want["entries"].keys()
    for name, e in want["entries"].items():
        assert got["entries"][name] == e, name
        assert vars(got["entries"][name]).items() <= vars(e).items(), name
    assert got == want


# ---- the snapshot is used, and holds what a listing gives ------------------------------

def test_an_open_from_the_snapshot_reads_no_envelope_and_holds_what_a_listing_gives(tmp_path, reads):
    d = tmp_path / "kv"
    saved = fill(d)
    assert os.path.exists(d / SNAPSHOT_NAME)
    reads["n"] = 0
    with open_store(d) as s:
        assert reads["n"] == 0
        assert_as_listed(s)
        for j in range(6):
            text, _, offsets = chain_of(j)
            e = s.find(text[:offsets[5 * BLOCK]] + b"\x00 and then something else")
            assert e is not None and e.tokens == 5 * BLOCK
            ck = s.load(e)
            assert ck is not None and ck.tokens.tolist() == list(range(1000 * j, 1000 * j + 5 * BLOCK))
        assert s.find("a whole prompt number 2, continued").sha == saved[-1].sha
        assert s.find(b"nothing stored starts like this") is None


def test_every_entry_comes_back_field_for_field(tmp_path):
    d = tmp_path / "kv"
    fill(d)
    # A name in upper-case hex is a checkpoint's name too (docs/format.md §2).
    name = checkpoint_files(d)[0]
    os.rename(d / name, d / (name[:40].upper() + ".kv"))
    with open_store(d):
        pass
    snap = index_snapshot.read(str(d), os.stat(d))
    assert snap is not None and sorted(snap.names) == checkpoint_files(d)
    for name, e in zip(snap.names, snap.entries):
        want = read_entry(os.path.join(d, name))
        assert e == want and e.path == want.path and e.name == name
        assert type(e.reason) is type(want.reason) and type(e.ext_flags) is type(want.ext_flags)


def test_sealed_entries_come_back_with_their_key_id_and_lookup_tag(tmp_path, reads):
    pytest.importorskip("cryptography")
    d, key = tmp_path / "kv", bytes(range(32))
    with open_store(d, key=key) as s:
        for j in range(3):
            save_chain(s, j)
    with open_store(d, key=key, layout="whole") as s:
        s.save("a sealed whole prompt", list(range(8)), make_tensors(8))
    reads["n"] = 0
    with open_store(d, key=key) as s:
        assert reads["n"] == 0
        assert all(e.key_id and e.lookup_tag for e in index_of(s).entries.values())
        assert_as_listed(s)
        text, _, offsets = chain_of(1)
        assert s.find(text[:offsets[3 * BLOCK]] + b"\x00!").tokens == 3 * BLOCK
        assert s.find("a sealed whole prompt, continued") is not None


def test_orphans_and_files_of_other_models_are_as_a_listing_leaves_them(tmp_path, reads):
    d = tmp_path / "kv"
    saved = fill(d)
    with open_store(d, model_id=7) as s:
        save_chain(s, 40)
    # A block cut out of a chain leaves the blocks after it orphaned until
    # a store removes them under its lock; the index lists them as such.
    text, ids, offsets = chain_of(2)
    middle = kvstore.format.sha1(text[:offsets[4 * BLOCK]]).hex() + ".kv"
    os.unlink(d / middle)
    idx = DirectoryIndex(str(d), lambda e: e.model_id == 0, 1)
    idx.refresh()
    assert len(idx.orphans) == 6
    idx._unsaved = 1
    idx.close()                                     # writes the snapshot, orphans and all
    reads["n"] = 0
    idx = DirectoryIndex(str(d), lambda e: e.model_id == 0, 1)
    idx.refresh()
    assert reads["n"] == 0
    ref = DirectoryIndex(str(d), lambda e: e.model_id == 0, 1, journal=False)
    ref.refresh()
    assert state(idx) == state(ref) and len(idx.orphans) == 6
    assert idx.longest_prefix(text[:offsets[3 * BLOCK]] + b"!").tokens == 3 * BLOCK
    assert idx.longest_prefix(text[:offsets[6 * BLOCK]] + b"!").tokens == 3 * BLOCK
    assert saved


# ---- a crash while it is written ---------------------------------------------------------

_WRITER = """
import os, sys, time
sys.path.insert(0, sys.argv[2])
from kvstore import index
# The snapshot is written in a few milliseconds: each one waits a moment,
# fully written under its temporary name, before its rename, so that the
# kill lands while a snapshot is being written.
_rename = os.rename
def rename(src, dst, *args, **kwargs):
    if ".index.tmp." in str(src):
        time.sleep(0.05)
    return _rename(src, dst, *args, **kwargs)
os.rename = rename
from test_index_snapshot import open_store, save_chain
index.SNAPSHOT_MIN_ENTRIES = 1
for j in range(1000, 100000):
    with open_store(sys.argv[1]) as s:            # each close writes the snapshot
        print(save_chain(s, j).sha, flush=True)
"""


def test_a_writer_killed_while_it_writes_the_snapshot_hides_no_file(tmp_path):
    d = tmp_path / "kv"
    with open_store(d) as s:
        for j in range(150):                        # a snapshot that takes a while to write
            save_chain(s, j)
    for attempt in range(5):
        # Run from tmp_path: the repository's kvstore/ must not shadow the installed package.
        child = subprocess.Popen([sys.executable, "-c", _WRITER, str(d), os.path.dirname(__file__)],
                                 stdout=subprocess.PIPE, text=True, cwd=tmp_path)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not any(n.startswith(SNAPSHOT_NAME + ".tmp.") for n in os.listdir(d)):
            pass
        child.send_signal(signal.SIGKILL)
        saved = child.communicate()[0].split()
        child.wait()
        debris = [n for n in os.listdir(d) if n.startswith(SNAPSHOT_NAME + ".tmp.")]
        if debris:
            break
    assert debris, "no kill landed while a snapshot was being written"
    with open_store(d) as s:
        assert_as_listed(s)
        names = set(index_of(s).entries)
        assert all(sha + ".kv" in names for sha in saved)
        assert not any(n.startswith(SNAPSHOT_NAME + ".tmp.") for n in os.listdir(d))       # debris removed


# ---- a snapshot that must not be used ----------------------------------------------------

@pytest.mark.parametrize("damage", ["truncated", "flipped", "empty", "garbage", "symlink", "directory", "fifo"])
def test_a_damaged_snapshot_is_rebuilt_from_a_listing(tmp_path, reads, damage):
    d = tmp_path / "kv"
    fill(d)
    snap = d / SNAPSHOT_NAME
    size = os.path.getsize(snap)
    if damage == "truncated":
        os.truncate(snap, size // 2)
    elif damage == "flipped":
        with open(snap, "r+b") as f:
            f.seek(size // 3)
            b = f.read(1)
            f.seek(size // 3)
            f.write(bytes([b[0] ^ 0x10]))
    elif damage == "empty":
        os.truncate(snap, 0)
    elif damage == "garbage":
        snap.write_bytes(os.urandom(size))
    elif damage == "symlink":
        os.replace(snap, tmp_path / "elsewhere")
        os.symlink(tmp_path / "elsewhere", snap)
    elif damage == "directory":
        os.unlink(snap)
        os.mkdir(snap)
    else:
        os.unlink(snap)
        os.mkfifo(snap, 0o600)
    reads["n"] = 0
    with open_store(d) as s:
        assert reads["n"] == len(checkpoint_files(d))             # every envelope read again
        assert_as_listed(s)
    if damage in ("truncated", "flipped", "empty", "garbage"):
        assert index_snapshot.read(str(d), os.stat(d)) is not None      # and written anew


def test_a_snapshot_copied_from_another_directory_is_not_used(tmp_path, reads):
    a, b = tmp_path / "a", tmp_path / "b"
    fill(a)
    with open_store(b) as s:
        save_chain(s, 77)
    shutil.copy2(a / SNAPSHOT_NAME, b / SNAPSHOT_NAME)
    reads["n"] = 0
    with open_store(b) as s:
        assert reads["n"] == len(checkpoint_files(b))
        assert_as_listed(s)
        assert not set(index_of(s).entries) & set(checkpoint_files(a))
    # A copy of a whole directory is another directory too.
    shutil.copytree(a, tmp_path / "c")
    reads["n"] = 0
    with open_store(tmp_path / "c") as s:
        assert reads["n"] == len(checkpoint_files(a))
        assert_as_listed(s)


def test_a_snapshot_from_before_the_boot_is_not_used(tmp_path, reads, monkeypatch):
    d = tmp_path / "kv"
    fill(d)
    booted = kvstore.temps.boot_time()
    monkeypatch.setattr(kvstore.temps, "boot_time", lambda: booted + 60)   # the machine restarted since
    reads["n"] = 0
    with open_store(d) as s:
        assert reads["n"] == len(checkpoint_files(d))
        assert_as_listed(s)


# ---- changes behind the snapshot's back --------------------------------------------------

def test_files_added_and_removed_through_the_journal_are_seen(tmp_path, reads):
    d = tmp_path / "kv"
    fill(d)
    snapshot = (d / SNAPSHOT_NAME).read_bytes()
    with open_store(d) as s:
        added = save_chain(s, 50)
        gone = s.find(chain_of(1)[0] + b"!")
        s.wipe(gone)                                  # the whole chain's last block
    (d / SNAPSHOT_NAME).write_bytes(snapshot)         # as if the writer had died before its close
    reads["n"] = 0
    with open_store(d) as s:
        assert reads["n"] == CHAIN_TOKENS // BLOCK     # the new chain's blocks only
        assert_as_listed(s)
        assert s.find(chain_of(50)[0] + b"!").sha == added.sha
        assert gone.name not in index_of(s).entries


@pytest.mark.parametrize("how", ["added", "removed", "replaced"])
def test_files_changed_without_the_journal_are_seen(tmp_path, reads, how):
    d, other = tmp_path / "kv", tmp_path / "other"
    fill(d)
    with open_store(other) as s:
        foreign = save_chain(s, 60)
    name = checkpoint_files(d)[0]
    time.sleep(index.MTIME_GRANULARITY_NS / 1e9)
    if how == "added":
        for n in checkpoint_files(other):
            shutil.copy2(other / n, d / n)
    elif how == "removed":
        os.unlink(d / name)
    else:
        # Another tool puts another file at a name the snapshot holds.
        with open_store(tmp_path / "spare", layout="whole") as s:
            spare = s.save("another text entirely", list(range(8)), make_tensors(8))
        os.replace(spare.path, d / name)
    reads["n"] = 0
    with open_store(d) as s:
        assert reads["n"] <= 10                         # the changed files only
        assert_as_listed(s)
        if how == "added":
            assert s.find(chain_of(60)[0] + b"!").sha == foreign.sha
        elif how == "removed":
            assert name not in index_of(s).entries
        else:
            assert index_of(s).entries[name].tokens == 8 and index_of(s).entries[name].payload_abi == 16


def test_a_journal_started_again_or_removed_makes_the_open_stat_every_file(tmp_path, reads):
    d = tmp_path / "kv"
    fill(d)
    for step in ("rotated", "removed"):
        with open_store(d) as s:
            added = save_chain(s, 70 if step == "rotated" else 71)
            snapshot = (d / SNAPSHOT_NAME).read_bytes()
        (d / SNAPSHOT_NAME).write_bytes(snapshot)
        if step == "rotated":
            os.replace(d / JOURNAL_NAME, tmp_path / "old-journal")
            (d / JOURNAL_NAME).write_bytes(b"")
        else:
            os.unlink(d / JOURNAL_NAME)
        reads["n"] = 0
        with open_store(d) as s:
            assert reads["n"] <= CHAIN_TOKENS // BLOCK
            assert_as_listed(s)
            assert s.find(chain_of(70 if step == "rotated" else 71)[0] + b"!").sha == added.sha


def test_a_store_open_meanwhile_keeps_up_with_the_snapshots_writes(tmp_path):
    d = tmp_path / "kv"
    fill(d)
    with open_store(d) as reader:
        reader.find("warm")
        for j in range(3):
            with open_store(d) as writer:             # its close replaces the snapshot
                e = save_chain(writer, 80 + j)
            assert reader.find(chain_of(80 + j)[0] + b"!").sha == e.sha
            assert_as_listed(reader)


# ---- what the snapshot holds, and who may read it ----------------------------------------

def test_the_snapshot_holds_no_prompt_text_and_is_private(tmp_path):
    d = tmp_path / "kv"
    secret = b"the confidential prompt " + os.urandom(8).hex().encode() + b" "
    with open_store(d, layout="whole") as s:
        s.save(secret * 20, list(range(8)), make_tensors(8))
    with open_store(d) as s:
        text, ids, offsets = chain_of(3)
        s.save(secret + text, ids, {"k": (ids % 251).astype(np.uint8)[:, None]}, positional={"k": 0},
               text_offsets=[0] + [len(secret) + o for o in offsets[1:]])
    data = (d / SNAPSHOT_NAME).read_bytes()
    for i in range(0, len(secret) - 8):
        assert secret[i:i + 8] not in data
    for i in range(0, len(text) - 8, 3):
        assert text[i:i + 8] not in data
    assert os.stat(d / SNAPSHOT_NAME).st_mode & 0o777 == 0o600
    # It names only files that are there.
    snap = index_snapshot.read(str(d), os.stat(d))
    assert sorted(snap.names) == checkpoint_files(d)
    # Wiped: the snapshot names none of them any more.
    with open_store(d) as s:
        s.wipe()
    assert not os.path.exists(d / SNAPSHOT_NAME) or not index_snapshot.read(str(d), os.stat(d)).names


def test_a_small_directory_keeps_no_snapshot(tmp_path, monkeypatch):
    monkeypatch.setattr(index, "SNAPSHOT_MIN_ENTRIES", 1000)
    d = tmp_path / "kv"
    fill(d)
    assert not os.path.exists(d / SNAPSHOT_NAME)


def test_stale_temporary_snapshots_are_removed_and_live_ones_kept(tmp_path):
    d = tmp_path / "kv"
    fill(d)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        stale = d / f"{SNAPSHOT_NAME}.tmp.{dead.pid}.00ff"
        live = d / f"{SNAPSHOT_NAME}.tmp.{sleeper.pid}.00ff"
        stale.write_bytes(b"half a snapshot")
        live.write_bytes(b"a snapshot being written")
        with open_store(d) as s:
            assert_as_listed(s)
        assert not stale.exists() and live.exists()
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_long_running_store_writes_the_snapshot_as_it_goes(tmp_path, monkeypatch, reads):
    monkeypatch.setattr(index, "SNAPSHOT_EVERY_CHANGES", 25)
    d = tmp_path / "kv"
    fill(d)
    with open_store(d) as s:
        for j in range(3):
            save_chain(s, 90 + j)                     # 10 blocks each: a snapshot after the third
        snap = index_snapshot.read(str(d), os.stat(d))
        assert sorted(snap.names) == checkpoint_files(d)
        reads["n"] = 0
        with open_store(d) as other:                  # meanwhile: from that snapshot, nothing to read
            assert reads["n"] == 0
            assert_as_listed(other)


def test_two_names_of_one_digest_are_both_kept(tmp_path, reads):
    d = tmp_path / "kv"
    saved = fill(d)
    if folds_case(d):
        pytest.skip("this filesystem folds case: a digest's upper-case name is its lower-case file")
    whole = saved[-1]
    shutil.copy2(whole.path, d / (whole.name[:40].upper() + ".kv"))
    with open_store(d) as s:
        assert len(index_of(s).entries) == len(checkpoint_files(d))
    reads["n"] = 0
    with open_store(d) as s:
        assert reads["n"] == 0
        assert_as_listed(s)
        assert s.find("a whole prompt number 2, continued").sha == whole.sha
