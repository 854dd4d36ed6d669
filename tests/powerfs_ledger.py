"""The power-loss filesystem's ledger (tests/powerfs.py): what a disk holds
durably after each call, what it still owes, and what survives a cut.

A file's bytes at its last fsync survive; the pages written since are
pending.  A directory's names at its last fsync survive; the names created,
renamed, linked or removed since are pending.  survive() writes the synced
state ("synced"), or that plus a random subset of the pending pages and
name changes ("reorder").

With barriers on (reset's barriers=True, the model of macOS's
F_BARRIERFSYNC), an fdatasync of a file or directory is a barrier, not a
flush: it snapshots the file's bytes (or the directory's names) as the next
epoch, ordered after every epoch before it, and nothing of it is durable
yet.  An fsync (datasync off: F_FULLFSYNC's drive flush) makes every epoch
durable, then the file or directory itself.  survive(mode="barrier") writes
the durable state plus a random prefix of the epochs, in their order (a
drive that keeps its barriers writes nothing of a later epoch before an
earlier one); when the prefix is all of them, plus a random subset of what
was written since (as "reorder").
"""

import os

PAGE = 4096


class Ledger:
    """What the disk holds durably, what it owes, and the live tree's ids."""

    def __init__(self, backing, graveyard, barriers=False):
        self.backing = backing
        self.graveyard = graveyard
        self.next_id = 0
        self.ids = {}             # live relative path ("" is the root) -> id
        self.kind = {}            # id -> "dir" or "file"
        self.where = {}           # file id -> its bytes' path now (live, or in the graveyard)
        self.names = {}           # dir id -> {name: id}, durable
        self.data = {}            # file id -> bytes at its last sync (absent: never synced)
        self.pages = {}           # file id -> pages written since its last sync
        self.log = {}             # dir id -> [pending name change]
        self.ops = 0
        self.buried = 0
        self.trace = []           # the mutating calls, for a failure's report
        self.arm_at = None
        self.frozen = False
        self.barriers = barriers  # fdatasync is a barrier (the module docstring)
        self.epochs = []          # ("file", id, bytes) or ("dir", id, {name: id}), in barrier order
        self.barrier_calls = 0
        self._adopt("")

    def _new(self, kind):
        self.next_id += 1
        self.kind[self.next_id] = kind
        if kind == "dir":
            self.names[self.next_id] = {}
            self.log[self.next_id] = []
        return self.next_id

    def _adopt(self, rel):
        """Takes the tree under rel as it is, all of it durable (a reset)."""
        i = self._new("dir")
        self.ids[rel] = i
        full = os.path.join(self.backing, rel)
        for name in sorted(os.listdir(full)):
            child = os.path.join(rel, name) if rel else name
            if os.path.isdir(os.path.join(self.backing, child)):
                self.names[i][name] = self._adopt(child)
            else:
                f = self._new("file")
                self.ids[child] = f
                self.where[f] = os.path.join(self.backing, child)
                with open(self.where[f], "rb") as fh:
                    self.data[f] = fh.read()
                self.pages[f] = set()
                self.names[i][name] = f
        return i

    def path(self, rel):
        return os.path.join(self.backing, rel)

    def count(self, what, rel):
        self.ops += 1
        self.trace.append(f"{self.ops} {what} {rel}")
        if len(self.trace) > 400:
            del self.trace[:100]
        if self.arm_at is not None and self.ops >= self.arm_at:
            self.frozen = True

    # -- changes ------------------------------------------------------------------

    def created(self, rel, kind):
        i = self._new(kind)
        self.ids[rel] = i
        if kind == "file":
            self.where[i] = self.path(rel)
            self.pages[i] = set()
        parent, name = split_path(rel)
        self.log[self.ids[parent]].append(("set", name, i))
        return i

    def written(self, i, offset, length):
        if length > 0:
            self.pages[i].update(range(offset // PAGE, (offset + length - 1) // PAGE + 1))

    def resized(self, i, old, new):
        lo, hi = min(old, new), max(old, new)
        if hi > lo:
            self.pages[i].update(range(lo // PAGE, (hi - 1) // PAGE + 1))

    def synced_file(self, i, fd, datasync=False):
        size = os.fstat(fd).st_size
        snapshot = os.pread(fd, size, 0) if size else b""
        self.pages[i] = set()
        if self._ordered(("file", i, snapshot), datasync):
            self.data[i] = snapshot

    def synced_dir(self, rel, datasync=False):
        d = self.ids[rel]
        names = {name: self.ids[os.path.join(rel, name) if rel else name]
                 for name in os.listdir(self.path(rel)) if not hidden(name)}
        self.log[d] = []
        if self._ordered(("dir", d, names), datasync):
            self.names[d] = names

    def _ordered(self, epoch, datasync):
        """With barriers on, a datasync queues epoch (False: not durable yet)
        and a full sync makes the queued epochs durable first.  True when
        the sync makes its own file or directory durable."""
        if not self.barriers:
            return True
        if datasync:
            self.barrier_calls += 1
            self.epochs.append(epoch)
            return False
        _settle(self.epochs, self.names, self.data)
        self.epochs = []
        return True

    def hide(self, old, new):
        """FUSE's stand-in for unlinking an open file: old is renamed to the
        hidden name new until its last close.  On a disk the name is gone."""
        i = self.ids[old]
        os.rename(self.path(old), self.path(new))
        del self.ids[old]
        self.ids[new] = i
        if self.where.get(i) == self.path(old):
            self.where[i] = self.path(new)
        parent, name = split_path(old)
        self.log[self.ids[parent]].append(("del", name, i))

    def _grave(self, i):
        """A new graveyard name for file i's bytes."""
        self.buried += 1
        return os.path.join(self.graveyard, f"{i}-{self.buried}")

    def unlink(self, rel):
        """Removes rel (a file, or an empty directory): the name goes, the
        bytes go to the graveyard (a durable name may still point at them).
        Raises OSError before changing anything."""
        i = self.ids[rel]
        if self.kind[i] == "file":
            grave = self._grave(i)
            os.rename(self.path(rel), grave)
            if self.where[i] == self.path(rel):
                self.where[i] = grave
        else:
            os.rmdir(self.path(rel))
        del self.ids[rel]
        parent, name = split_path(rel)
        if not hidden(name):                 # a hidden name's removal was logged by hide()
            self.log[self.ids[parent]].append(("del", name, i))

    def rename(self, old, new):
        """Renames old to new (replacing a file there, whose bytes go to the
        graveyard).  Raises OSError before changing anything."""
        i = self.ids[old]
        replaced = self.ids.get(new)
        grave = None
        if replaced is not None and self.kind[replaced] == "file":
            grave = self._grave(replaced)
            os.link(self.path(new), grave)
        try:
            os.rename(self.path(old), self.path(new))
        except OSError:
            if grave is not None:
                os.unlink(grave)
            raise
        if replaced is not None:
            del self.ids[new]
            if grave is not None and self.where[replaced] == self.path(new):
                self.where[replaced] = grave
        op, np_ = split_path(old), split_path(new)
        if op[0] == np_[0]:
            self.log[self.ids[op[0]]].append(("rename", op[1], np_[1], i))
        else:
            self.log[self.ids[op[0]]].append(("del", op[1], i))
            self.log[self.ids[np_[0]]].append(("set", np_[1], i))
        for rel in [r for r in self.ids if r == old or r.startswith(old + "/")]:
            j = self.ids.pop(rel)
            moved = new + rel[len(old):]
            self.ids[moved] = j
            if self.kind[j] == "file" and self.where.get(j) == self.path(rel):
                self.where[j] = self.path(moved)

    def linked(self, source, target):
        """target is a new name of source's file (the link made)."""
        i = self.ids[source]
        self.ids[target] = i
        parent, name = split_path(target)
        self.log[self.ids[parent]].append(("set", name, i))

    # -- after the cut ------------------------------------------------------------------

    def survive(self, dest, mode, rng):
        os.makedirs(dest, exist_ok=True)
        kept = {"pages_pending": 0, "pages_kept": 0, "names_pending": 0, "names_kept": 0,
                "epochs_pending": 0, "epochs_kept": 0}
        names, data = self.names, self.data
        if mode == "barrier":
            n = rng.randint(0, len(self.epochs))
            kept["epochs_pending"], kept["epochs_kept"] = len(self.epochs), n
            names, data = {d: dict(v) for d, v in names.items()}, dict(data)
            _settle(self.epochs[:n], names, data)
            mode = "reorder" if n == len(self.epochs) else "synced"
        self._write_dir(self.ids[""], dest, mode, rng, kept, set(), (names, data))
        return kept

    def _write_dir(self, d, dest, mode, rng, kept, seen, state):
        names = dict(state[0][d])
        if mode == "reorder":
            for change in self.log[d]:
                kept["names_pending"] += 1
                if rng.random() < 0.5:
                    kept["names_kept"] += 1
                    _apply(names, change)
        for name, i in sorted(names.items()):
            target = os.path.join(dest, name)
            if self.kind[i] == "dir":
                if i in seen:
                    continue
                os.makedirs(target, exist_ok=True)
                self._write_dir(i, target, mode, rng, kept, seen | {i}, state)
            else:
                with open(target, "wb") as f:
                    f.write(self._contents(i, mode, rng, kept, state[1]))

    def _contents(self, i, mode, rng, kept, data):
        base = data.get(i, b"")
        if mode != "reorder" or not self.pages.get(i):
            return base
        try:
            with open(self.where[i], "rb") as f:
                now = f.read()
        except FileNotFoundError:
            return base
        size = rng.choice((len(base), len(now)))
        out = bytearray(base[:size].ljust(size, b"\0"))
        for p in sorted(self.pages[i]):
            kept["pages_pending"] += 1
            if rng.random() < 0.5:
                kept["pages_kept"] += 1
                lo = p * PAGE
                if lo < size:
                    chunk = now[lo:min(lo + PAGE, size)]
                    out[lo:lo + len(chunk)] = chunk
        return bytes(out)


def _settle(epochs, names, data):
    """Applies epochs, in order, to the durable names and data."""
    for kind, i, value in epochs:
        (names if kind == "dir" else data)[i] = value


def hidden(name):
    """A name FUSE gives an unlinked file that is still open (until its last close)."""
    return name.startswith(".fuse_hidden")


def split_path(rel):
    parent, _, name = rel.rpartition("/")
    return parent, name


def _apply(names, change):
    if change[0] == "set":
        names[change[1]] = change[2]
    elif change[0] == "del":
        if names.get(change[1]) == change[2]:
            del names[change[1]]
    else:                                     # a rename within the directory, whole
        _, old, new, i = change
        if names.get(old) == i:
            del names[old]
        names[new] = i
