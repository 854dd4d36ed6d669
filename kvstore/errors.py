"""Exceptions raised by kvstore.

Every error is a :class:`KVStoreError`; each also inherits the builtin it
narrows, so ``except ValueError`` or ``except OSError`` keeps working.
"""

import errno as _errno
import os


class KVStoreError(Exception):
    """Base class of every kvstore error."""


class CorruptCheckpoint(KVStoreError, ValueError):
    """A file is not a valid checkpoint: bad magic, bad lengths, CRC mismatch.

    Attributes:
        path: the file, or None for an in-memory buffer.
        reason: a short key=value-friendly reason such as ``bad_magic``.
        detail: what exactly is wrong, without the path ("" when none).
    """

    def __init__(self, reason, path=None, detail=""):
        self.reason = reason
        self.detail = detail
        self.path = None if path is None else os.fspath(path)
        where = f"{self.path}: " if self.path is not None else ""
        super().__init__(f"{where}corrupt checkpoint ({reason}){': ' + detail if detail else ''}")


class BadKey(KVStoreError, ValueError):
    """A store key that cannot be used: not 32 bytes, or a key file that
    others may read or write (the message names the path and the problem)."""


class CheckpointOSError(KVStoreError, OSError):
    """An operating-system error on a checkpoint file or the store directory."""


class CheckpointMissing(CheckpointOSError, FileNotFoundError):
    """The checkpoint file does not exist (or vanished under a concurrent delete)."""


class UnsafePath(CheckpointOSError):
    """A path that kvstore refuses to use: a symlink, a directory, a device."""


class StoreClosed(KVStoreError, RuntimeError):
    """An operation on a KVStore after close()."""


class SessionNotFound(KVStoreError, LookupError):
    """No agent session has this hash prefix (or it cannot be loaded here)."""


class AmbiguousSession(KVStoreError, LookupError):
    """More than one agent session starts with this hash prefix.

    Attributes:
        matches: the full hashes that share the prefix.
    """

    def __init__(self, message, matches=()):
        self.matches = tuple(matches)
        super().__init__(message)


class PinRefused(KVStoreError, ValueError):
    """A pin the store will not grant (kvstore.pins).

    Attributes:
        reason: "not_stored" (no checkpoint holds exactly that prefix),
            "too_short" (the prefix is shorter than a checkpoint may be) or
            "share" (pinned bytes would pass the budget's pinned share).
    """

    def __init__(self, reason, message):
        self.reason = reason
        super().__init__(message)


class RemoteError(KVStoreError, OSError):
    """A remote-tier call failed in a way the caller must hear of (CLI, gc)."""


def os_error(err, path, what):
    """Builds the kvstore exception for an errno from an operation on path."""
    path = os.fspath(path)
    if err == _errno.ENOENT:
        cls = CheckpointMissing
    elif err in (_errno.ELOOP, _errno.EISDIR):
        cls = UnsafePath
    else:
        cls = CheckpointOSError
    msg = os.strerror(err)
    if err == _errno.ELOOP:
        msg = "is a symlink; kvstore does not follow symlinks"
    return cls(err, f"{what}: {msg}", path)
