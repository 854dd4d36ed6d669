# cython: language_level=3, boundscheck=False, wraparound=False
"""Bindings over csrc/: buffers in, buffers or exceptions out.

The GIL is released around every loop over bytes.  Status codes from C become
exceptions in exactly one place, :func:`_raise_status`.
"""

import errno as _errno
import os

from cpython.buffer cimport PyBUF_SIMPLE, PyBUF_WRITABLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from cpython.list cimport PyList_New, PyList_SET_ITEM
from cpython.ref cimport Py_INCREF
from libc.stdint cimport int32_t, uint8_t, uint32_t, uint64_t
from libc.stdlib cimport free, malloc
from libc.string cimport memcmp, memset

from kvstore._native cimport *

from kvstore.errors import CorruptCheckpoint, UnsafePath, os_error

kvs_init()

_IMPLS = {"auto": KVS_IMPL_AUTO, "portable": KVS_IMPL_PORTABLE,
          "x86": KVS_IMPL_X86, "avx512": KVS_IMPL_X86_AVX512, "arm": KVS_IMPL_ARM}
# Slowest first: the last name available is the one "auto" picks.
_ORDER = ("portable", "x86", "avx512", "arm")

HEADER_SIZE = KVS_HEADER_SIZE

_REASONS = {
    KVS_EMAGIC: "bad_magic",
    KVS_EVERSION: "bad_version",
    KVS_ETOKENS: "zero_tokens",
    KVS_ETRUNC: "truncated",
    KVS_ESHORT: "truncated",
    KVS_EBADTABLE: "bad_payload",
}


cdef int _raise_status(int rc, object path, str what) except -1:
    """The one place where a csrc status code becomes an exception."""
    if rc == 0:
        return 0
    if rc < 0:
        raise os_error(-rc, path, what)
    if rc == KVS_ENOTREG:
        raise UnsafePath(0, f"{what}: not a regular file", os.fspath(path))
    raise CorruptCheckpoint(_REASONS.get(rc, f"status_{rc}"), path, what)


def select(sha1=None, crc32c=None, table=None, quant=None):
    """Selects the SHA1, CRC32C, table-plane decoder and/or dequantizer implementation.

    Args:
        sha1, crc32c, table, quant: "auto", "portable", "x86" or "arm"; for
            crc32c also "avx512" (x86-64 with VPCLMULQDQ); for table "x86"
            is SSSE3 and "arm" NEON; for quant "x86" is AVX2 (it has no
            "arm": the portable build is NEON there).  None keeps the current.

    Raises:
        ValueError: the name is unknown or that path cannot run on this CPU.
    """
    for name, value in (("sha1", sha1), ("crc32c", crc32c), ("table", table), ("quant", quant)):
        if value is None:
            continue
        if value not in _IMPLS:
            raise ValueError(f"unknown {name} implementation {value!r}; expected one of {sorted(_IMPLS)}")
        impl = _IMPLS[value]
        rc = (kvs_sha1_select(impl) if name == "sha1" else kvs_crc32c_select(impl) if name == "crc32c"
              else kvs_table_select(impl) if name == "table" else kvs_quant_select(impl))
        if rc != 0:
            raise ValueError(f"{name} implementation {value!r} is not available on this machine")


def available():
    """The implementations that can run here: {"sha1": [...], "crc32c": [...], "table": [...], "quant": [...]}."""
    return {
        "sha1": [n for n in _ORDER if kvs_sha1_has(_IMPLS[n])],
        "crc32c": [n for n in _ORDER if kvs_crc32c_has(_IMPLS[n])],
        "table": [n for n in _ORDER if kvs_table_has(_IMPLS[n])],
        "quant": [n for n in _ORDER if kvs_quant_has(_IMPLS[n])],
    }


def implementation():
    """The running implementations, e.g. {"sha1": "sha-ni", "crc32c": "sse4.2", "table": "ssse3", "quant": "avx2"}."""
    return {"sha1": kvs_sha1_impl_name().decode(), "crc32c": kvs_crc32c_impl_name().decode(),
            "table": kvs_table_impl_name().decode(), "quant": kvs_quant_impl_name().decode()}


def read_prefaults():
    """True when reads map each chunk's fresh pages in one call before filling it.

    That is MADV_POPULATE_WRITE (Linux 5.14 and later); elsewhere the read
    faults the pages in one by one.  The bytes read are the same either way.
    """
    return bool(kvs_io_prefaults())


def set_read_prefaults(on):
    """Turns prefaulting on (where the kernel has it) or off; returns read_prefaults().

    For tests and KVSTORE_PORTABLE=1, which turns it off.  Call it while no
    read runs.
    """
    return bool(kvs_io_set_prefault(1 if on else 0))


cdef const kvs_hmac_key *_hmac_key(object key, kvs_hmac_key *k) except? NULL:
    """k set from key's bytes (an HMAC-SHA1 key), or NULL when key is None."""
    cdef Py_buffer view
    if key is None:
        return NULL
    PyObject_GetBuffer(key, &view, PyBUF_SIMPLE)
    try:
        if view.len == 0:
            raise ValueError("an HMAC key of 0 bytes")
        kvs_hmac_sha1_key(k, <const uint8_t *>view.buf, <size_t>view.len)
    finally:
        PyBuffer_Release(&view)
    return k


def sha1(data, key=None, inner=False):
    """SHA1 digest (20 bytes) of any buffer-protocol object; HMAC-SHA1 under key (bytes) when given,
    or with inner=True the HMAC's inner hash SHA1(key ^ ipad || data) (see sha1_prefixes)."""
    if inner:
        return sha1_prefixes(data, [len(memoryview(data).cast("B"))], key, inner=True)[0]
    cdef Py_buffer view
    cdef kvs_hmac_key k
    cdef const kvs_hmac_key *kp = _hmac_key(key, &k)
    cdef bytes out = PyBytes_FromStringAndSize(NULL, 20)
    cdef uint8_t *o = <uint8_t *>PyBytes_AS_STRING(out)
    PyObject_GetBuffer(data, &view, PyBUF_SIMPLE)
    try:
        with nogil:
            if kp == NULL:
                kvs_sha1(<const uint8_t *>view.buf, <size_t>view.len, o)
            else:
                kvs_hmac_sha1(kp, <const uint8_t *>view.buf, <size_t>view.len, o)
    finally:
        PyBuffer_Release(&view)
    return out


# Bytes of a sealed file's lookup tag (csrc/sha1.h: KVS_LOOKUP_TAG).
LOOKUP_TAG = KVS_LOOKUP_TAG


include "_native_lookup.pxi"


def crc32c(data, uint32_t crc=0):
    """CRC32C (Castagnoli) of data, continuing from crc.

    crc32c(b, crc32c(a)) == crc32c(a + b).
    """
    cdef Py_buffer view
    cdef uint32_t r
    PyObject_GetBuffer(data, &view, PyBUF_SIMPLE)
    try:
        with nogil:
            r = kvs_crc32c(crc, <const uint8_t *>view.buf, <size_t>view.len)
    finally:
        PyBuffer_Release(&view)
    return r


def crc32c_combine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b):
    """CRC32C of a + b from crc32c(a), crc32c(b) and len(b)."""
    return kvs_crc32c_combine(crc_a, crc_b, len_b)


def pack_header(int version, int quant_bits, int reason, int ext_flags, int model_id,
                uint32_t tokens, uint32_t hits, uint32_t ctx_size, int payload_abi,
                uint64_t created_at, uint64_t last_used, uint64_t payload_bytes, uint32_t model_tag=0):
    """The 48 header bytes; fields must already be range-checked by the caller."""
    cdef kvs_header h
    cdef bytes out = PyBytes_FromStringAndSize(NULL, KVS_HEADER_SIZE)
    h.version = version
    h.quant_bits = quant_bits
    h.reason = reason
    h.ext_flags = ext_flags
    h.model_id = model_id
    h.tokens = tokens
    h.hits = hits
    h.ctx_size = ctx_size
    h.payload_abi = payload_abi
    h.created_at = created_at
    h.last_used = last_used
    h.payload_bytes = payload_bytes
    h.model_tag = model_tag
    kvs_header_pack(&h, <uint8_t *>PyBytes_AS_STRING(out))
    return out


def parse_header(buf, path=None):
    """Parses 48 header bytes into a tuple in pack_header's argument order.

    Raises:
        CorruptCheckpoint: short buffer, bad magic, version != 1, zero tokens.
    """
    cdef Py_buffer view
    cdef kvs_header h
    cdef int rc
    PyObject_GetBuffer(buf, &view, PyBUF_SIMPLE)
    try:
        if view.len < KVS_HEADER_SIZE:
            raise CorruptCheckpoint("truncated", path, f"header is {view.len} bytes, expected {KVS_HEADER_SIZE}")
        rc = kvs_header_parse(<const uint8_t *>view.buf, &h)
    finally:
        PyBuffer_Release(&view)
    if rc == KVS_EVERSION:
        raise CorruptCheckpoint("bad_version", path, f"version {h.version}, expected 1")
    _raise_status(rc, path, "header")
    return (h.version, h.quant_bits, h.reason, h.ext_flags, h.model_id, h.tokens, h.hits,
            h.ctx_size, h.payload_abi, h.created_at, h.last_used, h.payload_bytes, h.model_tag)


def envelope_fits(uint64_t file_size, uint32_t text_len, uint64_t payload_bytes):
    """True when 52 + text_len + payload_bytes <= file_size (no overflow)."""
    return kvs_envelope_fits(file_size, text_len, payload_bytes) == 0


def touch(path, uint64_t now):
    """hits + 1 (saturating) and last_used = now, atomically in place; returns hits."""
    cdef bytes p = os.fsencode(path)
    cdef const char *cp = p
    cdef uint32_t hits = 0
    cdef int rc
    with nogil:
        rc = kvs_touch(cp, now, &hits)
    _raise_status(rc, path, "touch")
    return hits


def touch_fd(int fd, uint64_t now, path=None):
    """touch() on an open file (read-write): the hit goes to that very file; returns hits."""
    cdef uint32_t hits = 0
    cdef int rc
    with nogil:
        rc = kvs_touch_fd(fd, now, &hits)
    _raise_status(rc, path if path is not None else f"fd {fd}", "touch")
    return hits


def pread_into(int fd, buf, uint64_t offset, path=None, crc=None):
    """Fills the writable buffer buf from fd at offset, GIL released.

    Returns:
        the CRC32C of the bytes read, continuing from crc, or None when crc is None.

    Raises:
        CorruptCheckpoint: end of file before the buffer was full.
        CheckpointOSError: the read failed.
    """
    cdef Py_buffer view
    cdef uint32_t c = 0 if crc is None else crc
    cdef uint32_t *cp = NULL if crc is None else &c
    cdef int rc
    PyObject_GetBuffer(buf, &view, PyBUF_WRITABLE)
    try:
        with nogil:
            rc = kvs_pread_full(fd, <uint8_t *>view.buf, <size_t>view.len, offset, cp)
    finally:
        PyBuffer_Release(&view)
    _raise_status(rc, path if path is not None else f"fd {fd}", "read")
    return None if crc is None else c


cdef int _check_runs(Py_ssize_t i, Py_ssize_t b, Py_ssize_t nb, uint64_t span, uint64_t dst, uint64_t run,
                     uint64_t count, uint64_t stride) except -1:
    """Piece i's count runs of run bytes every stride from dst fit buffer b
    (of nb, span bytes long); ValueError naming the piece otherwise."""
    if not 0 <= b < nb:
        raise ValueError(f"piece {i} names buffer {b} of {nb}")
    # (count - 1) * stride + run <= span - dst, without overflow.
    if count and run and (dst > span or run > span - dst or (count > 1 and (
            stride < run or (span - dst - run) // stride < count - 1))):
        raise ValueError(f"piece {i}: {count} runs of {run} bytes every {stride} from {dst} "
                         f"do not fit a buffer of {span}")
    return 0


def pread_pieces(buffers, pieces, verify=True):
    """Reads a batch of pieces into buffers in one call, GIL released.

    The share of one I/O thread of a chain load: many small (often strided)
    reads, without coming back to Python between them.

    Args:
        buffers: writable buffers (the destinations).
        pieces: sequence of (buffer index, fd, file offset, run, count,
            stride, destination offset): count runs of run bytes,
            consecutive in the file, landing every stride bytes from the
            destination offset.
        verify: compute each piece's CRC32C.

    Returns:
        list of (status, crc): status 0, or the code _raise_status maps
        (CorruptCheckpoint for a file that ends first, an OSError
        otherwise); crc the CRC32C of the piece's file bytes (0 unless verify).

    Raises:
        ValueError: a piece does not fit its buffer, or names no buffer.
    """
    cdef Py_ssize_t nb = len(buffers), n = len(pieces), i
    cdef Py_buffer *views = NULL
    cdef kvs_piece *c = NULL
    cdef Py_ssize_t got = 0
    cdef uint64_t run, count, stride, dst
    cdef int with_crc = 1 if verify else 0
    views = <Py_buffer *>malloc(max(nb, 1) * sizeof(Py_buffer))
    c = <kvs_piece *>malloc(max(n, 1) * sizeof(kvs_piece))
    if views == NULL or c == NULL:
        free(views)
        free(c)
        raise MemoryError()
    try:
        for i in range(nb):
            PyObject_GetBuffer(buffers[i], &views[i], PyBUF_WRITABLE)
            got += 1
        for i in range(n):
            b, fd, off, run, count, stride, dst = pieces[i]
            _check_runs(i, b, nb, <uint64_t>views[b].len if 0 <= b < nb else 0, dst, run, count, stride)
            c[i].fd = fd
            c[i].off = off
            c[i].run = <size_t>run
            c[i].count = <size_t>count
            c[i].stride = <size_t>stride
            c[i].dst = <uint8_t *>views[b].buf + dst
            c[i].crc = 0
            c[i].status = 0
        with nogil:
            kvs_pread_pieces(c, <size_t>n, with_crc)
        return [(c[i].status, c[i].crc) for i in range(n)]
    finally:
        for i in range(got):
            PyBuffer_Release(&views[i])
        free(views)
        free(c)


def copy_runs(dst, uint64_t dst_offset, src, uint64_t src_offset, uint64_t run, uint64_t count, uint64_t stride):
    """Copies count runs of run bytes, consecutive in src from src_offset, to
    dst every stride bytes from dst_offset, GIL released; each destination
    run's pages are mapped first (as pread_pieces maps them).

    Raises:
        ValueError: the runs do not fit src or dst, or stride < run.
    """
    cdef Py_buffer d, s
    cdef uint64_t dspan, sspan
    PyObject_GetBuffer(dst, &d, PyBUF_WRITABLE)
    try:
        PyObject_GetBuffer(src, &s, PyBUF_SIMPLE)
        try:
            if not count or not run:
                return
            dspan, sspan = <uint64_t>d.len, <uint64_t>s.len
            # (count - 1) * stride + run <= dspan - dst_offset and
            # count * run <= sspan - src_offset, without overflow.
            if (dst_offset > dspan or run > dspan - dst_offset or (count > 1 and (
                    stride < run or (dspan - dst_offset - run) // stride < count - 1))):
                raise ValueError(f"{count} runs of {run} bytes every {stride} from {dst_offset} "
                                 f"do not fit a buffer of {dspan}")
            if src_offset > sspan or (sspan - src_offset) // run < count:
                raise ValueError(f"{count} runs of {run} bytes from {src_offset} pass a source of {sspan}")
            with nogil:
                kvs_copy_runs(<uint8_t *>d.buf + dst_offset, <const uint8_t *>s.buf + src_offset,
                              <size_t>run, <size_t>count, <size_t>stride)
        finally:
            PyBuffer_Release(&s)
    finally:
        PyBuffer_Release(&d)


include "_native_forms.pxi"


def raise_status(int rc, path, str what="read"):
    """Raises the exception a status of pread_pieces stands for (nothing for 0)."""
    _raise_status(rc, path, what)


def buffer_address(buf):
    """The address of a buffer's first byte (to tell whether two views share memory)."""
    cdef Py_buffer view
    PyObject_GetBuffer(buf, &view, PyBUF_SIMPLE)
    try:
        return <size_t>view.buf
    finally:
        PyBuffer_Release(&view)


# Errors of fallocate() that mean "this filesystem or file cannot", not "no room".
_NO_PREALLOCATE = frozenset(getattr(_errno, n) for n in ("EOPNOTSUPP", "ENOTSUP", "ENOSYS", "EINVAL", "ENODEV",
                                                          "EPERM", "ESPIPE") if hasattr(_errno, n))


def preallocate(int fd, uint64_t length, path=None):
    """Allocates a new file's first length bytes and sets its size (Linux fallocate).

    Returns:
        True when allocated, False where the filesystem or system cannot (the
        writes then allocate as they go).

    Raises:
        CheckpointOSError: no room (ENOSPC, EDQUOT, EFBIG) or an I/O error.
    """
    cdef int rc
    with nogil:
        rc = kvs_preallocate(fd, length)
    if rc == 0:
        return True
    if -rc in _NO_PREALLOCATE:
        return False
    _raise_status(rc, path if path is not None else f"fd {fd}", "preallocate")


def pwrite_from(int fd, buf, uint64_t offset, path=None, crc=None):
    """Writes all of buf to fd at offset, GIL released; returns the CRC as pread_into."""
    cdef Py_buffer view
    cdef uint32_t c = 0 if crc is None else crc
    cdef uint32_t *cp = NULL if crc is None else &c
    cdef int rc
    PyObject_GetBuffer(buf, &view, PyBUF_SIMPLE)
    try:
        with nogil:
            rc = kvs_pwrite_full(fd, <const uint8_t *>view.buf, <size_t>view.len, offset, cp)
    finally:
        PyBuffer_Release(&view)
    _raise_status(rc, path if path is not None else f"fd {fd}", "write")
    return None if crc is None else c


def pwrite_blocks(int fd, blocks, path=None, crc=True):
    """Writes a batch of blocks to fd in one call, GIL released: the share
    of one I/O thread of a save made of many small tensors (a chain block's
    layers), without coming back to Python between them.

    Args:
        blocks: sequence of (file offset, list of buffers): each block's
            buffers written one after another from its offset (one
            vectored write for up to 64 of them).
        crc: compute each block's CRC32C of what reached the file.

    Returns:
        list of each block's CRC32C (0 without crc).

    Raises:
        CheckpointOSError: a write failed (no room, an I/O error).
    """
    cdef Py_ssize_t nb = len(blocks), n = 0, i, got = 0
    cdef Py_buffer *views = NULL
    cdef kvs_span *spans = NULL
    cdef uint64_t *offs = NULL
    cdef Py_ssize_t *ends = NULL
    cdef uint32_t *crcs = NULL
    cdef Py_ssize_t start = 0
    cdef int rc = 0
    cdef int with_crc = 1 if crc else 0
    for off, bufs in blocks:
        n += len(bufs)
    views = <Py_buffer *>malloc(max(n, 1) * sizeof(Py_buffer))
    spans = <kvs_span *>malloc(max(n, 1) * sizeof(kvs_span))
    offs = <uint64_t *>malloc(max(nb, 1) * sizeof(uint64_t))
    ends = <Py_ssize_t *>malloc(max(nb, 1) * sizeof(Py_ssize_t))
    crcs = <uint32_t *>malloc(max(nb, 1) * sizeof(uint32_t))
    try:
        if views == NULL or spans == NULL or offs == NULL or ends == NULL or crcs == NULL:
            raise MemoryError()
        for i in range(nb):
            off, bufs = blocks[i]
            offs[i] = off
            crcs[i] = 0
            for b in bufs:
                PyObject_GetBuffer(b, &views[got], PyBUF_SIMPLE)
                spans[got].buf = <const uint8_t *>views[got].buf
                spans[got].len = <size_t>views[got].len
                got += 1
            ends[i] = got
        with nogil:
            for i in range(nb):
                rc = kvs_pwrite_spans(fd, spans + start, <size_t>(ends[i] - start), offs[i],
                                      &crcs[i] if with_crc else NULL)
                start = ends[i]
                if rc != 0:
                    break
        _raise_status(rc, path if path is not None else f"fd {fd}", "write")
        return [crcs[i] for i in range(nb)]
    finally:
        for i in range(got):
            PyBuffer_Release(&views[i])
        free(views); free(spans); free(offs); free(ends); free(crcs)


if os.environ.get("KVSTORE_PORTABLE", "") not in ("", "0"):
    select(sha1="portable", crc32c="portable", table="portable", quant="portable")
    set_read_prefaults(False)
