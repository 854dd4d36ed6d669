"""The directory's journal of changed names: how one process learns another's saves without a listing.

``<dir>/.journal`` (0600) is a text file of records ``<name> <mtime>``,
one per line, appended (O_APPEND, one write per call) by every kvstore
process right after it publishes, replaces or removes those files: the
checkpoint's name and the directory's mtime (ns) the writer saw just after
its change.  A record says only "this name changed": a reader looks at that
one file again (stat, and its envelope when it is new), so a record
repeated, out of order or about a file that has changed again since is
harmless.  The mtime tells a reader that the directory's current mtime is
a journaled change's, so that nothing else changed it since.  A record
``.index <mtime>`` says that the index snapshot (kvstore.index_snapshot)
was replaced or removed: no checkpoint changed, only the directory's mtime.

The files stay the truth: the journal is a hint that lets kvstore.index
skip a listing of the whole directory (docs/semantics.md §4).  A journal that
is missing, rotated (another inode at the name) or damaged (a line that is
not a checkpoint name) makes the reader list the directory once.  A change
made without a record (another tool, an older kvstore, a record lost to a
crash) shows in the directory's mtime, which the index still checks.

When the journal outgrows MAX_JOURNAL_BYTES the writer that notices
replaces it with an empty one (a rename over it); readers see the new
inode and list the directory once.  Nothing is synced: after a power loss
a store lists the directory when it opens anyway.
"""

import os
import secrets

from kvstore.format import is_checkpoint_name
from kvstore.index_snapshot import SNAPSHOT_NAME

JOURNAL_NAME = ".journal"

# Past this size the journal starts again empty (about 23,000 records).
MAX_JOURNAL_BYTES = 1 << 20

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def _recordable(name):
    """A checkpoint's name, or the snapshot's."""
    return name == SNAPSHOT_NAME or is_checkpoint_name(name)


def checkpoint_names(records):
    """The checkpoint names of records (a snapshot's record changes none)."""
    return [name for name, _ in records if name != SNAPSHOT_NAME]


def _parse(line):
    """(name, mtime) of a record line, or None when it is not one."""
    name, _, mtime = line.partition(" ")
    if not _recordable(name) or not mtime.isdigit():
        return None
    return name, int(mtime)


class Journal:
    """The journal of one directory, as one process reads and appends it."""

    def __init__(self, directory):
        self.path = os.path.join(os.fspath(directory), JOURNAL_NAME)
        self._fd = None          # open for reading, on the inode last read
        self._ino = None
        self._offset = 0

    # -- writing ----------------------------------------------------------------

    def append(self, names, dir_mtime_ns):
        """Records that the files called names changed, the directory's mtime
        then being dir_mtime_ns (best effort: a failure only costs readers a
        listing)."""
        data = "".join(f"{n} {int(dir_mtime_ns)}\n" for n in names if _recordable(n)).encode()
        if not data:
            return
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | _NOFOLLOW | _CLOEXEC, 0o600)
        except OSError:
            return
        try:
            os.write(fd, data)
            size = os.fstat(fd).st_size
        except OSError:
            return
        finally:
            os.close(fd)
        if size > MAX_JOURNAL_BYTES:
            self._rotate()

    def _rotate(self):
        tmp = f"{self.path}.{secrets.token_hex(4)}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, 0o600)
            os.close(fd)
            os.rename(tmp, self.path)
        except OSError:
            try:
                os.unlink(tmp)
            except OSError:
                pass

    # -- reading ----------------------------------------------------------------

    def start(self):
        """Reads from the journal's end from now on (called before a full
        listing, which sees every change recorded so far)."""
        self.close()
        flags = os.O_RDONLY | _NOFOLLOW | _CLOEXEC
        try:
            # Created here when missing, so that this reader follows it from
            # the first record on.
            self._fd = os.open(self.path, flags | os.O_CREAT, 0o600)
        except OSError:
            try:
                self._fd = os.open(self.path, flags)     # a directory this process cannot write
            except OSError:
                return
        st = os.fstat(self._fd)
        self._ino, self._offset = st.st_ino, st.st_size

    def position(self):
        """(inode, offset) up to which this reader has read the journal, or None."""
        return None if self._fd is None else (self._ino, self._offset)

    def resume(self, position):
        """Reads from position (an earlier position(), maybe another
        process's) on; False, and nothing to read, when the journal there
        now is another (rotated, or gone) or shorter: records since may be
        lost."""
        self.close()
        if position is None:
            return False
        try:
            fd = os.open(self.path, os.O_RDONLY | _NOFOLLOW | _CLOEXEC)
        except OSError:
            return False
        st = os.fstat(fd)
        if (st.st_ino, st.st_size >= position[1]) != (position[0], True):
            os.close(fd)
            return False
        self._fd, self._ino, self._offset = fd, st.st_ino, position[1]
        return True

    def changes(self):
        """[(name, directory mtime)] recorded since the last call (or
        start()), or None when the reader must list the directory instead
        (no journal, another journal at the name, a damaged line)."""
        try:
            st = os.stat(self.path, follow_symlinks=False)
        except OSError:
            return None
        if self._fd is None or st.st_ino != self._ino:
            return None
        if st.st_size <= self._offset:
            return [] if st.st_size == self._offset else None
        try:
            data = os.pread(self._fd, st.st_size - self._offset, self._offset)
        except OSError:
            return None
        end = data.rfind(b"\n") + 1          # a record still being written waits for its newline
        records = [_parse(line) for line in data[:end].decode("ascii", "replace").split("\n")[:-1]]
        if None in records:
            self._offset = st.st_size
            return None
        self._offset += end
        return records

    def close(self):
        """Lets go of the journal (a reader's descriptor); start() takes it up again."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self._ino = None
