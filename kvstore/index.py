"""The lookup index (docs/semantics.md §4, docs/format.md §14): text length -> {digest -> entry}.

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
size changed), so a lookup in an unchanged directory costs one stat.  The
first refresh starts from the directory's snapshot of the index
(kvstore.index_snapshot), brought up to date from the journal and a listing
of names, so that opening a store reads only the envelopes that changed
since the snapshot was written.

TieredLookup (kvstore.forest) searches the directory and the remote tier's
index of a bucket in the same single pass.

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

import gc
import os
import time
from itertools import filterfalse

import numpy as np

from kvstore import _native, index_snapshot
from kvstore.errors import CorruptCheckpoint, KVStoreError
from kvstore.forest import (Forest, attached_rows, chain_link_ok, forest_of, prefix_matches,
                            tag_bytes)
from kvstore.format import LOADABLE_ABIS, SEALED_ABIS, is_checkpoint_name, read_entry
from kvstore.index_snapshot import SNAPSHOT_NAME
from kvstore.journal import Journal, checkpoint_names

# Directory mtimes come from a coarse kernel clock (a few ms on Linux): a
# change made within this window of the last listing may carry the same
# mtime, so a directory modified that recently is always re-listed.
MTIME_GRANULARITY_NS = 50_000_000

# A change made without the journal (kvstore.journal) while journaled changes
# came in the same interval is found by a listing at most this late.
RESCAN_NS = 30 * 1_000_000_000


# Envelope errors that mean a torn file: cut short, or zeros where the magic
# should be (the name of a file whose data never reached the disk).  A file
# with a checkpoint's name only ever appears whole (a rename or a link of a
# synced file), so such a file is debris of a power loss, not a write in
# progress; a file of another format version is not torn and stays.
TORN_REASONS = frozenset({"truncated", "bad_magic"})

# A directory with fewer checkpoints opens fast without a snapshot (their
# envelopes read in some 40 ms): none is kept for it.
SNAPSHOT_MIN_ENTRIES = 1000

# The snapshot is written again after this many changes to the index: the
# journal holds about 23,000 records before it starts again empty, so a
# snapshot this far behind is still explained by it while several processes
# write.  A rewrite keeps the records of unchanged entries (some 1.5 µs per
# entry for 100,000, plus the new ones): about 40 µs per change.
SNAPSHOT_EVERY_CHANGES = 4096

# The fields of an Entry that the fits predicate may judge (kvstore.policy.misfit).
FIT_FIELDS = ("payload_abi", "key_id", "model_tag", "model_id", "ctx_size", "quant_bits")


class DirectoryIndex:
    """Every valid .kv envelope of one directory, kept current cheaply.

    Args:
        path: the directory.
        fits: predicate on Entry: can this store load it (model, context,
            payload ABI)?  Only entries that fit take part in lookups (all
            valid envelopes count for the budget).  It may judge only the
            FIT_FIELDS: it is asked once per distinct combination of them.
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
        self.temp_names = []       # the temporary files (".tmp." names) the last listing saw
        self._fit_memo = {}        # the FIT_FIELDS of an entry -> fits
        self._unsaved = 0          # entries changed since the snapshot was read or written
        self._written = None       # (records, entries) of the snapshot read or written: kept records

    # -- upkeep ------------------------------------------------------------

    def refresh(self, force=False):
        """Brings the index up to date: the journal's changed names looked at
        again, or the directory listed when the journal cannot say what
        changed (kvstore.journal); returns True when entries changed.  The
        first one starts from the directory's snapshot (docs/semantics.md §4)."""
        if self._mtime is None and self.journal is not None:
            return self._open()
        if force or self._mtime is None or self.journal is None:
            return self._relist(force)
        st = os.stat(self.path)
        records = self.journal.changes()
        if records is None:
            # No journal yet, or it cannot say (rotated, damaged): the
            # directory's mtime decides, as without one.
            return self._relist(False)
        changed = self._recheck(checkpoint_names(records))
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
        seen, temps = {}, []
        with os.scandir(self.path) as it:
            for de in it:
                if is_checkpoint_name(de.name):
                    try:
                        fst = de.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    seen[de.name] = (fst.st_ino, fst.st_mtime_ns, fst.st_size)
                elif ".tmp." in de.name:
                    temps.append(de.name)
        self.temp_names = temps
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

    # -- the snapshot (docs/semantics.md §4) ---------------------------------------

    def _open(self):
        """The first refresh: the directory's snapshot brought up to date from
        the journal and a listing of names, or, where it cannot be used or
        the directory changed in a way neither explains, every file stated
        (reading only the envelopes the snapshot does not hold as they are)."""
        # The cyclic collector would walk 100,000 new entries again and again
        # while they are made (none is garbage): it waits, and they join the
        # oldest generation at once (freeze and unfreeze move everything there).
        collecting = gc.isenabled()
        gc.disable()
        try:
            started = time.time_ns()
            st = os.stat(self.path)
            snap = index_snapshot.read(self.path, st)
            if snap is not None and self._load(snap):
                if self.journal.resume(snap.journal) and self._reconcile(snap, st, started):
                    if self._unsaved >= SNAPSHOT_EVERY_CHANGES:
                        self._save_snapshot()
                    return bool(self.entries)
            self._relist(True)
            self._save_snapshot()
            return bool(self.entries)
        finally:
            if collecting:
                if len(self.entries) >= SNAPSHOT_MIN_ENTRIES:
                    gc.freeze()
                    gc.unfreeze()
                gc.enable()

    def _reconcile(self, snap, st, started):
        """Looks again at the names the journal recorded since the snapshot,
        reads the names listed now that it does not hold, drops those no
        longer listed; False when the directory's mtime (st, read before the
        journal) is neither the snapshot's nor a recorded change's."""
        records = self.journal.changes()
        if records is None:
            return False
        listed = os.listdir(self.path)
        unknown = list(filterfalse(self.entries.__contains__, listed))
        # Names are listed once each: as many known as the index holds, none is gone.
        gone = [] if len(listed) - len(unknown) == len(self.entries) else list(self.entries.keys() - set(listed))
        self.temp_names = [n for n in unknown if ".tmp." in n]
        self._recheck(checkpoint_names(records) + [n for n in unknown if is_checkpoint_name(n)] + gone)
        if st.st_mtime_ns != snap.mtime_ns and st.st_mtime_ns not in {m for _, m in records}:
            return False
        # The listing of names counts as a listing of the directory (RESCAN_NS).
        self._mtime = self._full_mtime = st.st_mtime_ns
        self._listed_ns = started
        return True

    def _load(self, snap):
        """Takes in a snapshot's entries (into an empty index) at once: which
        ones join the lookup forest, and under which parent, is worked out on
        the snapshot's record arrays, not entry by entry.  False (and still
        empty) when it names a file twice."""
        rec, entries, shas, n = snap.records, snap.entries, snap.shas, len(snap.entries)
        self.entries = dict(zip(snap.names, entries))
        if len(self.entries) != n:
            self.entries = {}           # a name twice: not a snapshot kvstore wrote
            return False
        if not snap.unique or _native.LOOKUP_TAG != index_snapshot.SEAL_ID:
            self.entries = {}
            for e in entries:           # two names of one digest (hex case): as a listing would
                self._insert(e)
            self._changed()
            return True
        self._written = (rec, entries)
        self._by_sha = dict(zip(shas, entries))
        self._bytes = int(rec["file_size"].sum())
        block = np.isin(rec["payload_abi"], index_snapshot.BLOCK_ABIS)
        fit = self._fit_rows(entries, rec)
        cand = np.isin(rec["payload_abi"], list(LOADABLE_ABIS | SEALED_ABIS)) & fit
        attached, up = attached_rows(snap.parent_rows, rec, block, cand)
        nodes = np.flatnonzero(attached | (cand & ~block & (rec["tokens"] >= self.min_tokens)))
        self._forest, self._node = forest_of(entries, shas, snap.digests, rec, nodes, up)
        self._blocks = int(attached.sum())
        for i in np.flatnonzero(cand & block & ~attached).tolist():
            self._waiting.setdefault(entries[i].parent, {})[entries[i].sha] = entries[i]
        self._changed()
        return True

    def _fit_rows(self, entries, rec):
        """fits of every entry of a snapshot, as a bool array: asked of one
        entry per distinct FIT_FIELDS (and record kind) of the records."""
        first, inverse = index_snapshot.groups(rec, [*FIT_FIELDS, "kind"])
        return np.array([self._fit(entries[i]) for i in first], dtype=bool)[inverse]

    def _fit(self, e):
        key = tuple(getattr(e, f) for f in FIT_FIELDS)
        ok = self._fit_memo.get(key)
        if ok is None:
            ok = self._fit_memo[key] = bool(self.fits(e))
        return ok

    def _save_snapshot(self):
        """Writes the snapshot of the index as it is now (a small directory's is
        removed instead) and journals it: the directory's new mtime changed no checkpoint."""
        self._unsaved = 0
        if self.journal is None or self._mtime is None:
            return
        try:
            if len(self.entries) < SNAPSHOT_MIN_ENTRIES:
                self._written = None
                done = index_snapshot.remove(self.path)
            else:
                entries = list(self.entries.values())
                rec = index_snapshot.records_of(list(self.entries), entries, self._written)
                done = rec is not None and index_snapshot.write(
                    self.path, index_snapshot.encode(rec, os.stat(self.path), self._mtime, self.journal.position()))
                self._written = (rec, entries) if done else None
            if done:
                self.journal.append([SNAPSHOT_NAME], os.stat(self.path).st_mtime_ns)
        except OSError:
            pass            # a snapshot is a hint: without one the next open lists the directory

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
            if self._unsaved >= SNAPSHOT_EVERY_CHANGES:
                self._save_snapshot()

    def discard(self, name):
        """Forgets a file this process just deleted (and records it in the journal)."""
        if self._remove(name):
            self._changed()
        if self.journal is not None:
            self.journal.append([name], os.stat(self.path).st_mtime_ns)
            if self._unsaved >= SNAPSHOT_EVERY_CHANGES:
                self._save_snapshot()

    def close(self):
        """Writes the snapshot if the index changed since it was read or
        written, and lets go of the journal's descriptor (the index may still
        be read)."""
        if self.journal is not None:
            if self._unsaved:
                self._save_snapshot()
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
        self._unsaved += 1
        if not e.sha or not (e.loadable or e.sealed) or not self._fit(e):
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
        self._unsaved += 1
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
        entries, unsaved = list(self.entries.values()), self._unsaved
        self.entries, self._by_sha, self._node, self._waiting = {}, {}, {}, {}
        self._forest = Forest(max(64, 2 * len(entries)))
        self._blocks = self._bytes = 0
        # Parents first, so that children attach at once.
        for e in sorted(entries, key=lambda x: (x.token_start, x.tokens)):
            self._insert(e)
        self._unsaved = unsaved
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

    def kids_in_forest(self, sha):
        """The blocks in the lookup forest whose parent is the block sha (its
        forest links: the cost of its children, not of the directory)."""
        node, out = self._node.get(sha), []
        c = -1 if node is None else int(self._forest.first_child[node])
        while c >= 0:
            if self._forest.entry[c] is not None:
                out.append(self._forest.entry[c])
            c = int(self._forest.next_sibling[c])
        return out

    def deepest_match(self, data):
        """The entry with the longest stored text that is a prefix of data, loadable or not
        (where data's stored path ends), or None."""
        nodes = self._forest.entry
        return max((nodes[i] for i in self._forest.matches(data, self.keys)), key=_preference, default=None)

    def longest_below(self, sha):
        """The block with the most tokens in the forest below the block sha, itself included (None: not there)."""
        node, nodes = self._node.get(sha), self._forest.entry
        below = [] if node is None else self._forest.subtree(node) + [node]
        return max((nodes[i] for i in below if nodes[i] is not None), key=lambda e: e.tokens, default=None)

    def descendants(self, entry):
        """Every block below entry in its chains (not entry itself)."""
        kids = {}
        for e in self.entries.values():
            if e.is_block and e.parent:
                kids.setdefault(e.parent, []).append(e)
        out, todo = [], [entry.sha]
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
