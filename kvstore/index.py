"""The lookup index (docs/format.md §4): text length -> {digest -> entry}.

A lookup asks for the digest of the prompt's first n bytes at every distinct
stored length n; the index keeps those lengths sorted so that one SHA1 pass
over the prompt (kvstore.sha1_prefixes) answers for every entry at once.

Other processes add and delete files at any time.  The index re-lists the
directory only when the directory's mtime says something changed, and then
reads only the headers of names it has not seen (or whose inode, mtime or
size changed), so a lookup in an unchanged directory costs one stat.

TieredLookup searches the directory and the remote tier's index of a bucket
in the same single pass.
"""

import os
import time

import numpy as np

from kvstore import _native

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
        self._bad = {}             # name -> (inode, mtime, size) of a file that failed to parse
        self._by_digest = {}       # digest bytes -> Entry (eligible entries)
        # Lookup arrays, rebuilt on change: eligible entries sorted by text
        # length, their lengths (uint64) and their digests (20 bytes each).
        self._sorted = []
        self._lengths = np.zeros(0, dtype=np.uint64)
        self._digests = b""
        self._mtime = None
        self._listed_ns = 0        # time.time_ns() when the last listing started
        self.generation = 0        # bumped on every change

    # -- upkeep ------------------------------------------------------------

    def refresh(self, force=False):
        """Re-lists the directory if it changed since the last listing."""
        st = os.stat(self.path)
        now = time.time_ns()
        # The last listing saw every change stamped before it started; one
        # made just after it, within the same coarse tick, may have left the
        # mtime unchanged.  So an unchanged mtime is trusted only when the
        # last listing started well after it (checking `now` instead would
        # miss such a change for good).
        if (not force and st.st_mtime_ns == self._mtime
                and self._listed_ns - st.st_mtime_ns > MTIME_GRANULARITY_NS):
            return False
        # A file is known by (inode, mtime, size), not the inode alone: a
        # checkpoint deleted and stored again under the same name often gets
        # the inode number just freed (ext4 hands it out at once).
        seen = {}
        with os.scandir(self.path) as it:
            for de in it:
                if is_checkpoint_name(de.name):
                    try:
                        fst = de.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    seen[de.name] = (fst.st_ino, fst.st_mtime_ns, fst.st_size)
        changed = False
        for name in list(self.entries):
            e = self.entries[name]
            if seen.get(name) != (e.inode, e.mtime_ns, e.file_size):
                self._drop(name)
                changed = True
        for name in list(self._bad):
            if seen.get(name) != self._bad[name]:
                del self._bad[name]
        for name, key in seen.items():
            if name in self.entries or self._bad.get(name) == key:
                continue
            try:
                entry = read_entry(os.path.join(self.path, name))
            except KVStoreError:
                self._bad[name] = key
                continue
            self._add(entry)
            changed = True
        self._mtime = st.st_mtime_ns
        self._listed_ns = now
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
            self._by_digest[bytes.fromhex(entry.sha)] = entry

    def _drop(self, name):
        entry = self.entries.pop(name, None)
        if entry is None:
            return False
        if entry.sha:
            self._by_digest.pop(bytes.fromhex(entry.sha), None)
        return True

    def _rebuild_lengths(self):
        self._sorted = sorted(self._by_digest.values(), key=lambda e: (e.text_bytes, e.tokens))
        self._lengths = np.fromiter((e.text_bytes for e in self._sorted), dtype=np.uint64,
                                    count=len(self._sorted))
        self._digests = b"".join(bytes.fromhex(e.sha) for e in self._sorted)
        self.generation += 1

    # -- lookup ------------------------------------------------------------

    def longest_prefix(self, data):
        """The eligible entry with the longest text that is a prefix of data.

        One SHA1 pass over data gives the digest at every stored length; the
        last (longest) match wins.  Entries of equal length are ordered by
        token count, so a tie goes to more tokens.
        """
        n = int(np.searchsorted(self._lengths, len(data), side="right"))
        if n == 0:
            return None
        matches = _native.sha1_prefix_matches(data, self._lengths[:n],
                                              memoryview(self._digests)[:20 * n])
        return self._sorted[matches[-1]] if matches else None

    def lookup_arrays(self):
        """(eligible entries sorted by text length, their lengths as uint64, their
        digests joined): what longest_prefix searches, for a caller that
        searches this index together with another one in the same pass."""
        return self._sorted, self._lengths, self._digests

    def total_bytes(self):
        return sum(e.file_size for e in self.entries.values())


def _merge(local, remote):
    l_entries, l_lengths, l_digests = local
    r_shas, r_lengths, r_digests = remote
    lengths = np.concatenate([l_lengths, r_lengths]).astype(np.uint64, copy=False)
    # Stable: at equal lengths local entries stay first (and in their order:
    # fewer tokens first), so the scan from the end meets the remote one
    # first and the best local one next.
    order = np.argsort(lengths, kind="stable")
    owners = [*l_entries, *r_shas]
    digests = np.frombuffer(bytes(l_digests) + bytes(r_digests), dtype=np.uint8).reshape(-1, 20)
    return [owners[i] for i in order.tolist()], lengths[order], digests[order].tobytes()


class TieredLookup:
    """The local index and a remote index searched in one SHA1 pass.

    The local and the remote lengths are merged into one sorted array,
    rebuilt only when either index changed.  A remote hit counts only when
    its text is strictly longer than the best local one: at equal length the
    local file wins (no transfer needed).

    Args:
        local: the DirectoryIndex.
    """

    def __init__(self, local):
        self.local = local
        self._key = None
        self._merged = None

    def longest_prefix(self, data, remote=None):
        """(local Entry, None), (None, remote sha) or (None, None) for a miss.

        Args:
            data: the prompt bytes.
            remote: the remote index (``snapshot`` of (shas, lengths, digests)
                sorted by length, and ``generation``), or None: local only.
        """
        if remote is None:
            return self.local.longest_prefix(data), None
        key = (self.local.generation, id(remote), remote.generation)
        if self._key != key:
            self._merged = _merge(self.local.lookup_arrays(), remote.snapshot)
            self._key = key
        owners, lengths, digests = self._merged
        n = int(np.searchsorted(lengths, len(data), side="right"))
        if n == 0:
            return None, None
        matches = _native.sha1_prefix_matches(data, lengths[:n], memoryview(digests)[:20 * n])
        local = remote_at = None
        for i in reversed(matches):
            if not isinstance(owners[i], str):
                local = owners[i]
                break
            if remote_at is None:
                remote_at = i
        # The scan met the remote match first, so it is at least as long.
        if remote_at is not None and (local is None or int(lengths[remote_at]) > local.text_bytes):
            return None, owners[remote_at]
        return local, None
