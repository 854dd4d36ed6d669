"""The lookup index (docs/format.md §4, §14): text length -> {digest -> entry}.

A lookup asks for the digest of the prompt's first n bytes at every stored
length n; the index keeps those lengths so that one SHA1 pass over the
prompt answers for every entry at once.

Chains (ABI 17) make the stored lengths a forest: a block's text extends its
parent's, so a block can match only where its parent matched.  The index
keeps each block under its parent and the lookup tries a block only when its
parent matched (kvstore.sha1_forest_matches): one pass over the prompt plus
one digest per block tried, however many blocks hang below the roots that
did not match.  A directory without chains keeps the flat one-pass lookup.

A block is reachable only through an unbroken chain of blocks that each
start where their parent ends; a block whose chain does not reach a first
block (a parent evicted, never written, or rewritten by another model) is an
orphan: never found, and removed by the store under its lock.

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

_EMPTY_U32 = np.zeros(0, dtype=np.uint32)


def chain_link_ok(child, parent):
    """True when parent is the block child's chain continues from."""
    return (parent is not None and parent.is_block and parent.sha == child.parent
            and parent.tokens == child.token_start and parent.text_bytes == child.text_start
            and parent.token_digest == child.parent_token_digest and parent.model_id == child.model_id)


class DirectoryIndex:
    """Every valid .kv envelope of one directory, kept current cheaply.

    Args:
        path: the directory.
        fits: predicate on Entry: can this store load it (model, context,
            payload ABI)?  Only entries that fit take part in lookups (all
            valid envelopes count for the budget).
        min_tokens: the shortest checkpoint a lookup returns (shorter chain
            blocks still link longer ones).
    """

    def __init__(self, path, fits=lambda e: True, min_tokens=0):
        self.path = os.fspath(path)
        self.fits = fits
        self.min_tokens = min_tokens
        self.entries = {}          # name -> Entry (every valid envelope)
        self._bad = {}             # name -> (inode, mtime, size) of a file that failed to parse
        self._mtime = None
        self._listed_ns = 0        # time.time_ns() when the last listing started
        self.generation = 0        # bumped on every change
        self.orphans = []          # chain blocks that do not reach a first block
        self._rebuild()

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
                del self.entries[name]
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
            self.entries[name] = entry
            changed = True
        self._mtime = st.st_mtime_ns
        self._listed_ns = now
        if changed:
            self._rebuild()
        return changed

    def add(self, *entries):
        """Records entries this process just wrote (no listing needed)."""
        for entry in entries:
            self.entries[entry.name] = entry
        self._rebuild()

    def discard(self, name):
        """Forgets a file this process just deleted."""
        if self.entries.pop(name, None) is not None:
            self._rebuild()

    def get(self, sha):
        """The entry whose name is sha (40 lowercase hex digits, any case on disk), or None."""
        return self._by_sha.get(sha) if sha else None

    # -- the chain structure -------------------------------------------------

    def chain(self, entry):
        """The blocks from the first one to entry (entry last), or None when broken."""
        out = [entry]
        while out[-1].is_block and out[-1].parent:
            parent = self.get(out[-1].parent)
            if not chain_link_ok(out[-1], parent) or len(out) > len(self.entries):
                return None
            out.append(parent)
        out.reverse()
        return out

    def children(self):
        """sha -> [the block entries that name it as their parent]."""
        kids = {}
        for e in self.entries.values():
            if e.is_block and e.parent:
                kids.setdefault(e.parent, []).append(e)
        return kids

    def descendants(self, entry):
        """Every block below entry in its chains (not entry itself)."""
        kids, out, todo = self.children(), [], [entry.sha]
        while todo:
            for k in kids.get(todo.pop(), ()):
                if k.sha != entry.sha and k not in out:
                    out.append(k)
                    todo.append(k.sha)
        return out

    def _rebuild(self):
        """The lookup forest over the entries that fit, and the orphan list."""
        self._by_sha = {e.sha: e for e in self.entries.values() if e.sha}
        blocks = {e.sha: e for e in self.entries.values() if e.is_block and e.sha}
        kids = {}
        for e in blocks.values():
            if e.parent:
                kids.setdefault(e.parent, []).append(e)
        # Reachable blocks: from the first blocks down unbroken, fitting links.
        reach, todo = [], [e for e in blocks.values() if not e.parent]
        while todo:
            e = todo.pop()
            if not self.fits(e):
                continue
            reach.append(e)
            todo += [c for c in kids.get(e.sha, ()) if chain_link_ok(c, e)]
        reached = {e.sha for e in reach}
        self.orphans = [e for e in blocks.values() if e.sha not in reached and self.fits(e)]
        whole = [e for e in self.entries.values()
                 if e.sha and not e.is_block and e.loadable and e.tokens >= self.min_tokens and self.fits(e)]
        nodes = whole + reach
        at = {e.sha: i for i, e in enumerate(nodes)}
        self._nodes = nodes
        self._lengths = np.fromiter((e.text_bytes for e in nodes), dtype=np.uint64, count=len(nodes))
        self._digests = b"".join(bytes.fromhex(e.sha) for e in nodes)
        self._selectable = [not e.is_block or (e.restorable and e.tokens >= self.min_tokens) for e in nodes]
        roots, first, count, flat_kids = [], [], [], []
        for e in nodes:
            if not e.is_block or not e.parent:
                roots.append(at[e.sha])
            children = [at[c.sha] for c in kids.get(e.sha, ()) if c.sha in reached and chain_link_ok(c, e)] \
                if e.is_block else []
            first.append(len(flat_kids))
            count.append(len(children))
            flat_kids += children
        self._roots = np.array(roots, dtype=np.uint32)
        self._first = np.array(first, dtype=np.uint32)
        self._count = np.array(count, dtype=np.uint32)
        self._kids = np.array(flat_kids, dtype=np.uint32) if flat_kids else _EMPTY_U32
        # The selectable entries sorted by text length (ties: fewer tokens
        # first): the flat lookup, and the local half of a two-tier lookup.
        self._sorted = sorted((e for e, ok in zip(nodes, self._selectable) if ok),
                              key=lambda e: (e.text_bytes, e.tokens))
        self._sorted_lengths = np.fromiter((e.text_bytes for e in self._sorted), dtype=np.uint64,
                                           count=len(self._sorted))
        self._sorted_digests = b"".join(bytes.fromhex(e.sha) for e in self._sorted)
        self.generation += 1

    # -- lookup ------------------------------------------------------------

    def longest_prefix(self, data, accept=None):
        """The selectable entry with the longest text that is a prefix of data.

        One SHA1 pass over data gives the digest at every stored length
        tried; the longest match wins (of equal length, more tokens).

        Args:
            data: the prompt bytes.
            accept: optional predicate on Entry; a match it refuses is passed
                over for the next longest.
        """
        if not len(self._kids):
            n = int(np.searchsorted(self._sorted_lengths, len(data), side="right"))
            if n == 0:
                return None
            matches = _native.sha1_prefix_matches(data, self._sorted_lengths[:n],
                                                  memoryview(self._sorted_digests)[:20 * n])
            found = [self._sorted[i] for i in matches]
        else:
            matched = _native.sha1_forest_matches(data, self._lengths, self._digests, self._roots, self._first,
                                                  self._count, self._kids)
            found = sorted((self._nodes[i] for i in matched if self._selectable[i]),
                           key=lambda e: (e.text_bytes, e.tokens))
        for e in reversed(found):
            if accept is None or accept(e):
                return e
        return None

    def lookup_arrays(self):
        """(selectable entries sorted by text length, their lengths as uint64, their
        digests joined): what a flat lookup searches, for a caller that
        searches this index together with another one in the same pass."""
        return self._sorted, self._sorted_lengths, self._sorted_digests

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

    def longest_prefix(self, data, remote=None, accept=None):
        """(local Entry, None), (None, remote sha) or (None, None) for a miss.

        Args:
            data: the prompt bytes.
            remote: the remote index (``snapshot`` of (shas, lengths, digests)
                sorted by length, and ``generation``), or None: local only.
            accept: optional predicate on a local Entry (see DirectoryIndex).
        """
        if remote is None:
            return self.local.longest_prefix(data, accept), None
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
                if accept is None or accept(owners[i]):
                    local = owners[i]
                    break
                continue
            if remote_at is None:
                remote_at = i
        # The scan met the remote match first, so it is at least as long.
        if remote_at is not None and (local is None or int(lengths[remote_at]) > local.text_bytes):
            return None, owners[remote_at]
        return local, None
