"""The store key: reading and making key files, and the keys derived from it.

One 32-byte key per store, in a file only its owner may read or write.
Every key a sealed store uses is derived from it with HKDF-SHA256, one label
per purpose: the contents key (and from it one AES key per file, salted by
the file's random id), the name key (HMAC-SHA1 names, per model), and the
key id, which a sealed file carries in the clear so that a store knows its
own files without trying to decrypt them.
"""

import errno
import hmac
import os
import stat

from kvstore import files
from kvstore.errors import BadKey
from kvstore.seal.cipher import derive_key

KEY_BYTES = 32
KEY_ID_BYTES = 8

# HKDF labels: one key per purpose from the one store key.
_CONTENT_INFO = b"kvstore seal v1 contents"
_NAME_INFO = b"kvstore seal v1 names"
_FILE_INFO = b"kvstore seal v1 file"
_KEY_ID_MSG = b"kvstore key id"

_KEY_OPEN = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0)
_KEY_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


def load_key(value):
    """The 32 raw key bytes from bytes or from a key file.

    Args:
        value: 32 bytes, or the path of a file of exactly 32 bytes that only
            its owner may read or write (mode 0600 or 0400).

    Returns:
        bytes.

    Raises:
        BadKey (a ValueError): wrong length, a file others may read or write,
            a symlink or not a regular file; the message names the path.
        OSError: the file cannot be opened.
    """
    if isinstance(value, (bytes, bytearray, memoryview)):
        raw = bytes(value)
        if len(raw) != KEY_BYTES:
            raise BadKey(f"a store key is {KEY_BYTES} bytes, not {len(raw)}")
        return raw
    path = os.fspath(value)
    try:
        fd = os.open(path, _KEY_OPEN)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise BadKey(f"key file {path} is a symlink; give the file itself") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise BadKey(f"key file {path} is not a regular file")
        mode = stat.S_IMODE(st.st_mode)
        if mode & 0o077:
            who = "group" if mode & 0o070 else "world"
            how = "readable" if mode & 0o044 else "writable"
            raise BadKey(f"key file {path} is {who}-{how} (mode {mode:04o}); chmod 600 it")
        if st.st_size != KEY_BYTES:
            raise BadKey(f"key file {path} is {st.st_size} bytes; a key file holds exactly {KEY_BYTES} "
                         f"(make one with: kvstore key new FILE)")
        raw = os.pread(fd, KEY_BYTES + 1, 0)
    finally:
        os.close(fd)
    if len(raw) != KEY_BYTES:
        raise BadKey(f"key file {path} is {len(raw)} bytes; a key file holds exactly {KEY_BYTES}")
    return raw


def new_key_file(path):
    """Writes a fresh random key (os.urandom) to a new file, mode 0600, synced.

    Raises:
        FileExistsError: path exists (a key is never overwritten: the files
            it sealed would be lost).
    """
    path = os.fspath(path)
    fd = os.open(path, _KEY_CREATE, 0o600)
    try:
        os.fchmod(fd, 0o600)          # whatever the umask
        raw = os.urandom(KEY_BYTES)
        if os.write(fd, raw) != KEY_BYTES:
            raise OSError("short write of the key file")
        files.sync_fd(fd)
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    os.close(fd)
    files.sync_dir(os.path.dirname(os.path.abspath(path)))
    return path


def content_key(key):
    """The key the per-file AES keys are derived from (file_key)."""
    return derive_key(key, _CONTENT_INFO)


def file_key(content, file_id):
    """One file's AES-256 key: HKDF of the contents key, salted by the file's random id."""
    return derive_key(content, _FILE_INFO, salt=file_id)


def names_key(key, identity=None):
    """The HMAC-SHA1 key of the files' names: the key's own without an
    identity (a file that names no model), else one per model
    (kvstore.identity.ModelIdentity), so that two models never share (or
    replace) one file."""
    if identity is None:
        return derive_key(key, _NAME_INFO)
    return derive_key(key, _NAME_INFO + b"\0" + identity.digest)


def key_id(key):
    """The 8-byte key id a sealed file carries in the clear (from the
    model-less names key: it tells keys apart, and reveals nothing of them)."""
    return hmac.digest(names_key(key), _KEY_ID_MSG, "sha256")[:KEY_ID_BYTES]
