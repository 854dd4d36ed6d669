"""The lookup structures of kvstore.index: the forest (a node per checkpoint that may be found, blocks under
their parents) and the tiered lookup (the directory's index and a bucket's in one pass).

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


def chain_link_ok(child, parent):
    """True when parent is the block child's chain continues from (the same
    model made both: a chain never crosses models)."""
    return (parent is not None and parent.is_block and parent.sha == child.parent
            and parent.tokens == child.token_start and parent.text_bytes == child.text_start
            and parent.token_digest == child.parent_token_digest and parent.model_id == child.model_id
            and parent.model_tag == child.model_tag)


def reachable(good, up):
    """good[i] and good at every ancestor of i, for all i at once.

    up[i] is the row of i's parent, or i itself where the chain stops (a
    first block, or a row that is not good).  Pointer doubling: each pass
    folds in twice as many ancestors, so a chain of d blocks costs log2(d)
    passes over the arrays instead of a step per block.  A row whose
    parents go round in a cycle (only a damaged record can say so) is not.
    """
    ok, up = good.copy(), up.copy()
    for _ in range(64):                  # 2**64 ancestors: every chain that ends
        ok &= ok[up]
        nxt = up[up]
        if np.array_equal(nxt, up):
            return ok
        up = nxt
    return ok & (up[up] == up)           # still moving: a cycle, which reaches no first block


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

    @classmethod
    def of(cls, entries, lengths, digests, tags, parents):
        """A forest of the given nodes at once: node i is entries[i] (text
        length lengths[i], digest digests[20*i:20*i+20], lookup tag likewise
        in tags) under node parents[i] (-1: a root).  The same forest as
        add() called in node order, without a Python step per node."""
        n = len(entries)
        f = cls(max(64, 2 * n))
        f.n = f.live = n
        f.lengths[:n] = lengths
        f.digests[:20 * n] = digests
        f.tags[:_native.LOOKUP_TAG * n] = tags
        f.entry[:n] = entries
        parents = np.asarray(parents, dtype=np.int32)
        f.parent[:n] = parents
        # add() puts each node at the head of its parent's list (or of the
        # roots): in a group of siblings in node order, each node's next
        # sibling is the one added before it, and the last added heads it.
        order = np.lexsort((np.arange(n), parents))
        grouped = parents[order]
        same = np.zeros(n, dtype=bool)
        same[1:] = grouped[1:] == grouped[:-1]
        f.next_sibling[order[1:]] = np.where(same[1:], order[:-1], -1)
        if n:
            f.next_sibling[order[0]] = -1
        last = np.ones(n, dtype=bool)
        last[:-1] = ~same[1:]
        heads, owners = order[last], grouped[last]
        f.first_child[owners[owners >= 0]] = heads[owners >= 0]
        if (owners < 0).any():
            f.first_root = int(heads[owners < 0][0])
        return f

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


def attached_rows(prow, rec, block, cand):
    """The blocks that join the forest, for n entries at once: chain_link_ok
    and the attachment of DirectoryIndex._insert on arrays.

    Args:
        prow: each entry's parent's row (n where it is not among them).
        rec: a record array of the entries (kvstore.index_snapshot.RECORD:
            parent, tokens, token_start, text_bytes, text_start, token
            digests, model_id, model_tag; a block's parent is zeros where
            it has none).
        block, cand: bool arrays: a chain block; an entry that may be found.

    Returns:
        (bool array: a block whose chain reaches a first block through
        candidates that link, int array: the row of its parent, n where none).
    """
    n = len(prow)
    has_parent = prow < n
    p = np.where(has_parent, prow, 0)
    digest = np.frombuffer(rec["token_digest"].tobytes(), "<u8")
    parent_digest = np.frombuffer(rec["parent_token_digest"].tobytes(), "<u8")
    link = (has_parent & block[p] & (rec["tokens"][p] == rec["token_start"])
            & (rec["text_bytes"][p] == rec["text_start"]) & (digest[p] == parent_digest)
            & (rec["model_id"][p] == rec["model_id"]) & (rec["model_tag"][p] == rec["model_tag"]))
    first = ~np.frombuffer(rec["parent"].tobytes(), np.uint8).reshape(n, 20).any(axis=1)
    good = cand & block & (first | link)
    rows = np.arange(n)
    attached = reachable(good, np.where(good & ~first, prow, rows))
    return attached, np.where(attached & ~first, prow, n)


def forest_of(entries, shas, digests, rec, nodes, up):
    """(the Forest of the rows nodes of n entries, each under the node of its
    parent row up[row] (n: a root), in row order; sha -> node) at once.

    Args:
        entries, shas: the entries and their digests as hex.
        digests: (n, 20) uint8: the digests.
        rec: their record array (kvstore.index_snapshot.RECORD: text_bytes, lookup_tag).
    """
    n = len(entries)
    node_of = np.full(n + 1, -1, dtype=np.int64)
    node_of[nodes] = np.arange(len(nodes))
    tags = np.frombuffer(rec["lookup_tag"].tobytes(), np.uint8).reshape(n, -1)
    every = len(nodes) == n
    forest = Forest.of(entries if every else [entries[i] for i in nodes.tolist()], rec["text_bytes"][nodes],
                       digests[nodes].tobytes(), tags[nodes].tobytes(), node_of[up[nodes]])
    return forest, dict(zip(shas if every else [shas[i] for i in nodes.tolist()], range(len(nodes))))


def _merge(local, remote):
    l_entries, l_lengths, l_digests, l_tags = local
    r_shas, r_lengths, r_digests = remote
    lengths = np.concatenate([l_lengths, r_lengths]).astype(np.uint64, copy=False)
    # Stable: at equal lengths local entries stay first (and in their order:
    # fewer tokens first), so the scan from the end meets the remote one
    # first and the best local one next.
    order = np.argsort(lengths, kind="stable")
    owners = [*l_entries, *r_shas]
    digests = np.frombuffer(bytes(l_digests) + bytes(r_digests), dtype=np.uint8).reshape(-1, 20)
    # A bucket's listing carries no lookup tags: its entries are confirmed
    # by their names alone.
    tags = np.frombuffer(bytes(l_tags) + bytes(_native.LOOKUP_TAG * len(r_shas)),
                         dtype=np.uint8).reshape(-1, _native.LOOKUP_TAG)
    return [owners[i] for i in order.tolist()], lengths[order], digests[order].tobytes(), tags[order].tobytes()


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
        owners, lengths, digests, tags = self._merged
        n = int(np.searchsorted(lengths, len(data), side="right"))
        if n == 0:
            return None, None
        matches = prefix_matches(data, lengths[:n], memoryview(digests)[:20 * n], self.local.keys,
                                 memoryview(tags)[:_native.LOOKUP_TAG * n])
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
