"""The bucket's objects as the last listing saw them: the remote half of a lookup."""

import threading
import time

import numpy as np

from kvstore.remote.options import KeyInfo


class RemoteIndex:
    """The model's objects as the last listing (plus this process's uploads) saw them.

    Lookups read one immutable snapshot (shas sorted by text length, their
    lengths, their digests joined), replaced whole on every change, so a
    lookup takes no lock.  Only objects that can be loaded on their own are
    in it: whole checkpoints and restorable chain blocks whose whole chain
    is listed; chain() gives the blocks a hit's chain is made of.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._objects = {}          # sha -> (KeyInfo, size)
        self._rejected = set()      # shas this process found unusable (not eligible, corrupt)
        self._listing = False
        self._added = {}            # during a listing: objects added meanwhile
        self._dropped = set()       # during a listing: objects found gone meanwhile
        self.generation = 0
        self.listed_at = None       # time.time() of the last complete listing
        self.snapshot = ((), np.zeros(0, dtype=np.uint64), b"")

    def __len__(self):
        return len(self._objects)

    def __contains__(self, sha):
        return sha in self._objects

    def get(self, sha):
        """(text length, object size) of a listed object; (0, 0) if unknown."""
        info = self._objects.get(sha)
        return (info[0].text_bytes, info[1]) if info else (0, 0)

    def info(self, sha):
        """The KeyInfo of a listed object, or None."""
        info = self._objects.get(sha)
        return info[0] if info else None

    def text_bytes(self, sha):
        return self.get(sha)[0]

    def chain(self, sha):
        """The shas of a block's chain, first block first (a whole object: itself);
        None when a block of it is not listed."""
        out, seen = [], set()
        info = self.info(sha)
        while info is not None:
            if info.sha in seen:
                return None
            seen.add(info.sha)
            out.append(info.sha)
            if not info.parent:
                return out[::-1]
            info = self.info(info.parent)
        return None

    def begin_listing(self):
        with self._lock:
            self._listing = True
            self._added, self._dropped = {}, set()

    def finish_listing(self, objects):
        """Replaces the index with a complete listing ({sha: (KeyInfo, size)}),
        keeping what changed meanwhile."""
        with self._lock:
            objects = dict(objects)
            objects.update(self._added)
            for sha in self._dropped:
                objects.pop(sha, None)
            self._listing = False
            changed = objects != self._objects
            self._objects = objects
            self.listed_at = time.time()
            if changed:
                self._rebuild()

    def abort_listing(self):
        with self._lock:
            self._listing = False

    def add(self, sha, text_bytes, size, parent=None, restorable=True):
        value = (KeyInfo(text_bytes, sha, parent, restorable), size)
        with self._lock:
            if self._listing:
                self._added[sha] = value
                self._dropped.discard(sha)
            if self._objects.get(sha) != value:
                self._objects[sha] = value
                self._rebuild()

    def discard(self, sha, reject=False):
        with self._lock:
            if reject:
                self._rejected.add(sha)
            if self._listing:
                self._dropped.add(sha)
                self._added.pop(sha, None)
            if self._objects.pop(sha, None) is not None or reject:
                self._rebuild()

    def _complete(self):
        """The shas whose chain is all listed (a whole object: itself)."""
        done = {}
        for sha in self._objects:
            path = []
            cur = sha
            while cur not in done:
                info = self._objects.get(cur)
                if info is None or cur in path:
                    ok = False
                    break
                path.append(cur)
                if not info[0].parent:
                    ok = True
                    break
                cur = info[0].parent
            else:
                ok = done[cur]
            for p in path:
                done[p] = ok
        return {sha for sha, ok in done.items() if ok}

    def _rebuild(self):
        complete = self._complete()
        live = sorted((info.text_bytes, sha) for sha, (info, _) in self._objects.items()
                      if sha not in self._rejected and info.restorable and sha in complete)
        shas = tuple(sha for _, sha in live)
        lengths = np.fromiter((n for n, _ in live), dtype=np.uint64, count=len(live))
        digests = b"".join(bytes.fromhex(sha) for sha in shas)
        self.snapshot = (shas, lengths, digests)
        self.generation += 1
