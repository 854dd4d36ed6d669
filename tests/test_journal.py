"""The directory's journal (kvstore/journal.py): a find pays only for what changed.

A save or a delete by any store on a directory appends the names it
changed; another store's next find looks at those files again instead of
listing the directory.  The files stay the truth: whatever happens to the
journal (cut short, damaged, replaced, from another directory, missing) or
to the files behind its back, a find sees the directory as it is.
"""

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from kvstore import KVStore, index
from kvstore.journal import JOURNAL_NAME, MAX_JOURNAL_BYTES
from kvhelpers import make_store, make_tensors


def save(store, text, seed=0):
    return store.save(text, list(range(8)), make_tensors(8, seed=seed))


@pytest.fixture
def listings(monkeypatch):
    """Counts the directory listings every index makes."""
    count = {"n": 0}
    real = index.DirectoryIndex._relist

    def spy(self, force):
        st = os.stat(self.path)
        if force or st.st_mtime_ns != self._full_mtime or self._listed_ns - st.st_mtime_ns <= \
                index.MTIME_GRANULARITY_NS:
            count["n"] += 1
        return real(self, force)
    monkeypatch.setattr(index.DirectoryIndex, "_relist", spy)
    return count


def aged(path):
    """Lets the coarse-mtime window of the last change pass (index.MTIME_GRANULARITY_NS)."""
    time.sleep(index.MTIME_GRANULARITY_NS / 1e9 + 0.01)


def test_a_find_after_this_stores_own_save_lists_nothing(tmp_path, listings):
    with make_store(tmp_path / "kv") as s:
        save(s, "first prompt")
        aged(s.path)
        s.find("first prompt and more")
        before = listings["n"]
        e = save(s, "second prompt", seed=1)
        assert s.find("second prompt and more").sha == e.sha
        assert listings["n"] == before


def test_another_stores_save_and_delete_are_seen_without_a_listing(tmp_path, listings):
    d = tmp_path / "kv"
    with make_store(d) as a, make_store(d) as b:
        save(a, "a prompt of a")
        aged(d)
        assert b.find("a prompt of a, continued") is not None      # b learns it (a listing or the journal)
        before = listings["n"]
        e = save(a, "another prompt of a", seed=1)
        assert b.find("another prompt of a, continued").sha == e.sha
        a.wipe(e)
        assert b.find("another prompt of a, continued") is None
        assert listings["n"] == before
        assert os.stat(os.path.join(d, JOURNAL_NAME)).st_mode & 0o777 == 0o600


def test_files_added_or_removed_behind_the_journals_back_are_seen(tmp_path):
    d, other = tmp_path / "kv", tmp_path / "other"
    with make_store(d) as s, make_store(other) as o:
        kept = save(s, "a prompt that stays")
        e = save(o, "a prompt copied in by hand", seed=1)
        s.find("warm the index")
        shutil.copy2(e.path, os.path.join(d, e.name))                 # no journal record
        assert s.find("a prompt copied in by hand!").sha == e.sha
        os.unlink(os.path.join(d, e.name))                            # nor here
        assert s.find("a prompt copied in by hand!") is None
        assert s.find("a prompt that stays!").sha == kept.sha


def test_a_cut_short_damaged_or_foreign_journal_never_hides_a_file(tmp_path):
    d = tmp_path / "kv"
    with make_store(d) as a, make_store(d) as b:
        save(a, "first")
        b.find("warm")
        journal = os.path.join(d, JOURNAL_NAME)
        with open(journal, "ab") as f:
            f.write(b"0123456789abcdef")                        # a record cut short by a crash
        e2 = save(a, "second", seed=1)
        # The record cut short and the one after it form a line that is not a name.
        assert b.find("second!").sha == e2.sha
        with open(journal, "ab") as f:
            f.write(b"not a checkpoint name\n")                 # damage
        e3 = save(a, "third", seed=2)
        assert b.find("third!").sha == e3.sha
        with open(journal, "ab") as f:                          # a record of a file that is not here
            f.write(b"f" * 40 + b".kv 1\n")
        assert b.find("first!") is not None
        os.unlink(journal)                                      # gone: the mtime decides again
        e4 = save(a, "fourth", seed=3)
        assert b.find("fourth!").sha == e4.sha


def test_a_journal_past_its_size_starts_again(tmp_path, monkeypatch):
    monkeypatch.setattr("kvstore.journal.MAX_JOURNAL_BYTES", 200)
    d = tmp_path / "kv"
    with make_store(d) as a, make_store(d) as b:
        b.find("warm")
        saved = [save(a, f"prompt number {i}", seed=i) for i in range(12)]
        assert os.path.getsize(os.path.join(d, JOURNAL_NAME)) <= 200 + 44
        for i, e in enumerate(saved):
            assert b.find(f"prompt number {i}!").sha == e.sha
    assert MAX_JOURNAL_BYTES > 200


_WRITER = """
import sys, numpy as np
sys.path.insert(0, sys.argv[2])
from kvhelpers import make_store, make_tensors
with make_store(sys.argv[1]) as s:
    for i in range(100000):
        e = s.save(f"writer prompt {i}", list(range(8)), make_tensors(8, seed=i))
        print(i, e.sha, flush=True)
"""


def test_a_writer_killed_mid_update_hides_no_file_it_stored(tmp_path):
    d = tmp_path / "kv"
    with make_store(d) as reader:
        reader.find("warm")
        child = subprocess.Popen([sys.executable, "-c", _WRITER, str(d), os.path.dirname(__file__)],
                                 stdout=subprocess.PIPE, text=True)
        done = []
        for line in child.stdout:
            done.append(line.split())
            if len(done) >= 40:
                break
            if len(done) % 10 == 0:
                reader.find("writer prompt 0!")             # reads the journal while it grows
        child.send_signal(signal.SIGKILL)
        child.wait()
        for i, sha in done:
            e = reader.find(f"writer prompt {i}!")
            assert e is not None and e.sha == sha


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors through /proc/self/fd")
def test_a_closed_store_lets_go_of_the_journal(tmp_path):
    d = tmp_path / "kv"
    with make_store(d) as s:
        save(s, "a prompt")
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(20):
        with make_store(d) as s:
            s.find("a prompt, continued")
    assert len(os.listdir("/proc/self/fd")) <= before
