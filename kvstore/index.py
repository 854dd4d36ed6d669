"""The directory index (SPEC section 4): text length -> {digest -> entry}.

A lookup asks for the digest of the prompt's first n bytes at every distinct
stored length n; the index keeps those lengths sorted so that one SHA1 pass
over the prompt (kvstore.sha1_prefixes) answers for every entry at once.

Other processes add and delete files at any time.  The index re-lists the
directory only when the directory's mtime says something changed, and then
reads only the headers of names it has not seen (or whose inode changed), so
a lookup in an unchanged directory costs one stat.
"""

import bisect
import os
import time

from kvstore.errors import KVStoreError
from kvstore.format import is_checkpoint_name, read_entry

# Directory mtimes come from a coarse kernel clock (a few ms on Linux): a
# change made within this window of the last listing may carry the same
# mtime, so a directory modified that recently is always re-listed.
MTIME_GRANULARITY_NS = 50_000_000


class DirectoryIndex:
    """Every valid .kv envelope of one directory, kept current cheaply.

    Args:
        path: the directory.
        eligible: predicate on Entry; only eligible entries take part in
            lookups (all valid envelopes count for the budget).
    """

    def __init__(self, path, eligible=lambda e: True):
        self.path = os.fspath(path)
        self.eligible = eligible
        self.entries = {}          # name -> Entry (every valid envelope)
        self._bad = {}             # name -> inode of a file that failed to parse
        self._by_len = {}          # text length -> {digest bytes -> Entry}
        self._lengths = []         # sorted distinct lengths of eligible entries
        self._mtime = None
        self.generation = 0        # bumped on every change

    # -- upkeep ------------------------------------------------------------

    def refresh(self, force=False):
        """Re-lists the directory if it changed since the last listing."""
        st = os.stat(self.path)
        now = time.time_ns()
        if (not force and st.st_mtime_ns == self._mtime
                and now - st.st_mtime_ns > MTIME_GRANULARITY_NS):
            return False
        seen = {}
        with os.scandir(self.path) as it:
            for de in it:
                if is_checkpoint_name(de.name):
                    try:
                        seen[de.name] = de.inode()
                    except OSError:
                        pass
        changed = False
        for name in list(self.entries):
            if seen.get(name) != self.entries[name].inode:
                self._drop(name)
                changed = True
        for name in list(self._bad):
            if seen.get(name) != self._bad[name]:
                del self._bad[name]
        for name, ino in seen.items():
            if name in self.entries or self._bad.get(name) == ino:
                continue
            try:
                entry = read_entry(os.path.join(self.path, name))
            except KVStoreError:
                self._bad[name] = ino
                continue
            self._add(entry)
            changed = True
        self._mtime = st.st_mtime_ns
        if changed:
            self._rebuild_lengths()
        return changed

    def add(self, entry):
        """Records an entry this process just wrote (no listing needed)."""
        self._drop(entry.name)
        self._add(entry)
        self._rebuild_lengths()

    def discard(self, name):
        """Forgets a file this process just deleted."""
        if self._drop(name):
            self._rebuild_lengths()

    def _add(self, entry):
        self.entries[entry.name] = entry
        if entry.sha and self.eligible(entry):
            self._by_len.setdefault(entry.text_bytes, {})[bytes.fromhex(entry.sha)] = entry

    def _drop(self, name):
        entry = self.entries.pop(name, None)
        if entry is None:
            return False
        bucket = self._by_len.get(entry.text_bytes)
        if bucket is not None and entry.sha:
            bucket.pop(bytes.fromhex(entry.sha), None)
            if not bucket:
                del self._by_len[entry.text_bytes]
        return True

    def _rebuild_lengths(self):
        self._lengths = sorted(self._by_len)
        self.generation += 1

    # -- lookup ------------------------------------------------------------

    def lengths_upto(self, n):
        """The sorted distinct eligible text lengths <= n."""
        return self._lengths[:bisect.bisect_right(self._lengths, n)]

    def get(self, length, digest):
        bucket = self._by_len.get(length)
        return None if bucket is None else bucket.get(digest)

    def total_bytes(self):
        return sum(e.file_size for e in self.entries.values())
