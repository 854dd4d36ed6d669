"""Faults (docs/format.md §3; docs/semantics.md §5, §11, §12): corrupt, truncated and vanished files,
read-only directories, a full disk, hostile names and impossible inputs.  A
fault is a miss or a refusal, never an exception in the serving loop, and it
never leaves a partial or corrupt visible file behind."""

import functools
import json
import logging
import os
import resource
import shutil
import signal
import stat
import struct
import tempfile

import numpy as np
import pytest

import kvstore
from kvstore.files import QUARANTINE_DIR
import kvhelpers
from kvhelpers import CTX, drop_root, flip, listing, make_store, make_tensors

PAYLOAD_HEAD = struct.Struct("<4sIQII")
TEXT = "a system prompt and a user turn"
PROMPT = TEXT + ", and the rest of the request"


# This file's saves: k and v, (4, 256) float16 each.
tensors = functools.partial(make_tensors, dtypes=("float16", "float16"))


def tmp_names(directory):
    return [n for n in os.listdir(directory) if ".tmp." in n]


def layout(path):
    """(payload start P, manifest length, data offset, manifest dict)."""
    e = kvstore.format.read_entry(path)
    with open(path, "rb") as f:
        f.seek(e.tensors_offset)
        _, mlen, doff, _, _ = PAYLOAD_HEAD.unpack(f.read(24))
        manifest = json.loads(f.read(mlen))
    return e.tensors_offset, mlen, doff, manifest


def rewrite_manifest(path, raw):
    """Puts raw (padded to the old length) in place of the manifest, with a valid CRC."""
    P, mlen, doff, _ = layout(path)
    assert len(raw) <= mlen
    raw = raw + b" " * (mlen - len(raw))
    with open(path, "r+b") as f:
        f.seek(P + 4)
        f.write(struct.pack("<I", mlen))
        f.seek(P + 16)
        f.write(struct.pack("<I", kvstore.format.crc32c(raw)))
        f.seek(P + 24)
        f.write(raw)


def assert_miss_and_removed(store, path, into="numpy"):
    e = store.find(PROMPT)
    assert e is not None
    corrupt = store.stats()["corrupt"]
    assert store.load(e, into=into) is None
    assert not os.path.exists(path)
    assert store.stats()["corrupt"] == corrupt + 1
    assert store.find(PROMPT) is None
    # The text can be stored again at once.
    assert store.save(TEXT, [1, 2, 3], tensors()) is not None
    assert store.load(store.find(PROMPT)) is not None


# ---- corrupt payloads ----------------------------------------------------------

@pytest.mark.parametrize("into", ["numpy", "mlx"])
@pytest.mark.parametrize("block", ["tokens", "k", "v"])
def test_flipped_payload_byte_is_a_miss_and_removed(store, caplog, into, block):
    if into == "mlx":
        pytest.importorskip("mlx.core")
    e = store.save(TEXT, [1, 2, 3], tensors())
    P, _, _, m = layout(e.path)
    b = m["tokens"] if block == "tokens" else next(t for t in m["tensors"] if t["name"] == block)
    flip(e.path, P + b["offset"] + 5)
    with caplog.at_level(logging.WARNING, logger="kvstore"):
        assert_miss_and_removed(store, e.path, into)
    assert any("corrupt" in r.getMessage() and "reason=crc" in r.getMessage() for r in caplog.records)


def test_corrupt_file_is_quarantined(tmp_path):
    with make_store(tmp_path / "kv", quarantine=True) as s:
        e = s.save(TEXT, [1, 2, 3], tensors())
        flip(e.path, e.file_size - 7)
        before = open(e.path, "rb").read()
        assert s.load(s.find(PROMPT)) is None
        qpath = os.path.join(s.path, QUARANTINE_DIR, e.name)
        assert not os.path.exists(e.path)
        assert open(qpath, "rb").read() == before          # moved aside intact, for a post-mortem
        assert stat.S_IMODE(os.stat(os.path.dirname(qpath)).st_mode) == 0o700
        assert [x.name for x in s.entries()] == []         # the quarantine is not a checkpoint
        assert s.stats()["corrupt"] == 1


def test_verify_off_skips_crc_checks(tmp_path):
    with make_store(tmp_path / "kv", verify=False) as s:
        e = s.save(TEXT, [1, 2, 3], tensors())
        P, _, _, m = layout(e.path)
        k = next(t for t in m["tensors"] if t["name"] == "k")
        flip(e.path, P + k["offset"], 0x80)
        ck = s.load(s.find(PROMPT))
        assert ck is not None                              # the CRC is what catches it
        assert not np.array_equal(ck.tensors["k"], tensors()["k"])
        assert np.array_equal(ck.tensors["v"], tensors()["v"])


# ---- truncation -----------------------------------------------------------------

@pytest.mark.parametrize("keep", [0, 10, 51, 60, 200, -1])
def test_truncated_after_find(store, keep):
    e = store.save(TEXT, [1, 2, 3], tensors())
    found = store.find(PROMPT)
    with open(e.path, "r+b") as f:
        f.truncate(keep if keep >= 0 else e.file_size - 1)
    assert store.load(found) is None
    assert not os.path.exists(e.path)


def test_truncated_before_find(tmp_path):
    d = tmp_path / "kv"
    with make_store(d) as s:
        e = s.save(TEXT, [1, 2, 3], tensors())
    os.truncate(e.path, e.file_size // 2)
    with make_store(d) as s:                               # lists the directory afresh
        assert s.find(PROMPT) is None                      # an invalid envelope is not indexed
        assert s.entries() == []
        assert s.stats()["bytes"] == 0                     # nor counted
        new = s.save(TEXT, [1, 2, 3], tensors(seed=1))     # replaced, not "kept"
        assert new.path == e.path
        assert new.file_size == e.file_size or s.kv_codec != "raw"     # packed: the size follows the values
        ck = s.load(s.find(PROMPT))
        assert np.array_equal(ck.tensors["k"], tensors(seed=1)["k"])


def test_truncated_in_place_under_an_open_store(store):
    e = store.save(TEXT, [1, 2, 3], tensors())
    os.truncate(e.path, e.file_size // 2)
    # The directory did not change, so the index may still offer the entry;
    # the load is then a miss and the file goes.
    found = store.find(PROMPT)
    assert found is None or store.load(found) is None
    assert store.find(PROMPT) is None
    assert store.save(TEXT, [1, 2, 3], tensors(seed=1)) is not None
    assert store.load(store.find(PROMPT)) is not None


# ---- manifest faults ---------------------------------------------------------------

def _mutate(path, fn):
    _, _, _, m = layout(path)
    fn(m)
    rewrite_manifest(path, json.dumps(m, separators=(",", ":")).encode())


def _big_shape(m):
    t = m["tensors"][0]
    t["shape"], t["nbytes"] = [2**31, 2**31], 2**63


def _offset_past_end(m):
    m["tensors"][1]["offset"] = 10**12


def _overlap(m):
    m["tensors"][1]["offset"] = m["tensors"][0]["offset"]


def _count(m):
    m["tokens"]["count"] = 2


def _dtype(m):
    m["tensors"][0]["dtype"] = "object"


def _unaligned(m):
    m["tensors"][1]["offset"] += 8


def _shape_mismatch(m):
    m["tensors"][0]["shape"] = [4, 255]


@pytest.mark.parametrize("damage", [
    pytest.param(lambda p: flip(p, layout(p)[0] + 30), id="manifest_byte_crc"),
    pytest.param(lambda p: rewrite_manifest(p, b"{not json" + b"\xff" * 20), id="garbage_valid_crc"),
    pytest.param(lambda p: rewrite_manifest(p, b"[1, 2, 3]"), id="not_an_object"),
    pytest.param(lambda p: rewrite_manifest(p, b'{"version": 2}'), id="version"),
    pytest.param(lambda p: _mutate(p, _big_shape), id="huge_shape"),
    pytest.param(lambda p: _mutate(p, _offset_past_end), id="offset_past_end"),
    pytest.param(lambda p: _mutate(p, _overlap), id="overlap"),
    pytest.param(lambda p: _mutate(p, _count), id="token_count"),
    pytest.param(lambda p: _mutate(p, _dtype), id="dtype"),
    pytest.param(lambda p: _mutate(p, _unaligned), id="unaligned"),
    pytest.param(lambda p: _mutate(p, _shape_mismatch), id="shape_vs_nbytes"),
    pytest.param(lambda p: flip(p, layout(p)[0]), id="payload_magic"),
    pytest.param(lambda p: flip(p, layout(p)[0] + 4, 0x80), id="manifest_length"),
    pytest.param(lambda p: flip(p, layout(p)[0] + 8, 0x08), id="data_offset"),
])
@pytest.mark.parametrize("into", ["numpy", "mlx"])
def test_manifest_faults(store, damage, into):
    if into == "mlx":
        pytest.importorskip("mlx.core")
    e = store.save(TEXT, [1, 2, 3], tensors())
    damage(e.path)
    assert_miss_and_removed(store, e.path, into)


def test_garbage_trailer_keeps_the_checkpoint(store):
    e = store.save(TEXT, [1, 2, 3], tensors(), trailers={3: "title"})
    with open(e.path, "r+b") as f:
        f.seek(e.trailer_offset + 17)
        f.write(b"\x00garbage")
    ck = store.load(store.find(PROMPT))
    assert ck is not None and ck.trailers == {}            # the section is dropped, the state is fine
    assert os.path.exists(e.path)


# ---- files that move under us ----------------------------------------------------

def test_file_deleted_between_find_and_load(store):
    e = store.save(TEXT, [1, 2, 3], tensors())
    found = store.find(PROMPT)
    os.unlink(e.path)
    misses = store.stats()["misses"]
    assert store.load(found) is None
    assert store.stats()["misses"] == misses + 1
    assert store.find(PROMPT) is None and store.entries() == []


def test_file_replaced_by_garbage_between_find_and_load(store):
    e = store.save(TEXT, [1, 2, 3], tensors())
    found = store.find(PROMPT)
    with open(e.path + ".new", "wb") as f:
        f.write(b"KVC" + os.urandom(200))
    os.replace(e.path + ".new", e.path)
    assert store.load(found) is None


def test_hostile_names_and_types_are_ignored(store, tmp_path):
    good = store.save(TEXT, [1, 2, 3], tensors())
    elsewhere = tmp_path / "elsewhere.bin"
    shutil.copyfile(good.path, elsewhere)
    os.unlink(good.path)
    os.symlink(elsewhere, good.path)                       # a planted symlink under the right name
    os.mkdir(os.path.join(store.path, "f" * 40 + ".kv"))    # a directory with a checkpoint name
    open(os.path.join(store.path, "e" * 40 + ".kv"), "wb").close()   # an empty file
    partial = os.path.join(store.path, good.name + f".tmp.{os.getpid()}.abcd")
    shutil.copyfile(elsewhere, partial)                    # a writer's partial file
    assert store.find(PROMPT) is None
    assert store.entries() == []
    assert store.evict() == []
    with pytest.raises(kvstore.errors.UnsafePath):
        kvstore.format.read_entry(good.path)
    # Saving replaces the symlink itself and never writes through it.
    before = elsewhere.read_bytes()
    e = store.save(TEXT, [1, 2, 3], tensors(seed=2))
    assert e is not None and not os.path.islink(e.path)
    assert elsewhere.read_bytes() == before
    assert np.array_equal(store.load(store.find(PROMPT)).tensors["k"], tensors(seed=2)["k"])


# ---- read-only directory ------------------------------------------------------------

def _read_only_child(path, q):
    try:
        drop_root()
        out = {"euid": os.geteuid()}
        d = os.path.join(path, "kv")
        with make_store(d) as s:
            s.save(TEXT, [1, 2, 3], tensors())
            os.chmod(d, 0o500)
            before = listing(d)
            out["save"] = s.save("another text", [1, 2, 3], tensors())
            out["async"] = s.save_async("a third text", [1, 2, 3], tensors()).result()
            out["left_behind"] = sorted(set(listing(d)) - set(before))
            ck = s.load(s.find(PROMPT))                   # reading still works
            out["load"] = ck is not None and np.array_equal(ck.tensors["k"], tensors()["k"])
            out["save_errors"] = s.stats()["save_errors"]
        try:
            make_store(d)
            out["open"] = "opened"
        except kvstore.KVStoreError as e:
            out["open"] = (type(e).__name__, isinstance(e, OSError), e.errno)
        out["listing_after_open"] = listing(d) == before
        os.chmod(d, 0o700)
        with make_store(d) as s:
            out["save_after"] = s.save("another text", [1, 2, 3], tensors()) is not None
        q.put(out)
    except BaseException as e:
        q.put(repr(e))


@pytest.mark.skipif(kvhelpers.SPAWNED_AS_ROOT, reason="a spawned child that drops root cannot import from "
                    "root's private folders (kvhelpers.SPAWNED_AS_ROOT)")
def test_read_only_directory(tmp_path):
    base = tempfile.mkdtemp(prefix="kvstore-ro-")          # reachable by an unprivileged child
    try:
        if os.geteuid() == 0:
            os.chown(base, 65534, 65534)
        q = CTX.Queue()
        p = CTX.Process(target=_read_only_child, args=(base, q))
        p.start()
        out = q.get(timeout=60)
        p.join(30)
        if isinstance(out, str) and "PermissionError" in out and "setuid" in out.lower():
            pytest.skip("cannot drop root privileges here")
        assert isinstance(out, dict), out
        assert out["euid"] != 0                            # modes meant something
        assert out["save"] is None and out["async"] is None
        assert out["left_behind"] == []
        assert out["load"] is True
        assert out["save_errors"] == 2
        assert out["open"][0] == "CheckpointOSError" and out["open"][1] is True
        assert out["listing_after_open"] is True
        assert out["save_after"] is True
    finally:
        shutil.rmtree(base, ignore_errors=True)


# ---- full disk ------------------------------------------------------------------------

LIMIT = 64 << 10


def _full_disk_child(path, q):
    try:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)      # EFBIG instead of a kill
        resource.setrlimit(resource.RLIMIT_FSIZE, (LIMIT, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
        out = {}
        lines = []
        handler = logging.Handler()
        handler.emit = lambda r: lines.append(r.getMessage())
        logging.getLogger("kvstore").addHandler(handler)
        logging.getLogger("kvstore").setLevel(logging.INFO)
        with make_store(path, durable=True) as s:
            before = listing(path)
            big = {"k": np.ones(4 * LIMIT, np.uint8)}
            out["save"] = s.save("too big for the disk", [1, 2, 3], big)
            out["async"] = s.save_async("also too big", [1, 2, 3], big).result()
            out["left_behind"] = sorted(set(listing(path)) - set(before))
            out["save_errors"] = s.stats()["save_errors"]
            out["logged"] = [m for m in lines if "save_failed" in m]
            small = s.save("fits on the disk", [4, 5], tensors(seed=3))
            out["small"] = small is not None and small.file_size < LIMIT
            ck = s.load(s.find("fits on the disk!"))
            out["small_load"] = ck is not None and np.array_equal(ck.tensors["v"], tensors(seed=3)["v"])
            ck = s.load(s.find(PROMPT))
            out["old_load"] = ck is not None and np.array_equal(ck.tensors["k"], tensors()["k"])
        q.put(out)
    except BaseException as e:
        q.put(repr(e))


def test_full_disk(tmp_path):
    """RLIMIT_FSIZE in a child process makes writes past 64 KiB fail with
    EFBIG, as a full disk fails them with ENOSPC."""
    d = tmp_path / "kv"
    with make_store(d) as s:
        s.save(TEXT, [1, 2, 3], tensors())
    q = CTX.Queue()
    p = CTX.Process(target=_full_disk_child, args=(str(d), q))
    p.start()
    out = q.get(timeout=60)
    p.join(30)
    assert isinstance(out, dict), out
    assert p.exitcode == 0
    assert out["save"] is None and out["async"] is None
    assert out["left_behind"] == []
    assert out["save_errors"] == 2
    assert len(out["logged"]) == 2 and all("error=EFBIG" in m for m in out["logged"]), out["logged"]
    assert out["small"] and out["small_load"] and out["old_load"]
    assert tmp_names(d) == []
    assert sorted(listing(d)) == sorted([hashlib_name(TEXT), hashlib_name("fits on the disk")])
    with make_store(d) as s:                               # and the directory is healthy
        assert len(s.entries()) == 2


def hashlib_name(text):
    return kvstore.format.sha1(text.encode()).hex() + ".kv"


# ---- impossible inputs -------------------------------------------------------------------

def test_huge_token_array_rejected_cleanly(store):
    huge = np.broadcast_to(np.uint32(7), (2**32,))        # 16 GiB if it were real; costs nothing
    with pytest.raises(ValueError):
        store.save(TEXT, huge, tensors())
    with pytest.raises(ValueError):
        store.save_async(TEXT, np.broadcast_to(np.uint32(7), (2**32 + 5,)), tensors()).result()
    assert listing(store.path) == []
    assert store.save(TEXT, [1, 2, 3], tensors()) is not None


@pytest.mark.parametrize("tokens", [
    [-1, 2], [2**32, 1], np.array([1.5, 2.0]), np.array([[1, 2], [3, 4]]), ["a", "b"], [2**70]])
def test_invalid_token_ids_rejected(store, tokens):
    with pytest.raises((ValueError, TypeError)):
        store.save(TEXT, tokens, tensors())
    assert listing(store.path) == []


def test_long_token_array_over_budget_is_refused(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="kvstore")
    with make_store(tmp_path / "kv", budget_mb=1) as s:
        assert s.save(TEXT, np.zeros(1 << 20, np.uint32), {}) is None        # 4 MiB of ids
        assert listing(s.path) == []
        assert any("reason=budget" in r.getMessage() for r in caplog.records)


def test_text_and_tensor_names_checked(store):
    with pytest.raises(ValueError):
        store.save(TEXT, [1], {"": np.zeros(2)})
    with pytest.raises(TypeError):
        store.save(12345, [1], tensors())
    assert listing(store.path) == []


def test_torn_checkpoints_are_removed_at_open_and_said_so(tmp_path, caplog):
    # A power loss can leave a checkpoint's name with its data never written
    # (empty, or zeros): debris, removed by the next open (found by
    # tests/test_power_cuts.py).  A file of another format version is not
    # torn and stays.
    caplog.set_level(logging.INFO, logger="kvstore")
    d = tmp_path / "kv"
    with make_store(d) as s:
        good = s.save("a stored prompt", [1, 2, 3], make_tensors(8))
    empty, zeros, newer = (d / f"{c * 40}.kv" for c in "abc")
    empty.write_bytes(b"")
    zeros.write_bytes(b"\0" * 4096)
    raw = bytearray(open(good.path, "rb").read())
    raw[3] = 2                                           # format version 2: a future one, not ours
    newer.write_bytes(bytes(raw))
    with make_store(d) as s:
        assert [e.path for e in s.entries()] == [good.path]
    assert not empty.exists() and not zeros.exists() and newer.exists()
    lines = [r.getMessage() for r in caplog.records if "kvstore: corrupt " in r.getMessage()]
    assert any("reason=truncated action=removed file=aaaaaaaaaaaa" in m for m in lines), lines
    assert any("reason=bad_magic action=removed file=bbbbbbbbbbbb" in m for m in lines), lines
