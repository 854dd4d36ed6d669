"""Writing a sealed file: SealingSink, which encrypts a plain image chunk by chunk, and stage_sealed.

A save encrypts each chunk as soon as the plain writer (publish.write_image)
has written its last byte, straight from the writer's buffers, on an I/O
thread; nothing plain is ever written to a file, and only a few chunks of
plain bytes are in memory at a time.
"""

import collections
import os

import numpy as np

from kvstore import _native, host, payload, publish
from kvstore.format import PREFIX_SIZE, entry_from_fd
from kvstore.seal.cipher import encrypt_pieces
from kvstore.seal.layout import (BODY_OFFSET, CHUNK_BYTES, FILE_ID_BYTES, TAG_BYTES, Grid, chunk_aad, chunk_nonce,
                                 clear_heads, file_aad, sealed_size, tags_offset)


def stage_sealed(sealer, path, header, text, plan, trailer_raw=b"", head=b"", lookup_tag=b""):
    """publish.stage_checkpoint, sealed: the plain bytes go to a SealingSink,
    which encrypts each chunk as soon as the writer has passed it and
    writes it on an I/O thread.

    Args:
        sealer: the kvstore.seal.Sealer of the key (its key_id and file_key).
        header, head: the plain file's (ABI 16 or 17; a block's chain
            header names its parent by its keyed name).
        lookup_tag: the name's (kvstore.names.names_of; b"": none, found by
            its name alone).
        The rest: as publish.stage_checkpoint.

    Returns:
        the TempFile, its ``entry`` the new file's Entry (ABI 48 or 49).
    """
    body = publish.image_size(text, plan, trailer_raw) - PREFIX_SIZE
    data_start = plan.payload_start + plan.data_offset - PREFIX_SIZE      # in the body
    grid = Grid.for_data_at(body, data_start)
    file_id = os.urandom(FILE_ID_BYTES)
    total = sealed_size(grid)
    prefix, clear = clear_heads(header, len(text), grid, sealer.key_id, file_id, head, lookup_tag)
    aad = file_aad(path, prefix, clear)
    tmp = publish.TempFile(path)
    try:
        host.preallocate(tmp.fd, total, tmp.path)
        _native.pwrite_from(tmp.fd, prefix + clear, 0, tmp.path)
        sink = SealingSink(sealer.file_key(file_id), aad, tmp.fd, tmp.path, grid, data_start)
        try:
            # No CRCs: the tags check every byte (docs/format.md §16).
            publish.write_image(sink, tmp.path, header, text, plan, trailer_raw, head, crc=False)
            sink.finish()
        finally:
            sink.wait()
        _native.pwrite_from(tmp.fd, sink.tags, tags_offset(grid), tmp.path)
        os.ftruncate(tmp.fd, total)
        tmp.entry = entry_from_fd(tmp.fd, os.fstat(tmp.fd), path)
    except BaseException:
        tmp.close()
        raise
    return tmp


def seal_chunk(key, aad, i, chunks, pieces, out, tags):
    """Encrypts chunk i into out: its plain bytes are pieces, (offset,
    memoryview) in order, with zeros between them and after the last.
    Fills the chunk's tag in tags (an I/O thread's job)."""
    tags[TAG_BYTES * i:TAG_BYTES * (i + 1)] = encrypt_pieces(key, chunk_nonce(i), chunk_aad(aad, i, chunks),
                                                             pieces, out)


class SealingSink:
    """Where publish.write_image writes a sealed file's plain bytes
    (payload.pwrite_from's method), at plain-file offsets.

    The writer goes forward through the tensor data, so once a write reaches
    a chunk's end (or starts past it), that chunk has all its bytes: an I/O
    thread then encrypts it straight from the writer's buffers (the pieces
    recorded for it, zeros between them) into a chunk buffer and keeps its
    tag, while the writer
    goes on (cryptography releases the GIL while OpenSSL runs).  The
    writer's thread writes the encrypted chunks to the sealed file in order,
    as they come back: the kernel takes one buffered writer of a file at a
    time, so writes from the I/O threads would only queue on each other and
    hold up the encryption.  The chunks below ``held`` (the text and the
    manifest, whose CRCs are written last) are copied into buffers and wait
    for finish().  At most IN_FLIGHT chunks are queued at once.

    Args:
        key, aad: the file's AES key and common AAD.
        fd, path: the sealed file being written.
        grid: the body's chunks (Grid.for_data_at data_start).
        data_start: the body offset where the tensor data starts: the
            chunks below it (the text, a block's chain header and the
            manifest) are held.
    """

    IN_FLIGHT = 2 * payload.IO_THREADS + 2

    def __init__(self, key, aad, fd, path, grid, data_start):
        self.key, self.aad, self.fd, self.path, self.grid = key, aad, fd, path, grid
        self.body, self.chunks = grid.body, grid.count
        self.held = grid.of(data_start)
        self.next = self.held          # chunks [held, next) are queued
        self.staged = {}               # held chunk -> its bytes (numpy uint8, zero-filled)
        self.pieces = {}               # chunk >= held -> [(offset in chunk, memoryview)]
        self.jobs = collections.deque()
        self.spare = []
        self.tags = bytearray(TAG_BYTES * self.chunks)

    def pwrite_pieces(self, bufs, offset, path=None):
        for b in bufs:
            mv = payload.bytes_view(b)
            self.pwrite_from(mv, offset, path)
            offset += mv.nbytes

    def pwrite_from(self, buf, offset, path=None):
        mv = payload.bytes_view(buf)
        lo = offset - PREFIX_SIZE
        if lo < 0:                     # the prefix is written in the clear, by the caller
            mv, lo = mv[-lo:], 0
        hi = lo + mv.nbytes
        if hi > self.body:
            raise ValueError(f"write of {mv.nbytes} bytes at {offset} passes the body ({self.body} bytes)")
        if lo == hi:
            return
        grid = self.grid
        self._queue_below(grid.of(lo))
        for i in grid.covering(lo, hi):
            c0, c1 = grid.span(i)
            a, b = max(lo, c0), min(hi, c1)
            part = mv[a - lo:b - lo]
            if i < self.held:
                self._staged(i)[a - c0:b - c0] = np.frombuffer(part, dtype=np.uint8)
                continue
            if i < self.next:
                raise RuntimeError(f"write behind sealed chunk {i}")
            pieces = self.pieces.setdefault(i, [])
            if pieces and pieces[-1][0] + pieces[-1][1].nbytes > a - c0:
                raise RuntimeError(f"write at {offset} goes back inside chunk {i}")
            pieces.append((a - c0, part))
        # The chunks this write completes go now, while the writer goes on.
        self._queue_below(grid.of(hi))

    def reserve(self, size, path=None):
        """The Source protocol's preallocation: the sealed file is sized by its writer."""

    def set_size(self, size):
        """The Source protocol's final size: the sealed file's is set when it is written."""

    def finish(self):
        """Queues every chunk not queued yet, the held ones last, and waits for them."""
        self._queue_below(self.chunks)
        for i in range(self.held):
            c0, c1 = self.grid.span(i)
            self._queue(i, [(0, memoryview(self._staged(i))[:c1 - c0])])
        self.staged.clear()
        self.wait()

    def wait(self):
        """Waits for every queued chunk and writes it (none after a failure);
        raises the first error."""
        error = None
        while self.jobs:
            try:
                self._write_oldest(write=error is None)
            except Exception as e:
                error = error or e
        if error is not None:
            raise error

    def _write_oldest(self, write=True):
        """Waits for the oldest queued chunk and writes it to the sealed file."""
        job, i, out, n = self.jobs.popleft()
        job.result()
        if write:
            _native.pwrite_from(self.fd, memoryview(out)[:n], BODY_OFFSET + self.grid.span(i)[0], self.path)
        self.spare.append(out)

    def _staged(self, i):
        buf = self.staged.get(i)
        if buf is None:
            buf = self.staged[i] = np.zeros(CHUNK_BYTES, dtype=np.uint8)
        return buf

    def _queue_below(self, k):
        while self.next < min(k, self.chunks):
            self._queue(self.next, self.pieces.pop(self.next, []))
            self.next += 1

    def _queue(self, i, pieces):
        while len(self.jobs) >= self.IN_FLIGHT:
            self._write_oldest()
        out = self.spare.pop() if self.spare else bytearray(CHUNK_BYTES)
        c0, c1 = self.grid.span(i)
        n = c1 - c0
        self.jobs.append((payload.io_pool().submit(seal_chunk, self.key, self.aad, i, self.chunks, pieces,
                                                   memoryview(out)[:n], self.tags), i, out, n))
