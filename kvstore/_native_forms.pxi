# Included by kvstore/_native.pyx (one compiled module): the bindings of a
# chain block's stored forms, byte planes (csrc/planes.h) and group-wise
# quantisation (csrc/quant.h).  Buffers in, buffers out, GIL released.


cdef size_t _plane_elements(pieces, size_t width, Py_buffer *planes, str what) except? 0:
    """The element count of pieces (buffers of whole width-byte elements),
    checked against the planes: each plane one byte per element."""
    if width < 1 or width > KVS_PLANES_MAX:
        raise ValueError(f"{width} planes: an element is 1 to {KVS_PLANES_MAX} bytes")
    total = 0
    for i, b in enumerate(pieces):
        n = memoryview(b).nbytes
        if n % width:
            raise ValueError(f"{what} piece {i} holds {n} bytes, not whole {width}-byte elements")
        total += n
    for p in range(width):
        if <size_t>planes[p].len != total // width:
            raise ValueError(f"{what} pieces hold {total // width} elements, plane {p} {planes[p].len} bytes")
    return total // width


cdef _planes_pass(pieces, planes, bint split):
    cdef Py_buffer views[KVS_PLANES_MAX]
    cdef uint8_t *ptrs[KVS_PLANES_MAX]
    cdef Py_buffer piece
    cdef size_t width = len(planes), got = 0, first = 0, count
    cdef int flags = PyBUF_WRITABLE if split else PyBUF_SIMPLE
    if width > KVS_PLANES_MAX:
        raise ValueError(f"{width} planes: an element is 1 to {KVS_PLANES_MAX} bytes")
    try:
        for p in range(width):
            PyObject_GetBuffer(planes[p], &views[p], flags)
            got += 1
            ptrs[p] = <uint8_t *>views[p].buf
        _plane_elements(pieces, width, views, "split" if split else "join")
        for b in pieces:
            PyObject_GetBuffer(b, &piece, PyBUF_SIMPLE if split else PyBUF_WRITABLE)
            try:
                count = <size_t>piece.len // width
                with nogil:
                    if split:
                        kvs_planes_split(ptrs, first, <const uint8_t *>piece.buf, count, width)
                    else:
                        kvs_planes_join(<uint8_t *>piece.buf, <const uint8_t **>ptrs, first, count, width)
                first += count
            finally:
                PyBuffer_Release(&piece)
    finally:
        for p in range(got):
            PyBuffer_Release(&views[p])


def planes_split(pieces, planes):
    """Byte p of every element of pieces into planes[p]: an element is
    len(planes) bytes, pieces (buffers in order) hold whole elements, and
    each plane (a writable buffer) one byte per element; GIL released
    (csrc/planes.h).

    Raises:
        ValueError: a piece is not whole elements, or a plane is not one byte per element.
    """
    _planes_pass(pieces, planes, True)


def planes_join(planes, pieces):
    """planes_split's inverse: the elements rebuilt from planes into pieces
    (writable buffers in order); GIL released.

    Raises:
        ValueError: a piece is not whole elements, or a plane is not one byte per element.
    """
    _planes_pass(pieces, planes, False)


_Q_DTYPES = {"float32": (KVS_Q_F32, 4), "float16": (KVS_Q_F16, 2), "bfloat16": (KVS_Q_BF16, 2)}


cdef _q_geometry(str dtype, int bits, size_t group, size_t nbytes):
    """(dtype code, width, count) of a quantised block of nbytes of dtype, checked."""
    if dtype not in _Q_DTYPES:
        raise ValueError(f"dtype {dtype!r}: quantised blocks hold {', '.join(_Q_DTYPES)}")
    if bits not in (4, 8):
        raise ValueError(f"bits={bits}: 8 or 4")
    code, width = _Q_DTYPES[dtype]
    count = nbytes // width
    if group not in (16, 32, 64):
        raise ValueError(f"group={group}: 16, 32 or 64")
    if nbytes % width or count % group:
        raise ValueError(f"{nbytes} bytes of {dtype} are not whole groups of {group}")
    return code, width, count


def quantize(const uint8_t[::1] src, str dtype, int bits, size_t group, uint8_t[::1] q, uint8_t[::1] scales,
             uint8_t[::1] biases):
    """src (the bytes of dtype values) group-wise affine into q (count * bits
    / 8 bytes), scales and biases (count / group values of dtype each), GIL
    released (csrc/quant.h).  Returns True, or False when a value is not
    finite or a group's scale does not fit dtype (the outputs then hold
    nothing to keep).

    Raises:
        ValueError: a dtype, bits or group it does not take, or outputs of another size.
    """
    cdef int code, rc
    cdef size_t width, count
    code, width, count = _q_geometry(dtype, bits, group, src.shape[0])
    _q_sizes("quantize: outputs", q, scales, biases, count, bits, group, width)
    if count == 0:
        return True
    with nogil:
        rc = kvs_quantize(&src[0], count, code, bits, group, &q[0], &scales[0], &biases[0])
    return rc == 0


def dequantize(const uint8_t[::1] q, const uint8_t[::1] scales, const uint8_t[::1] biases, str dtype, int bits,
               size_t group, uint8_t[::1] dst):
    """quantize's inverse into dst (the bytes of dtype values): q * scale +
    bias, rounded to the nearest (even) value of dtype; GIL released.

    Raises:
        ValueError: a dtype, bits or group it does not take, or inputs of another size.
    """
    cdef int code
    cdef size_t width, count
    code, width, count = _q_geometry(dtype, bits, group, dst.shape[0])
    _q_sizes("dequantize: inputs", q, scales, biases, count, bits, group, width)
    if count == 0:
        return
    with nogil:
        kvs_populate(&dst[0], <size_t>dst.shape[0])
        kvs_dequantize(&q[0], &scales[0], &biases[0], count, code, bits, group, &dst[0])


cdef _q_sizes(str what, const uint8_t[::1] q, const uint8_t[::1] scales, const uint8_t[::1] biases, size_t count,
              int bits, size_t group, size_t width):
    if <size_t>q.shape[0] != count * bits // 8 or <size_t>scales.shape[0] != count // group * width \
            or <size_t>biases.shape[0] != count // group * width:
        raise ValueError(f"{what} of {q.shape[0]}, {scales.shape[0]}, {biases.shape[0]} bytes for {count} "
                         f"elements in groups of {group}")


def table_pack(const uint8_t[::1] plane, size_t limit):
    """plane's table form (csrc/table.h) as a bytearray, or None when that
    would take more than limit bytes; GIL released."""
    cdef size_t n = plane.shape[0], size = 0, head
    if n == 0:
        return None
    head = KVS_TABLE_HEAD + (n + 1) // 2
    if limit < head:
        return None
    cdef size_t most = (limit - head) // 5
    out = bytearray(head + 5 * most)
    cdef uint8_t *o = out
    with nogil:
        size = kvs_table_pack(&plane[0], n, most, o)
    if size == 0:
        return None
    del out[size:]
    return out


def table_join(stored, planes, dst, size_t offset, size_t run, size_t count, size_t stride, path, str what):
    """Rebuilds a block of byte planes into count runs of run bytes in dst
    (a writable buffer), at offset, offset + stride, ...; GIL released.

    Args:
        stored: the block's stored bytes, its planes end to end.
        planes: [(is_table, stored length), ...], one per byte of an element.

    Raises:
        CorruptCheckpoint: "bad_payload" when a table plane's form does not
            hold (csrc/table.h: kvs_table_check) or the lengths do not add up.
        ValueError: the runs do not fit dst or are not whole elements.
    """
    cdef uint8_t table[KVS_PLANES_MAX]
    cdef size_t lens[KVS_PLANES_MAX]
    cdef size_t width = len(planes), p
    cdef Py_buffer src, out
    cdef int rc = 0
    if width < 1 or width > KVS_PLANES_MAX or run % width:
        raise ValueError(f"{width} planes for runs of {run} bytes")
    for p, (is_table, length) in enumerate(planes):
        table[p] = 1 if is_table else 0
        lens[p] = length
    PyObject_GetBuffer(stored, &src, PyBUF_SIMPLE)
    try:
        PyObject_GetBuffer(dst, &out, PyBUF_WRITABLE)
        try:
            if count and offset + (count - 1) * stride + run > <size_t>out.len:
                raise ValueError(f"{what}: {count} runs of {run} bytes every {stride} from {offset} "
                                 f"do not fit {out.len} bytes")
            with nogil:     # checks the planes before a byte lands (csrc/packed.h)
                rc = kvs_packed_join(<const uint8_t *>src.buf, <size_t>src.len, table, lens, width,
                                     <uint8_t *>out.buf + offset, run, count, stride)
        finally:
            PyBuffer_Release(&out)
    finally:
        PyBuffer_Release(&src)
    _raise_status(rc, path, what)


cdef int _packed_piece(kvs_packed_piece *c, Py_ssize_t i, piece, Py_buffer *views, Py_ssize_t nb) except -1:
    """c set from read_packed's piece i, checked (see read_packed)."""
    cdef size_t k
    cdef uint64_t dst, run, count, stride
    b, fd, off, stored, form, dst, run, count, stride, want = piece
    _check_runs(i, b, nb, <uint64_t>views[b].len if 0 <= b < nb else 0, dst, run, count, stride)
    c.qbits, c.qdtype, c.group = 0, 0, 0
    if isinstance(form, tuple):                 # ("quant", bits, dtype, group)
        kind, bits, dtype, group = form
        code, width, _ = _q_geometry(dtype, bits, group, 0)
        if kind != "quant" or run % width or (run // width) % group:
            raise ValueError(f"piece {i}: runs of {run} bytes are not whole groups of {group} {dtype}")
        c.qbits, c.qdtype, c.group = bits, code, group
    else:
        width = len(form)
        if width < 1 or width > KVS_PLANES_MAX or run % width:
            raise ValueError(f"piece {i}: {width} planes for runs of {run} bytes")
        for k in range(width):
            c.table[k] = 1 if form[k][0] else 0
            c.lens[k] = form[k][1]
    c.fd, c.off, c.stored, c.width = fd, off, stored, width
    c.dst = <uint8_t *>views[b].buf + dst
    c.run, c.count, c.stride = <size_t>run, <size_t>count, <size_t>stride
    c.want, c.crc, c.status = want, 0, 0
    return 0


def read_packed(buffers, pieces, verify=True):
    """Reads a batch of packed chain blocks (table planes) and quantised
    ones into buffers in one call, GIL released (csrc/packed.h): the share
    of one I/O thread.

    Args:
        buffers: writable buffers (the destinations).
        pieces: sequence of (buffer index, fd, file offset, stored length,
            form, destination offset, run, count, stride, expected CRC32C
            of the stored bytes); form is the planes [(is_table, stored
            length), ...] or ("quant", bits, dtype, group), each run whole
            groups.
        verify: join only a block whose CRC is the one expected.

    Returns:
        list of (status, crc): status 0 or the code _raise_status maps
        (bad_payload for planes that do not hold, truncated, an OSError);
        crc the CRC32C of the stored bytes read.

    Raises:
        ValueError: a piece does not fit its buffer, its planes are not 1
            to 16 of whole elements, or its runs not whole groups.
    """
    cdef Py_ssize_t nb = len(buffers), n = len(pieces), i, got = 0
    cdef Py_buffer *views = NULL
    cdef kvs_packed_piece *c = NULL
    cdef uint8_t *scratch = NULL
    cdef size_t most = 1
    cdef int check
    views = <Py_buffer *>malloc(max(nb, 1) * sizeof(Py_buffer))
    c = <kvs_packed_piece *>malloc(max(n, 1) * sizeof(kvs_packed_piece))
    try:
        if views == NULL or c == NULL:
            raise MemoryError()
        for i in range(nb):
            PyObject_GetBuffer(buffers[i], &views[i], PyBUF_WRITABLE)
            got += 1
        for i in range(n):
            _packed_piece(&c[i], i, pieces[i], views, nb)
            most = max(most, c[i].stored)
        scratch = <uint8_t *>malloc(most)
        if scratch == NULL:
            raise MemoryError()
        check = 1 if verify else 0
        with nogil:
            kvs_read_packed(c, <size_t>n, scratch, check)
        return [(c[i].status, c[i].crc) for i in range(n)]
    finally:
        free(scratch)
        for i in range(got):
            PyBuffer_Release(&views[i])
        free(views)
        free(c)
