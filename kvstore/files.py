"""File helpers shared by the store, the remote tier and the command line.

Everything here acts on one file (or one directory listing) and knows
nothing of lookups, budgets or models:

- sync_fd, sync_dir: the one place that makes a write durable, with the
  platform's primitive (F_FULLFSYNC on macOS, fsync elsewhere);
- unlink_if_same, move_aside / quarantine, overwrite / wipe_file: changes
  that act only on the very file a caller opened, never on a newer one that
  took its name, and never through a planted symlink;
- record_hit: the in-place hit count of the file a load just read;
- crc_range, verify_file: the checks of a load without keeping any array;
- scan_directory: the valid envelopes of a directory and the bad ones.

A new file is written and put in place by kvstore.publish.

See docs/semantics.md §6 (save), §11 (durability) and §12 (privacy).
"""

import errno
import fcntl
import hashlib
import os
import shutil
import sys
import time

from kvstore import _native, names, payload
from kvstore.identity import ModelIdentity
from kvstore.forest import chain_link_ok
from kvstore.errors import CheckpointMissing, CheckpointOSError, CorruptCheckpoint, KVStoreError, UnsafePath
from kvstore.format import PREFIX_SIZE, entry_from_fd, is_checkpoint_name, open_checkpoint, read_entry

# Flags of every open kvstore makes: never through a symlink, never inherited
# by a child process.
_SAFE = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
CREATE_FLAGS = os.O_RDWR | os.O_CREAT | os.O_EXCL | _SAFE
RDWR_FLAGS = os.O_RDWR | _SAFE
READ_FLAGS = os.O_RDONLY | _SAFE

QUARANTINE_DIR = ".quarantine"

# wipe overwrites in blocks of this size before unlinking.
WIPE_BLOCK = 1 << 20

# verify_file and crc_range stream every block through one buffer of this
# size, so checking a file of any size costs a few MiB of memory, far inside
# the 64 MiB a load may use on top of its arrays (docs/semantics.md §5).
VERIFY_CHUNK = 4 << 20


def short_name(name):
    """A checkpoint name cut for a log line: ``3f9c0a1b2c3d…kv``."""
    return name[:12] + "…kv" if len(name) > 12 else name


def describe_error(err):
    """One line naming what is wrong with a file (never prompt text)."""
    if isinstance(err, CorruptCheckpoint):
        return f"{err.reason}: {err.detail}" if err.detail else err.reason
    if isinstance(err, UnsafePath):
        return "unsafe_path: not a regular file (kvstore never follows symlinks)"
    if isinstance(err, OSError) and err.errno:
        return f"unreadable: {os.strerror(err.errno)}"
    return f"unreadable: {err}"


# ---- durability ---------------------------------------------------------------
#
# On macOS fsync(2) hands the data to the drive but does not make the drive
# flush its own write cache, so a power loss can still lose or tear a file
# that was "synced".  Apple's answer is fcntl(F_FULLFSYNC), which SQLite uses
# when `PRAGMA fullfsync` is on; some filesystems (network mounts, FUSE)
# refuse it, and then fsync is the best there is.  On Linux fsync reaches
# the platter (or the drive's flush), and fdatasync suffices for a change
# that does not need the file's metadata (an in-place byte of a header).

#
# A full flush is slow on Apple's SSDs (the drive empties its whole cache),
# and a chained save makes two syncs per block.  Apple's answer for ordering
# is fcntl(F_BARRIERFSYNC): an fsync, then a barrier, so that the drive
# writes nothing issued after it before what was issued before it.  So on
# macOS the steps of a durable save (each block's data, each link in the
# directory) are barriers, and the save's last step is an F_FULLFSYNC of the
# directory, which flushes the drive's cache: every step before it is then
# durable.  A power cut before that flush keeps a prefix of the steps in
# their order (a chain prefix, as on Linux); a save that returned is durable.
# Elsewhere each step's fsync is durable already and the end adds nothing
# (docs/semantics.md §11).

# <sys/fcntl.h> on macOS; Python's fcntl module does not name it everywhere.
F_BARRIERFSYNC = 85

# errno values that mean "this filesystem does not do F_FULLFSYNC" (or F_BARRIERFSYNC).
_FULLFSYNC_REFUSED = frozenset(getattr(errno, n) for n in ("ENOTSUP", "EOPNOTSUPP", "EINVAL", "ENOTTY")
                               if hasattr(errno, n))

_sync_fallbacks = 0


def sync_primitive(platform=None):
    """The primitive a durable write uses on a platform: "F_FULLFSYNC" on macOS, else "fsync".

    Args:
        platform: a ``sys.platform`` value (default: this one's).
    """
    platform = sys.platform if platform is None else platform
    return "F_FULLFSYNC" if platform == "darwin" else "fsync"


SYNC_PRIMITIVE = sync_primitive()


def step_primitive(platform=None):
    """The primitive of a durable save's steps on a platform: "F_BARRIERFSYNC"
    on macOS (the save then ends with sync_primitive's F_FULLFSYNC), else
    "fsync", the same as the end.

    Args:
        platform: a ``sys.platform`` value (default: this one's).
    """
    platform = sys.platform if platform is None else platform
    return "F_BARRIERFSYNC" if platform == "darwin" else "fsync"


STEP_PRIMITIVE = step_primitive()


def sync_fd(fd, data_only=False, primitive=None):
    """Makes what was written to fd durable: the one place kvstore syncs.

    Args:
        fd: an open file or directory.
        data_only: the change needs no metadata to be found again (a byte
            rewritten in place): fdatasync where the platform has it.
        primitive: "F_FULLFSYNC", "F_BARRIERFSYNC" (order_fd) or "fsync"
            (default: SYNC_PRIMITIVE).

    Returns:
        the primitive that took effect: "F_FULLFSYNC", "F_BARRIERFSYNC",
        "fsync" or "fdatasync" (F_BARRIERFSYNC falls back to F_FULLFSYNC,
        and F_FULLFSYNC to fsync, where the filesystem refuses it or the
        platform has no such call).
    """
    global _sync_fallbacks
    primitive = SYNC_PRIMITIVE if primitive is None else primitive
    if primitive == "F_BARRIERFSYNC":
        if sys.platform == "darwin" or getattr(fcntl, "F_BARRIERFSYNC", None) is not None:
            try:
                fcntl.fcntl(fd, getattr(fcntl, "F_BARRIERFSYNC", F_BARRIERFSYNC))
                return "F_BARRIERFSYNC"
            except OSError as e:
                if e.errno not in _FULLFSYNC_REFUSED:
                    raise
        primitive = "F_FULLFSYNC"           # no barrier here: a full flush orders too
    if primitive == "F_FULLFSYNC":
        op = getattr(fcntl, "F_FULLFSYNC", None)
        if op is not None:
            try:
                fcntl.fcntl(fd, op)
                return "F_FULLFSYNC"
            except OSError as e:
                if e.errno not in _FULLFSYNC_REFUSED:
                    raise
        _sync_fallbacks += 1
        os.fsync(fd)
        return "fsync"
    if data_only and hasattr(os, "fdatasync"):
        os.fdatasync(fd)
        return "fdatasync"
    os.fsync(fd)
    return "fsync"


def sync_fallbacks():
    """How many times this process fell back from F_FULLFSYNC to fsync."""
    return _sync_fallbacks


def sync_dir(path, primitive=None):
    """Makes a rename or unlink in the directory at path durable (or, with
    primitive STEP_PRIMITIVE, ordered before what follows: order_dir)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        return sync_fd(fd, primitive=primitive)
    finally:
        os.close(fd)


def order_fd(fd):
    """A step of a durable save: what was written to fd reaches the disk
    before anything written after it (F_BARRIERFSYNC on macOS; elsewhere
    fsync, which also makes it durable).  The save's last step is a
    sync_dir, which makes every step before it durable."""
    return sync_fd(fd, primitive=STEP_PRIMITIVE)


def order_dir(path):
    """order_fd of the directory at path: a rename or link in it, ordered."""
    return sync_dir(path, primitive=STEP_PRIMITIVE)


def filesystem_bytes(path):
    """The size in bytes of the filesystem that holds path (not its free space)."""
    return shutil.disk_usage(path).total


def make_dir(path, durable):
    """Creates the directory at path and every missing one above it (0700),
    like os.makedirs; with durable, syncs the directory each new one was
    made in, so that a power cut cannot take away a directory that durable
    saves went into.

    Raises:
        FileExistsError: path exists.
    """
    created = []
    p = os.path.abspath(path)
    while not os.path.lexists(p) and p != os.path.dirname(p):
        created.append(p)
        p = os.path.dirname(p)
    os.makedirs(path, mode=0o700, exist_ok=False)
    if durable:
        for d in reversed(created):
            sync_dir(os.path.dirname(d))


def same_file(path, st):
    """True while path names the file stat'ed as st (not a newer one, not a symlink)."""
    try:
        now = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return (now.st_ino, now.st_dev) == (st.st_ino, st.st_dev)


# ---- changing or removing the file one opened ---------------------------------

def unlink_if_same(path, st):
    """Unlinks path only if it is still the file stat'ed as st; True when it did."""
    if not same_file(path, st):
        return False
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True


def move_aside(path, qdir):
    """Renames path into the directory qdir, never through a symlink at qdir.

    The file holds prompt text: a symlink planted as the quarantine would
    move it out of the store's 0700 directory.  Raises OSError (ELOOP for a
    symlink) instead.
    """
    qfd = os.open(qdir, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _SAFE)
    try:
        os.rename(path, os.path.basename(path), dst_dir_fd=qfd)
    finally:
        os.close(qfd)


def quarantine(path, directory):
    """Moves path into <directory>/.quarantine (created 0700); OSError if it cannot."""
    qdir = os.path.join(directory, QUARANTINE_DIR)
    os.makedirs(qdir, mode=0o700, exist_ok=True)
    move_aside(path, qdir)


def record_hit(path, st, hits, fd=None):
    """hits + 1 and last_used = now on the file at path if it is still the one
    stat'ed as st (open by the caller, so its inode is not reused), through
    fd when the caller holds it open for writing.

    Returns the new hit count, or hits when the name is gone or holds another
    file (deleted or replaced meanwhile: the load stands, uncounted).
    """
    own = fd is None
    try:
        fd, now = open_checkpoint(path, RDWR_FLAGS) if own else (fd, os.lstat(path))
        try:
            same = (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino)
            return _native.touch_fd(fd, int(time.time()), path) if same else hits
        finally:
            if own:
                os.close(fd)
    except (OSError, KVStoreError):
        return hits


def overwrite(path):
    """Zeroes a file in place and syncs it; returns its stat, or None if it cannot be opened."""
    try:
        fd, st = open_checkpoint(path, RDWR_FLAGS)
    except KVStoreError:
        return None
    try:
        zero = bytes(min(WIPE_BLOCK, st.st_size))
        for off in range(0, st.st_size, WIPE_BLOCK):
            os.pwrite(fd, zero[:min(WIPE_BLOCK, st.st_size - off)], off)
        sync_fd(fd)
    finally:
        os.close(fd)
    return st


def wipe_file(path):
    """Overwrites then unlinks one file (a checkpoint, a bad envelope, a quarantined file).

    Symlinks are refused, and the name is unlinked only if it is still the
    file that was overwritten.

    Returns:
        True when the file was wiped.
    """
    st = overwrite(path)
    return st is not None and unlink_if_same(path, st)


# ---- checking a file ------------------------------------------------------------

def crc_range(fd, offset, length, path=None, buf=None, progress=None):
    """CRC32C of length bytes of fd at offset, read through one bounded buffer.

    Args:
        buf: a reusable bytearray (default: one of at most VERIFY_CHUNK bytes).
        progress: optional callable(nbytes), called as bytes are read.
    """
    if buf is None:
        buf = bytearray(min(VERIFY_CHUNK, max(length, 1)))
    mv = memoryview(buf)
    crc = 0
    for at in range(0, length, len(buf)):
        k = min(len(buf), length - at)
        crc = _native.pread_into(fd, mv[:k], offset + at, path, crc)
        if progress is not None:
            progress(k)
    return crc


def verify_file(path, progress=None, name=None):
    """Checks one checkpoint file as a load would, without keeping any array.

    Checked: the envelope, the stored text against the file name, the
    payload header and manifest, and the CRC32C of the token block and of
    every tensor.  A chain block's name is the digest of its whole text, so
    its chain is walked (in the same directory): every parent must be there,
    end where the block starts, and their text segments and its own must
    hash to its name.  Blocks stream through one reused buffer of VERIFY_CHUNK
    bytes, so memory stays bounded whatever the file size.  A file whose
    payload ABI this build cannot load is a valid envelope: its payload is
    not checked.  The trailer is not checked either: a section whose CRC
    fails is dropped on load and the checkpoint stays usable.

    Args:
        path: the .kv file.
        progress: optional callable(nbytes), called as bytes are read.
        name: the checkpoint name to check the text against, for a file not
            (yet) under its name (a download in a temporary file).

    Returns:
        None when the file is sound, else a one-line reason such as
        ``"crc: tensor 'k.0' CRC mismatch"`` (never prompt text).

    Raises:
        CheckpointMissing: the file does not exist (or vanished meanwhile).
    """
    try:
        fd, st = open_checkpoint(path)
    except CheckpointMissing:
        raise
    except CheckpointOSError as e:
        return describe_error(e)
    try:
        e = entry_from_fd(fd, st, path if name is None else os.path.join(os.path.dirname(path), name))
        if progress is not None:
            progress(PREFIX_SIZE)
        return _check_contents(fd, e, os.path.dirname(path), progress)
    except CheckpointMissing:
        raise
    except (KVStoreError, OSError) as err:
        return describe_error(err)
    finally:
        os.close(fd)


def _check_contents(fd, e, directory, progress):
    """verify_file past the envelope: the text against the name, then every CRC; None or the reason."""
    if not e.loadable:
        return None
    mv = memoryview(bytearray(min(VERIFY_CHUNK, max(e.segment_bytes, e.payload_bytes, 1))))
    manifest = payload.read_manifest(fd, e)
    h, why = _name_hasher(e, manifest.model)
    if why is None and e.is_block and e.parent:
        why = _hash_ancestors(directory, e, h, mv)
    if why is not None:
        return why
    for off in range(0, e.segment_bytes, len(mv)):
        k = min(len(mv), e.segment_bytes - off)
        _native.pread_into(fd, mv[:k], PREFIX_SIZE + off, e.path)
        h.update(mv[:k])
        if progress is not None:
            progress(k)
    if e.sha and h.hexdigest() != e.sha:
        return "text_hash: stored text does not hash to the file name"
    blocks = [(manifest.tokens[0], 4 * e.stored_tokens, manifest.tokens[2], "tokens")]
    blocks += [(off, manifest.packed[tname][0] if tname in manifest.packed else n, crc, f"tensor {tname!r}")
               for tname, _, _, off, n, crc in manifest.tensors]          # a packed block: its stored bytes
    for off, n, want, what in blocks:
        if crc_range(fd, e.tensors_offset + off, n, e.path, mv, progress) != want:
            return f"crc: {what} CRC mismatch"
    return None


def _name_hasher(entry, model):
    """(a SHA1 stream that gives entry's name from its text, None), or (None,
    the one-line reason the file's model is not what its header says).

    A file that names its model (header tag) is named in that model's
    namespace, and its manifest carries the identity (docs/semantics.md §17).
    """
    if not entry.model_tag:
        return hashlib.sha1(), None
    if model is None:
        return None, "model_mismatch: the header names a model, the manifest none"
    ident = ModelIdentity(model)
    if ident.tag != entry.model_tag:
        return None, "model_mismatch: the manifest names another model than the header"
    return names.hasher(ident.names), None


class BrokenChain(Exception):
    """The walk up a chain (ancestors) stopped at child's parent: missing or
    unreadable (error: the exception) or not linking to child (error None)."""

    def __init__(self, child, error):
        super().__init__(f"parent {child.parent[:12]} of {child.sha[:12]}")
        self.child, self.name, self.error = child, child.parent, error

    def describe(self):
        """The one-line reason, as kvstore verify says it."""
        if isinstance(self.error, CheckpointMissing):
            return f"broken_chain: parent {self.name[:12]} is missing"
        if self.error is not None:
            return f"broken_chain: parent {self.name[:12]}: {describe_error(self.error)}"
        return f"broken_chain: parent {self.name[:12]} does not end where its child starts"


def ancestors(entry, directory, limit=1 << 20, linked=True):
    """The blocks entry's chain continues from, read from directory, nearest
    first, each checked to link to its child (forest.chain_link_ok; with
    linked=False not: a sealed file's envelope hides the token digests the
    check compares): the one walk up a chain on disk.

    Raises:
        BrokenChain: where the chain breaks (at the latest after limit blocks).
    """
    cur, n = entry, 0
    while cur.is_block and cur.parent:
        try:
            parent = read_entry(os.path.join(directory, cur.parent + ".kv"))
        except (KVStoreError, OSError) as err:
            raise BrokenChain(cur, err) from None
        if (linked and not chain_link_ok(cur, parent)) or n > limit:
            raise BrokenChain(cur, None)
        yield parent
        cur, n = parent, n + 1


def _hash_ancestors(directory, entry, h, mv):
    """Feeds the text segments of entry's ancestors, first block first, into h.

    Returns None, or the one-line reason the chain is broken.
    """
    try:
        chain = list(ancestors(entry, directory))
    except BrokenChain as broken:
        return broken.describe()
    for p in reversed(chain):
        try:
            fd, _ = open_checkpoint(p.path)
        except KVStoreError as err:
            return f"broken_chain: parent {p.sha[:12]}: {describe_error(err)}"
        try:
            for off in range(0, p.segment_bytes, len(mv)):
                k = min(len(mv), p.segment_bytes - off)
                _native.pread_into(fd, mv[:k], PREFIX_SIZE + off, p.path)
                h.update(mv[:k])
        finally:
            os.close(fd)
    return None


def scan_directory(directory):
    """Reads every envelope of a directory without opening a store (which evicts).

    Returns:
        (valid entries sorted by name, [(name, one-line reason)] for files
        named like checkpoints whose envelope is bad).
    """
    entries, bad = [], []
    for name in checkpoint_names(directory):
        try:
            entries.append(read_entry(os.path.join(directory, name)))
        except CheckpointMissing:
            continue                    # deleted while we listed
        except (KVStoreError, OSError) as e:
            bad.append((name, describe_error(e)))
    return entries, bad


def checkpoint_names(directory):
    """The names in directory that look like checkpoints, sorted."""
    with os.scandir(directory) as it:
        return sorted(de.name for de in it if is_checkpoint_name(de.name))


__all__ = ["TempFile", "write_checkpoint", "write_image", "image_size", "sync_fd", "sync_dir", "sync_primitive", "sync_fallbacks", "SYNC_PRIMITIVE", "same_file", "unlink_if_same", "move_aside", "quarantine",
           "record_hit", "overwrite", "wipe_file", "crc_range", "verify_file", "scan_directory",
           "checkpoint_names", "short_name", "describe_error", "make_dir", "ancestors", "BrokenChain",
           "QUARANTINE_DIR", "CREATE_FLAGS", "RDWR_FLAGS", "READ_FLAGS"]
