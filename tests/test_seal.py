"""Sealed checkpoints (docs/format.md §16): keys, keyed names, AES-256-GCM chunks, the store's gates.

Every test works on real files: a sealed store writes them, the test reads,
flips, truncates, swaps or renames their bytes, and a store (with the key,
with another key, or with none) opens the directory again.
"""

import dataclasses
import hashlib
import hmac
import itertools
import json
import logging
import os
import shutil
import stat
import subprocess
import sys
import tempfile

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as hs

pytest.importorskip("cryptography")

import kvstore  # noqa: E402
from kvstore import payload, seal, sessions  # noqa: E402
from kvstore.errors import BadKey  # noqa: E402
from kvstore.format import (PAYLOAD_ABI_SEALED, PAYLOAD_ABI_SEALED_CHAIN, PREFIX_SIZE, SEAL_HEAD,  # noqa: E402
                            entry_from_fd, open_checkpoint, read_entry)
from kvhelpers import S3_BUCKET, checkpoint_files, flip, listing, make_store  # noqa: E402

KEY = bytes(range(32))
OTHER_KEY = bytes(range(1, 33))
SHIFT = seal.BODY_OFFSET - PREFIX_SIZE        # a plain body offset + SHIFT = its sealed offset


# ---- sequences: text, token ids, offsets and KV that follow from the ids ------------------

def seq(n, base=0):
    ids = np.arange(base, base + n, dtype=np.uint32)
    words = [f"tok{int(t)} ".encode() for t in ids]
    text = b"".join(words)
    offsets = [0, *itertools.accumulate(len(w) for w in words)]
    return text, ids, offsets


def kv(ids, seed=0):
    """KV rows that follow from each token id (so a longer save repeats a shorter one's rows)."""
    x = (np.asarray(ids, np.int64)[:, None] * 7919 + np.arange(16) * 104729 + seed * 15485863) % 100003
    rows = np.stack([x, x * 3 % 100003])[None] / 1000.0 - 50.0
    return {"k": rows.astype(np.float16), "v": rows[:, ::-1].astype(np.float32)}


POS = {"k": 2, "v": 2}


def save(store, n=64, base=0, seed=0, **kw):
    text, ids, offsets = seq(n, base)
    tensors = kv(ids, seed)
    e = store.save(text, ids, tensors, positional=POS, text_offsets=offsets, **kw)
    assert e is not None
    return text, ids, tensors, e


def sealed_store(path, key=KEY, **kw):
    return make_store(path, key=key, block_tokens=16, **kw)


def plain_view(path, key=KEY):
    """(plain Entry, manifest) of a sealed file, through the key: where each region lies."""
    fd, st = open_checkpoint(path)
    try:
        e = entry_from_fd(fd, st, path)
        src, plain = seal.Sealer(key).source(fd, st, e)
        return plain, payload.read_manifest(src, plain)
    finally:
        os.close(fd)


def grid_of(path):
    """The chunk grid a sealed file's seal head gives."""
    _, _, log2, _, _, _, body, _, _, first, _ = SEAL_HEAD.unpack_from(open(path, "rb").read(seal.BODY_OFFSET),
                                                                  PREFIX_SIZE)
    return seal.Grid(body, 1 << log2, first)


# ---- the chunk grid -------------------------------------------------------------------------

@given(hs.integers(1, 5000), hs.integers(0, 12), hs.data())
def test_grid_chunks_tile_the_body_and_find_every_offset(body, log2, data):
    size = 1 << log2
    first = data.draw(hs.integers(1, size))
    g = seal.Grid(body, size, first)
    spans = [g.span(i) for i in range(g.count)]
    assert spans[0][0] == 0 and spans[-1][1] == body
    assert all(a < b <= a + size for a, b in spans) and all(spans[i][1] == spans[i + 1][0] for i in range(g.count - 1))
    assert spans[0][1] == min(first, body)
    for i, (a, b) in enumerate(spans):
        assert g.of(a) == g.of(b - 1) == i
    assert g.of(body) == g.count
    lo = data.draw(hs.integers(0, body))
    hi = data.draw(hs.integers(lo, body))
    assert list(g.covering(lo, hi)) == [i for i, (a, b) in enumerate(spans) if a < hi and b > lo and lo < hi]


@pytest.mark.parametrize("layout", ["whole", "chain"])
@pytest.mark.parametrize("text_bytes", [300, 3 * seal.CHUNK_BYTES // 2])
def test_the_tensor_data_starts_on_a_chunk_boundary(tmp_path, layout, text_bytes):
    # The text, a block's chain header and the manifest end where a chunk
    # ends: a load authenticates them without decrypting tensor bytes.
    n = 32
    text = b"x" * (text_bytes - text_bytes % n)
    offsets = [len(text) * i // n for i in range(n + 1)]
    ids = np.arange(n, dtype=np.uint32)
    with sealed_store(tmp_path / "kv", layout=layout) as s:
        s.save(text, ids, kv(ids), positional=POS, text_offsets=offsets)
        files = [x.path for x in s.entries()]
    for path in files:
        plain, manifest = plain_view(path)
        data_start = plain.tensors_offset + manifest.tokens[0] - PREFIX_SIZE
        g = grid_of(path)
        assert g.span(g.of(data_start))[0] == data_start
        assert g.first == data_start % seal.CHUNK_BYTES or (data_start % seal.CHUNK_BYTES == 0
                                                           and g.first == seal.CHUNK_BYTES)


@pytest.mark.parametrize("change", [64, -64, None])
def test_an_edited_first_chunk_length_is_a_miss(tmp_path, change):
    d = tmp_path / "kv"
    with sealed_store(d, layout="whole") as s:
        text, *_, e = save(s, 40)
    at = PREFIX_SIZE + SEAL_HEAD.size - 12         # the u32 first chunk length (then the 8-byte lookup tag)
    first = int.from_bytes(open(e.path, "rb").read(at + 4)[at:], "little")
    assert first == grid_of(e.path).first
    with open(e.path, "r+b") as f:
        f.seek(at)
        f.write((0 if change is None else first + change).to_bytes(4, "little"))
    with sealed_store(d, layout="whole") as s:
        hit = s.find(text)
        assert hit is None or s.load(hit) is None
    assert checkpoint_files(d) == []


# ---- round trips --------------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["whole", "chain"])
@pytest.mark.parametrize("into", ["numpy", "mlx"])
def test_round_trip_is_exact(tmp_path, layout, into):
    with sealed_store(tmp_path / "kv", layout=layout) as s:
        text, ids, tensors, e = save(s, 100)
        assert e.sealed and e.payload_abi == (PAYLOAD_ABI_SEALED if layout == "whole" else PAYLOAD_ABI_SEALED_CHAIN)
    names = checkpoint_files(tmp_path / "kv")
    assert len(names) == (1 if layout == "whole" else 7)       # 100 tokens on a 16-token grid
    with sealed_store(tmp_path / "kv", layout=layout) as s:
        hit = s.find(text + b"and more")
        assert hit is not None and hit.tokens == 100
        ck = s.load(hit, into=into)
        assert ck is not None and ck.text_bytes == text and np.array_equal(ck.tokens, ids)
        for name, a in tensors.items():
            assert np.array_equal(np.array(ck.tensors[name]), a)
        if layout == "chain":
            # A prompt that leaves the sequence inside block 3 gets blocks 0..2.
            _, _, offsets = seq(100)
            mid = s.find(text[:offsets[40]] + b"\x00elsewhere")
            assert mid is not None and mid.tokens == 32
            ck = s.load(mid, into=into)
            assert np.array_equal(np.array(ck.tensors["k"]), tensors["k"][:, :, :32])
            assert np.array_equal(ck.tokens, ids[:32])


@pytest.mark.parametrize("layout", ["whole", "chain"])
def test_a_file_of_many_chunks_round_trips_exact(tmp_path, layout):
    # Odd-sized tensors that start and end inside chunks (padding between
    # them), one spanning several chunks, and a text over a chunk long: the
    # writer's pieces are encrypted straight from its buffers, the text and
    # manifest chunks last.
    rng = np.random.default_rng(7)
    n = 64
    text = b"".join(f"w{i:07d} ".encode() for i in range(n)) * 2600       # ~1.3 MiB
    offsets = [len(text) * i // n for i in range(n + 1)]
    ids = np.arange(n, dtype=np.uint32)
    tensors = {f"{layer}.{name}": rng.standard_normal((1, 3, n, width)).astype(np.float32)
               for layer, width in enumerate((5, 1777, 3, 4099)) for name in ("k", "v")}
    positional = {name: 2 for name in tensors}
    with sealed_store(tmp_path / "kv", layout=layout) as s:
        e = s.save(text, ids, tensors, positional=positional, text_offsets=offsets)
        assert e is not None and e.sealed
    assert sum(os.path.getsize(tmp_path / "kv" / f) for f in checkpoint_files(tmp_path / "kv")) \
        > 4 * seal.CHUNK_BYTES
    with sealed_store(tmp_path / "kv", layout=layout) as s:
        hit = s.find(text)
        assert hit is not None and hit.tokens == n
        ck = s.load(hit)
        assert ck is not None and ck.text_bytes == text and np.array_equal(ck.tokens, ids)
        for name, a in tensors.items():
            assert np.array_equal(np.asarray(ck.tensors[name]), a), name


def test_a_sealed_chain_load_asks_for_its_ciphertext_ahead_in_parts(tmp_path, monkeypatch):
    # Through kvstore.host.prefetch, as a plain chain load asks (so macOS's
    # F_RDADVISE and Linux's read-through serve both), cut in parts (here
    # 64 KiB) that together cover every block's tensor chunks.
    from kvstore import host
    from kvstore.seal import source
    rng = np.random.default_rng(3)
    n = 64
    text, ids, offsets = seq(n)
    tensors = {"k": rng.standard_normal((1, 3, n, 4099)).astype(np.float32)}
    with sealed_store(tmp_path / "kv", layout="chain") as s:
        assert s.save(text, ids, tensors, positional={"k": 2}, text_offsets=offsets) is not None
    asked = []
    monkeypatch.setattr(source, "PREFETCH_ASK", 64 << 10)
    monkeypatch.setattr(host, "_read_ahead_bytes", lambda fd: None)    # no device window to ask past
    monkeypatch.setattr(host, "prefetch", lambda fd, off, k: asked.append((os.fstat(fd).st_ino, off, k)) or True)
    with sealed_store(tmp_path / "kv", layout="chain") as s:
        ck = s.load(s.find(text))
    assert ck is not None and np.array_equal(np.asarray(ck.tensors["k"]), tensors["k"])
    files = {os.stat(tmp_path / "kv" / f).st_ino: os.path.getsize(tmp_path / "kv" / f)
             for f in checkpoint_files(tmp_path / "kv")}
    assert asked and all(k <= 64 << 10 and off + k <= files[ino] for ino, off, k in asked)
    for ino, size in files.items():         # each block: its 0.8 MB of tensor data, in parts
        got = sum(k for i, _, k in asked if i == ino)
        assert got >= 16 * 3 * 4099 * 4, (ino, got)


def test_second_save_keeps_the_sealed_chain(tmp_path, caplog):
    with sealed_store(tmp_path / "kv") as s:
        save(s, 100)
        before = {n: os.stat(tmp_path / "kv" / n).st_ino for n in checkpoint_files(tmp_path / "kv")}
        text, ids, offsets = seq(130)
        e = s.save(text, ids, kv(ids), positional=POS, text_offsets=offsets)
        assert e is not None and e.tokens == 130
        after = {n: os.stat(tmp_path / "kv" / n).st_ino for n in checkpoint_files(tmp_path / "kv")}
        # Every block of the first save stays (its last one, 96..100, is a leaf of its own).
        assert all(after.get(n) == ino for n, ino in before.items())
        assert len(after) == len(before) + 3          # 96..112, 112..128, 128..130
        ck = s.load(s.find(text))
        assert ck is not None and np.array_equal(ck.tensors["k"], kv(ids)["k"])


def test_trailers_and_sessions_round_trip_sealed(tmp_path):
    text, ids, _ = seq(40)
    with sealed_store(tmp_path / "kv", layout="whole") as s:
        e = sessions.save(s, text, ids, kv(ids), {}, title="a secret title")
        assert e is not None and e.sealed
        raw = open(e.path, "rb").read()
        assert b"a secret title" not in raw
        listed = sessions.list(s)
        assert [(x.sha, x.title) for x in listed] == [(e.sha, "a secret title")]
        ck = sessions.switch(s, e.sha[:8])
        assert ck.trailers == {3: "a secret title"} and np.array_equal(ck.tokens, ids)
        # A new title rewrites the sealed file (sealed anew), never in place.
        e2 = sessions.save(s, text, ids, kv(ids), {}, title="another")
        assert e2.sha == e.sha and e2.inode != e.inode
        assert sessions.switch(s, e.sha[:8]).trailers == {3: "another"}
    # Without the key (or with another) the session is listed with no title.
    with make_store(tmp_path / "kv") as s:
        assert [(x.sha, x.title) for x in sessions.list(s)] == [(e.sha, None)]
    with sealed_store(tmp_path / "kv", key=OTHER_KEY) as s:
        assert [(x.sha, x.title) for x in sessions.list(s)] == [(e.sha, None)]


def test_cli_inspect_and_session_list_read_sealed_files_through_the_key(tmp_path):
    key = tmp_path / "store.key"
    seal.new_key_file(key)
    d = tmp_path / "kv"
    text, ids, _ = seq(40)
    with make_store(d, key=key, block_tokens=16) as s:
        e = sessions.save(s, text, ids, kv(ids), {}, title="the sealed title", positional=POS,
                          text_offsets=seq(40)[2])
    assert e.is_block and e.parent
    p = kvs("session", "list", d, "--key", key)
    assert p.returncode == 0 and "the sealed title" in p.stdout, p.stdout + p.stderr
    p = kvs("session", "list", d)
    assert p.returncode == 0 and e.sha[:12] in p.stdout and "the sealed title" not in p.stdout
    p = kvs("inspect", e.path, "--key", key, "--text")
    assert p.returncode == 0, p.stderr
    assert "this key; heads authenticated" in p.stdout and "manifest:" in p.stdout
    assert "title: the sealed title" in p.stdout and "crc ok" in p.stdout
    assert p.stdout.rstrip("\n").endswith(text.decode())           # the whole sequence, parents first
    p = kvs("inspect", e.path)
    assert p.returncode == 0 and "no key given: text, manifest and trailers hidden" in p.stdout
    assert "manifest:" not in p.stdout and "the sealed title" not in p.stdout
    p = kvs("inspect", e.path, "--text")
    assert p.returncode == 2 and "is sealed: give its key" in p.stderr
    flip(e.path, seal.BODY_OFFSET + 3)
    p = kvs("inspect", e.path, "--key", key)
    assert p.returncode == 1 and "does not authenticate" in p.stdout


def test_hits_in_place_still_authenticate(tmp_path):
    with sealed_store(tmp_path / "kv", layout="whole") as s:
        text, ids, tensors, e = save(s, 50)
        first = s.load(s.find(text), consume=False)
        assert first is not None and first.entry.hits == 1
        raw = open(e.path, "rb").read()
        assert int.from_bytes(raw[12:16], "little") == 1 and int.from_bytes(raw[32:40], "little") > 0
        second = s.load(s.find(text), consume=False)
        assert second is not None and second.entry.hits == 2
        assert np.array_equal(second.tensors["k"], tensors["k"])


# ---- what the files show ---------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["whole", "chain"])
def test_files_hide_text_tensors_and_names(tmp_path, layout):
    with sealed_store(tmp_path / "a", layout=layout) as s:
        text, ids, tensors, e = save(s, 64)
    with sealed_store(tmp_path / "b", key=OTHER_KEY, layout=layout) as s:
        save(s, 64)
    sha = hashlib.sha1(text).hexdigest()
    sealer = seal.Sealer(KEY)
    # HMAC-SHA1 under the name key (RFC 2104, as Python's hmac computes it).
    assert e.sha == sealer.name(text).hex() == hmac.new(sealer.name_key, text, "sha1").hexdigest() != sha
    names_a, names_b = checkpoint_files(tmp_path / "a"), checkpoint_files(tmp_path / "b")
    assert not set(names_a) & set(names_b)           # another key, other names for the same texts
    for name in names_a:
        raw = open(tmp_path / "a" / name, "rb").read()
        assert b"tok1 " not in raw and b"tok10 tok11" not in raw
        assert sha.encode() not in raw and bytes.fromhex(sha) not in raw
        for a in tensors.values():
            # No 64-byte run of any tensor's bytes is on disk.
            flat = a.tobytes()
            assert all(flat[i:i + 64] not in raw for i in range(0, len(flat) - 64, 1024))
        assert ids[3:11].tobytes() not in raw


# ---- the key -------------------------------------------------------------------------------

def test_key_file_checks(tmp_path):
    p = tmp_path / "key"
    seal.new_key_file(p)
    st = os.stat(p)
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_size == 32
    assert seal.load_key(p) == open(p, "rb").read()
    with pytest.raises(FileExistsError):
        seal.new_key_file(p)
    os.chmod(p, 0o640)
    with pytest.raises(BadKey, match=r"key file .*key is group-readable \(mode 0640\); chmod 600 it"):
        seal.load_key(p)
    os.chmod(p, 0o604)
    with pytest.raises(BadKey, match=r"world-readable \(mode 0604\)"):
        seal.load_key(p)
    os.chmod(p, 0o602)
    with pytest.raises(BadKey, match=r"world-writable"):
        seal.load_key(p)
    short = tmp_path / "short"
    short.write_bytes(bytes(31))
    os.chmod(short, 0o600)
    with pytest.raises(BadKey, match=r"short is 31 bytes; a key file holds exactly 32"):
        seal.load_key(short)
    with pytest.raises(ValueError, match="32 bytes, not 16"):
        kvstore.KVStore(tmp_path / "kv", key=bytes(16))
    os.symlink(p, tmp_path / "link")
    os.chmod(p, 0o600)
    with pytest.raises(BadKey, match="symlink"):
        seal.load_key(tmp_path / "link")
    # A store given the path works like one given the bytes.
    with make_store(tmp_path / "kv", key=p, layout="whole") as s:
        text, *_ = save(s, 20)
    with make_store(tmp_path / "kv", key=open(p, "rb").read(), layout="whole") as s:
        assert s.load(s.find(text)) is not None


# ---- faults: each is a miss, never a wrong state -------------------------------------------

def _regions(path):
    """Sealed file offsets of one byte in each region of a whole sealed file."""
    plain, manifest = plain_view(path)
    P = plain.payload_offset
    tok_off = manifest.tokens[0]
    ten_off = manifest.tensors[0][3]
    size = os.path.getsize(path)
    return {
        "text": PREFIX_SIZE + 3 + SHIFT,
        "manifest": P + 24 + 5 + SHIFT,
        "tokens": plain.tensors_offset + tok_off + 2 + SHIFT,
        "tensor": plain.tensors_offset + ten_off + 17 + SHIFT,
        "trailer": plain.trailer_offset + 20 + SHIFT,
        "tag": size - 5,
    }


@pytest.mark.parametrize("region", ["text", "manifest", "tokens", "tensor", "trailer", "tag"])
@pytest.mark.parametrize("quarantine", [False, True])
def test_a_flipped_bit_is_a_miss_and_the_file_goes(tmp_path, caplog, region, quarantine):
    d = tmp_path / "kv"
    # Tensors over 1 MiB, so the file has several chunks.
    text, ids, _ = seq(40)
    big = {"k": np.random.default_rng(1).standard_normal((1, 8, 40, 2048)).astype(np.float32)}
    with sealed_store(d, layout="whole") as s:
        e = s.save(text, ids, big, trailers={kvstore.format.ExtFlag.SESSION_TITLE: "t" * 64})
    assert os.path.getsize(e.path) > 2 * seal.CHUNK_BYTES
    flip(e.path, _regions(e.path)[region])
    caplog.set_level(logging.INFO, logger="kvstore")
    with sealed_store(d, layout="whole", quarantine=quarantine) as s:
        assert s.verify_file(e.path).startswith("auth_failed")       # kvstore verify, chunk by chunk
        hit = s.find(text)
        assert hit is not None
        assert s.load(hit) is None
    assert "corrupt reason=auth_failed" in caplog.text
    assert checkpoint_files(d) == []
    assert (os.listdir(d / ".quarantine") == [e.name]) if quarantine else not (d / ".quarantine").exists()


@pytest.mark.parametrize("cut", [1, 16, 17, 4096])
def test_a_truncated_file_is_a_miss(tmp_path, cut):
    d = tmp_path / "kv"
    with sealed_store(d, layout="whole") as s:
        text, _, _, e = save(s, 30)
    size = os.path.getsize(e.path)
    os.truncate(e.path, size - cut)
    with sealed_store(d, layout="whole") as s:
        hit = s.find(text)
        assert hit is None or s.load(hit) is None
        assert s.find(text) is None


def test_a_chunk_swapped_between_two_files_is_a_miss(tmp_path, caplog):
    d = tmp_path / "kv"
    with sealed_store(d, layout="whole") as s:
        a_text, a_ids, _ = seq(40, 0)
        b_text, b_ids, _ = seq(40, 1000)
        big = {"k": np.zeros((1, 8, 40, 1024), np.float32)}
        a = s.save(a_text, a_ids, big)
        b = s.save(b_text, b_ids, big)
    # Same chunk of tensor data in both (zeros): same plain bytes, other ciphertext.
    at = seal.BODY_OFFSET + seal.CHUNK_BYTES
    with open(a.path, "rb") as f:
        f.seek(at)
        chunk = f.read(4096)
    with open(b.path, "r+b") as f:
        f.seek(at)
        assert f.read(4096) != chunk
        f.seek(at)
        f.write(chunk)
    caplog.set_level(logging.INFO, logger="kvstore")
    with sealed_store(d, layout="whole") as s:
        assert s.load(s.find(b_text)) is None
        assert "corrupt reason=auth_failed" in caplog.text
        assert s.load(s.find(a_text)) is not None


@pytest.mark.parametrize("field,offset,value", [
    ("tokens", 8, 39), ("ctx_size", 16, 1), ("model_id", 7, 0), ("abi_plain", 20, 16), ("abi_chain", 20, 49),
    ("reason", 5, 4), ("quant", 4, 8), ("created", 24, 7)])
def test_an_edited_header_is_a_miss(tmp_path, field, offset, value):
    d = tmp_path / "kv"
    with sealed_store(d, layout="whole", model_id=1, ctx_size=4096) as s:
        text, ids, tensors, e = save(s, 40)
    with open(e.path, "r+b") as f:
        f.seek(offset)
        f.write(bytes([value]))
    for accept_unsealed in (False, True):
        with sealed_store(d, layout="whole", model_id=1 if field != "model_id" else 0, ctx_size=4096,
                          accept_unsealed=accept_unsealed) as s:
            hit = s.find(text)
            assert hit is None or s.load(hit) is None


def test_a_file_renamed_to_another_name_is_a_miss(tmp_path):
    d = tmp_path / "kv"
    with sealed_store(d, layout="whole") as s:
        a_text, _, _, a = save(s, 30, 100)
        b_text, _, _, b = save(s, 30, 200)          # as long as a's text: the lookup tries b's name
        assert a.text_bytes == b.text_bytes
    os.replace(a.path, b.path)          # an older file replayed under another name
    with sealed_store(d, layout="whole") as s:
        # Its lookup tag is a's: b's prompt passes it over, and a's name is gone.
        hit = s.find(b_text)
        assert hit is None or s.load(hit) is None
        assert s.find(a_text) is None
        assert s.verify_file(b.path).startswith("auth_failed")
        # Loaded by hand, it does not authenticate under b's name.
        assert s.load(s.entries()[0]) is None
    assert checkpoint_files(d) == []


def test_a_tampered_block_falls_back_to_its_ancestor(tmp_path):
    d = tmp_path / "kv"
    with sealed_store(d) as s:
        text, ids, tensors, e = save(s, 100)
        blocks = {x.tokens: x for x in s.entries()}
    flip(blocks[64].path, seal.BODY_OFFSET + 200)
    with sealed_store(d) as s:
        ck = s.load(s.find(text))
        # Block 48..64 is gone with every block after it; the load got 48 tokens.
        assert ck is not None and ck.entry.tokens == 48
        assert np.array_equal(ck.tensors["k"], tensors["k"][:, :, :48])
        assert sorted(x.tokens for x in s.entries()) == [16, 32, 48]


def test_a_clear_chain_header_edited_to_another_parent_is_a_miss(tmp_path):
    # An attacker relinks block 16..32 of chain A under chain B's first block
    # (same lengths, a valid chain header CRC): no prompt finds it there (its
    # name is A's), A's prompt gets A's first block, and a load of the block
    # fails authentication (the clear chain header is in every chunk's AAD).
    from kvstore.format import CHAIN_HEAD_SIZE, SEAL_HEAD_SIZE, pack_chain_head, parse_chain_head
    d = tmp_path / "kv"
    with sealed_store(d) as s:
        a_text, _, a_tensors, _ = save(s, 48, 100)
        b_text, _, b_tensors, _ = save(s, 48, 200)
        files = {x.name: x for x in s.entries()}
    by_end = {}
    for x in files.values():
        by_end.setdefault(x.tokens, []).append(x)
    a2 = next(x for x in by_end[32] if x.parent in {y.sha for y in by_end[16]} and
              files[x.parent + ".kv"].text_bytes == x.text_start)
    a1 = files[a2.parent + ".kv"]
    b1 = next(x for x in by_end[16] if x.sha != a1.sha)
    assert b1.text_bytes == a1.text_bytes
    at = PREFIX_SIZE + SEAL_HEAD_SIZE
    raw = open(a2.path, "rb").read(at + CHAIN_HEAD_SIZE)[at:]
    f = parse_chain_head(raw, a2.tokens)
    forged = pack_chain_head(bytes.fromhex(b1.sha), f["token_start"], f["text_start"], f["block_grid"],
                             f["chain_flags"], bytes(8), bytes(8))
    with open(a2.path, "r+b") as fh:
        fh.seek(at)
        fh.write(forged)
    with sealed_store(d) as s:
        hit = s.find(a_text)
        assert hit is not None and hit.tokens == 16
        ck = s.load(hit)
        assert np.array_equal(ck.tensors["k"], a_tensors["k"][:, :, :16])
        ck = s.load(s.find(b_text))
        assert ck.entry.tokens == 48 and np.array_equal(ck.tensors["k"], b_tensors["k"])
        assert s.verify_file(a2.path).startswith("auth_failed")
        forged_entry = next(x for x in s.entries() if x.sha == a2.sha)
        assert forged_entry.parent == b1.sha
        assert s.load(forged_entry) is None
        assert a2.sha not in {x.sha for x in s.entries()}


@pytest.mark.parametrize("width", [12000, 5], ids=["a-chunk-inside-one-piece", "short-rows"])
@pytest.mark.parametrize("into", ["numpy", "mlx"])
def test_a_forged_tensor_chunk_of_a_block_falls_back_to_its_ancestor(tmp_path, width, into):
    # A chain load decrypts each chunk in a scratch chunk and copies its rows
    # out only once its tag has checked: a forged chunk in block 32..48 (one
    # that lies inside one tensor piece of long rows, or one of many short
    # rows) leaves no byte in the tensors; the load falls back to 32 tokens.
    d = tmp_path / "kv"
    n = 64
    text, ids, offsets = seq(n)
    rng = np.random.default_rng(3)
    tensors = {name: rng.standard_normal((1, 3, n, width)).astype(np.float32) for name in POS}
    with sealed_store(d) as s:
        s.save(text, ids, tensors, positional=POS, text_offsets=offsets)
        blocks = {x.tokens: x for x in s.entries()}
        ck = s.load(s.find(text), into=into)
        assert ck is not None and ck.entry.tokens == n
        assert all(np.array_equal(np.asarray(ck.tensors[k]), a) for k, a in tensors.items())
    plain, manifest = plain_view(blocks[48].path)
    name, _, _, off, nbytes, _ = next(r for r in manifest.tensors if r[0] == "v")
    at = plain.tensors_offset + off - PREFIX_SIZE          # the piece's body range
    middle = at + nbytes // 2
    grid = grid_of(blocks[48].path)
    chunk = grid.span(grid.of(middle))
    assert (at <= chunk[0] and chunk[1] <= at + nbytes) == (width == 12000)
    flip(blocks[48].path, middle + seal.BODY_OFFSET)
    with sealed_store(d) as s:
        ck = s.load(s.find(text), into=into)
        assert ck is not None and ck.entry.tokens == 32
        for k, a in tensors.items():
            assert np.array_equal(np.asarray(ck.tensors[k]), a[:, :, :32]), k
        assert sorted(x.tokens for x in s.entries()) == [16, 32]


def test_a_wrong_lookup_tag_hides_the_file_and_verify_says_so(tmp_path, monkeypatch):
    # A writer that sealed a wrong tag (never this one's): lookups pass the
    # file over (a miss, not a wrong state) and kvstore verify reports it.
    from kvstore import names as names_mod
    d = tmp_path / "kv"
    names_of = names_mod.names_of

    def wrong_tags(text, lengths, name_key=None):
        names, tags = names_of(text, lengths, name_key)
        return names, [bytes(b ^ 0xFF for b in t) for t in tags]
    with sealed_store(d, layout="whole") as s:
        monkeypatch.setattr(names_mod, "names_of", wrong_tags)
        text, *_, e = save(s, 40)
        monkeypatch.setattr(names_mod, "names_of", names_of)
    with sealed_store(d, layout="whole") as s:
        assert s.find(text) is None
        assert s.verify_file(e.path).startswith("lookup_tag")
        assert s.load(s.entries()[0]) is not None        # the file itself is sound


# ---- keys that differ, stores without keys ----------------------------------------------------

def test_another_key_sees_foreign_files_and_deletes_none(tmp_path):
    d = tmp_path / "kv"
    with sealed_store(d) as s:
        text, *_ = save(s, 100)
    names = checkpoint_files(d)
    with sealed_store(d, key=OTHER_KEY) as s:
        assert s.find(text) is None
        assert len(s.entries()) == len(names)
        # Even a load asked for by hand is a miss that keeps the file.
        assert all(s.load(x) is None for x in s.entries())
    assert checkpoint_files(d) == names


def test_a_store_without_the_key_lists_counts_and_evicts_sealed_files(tmp_path):
    d = tmp_path / "kv"
    with sealed_store(d) as s:
        text, *_ = save(s, 100)
        total = sum(x.file_size for x in s.entries())
    with make_store(d) as s:
        entries = s.entries()
        assert len(entries) == 7 and all(x.sealed and not x.loadable for x in entries)
        assert sum(x.file_size for x in entries) == total
        assert s.find(text) is None
        assert all(s.load(x) is None for x in entries)
    assert len(checkpoint_files(d)) == 7
    # Eviction goes leaves first by the clear parent links: a budget for about
    # half the chain leaves its first blocks.
    budget_mb = (total // 2) / (1024 * 1024)
    with make_store(d, budget_mb=budget_mb) as s:
        left = sorted(x.tokens for x in s.entries())
    assert left and left == [16 * (i + 1) for i in range(len(left))]


def test_a_keyed_store_ignores_unsealed_files_unless_told(tmp_path):
    d = tmp_path / "kv"
    with make_store(d) as s:
        text, ids, tensors, _ = save(s, 64)
    with sealed_store(d) as s:
        assert s.find(text) is None
    with sealed_store(d, accept_unsealed=True) as s:
        ck = s.load(s.find(text))
        assert ck is not None and np.array_equal(ck.tensors["k"], tensors["k"])


def test_wipe_takes_a_sealed_chain_along(tmp_path):
    d = tmp_path / "kv"
    with sealed_store(d) as s:
        save(s, 100)
        first = min(s.entries(), key=lambda x: x.tokens)
        assert s.wipe(first) == 7
    assert checkpoint_files(d) == []


# ---- the command line ------------------------------------------------------------------------

def kvs(*args, env=None):
    """Runs `python -m kvstore ARGS` from a directory outside the repository, where the
    source tree would shadow the installed package."""
    full = {k: v for k, v in os.environ.items() if k != "KVSTORE_KEY_FILE"}
    full.update(env or {})
    return subprocess.run([sys.executable, "-m", "kvstore", *map(str, args)], capture_output=True, text=True,
                          env=full, cwd=tempfile.gettempdir(), timeout=120)


def test_cli_key_new_verify_and_ls(tmp_path):
    key = tmp_path / "store.key"
    p = kvs("key", "new", key)
    assert p.returncode == 0, p.stderr
    assert stat.S_IMODE(os.stat(key).st_mode) == 0o600 and os.path.getsize(key) == 32
    p = kvs("key", "new", key)
    assert p.returncode == 2 and "never overwritten" in p.stderr
    d = tmp_path / "kv"
    with make_store(d, key=key, layout="whole") as s:
        save(s, 30, 0)
        _, _, _, bad = save(s, 30, 700)
    p = kvs("verify", d, "--key", key)
    assert p.returncode == 0 and "2 ok" in p.stdout, p.stdout + p.stderr
    flip(bad.path, seal.BODY_OFFSET + 10)
    p = kvs("verify", d, "--key", key)
    assert p.returncode == 1 and f"{bad.name}: auth_failed" in p.stdout and "1 ok" in p.stdout, p.stdout
    p = kvs("verify", d, env={"KVSTORE_KEY_FILE": str(key)})
    assert p.returncode == 1 and "auth_failed" in p.stdout
    p = kvs("verify", d, "--key", key, "--quarantine")
    assert p.returncode == 1 and os.listdir(d / ".quarantine") == [bad.name]
    # Without the key: foreign, envelope only.
    p = kvs("verify", d)
    assert p.returncode == 0 and "1 foreign payload ABI" in p.stdout
    p = kvs("ls", d, "--json", env={"KVSTORE_KEY_FILE": str(key)})
    assert p.returncode == 0, p.stderr
    rows = json.loads(p.stdout)
    assert len(rows) == 1 and rows[0]["sealed"] and rows[0]["loadable"]      # the other is quarantined
    p = kvs("ls", d)
    assert "48(sealed)" in p.stdout and "foreign payload ABI" in p.stdout
    os.chmod(key, 0o644)
    p = kvs("ls", d, env={"KVSTORE_KEY_FILE": str(key)})
    assert p.returncode == 2 and "group-readable (mode 0644); chmod 600 it" in p.stderr


def test_cli_export_of_a_sealed_store_needs_plain(tmp_path):
    key = tmp_path / "k"
    seal.new_key_file(key)
    d = tmp_path / "kv"
    with make_store(d, key=key, layout="whole") as s:
        text, ids, tensors, e = save(s, 30)
    out = tmp_path / "out.kv"
    p = kvs("export", e.sha[:12], out, "--dir", d, "--key", key)
    assert p.returncode == 2 and "--plain" in p.stderr and not out.exists()
    p = kvs("export", e.sha[:12], out, "--dir", d, "--key", key, "--plain")
    assert p.returncode == 0, p.stderr
    assert read_entry(out).payload_abi == 16
    # Imported into a sealed store, it is sealed again.
    d2 = tmp_path / "kv2"
    p = kvs("import", out, "--dir", d2, "--layout", "whole", env={"KVSTORE_KEY_FILE": str(key)})
    assert p.returncode == 0, p.stderr
    assert [read_entry(d2 / n).payload_abi for n in checkpoint_files(d2)] == [PAYLOAD_ABI_SEALED]
    assert checkpoint_files(d2) == checkpoint_files(d)


def test_sealed_entries_keep_their_clear_fields(tmp_path):
    with sealed_store(tmp_path / "kv", layout="whole", ctx_size=8192, model_id=3) as s:
        text, ids, _, e = save(s, 77, reason=kvstore.format.Reason.SHUTDOWN)
    got = read_entry(e.path)
    assert (got.tokens, got.ctx_size, got.model_id, got.reason, got.text_bytes) == \
        (77, 8192, 3, kvstore.format.Reason.SHUTDOWN, len(text))
    assert got.key_id == seal.Sealer(KEY).key_id and got.sealed
    assert dataclasses.replace(got, hits=0) is not None
    assert listing(tmp_path / "kv") == [e.name]
    shutil.rmtree(tmp_path / "kv")


# ---- the remote tier: a bucket shared by hosts with the same key ----------------------------

def remote_store(server, path, prefix, key=KEY, **kw):
    ro = {"endpoint_url": server.endpoint, "profile": "kvwriter", "refresh_interval_s": 3600,
          "breaker_cooldown_s": 0.5, "connect_timeout": 1.0, "read_timeout": 10.0, "max_attempts": 1}
    return make_store(str(path), key=key, block_tokens=16, remote=f"s3://{S3_BUCKET}/{prefix}", remote_options=ro,
                      model_identity="test-model@1", **kw)


def bucket_keys(server, prefix):
    import boto3
    c = boto3.session.Session(profile_name="kvwriter").client("s3", endpoint_url=server.endpoint)
    keys = []
    for page in c.get_paginator("list_objects_v2").paginate(Bucket=S3_BUCKET, Prefix=prefix + "/"):
        keys += [o["Key"] for o in page.get("Contents", ())]
    return c, S3_BUCKET, keys


@pytest.mark.parametrize("layout", ["chain", "whole"])
def test_a_shared_bucket_takes_only_what_the_key_sealed(s3, tmp_path, layout):
    prefix = f"seal-{layout}"
    with remote_store(s3, tmp_path / "a", prefix, layout=layout) as a:
        text, ids, tensors, e = save(a, 100)
        assert a.remote.flush(30)
        local = {n: open(tmp_path / "a" / n, "rb").read() for n in checkpoint_files(tmp_path / "a")}
    client, bucket, keys = bucket_keys(s3, prefix)
    assert len(keys) == len(local)
    for k in keys:
        body = client.get_object(Bucket=bucket, Key=k)["Body"].read()
        name = k.rsplit("/", 1)[1][:40] + ".kv"
        # Uploaded as sealed on disk: the same bytes but for the hit fields, named by keyed MACs.
        assert body[:12] + body[16:32] + body[40:] == local[name][:12] + local[name][16:32] + local[name][40:]
        assert b"tok1 " not in body and hashlib.sha1(text).hexdigest() not in k

    # Another host with the same key gets the state from the bucket.
    with remote_store(s3, tmp_path / "b", prefix, layout=layout) as b:
        assert b.remote.refresh()
        hit = b.find(text + b" more")
        assert hit is not None and hit.remote is not None
        ck = b.load(hit)
        assert ck is not None and np.array_equal(ck.tensors["k"], tensors["k"]) and np.array_equal(ck.tokens, ids)
        assert all(read_entry(tmp_path / "b" / n).sealed for n in checkpoint_files(tmp_path / "b"))

    # A host with another key finds nothing there.
    with remote_store(s3, tmp_path / "c", prefix, key=OTHER_KEY, layout=layout) as c:
        c.remote.refresh()
        assert c.find(text) is None

    # An object tampered with in the bucket is never published by a host with the key.
    last = max(keys, key=lambda k: int(k.split("/")[-2]))
    body = bytearray(client.get_object(Bucket=bucket, Key=last)["Body"].read())
    body[seal.BODY_OFFSET + 5] ^= 1
    client.put_object(Bucket=bucket, Key=last, Body=bytes(body))
    with remote_store(s3, tmp_path / "d", prefix, layout=layout) as d:
        assert d.remote.refresh()
        hit = d.find(text)
        got = None if hit is None else d.load(hit)
        assert got is None or got.entry.tokens < 100          # a chain may fall back to a block that verified
        names = checkpoint_files(tmp_path / "d")
        assert last.rsplit("/", 1)[1][:40] + ".kv" not in names
