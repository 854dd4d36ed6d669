"""Pure-Python twins of the C hot paths, for the tests (a testing helper:
the package does not ship it) and as executable documentation.

Same names and results as kvstore._native: sha1 and sha1_prefixes on hashlib,
crc32c on a bit-reflected table, the header on struct, byte planes on slices,
quantisation on NumPy.
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


# ---- group-wise affine quantisation (csrc/quant.h), in NumPy ----

_Q_STORE = {"bfloat16": "uint16", "float16": "float16", "float32": "float32"}


def _q_f32(raw, dtype):
    """float32 values of raw bytes (or a stored array) of dtype."""
    import numpy as np
    a = np.frombuffer(raw, _Q_STORE[dtype]) if not isinstance(raw, np.ndarray) else raw
    if dtype == "bfloat16":
        return (a.astype(np.uint32) << 16).view(np.float32)
    return a.astype(np.float32)


def _q_from_f32(x, dtype):
    """x (float32, finite) in dtype, rounded to the nearest (even)."""
    import numpy as np
    if dtype == "bfloat16":
        u = x.view(np.uint32)
        return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return x.astype(_Q_STORE[dtype])


def _q_round_up(x, dtype):
    """x (float32, >= 0) in dtype, rounded toward +inf; an overflow gives inf."""
    import numpy as np
    if dtype == "float32":
        return x.astype(np.float32)
    if dtype == "float16":
        with np.errstate(over="ignore"):
            r = x.astype(np.float16)
        return np.where(r.astype(np.float32) < x, np.nextafter(r, np.float16(np.inf)), r)
    u = x.view(np.uint32)
    t = u & np.uint32(0xFFFF0000)
    return ((t + np.where((t != u) & (x > 0), np.uint32(0x10000), np.uint32(0))) >> 16).astype(np.uint16)


def quantize(src, dtype, bits, group):
    """(ok, q, scales, biases) as bytes: kvstore._native.quantize's results."""
    import numpy as np
    x = _q_f32(memoryview(src).cast("B"), dtype).reshape(-1, group)
    levels = (1 << bits) - 1
    if not np.isfinite(x).all():
        return False, b"", b"", b""
    lo, hi = x.min(axis=1), x.max(axis=1)
    lo = np.where(lo == 0, np.float32(0), lo)       # +0 whichever zero was smallest
    with np.errstate(over="ignore"):
        bias = _q_from_f32(lo, dtype)               # lo is a value of dtype: exact
        scale = _q_round_up((hi - lo) / levels, dtype)
    s = _q_f32(scale, dtype)
    if not (np.isfinite(s).all() and np.isfinite(hi - lo).all()):
        return False, b"", b"", b""
    with np.errstate(over="ignore"):                # the largest value given back must fit dtype
        top = _q_f32(_q_from_f32(np.float32(levels) * s + lo, dtype), dtype)
    if not np.isfinite(top).all():
        return False, b"", b"", b""
    inv = np.float32(1) / np.where(s > 0, s, np.float32(1))
    q = np.clip(np.rint((x - lo[:, None]) * inv[:, None]), 0, levels).astype(np.uint8)
    if bits == 4:
        q = q[:, 0::2] | (q[:, 1::2] << 4)
    return True, q.tobytes(), scale.tobytes(), bias.tobytes()


def dequantize(q, scales, biases, dtype, bits, group):
    """The values as bytes of dtype: kvstore._native.dequantize's result."""
    import numpy as np
    q = np.frombuffer(q, np.uint8)
    if bits == 4:
        q = np.stack([q & 0xF, q >> 4], axis=-1)
    x = q.reshape(-1, group).astype(np.float32)
    x *= _q_f32(scales, dtype)[:, None]
    x += _q_f32(biases, dtype)[:, None]
    return _q_from_f32(x.reshape(-1), dtype).tobytes()
