"""Reads of one whole payload (an ABI 16 file): the token ids, the tensors into NumPy,
and the payload's tensor data seen as a safetensors file for mx.load.

Reading streams every block straight into its destination array and checks
its CRC as it lands; nothing reads the payload into an intermediate buffer.
For MLX the destination arrays are allocated by mx.load itself: the reader
presents the payload to mx.load as a virtual safetensors file (VirtualBlob)
whose readinto() calls land, in parallel chunks with the GIL released, in
the new arrays' own memory (see bench/README.md for why this beats
zero-fill-then-read); kvstore.payload.mlx_io drives it.
"""

import io
import json
import struct

import numpy as np

from kvstore import _native
from kvstore.payload.buffers import bytes_view, pread_into
from kvstore.payload.manifest import numpy_dtype
from kvstore.payload.pool import check_crc, join_slices, read_block, submit_slices
from kvstore.sources import sealed


def read_tokens(fd, entry, manifest, verify=True):
    """The token ids as a numpy uint32 array, CRC-checked."""
    off, n, crc = manifest.tokens
    out = np.empty(n // 4, dtype="<u4")
    got = read_block(fd, out.view(np.uint8), entry.tensors_offset + off, entry.path, verify)
    check_crc(got, crc, entry.path, "tokens")
    return out.astype(np.uint32, copy=False)


def read_tensors_numpy(fd, entry, manifest, verify=True):
    """Every tensor as a numpy array (bfloat16 as its uint16 bit pattern).

    The reads of every tensor are queued at once (parallel slices, CRC'd as
    they land), then joined: no tensor waits for the previous one.
    """
    out, pending = {}, []
    crc0 = 0 if verify else None
    for name, dtype, shape, off, n, crc in manifest.tensors:
        a = np.empty(shape, dtype=numpy_dtype(dtype))
        if n:
            jobs = submit_slices(pread_into, fd, bytes_view(a.reshape(-1).view(np.uint8)),
                                 entry.tensors_offset + off, entry.path, crc0)
            pending.append((name, crc, jobs))
        out[name] = a
    error = None
    for name, crc, jobs in pending:          # every job joined, even after a failure
        try:
            check_crc(join_slices(jobs, crc0), crc, entry.path, f"tensor {name!r}")
        except Exception as e:
            error = error or e
    if error is not None:
        raise error
    return out


def safetensors_head(nbytes):
    """The header of a safetensors file that holds one uint8 array "blob" of nbytes."""
    header = {"blob": {"dtype": "U8", "shape": [nbytes], "data_offsets": [0, nbytes]}}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


class VirtualBlob(io.RawIOBase):
    """The payload's tensor data seen as a safetensors file of one uint8 blob, for mx.load.

    mx.load allocates the blob (no fill) and calls readinto() with the new
    array's own memory.  In deferred mode this object queues the parallel
    preads of every tensor at once (each slice CRC'd as it lands, into the
    blob at the tensor's offset) and returns, so MLX's bookkeeping and the
    reads overlap and Python is entered once per load, not once per tensor;
    the tensors are then views of the blob (no copy).  wait() joins the
    reads and checks every CRC; the caller checks that the buffer MLX handed
    over is the blob's final memory.  A read that is not the whole blob in
    one call is served at once, without CRCs: the caller then checks every
    tensor's CRC from the blob after the load.

    Args:
        tensors: manifest rows of the tensors to read (none empty).
        lo, hi: the payload-relative byte range the blob covers.
    """

    def __init__(self, fd, entry, tensors, lo, hi, verify, defer):
        self.fd, self.entry, self.tensors, self.lo, self.verify, self.defer = fd, entry, tensors, lo, verify, defer
        self.head = safetensors_head(hi - lo)
        self.size = len(self.head) + hi - lo
        self.pos = 0
        self.partial = False      # data read other than whole-in-one-call: CRCs checked after
        self.pending = []         # (name, crc, jobs)
        self.address = None       # of the buffer the deferred reads go into
        self.error = None

    def readable(self):
        return True

    def seekable(self):
        return True

    def seek(self, pos, whence=0):
        self.pos = pos if whence == 0 else self.pos + pos if whence == 1 else self.size + pos
        return self.pos

    def tell(self):
        return self.pos

    def readinto(self, b):
        mv = bytes_view(b)
        n, done = mv.nbytes, 0
        try:
            while done < n and self.pos < self.size:
                if self.pos < len(self.head):
                    k = min(n - done, len(self.head) - self.pos)
                    mv[done:done + k] = self.head[self.pos:self.pos + k]
                elif self.defer and done == 0 and self.pos == len(self.head) and n == self.size - self.pos:
                    k = self._queue_all(mv)
                else:
                    k = self._read_now(mv[done:], self.pos - len(self.head))
                self.pos += k
                done += k
        except Exception as e:      # mx.load would mask it: keep it
            self.error = self.error or e
            raise
        return done

    def _queue_all(self, mv):
        crc0 = 0 if self.verify else None
        if sealed(self.fd):
            # A sealed file's view decrypts whole chunks: one read of the
            # blob's range (its tags vouch for every byte; no CRCs).
            self.pending.append(("blob", None, submit_slices(pread_into, self.fd, mv,
                                                             self.entry.tensors_offset + self.lo,
                                                             self.entry.path, None)))
            self.address = _native.buffer_address(mv)
            return mv.nbytes
        for name, dtype, shape, off, n, crc in self.tensors:
            at = off - self.lo
            jobs = submit_slices(_native.pread_into, self.fd, mv[at:at + n], self.entry.tensors_offset + off,
                                 self.entry.path, crc0)
            self.pending.append((name, crc, jobs))
        self.address = _native.buffer_address(mv)
        return mv.nbytes

    def _read_now(self, mv, rel):
        k = min(mv.nbytes, self.size - len(self.head) - rel)
        read_block(self.fd, mv[:k], self.entry.tensors_offset + self.lo + rel, self.entry.path, False)
        self.partial = True
        return k

    def wait(self):
        """Joins the deferred reads; raises the first failure."""
        for name, crc, jobs in self.pending:
            try:
                got = join_slices(jobs, 0 if self.verify else None)
                check_crc(got, crc, self.entry.path, f"tensor {name!r}")
            except Exception as e:
                self.error = self.error or e
        if self.error is not None:
            raise self.error
