# Included by _native.pyx: the lookup's SHA1 passes (one pass over a prompt
# giving the digest at every stored length; matching against a flat table or
# the chain forest).  Shares _native.pyx's cimports and helpers.

def sha1_prefixes(data, lengths, key=None, inner=False):
    """Digests of data[:n] for every n in lengths, in the order given, in one pass.

    Args:
        data: any buffer-protocol object.
        lengths: iterable of ints, any order, repeats allowed.
        key: bytes: HMAC-SHA1 digests under this key instead (the same one pass).
        inner: with key, the HMAC's inner hashes, SHA1(key ^ ipad || prefix),
            instead (a sealed file's lookup tag is the first LOOKUP_TAG bytes).

    Returns:
        list of 20-byte digests, one per length.

    Raises:
        ValueError: a length is negative or larger than len(data).
    """
    cdef Py_buffer view
    cdef list lens = lengths if type(lengths) is list else list(lengths)
    cdef Py_ssize_t n = len(lens), i
    cdef long long v
    cdef uint64_t *c_lens = NULL
    cdef size_t *order = NULL
    cdef uint8_t *out = NULL
    cdef list result
    cdef kvs_hmac_key k
    cdef const kvs_hmac_key *kp = _hmac_key(key, &k)
    cdef bint inner_only = inner
    if inner_only and kp == NULL:
        raise ValueError("inner=True needs a key")
    if n == 0:
        return []
    PyObject_GetBuffer(data, &view, PyBUF_SIMPLE)
    try:
        c_lens = <uint64_t *>malloc(n * sizeof(uint64_t))
        order = <size_t *>malloc(n * sizeof(size_t))
        out = <uint8_t *>malloc(n * 20)
        if c_lens == NULL or order == NULL or out == NULL:
            raise MemoryError()
        for i in range(n):
            try:
                v = lens[i]
            except OverflowError:
                v = -1
            if v < 0 or v > view.len:
                raise ValueError(f"length {lens[i]!r} at index {i} is outside 0..{view.len} (the data length)")
            c_lens[i] = <uint64_t>v
        with nogil:
            if inner_only:
                kvs_hmac_sha1_inner_prefixes(<const uint8_t *>view.buf, <size_t>view.len, c_lens, n, order, out, kp)
            else:
                kvs_sha1_prefixes_keyed(<const uint8_t *>view.buf, <size_t>view.len, c_lens, n, order, out, kp)
        result = PyList_New(n)
        for i in range(n):
            d = PyBytes_FromStringAndSize(<char *>out + 20 * i, 20)
            Py_INCREF(d)
            PyList_SET_ITEM(result, i, d)
        return result
    finally:
        free(c_lens)
        free(order)
        free(out)
        PyBuffer_Release(&view)


def sha1_prefix_matches(data, lengths, expected, key=None, tags=None, inner=False):
    """Indices i where sha1(data[:lengths[i]]) == expected[20*i:20*i+20], ascending.

    The lookup primitive of the directory index: one SHA1 pass over data,
    then one 20-byte compare per length, with no Python object per length.

    Args:
        data: any buffer-protocol object (the prompt).
        lengths: a C-contiguous uint64 buffer (e.g. numpy.uint64 array) of
            lengths <= len(data); ascending order is fastest, repeats allowed.
        expected: a buffer of 20 * len(lengths) bytes, the digest for each length.
        key: bytes: compare HMAC-SHA1 digests under this key instead.
        tags: with key, LOOKUP_TAG bytes per length (all zero: none): the
            pass gives the inner hashes, and the HMAC is finished (one block)
            only where a tag matches its inner hash or is none.
        inner: with key, the expected digests are the inner hashes
            themselves (names in a namespace; tags are ignored).

    Raises:
        ValueError: sizes disagree or a length is larger than len(data).
    """
    cdef const uint64_t[::1] lens = lengths
    cdef Py_buffer view, exp
    cdef Py_ssize_t n = lens.shape[0], i
    cdef size_t bad = 0
    cdef size_t *order = NULL
    cdef uint8_t *out = NULL
    cdef list matches = []
    cdef kvs_hmac_key k
    cdef const kvs_hmac_key *kp = _hmac_key(key, &k)
    cdef const uint8_t[::1] tag_view
    cdef const uint8_t *tg = NULL
    cdef uint8_t none[20]
    cdef uint8_t digest[20]
    cdef bint inner_only = inner
    if inner_only and kp == NULL:
        raise ValueError("inner=True needs a key")
    if n == 0:
        return matches
    if tags is not None and kp != NULL and not inner_only:
        tag_view = tags
        if tag_view.shape[0] != KVS_LOOKUP_TAG * n:
            raise ValueError(f"tags hold {tag_view.shape[0]} bytes, need {KVS_LOOKUP_TAG} * {n}")
        tg = &tag_view[0]
    memset(none, 0, 20)
    PyObject_GetBuffer(data, &view, PyBUF_SIMPLE)
    try:
        PyObject_GetBuffer(expected, &exp, PyBUF_SIMPLE)
        try:
            if exp.len != 20 * n:
                raise ValueError(f"expected holds {exp.len} bytes, need 20 * {n}")
            order = <size_t *>malloc(n * sizeof(size_t))
            out = <uint8_t *>malloc(n * 20)
            if order == NULL or out == NULL:
                raise MemoryError()
            with nogil:
                if tg != NULL or inner_only:
                    bad = kvs_hmac_sha1_inner_prefixes(<const uint8_t *>view.buf, <size_t>view.len, &lens[0], n,
                                                       order, out, kp)
                else:
                    bad = kvs_sha1_prefixes_keyed(<const uint8_t *>view.buf, <size_t>view.len, &lens[0], n,
                                                  order, out, kp)
            if bad:
                raise ValueError(f"length {lens[bad - 1]} at index {bad - 1} is larger than the data ({view.len})")
            for i in range(n):
                if tg == NULL:      # plain SHA1, inner hashes, or HMACs finished by the pass
                    if memcmp(out + 20 * i, <const uint8_t *>exp.buf + 20 * i, 20) == 0:
                        matches.append(i)
                    continue
                if (memcmp(tg + KVS_LOOKUP_TAG * i, none, KVS_LOOKUP_TAG) != 0
                        and memcmp(tg + KVS_LOOKUP_TAG * i, out + 20 * i, KVS_LOOKUP_TAG) != 0):
                    continue
                kvs_hmac_sha1_outer(kp, out + 20 * i, digest)
                if memcmp(digest, <const uint8_t *>exp.buf + 20 * i, 20) == 0:
                    matches.append(i)
        finally:
            PyBuffer_Release(&exp)
    finally:
        free(order)
        free(out)
        PyBuffer_Release(&view)
    return matches


def sha1_forest_matches(data, lengths, digests, int first_root, first_child, next_sibling, key=None, tags=None,
                        inner=False):
    """The nodes of a prefix forest whose digest matches data, in one pass (shortest first).

    Node i claims sha1(data[:lengths[i]]) == digests[20*i:20*i+20]; a node is
    tried only when its parent matched (roots always), so a lookup over
    chains of checkpoint blocks costs one SHA1 pass plus one digest per node
    tried, not per node stored.

    Args:
        data: any buffer-protocol object (the prompt).
        lengths: C-contiguous uint64 buffer, one length per node.
        digests: a buffer of 20 bytes per node.
        first_root: the first root's index (-1: no roots).
        first_child, next_sibling: C-contiguous int32 buffers, one per node:
            the roots are first_root, next_sibling[first_root], ...; node
            i's children first_child[i], next_sibling[first_child[i]], ...;
            -1 ends a list.  An index out of range ends its list.
        key: bytes: nodes claim HMAC-SHA1 digests under this key instead.
        tags: with key, LOOKUP_TAG bytes per node (all zero: none); a node
            with a tag is confirmed only when the tag matches its inner hash
            (see sha1_prefix_matches).
        inner: with key, nodes claim the inner hashes themselves (names in
            a namespace; tags are ignored).

    Returns:
        list of matching node indices.

    Raises:
        ValueError: the arrays' sizes disagree.
    """
    cdef const uint64_t[::1] lens = lengths
    cdef const int32_t[::1] fc = first_child
    cdef const int32_t[::1] ns = next_sibling
    cdef Py_ssize_t n = lens.shape[0], i
    cdef size_t got = 0
    cdef uint32_t *heap = NULL
    cdef uint32_t *matched = NULL
    cdef Py_buffer view, dig
    cdef kvs_hmac_key k
    cdef const kvs_hmac_key *kp = _hmac_key(key, &k)
    cdef const uint8_t[::1] tag_view
    cdef const uint8_t *tg = NULL
    cdef int outer = 0 if inner else 1
    if inner and kp == NULL:
        raise ValueError("inner=True needs a key")
    if fc.shape[0] < n or ns.shape[0] < n:
        raise ValueError(f"first_child and next_sibling need one entry per node ({n})")
    if n == 0 or first_root < 0:
        return []
    if n >= 0x7FFFFFFF:
        raise ValueError(f"{n} nodes: too many for int32 indices")
    if tags is not None and kp != NULL and outer:
        tag_view = tags
        if tag_view.shape[0] < KVS_LOOKUP_TAG * n:
            raise ValueError(f"tags hold {tag_view.shape[0]} bytes, need {KVS_LOOKUP_TAG} * {n}")
        tg = &tag_view[0]
    PyObject_GetBuffer(data, &view, PyBUF_SIMPLE)
    try:
        PyObject_GetBuffer(digests, &dig, PyBUF_SIMPLE)
        try:
            if dig.len < 20 * n:
                raise ValueError(f"digests hold {dig.len} bytes, need 20 * {n}")
            heap = <uint32_t *>malloc(n * sizeof(uint32_t))
            matched = <uint32_t *>malloc(n * sizeof(uint32_t))
            if heap == NULL or matched == NULL:
                raise MemoryError()
            with nogil:
                got = kvs_sha1_forest_keyed(<const uint8_t *>view.buf, <size_t>view.len, &lens[0],
                                            <const uint8_t *>dig.buf, <size_t>n, first_root, &fc[0], &ns[0],
                                            heap, matched, kp, tg, outer)
            return [matched[i] for i in range(<Py_ssize_t>got)]
        finally:
            PyBuffer_Release(&dig)
    finally:
        free(heap)
        free(matched)
        PyBuffer_Release(&view)
