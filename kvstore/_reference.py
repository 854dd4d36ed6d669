"""Pure-Python twins of the C hot paths, for tests and as executable documentation.

Same names and results as kvstore._native: sha1 and sha1_prefixes on hashlib,
crc32c on a bit-reflected table, the header on struct, byte planes on slices.
"""

import hashlib
import struct

_POLY = 0x82F63B78
_TABLE = []
for _n in range(256):
    _c = _n
    for _ in range(8):
        _c = (_c >> 1) ^ _POLY if _c & 1 else _c >> 1
    _TABLE.append(_c)

_HEADER = struct.Struct("<3sBBBBBIIIB3sQQQ")   # bytes 21..23: the u24 model tag
HEADER_SIZE = _HEADER.size  # 48


def sha1(data):
    return hashlib.sha1(memoryview(data).cast("B")).digest()


def sha1_prefixes(data, lengths):
    view = memoryview(data).cast("B")
    lengths = list(lengths)
    for i, n in enumerate(lengths):
        if n < 0 or n > len(view):
            raise ValueError(f"length {n!r} at index {i} is outside 0..{len(view)} (the data length)")
    h = hashlib.sha1()
    at = 0
    digests = {}
    for n in sorted(set(lengths)):
        h.update(view[at:n])
        at = n
        digests[n] = h.copy().digest()
    return [digests[n] for n in lengths]


def crc32c(data, crc=0):
    c = crc ^ 0xFFFFFFFF
    for b in bytes(memoryview(data).cast("B")):
        c = _TABLE[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


def pack_header(version, quant_bits, reason, ext_flags, model_id, tokens, hits, ctx_size,
                payload_abi, created_at, last_used, payload_bytes, model_tag=0):
    return _HEADER.pack(b"KVC", version, quant_bits, reason, ext_flags, model_id, tokens, hits,
                        ctx_size, payload_abi, model_tag.to_bytes(3, "little"), created_at, last_used,
                        payload_bytes)


def parse_header(buf):
    """Returns the fields as pack_header's arguments, or raises ValueError."""
    if len(buf) < HEADER_SIZE:
        raise ValueError("truncated")
    magic, *fields = _HEADER.unpack_from(buf)
    if magic != b"KVC":
        raise ValueError("bad_magic")
    if fields[0] != 1:
        raise ValueError("bad_version")
    if fields[5] == 0:
        raise ValueError("zero_tokens")
    tag = int.from_bytes(fields.pop(9), "little")
    return (*fields, tag)


def planes_split(pieces, width):
    """The byte planes of the elements in pieces: plane p holds byte p of every element."""
    data = b"".join(bytes(memoryview(b).cast("B")) for b in pieces)
    if width < 1 or len(data) % width:
        raise ValueError("not whole elements")
    return [data[p::width] for p in range(width)]


def planes_join(planes, sizes):
    """planes_split's inverse: the elements, cut into pieces of sizes bytes."""
    width = len(planes)
    out = bytearray(width * len(planes[0]))
    for p in range(width):
        out[p::width] = planes[p]
    cuts, at = [], 0
    for size in sizes:
        cuts.append(bytes(out[at:at + size]))
        at += size
    return cuts
