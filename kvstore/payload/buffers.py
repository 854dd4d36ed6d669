"""A payload's byte sources: flat views of arrays, and positioned reads and writes.

A source is a file descriptor, or an object with the same methods (a sealed
file's authenticated plain view, kvstore.seal.SealedSource; the in-memory
image kvstore.seal encrypts before anything reaches the disk);
kvstore.sources.as_source tells them apart.
"""

import threading

from kvstore.sources import as_source

_local = threading.local()


def bytes_view(buf):
    """buf's bytes as one flat memoryview (format "B", 1-D) of its memory."""
    mv = memoryview(buf)
    if mv.nbytes == 0:
        # cast() refuses a shape with a zero in it (an MLX array of shape
        # (0, 4)); an empty block has no bytes to move either way.
        return memoryview(bytearray())
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")


def pread_into(src, buf, offset, path=None, crc=None):
    """Fills buf from src at offset: src is a file descriptor, or an object
    with the same pread_into method (a sealed file's authenticated plain
    view, kvstore.seal.SealedSource).  Returns the CRC as _native.pread_into."""
    return as_source(src).pread_into(buf, offset, path, crc)


def pwrite_from(dst, buf, offset, path=None):
    """Writes buf to dst at offset: dst is a file descriptor, or an object
    with the same pwrite_from method (the in-memory image kvstore.seal
    encrypts before anything reaches the disk)."""
    return as_source(dst).pwrite_from(buf, offset, path)


def pwrite_pieces(dst, bufs, offset, path=None):
    """Writes the buffers one after another from offset (pwrite_from's dst)."""
    return as_source(dst).pwrite_pieces(bufs, offset, path)


def pread(src, n, offset):
    """os.pread for a file descriptor or a source with pread_into."""
    return as_source(src).pread(n, offset)


def thread_scratch(slot, n):
    """n bytes of this thread's scratch buffer named slot, kept for its next
    use (a chain load decrypts or unpacks hundreds of blocks, and a fresh
    zeroed MiB each is a cost of its own); buffers of different slots never
    overlap."""
    buf = getattr(_local, slot, None)
    if buf is None or len(buf) < n:
        buf = memoryview(bytearray(n))
        setattr(_local, slot, buf)
    return buf[:n]

