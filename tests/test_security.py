"""Security and privacy (docs/semantics.md §12).

- Modes: the directory 0700 and every file 0600 under umask 0 and 077, after
  every kind of write (test_store.py checks the basic save and quarantine
  under four umasks; here every path the store ever creates is walked;
  test_crash.py checks the temporary files a killed writer leaves, under
  umask 0).
- Symlinks: one planted in place of a .kv file, pointing at a valid
  checkpoint outside, is followed by nothing: find, load (with an entry found
  before the swap), entries, stats, touch, verify, evict, wipe, save (the
  kept-file path included) and the CLI.  A planted quarantine directory or
  lock file is not followed either (test_faults.py checks the basic save
  over a planted link).
- Names: only 40 hex digits + ".kv" are checkpoints; copies of a valid file
  under any other name are never listed, loaded, counted, evicted or wiped.
- No path comes from file contents: texts, meta, tensor names and titles
  that look like paths create nothing anywhere.
- Prompt privacy: every flow (store, sessions, corrupt files, eviction,
  wipe, the CLI with -v) runs with distinctive prompts while all logging is
  captured at DEBUG (the kvstore logger and the root), plus every exception
  message and every CLI output; none holds any piece of a prompt, except
  `inspect --text`, which must.
- wipe() overwrites text, payload and trailer before unlinking, seen through
  a descriptor opened before the wipe (test_store.py checks through hard
  links); the CLI wipe too.
- max_age_s deletes old checkpoints on open and on every eviction pass:
  explicit evict(), save(), save_async(); a header without timestamps ages
  by its file's mtime (test_eviction.py checks the open and the save pass).
"""

import logging
import os
import shutil
import stat
import subprocess
import sys
import time

import numpy as np
import pytest

import kvstore
from kvstore import KVStore, sessions
from kvstore.files import QUARANTINE_DIR, verify_file, wipe_file
from kvstore.store import LOCK_NAME

from kvhelpers import OPTS, flip, folds_case, make_store, make_tensors


def mode(path):
    return stat.S_IMODE(os.lstat(path).st_mode)


def walk(d):
    """Every directory and file under d, d included."""
    out = [d]
    for root, dirs, files in os.walk(d):
        out += [os.path.join(root, n) for n in dirs + files]
    return out


# ---- modes -------------------------------------------------------------------------

@pytest.mark.parametrize("umask", [0o000, 0o077])
def test_every_path_the_store_creates_is_private(tmp_path, umask):
    old = os.umask(umask)
    try:
        d = tmp_path / "deep" / "kv"
        with KVStore(d, **OPTS, quarantine=True, budget_mb=0.05) as s:
            s.save("plain", [1, 2], make_tensors())
            s.save_async("async", [1, 2], make_tensors(seed=1)).result()
            s.save("plain", [1, 2], make_tensors(), trailers={3: "retitled"})     # kept, rewritten
            sessions.save(s, "a session", [1, 2, 3], make_tensors(seed=2), title="t",
                          system_text="a", system_tokens=[1], system_tensors=make_tensors(seed=3))
            bad = s.save("to be corrupted", [1, 2], make_tensors(seed=4))
            flip(bad.path, bad.file_size - 2)
            assert s.load(s.find("to be corrupted!")) is None                     # quarantined
            for i in range(6):
                s.save(f"filler {i}", [1, 2], make_tensors(seed=i, n=2048))       # evictions
        paths = walk(str(d))
        assert os.path.join(str(d), QUARANTINE_DIR) in paths and os.path.join(str(d), LOCK_NAME) in paths
        for p in paths:
            want = 0o700 if os.path.isdir(p) else 0o600
            assert mode(p) == want, (p, oct(mode(p)))
    finally:
        os.umask(old)


# ---- symlinks ----------------------------------------------------------------------

TEXT = "a prompt whose checkpoint is swapped for a symlink"


@pytest.fixture
def planted(tmp_path):
    """A store whose one checkpoint was replaced by a symlink to a copy outside.

    Returns (store, entry found before the swap, outside path, outside bytes).
    """
    s = make_store(tmp_path / "kv", quarantine=True)
    e = s.save(TEXT, [1, 2, 3], make_tensors(), trailers={3: "title"})
    found = s.find(TEXT + "!")
    outside = tmp_path / "outside.kv"
    shutil.copyfile(e.path, outside)
    os.unlink(e.path)
    os.symlink(outside, e.path)
    yield s, found, str(outside), outside.read_bytes()
    s.close()


def test_planted_symlink_is_never_read(planted):
    s, found, outside, before = planted
    assert s.find(TEXT + "!") is None
    assert s.entries() == [] and s.stats()["bytes"] == 0 and s.stats()["entries"] == 0
    assert s.load(found) is None                                  # an entry from before the swap
    assert verify_file(found.path).startswith("unsafe_path")
    with pytest.raises(kvstore.errors.UnsafePath):
        kvstore.format.read_entry(found.path)
    with pytest.raises(kvstore.errors.UnsafePath):
        kvstore.format.touch(found.path)
    assert sessions.list(s) == []
    assert open(outside, "rb").read() == before                   # no hit recorded through it
    assert os.path.islink(found.path)                             # not "removed as corrupt" either


def test_planted_symlink_is_never_written_through(planted):
    s, found, outside, before = planted
    assert s.evict() == []
    assert s.wipe(found) == 0                                     # not overwritten through the link
    assert s.wipe() == 0
    assert open(outside, "rb").read() == before
    # Saving the same text (compatible, with a trailer: the kept-file path)
    # replaces the link itself.
    e = s.save(TEXT, [1, 2, 3], make_tensors(), trailers={3: "new title"})
    assert e is not None and stat.S_ISREG(os.lstat(e.path).st_mode)
    assert open(outside, "rb").read() == before
    os.unlink(e.path)
    os.symlink(outside, e.path)
    e = s.save_async(TEXT, [1, 2, 3], make_tensors(seed=5)).result()
    assert e is not None and not os.path.islink(e.path)
    assert open(outside, "rb").read() == before
    ck = s.load(s.find(TEXT + "!"))
    assert np.array_equal(ck.tensors["k"], make_tensors(seed=5)["k"])
    # discard() of the old entry: at most the link itself is moved aside.
    os.unlink(e.path)
    os.symlink(outside, e.path)
    s.discard(found, "test")
    assert open(outside, "rb").read() == before


def test_planted_symlink_and_the_cli(planted, tmp_path):
    s, found, outside, before = planted
    d = s.path
    out = cli(tmp_path, "ls", d, "--json")
    assert out.returncode == 0 and "[]" in out.stdout
    out = cli(tmp_path, "inspect", found.path)
    assert out.returncode != 0 and "symlink" in out.stderr
    out = cli(tmp_path, "verify", d)
    assert out.returncode == 1 and "symlink" in out.stdout + out.stderr     # reported, not followed
    out = cli(tmp_path, "verify", d, "--quarantine")                      # moves the link itself aside
    out = cli(tmp_path, "wipe", d, "--yes")
    assert out.returncode == 0
    assert open(outside, "rb").read() == before
    q = os.path.join(d, QUARANTINE_DIR, found.name)
    assert os.path.islink(found.path) or os.path.islink(q)


def test_planted_quarantine_symlink_is_not_followed(tmp_path):
    """A corrupt file holds prompt text: moving it into a planted link would
    take it out of the private directory (this once happened)."""
    public = tmp_path / "public"
    public.mkdir()
    with make_store(tmp_path / "kv", quarantine=True) as s:
        os.symlink(public, os.path.join(s.path, QUARANTINE_DIR))
        e = s.save(TEXT, [1, 2, 3], make_tensors())
        flip(e.path, e.file_size - 3)
        assert s.load(s.find(TEXT + "!")) is None
        assert os.listdir(public) == []
        assert os.path.exists(e.path)                              # kept in place, not moved out


def test_cli_verify_quarantine_does_not_follow_a_planted_link(tmp_path):
    public = tmp_path / "public"
    public.mkdir()
    with make_store(tmp_path / "kv") as s:
        e = s.save(TEXT, [1, 2, 3], make_tensors())
        flip(e.path, e.file_size - 3)
        os.symlink(public, os.path.join(s.path, QUARANTINE_DIR))
    p = cli(tmp_path, "verify", tmp_path / "kv", "--quarantine")
    assert p.returncode == 1 and "Traceback" not in p.stderr
    assert os.listdir(public) == [] and os.path.exists(e.path)


def test_planted_lock_symlink_is_not_followed(tmp_path):
    d = tmp_path / "kv"
    d.mkdir(mode=0o700)
    target = tmp_path / "lock-target"
    os.symlink(target, d / LOCK_NAME)
    with pytest.raises(kvstore.errors.UnsafePath):                       # a KVStoreError, not a bare OSError
        KVStore(d, **OPTS)
    assert not target.exists()


def test_store_path_that_is_a_symlink_is_refused(tmp_path):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    os.symlink(real, tmp_path / "link")
    with pytest.raises(kvstore.errors.UnsafePath):
        KVStore(tmp_path / "link", **OPTS)


# ---- names ---------------------------------------------------------------------------

def test_only_40_hex_names_are_checkpoints(tmp_path):
    with make_store(tmp_path / "kv", budget_mb=0) as s:
        e = s.save(TEXT, [1, 2, 3], make_tensors())
        sha = e.sha
        bad_names = ["abc.kv", sha[:39] + ".kv", sha + "0.kv", sha + ".KV", sha + ".kv.bak", "." + sha + ".kv",
                     sha + ".kvx", " " + sha + ".kv", "g" * 40 + ".kv", sha[:38] + "-_.kv", sha + ".kv~",
                     sha + ".kv.tmp"]
        if folds_case(s.path):               # there sha + ".KV" is the checkpoint itself
            bad_names.remove(sha + ".KV")
        for n in bad_names:
            shutil.copyfile(e.path, os.path.join(s.path, n))
        os.mkdir(os.path.join(s.path, "sub"))
        shutil.copyfile(e.path, os.path.join(s.path, "sub", e.name))
        upper = sha.upper() + ".kv"                                # accepted on read (docs/format.md §2)
        os.rename(e.path, os.path.join(s.path, upper))
        assert [x.name for x in s.entries()] == [upper]
        assert s.stats()["bytes"] == e.file_size
        ck = s.load(s.find(TEXT + "!"))
        assert ck is not None and ck.entry.name == upper
        assert s.wipe() == 1
    with make_store(tmp_path / "kv", budget_mb=0.000001) as s:     # opening evicts to a tiny budget
        assert s.entries() == []
    left = sorted(os.listdir(tmp_path / "kv"))
    for n in bad_names + ["sub"]:
        assert n in left, n
    for n in bad_names:
        assert open(tmp_path / "kv" / n, "rb").read(3) == b"KVC"      # never wiped, evicted or moved


def test_no_path_is_built_from_file_contents(tmp_path):
    """Path-like texts, meta, tensor names and titles write nowhere but the store."""
    evil = "../../../escape/" + "x" * 10
    d = tmp_path / "a" / "kv"
    with make_store(d, quarantine=True) as s:
        t = {evil: np.ones(8, np.float32), "/abs/path": np.zeros(4, np.uint8), "..\\..\\win": np.ones(2)}
        e = s.save(evil, [1, 2], t, meta={"path": evil, "file": "/etc/passwd"}, trailers={3: evil, 0: {evil: evil}})
        sessions.save(s, "/tmp/" + evil, [1, 2], t, title=evil)
        ck = s.load(s.find(evil + "!"))
        assert ck is not None and set(ck.tensors) == set(t)
        assert [i.title for i in sessions.list(s)] == [evil]
        # A valid file copied under another valid name: its text does not hash to it.
        other = os.path.join(s.path, "0" * 40 + ".kv")
        shutil.copyfile(e.path, other)
        assert verify_file(other).startswith("text_hash")
        assert s.load(kvstore.format.read_entry(other)) is None
        flip(e.path, e.trailer_offset - 1)
        s.load(s.find(evil + "!"))                                 # corrupt: quarantined by its own name
        s.evict()
    before = set(walk(str(tmp_path)))
    assert all(p.startswith(str(d)) or str(d).startswith(p) for p in before), before
    assert not (tmp_path / "escape").exists() and not os.path.exists("/abs/path")
    assert sorted(os.listdir(os.path.join(d, QUARANTINE_DIR))) == sorted([e.name, "0" * 40 + ".kv"])


# ---- prompt privacy ------------------------------------------------------------------------

# Each prompt carries pieces that must never show up anywhere: an ASCII word,
# a non-ASCII phrase and a tool result.
PIECES = ["ZEBRA-QUARTZ-7341", "секретный-пароль", "tool-result-HUNTER2"]
PROMPTS = [f"system: {PIECES[0]} user: {PIECES[1]} tool: {PIECES[2]} turn {i}" for i in range(4)]


def forms(piece):
    """The ways a piece of prompt could leak: as is, escaped, encoded, hex."""
    b = piece.encode()
    return {piece, b.hex(), repr(b)[2:-1], piece.encode("unicode_escape").decode(),
            ascii(piece)[1:-1], b.decode("latin-1")}


def assert_private(text, where):
    for piece in PIECES:
        for f in forms(piece):
            assert f not in text, f"{where}: prompt piece {f!r} in {text[:2000]!r}"


def cli(cwd, *args):
    env = {k: v for k, v in os.environ.items() if k != "KVSTORE_DEBUG"}
    return subprocess.run([sys.executable, "-m", "kvstore", *map(str, args)], cwd=cwd, capture_output=True,
                          text=True, timeout=120, env=env)


def test_no_prompt_text_anywhere(tmp_path, caplog, capfd):
    caplog.set_level(logging.DEBUG)
    caplog.set_level(logging.DEBUG, logger="kvstore")
    errors = []

    def attempt(fn, *a, **kw):
        try:
            return fn(*a, **kw)
        except Exception as e:                                     # noqa: BLE001 - collected and checked
            errors.append(f"{type(e).__name__}: {e} {e.args!r}")
            return None

    d = tmp_path / "kv"
    with make_store(d, min_tokens=2, cold_max_tokens=40, budget_mb=0.25,
                    quarantine=True) as s:
        attempt(s.save, PROMPTS[0], [1], make_tensors())                            # refused: min_tokens
        attempt(s.save, PROMPTS[0], [1, 2], {"x": np.zeros(1 << 20, np.uint8)})    # refused: budget
        attempt(s.save, PROMPTS[0], [-1, 2], make_tensors())                        # ValueError
        attempt(s.save, PROMPTS[0], [1, 2], {"": np.zeros(2)})                      # ValueError
        attempt(s.save, PROMPTS[0], [1, 2], make_tensors(), meta={"f": object()})   # not JSON
        attempt(s.save, PROMPTS[0], [1, 2], make_tensors(), trailers={3: 5})        # TypeError
        e = s.save(PROMPTS[0], [1, 2], make_tensors(), trailers={0: {"call": PIECES[2]}, 3: "a title"})
        s.save(PROMPTS[0], [1, 2], make_tensors(), trailers={3: "another title"})   # kept
        ck = s.load(s.find(PROMPTS[0] + " more"))                                   # hit
        s.find(PIECES[0])                                                           # miss
        s.save_async(PROMPTS[1], list(range(50)), make_tensors(seed=1)).result()    # consumed on load
        s.load(s.find(PROMPTS[1] + "!"), consume=True)
        sessions.save(s, PROMPTS[2], [1, 2, 3], make_tensors(seed=2), title="work")
        info = sessions.list(s)
        attempt(sessions.switch, s, "zz")
        attempt(sessions.switch, s, "0123456789")
        sessions.switch(s, info[0].sha[:8])
        for i in range(8):                                                          # evictions
            s.save(f"{PROMPTS[3]} filler {i}", [1, 2], make_tensors(seed=i, n=4096))
        bad = s.save(PROMPTS[3] + " corrupt", [1, 2], make_tensors())
        flip(bad.path, bad.file_size - 1)
        s.load(s.find(PROMPTS[3] + " corrupt!"))                                    # quarantined
        attempt(kvstore.format.read_entry, os.path.join(s.path, QUARANTINE_DIR, bad.name))
        trunc = s.save(PROMPTS[3] + " truncated", [1, 2], make_tensors())
        os.truncate(trunc.path, 100)
        attempt(kvstore.format.read_entry, trunc.path)
        attempt(kvstore.format.touch, trunc.path)
        verify_file(trunc.path)
        reprs = [repr(x) for x in (e, ck, info, s.entries(), s.stats())]
        survivor = s.save(PROMPTS[0] + " kept for the CLI", [1, 2], make_tensors(seed=9))
    with make_store(d, max_age_s=0) as s:                                          # max age on open
        pass
    with make_store(d) as s:
        survivor = s.save(PROMPTS[0] + " kept for the CLI", [1, 2], make_tensors(seed=9))
        sessions.save(s, PROMPTS[2], [1, 2, 3], make_tensors(seed=2), title="work")
        other = s.save(PROMPTS[1] + " corrupt for verify", [1, 2], make_tensors())
        flip(other.path, other.file_size - 1)

    outputs = []
    for args in (["ls", d], ["ls", d, "--json"], ["inspect", survivor.path], ["inspect", survivor.sha[:10], "--dir", d],
                 ["stats", d], ["stats", d, "--json"], ["session", "list", d], ["session", "list", d, "--json"],
                 ["verify", d], ["verify", d, "--quarantine"], ["evict", d, "--budget-mb", "0.0001", "--dry-run"],
                 ["evict", d, "--budget-mb", "1"]):
        p = cli(tmp_path, "-v", *args)                  # -v: every store event logged to stderr
        assert "Traceback" not in p.stderr, (args, p.stderr)
        outputs.append((args, p.stdout + p.stderr))
    shown = cli(tmp_path, "inspect", survivor.path, "--text")
    assert shown.returncode == 0 and PIECES[0] in shown.stdout and PIECES[1] in shown.stdout
    p = cli(tmp_path, "-v", "wipe", d, "--yes")
    outputs.append((["wipe"], p.stdout + p.stderr))
    assert p.returncode == 0

    for args, text in outputs:
        assert_private(text, f"kvstore {' '.join(map(str, args))}")
    captured = capfd.readouterr()
    assert_private(captured.out + captured.err, "this process's stdout/stderr")
    kinds = set()
    for r in caplog.records:
        msg = r.getMessage()
        kinds.add(msg.split()[1] if msg.startswith("kvstore: ") and len(msg.split()) > 1 else msg[:20])
        assert_private(msg + repr(r.args) + (r.exc_text or ""), f"log {r.name}:{r.levelname}")
    for err in errors:
        assert_private(err, "exception")
    for rep in reprs:
        assert_private(rep, "repr")
    # The flows did run: each kind of event was logged at least once.
    assert {"save_refused", "saved", "save_kept", "hit", "evicted", "corrupt"} <= kinds, kinds
    assert len(errors) >= 7


# ---- wipe ------------------------------------------------------------------------------------

def test_wipe_overwrites_every_byte_before_unlinking(tmp_path):
    with make_store(tmp_path / "kv") as s:
        e = s.save(PROMPTS[0], [1, 2, 3], make_tensors(), trailers={0: {"id": PIECES[2]}, 3: "title"})
        fd = os.open(e.path, os.O_RDONLY)              # a reader of the blocks, from before the wipe
        try:
            assert PIECES[0].encode() in os.pread(fd, e.file_size, 0)
            assert s.wipe(e) == 1
            assert not os.path.exists(e.path)
            after = os.pread(fd, e.file_size + 1, 0)
        finally:
            os.close(fd)
        assert after == bytes(e.file_size)             # text, payload and trailer: all zeros, same size


def test_cli_wipe_and_wipe_file_overwrite(tmp_path):
    d = tmp_path / "kv"
    witnesses = []
    with make_store(d, quarantine=True) as s:
        for i in range(3):
            e = s.save(f"{PROMPTS[i]} to wipe", [1, 2], make_tensors(seed=i))
            witnesses.append((tmp_path / f"w{i}", e.file_size))
            os.link(e.path, witnesses[-1][0])
        bad = s.save(PROMPTS[3] + " quarantined", [1, 2], make_tensors())
        flip(bad.path, bad.file_size - 1)
        s.load(s.find(PROMPTS[3] + " quarantined!"))
        q = os.path.join(s.path, QUARANTINE_DIR, bad.name)
        os.link(q, tmp_path / "wq")
        witnesses.append((tmp_path / "wq", bad.file_size))
    p = cli(tmp_path, "wipe", d, "--yes")
    assert p.returncode == 0, p.stderr
    for w, size in witnesses:
        assert w.read_bytes() == bytes(size), w
    assert not [n for n in os.listdir(d) if n.endswith(".kv")]
    # wipe_file: a file that is not a valid checkpoint (here a truncated one).
    junk = d / ("1" * 40 + ".kv")
    junk.write_bytes(b"KVC" + PIECES[0].encode() * 10)
    os.link(junk, tmp_path / "wj")
    assert wipe_file(junk) and not junk.exists()
    assert (tmp_path / "wj").read_bytes() == bytes(3 + 17 * 10)


# ---- maximum age ------------------------------------------------------------------------------

def _age(path, seconds):
    """Sets created_at `seconds` into the past (0 for None) and last_used to 0."""
    e = kvstore.format.read_entry(path)
    t = 0 if seconds is None else int(time.time()) - seconds
    h = kvstore.format.Header(quant_bits=e.quant_bits, tokens=e.tokens, ctx_size=e.ctx_size,
                       payload_bytes=e.payload_bytes, reason=e.reason, ext_flags=e.ext_flags,
                       model_id=e.model_id, hits=e.hits, payload_abi=e.payload_abi,
                       created_at=t, last_used=0)
    with open(path, "r+b") as f:
        f.write(h.pack())


def test_max_age_on_every_eviction_pass(tmp_path):
    d = tmp_path / "kv"
    with make_store(d, max_age_s=3600) as s:
        # Another process writes checkpoints while this store is open.
        with make_store(d) as writer:
            old = [writer.save(f"old {i}", [1, 2], make_tensors(seed=i)) for i in range(4)]
            fresh = writer.save("fresh", [1, 2], make_tensors(seed=9))
        for e in old:
            _age(e.path, 7200)
        assert s.find("old 0!") is not None                       # not yet: no pass since
        assert sorted(e.name for e in s.evict()) == sorted(e.name for e in old)
        assert not any(os.path.exists(e.path) for e in old)
        assert os.path.exists(fresh.path)
        # save(): the pass after it ages others out, never the new file.
        again = s.save("old 0", [1, 2], make_tensors())
        _age(again.path, 7200)
        s.save("newer", [1, 2], make_tensors())
        assert not os.path.exists(again.path)
        # save_async(): the same, from the writer thread.
        again = s.save("old 1", [1, 2], make_tensors())
        _age(again.path, 7200)
        s.save_async("newest", [1, 2], make_tensors()).result()
        assert not os.path.exists(again.path)
        assert s.stats()["evictions"] >= 6


def test_max_age_on_open_and_without_timestamps(tmp_path):
    d = tmp_path / "kv"
    with make_store(d) as s:
        stamped = s.save("stamped long ago", [1, 2], make_tensors())
        bare = s.save("no timestamps at all", [1, 2], make_tensors())
        recent_bare = s.save("no timestamps, new file", [1, 2], make_tensors())
        keep = s.save("recent", [1, 2], make_tensors())
    _age(stamped.path, 7200)
    _age(bare.path, None)                                          # created_at 0, last_used 0
    _age(recent_bare.path, None)
    old = time.time() - 7200
    os.utime(bare.path, (old, old))                                # ... and an old file
    with make_store(d, max_age_s=3600) as s:
        names = sorted(e.name for e in s.entries())
    assert names == sorted([recent_bare.name, keep.name])
