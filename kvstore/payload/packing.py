"""Packed blocks: a tensor block stored as byte planes, the compressible
ones as table planes.

A block of elements W bytes wide is split into W byte planes (plane p holds
byte p of every element: kvstore._native.planes_split).  Each plane is
stored as a table plane (csrc/table.h: 4-bit codes into the plane's 16 most
common values, the other bytes listed as exceptions) or, where that would
not bring it below PLANE_KEEP of its size, as it is.  For the 16-bit floats
of a KV cache the high plane (the sign and seven of the eight exponent bits
of bfloat16) takes few values and halves; the low plane (the mantissa) is
close to random and stays raw: a block stores about 0.75 of its bytes.

The stored form of a block is its planes' stored bytes end to end; what
each one is (["table", length] or ["raw", length]) is the caller's to
record (the manifest's "planes").  unpack() checks that description and
every table plane's form before it writes a byte; a plane that does not
hold is CorruptCheckpoint, never bytes in the destination.

Why a table and not a general compressor (bench/lossless.py measures them
on the zoo's blocks and on a trained model's KV): zstd over the same plane
stores it in 0.37 of its size against the table's 0.50, so a block in 0.69
against 0.75, but decodes at about 1 GB/s a core here, so a load from a
warm page cache took 2.7 times a raw one's on 2 cores; LZ4 keeps its speed
but not the bytes (0.83 of the block); Blosc2 does the shuffle and threads
itself but brings an HTTP client, pydantic and rich with it.  The table
decodes with one byte shuffle per sixteen values (SSSE3, NEON), so
rebuilding a block costs what copying it does and the reads it saves are
all gain.
"""

from kvstore import _native
from kvstore.errors import CorruptCheckpoint

CODEC = "table-planes"
# A plane the table cannot bring below this share of its size is stored
# raw: its bytes would hardly shrink and its rebuild would cost a lookup.
PLANE_KEEP = 0.9
KINDS = ("raw", "table")
# A plane longer than twice this is first tried on its first SAMPLE bytes:
# one the sample shows does not pay (the mantissa's) is stored raw without
# counting all of it.
SAMPLE = 64 << 10
# What is packed: the float dtypes of a KV cache, in blocks of at least
# MIN_BYTES (a table plane's head is 20 bytes; a block of a real model's KV
# is 64 KiB or more a tensor).
PACKABLE = frozenset({"bfloat16", "float16", "float32"})
MIN_BYTES = 1 << 10


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
        table = None if n > 2 * SAMPLE and _native.table_pack(memoryview(plane)[:SAMPLE], int(
            PLANE_KEEP * SAMPLE)) is None else _native.table_pack(plane, int(PLANE_KEEP * n))
        kind, part = ("table", table) if table is not None else ("raw", plane)
        planes.append([kind, len(part)])
        parts.append(part)
    return planes, parts


def stored_size(planes):
    """The stored bytes of a packed block described by planes."""
    return sum(length for _, length in planes)


def check_planes(planes, width, nbytes):
    """None when planes can describe a block of nbytes bytes of width-byte
    elements, else what is wrong (for the caller's CorruptCheckpoint).  A
    table plane's own form is checked as it is read (unpack)."""
    if not isinstance(planes, list) or len(planes) != width:
        return f"planes is not a list of {width}"
    for p in planes:
        if (not isinstance(p, list) or len(p) != 2 or p[0] not in KINDS or type(p[1]) is not int
                or p[1] < 0 or (p[0] == "raw" and p[1] != nbytes // width)):
            return f"plane {p!r} is not [\"raw\", {nbytes // width}] or [\"table\", length]"
    return None


def unpack(stored, planes, dst, runs, path, what):
    """Rebuilds a packed block into dst (a writable byte buffer) at runs,
    (offset, run, count, stride): count runs of run bytes, stride apart.

    Args:
        stored: the block's stored bytes (a buffer of stored_size(planes)).
        planes: its planes' description, checked (check_planes).
        path, what: name the block in errors.

    Raises:
        CorruptCheckpoint: "bad_payload" when the stored bytes are not the
            planes' size or a table plane's form does not hold.
    """
    if memoryview(stored).nbytes != stored_size(planes):
        raise CorruptCheckpoint("bad_payload", path, f"{what}: {memoryview(stored).nbytes} stored bytes, "
                                f"its planes {stored_size(planes)}")
    offset, run, count, stride = runs
    _native.table_join(stored, [(kind == "table", length) for kind, length in planes], dst,
                       offset, run, count, stride, path, what)
