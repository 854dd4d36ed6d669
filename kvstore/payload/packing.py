"""Packed blocks: a tensor block stored as compressed byte planes.

A block of elements W bytes wide is split into W byte planes (plane p holds
byte p of every element: kvstore._native.planes_split), and each plane is
stored as a zstd frame or, where zstd does not shrink it below PLANE_KEEP
of its size, as it is.  For the 16-bit floats of a KV cache the high plane
(the sign and seven of the eight exponent bits) takes few values and
shrinks; the low plane (the mantissa) is close to random and stays raw.

The stored form of a block is its planes' stored bytes end to end; what
each one is (["zstd", length] or ["raw", length]) is the caller's to
record (the manifest's "planes").  unpack() checks that description
against the block it rebuilds into before it writes a byte, and a frame
that does not decompress to exactly one plane is CorruptCheckpoint, never
bytes in the destination.

zstd, not LZ4 or Blosc2: the exponent plane's values are few but not in
runs, so it shrinks through an entropy coder (zstd's Huffman stage), which
LZ4 has not (bench/lossless.py: a plane split and LZ4 stores 0.83 of the
zoo's random bfloat16 blocks, zstd level 1 0.69); Blosc2 does the shuffle
and its threads itself, but its Python package brings an HTTP client,
pydantic and rich with it.  python-zstandard has no dependencies and
releases the GIL while it decompresses.
"""

import threading

from kvstore import _native
from kvstore.errors import CorruptCheckpoint

CODEC = "zstd-planes"
# zstd's fastest standard level: level 3 stored the same blocks 1-3% smaller
# at 70-80% of the encode rate (bench/lossless.py).
LEVEL = 1
# A plane zstd cannot bring below this share of its size is stored raw:
# decoding it would cost more than the bytes it saves.
PLANE_KEEP = 0.95
# A plane is first tried on a sample this long from its start: a plane the
# sample shows incompressible (the mantissa's) is stored raw without
# compressing all of it.
SAMPLE = 64 << 10
KINDS = ("raw", "zstd")
# What is packed: the float dtypes of a KV cache, in blocks of at least
# MIN_BYTES (a zstd frame's header is a dozen bytes; a block of a real
# model's KV is 64 KiB or more a tensor).
PACKABLE = frozenset({"bfloat16", "float16", "float32"})
MIN_BYTES = 1 << 10

_local = threading.local()


def _zstd():
    import zstandard
    return zstandard


def _compressor():
    c = getattr(_local, "c", None)
    if c is None:
        c = _local.c = _zstd().ZstdCompressor(level=LEVEL)
    return c


def _decompressor():
    d = getattr(_local, "d", None)
    if d is None:
        d = _local.d = _zstd().ZstdDecompressor()
    return d


def packable(dtype, nbytes):
    """Whether a tensor block of dtype and nbytes is tried packed."""
    return dtype in PACKABLE and nbytes >= MIN_BYTES


def pack(pieces, width):
    """The packed form of a block of width-byte elements laid in pieces.

    Returns:
        (planes, parts): [[kind, stored length], ...] one per plane, and the
        stored bytes as buffers in order (raw planes are the split planes).
    """
    n = sum(memoryview(b).nbytes for b in pieces) // width
    split = [bytearray(n) for _ in range(width)]
    _native.planes_split(pieces, split)
    planes, parts = [], []
    for plane in split:
        packed = _shrunk(plane)
        kind, part = ("zstd", packed) if packed is not None else ("raw", plane)
        planes.append([kind, len(part)])
        parts.append(part)
    return planes, parts


def _shrunk(plane):
    """plane as a zstd frame, or None where that would not shrink it below PLANE_KEEP."""
    n = len(plane)
    if not n:
        return None
    c = _compressor()
    if n > 2 * SAMPLE and len(c.compress(memoryview(plane)[:SAMPLE])) > PLANE_KEEP * SAMPLE:
        return None
    frame = c.compress(plane)
    return frame if len(frame) <= PLANE_KEEP * n else None


def stored_size(planes):
    """The stored bytes of a packed block described by planes."""
    return sum(length for _, length in planes)


def check_planes(planes, width, nbytes):
    """None when planes can describe a block of nbytes bytes of width-byte
    elements, else what is wrong (for the caller's CorruptCheckpoint)."""
    if not isinstance(planes, list) or len(planes) != width:
        return f"planes is not a list of {width}"
    for p in planes:
        if (not isinstance(p, list) or len(p) != 2 or p[0] not in KINDS or type(p[1]) is not int
                or p[1] < 0 or (p[0] == "raw" and p[1] != nbytes // width)):
            return f"plane {p!r} is not [\"raw\", {nbytes // width}] or [\"zstd\", length]"
    return None


def unpack(stored, planes, pieces, path, what):
    """Rebuilds a packed block into pieces (writable buffers in order).

    Args:
        stored: the block's stored bytes (a buffer of stored_size(planes)).
        planes: its planes' description, checked (check_planes).
        path, what: name the block in errors.

    Raises:
        CorruptCheckpoint: "bad_payload" when a plane's frame does not
            decompress to exactly one plane's bytes.
    """
    mv = memoryview(stored).cast("B")
    n = sum(memoryview(b).nbytes for b in pieces) // len(planes)
    if mv.nbytes != stored_size(planes):
        raise CorruptCheckpoint("bad_payload", path, f"{what}: {mv.nbytes} stored bytes, its planes "
                                f"{stored_size(planes)}")
    out, at = [], 0
    for kind, length in planes:
        part = mv[at:at + length]
        at += length
        out.append(part if kind == "raw" else _inflate(part, n, path, what))
    _native.planes_join(out, pieces)


def _inflate(frame, n, path, what):
    """One plane of n bytes from its zstd frame.  The frame must say its
    size (every frame pack writes does), and say n: zstd sizes its output
    by the frame's word, so a frame that claimed more would allocate it."""
    z = _zstd()
    try:
        size = z.frame_content_size(frame)
        if size != n:
            raise CorruptCheckpoint("bad_payload", path, f"{what}: a plane's frame holds {size} bytes, not {n}")
        plane = _decompressor().decompress(frame, max_output_size=n, allow_extra_data=False)
    except z.ZstdError as e:
        raise CorruptCheckpoint("bad_payload", path, f"{what}: a plane does not decompress: {e}") from None
    if len(plane) != n:
        raise CorruptCheckpoint("bad_payload", path, f"{what}: a plane decompresses to {len(plane)} bytes, not {n}")
    return plane
