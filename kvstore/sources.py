"""A file's bytes, plain or sealed, behind one small protocol (the Source).

The readers and writers of the payload take a Source, never a bare file
descriptor: FdSource over a plain file, kvstore.seal.SealedSource over a
sealed file's authenticated plain view, and the sealing sink that collects
a file's image before it is encrypted.  A Source offers:

    pread(n, offset) -> bytes
    pread_into(buf, offset, path=None, crc=None) -> crc     (as _native.pread_into)
    read_pieces(buffers, pieces, verify=False)              (as _native.pread_pieces)
    pwrite_from(buf, offset, path=None)                     (writers)
    pwrite_pieces(buffers, offset, path=None)               one after another, from offset
    reserve(size, path=None)   all of a new file's blocks at once (or nothing)
    set_size(size)             the file's final size (or nothing)
    close()                    what the Source itself opened (FdSource: its descriptor)
    any_thread                 True when its positioned writes may come from any thread
                               (a plain file's: a save's bytes then move on the I/O threads)
    sealed                     True when its reads decrypt and authenticate (whole
                               chunks, the tags vouch: no CRCs, no kernel read-ahead)

as_source() is the one place that tells a descriptor from a Source, and
sealed() the one that asks whether reads of it are a sealed file's.
"""

import os

from kvstore import _native, host

_pwritev = getattr(os, "pwritev", None)
_IOV_MAX = 1024                 # POSIX's minimum for IOV_MAX is 16; Linux and macOS allow 1024


class FdSource:
    """The Source of a plain file, through its descriptor."""

    __slots__ = ("fd",)

    # A plain file's positioned writes may come from any thread: a save hands
    # its blocks' bytes to the payload I/O threads (kvstore.payload.plan).
    any_thread = True
    sealed = False

    def __init__(self, fd):
        self.fd = fd

    def pread(self, n, offset):
        return os.pread(self.fd, n, offset)

    def pread_into(self, buf, offset, path=None, crc=None):
        return _native.pread_into(self.fd, buf, offset, path, crc)

    read_pieces = staticmethod(_native.pread_pieces)

    def pwrite_from(self, buf, offset, path=None):
        return _native.pwrite_from(self.fd, buf, offset, path)

    def pwrite_pieces(self, bufs, offset, path=None):
        # One vectored write per IOV_MAX buffers where the platform has it
        # (Linux, macOS 11+); what a short write leaves goes one by one.
        for i in range(0, len(bufs), _IOV_MAX):
            group = bufs[i:i + _IOV_MAX]
            done = 0
            if _pwritev is not None:
                try:
                    done = _pwritev(self.fd, group, offset)
                except OSError as e:
                    _native.raise_status(-(e.errno or 5), path if path is not None else f"fd {self.fd}", "write")
            for b in group:
                n = memoryview(b).nbytes
                if done < n:
                    _native.pwrite_from(self.fd, memoryview(b).cast("B")[done:], offset + done, path)
                done = max(0, done - n)
                offset += n

    def pwrite_blocks(self, blocks, path=None, crc=True):
        return _native.pwrite_blocks(self.fd, blocks, path if path is not None else f"fd {self.fd}", crc)

    def reserve(self, size, path=None):
        # All blocks at once: faster writes, and a disk without room fails here.
        host.preallocate(self.fd, size, path)

    def set_size(self, size):
        os.ftruncate(self.fd, size)

    def close(self):
        os.close(self.fd)


def as_source(x):
    """x as a Source: a file descriptor (an int) in an FdSource, any Source as it is."""
    return FdSource(x) if type(x) is int else x


def sealed(x):
    """Whether x (a descriptor or a Source) reads a sealed file's plain view."""
    return as_source(x).sealed
