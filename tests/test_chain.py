"""Chained checkpoints (payload ABI 17, docs/format.md §14): storage v2.

A save is cut into blocks ending at multiples of block_tokens plus a last
block ending where the save ends; each block is one .kv file named by the
SHA1 of the whole text up to its end, storing only its own range.  These
tests cover the cutting, the round trip at every block boundary (NumPy and
MLX), writing only the missing blocks, snapshot semantics, every kind of bad
block (a shorter hit or a miss, never an exception), two writers and an
evictor racing, SIGKILL in the middle of a chained save, leaf-only eviction,
mixed ABI 16 / ABI 17 directories, hit counts and the shape of the lookup.

The sequences are made of token ids whose text and tensors are functions of
the ids alone (word(), kv_of(), rows_of()), so any loaded checkpoint can be
checked against its own token ids: a load that mixes up blocks cannot pass.
"""

import fcntl
import hashlib
import itertools
import logging
import os
import random
import re
import signal
import time

import numpy as np
import pytest

import kvstore
from kvstore.settings import Settings
from kvstore import chain, policy
from kvstore.format import Reason
from kvstore.chain import cut_points, plan_blocks
from kvstore.files import verify_file
from kvstore.format import (CHAIN_END, CHAIN_RESTORABLE, NO_PARENT, PAYLOAD_ABI_CHAIN, PAYLOAD_ABI_TABLE_CHAIN,
                            PAYLOAD_ABI_TABLE_TENSORS, PAYLOAD_ABI_TENSORS, pack_chain_head)
from kvstore.index import MTIME_GRANULARITY_NS, DirectoryIndex
from kvstore.payload import PAYLOAD_HEADER, read_manifest
from kvhelpers import index_of, CTX, checkpoint_files, flip, make_store

# ---- sequences whose text and tensors follow from their token ids ------------------------


def word(t):
    """The text token id t renders to (1 to 3 extra bytes, so offsets are uneven)."""
    return f"w{t}" + "x" * (t % 3) + " "


class Seq:
    """Token ids with their text and text_offsets (offsets[i]: bytes of the first i tokens)."""

    def __init__(self, ids):
        self.ids = np.asarray(list(ids), dtype=np.uint32)
        words = [word(int(t)).encode() for t in self.ids]
        self.text = b"".join(words)
        self.offsets = [0, *itertools.accumulate(len(w) for w in words)]

    def __len__(self):
        return int(self.ids.size)

    def __getitem__(self, s):
        assert isinstance(s, slice) and s.start is None
        return Seq(self.ids[s])

    def prompt(self, c, tail=b"\x00 diverges here"):
        """A prompt that follows this sequence for c tokens, then leaves it."""
        return self.text[:self.offsets[c]] + tail


def render(ids):
    return b"".join(word(int(t)).encode() for t in ids)


def kv_of(ids, heads=2):
    """A (1, heads, n, 8) float16 KV tensor: every value an exact integer of its token, in [1024, 2048)
    (one exponent: the high byte plane takes 4 values, so a lossless store packs it, as real KV's)."""
    ids = np.asarray(ids, dtype=np.int64)
    v = 1024 + (ids % 61)[None, None, :, None] * 16 + np.arange(heads)[None, :, None, None] * 8 + np.arange(8)
    return v.astype(np.float16)


def rows_of(ids):
    """An (n, 3) int32 tensor that grows along axis 0."""
    return (np.asarray(ids, dtype=np.int64)[:, None] * 3 + np.arange(3)).astype(np.int32)


def snap_of(ids, tag=0):
    """A snapshot: the state at the end (length, last id, who saved it)."""
    return np.array([len(ids), int(ids[-1]) if len(ids) else -1, tag], dtype=np.float32)


POS = {"k": 2, "p": 0}


def tensors_of(seq, snapshot=True, tag=0, heads=2):
    t = {"k": kv_of(seq.ids, heads), "p": rows_of(seq.ids)}
    if snapshot:
        t["s"] = snap_of(seq.ids, tag)
    return t


def save(store, seq, snapshot=True, tag=0, heads=2, **kw):
    return store.save(seq.text, seq.ids, tensors_of(seq, snapshot, tag, heads), positional=POS,
                      text_offsets=seq.offsets, **kw)


def as_np(a):
    return a if isinstance(a, np.ndarray) else np.array(a)


def check_loaded(ck, snapshot=True, tags=(0,), heads=2):
    """The loaded state is exactly what a save of its own token ids holds."""
    assert ck is not None
    ids = ck.tokens
    assert ids.dtype == np.uint32 and ids.shape == (ck.entry.tokens,)
    assert ck.text_bytes == render(ids)
    k, p = as_np(ck.tensors["k"]), as_np(ck.tensors["p"])
    assert k.dtype == np.float16 and p.dtype == np.int32
    want = kv_of(ids, heads)
    assert k.shape == want.shape and k.tobytes() == want.tobytes()          # bit-identical
    assert np.array_equal(p, rows_of(ids))
    if snapshot:
        s = as_np(ck.tensors["s"])
        assert s[0] == len(ids) and s[1] == int(ids[-1]) and s[2] in tags, s
    else:
        assert "s" not in ck.tensors


def block_of(store, tokens, text=None):
    """The entry of the block ending at `tokens` (of the chain holding text, if given)."""
    found = [e for e in store.entries() if e.tokens == tokens
             and (text is None or hashlib.sha1(text[:e.text_bytes]).hexdigest() == e.sha)]
    assert len(found) == 1, found
    return found[0]


def chain_text(store, e):
    """The whole text of e's chain, read from the blocks."""
    with chain.OpenChain(index_of(store).chain(e)) as opened:
        return opened.text()


def log_lines(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "kvstore"]


def settle():
    """Sleeps past the index's mtime granularity: the next lookup lists the
    directory once and later ones trust that listing while the directory is unchanged."""
    time.sleep(2 * MTIME_GRANULARITY_NS / 1e9)


def touch_directory(path):
    """Changes the directory (as another process publishing a file would): the next lookup re-lists it."""
    other = os.path.join(path, "unrelated-file")
    with open(other, "w"):
        pass
    os.unlink(other)


BASE = Seq(range(1000))          # the shared sequence most tests cut

# ---- 1. cutting ---------------------------------------------------------------------------


def test_cut_points_grid_and_last_block():
    two = list(range(0, 21, 2))                       # 10 tokens of 2 bytes each
    assert cut_points(10, 4, two, 20) == [(4, 8), (8, 16), (10, 20)]
    assert cut_points(8, 4, two[:9], 16) == [(4, 8), (8, 16)]          # the end on the grid: no extra block
    assert cut_points(3, 4, [0, 1, 2, 3], 3) == [(3, 3)]               # shorter than one block
    assert cut_points(10, 4, None, 20) == [(10, 20)]                   # no offsets: one block
    assert cut_points(10, 4, lambda i: 2 * i, 20) == [(4, 8), (8, 16), (10, 20)]   # a callable
    assert cut_points(1000, 64, BASE.offsets, len(BASE.text)) == \
        [(c, BASE.offsets[c]) for c in range(64, 1000, 64)] + [(1000, len(BASE.text))]


def test_cut_points_skip_cuts_that_add_no_text():
    # Tokens 2..5 render to nothing: the cut at 4 would repeat the name of the one at 2.
    assert cut_points(10, 2, [0, 1, 2, 2, 2, 2, 3, 4, 5, 6, 7], 7) == [(2, 2), (6, 3), (8, 5), (10, 7)]
    # Trailing tokens that render to nothing: no cut may end where the whole text ends.
    assert cut_points(8, 2, [0, 1, 2, 3, 4, 4, 4, 4, 4], 4) == [(2, 2), (8, 4)]
    # Leading tokens that render to nothing: no empty first block.
    assert cut_points(4, 2, [0, 0, 0, 1, 2], 2) == [(4, 2)]


@pytest.mark.parametrize("n, offsets, text_len, message", [
    (10, [0] * 5, 20, "text_offsets holds 5 values; 10 tokens need 11"),
    (10, list(range(11)), 20, "text_offsets[10]=10 is not the text length 20"),
    (10, [0, 1, 5, 6, 3, 7, 8, 9, 9, 9, 10], 10, "text_offsets[4]=3 is outside 5..10"),
    (10, [0, 1, 2, 3, 11, 5, 6, 7, 8, 9, 10], 10, "text_offsets[4]=11 is outside 2..10"),
    (10, [0, 1, -1, 3, 4, 5, 6, 7, 8, 9, 10], 10, "text_offsets[2]=-1 is outside 0..10"),
])
def test_bad_offsets_raise_value_error_naming_the_value(n, offsets, text_len, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        cut_points(n, 2, offsets, text_len)


@pytest.mark.store_args(block_tokens=4)
def test_save_with_bad_offsets_raises_and_writes_nothing(store):
    seq = BASE[:10]
    bad = list(seq.offsets)
    bad[4], bad[8] = bad[8], bad[4]                  # goes down at 8
    with pytest.raises(ValueError, match=re.escape(f"text_offsets[8]={seq.offsets[4]} is outside")):
        store.save(seq.text, seq.ids, tensors_of(seq), positional=POS, text_offsets=bad)
    with pytest.raises(ValueError, match=re.escape("text_offsets holds 10 values; 10 tokens need 11")):
        store.save(seq.text, seq.ids, tensors_of(seq), positional=POS, text_offsets=seq.offsets[:-1])
    assert checkpoint_files(store.path) == []


def test_plan_blocks_names_parents_and_token_digests():
    seq = BASE[:300]
    blocks = plan_blocks(seq.text, seq.ids, 64, seq.offsets)
    ends = [64, 128, 192, 256, 300]
    assert [b.tokens for b in blocks] == ends
    assert [b.token_start for b in blocks] == [0, 64, 128, 192, 256]
    assert [b.text_bytes for b in blocks] == [seq.offsets[c] for c in ends]
    assert [b.text_start for b in blocks] == [0] + [seq.offsets[c] for c in ends[:-1]]
    assert [b.sha for b in blocks] == [hashlib.sha1(seq.text[:seq.offsets[c]]).hexdigest() for c in ends]
    assert [b.name for b in blocks] == [b.sha + ".kv" for b in blocks]
    assert [b.parent for b in blocks] == [""] + [b.sha for b in blocks[:-1]]
    assert blocks[0].parent_digest == NO_PARENT
    assert blocks[2].parent_digest == bytes.fromhex(blocks[1].sha)
    assert [b.last for b in blocks] == [False] * 4 + [True]

    def digest(c):
        return hashlib.sha1(seq.ids[:c].astype("<u4").tobytes()).digest()[:8]
    assert [b.token_digest for b in blocks] == [digest(c) for c in ends]
    assert [b.parent_token_digest for b in blocks] == [digest(0)] + [digest(c) for c in ends[:-1]]
    assert blocks[-1].flags(True) == CHAIN_RESTORABLE | CHAIN_END
    assert blocks[0].flags(False) == 0
    # The same text with other token ids: the same names, other token digests.
    other = plan_blocks(seq.text, seq.ids + 1, 64, seq.offsets)
    assert [b.sha for b in other] == [b.sha for b in blocks]
    assert all(a.token_digest != b.token_digest for a, b in zip(other, blocks))


@pytest.mark.parametrize("snapshot", [True, False])
@pytest.mark.store_args(block_tokens=64)
def test_blocks_on_disk(store, snapshot):
    seq = BASE[:300]
    last = save(store, seq, snapshot, reason=Reason.SHUTDOWN)
    plan = plan_blocks(seq.text, seq.ids, 64, seq.offsets)
    assert checkpoint_files(store.path) == sorted(b.name for b in plan)
    abi = PAYLOAD_ABI_CHAIN if store.settings.kv_codec == "raw" else PAYLOAD_ABI_TABLE_CHAIN     # packed: CI's pass
    for b in plan:
        e = kvstore.format.read_entry(os.path.join(store.path, b.name))
        assert (e.payload_abi, e.is_block, e.sha, e.parent) == (abi, True, b.sha, b.parent)
        assert (e.token_start, e.tokens, e.text_start, e.text_bytes) == \
            (b.token_start, b.tokens, b.text_start, b.text_bytes)
        assert e.segment_bytes == b.text_bytes - b.text_start
        assert e.stored_tokens == b.tokens - b.token_start
        assert (e.token_digest, e.parent_token_digest) == (b.token_digest, b.parent_token_digest)
        assert e.block_grid == 64
        assert e.reason == (Reason.SHUTDOWN if b.last else Reason.CONTINUED)
        assert e.restorable == (b.last or not snapshot)
        assert e.chain_flags == (CHAIN_END if b.last else 0) | (CHAIN_RESTORABLE if b.last or not snapshot else 0)
        with open(e.path, "rb") as f:                 # the stored segment is the block's own text
            f.seek(e.text_offset)
            assert f.read(e.segment_bytes) == seq.text[b.text_start:b.text_bytes]
    assert (last.sha, last.tokens, last.token_start, last.parent) == \
        (plan[-1].sha, 300, 256, plan[-2].sha)
    assert index_of(store).chain(last) == [kvstore.format.read_entry(os.path.join(store.path, b.name)) for b in plan]


@pytest.mark.store_args(block_tokens=64)
def test_without_offsets_a_save_is_one_block(store):
    seq = BASE[:300]
    e = store.save(seq.text, seq.ids, tensors_of(seq), positional=POS)
    assert checkpoint_files(store.path) == [e.name]
    assert (e.is_block, e.token_start, e.text_start, e.parent, e.tokens, e.restorable) == \
        (True, 0, 0, "", 300, True)
    check_loaded(store.load(store.find(seq.prompt(300))))
    assert store.find(seq.prompt(299)) is None          # no boundary inside


# ---- 2. round trip at every block boundary ------------------------------------------------


@pytest.mark.parametrize("into", ["numpy", "mlx"])
@pytest.mark.parametrize("snapshot", [True, False])
@pytest.mark.store_args(block_tokens=64)
def test_round_trip_at_every_block_boundary(store, into, snapshot):
    if into == "mlx":
        pytest.importorskip("mlx.core")
    n = 300
    seq = BASE[:n]
    cuts = [64, 128, 192, 256, 300]
    if snapshot:
        # Intermediate blocks of a save with a snapshot are links only: save
        # the sequence as it grows, so that every boundary ends a save.
        for c in cuts:
            save(store, seq[:c])
    else:
        save(store, seq, snapshot=False)
    assert len(checkpoint_files(store.path)) == len(cuts)
    for c in cuts:
        e = store.find(seq.prompt(c))
        assert e is not None and (e.tokens, e.text_bytes) == (c, seq.offsets[c])
        ck = store.load(e, into=into)
        check_loaded(ck, snapshot)
        assert ck.entry.tokens == c
        assert np.array_equal(ck.tokens, seq.ids[:c])
        assert ck.text_bytes == seq.text[:seq.offsets[c]]
        # Bit-identical to the saved arrays sliced to the block's end.
        assert as_np(ck.tensors["k"]).tobytes() == kv_of(seq.ids)[:, :, :c, :].tobytes()
        assert as_np(ck.tensors["p"]).tobytes() == rows_of(seq.ids)[:c].tobytes()
        if snapshot:
            assert as_np(ck.tensors["s"]).tobytes() == snap_of(seq.ids[:c]).tobytes()
    # A prompt leaving the sequence inside a block gets the boundary before it.
    for p in [1, 63, 64, 65, 127, 150, 255, 299, 300]:
        e = store.find(seq.prompt(p))
        want = max([c for c in cuts if c <= p], default=None)
        assert (e.tokens if e else None) == want, p
        assert (e.tokens if e else 0) >= p - 64
        if e is not None:
            check_loaded(store.load(e, into=into), snapshot)
    assert store.find(b"w0 w1 ") is None                # shorter than any block


@pytest.mark.store_args(block_tokens=64)
def test_find_accept_passes_over_blocks(store):
    save(store, BASE[:300], snapshot=False)
    prompt = BASE.prompt(300)
    assert store.find(prompt, accept=lambda e: e.tokens < 200).tokens == 192
    assert store.find(prompt, accept=lambda e: e.tokens in (64, 128)).tokens == 128
    assert store.find(prompt, accept=lambda e: False) is None
    assert store.find(prompt, accept=lambda e: e.tokens != 256).tokens == 300


@pytest.mark.store_args(block_tokens=64, min_tokens=100)
def test_min_tokens_applies_to_blocks(store):
    save(store, BASE[:300], snapshot=False)
    assert store.find(BASE.prompt(64)) is None            # 64 < min_tokens: it only links
    assert store.find(BASE.prompt(127)) is None
    e = store.find(BASE.prompt(128))
    assert e.tokens == 128
    check_loaded(store.load(e), snapshot=False)


# ---- 3. only the missing blocks are written ------------------------------------------------


@pytest.mark.store_args(block_tokens=64)
def test_only_missing_blocks_are_written(store):
    def sizes():
        return {n: os.path.getsize(os.path.join(store.path, n)) for n in checkpoint_files(store.path)}

    def names(seq, ends):
        return {hashlib.sha1(seq.text[:seq.offsets[c]]).hexdigest() + ".kv" for c in ends}

    a = BASE[:1000]
    save(store, a)
    a_ends = list(range(64, 1000, 64)) + [1000]
    assert set(sizes()) == names(a, a_ends) and len(a_ends) == 16
    stats = store.stats()
    assert stats["bytes_saved"] == sum(sizes().values()) and stats["saves"] == 1
    before = {n: os.stat(os.path.join(store.path, n)) for n in sizes()}

    # The same save again writes nothing and returns the stored last block.
    again = save(store, a)
    assert again.sha == hashlib.sha1(a.text).hexdigest() and again.tokens == 1000
    assert store.stats()["bytes_saved"] == stats["bytes_saved"]
    assert store.stats()["saves"] == 1
    for n, st in before.items():
        now = os.stat(os.path.join(store.path, n))
        assert (now.st_ino, now.st_mtime_ns, now.st_size) == (st.st_ino, st.st_mtime_ns, st.st_size)

    # B extends A to 1300: only its own blocks (A's tail at 1000 is not one of them).
    b = Seq(range(1300))
    old = sizes()
    save(store, b)
    new = {n: s for n, s in sizes().items() if n not in old}
    assert set(new) == names(b, [1024, 1088, 1152, 1216, 1280, 1300])
    assert store.stats()["bytes_saved"] == stats["bytes_saved"] + sum(new.values())
    for n, st in before.items():                    # nothing of A rewritten
        assert os.stat(os.path.join(store.path, n)).st_ino == st.st_ino
    assert names(a, [1000]) <= set(sizes())          # A's tail stays (a leaf of its own)

    # C shares A's first 500 tokens, then goes elsewhere: blocks from 512 on are its own.
    c = Seq(list(range(500)) + list(range(50_000, 50_300)))
    old, saved = sizes(), store.stats()["bytes_saved"]
    save(store, c)
    new = {n: s for n, s in sizes().items() if n not in old}
    assert set(new) == names(c, [512, 576, 640, 704, 768, 800])
    assert store.stats()["bytes_saved"] == saved + sum(new.values())
    assert len(sizes()) == 16 + 6 + 6
    for seq, ends in ((a, a_ends), (b, [1300]), (c, [800])):
        check_loaded(store.load(store.find(seq.prompt(ends[-1]))))


# ---- 4. snapshots ---------------------------------------------------------------------------


@pytest.mark.store_args(block_tokens=64)
def test_snapshot_makes_only_the_last_block_restorable(store):
    seq = BASE[:300]
    save(store, seq, tag=1)
    flags = {e.tokens: e.restorable for e in store.entries()}
    assert flags == {64: False, 128: False, 192: False, 256: False, 300: True}
    for p in (64, 100, 128, 200, 256, 299):
        assert store.find(seq.prompt(p)) is None, p       # links only: never a hit
    e = store.find(seq.prompt(300))
    assert e.tokens == 300
    check_loaded(store.load(e), tags=(1,))

    # A save ending exactly on a link block rewrites it as restorable; its children still load.
    link = block_of(store, 128)
    e128 = save(store, seq[:128], tag=2)
    assert e128.sha == link.sha and e128.restorable and e128.chain_flags == CHAIN_RESTORABLE | CHAIN_END
    assert len(checkpoint_files(store.path)) == 5
    assert block_of(store, 64).restorable is False            # the ancestor left as it was
    hit = store.find(seq.prompt(200))
    assert hit.tokens == 128
    ck = store.load(hit)
    check_loaded(ck, tags=(2,))
    assert as_np(ck.tensors["s"]).tobytes() == snap_of(seq.ids[:128], 2).tobytes()
    ck = store.load(store.find(seq.prompt(300)))
    check_loaded(ck, tags=(1,))
    assert index_of(store).orphans == []


@pytest.mark.store_args(block_tokens=64)
def test_longer_save_keeps_restorable_blocks_restorable(store):
    seq = BASE[:300]
    save(store, seq[:128], tag=1)                  # 64 link, 128 restorable
    first = block_of(store, 128)
    save(store, seq, tag=2)                        # 128 is one of its links: kept as it is
    again = block_of(store, 128)
    assert again.restorable and again.inode == first.inode
    check_loaded(store.load(store.find(seq.prompt(130))), tags=(1,))
    check_loaded(store.load(store.find(seq.prompt(300))), tags=(2,))


# ---- 5. bad blocks: a shorter hit or a miss, never an exception ---------------------------

def rewrite_chain_head(e, **changes):
    """Rewrites the chain header of block e with a valid CRC."""
    fields = dict(parent=bytes.fromhex(e.parent) if e.parent else NO_PARENT, token_start=e.token_start,
                  text_start=e.text_start, grid=e.block_grid, flags=e.chain_flags, token_digest=e.token_digest,
                  parent_token_digest=e.parent_token_digest)
    fields.update(changes)
    with open(e.path, "r+b") as f:
        f.seek(e.payload_offset)
        f.write(pack_chain_head(**fields))


def tensor_offset(e, name):
    """File offset of tensor name's data in block e."""
    fd = os.open(e.path, os.O_RDONLY)
    try:
        m = read_manifest(fd, e)
    finally:
        os.close(fd)
    if name == "tokens":
        return e.tensors_offset + m.tokens[0]
    return e.tensors_offset + next(t[3] for t in m.tensors if t[0] == name)


@pytest.mark.store_args(block_tokens=64)
def test_missing_middle_block_orphans_the_blocks_after_it(store, caplog):
    seq = BASE[:300]
    save(store, seq, snapshot=False)
    os.unlink(block_of(store, 128).path)
    caplog.set_level(logging.INFO, logger="kvstore")
    evicted = store.evict()
    assert sorted(e.tokens for e in evicted) == [192, 256, 300]
    assert sum("evicted reason=orphan" in m for m in log_lines(caplog)) == 3
    assert [e.tokens for e in store.entries()] == [64]
    e = store.find(seq.prompt(300))
    assert e.tokens == 64
    check_loaded(store.load(e), snapshot=False)


@pytest.mark.store_args(block_tokens=64)
def test_lookup_never_finds_orphans_and_sweeps_them(store, caplog):
    seq = BASE[:300]
    save(store, seq, snapshot=False)
    os.unlink(block_of(store, 128).path)
    caplog.set_level(logging.INFO, logger="kvstore")
    e = store.find(seq.prompt(300))
    assert e.tokens == 64                              # not 300: its chain is broken
    assert len(checkpoint_files(store.path)) == 1      # the lookup's sweep removed the orphans
    assert sum("evicted reason=orphan" in m for m in log_lines(caplog)) == 3
    check_loaded(store.load(e), snapshot=False)


BROKEN_LINKS = {
    # block (by its end) -> chain header fields rewritten; the first block hit by it
    "parent_longer_than_child": (192, lambda s: dict(token_start=100)),
    "parent_elsewhere": (192, lambda s: dict(parent=bytes.fromhex(block_of(s, 64).sha))),
    "cycle": (128, lambda s: dict(parent=bytes.fromhex(block_of(s, 256).sha))),
    "text_start": (192, lambda s: dict(text_start=block_of(s, 192).text_start - 1)),
    "token_digest": (192, lambda s: dict(parent_token_digest=b"\x01" * 8)),
    "parent_is_child": (192, lambda s: dict(parent=bytes.fromhex(block_of(s, 192).sha))),
}


@pytest.mark.parametrize("case", sorted(BROKEN_LINKS))
@pytest.mark.store_args(block_tokens=64)
def test_chain_header_pointing_elsewhere(store, caplog, case):
    seq = BASE[:300]
    save(store, seq, snapshot=False)
    leaf = store.find(seq.prompt(300))
    assert leaf.tokens == 300
    at, change = BROKEN_LINKS[case]
    victim = block_of(store, at)
    rewrite_chain_head(victim, **change(store))
    kvstore.format.read_entry(victim.path)                    # a valid envelope: only the link is wrong
    caplog.set_level(logging.INFO, logger="kvstore")
    # The leaf found before the damage: a shorter hit or a miss, never wrong data.
    ck = store.load(leaf)
    assert ck is None or ck.entry.tokens < at
    if ck is not None:
        check_loaded(ck, snapshot=False)
    # From now on the block and those after it are never found, and they go.
    e = store.find(seq.prompt(300))
    assert e.tokens == at - 64
    check_loaded(store.load(e), snapshot=False)
    store.evict()
    assert sorted(e.tokens for e in store.entries()) == [c for c in (64, 128, 192, 256, 300) if c < at]
    assert index_of(store).orphans == []
    assert any("reason=orphan" in m or "reason=broken_chain" in m for m in log_lines(caplog))


def _truncate(e):
    os.truncate(e.path, e.file_size // 2)


def _garbage(e):
    with open(e.path, "r+b") as f:
        f.write(random.Random(7).randbytes(e.file_size))


def _chain_crc(e):
    flip(e.path, e.payload_offset + 30)


def _bad_range(e):
    rewrite_chain_head(e, token_start=e.tokens)       # token_start >= header tokens


def _tensor_byte(e):
    flip(e.path, tensor_offset(e, "k") + 5)


def _token_byte(e):
    flip(e.path, tensor_offset(e, "tokens") + 2)


def _axis0_byte(e):
    flip(e.path, tensor_offset(e, "p") + 1)


def _manifest_byte(e):
    # A middle block's manifest is read while the blocks before it are read.
    flip(e.path, e.tensors_offset + PAYLOAD_HEADER.size + 3)


DAMAGE = {"truncated": _truncate, "garbage": _garbage, "chain_crc": _chain_crc, "bad_range": _bad_range,
          "tensor_byte": _tensor_byte, "token_byte": _token_byte, "axis0_byte": _axis0_byte,
          "manifest_byte": _manifest_byte}
# Damage that makes the envelope itself unreadable (the index drops the file).
ENVELOPE = {"truncated", "garbage", "chain_crc", "bad_range"}

def _damage_params():
    for kind in sorted(DAMAGE):
        for mode in ("stale", "relisted"):
            yield pytest.param(kind, mode, id=f"{kind}-{mode}")


@pytest.mark.parametrize("into", ["numpy", "mlx"])
@pytest.mark.parametrize("kind, mode", list(_damage_params()))
@pytest.mark.store_args(block_tokens=64)
def test_corrupt_middle_block_falls_back_to_the_longest_valid_ancestor(store, caplog, kind, mode, into):
    """A torn write, garbage, a bad chain header or a flipped byte in block 128
    of 64..300: the leaf's load returns block 64 and the damaged block and
    every block after it are gone.  "stale": the index still holds the lookup's
    listing; "relisted": the directory changed since the lookup (another
    process published a file), so the index re-read the damaged header."""
    if into == "mlx":
        pytest.importorskip("mlx.core")
    seq = BASE[:300]
    save(store, seq, snapshot=False)
    settle()
    leaf = store.find(seq.prompt(300))
    assert leaf.tokens == 300
    victim = block_of(store, 128)
    DAMAGE[kind](victim)
    if kind in ENVELOPE:
        with pytest.raises(kvstore.CorruptCheckpoint):
            kvstore.format.read_entry(victim.path)
    if mode == "relisted":
        touch_directory(store.path)
    caplog.set_level(logging.INFO, logger="kvstore")
    ck = store.load(leaf, into=into)
    assert ck is not None and ck.entry.tokens == 64
    check_loaded(ck, snapshot=False)
    assert any("kvstore: corrupt reason=" in m for m in log_lines(caplog))
    assert [e.tokens for e in store.entries()] == [64]
    assert checkpoint_files(store.path) == [block_of(store, 64).name]       # the damaged block went too
    e = store.find(seq.prompt(300))
    assert e.tokens == 64
    check_loaded(store.load(e), snapshot=False)
    # The sequence can be stored again at once.
    save(store, seq, snapshot=False)
    check_loaded(store.load(store.find(seq.prompt(300))), snapshot=False)


@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_corrupt_middle_block_found_at_open(tmp_path, caplog, kind):
    """The damage is there when a store opens the directory (a torn write
    before a power loss): the blocks after it are never found; the ancestor is."""
    d = tmp_path / "kv"
    seq = BASE[:300]
    with make_store(d, block_tokens=64) as s:
        save(s, seq, snapshot=False)
        victim = block_of(s, 128)
    DAMAGE[kind](victim)
    caplog.set_level(logging.INFO, logger="kvstore")
    with make_store(d, block_tokens=64) as s:
        e = s.find(seq.prompt(300))
        if kind in ENVELOPE:
            assert e.tokens == 64                               # the damaged envelope is never indexed
        else:
            assert e.tokens == 300                              # payload damage shows on load
        ck = s.load(e)
        assert ck is not None and ck.entry.tokens == 64
        check_loaded(ck, snapshot=False)
        assert not any(x.tokens > 64 for x in s.entries())
        assert index_of(s).orphans == []
        assert log_lines(caplog)


def _parsed_manifests(monkeypatch):
    """The names of the files whose manifests are parsed from now on (a list that grows)."""
    parsed = []
    real = kvstore.payload.Manifest.__init__

    def counting(self, raw, entry, data_offset):
        parsed.append(os.path.basename(entry.path))
        real(self, raw, entry, data_offset)
    monkeypatch.setattr(kvstore.payload.Manifest, "__init__", counting)
    return parsed


@pytest.mark.store_args(block_tokens=64)
def test_a_middle_block_manifest_is_parsed_once_and_its_damage_still_found(store, monkeypatch, caplog):
    """Loads keep the checked manifests of middle blocks (by their bytes and
    place): a second load parses only the root's and the target's; a middle
    block changed on disk is read and judged again."""
    seq = BASE[:300]
    save(store, seq, snapshot=False)
    leaf = store.find(seq.prompt(300))
    check_loaded(store.load(leaf), snapshot=False)
    parsed = _parsed_manifests(monkeypatch)
    check_loaded(store.load(store.find(seq.prompt(300))), snapshot=False)
    assert sorted(parsed) == sorted([block_of(store, 64).name, leaf.name])      # root and target only
    victim = block_of(store, 128)
    flip(victim.path, victim.tensors_offset + PAYLOAD_HEADER.size + 3)     # its manifest, parsed before
    caplog.set_level(logging.INFO, logger="kvstore")
    ck = store.load(store.find(seq.prompt(300)))
    assert ck is not None and ck.entry.tokens == 64
    assert any("corrupt reason=crc" in line for line in log_lines(caplog))


def rewrite_manifest(e, change):
    """Rewrites block e's manifest as change(raw) (as long), its CRC made good."""
    with open(e.path, "r+b") as f:
        f.seek(e.tensors_offset)
        magic, mlen, data_offset, _, reserved = PAYLOAD_HEADER.unpack(f.read(PAYLOAD_HEADER.size))
        raw = f.read(mlen)
        new = change(raw)
        assert len(new) == len(raw) and new != raw
        f.seek(e.tensors_offset)
        f.write(PAYLOAD_HEADER.pack(magic, mlen, data_offset, kvstore._native.crc32c(new), reserved) + new)


def _misaligned_offset(raw):
    # The first tensor's offset, one byte on: not 64-byte aligned.
    m = re.search(rb'"tensors":\[\{[^}]*"offset":([0-9]+)', raw)
    return raw[:m.start(1)] + str(int(m.group(1)) + 1).encode() + raw[m.end(1):]


def _crc_out_of_range(raw):
    # A ten-digit CRC made 9999999999, past 32 bits.
    m = re.search(rb'"crc32c":([0-9]{10})[,}]', raw)
    assert m, "no ten-digit CRC to spoil"
    return raw[:m.start(1)] + b"9999999999" + raw[m.end(1):]


def _fresh_manifest_caches(monkeypatch):
    """Empties the caches of checked manifests; returns _parsed_manifests()."""
    import collections
    from kvstore.payload import manifest
    monkeypatch.setattr(manifest, "_MANIFESTS", collections.OrderedDict())
    monkeypatch.setattr(manifest, "_TEMPLATES", collections.OrderedDict())
    return _parsed_manifests(monkeypatch)


@pytest.mark.store_args(block_tokens=64)
def test_middle_blocks_alike_but_for_offsets_and_crcs_are_parsed_once(store, monkeypatch):
    """A fresh process's first load of a chain parses the root's and the
    target's manifests and one of the middle blocks' (128): the others (192,
    256) are like it but for their offsets and CRCs, and are checked as that."""
    seq = BASE[:300]
    save(store, seq, snapshot=False)
    parsed = _fresh_manifest_caches(monkeypatch)
    check_loaded(store.load(store.find(seq.prompt(300))), snapshot=False)
    # (Packed blocks too, in CI's packed pass: table planes without exceptions
    # have the same lengths in every block, so their manifests are alike.)
    assert sorted(parsed) == sorted(block_of(store, n).name for n in (64, 128, 300))


@pytest.mark.parametrize("damage", [_misaligned_offset, _crc_out_of_range])
@pytest.mark.store_args(block_tokens=64)
def test_a_middle_block_like_another_is_still_checked_whole(store, monkeypatch, caplog, damage):
    """Block 192's manifest is spoilt in one offset or CRC, its CRC made
    good: like 128's but for them, it is checked as that one's without being
    parsed, and its bad value still found (the load stops at 128)."""
    seq = BASE[:300]
    save(store, seq, snapshot=False)
    victim = block_of(store, 192)
    rewrite_manifest(victim, damage)
    parsed = _fresh_manifest_caches(monkeypatch)
    caplog.set_level(logging.INFO, logger="kvstore")
    ck = store.load(store.find(seq.prompt(300)))
    assert ck is not None and ck.entry.tokens == 128
    check_loaded(ck, snapshot=False)
    assert victim.name not in parsed
    assert any("corrupt reason=bad_manifest" in m for m in log_lines(caplog))


@pytest.mark.store_args(block_tokens=64)
def test_corrupt_leaf_with_snapshots_is_a_miss(store, caplog):
    """With snapshots the ancestors are links only: a corrupt leaf leaves nothing to restore."""
    seq = BASE[:300]
    save(store, seq)
    leaf = store.find(seq.prompt(300))
    flip(leaf.path, tensor_offset(leaf, "s"))
    caplog.set_level(logging.INFO, logger="kvstore")
    assert store.load(leaf) is None
    assert any("corrupt reason=crc" in m for m in log_lines(caplog))
    assert store.find(seq.prompt(300)) is None
    assert sorted(e.tokens for e in store.entries()) == [64, 128, 192, 256]   # links stay (leaves for eviction)
    assert index_of(store).orphans == []


@pytest.mark.parametrize("case", ["heads", "missing_tensor"])
@pytest.mark.store_args(block_tokens=64)
def test_chain_mismatch_is_a_shorter_hit_or_a_miss(store, caplog, case):
    """Two saves whose positional tensors disagree in the non-axis dimensions
    (or the second one grows a tensor the first did not have): the longer
    chain's blocks do not fit together."""
    a, b = BASE[:200], BASE[:300]
    if case == "heads":
        save(store, a, snapshot=False, heads=2)
        save(store, b, snapshot=False, heads=4)
    else:
        store.save(a.text, a.ids, {"k": kv_of(a.ids)}, positional={"k": 2}, text_offsets=a.offsets)
        save(store, b, snapshot=False)
    caplog.set_level(logging.INFO, logger="kvstore")
    e = store.find(b.prompt(300))
    assert e.tokens == 300
    ck = store.load(e)
    assert ck is None or ck.entry.tokens < 300
    assert any("reason=chain_mismatch" in m for m in log_lines(caplog))
    assert not os.path.exists(e.path)
    # Whatever is found from now on loads the state it claims.
    for p in (64, 128, 200, 256, 300):
        e = store.find(b.prompt(p))
        if e is not None:
            ck = store.load(e)
            if ck is not None:
                assert np.array_equal(ck.tokens, b.ids[:ck.entry.tokens])
                assert ck.text_bytes == b.text[:b.offsets[ck.entry.tokens]]
                k = as_np(ck.tensors["k"])
                assert k.tobytes() in (kv_of(ck.tokens, 2).tobytes(), kv_of(ck.tokens, 4).tobytes())


@pytest.mark.store_args(block_tokens=64)
def test_wipe_and_discard_take_the_blocks_after_along(store):
    seq = BASE[:300]
    save(store, seq, snapshot=False)
    assert store.wipe(block_of(store, 192)) == 3
    assert sorted(e.tokens for e in store.entries()) == [64, 128]
    save(store, seq, snapshot=False)
    assert store.discard(block_of(store, 128), "engine_refused") is True
    assert [e.tokens for e in store.entries()] == [64]
    assert store.find(seq.prompt(300)).tokens == 64


# ---- 6. two writers on overlapping chains ------------------------------------------------

SHARED = Seq(range(240))
ROUNDS = 20


def _writer_plan(wid, rounds=ROUNDS):
    """[(Seq, tag)] writer wid saves: prefixes of SHARED, and branches of its own."""
    rng = random.Random(1000 + wid)
    out = []
    for r in range(rounds):
        out.append((SHARED[:rng.randrange(17, 240)], wid + 1))
        m = rng.randrange(1, 200)
        own = [100_000 * (wid + 1) + 1000 * r + j for j in range(rng.randrange(1, 60))]
        out.append((Seq(list(range(m)) + own), wid + 1))
    return out


def _overlap_writer(path, wid, start):
    start.wait()
    with make_store(path, block_tokens=16) as s:
        for seq, tag in _writer_plan(wid):
            assert save(s, seq, tag=tag) is not None


def check_directory(path, snapshot=True, tags=(0,), block_tokens=16, load="all", rng=None, verified=None):
    """No orphans left in the directory; then a store opened on it (which
    removes stale temporaries) sees every chain whole, every file verifies
    (those not in `verified` yet), every restorable block is found and (per
    `load`: all, or leaves and a sample) loads exactly."""
    assert DirectoryIndex(path).orphans == []
    with make_store(path, block_tokens=block_tokens) as s:
        assert checkpoint_files(path, temporaries=True) == checkpoint_files(path)
        entries = s.entries()
        assert index_of(s).orphans == []
        assert len(entries) == len(checkpoint_files(path))     # every file a valid envelope
        parents = {e.parent for e in entries}
        loaded = 0
        for e in entries:
            assert e.is_block
            assert index_of(s).chain(e) is not None, e
            key = (e.name, e.inode, e.file_size)
            if verified is None or key not in verified:
                assert verify_file(e.path) is None
                if verified is not None:
                    verified.add(key)
            if not e.restorable:
                continue
            text = chain_text(s, e)
            f = s.find(text + b"\x00")
            assert f is not None and f.sha == e.sha
            if load == "all" or e.sha not in parents or (rng is not None and rng.random() < 0.05):
                ck = s.load(f)
                check_loaded(ck, snapshot, tags)
                assert ck.text_bytes == text and ck.entry.tokens == e.tokens
                loaded += 1
        return entries, loaded


def test_two_processes_save_overlapping_chains(tmp_path):
    path = str(tmp_path / "kv")
    make_store(path).close()
    start = CTX.Event()
    procs = [CTX.Process(target=_overlap_writer, args=(path, w, start)) for w in (0, 1)]
    for p in procs:
        p.start()
    start.set()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    _, loaded = check_directory(path, tags=(1, 2))
    assert loaded > 0
    with make_store(path, block_tokens=16) as s:
        for w in (0, 1):
            for seq, _ in _writer_plan(w):          # every save is there, whole, as one of the writers made it
                e = s.find(seq.prompt(len(seq)))
                assert e is not None and e.tokens == len(seq) and e.text_bytes == len(seq.text)
                check_loaded(s.load(e), tags=(1, 2))


# ---- 7. an evictor racing saves that extend a leaf ------------------------------------------

GROW = Seq(range(700))


def _growing_saver(path, rounds, done):
    with make_store(path, block_tokens=16) as s:            # its own budget is ample
        for r in range(rounds):
            save(s, GROW[:16 * (r + 1) + 5], snapshot=False)
    done.set()


def _evictor(path, budget_mb, done):
    with make_store(path, block_tokens=16, budget_mb=budget_mb) as s:
        while not done.is_set():
            s.evict()
        s.evict()


def test_evictor_racing_a_growing_chain(tmp_path):
    path = str(tmp_path / "kv")
    rounds = 40
    with make_store(path, block_tokens=16) as s:
        block = save(s, GROW[:16], snapshot=False).file_size
        s.wipe()
    budget_mb = 6 * block / 2**20
    done = CTX.Event()
    procs = [CTX.Process(target=_growing_saver, args=(path, rounds, done)),
             CTX.Process(target=_evictor, args=(path, budget_mb, done))]
    for p in procs:
        p.start()
    # Meanwhile: whatever a lookup finds either loads exactly or is a miss.
    rng = random.Random(3)
    with make_store(path, block_tokens=16) as s:
        while procs[0].is_alive():
            e = s.find(GROW.prompt(rng.randrange(16, 16 * rounds + 6)))
            if e is not None:
                ck = s.load(e)
                if ck is not None:
                    check_loaded(ck, snapshot=False)
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    check_directory(path, snapshot=False)
    with make_store(path, block_tokens=16, budget_mb=budget_mb) as s:
        s.evict()
        assert DirectoryIndex(path).orphans == []
        entries = s.entries()
        assert entries and s.stats()["bytes"] <= s.budget_bytes
        assert all(index_of(s).chain(e) is not None for e in entries)
        for c in range(16, 16 * rounds + 6):
            e = s.find(GROW.prompt(c))
            if e is not None:                              # never a hole: what is found loads whole
                ck = s.load(e)
                check_loaded(ck, snapshot=False)
                assert ck.entry.tokens == e.tokens
        # Every block left is a prefix of GROW: the full prompt finds the longest.
        last = s.find(GROW.prompt(16 * rounds + 5))
        assert last is not None and last.tokens == max(e.tokens for e in entries)


# ---- 8. SIGKILL in the middle of a chained save ----------------------------------------------

HEADER = list(range(40))          # every crash chain shares its first two blocks


def _crash_seq(run, i):
    return Seq(HEADER + [100_000 * (run + 1) + 1000 * i + j for j in range(360)])


def _crash_saver(path, run, conn):
    with make_store(path, block_tokens=16, durable=True) as s:
        for i in itertools.count():
            conn.send(("begin", i))
            save(s, _crash_seq(run, i), snapshot=False)
            conn.send(("done", i))


def test_sigkill_in_the_middle_of_a_chained_save(tmp_path):
    path = str(tmp_path / "kv")
    make_store(path).close()
    rng = random.Random(11)
    verified = set()
    partial = 0
    # Twelve kills at least; more (up to 40) while none has landed inside a
    # chain's writing, which a slow fsync at the first block can delay.
    for run in range(40):
        if run >= 12 and partial:
            break
        parent, child = CTX.Pipe()
        p = CTX.Process(target=_crash_saver, args=(path, run, child))
        p.start()
        assert parent.poll(30)
        assert parent.recv() == ("begin", 0)
        time.sleep(rng.uniform(0.0, 0.25))
        os.kill(p.pid, signal.SIGKILL)
        p.join(30)
        assert p.exitcode == -signal.SIGKILL
        done = []
        while parent.poll():
            kind, i = parent.recv()
            if kind == "done":
                done.append(i)
        check_directory(path, snapshot=False, load="leaves", rng=rng, verified=verified)
        with make_store(path, block_tokens=16) as s:
            for i in done:                         # every save that returned is whole
                seq = _crash_seq(run, i)
                e = s.find(seq.prompt(len(seq)))
                assert e is not None and e.tokens == len(seq)
            # The save in flight left a prefix of its chain: whole blocks from the first on.
            seq = _crash_seq(run, len(done))
            e = s.find(seq.prompt(len(seq)))
            if e is not None:
                assert e.tokens in [c for c in range(16, 400, 16)] + [400]
                partial += 32 < e.tokens < 400
                check_loaded(s.load(e), snapshot=False)
    assert checkpoint_files(path, temporaries=True) == checkpoint_files(path)
    assert partial > 0                     # some kills did land inside a chain's writing


# ---- 9. eviction goes leaves first ----------------------------------------------------------

def _entry(sha, parent, tokens, hits, now, reason=Reason.CONTINUED):
    return kvstore.format.Entry(sha=sha, path=f"/x/{sha}.kv", quant_bits=16, reason=reason, ext_flags=kvstore.format.ExtFlag(0),
                         model_id=0, tokens=tokens, hits=hits, ctx_size=0, payload_abi=PAYLOAD_ABI_CHAIN,
                         created_at=now, last_used=now, payload_bytes=1000, text_bytes=tokens * 4,
                         file_size=1000, token_start=0, parent=parent)


def test_eviction_order_puts_leaves_first():
    now = 1_700_000_000
    x1, x2, x3 = (_entry("a" * 40, "", 100, 0, now), _entry("b" * 40, "a" * 40, 100, 0, now),
                  _entry("c" * 40, "b" * 40, 100, 100, now))
    y1, y2 = _entry("d" * 40, "", 100, 5, now), _entry("e" * 40, "d" * 40, 100, 10, now)
    entries = [x1, x2, x3, y1, y2]
    # Scores alone would start with the cold interior blocks of x.
    assert sorted(entries, key=lambda e: policy.eviction_score(e, now))[:2] == [x1, x2]
    assert policy.eviction_order(entries, now) == [y2, y1, x3, x2, x1]
    assert policy.eviction_order(list(reversed(entries)), now) == [y2, y1, x3, x2, x1]
    # A parent that is not among the candidates does not hold its child back.
    assert policy.eviction_order([x2, x3], now) == [x3, x2]
    # Protected goes last, children first still.
    assert policy.eviction_order(entries, now, protected=frozenset([y2.sha])) == [x3, x2, x1, y2, y1]
    assert policy.select_victims(entries, 3000, now) == [y2, y1]


def test_budget_eviction_never_cuts_a_hot_chain(tmp_path, caplog):
    d = tmp_path / "kv"
    x, y = BASE[:192], Seq(range(60_000, 60_192))
    with make_store(d, block_tokens=64) as s:
        save(s, x, snapshot=False)
        save(s, y, snapshot=False)
        xs = {e.tokens: e for e in s.entries() if e.sha == hashlib.sha1(x.text[:e.text_bytes]).hexdigest()}
        ys = {e.tokens: e for e in s.entries() if e.sha not in {v.sha for v in xs.values()}}
        assert sorted(xs) == sorted(ys) == [64, 128, 192]
    for _ in range(50):
        kvstore.format.touch(xs[192].path)                   # the leaf of x is hot, its interior cold
    budget = sum(e.file_size for e in xs.values()) + ys[64].file_size // 2
    caplog.set_level(logging.INFO, logger="kvstore")
    with make_store(d, block_tokens=64, budget_mb=budget / 2**20) as s:        # open evicts
        left = {e.sha for e in s.entries()}
        assert left == {e.sha for e in xs.values()}                            # x whole, y gone
        evicted = re.findall(r"evicted reason=budget tokens=(\d+) bytes=\d+ file=(\w+)…kv",
                             "\n".join(log_lines(caplog)))
        # y leaf first (the cold interior blocks of x wait for x's hot leaf).
        assert evicted == [("192", ys[192].sha[:12]), ("128", ys[128].sha[:12]), ("64", ys[64].sha[:12])]
        check_loaded(s.load(s.find(x.prompt(192))), snapshot=False)
    caplog.clear()
    # Under a budget for one block only, x goes leaf first, down to its root.
    with make_store(d, block_tokens=64, budget_mb=xs[64].file_size * 1.2 / 2**20) as s:
        evicted = re.findall(r"evicted reason=budget tokens=(\d+)", "\n".join(log_lines(caplog)))
        assert evicted == ["192", "128"]
        assert [e.sha for e in s.entries()] == [xs[64].sha]
        check_loaded(s.load(s.find(x.prompt(192))), snapshot=False)


def test_just_saved_block_is_protected(tmp_path):
    """Over budget after a save: other chains' leaves go, never the block just saved."""
    d = tmp_path / "kv"
    seq, other = BASE[:300], Seq(range(90_000, 90_192))
    with make_store(d, block_tokens=64) as s:
        save(s, other, snapshot=False)
        one = block_of(s, 64).file_size
    with make_store(d, block_tokens=64, budget_mb=6 * one / 2**20) as s:
        last = save(s, seq, snapshot=False)              # 5 blocks + 3 of other > 6
        assert os.path.exists(last.path)
        assert sorted(e.tokens for e in s.entries()) == [64, 64, 128, 192, 256, 300]
        assert {e.tokens for e in s.entries() if e.sha == last.sha or index_of(s).chain(e)[0].sha ==
                block_of(s, 64, seq.text).sha} == {64, 128, 192, 256, 300}
        check_loaded(s.load(s.find(seq.prompt(300))), snapshot=False)


def test_save_never_returns_a_block_its_own_eviction_removed(tmp_path, caplog):
    d = tmp_path / "kv"
    seq = BASE[:300]
    with make_store(d, block_tokens=64) as s:
        one = save(s, seq[:128], snapshot=False).file_size            # two blocks stored
    caplog.set_level(logging.INFO, logger="kvstore")
    with make_store(d, block_tokens=64, budget_mb=3.5 * one / 2**20) as s:
        # Three new blocks fit the budget; the whole chain (five) does not.
        last = save(s, seq, snapshot=False)
        # Either refused (None, with a log line), or kept: never a dangling Entry.
        assert last is None or os.path.exists(last.path), log_lines(caplog)
        if last is not None:
            check_loaded(s.load(s.find(seq.prompt(300))), snapshot=False)


# ---- 10. mixed layouts ----------------------------------------------------------------------

def test_whole_and_chain_layouts_share_a_directory(tmp_path):
    d = tmp_path / "kv"
    w = BASE[:100]
    c = BASE[:300]
    other = Seq(range(70_000, 70_150))
    with make_store(d, layout="whole", block_tokens=64) as whole:
        ew = save(whole, w)
        eo = save(whole, other)
        whole_abi = PAYLOAD_ABI_TENSORS if whole.settings.kv_codec == "raw" else PAYLOAD_ABI_TABLE_TENSORS
        assert (ew.payload_abi, ew.is_block, eo.is_block) == (whole_abi, False, False)     # packed: CI's pass
        assert len(checkpoint_files(d)) == 2                  # one file per save, offsets or not
    with make_store(d, block_tokens=64) as chained:
        save(chained, c, snapshot=False)
        assert len(checkpoint_files(d)) == 2 + 5
        # One lookup over both: the ABI 16 file at 100 beats the block at 64.
        e = chained.find(c.prompt(110))
        assert (e.tokens, e.is_block) == (100, False)
        check_loaded(chained.load(e))
        e = chained.find(c.prompt(130))
        assert (e.tokens, e.is_block) == (128, True)
        check_loaded(chained.load(e), snapshot=False)
        e = chained.find(other.prompt(150))
        assert (e.tokens, e.is_block) == (150, False)
        check_loaded(chained.load(e))
    with make_store(d, layout="whole", block_tokens=64) as whole:
        e = whole.find(c.prompt(300))
        assert (e.tokens, e.is_block) == (300, True)
        check_loaded(whole.load(e, into="numpy"), snapshot=False)
        e = whole.find(c.prompt(99))
        assert (e.tokens, e.is_block) == (64, True)
        check_loaded(whole.load(e), snapshot=False)
        # A whole save of a text no chain block ends at is an ABI 16 file.
        e = save(whole, c[:150], snapshot=False)
        assert (e.tokens, e.is_block) == (150, False)
        assert len(checkpoint_files(d)) == 8
        assert whole.find(c.prompt(160)).tokens == 150
        assert whole.find(c.prompt(300)).tokens == 300
    with make_store(d, block_tokens=64) as chained:
        # A chained save whose last block is an ABI 16 file of the same text keeps it.
        kept = save(chained, w)
        assert (kept.tokens, kept.is_block, kept.inode) == (100, False, ew.inode)
        check_loaded(chained.load(chained.find(c.prompt(110))))


def test_whole_save_does_not_cut_a_chain(tmp_path):
    d = tmp_path / "kv"
    c = BASE[:300]
    with make_store(d, block_tokens=64) as chained:
        save(chained, c, snapshot=False)
    with make_store(d, layout="whole", block_tokens=64) as whole:
        save(whole, c[:128], snapshot=False)          # ends where block 128 (restorable) ends
        e = whole.find(c.prompt(300))
        assert e is not None and e.tokens == 300, e and e.tokens
        check_loaded(whole.load(e), snapshot=False)


def test_chains_are_never_consumed(tmp_path):
    opts = Settings(min_tokens=1, cold_max_tokens=10)
    with make_store(tmp_path / "kv", settings=opts, block_tokens=64) as s:
        seq = BASE[:300]
        save(s, seq, snapshot=False)
        for _ in range(3):
            ck = s.load(s.find(seq.prompt(300)))
            check_loaded(ck, snapshot=False)
        assert len(checkpoint_files(s.path)) == 5
        assert s.stats()["consumed"] == 0


# ---- 11. hits ---------------------------------------------------------------------------------

@pytest.mark.store_args(block_tokens=64)
def test_every_block_read_counts_a_hit(store):
    seq = BASE[:300]
    save(store, seq, snapshot=False)
    other = Seq(list(range(128)) + list(range(80_000, 80_100)))   # shares blocks 64 and 128
    save(store, other, snapshot=False)

    def hits():
        return {e.name: kvstore.format.read_entry(e.path).hits for e in store.entries()}
    assert set(hits().values()) == {0}
    ck = store.load(store.find(seq.prompt(300)))
    h = hits()
    seq_names = {block_of(store, t, seq.text).name for t in (64, 128, 192, 256, 300)}
    assert {n for n, v in h.items() if v == 1} == seq_names
    assert {n for n, v in h.items() if v == 0} == set(h) - seq_names
    assert ck.entry.hits == 1
    ck = store.load(store.find(seq.prompt(200)))            # blocks 64..192
    assert ck.entry.hits == 2
    store.load(store.find(other.prompt(228)))                # blocks 64, 128, then other's own
    h = hits()
    assert [h[block_of(store, t, seq.text).name] for t in (64, 128, 192, 256, 300)] == [3, 3, 2, 1, 1]
    assert [h[block_of(store, t, other.text).name] for t in (192, 228)] == [1, 1]
    assert kvstore.format.read_entry(block_of(store, 64).path).last_used > 0


# ---- 12. the lookup's shape with many blocks -------------------------------------------------

def test_lookup_over_2000_blocks_tries_only_matching_subtrees(tmp_path):
    d = tmp_path / "kv"
    os.makedirs(d, mode=0o700)
    chains = [Seq(range(1000 * (j + 1), 1000 * (j + 1) + 800)) for j in range(20)]
    for j, seq in enumerate(chains):
        # Each chain written in a directory of its own, then moved in: the
        # files are the same, the writing stays cheap.
        part = tmp_path / f"part{j}"
        with make_store(part, block_tokens=8) as s:
            s.save(seq.text, seq.ids, {"k": (seq.ids % 251).astype(np.uint8)[:, None]}, positional={"k": 0},
                   text_offsets=seq.offsets)
        for n in checkpoint_files(part):
            os.rename(part / n, d / n)
    with make_store(d, block_tokens=8) as s:
        entries = s.entries()
        assert len(entries) == 2000 and index_of(s).orphans == []
        f = index_of(s)._forest
        roots, r = [], f.first_root
        while r >= 0:
            roots.append(r)
            r = int(f.next_sibling[r])
        assert len(roots) == 20                             # one root per chain

        def forest(prompt):
            return f.matches(prompt)
        miss = b"nothing stored starts like this " * 100
        assert forest(miss) == [] and s.find(miss) is None
        for j in (0, 7, 19):
            seq = chains[j]
            first = hashlib.sha1(seq.text[:seq.offsets[8]]).hexdigest()
            prompt = seq.prompt(8)
            assert [f.entry[i].sha for i in forest(prompt)] == [first]
            e = s.find(prompt)
            assert (e.sha, e.tokens) == (first, 8)
            assert s.find(seq.prompt(15)).tokens == 8
            matched = forest(seq.prompt(456))
            assert [f.entry[i].tokens for i in matched] == list(range(8, 457, 8))
            e = s.find(seq.prompt(800))
            assert e.tokens == 800
            ck = s.load(e)
            assert np.array_equal(ck.tokens, seq.ids)
            assert np.array_equal(ck.tensors["k"][:, 0], (seq.ids % 251).astype(np.uint8))
        assert s.find(chains[3].prompt(800), accept=lambda e: e.tokens <= 400).tokens == 400


# ---- the directory lock -------------------------------------------------------------------

def _locked_saver(path, ready, go, done):
    with make_store(path, block_tokens=64) as s:       # opened (and evicted) before the test locks
        ready.set()
        go.wait(30)
        save(s, BASE[:300], snapshot=False)
    done.set()


@pytest.mark.parametrize("held", ["exclusive", "shared"])
def test_saves_publish_under_a_shared_lock(tmp_path, held):
    """An evictor (exclusive) holds back a chained save's publishing; another
    publisher (shared) does not, and under its budget the save runs no
    eviction pass that would wait for the exclusive lock."""
    path = str(tmp_path / "kv")
    make_store(path).close()
    ready, go, done = CTX.Event(), CTX.Event(), CTX.Event()
    p = CTX.Process(target=_locked_saver, args=(path, ready, go, done))
    p.start()
    try:
        assert ready.wait(30)
        fd = os.open(os.path.join(path, ".kvstore.lock"), os.O_RDONLY | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if held == "exclusive" else fcntl.LOCK_SH)
            go.set()
            if held == "exclusive":
                assert not done.wait(0.5)
                assert checkpoint_files(path, temporaries=True) == []
            else:
                deadline = time.monotonic() + 30
                while len(checkpoint_files(path)) < 5 and time.monotonic() < deadline:
                    time.sleep(0.01)
                assert len(checkpoint_files(path)) == 5
                assert done.wait(30)                     # no eviction pass under the budget
        finally:
            os.close(fd)
        assert done.wait(30)
    finally:
        p.join(30)
    assert p.exitcode == 0
    with make_store(path, block_tokens=64) as s:
        check_loaded(s.load(s.find(BASE.prompt(300))), snapshot=False)


# ---- tails a longer save replaces ------------------------------------------------------------

@pytest.mark.store_args(block_tokens=64)
def test_a_tail_goes_once_a_save_of_its_sequence_writes_the_whole_block_it_lay_in(store):
    seq = Seq(range(1, 400))
    prompt_end = save(store, seq[:150], snapshot=False, reason=Reason.SHUTDOWN)     # [128, 150): a tail
    answer_end = save(store, seq[:170], snapshot=False, reason=Reason.SHUTDOWN)     # its sibling [128, 170)
    anchor = save(store, Seq(list(range(1, 140)) + [999] * 20), snapshot=False, reason=Reason.COLD)
    names = {e.name for e in store.entries()}
    # A sibling tail replaces nothing: both ends of a sequence stay addressable.
    assert {prompt_end.name, answer_end.name, anchor.name} <= names
    assert store.find(seq.prompt(150)).tokens == 150
    # The sequence grows past the next boundary: the whole block [128, 192) is
    # written, and the tails of [128, ...) go (the cold anchor, another
    # sequence's and asked for, stays).
    save(store, seq[:200], snapshot=False, reason=Reason.CONTINUED)
    names = {e.name for e in store.entries()}
    assert prompt_end.name not in names and answer_end.name not in names and anchor.name in names
    assert store.find(seq.prompt(150)).tokens == 128
    check_loaded(store.load(store.find(seq.prompt(200)), min_tokens=1), snapshot=False)
    assert store.stats()["evictions"] == 2


# ---- where a prompt leaves the stored sequences (KVStore.explain) -------------------------

@pytest.mark.store_args(block_tokens=64)
def test_explain_finds_the_byte_where_a_prompt_leaves_the_stored_sequence(store):
    save(store, BASE[:300])
    d = store.explain(BASE.prompt(150))
    assert (d.shared_bytes, d.shared_tokens) == (BASE.offsets[128], 128)      # the deepest shared block
    assert d.byte == BASE.offsets[150] and d.parted
    assert (d.stored_bytes, d.stored_tokens) == (BASE.offsets[300], 300)
    # A prompt that only goes on past the stored end parted from nothing.
    d = store.explain(BASE[:400].text)
    assert (d.shared_tokens, d.byte, d.stored_tokens, d.parted) == (300, BASE.offsets[300], 300, False)
    # A prompt that ends inside a stored block: the stored text goes on past it.
    d = store.explain(BASE.text[:BASE.offsets[150]])
    assert (d.byte, d.stored_tokens, d.parted) == (BASE.offsets[150], 300, True)
    # Nothing stored shares the prompt's first block: nothing to explain.
    assert store.explain(BASE.prompt(10)) is None


@pytest.mark.store_args(block_tokens=64)
def test_explain_follows_the_stored_sequence_the_prompt_agrees_with_longest(store):
    other = Seq(list(range(128)) + list(range(5000, 5200)))         # BASE's first 128 tokens, then its own
    save(store, BASE[:300])
    save(store, other)
    d = store.explain(other.prompt(140))
    assert d.shared_tokens == 128 and d.byte == other.offsets[140]
    assert (d.stored_bytes, d.stored_tokens) == (len(other.text), 328)
    d = store.explain(BASE.prompt(170))
    assert d.byte == BASE.offsets[170] and d.stored_tokens == 300


@pytest.mark.store_args(block_tokens=64)
def test_explain_by_text_agrees_with_explain_by_name(store):
    from kvstore.divergence import divergence_by_text
    other = Seq(list(range(128)) + list(range(5000, 5200)))
    save(store, BASE[:300])
    save(store, other)
    entries = store.entries()
    for prompt in (BASE.prompt(150), other.prompt(140), BASE[:400].text, BASE.text[:BASE.offsets[150]],
                   BASE.prompt(10), other.prompt(300)):
        assert divergence_by_text(entries, prompt, store._reader.segment) == store.explain(prompt)
