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

A sealed store's files are named by HMAC-SHA1 of the text under the
store's name key (kvstore.seal, docs/format.md §16).  The HMAC's inner hash
is a SHA1 pass that starts from the key's state, so a sealed lookup is the
same one pass over the prompt.  Each sealed file carries a lookup tag, the
first bytes of its name's inner hash: a length whose inner hash does not
start with the tag is passed over at once, and only a tag that matches (or
an entry without one, a bucket's) costs the outer block that finishes the
HMAC.  A sealed lookup so costs what a plain one does.  A keyed store that
accepts unsealed files makes a second, plain pass.
"""

import os
import time

import numpy as np

from kvstore import _native

from kvstore.errors import CorruptCheckpoint, KVStoreError
from kvstore.format import is_checkpoint_name, read_entry
from kvstore.forest import Forest, prefix_matches, tag_bytes
from kvstore.journal import Journal

# Directory mtimes come from a coarse kernel clock (a few ms on Linux): a
# change made within this window of the last listing may carry the same
# mtime, so a directory modified that recently is always re-listed.
MTIME_GRANULARITY_NS = 50_000_000

# A change made without the journal (kvstore.journal) while journaled changes
# came in the same interval is found by a listing at most this late.
RESCAN_NS = 30 * 1_000_000_000

_EMPTY_U32 = np.zeros(0, dtype=np.uint32)


# Envelope errors that mean a torn file: cut short, or zeros where the magic
# should be (the name of a file whose data never reached the disk).  A file
# with a checkpoint's name only ever appears whole (a rename or a link of a
# synced file), so such a file is debris of a power loss, not a write in
# progress; a file of another format version is not torn and stays.
TORN_REASONS = frozenset({"truncated", "bad_magic"})


def chain_link_ok(child, parent):
    """True when parent is the block child's chain continues from (the same
    model made both: a chain never crosses models)."""
    return (parent is not None and parent.is_block and parent.sha == child.parent
            and parent.tokens == child.token_start and parent.text_bytes == child.text_start
            and parent.token_digest == child.parent_token_digest and parent.model_id == child.model_id
            and parent.model_tag == child.model_tag)


class DirectoryIndex:
    """Every valid .kv envelope of one directory, kept current cheaply.

    Args:
        path: the directory.
        fits: predicate on Entry: can this store load it (model, context,
            payload ABI)?  Only entries that fit take part in lookups (all
            valid envelopes count for the budget).
        min_tokens: the shortest checkpoint a lookup returns (shorter chain
            blocks still link longer ones).
        keys: the kvstore.names.NameKey of every kind of name a lookup
            matches (None: SHA1 names), the store's own first: one pass over
            the prompt each.
    """

    def __init__(self, path, fits=lambda e: True, min_tokens=0, keys=(None,), journal=True):
        self.path = os.fspath(path)
        self.journal = Journal(self.path) if journal else None
        self.keys = tuple(keys)
        self.fits = fits
        self.min_tokens = min_tokens
        self.entries = {}          # name -> Entry (every valid envelope)
        self._bad = {}             # name -> (inode, mtime, size) of a file that failed to parse
        self._torn = {}            # name -> reason, of those: torn envelopes (TORN_REASONS)
        self._mtime = None         # the directory's mtime the index accounts for
        self._listed_ns = 0        # time.time_ns() when the last listing started
        self._full_mtime = None    # the directory's mtime at the last listing
        self.generation = 0        # bumped on every change
        self._by_sha = {}          # sha -> Entry
        self._forest = Forest()
        self._node = {}            # sha -> forest node of an entry that is in the forest
        self._waiting = {}         # parent sha -> {sha: Entry} of blocks whose parent is not in the forest
        self._blocks = 0           # chain blocks in the forest (none: the flat lookup)
        self._bytes = 0            # the file sizes of every entry
        self._flat = None          # (generation, the flat lookup arrays), built when asked for

    # -- upkeep ------------------------------------------------------------

    def refresh(self, force=False):
        """Brings the index up to date: the journal's changed names looked at
        again, or the directory listed when the journal cannot say what
        changed (kvstore.journal); returns True when entries changed."""
        if force or self._mtime is None or self.journal is None:
            return self._relist(force)
        st = os.stat(self.path)
        records = self.journal.changes()
        if records is None:
            # No journal yet, or it cannot say (rotated, damaged): the
            # directory's mtime decides, as without one.
            return self._relist(False)
        changed = self._recheck([name for name, _ in records])
        if st.st_mtime_ns != self._mtime:
            if st.st_mtime_ns not in {m for _, m in records}:
                # Changed since, and not by a journaled change (another tool,
                # or a writer whose record comes next): list it.
                return self._relist(False) or changed
            self._mtime = st.st_mtime_ns
        if (time.time_ns() - self._listed_ns > RESCAN_NS and st.st_mtime_ns != self._full_mtime):
            # A change made without the journal while journaled ones hid it
            # (the same interval) is found within RESCAN_NS.
            return self._relist(True) or changed
        return changed

    def _relist(self, force):
        """Re-lists the directory if it changed since the last listing (always with force)."""
        if self.journal is not None and (force or self._full_mtime is None):
            self.journal.start()      # (may create the journal: before the directory's mtime is read)
        st = os.stat(self.path)
        now = time.time_ns()
        # The last listing saw every change stamped before it started; one
        # made just after it, within the same coarse tick, may have left the
        # mtime unchanged.  So an unchanged mtime is trusted only when the
        # last listing started well after it (checking `now` instead would
        # miss such a change for good).
        if (not force and st.st_mtime_ns == self._full_mtime
                and self._listed_ns - st.st_mtime_ns > MTIME_GRANULARITY_NS):
            self._mtime = st.st_mtime_ns
            return False
        if self.journal is not None and not force and self._full_mtime is not None:
            self.journal.start()      # the listing sees every change recorded before it
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
                self._remove(name)
                changed = True
        for name in list(self._bad):
            if seen.get(name) != self._bad[name]:
                del self._bad[name]
                self._torn.pop(name, None)
        for name, key in seen.items():
            changed |= self._examine(name, key)
        self._mtime = self._full_mtime = st.st_mtime_ns
        self._listed_ns = now
        if changed:
            self._changed()
        return changed

    def _recheck(self, names):
        """Looks again at the files called names (recorded as changed); True when entries changed."""
        changed = False
        for name in dict.fromkeys(names):
            try:
                fst = os.stat(os.path.join(self.path, name), follow_symlinks=False)
            except FileNotFoundError:
                self._bad.pop(name, None)
                self._torn.pop(name, None)
                changed |= self._remove(name)
                continue
            except OSError:
                continue
            key = (fst.st_ino, fst.st_mtime_ns, fst.st_size)
            e = self.entries.get(name)
            if e is not None and (e.inode, e.mtime_ns, e.file_size) != key:
                self._remove(name)
                changed = True
            if self._bad.get(name) not in (None, key):
                del self._bad[name]
                self._torn.pop(name, None)
            changed |= self._examine(name, key)
        if changed:
            self._changed()
        return changed

    def _examine(self, name, key):
        """Reads the envelope of a file not indexed as it is now (key: inode,
        mtime, size); True when it joined the index."""
        if name in self.entries or self._bad.get(name) == key:
            return False
        try:
            entry = read_entry(os.path.join(self.path, name))
        except CorruptCheckpoint as err:
            self._bad[name] = key
            if err.reason in TORN_REASONS:
                self._torn[name] = err.reason
            return False
        except KVStoreError:
            self._bad[name] = key
            return False
        self._insert(entry)
        return True

    def add(self, *entries):
        """Records entries this process just wrote (no listing needed), in the journal too."""
        for entry in entries:
            self._remove(entry.name)
            self._insert(entry)
        self._changed()
        if self.journal is not None:
            self.journal.append([e.name for e in entries], os.stat(self.path).st_mtime_ns)

    def discard(self, name):
        """Forgets a file this process just deleted (and records it in the journal)."""
        if self._remove(name):
            self._changed()
        if self.journal is not None:
            self.journal.append([name], os.stat(self.path).st_mtime_ns)

    def close(self):
        """Lets go of the journal's descriptor (the index may still be read)."""
        if self.journal is not None:
            self.journal.close()

    def get(self, sha):
        """The entry whose name is sha (40 lowercase hex digits, any case on disk), or None."""
        return self._by_sha.get(sha) if sha else None

    @property
    def torn(self):
        """[(name, reason)] of the checkpoint-named files whose envelope is torn (TORN_REASONS)."""
        return sorted(self._torn.items())

    @property
    def orphans(self):
        """The chain blocks that fit this store but whose chain does not reach a first block."""
        return [e for kids in self._waiting.values() for e in kids.values()]

    def _insert(self, e):
        self.entries[e.name] = e
        self._bytes += e.file_size
        if e.sha:
            self._by_sha[e.sha] = e
        if not e.sha or not (e.loadable or e.sealed) or not self.fits(e):
            return
        if not e.is_block:
            if e.tokens >= self.min_tokens:
                self._node[e.sha] = self._forest.add(e)
            return
        parent = self._node.get(e.parent) if e.parent else -1
        if e.parent and (parent is None or not chain_link_ok(e, self._forest.entry[parent])):
            self._waiting.setdefault(e.parent, {})[e.sha] = e
            return
        self._attach(e, parent)

    def _attach(self, e, parent):
        """Puts block e in the forest under parent, and the blocks waiting for it below it."""
        todo = [(e, parent)]
        while todo:
            e, parent = todo.pop()
            self._node[e.sha] = node = self._forest.add(e, parent)
            self._blocks += 1
            for kid in self._waiting.pop(e.sha, {}).values():
                if chain_link_ok(kid, e):
                    todo.append((kid, node))
                else:
                    self._waiting.setdefault(e.sha, {})[kid.sha] = kid

    def _remove(self, name):
        e = self.entries.pop(name, None)
        if e is None:
            return False
        self._bytes -= e.file_size
        if e.sha and self._by_sha.get(e.sha) is e:
            del self._by_sha[e.sha]
        waiting = self._waiting.get(e.parent)
        if waiting is not None and waiting.get(e.sha) is e:
            del waiting[e.sha]
            if not waiting:
                del self._waiting[e.parent]
        node = self._node.get(e.sha) if e.sha else None
        if node is None or self._forest.entry[node] is not e:
            return True
        # The blocks below it leave the forest and wait for their parents
        # again (a replacement of e, coming back at once, takes them back).
        below = self._forest.subtree(node)
        self._forest.unlink(node)
        del self._node[e.sha]
        self._blocks -= e.is_block
        for c in below:
            kid = self._forest.entry[c]
            self._forest.kill(c)
            del self._node[kid.sha]
            self._blocks -= 1
            self._waiting.setdefault(kid.parent, {})[kid.sha] = kid
        return True

    def _changed(self):
        self.generation += 1
        f = self._forest
        if f.n > 1024 and f.live * 2 < f.n:
            self._rebuild()

    def _rebuild(self):
        """The forest from scratch (drops dead nodes)."""
        entries = list(self.entries.values())
        self.entries, self._by_sha, self._node, self._waiting = {}, {}, {}, {}
        self._forest = Forest(max(64, 2 * len(entries)))
        self._blocks = self._bytes = 0
        # Parents first, so that children attach at once.
        for e in sorted(entries, key=lambda x: (x.token_start, x.tokens)):
            self._insert(e)
        self.generation += 1

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

    def kids_in_forest(self, sha):
        """The blocks in the lookup forest whose parent is the block sha (its
        forest links: the cost of its children, not of the directory)."""
        node = self._node.get(sha)
        out = []
        if node is None:
            return out
        c = int(self._forest.first_child[node])
        while c >= 0:
            if self._forest.entry[c] is not None:
                out.append(self._forest.entry[c])
            c = int(self._forest.next_sibling[c])
        return out

    def descendants(self, entry):
        """Every block below entry in its chains (not entry itself)."""
        kids, out, todo = self.children(), [], [entry.sha]
        while todo:
            for k in kids.get(todo.pop(), ()):
                if k.sha != entry.sha and k not in out:
                    out.append(k)
                    todo.append(k.sha)
        return out

    # -- lookup ------------------------------------------------------------

    def _selectable(self, e):
        return not e.is_block or (e.restorable and e.tokens >= self.min_tokens)

    def longest_prefix(self, data, accept=None):
        """The selectable entry with the longest text that is a prefix of data.

        One SHA1 pass over data gives the digest at every stored length
        tried; the longest match wins (of equal length, more tokens, then a
        file that names its model over one that names none).

        Args:
            data: the prompt bytes.
            accept: optional predicate on Entry; a match it refuses is passed
                over for the next longest.
        """
        if not self._blocks:
            entries, lengths, digests, tags = self.lookup_arrays()
            n = int(np.searchsorted(lengths, len(data), side="right"))
            if n == 0:
                return None
            found = [entries[i] for i in prefix_matches(data, lengths[:n], memoryview(digests)[:20 * n],
                                                        self.keys, memoryview(tags)[:_native.LOOKUP_TAG * n])]
        else:
            nodes = self._forest.entry
            found = sorted((nodes[i] for i in self._forest.matches(data, self.keys) if self._selectable(nodes[i])),
                           key=_preference)
        for e in reversed(found):
            if accept is None or accept(e):
                return e
        return None

    def lookup_arrays(self):
        """(selectable entries sorted by text length, their lengths as uint64, their
        digests joined, their lookup tags joined): what a flat lookup searches,
        for a caller that searches this index together with another one in the
        same pass.  Built when asked for, kept until the index changes."""
        if self._flat is None or self._flat[0] != self.generation:
            live = sorted((e for e in self._forest.entry[:self._forest.n] if e is not None and self._selectable(e)),
                          key=_preference)
            lengths = np.fromiter((e.text_bytes for e in live), dtype=np.uint64, count=len(live))
            self._flat = (self.generation, (live, lengths, b"".join(bytes.fromhex(e.sha) for e in live),
                                            b"".join(tag_bytes(e) for e in live)))
        return self._flat[1]

    def total_bytes(self):
        """The bytes of every valid envelope listed (kept as entries come and go)."""
        return self._bytes


def _preference(e):
    """Ascending: the best match last.  Longer text, then more tokens; then a
    file of the store's model over one that names no model (a store that
    accepts both sees no third kind)."""
    return e.text_bytes, e.tokens, e.model_tag != 0


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
