"""The lookup forest of kvstore.index: a node per checkpoint that may be found, blocks under their parents.

One SHA1 pass over a prompt tests every root's length at once; a block is
tried only where its parent matched (kvstore.sha1_forest_matches), so a
lookup costs one pass plus one digest per block tried.  Nodes are changed in
place (a file added, removed, or its subtree cut off while a parent is
missing); the arrays a lookup reads are rebuilt only when the forest grew
or most of its nodes are dead.
"""

import numpy as np

from kvstore import _native
from kvstore.names import native_args

_NO_TAG = bytes(_native.LOOKUP_TAG)


def prefix_matches(data, lengths, digests, keys=(None,), tags=None):
    """Indices i whose name digests[20*i:20*i+20] is data[:lengths[i]]'s
    under any of keys (kvstore.names.NameKey, or None: SHA1), ascending: one
    pass per key.  tags: the entries' lookup tags (LOOKUP_TAG bytes each),
    for an HMAC pass."""
    out = []
    for key in keys:
        k, inner = native_args(key)
        out += _native.sha1_prefix_matches(data, lengths, digests, k, tags if k is not None else None, inner)
    return out if len(keys) == 1 else sorted(set(out))


def tag_bytes(entry):
    """An entry's lookup tag as the lookup arrays hold it (zeros: none)."""
    return entry.lookup_tag or _NO_TAG


class Forest:
    """The lookup forest, changed in place: a node per ABI 16 file that may be
    found and per block whose chain reaches a first block.

    Node arrays grow by doubling; a removed node is unlinked and left dead
    until dead nodes outnumber live ones (then the store rebuilds it).
    Children and roots are linked lists (first_child / next_sibling), so
    adding or removing a node costs its siblings, not the forest.
    """

    def __init__(self, capacity=64):
        self.n = 0
        self.live = 0
        self.lengths = np.zeros(capacity, dtype=np.uint64)
        self.digests = bytearray(20 * capacity)
        self.tags = bytearray(_native.LOOKUP_TAG * capacity)
        self.first_child = np.full(capacity, -1, dtype=np.int32)
        self.next_sibling = np.full(capacity, -1, dtype=np.int32)
        self.parent = np.full(capacity, -1, dtype=np.int32)
        self.entry = [None] * capacity
        self.first_root = -1

    def _grow(self):
        cap = 2 * len(self.entry)
        self.lengths = np.resize(self.lengths, cap)
        self.digests.extend(bytes(len(self.digests)))
        self.tags.extend(bytes(len(self.tags)))
        for name in ("first_child", "next_sibling", "parent"):
            old = getattr(self, name)
            new = np.full(cap, -1, dtype=np.int32)
            new[:len(old)] = old
            setattr(self, name, new)
        self.entry.extend([None] * (cap - len(self.entry)))

    def add(self, entry, parent=-1):
        """A new node for entry under parent (-1: a root); returns its index."""
        if self.n == len(self.entry):
            self._grow()
        i = self.n
        self.n += 1
        self.live += 1
        self.lengths[i] = entry.text_bytes
        self.digests[20 * i:20 * i + 20] = bytes.fromhex(entry.sha)
        t = _native.LOOKUP_TAG
        self.tags[t * i:t * i + t] = tag_bytes(entry)
        self.entry[i] = entry
        self.parent[i] = parent
        self.first_child[i] = -1
        if parent < 0:
            self.next_sibling[i] = self.first_root
            self.first_root = i
        else:
            self.next_sibling[i] = self.first_child[parent]
            self.first_child[parent] = i
        return i

    def unlink(self, i):
        """Takes node i (and so its subtree) out of the forest and marks it dead."""
        parent = int(self.parent[i])
        head = self.first_root if parent < 0 else int(self.first_child[parent])
        if head == i:
            nxt = int(self.next_sibling[i])
            if parent < 0:
                self.first_root = nxt
            else:
                self.first_child[parent] = nxt
        else:
            while head >= 0 and int(self.next_sibling[head]) != i:
                head = int(self.next_sibling[head])
            if head >= 0:
                self.next_sibling[head] = self.next_sibling[i]
        self.kill(i)

    def kill(self, i):
        """Marks node i dead (its list is unlinked from the roots already)."""
        self.entry[i] = None
        self.live -= 1

    def subtree(self, i):
        """The nodes below i (not i)."""
        out, todo = [], [i]
        while todo:
            c = int(self.first_child[todo.pop()])
            while c >= 0:
                out.append(c)
                todo.append(c)
                c = int(self.next_sibling[c])
        return out

    def matches(self, data, keys=(None,)):
        """The nodes whose name matches data under any of keys (see prefix_matches)."""
        n = self.n
        out = []
        for key in keys:
            k, inner = native_args(key)
            tags = memoryview(self.tags)[:_native.LOOKUP_TAG * n] if k is not None else None
            out += _native.sha1_forest_matches(data, self.lengths[:n], memoryview(self.digests)[:20 * n],
                                               self.first_root, self.first_child[:n], self.next_sibling[:n], k,
                                               tags, inner)
        return out if len(keys) == 1 else sorted(set(out))
