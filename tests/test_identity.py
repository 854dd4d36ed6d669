"""Model identities in the store (docs/semantics.md §17): many models, one directory.

A store opened with model_identity records the model in every file it writes
(the header's model tag, the name's namespace, the manifest) and offers
lookups and loads only its own; another model's files are foreign: listed,
counted in the budget, evictable, never found or loaded.  These tests use
NumPy tensors and identity strings; tests/test_canary.py and test_mlx.py
run real models.
"""

import json
import os
import time

import numpy as np
import pytest

import kvstore
from kvstore import files, names, policy, registry, settings
from kvstore.format import HEADER_SIZE, read_entry
from kvstore.identity import ModelIdentity

from kvhelpers import checkpoint_files, flip, make_store, make_tensors

A, B = "org/model-a@1", "org/model-a@1-finetune"
TEXT = "the shared system prompt, then a question " * 4


def save(store, text=TEXT, n=64, seed=None, **kw):
    tensors = make_tensors(n, seed=seed if seed is not None else text + (store.model_identity or ""))
    kw.setdefault("positional", {"k": 1, "v": 1})
    text_b = text.encode() if isinstance(text, str) else text
    kw.setdefault("text_offsets", [len(text_b) * i // n for i in range(n + 1)])
    e = store.save(text, np.arange(n), tensors, **kw)
    assert e is not None
    return e, tensors


def loaded(store, prompt=TEXT + " and more"):
    e = store.find(prompt)
    return None if e is None else store.load(e)


def same_tensors(ckpt, tensors):
    return all(np.array_equal(ckpt.tensors[k], tensors[k]) for k in tensors)


# ---- what a file records -------------------------------------------------------------------------

def test_a_model_store_records_its_model_in_header_name_and_manifest(tmp_path):
    ident = ModelIdentity(A)
    with make_store(tmp_path / "kv", model_identity=A) as s:
        e, _ = save(s)
        assert s.model_identity == A and s.model_tag == ident.tag != 0
    on_disk = read_entry(e.path)
    assert on_disk.model_tag == ident.tag
    with open(e.path, "rb") as f:
        head = f.read(HEADER_SIZE)
    assert int.from_bytes(head[21:24], "little") == ident.tag
    # Named in the model's namespace: SHA1 of the namespace block then the text.
    assert e.sha == names.name_of(TEXT.encode(), ident.names).hex() != kvstore.format.sha1(TEXT.encode()).hex()
    h = names.hasher(ident.names)
    h.update(TEXT.encode())
    assert h.hexdigest() == e.sha
    with make_store(tmp_path / "kv", model_identity=A) as s:
        assert loaded(s).tensors          # and it loads
        assert files.verify_file(e.path) is None
    # The manifest carries the identity itself.
    fd, _ = kvstore.format.open_checkpoint(e.path)
    try:
        assert kvstore.payload.read_manifest(fd, read_entry(e.path)).model == A
    finally:
        os.close(fd)


def test_a_store_without_identity_writes_ds4_style_files(tmp_path):
    with make_store(tmp_path / "kv", layout="whole") as s:
        e, _ = save(s, positional=None, text_offsets=None)
    assert read_entry(e.path).model_tag == 0
    assert e.sha == kvstore.format.sha1(TEXT.encode()).hex()
    with open(e.path, "rb") as f:
        assert f.read(HEADER_SIZE)[21:24] == b"\0\0\0"


@pytest.mark.parametrize("bad", ["", 7, "x" * 1025])
def test_a_bad_identity_is_refused_by_name(tmp_path, bad):
    with pytest.raises(ValueError, match="model identity"):
        make_store(tmp_path / "kv", model_identity=bad)


# ---- two models, one directory -------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["chain", "whole"])
def test_two_models_store_one_text_apart_and_each_loads_its_own(tmp_path, layout):
    d = tmp_path / "kv"
    with make_store(d, model_identity=A, layout=layout, block_tokens=16) as a:
        ea, ta = save(a)
    with make_store(d, model_identity=B, layout=layout, block_tokens=16) as b:
        # A's chain is not B's: B finds nothing and writes all of its own.
        assert b.find(TEXT + " and more") is None
        eb, tb = save(b)
        assert eb.sha != ea.sha
    assert not any(np.array_equal(ta[k], tb[k]) for k in ta)
    for ident, want in ((A, ta), (B, tb)):
        with make_store(d, model_identity=ident, layout=layout, block_tokens=16) as s:
            ck = loaded(s)
            assert ck is not None and same_tensors(ck, want), ident
            # Foreign files are listed and counted, never loaded.
            assert len(s.entries()) == len(checkpoint_files(d))
            assert s.stats()["bytes"] == sum(os.path.getsize(d / n) for n in checkpoint_files(d))
            foreign = [e for e in s.entries() if e.model_tag != ModelIdentity(ident).tag]
            assert foreign and all(s.load(e, min_tokens=0) is None for e in foreign)
    assert len(checkpoint_files(d)) == (8 if layout == "chain" else 2)     # nothing was deleted


def test_files_that_name_no_model_are_loaded_only_by_a_store_that_says_so(tmp_path):
    d = tmp_path / "kv"
    with make_store(d) as old:                       # written before identities
        _, t = save(old)
    with make_store(d, model_identity=A) as s:
        assert s.find(TEXT + " and more") is None
        assert all(s.load(e, min_tokens=0) is None for e in s.entries())
    with make_store(d, model_identity=A, accept_unidentified=True) as s:
        ck = loaded(s)
        assert ck is not None and same_tensors(ck, t)
        # Its own files still come first, in its own namespace.
        _, t2 = save(s, seed=5)
        assert same_tensors(loaded(s), t2)
    with make_store(d) as anonymous:                 # and a model's files are foreign to a store without one
        assert same_tensors(loaded(anonymous), t)
        assert sum(e.model_tag != 0 for e in anonymous.entries()) == 1


def whole_file_retagged(d, writer, tag_of):
    """A whole file saved by a store of model writer, its header's model tag then set to tag_of's."""
    with make_store(d, model_identity=writer, layout="whole") as s:
        e, _ = save(s, positional=None, text_offsets=None)
    with open(e.path, "r+b") as f:
        f.seek(21)
        f.write(ModelIdentity(tag_of).tag.to_bytes(3, "little"))
    return e


def test_a_header_tag_changed_to_another_model_makes_the_file_foreign(tmp_path):
    d = tmp_path / "kv"
    e = whole_file_retagged(d, A, B)
    with make_store(d, model_identity=A, layout="whole") as s:
        assert s.find(TEXT + " and more") is None
        assert s.misfit(s.entries()[0]) == "model"
    assert os.path.exists(e.path)


def test_a_file_whose_manifest_names_another_model_is_not_loaded(tmp_path):
    # B's file, relabelled as A's (tag and name): its manifest still says B.
    d = tmp_path / "kv"
    eb = whole_file_retagged(d, B, A)
    forged = d / (names.name_of(TEXT.encode(), ModelIdentity(A).names).hex() + ".kv")
    os.rename(eb.path, forged)
    assert files.verify_file(str(forged)).startswith("model_mismatch")
    with make_store(d, model_identity=A, layout="whole") as a:
        e = a.find(TEXT + " and more")
        assert e is not None and a.load(e) is None
        assert a.stats()["corrupt"] == 1
    assert not forged.exists()


def test_verify_checks_namespaced_names_of_chains(tmp_path):
    d = tmp_path / "kv"
    with make_store(d, model_identity=A, block_tokens=16) as s:
        save(s)
    paths = [d / n for n in checkpoint_files(d)]
    assert len(paths) == 4 and all(files.verify_file(str(p)) is None for p in paths)
    # A block's text no longer hashes to its name in its model's namespace.
    last = max(paths, key=lambda p: read_entry(p).tokens)
    flip(last, kvstore.format.PREFIX_SIZE)
    assert files.verify_file(str(last)).startswith("text_hash")


def test_sealed_stores_of_two_models_share_a_key_and_a_directory(tmp_path):
    pytest.importorskip("cryptography")
    d, key = tmp_path / "kv", bytes(range(32))
    with make_store(d, model_identity=A, key=key) as a:
        ea, ta = save(a)
    with make_store(d, model_identity=B, key=key) as b:
        assert b.find(TEXT + " and more") is None
        eb, tb = save(b)
        assert eb.sha != ea.sha
        assert same_tensors(loaded(b), tb)
    with make_store(d, model_identity=A, key=key) as a:
        assert same_tensors(loaded(a), ta)
        # kvstore verify --key checks every file, whichever model sealed it.
        sealer = kvstore.seal.Sealer(key)
        assert all(sealer.verify_file(str(d / n)) is None for n in checkpoint_files(d))


# ---- one budget, the registry --------------------------------------------------------------------

def test_one_budget_covers_every_model_and_stale_files_go_first(tmp_path):
    d = tmp_path / "kv"
    with make_store(d, model_identity=A, layout="whole", budget_mb=0) as a:
        ea, _ = save(a, positional=None, text_offsets=None, reason=kvstore.format.Reason.COLD)
        eb, _ = save(a, text=TEXT + " second", positional=None, text_offsets=None,
                     reason=kvstore.format.Reason.COLD)
        kvstore.format.touch(eb.path)                       # A's second file is used, now
    # A's first anchor was last used 40 days ago: past stale_after_s (30 days).
    kvstore.format.touch(ea.path, now=int(time.time()) - 40 * 86400)
    size = read_entry(ea.path).file_size
    budget_mb = 2.5 * size / 2**20
    with make_store(d, model_identity=B, layout="whole", budget_mb=budget_mb) as b:
        save(b, text=TEXT + " third", positional=None, text_offsets=None, reason=kvstore.format.Reason.CONTINUED)
        kept = {e.sha for e in b.entries()}
    # The budget counted A's files too: one had to go, and the stale anchor
    # went before B's fresh waypoint, which scores lower.
    assert ea.sha not in kept and eb.sha in kept and len(kept) == 2
    assert settings.DEFAULT_STALE_AFTER_S == 30 * 86400


def test_the_registry_names_the_models_that_use_a_directory(tmp_path):
    d = tmp_path / "kv"
    with make_store(d, model_identity=ModelIdentity(A, "model A")):
        pass
    with make_store(d, model_identity=B):
        pass
    rows = registry.read_registry(str(d))
    assert {r["identity"] for r in rows.values()} == {A, B}
    assert registry.describe_tag(ModelIdentity(A).tag, rows) == "model A"
    assert registry.describe_tag(ModelIdentity(B).tag, rows) == B
    assert registry.describe_tag(0, rows) == "-"
    assert os.stat(d / registry.REGISTRY).st_mode & 0o777 == 0o600
    # A second open within a day writes nothing.
    before = os.stat(d / registry.REGISTRY).st_mtime_ns
    with make_store(d, model_identity=B):
        pass
    assert os.stat(d / registry.REGISTRY).st_mtime_ns == before
    # A damaged registry only leaves the models unnamed.
    (d / registry.REGISTRY).write_text("{not json")
    assert registry.read_registry(str(d)) == {}
    with make_store(d, model_identity=A) as s:
        assert s.entries() == []
    assert json.loads((d / registry.REGISTRY).read_text())


# ---- the command line ------------------------------------------------------------------------------

def test_ls_stats_export_and_import_keep_the_model(tmp_path, capsys):
    from kvstore import cli
    d, other = tmp_path / "kv", tmp_path / "other"
    with make_store(d, model_identity=ModelIdentity(A, "model A"), block_tokens=16) as s:
        ea, ta = save(s)
    with make_store(d, model_identity=B, block_tokens=16) as s:
        save(s)
    assert cli.main(["ls", str(d)]) == 0
    out = capsys.readouterr().out
    assert "model A" in out and B in out
    assert cli.main(["ls", str(d), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {r["model"] for r in rows} == {"model A", B}
    assert {r["model_tag"] for r in rows} == {f"{ModelIdentity(A).tag:06x}", f"{ModelIdentity(B).tag:06x}"}
    assert cli.main(["stats", str(d), "--json"]) == 0
    models = json.loads(capsys.readouterr().out)["models"]
    assert sorted(m["name"] for m in models) == ["model A", B] and all(m["entries"] == 4 for m in models)
    assert cli.main(["stats", str(d)]) == 0
    assert "model A (" in capsys.readouterr().out
    assert cli.main(["inspect", ea.path]) == 0
    out = capsys.readouterr().out
    assert "model A (tag" in out and f"model: {A}" in out
    # Export A's sequence: one file that still names A; import it elsewhere as A's.
    exported = tmp_path / "a.kv"
    assert cli.main(["export", ea.sha[:10], str(exported), "--dir", str(d)]) == 0
    assert read_entry(exported).model_tag == ModelIdentity(A).tag
    assert cli.main(["import", str(exported), "--dir", str(other), "--block-tokens", "16"]) == 0
    capsys.readouterr()
    with make_store(other, model_identity=A, block_tokens=16) as s:
        assert same_tensors(loaded(s), ta)
    with make_store(other, model_identity=B, block_tokens=16) as s:
        assert s.find(TEXT + " and more") is None
