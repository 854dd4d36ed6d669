"""Publishing a new file: written under a temporary name, then put in place (docs/semantics.md §6, §11).

- TempFile: a new file under a temporary name, published by rename or
  link (sync the file, put it in place, sync the directory);
- stage_checkpoint / write_checkpoint: one checkpoint file written into a
  TempFile, then published (write_checkpoint does both at once);
- write_image: the bytes of one checkpoint file, into a descriptor or a
  Source (the sealing sink writes through it too).

A chained save stages every block first and has each one's data synced by
the sync threads (TempFile.sync_soon) while it writes the next; it then
publishes them parent first, each linked and its directory synced only
after its own data is on the disk.  The slow part of a durable save, the
disk taking the data, runs while the CPU copies the next block, and the
order that keeps a chain whole after a crash stays what it was.
"""

import concurrent.futures
import errno
import os
import secrets

from kvstore import files, payload, temps
from kvstore.executors import LazyExecutor
from kvstore.format import PREFIX_SIZE, entry_from_fd
from kvstore.sources import as_source

# Data syncs in flight at once: two keep the disk busy while the next block
# is written; more only queue in the kernel.
SYNC_THREADS = 2

# The executor of TempFile.sync_soon (made on first use).
_sync = LazyExecutor(lambda: concurrent.futures.ThreadPoolExecutor(SYNC_THREADS, thread_name_prefix="kvstore-sync"))


# errno values of link() that mean "no hard links here", not "no room".
_NO_LINKS = frozenset(getattr(errno, n) for n in ("EPERM", "ENOTSUP", "EOPNOTSUPP", "EXDEV", "ENOSYS")
                      if hasattr(errno, n))


class TempFile:
    """A new file at ``<final>.tmp.<pid>.<random>`` (0600, created exclusively).

    Use as a context manager: write through ``fd``, then ``publish()``; on
    any exit without a publish the temporary file is removed.  A crash
    leaves only the temporary name, which kvstore.temps clears.  ``entry``
    is for the caller that staged a checkpoint in it (stage_checkpoint).

    Raises:
        OSError: the file cannot be created.
    """

    def __init__(self, final):
        self.final = os.fspath(final)
        self.path = f"{self.final}.tmp.{os.getpid()}.{secrets.token_hex(4)}"
        self.fd = os.open(self.path, files.CREATE_FLAGS, 0o600)
        temps.track(self.path)
        self.published = False
        self.entry = None
        self._synced = None
        try:
            os.fchmod(self.fd, 0o600)       # whatever the umask
        except BaseException:
            self.close()
            raise

    def sync_soon(self):
        """Starts syncing the data written so far on a sync thread; a
        durable publish() then waits for it instead of syncing again.
        Nothing may be written to fd after this call."""
        if self._synced is None:
            self._synced = _sync.get().submit(files.order_fd, self.fd)

    def publish(self, durable, exclusive=False, last=True):
        """Sync the data (durable), put it in place, sync the directory (durable).

        The data's sync is a step of the save (files.order_fd: ordered
        before the name); so is the directory's, unless last.

        Args:
            exclusive: only if no file has the name yet (a hard link, which
                fails on an existing name): the first of two writers of the
                same checkpoint wins.  Where the filesystem has no hard
                links, a rename.
            last: the last file of a durable save: its directory's sync
                makes every step of the save durable (files.sync_dir); a
                chained save's earlier blocks only order theirs
                (files.order_dir: a barrier on macOS).

        Returns:
            True, or False when exclusive and another file had the name.
        """
        if durable:
            self._wait_sync()
        if exclusive:
            try:
                os.link(self.path, self.final)
            except FileExistsError:
                return False
            except OSError as e:
                if e.errno not in _NO_LINKS:
                    raise
                os.rename(self.path, self.final)
            else:
                os.unlink(self.path)
        else:
            os.rename(self.path, self.final)
        self.published = True
        if durable:
            (files.sync_dir if last else files.order_dir)(os.path.dirname(self.final) or ".")
        return True

    def _wait_sync(self):
        if self._synced is None:
            files.order_fd(self.fd)
        else:
            self._synced.result()       # its OSError, if the sync failed

    def close(self):
        if self._synced is not None:
            # The sync thread must be done with fd before it is closed.
            concurrent.futures.wait([self._synced])
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        if not self.published:
            try:
                os.unlink(self.path)
            except OSError:
                pass
        temps.untrack(self.path)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def stage_checkpoint(path, header, text, plan, trailer_raw=b"", head=b""):
    """Writes one checkpoint file under a temporary name, not yet published.

    Args:
        path: the final name.
        header: the format.Header to write.
        text: the text bytes stored in the file (a chain block's segment).
        plan: the payload.Plan (built with head=len(head)).
        trailer_raw: the trailer bytes.
        head: bytes at the payload start before the tensor payload (a chain
            block's chain header).

    Returns:
        the TempFile, its ``entry`` the new file's Entry; the caller
        publishes it (TempFile.publish) and closes it.
    """
    tmp = TempFile(path)
    try:
        write_image(tmp.fd, tmp.path, header, text, plan, trailer_raw, head)
        # Read back before publishing: once visible, the file may be wiped
        # (zeroed) by another process at once.
        tmp.entry = entry_from_fd(tmp.fd, os.fstat(tmp.fd), path)
    except BaseException:
        tmp.close()
        raise
    return tmp


def publish_staged(tmp, durable, exclusive=False):
    """Publishes a staged TempFile and closes it.

    Returns:
        its Entry, or None when exclusive and another file already had the name.
    """
    with tmp:
        return tmp.entry if tmp.publish(durable, exclusive) else None


def write_checkpoint(path, header, text, plan, trailer_raw=b"", head=b"", durable=True, exclusive=False):
    """stage_checkpoint, then publish_staged (durable, exclusive: see TempFile.publish).

    Returns:
        the new file's Entry, or None when exclusive and another file already
        had the name.
    """
    return publish_staged(stage_checkpoint(path, header, text, plan, trailer_raw, head), durable, exclusive)


def image_size(text, plan, trailer_raw=b""):
    """The size of the file write_image writes."""
    return PREFIX_SIZE + len(text) + plan.payload_bytes + len(trailer_raw)


def write_image(fd, path, header, text, plan, trailer_raw=b"", head=b"", crc=True):
    """Writes the bytes of one checkpoint file into fd (a new, empty file),
    or into an object with payload.pwrite_from's method (the sink that
    kvstore.seal encrypts from): what write_checkpoint publishes.

    Args:
        crc: False writes 0 as every payload block's CRC (payload.Plan.write).

    Returns:
        the file size.
    """
    P = PREFIX_SIZE + len(text)
    size = image_size(text, plan, trailer_raw)
    dst = as_source(fd)
    dst.reserve(size, path)
    payload.pwrite_from(fd, header.pack() + len(text).to_bytes(4, "little") + text + head, 0, path)
    plan.write(fd, path, crc)
    if trailer_raw:
        payload.pwrite_from(fd, trailer_raw, P + plan.payload_bytes, path)
    # A zero-byte last block sits at an aligned offset past the last byte
    # written: without a trailer (or the preallocation) the file would end
    # short of payload_bytes and read back as truncated.
    dst.set_size(size)
    return size
