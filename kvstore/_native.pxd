# Declarations of csrc/ for kvstore/_native.pyx.
from libc.stdint cimport int32_t, uint8_t, uint32_t, uint64_t

cdef extern from "dispatch.h" nogil:
    enum:
        KVS_IMPL_AUTO
        KVS_IMPL_PORTABLE
        KVS_IMPL_X86
        KVS_IMPL_ARM
        KVS_IMPL_X86_AVX512
    void kvs_init()
    int kvs_sha1_select(int impl)
    int kvs_crc32c_select(int impl)
    int kvs_sha1_has(int impl)
    int kvs_crc32c_has(int impl)
    const char *kvs_sha1_impl_name()
    const char *kvs_crc32c_impl_name()

cdef extern from "sha1.h" nogil:
    void kvs_sha1(const uint8_t *data, size_t n, uint8_t *out)
    size_t kvs_sha1_prefixes(const uint8_t *data, size_t n, const uint64_t *lengths,
                             size_t count, size_t *order, uint8_t *out)
    size_t kvs_sha1_forest(const uint8_t *data, size_t n, const uint64_t *lengths,
                           const uint8_t *digests, size_t n_nodes, int32_t first_root,
                           const int32_t *first_child, const int32_t *next_sibling,
                           uint32_t *heap, uint32_t *matched)
    ctypedef struct kvs_hmac_key:
        uint32_t inner[5]
        uint32_t outer[5]
    void kvs_hmac_sha1_key(kvs_hmac_key *k, const uint8_t *key, size_t n)
    void kvs_hmac_sha1(const kvs_hmac_key *k, const uint8_t *data, size_t n, uint8_t *out)
    size_t kvs_sha1_prefixes_keyed(const uint8_t *data, size_t n, const uint64_t *lengths,
                                   size_t count, size_t *order, uint8_t *out, const kvs_hmac_key *key)
    size_t kvs_hmac_sha1_inner_prefixes(const uint8_t *data, size_t n, const uint64_t *lengths,
                                        size_t count, size_t *order, uint8_t *out, const kvs_hmac_key *key)
    void kvs_hmac_sha1_outer(const kvs_hmac_key *k, const uint8_t *inner, uint8_t *out)
    size_t kvs_sha1_forest_keyed(const uint8_t *data, size_t n, const uint64_t *lengths,
                                 const uint8_t *digests, size_t n_nodes, int32_t first_root,
                                 const int32_t *first_child, const int32_t *next_sibling,
                                 uint32_t *heap, uint32_t *matched, const kvs_hmac_key *key,
                                 const uint8_t *tags, int outer)
    int KVS_LOOKUP_TAG

cdef extern from "crc32c.h" nogil:
    uint32_t kvs_crc32c(uint32_t crc, const uint8_t *data, size_t n)
    uint32_t kvs_crc32c_combine(uint32_t a, uint32_t b, uint64_t len_b)

cdef extern from "header.h" nogil:
    enum:
        KVS_HEADER_SIZE
        KVS_EMAGIC
        KVS_EVERSION
        KVS_ETOKENS
        KVS_ETRUNC
        KVS_ENOTREG
    ctypedef struct kvs_header:
        uint8_t version
        uint8_t quant_bits
        uint8_t reason
        uint8_t ext_flags
        uint8_t model_id
        uint32_t tokens
        uint32_t hits
        uint32_t ctx_size
        uint8_t payload_abi
        uint32_t model_tag
        uint64_t created_at
        uint64_t last_used
        uint64_t payload_bytes
    void kvs_header_pack(const kvs_header *h, uint8_t *out)
    int kvs_header_parse(const uint8_t *buf, kvs_header *h)
    int kvs_envelope_fits(uint64_t file_size, uint32_t text_len, uint64_t payload_bytes)
    int kvs_touch(const char *path, uint64_t now, uint32_t *hits_out)
    int kvs_touch_fd(int fd, uint64_t now, uint32_t *hits_out)

cdef extern from "io.h" nogil:
    enum:
        KVS_ESHORT
    int kvs_io_prefaults()
    int kvs_io_set_prefault(int on)
    int kvs_preallocate(int fd, uint64_t len)
    int kvs_pread_full(int fd, uint8_t *buf, size_t n, uint64_t off, uint32_t *crc)
    ctypedef struct kvs_piece:
        int fd
        uint64_t off
        size_t run
        size_t count
        size_t stride
        uint8_t *dst
        uint32_t crc
        int status
    size_t kvs_pread_pieces(kvs_piece *pieces, size_t n, int with_crc)
    void kvs_copy_runs(uint8_t *dst, const uint8_t *src, size_t run, size_t count, size_t stride)
    void kvs_populate(uint8_t *buf, size_t len)
    int kvs_pwrite_full(int fd, const uint8_t *buf, size_t n, uint64_t off, uint32_t *crc)
    ctypedef struct kvs_span:
        const uint8_t *buf
        size_t len
    int kvs_pwrite_spans(int fd, const kvs_span *spans, size_t n, uint64_t off, uint32_t *crc)


cdef extern from "planes.h" nogil:
    enum: KVS_PLANES_MAX
    void kvs_planes_split(uint8_t **planes, size_t first, const uint8_t *src, size_t count, size_t width)
    void kvs_planes_join(uint8_t *dst, const uint8_t **planes, size_t first, size_t count, size_t width)


cdef extern from "table.h" nogil:
    enum: KVS_TABLE_HEAD, KVS_EBADTABLE
    size_t kvs_table_pack(const uint8_t *plane, size_t n, size_t max_exceptions, uint8_t *out)
    int kvs_table_select(int impl)
    int kvs_table_has(int impl)
    const char *kvs_table_impl_name()


cdef extern from "packed.h" nogil:
    ctypedef struct kvs_packed_piece:
        int fd
        uint64_t off
        size_t stored
        size_t width
        size_t lens[16]
        uint8_t table[16]
        int qbits
        int qdtype
        size_t group
        uint8_t *dst
        size_t run, count, stride
        uint32_t want
        uint32_t crc
        int status
    size_t kvs_read_packed(kvs_packed_piece *pieces, size_t n, uint8_t *scratch, int check_crc)
    int kvs_packed_join(const uint8_t *stored, size_t len, const uint8_t *table, const size_t *lens, size_t width,
                        uint8_t *dst, size_t run, size_t count, size_t stride)


cdef extern from "quant.h" nogil:
    enum: KVS_Q_F32, KVS_Q_F16, KVS_Q_BF16
    int kvs_quant_has(int impl)
    int kvs_quant_select(int impl)
    const char *kvs_quant_impl_name()
    int kvs_quantize(const void *src, size_t count, int dtype, int bits, size_t group,
                     uint8_t *q, void *scales, void *biases)
    void kvs_dequantize(const uint8_t *q, const void *scales, const void *biases, size_t count, int dtype,
                        int bits, size_t group, void *dst)
