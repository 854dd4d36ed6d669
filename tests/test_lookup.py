"""KVStore.find (docs/semantics.md §4): longest stored byte prefix, the filters, the
index kept current across processes, and digests confirmed by the bytes."""

import dataclasses
import functools
import hashlib
import os
import shutil
import struct
import time

import numpy as np
import pytest

import kvstore
from kvstore import index as index_mod
from kvhelpers import index_of, CTX, make_store, make_tensors


# tensors_for(text): k, 16 float16 values of the text's own (seeded by its SHA1).
tensors_for = functools.partial(make_tensors, 16, shape=("n",), dtypes=("float16",), names=("k",))


def kvstore_bytes(text):
    return text.encode("utf-8") if isinstance(text, str) else bytes(text)


def put(store, text, ntokens=4, **kw):
    e = store.save(text, list(range(1, ntokens + 1)), tensors_for(text), **kw)
    assert e is not None, "save refused"
    return e


def found_text(store, prompt):
    """The stored text find(prompt) returns (checked by loading), or None."""
    e = store.find(prompt)
    if e is None:
        return None
    ck = store.load(e)
    assert ck is not None
    assert ck.text_bytes == kvstore_bytes(prompt)[:e.text_bytes]
    assert ck.entry.sha == e.sha == hashlib.sha1(ck.text_bytes).hexdigest()
    return ck.text_bytes


def write_foreign(directory, text, abi=2, tokens=1000, payload=b"ds4 graph state" * 10, **fields):
    """A checkpoint with another payload ABI (ds4 writes 2), written by hand."""
    h = kvstore.format.Header(quant_bits=4, tokens=tokens, ctx_size=4096, payload_bytes=len(payload),
                       reason=kvstore.format.Reason.COLD, payload_abi=abi, created_at=int(time.time()),
                       **fields)
    path = os.path.join(directory, hashlib.sha1(text).hexdigest() + ".kv")
    with open(path, "wb") as f:
        f.write(h.pack() + struct.pack("<I", len(text)) + text + payload)
    return path


# ---- longest prefix ---------------------------------------------------------

def test_longest_stored_prefix_wins(store):
    for t in (b"System: be brief.", b"System: be brief. User: hi", b"System: be brief. User: hi. A: hello"):
        put(store, t)
    put(store, b"System: be brief. User: hX")                  # same length as one above, not a prefix
    put(store, b"System: be brief. User: hi. A: hello and a lot more than the prompt has")

    assert found_text(store, b"System: be brief. User: hi. A: hello. User: next") == \
        b"System: be brief. User: hi. A: hello"
    assert found_text(store, b"System: be brief. User: hi. A: hel") == b"System: be brief. User: hi"
    assert found_text(store, b"System: be brief. User: hi") == b"System: be brief. User: hi"   # equal = prefix
    assert found_text(store, b"System: be brief. User: hX and more") == b"System: be brief. User: hX"
    assert found_text(store, b"System: be brief. Us") == b"System: be brief."


def test_longest_prefix_among_many_lengths(store):
    base = bytes(range(256)) * 4
    for n in range(1, len(base), 37):
        put(store, base[:n])
    for cut in (1, 2, 38, 39, 500, 1000, 1024):
        e = store.find(base[:cut] + b"\x00tail")
        want = max(n for n in range(1, len(base), 37) if n <= cut)
        assert e is not None and e.text_bytes == want
        assert e.sha == hashlib.sha1(base[:want]).hexdigest()


@pytest.mark.store_args(layout="whole")
def test_longest_prefix_among_dense_lengths(store):
    # More stored lengths than 64-byte blocks of the prompt, some a block or
    # two apart and some inside one block: the flat lookup finishes their
    # digests many at a time where the CPU allows (csrc/sha1.c).
    base = hashlib.shake_256(b"dense lookup").digest(1500)
    lengths = sorted({*range(3, len(base), 11), *range(56, len(base), 64), *range(63, len(base), 64)})
    for n in lengths:
        put(store, base[:n])
    for cut in (3, 4, 56, 63, 64, 700, 1447, 1499, 1500):
        e = store.find(base[:cut] + b"\x00tail")
        want = max(n for n in lengths if n <= cut)
        assert e is not None and e.text_bytes == want, cut
        assert e.sha == hashlib.sha1(base[:want]).hexdigest()
    assert store.find(bytes([base[0] ^ 1]) + base[1:]) is None      # differs from every text at once
    assert store.find(base[:2]) is None


def test_non_prefix_misses(store):
    put(store, b"The quick brown fox")
    assert store.find(b"The quick brown cat jumps") is None
    assert store.find(b"the quick brown fox jumps") is None            # case differs
    assert store.find(b"XThe quick brown fox") is None                 # shifted
    assert store.find(b"The quick brown fo") is None                   # prompt shorter
    assert store.find(b"The quick brown fox") is not None


def test_empty_prompt_misses(store):
    put(store, b"a")
    assert store.find(b"") is None
    assert store.find("") is None


def test_prompt_shorter_than_every_entry(store):
    put(store, b"0123456789")
    put(store, b"0123456789abcdef")
    for p in (b"0", b"012345678", "012345678"):
        assert store.find(p) is None


def test_non_utf8_bytes(store):
    text = b"\xff\xfe\x80\x00binary\xc3"                  # invalid UTF-8, a NUL, a cut sequence
    put(store, text)
    assert found_text(store, text + b"\x28\x00more") == text
    assert store.find(b"\xff\xfe\x80\x01") is None


def test_byte_prefix_not_character_prefix(store):
    word = "naïve café"
    cut = word.encode("utf-8")[:3]                       # ends inside the two-byte "ï"
    put(store, cut)
    assert found_text(store, word) == cut
    assert found_text(store, word + " ✓") == cut


def test_str_and_bytes_prompts_are_the_same_key(store):
    text = "Système: réponds en français ✓"
    e1 = put(store, text)
    assert e1.sha == hashlib.sha1(text.encode("utf-8")).hexdigest()
    for prompt in (text + " …", (text + " …").encode("utf-8"), bytearray((text + "!").encode()),
                   memoryview((text + "?").encode())):
        e = store.find(prompt)
        assert e is not None and e.sha == e1.sha
    e2 = put(store, text.encode("utf-8"))                # bytes save: same file, kept
    assert e2.sha == e1.sha and len(store.entries()) == 1
    with pytest.raises(TypeError):
        store.find(12345)


# ---- filters ----------------------------------------------------------------

def test_model_id_filter(tmp_path):
    d = tmp_path / "kv"
    with make_store(d, model_id=0) as m0, make_store(d, model_id=7) as m7:
        put(m0, b"shared prefix A")
        put(m7, b"shared prefix")
        assert found_text(m0, b"shared prefix A and more") == b"shared prefix A"
        assert found_text(m7, b"shared prefix A and more") == b"shared prefix"
        assert m0.find(b"shared prefix only") is None
        assert {e.model_id for e in m0.entries()} == {0, 7}     # both listed


def test_min_tokens_filter(tmp_path):
    d = tmp_path / "kv"
    with make_store(d) as w:
        put(w, b"short", ntokens=5)
        put(w, b"short and long", ntokens=20)
        put(w, b"short and long, then short again", ntokens=9)
    with make_store(d, min_tokens=10) as r:
        assert found_text(r, b"short and long, then short again!") == b"short and long"
        assert r.find(b"short but not long") is None
        assert len(r.entries()) == 3
    with make_store(d, min_tokens=20) as r:
        assert r.find(b"short and long") is not None            # >= min_tokens counts
    with make_store(d, min_tokens=21) as r:
        assert r.find(b"short and long") is None


def test_ctx_size_smaller_loadable_by_larger_never_reverse(tmp_path):
    d = tmp_path / "kv"
    with make_store(d, ctx_size=2048) as small, make_store(d, ctx_size=8192) as large, \
            make_store(d) as unlimited:
        e_small = put(small, b"made with 2k")
        e_large = put(large, b"made with 8k")
        assert e_small.ctx_size == 2048 and e_large.ctx_size == 8192
        assert found_text(large, b"made with 2k context") == b"made with 2k"
        assert small.find(b"made with 8k context") is None
        assert found_text(small, b"made with 2k context") == b"made with 2k"
        assert found_text(unlimited, b"made with 8k context") == b"made with 8k"
        # A store exactly at the checkpoint's context loads it.
        with make_store(d, ctx_size=8192) as same:
            assert same.find(b"made with 8k!") is not None
        with make_store(d, ctx_size=8191) as under:
            assert under.find(b"made with 8k!") is None


def test_save_ctx_size_argument(tmp_path):
    with make_store(tmp_path / "kv", ctx_size=4096) as s:
        e = put(s, b"explicit ctx", ctx_size=16384)
        assert e.ctx_size == 16384 and kvstore.format.read_entry(e.path).ctx_size == 16384
        assert s.find(b"explicit ctx!") is None
        assert put(s, b"default ctx").ctx_size == 4096


def test_reject_different_quant(tmp_path):
    d = tmp_path / "kv"
    with make_store(d, quant_bits=4) as q4:
        assert put(q4, b"quantised 4 bit").quant_bits == 4
    with make_store(d, quant_bits=8) as q8:
        assert q8.find(b"quantised 4 bit!") is not None           # reuse is the default
    with make_store(d, quant_bits=8, reject_different_quant=True) as q8r:
        assert q8r.find(b"quantised 4 bit!") is None
    with make_store(d, quant_bits=4, reject_different_quant=True) as q4r:
        assert found_text(q4r, b"quantised 4 bit!") == b"quantised 4 bit"


def test_foreign_payload_abi_is_listed_never_found(store):
    put(store, b"ds4 shares")
    path = write_foreign(store.path, b"ds4 shares a prefix")
    foreign = [e for e in store.entries() if e.path == path]
    assert len(foreign) == 1 and foreign[0].payload_abi == 2 and not foreign[0].loadable
    # The longer foreign entry does not shadow the loadable shorter one.
    assert found_text(store, b"ds4 shares a prefix with us") == b"ds4 shares"
    os.unlink(os.path.join(store.path, hashlib.sha1(b"ds4 shares").hexdigest() + ".kv"))
    assert store.find(b"ds4 shares a prefix with us") is None
    # Loading it anyway is a miss that leaves the file alone (it is not corrupt).
    assert store.load(foreign[0]) is None
    assert os.path.exists(path)
    assert store.stats()["corrupt"] == 0
    assert store.stats()["bytes"] >= foreign[0].file_size       # the budget sees it


def test_names_that_are_not_checkpoints_are_ignored(store):
    e = put(store, b"real")
    raw = open(e.path, "rb").read()
    for name in ("notes.kv", hashlib.sha1(b"real").hexdigest() + ".kv.bak", "x" * 40 + ".kv"):
        with open(os.path.join(store.path, name), "wb") as f:
            f.write(raw)
    assert [x.name for x in store.entries()] == [e.name]
    upper = hashlib.sha1(b"upper").hexdigest().upper() + ".kv"      # uppercase hex is accepted
    path = write_foreign(store.path, b"upper", abi=2)
    os.rename(path, os.path.join(store.path, upper))
    assert upper in [x.name for x in store.entries()]


# ---- the index across processes ---------------------------------------------

def _child_save(path, text, q):
    try:
        with make_store(path) as s:
            e = put(s, text)
        q.put(e.name)
    except BaseException as exc:        # report, never hang the parent
        q.put(repr(exc))


def _child_delete(path, text, q):
    try:
        with make_store(path) as s:
            e = s.find(text)
            q.put(s.wipe(e) if e is not None else -1)
    except BaseException as exc:
        q.put(repr(exc))


def _in_child(target, *args):
    q = CTX.Queue()
    p = CTX.Process(target=target, args=args + (q,))
    p.start()
    out = q.get(timeout=60)
    p.join(30)
    assert p.exitcode == 0, out
    return out


def test_index_sees_files_of_other_processes(store):
    put(store, b"mine")
    assert store.find(b"theirs, and more") is None
    name = _in_child(_child_save, store.path, b"theirs")
    assert name == hashlib.sha1(b"theirs").hexdigest() + ".kv"
    assert found_text(store, b"theirs, and more") == b"theirs"      # no reopen
    e = store.find(b"theirs, and more")
    assert _in_child(_child_delete, store.path, b"theirs, and more") == 1
    assert store.find(b"theirs, and more") is None
    assert store.load(e) is None                                    # the stale entry is a miss
    assert found_text(store, b"mine!") == b"mine"


def test_index_sees_same_tick_change(tmp_path):
    """On filesystems with coarse timestamps a change right after a listing can
    leave the directory mtime unchanged (emulated with utime): the index must
    still notice it once the mtime is old enough to be trusted."""
    d = tmp_path / "kv"
    gran = index_mod.MTIME_GRANULARITY_NS
    with make_store(d) as reader, make_store(d) as writer:
        for attempt in range(5):
            put(writer, f"first {attempt}".encode())
            mtime = os.stat(d).st_mtime_ns
            assert reader.find(f"first {attempt}!".encode()) is not None   # lists right after the change
            if time.time_ns() - mtime >= gran:
                continue                 # the machine stalled: that listing may be trusted; again
            put(writer, f"second {attempt}".encode())
            os.utime(d, ns=(os.stat(d).st_atime_ns, mtime))       # same coarse tick as the listing
            time.sleep(gran / 1e9 * 2)
            assert reader.find(f"second {attempt}!".encode()) is not None
            return
        pytest.skip("could not list within the mtime granularity of a change")


def test_unchanged_directory_is_not_relisted(store, monkeypatch):
    for t in (b"one", b"one two", b"one two three"):
        put(store, t)
    time.sleep(index_mod.MTIME_GRANULARITY_NS / 1e9 * 2)
    store.find(b"one two three four")                       # may list once: settles the index
    calls = []
    real = index_mod.os.scandir

    def counting_scandir(*a, **kw):
        calls.append(a)
        return real(*a, **kw)

    monkeypatch.setattr(index_mod.os, "scandir", counting_scandir)
    gen = index_of(store).generation
    for _ in range(50):
        assert store.find(b"one two three four").text_bytes == len(b"one two three")
        assert store.find(b"zzz") is None
    assert calls == []
    assert index_of(store).generation == gen
    # ... and the counter does see a listing once the directory changes.
    shutil.copy(store.find(b"one").path, os.path.join(store.path, hashlib.sha1(b"copy").hexdigest() + ".kv"))
    store.find(b"one")
    assert len(calls) >= 1


# ---- digest matches are confirmed by the bytes --------------------------------

def test_file_under_another_texts_name_is_not_loaded(store):
    good = b"AAAA the real text"
    other = b"BBBB the real text"                          # same length, different bytes
    e_good = put(store, good)
    e_other = put(store, other)
    good_tensors = store.load(store.find(good)).tensors
    # A valid checkpoint of `good` planted under the name of `other`.
    planted = e_other.path
    shutil.copyfile(e_good.path, planted + ".planting")
    os.replace(planted + ".planting", planted)

    e = store.find(other + b" and more")
    assert e is not None and e.name == e_other.name
    assert store.load(e) is None                             # not good's checkpoint
    assert os.path.exists(e_good.path)                       # the good file stays
    ck = store.load(store.find(good + b" and more"))
    assert ck is not None and ck.text_bytes == good
    assert np.array_equal(ck.tensors["k"], good_tensors["k"])
    # The planted file is never served, whatever was done with it.
    e = store.find(other + b"!")
    assert e is None or store.load(e) is None


def test_collision_text_mismatch_is_a_miss_and_keeps_the_file(store):
    text = b"a prompt whose digest collides"
    e = put(store, text)
    hit = store.find(text + b" tail")
    # As if a different prompt had produced the same digest: the stored bytes
    # do not match the prompt the lookup was made for.
    collided = dataclasses.replace(hit, query=b"a prompt whose digest COLLIDES tail")
    misses = store.stats()["misses"]
    assert store.load(collided) is None
    assert store.stats()["misses"] == misses + 1
    assert os.path.exists(e.path)                            # a valid file, not corrupt
    assert store.stats()["corrupt"] == 0
    assert store.load(store.find(text + b" tail")) is not None


def test_index_notices_a_file_recreated_under_the_same_name(tmp_path):
    """Another engine deletes a checkpoint and stores the same text again; the
    filesystem may hand the new file the inode number the old one had (ext4
    does at once).  The cached entry must not outlive its file: the model-0
    store must not find (and serve) the model-1 state."""
    d = tmp_path / "kv"
    text = b"shared system prompt"
    with make_store(d, model_id=0) as m0, make_store(d, model_id=1) as m1:
        e0 = put(m0, text)
        assert m0.find(text + b"!") is not None                 # cached by m0's index
        os.unlink(e0.path)                                      # evicted by someone
        e1 = m1.save(text, [9, 9, 9, 9, 9], tensors_for(b"model one"))
        assert e1.model_id == 1 and e1.path == e0.path
        found = m0.find(text + b"!")
        assert found is None
        assert found_text(m1, text + b"!") == text
