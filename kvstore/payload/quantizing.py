"""Quantised blocks: a float tensor block stored lossy, group-wise affine.

The block's elements, in order, fall in groups of GROUP (the first of
GROUPS that divides the block); a group of values x is stored as the
unsigned integers q = round((x - bias) * (1 / scale)), bits wide, with
bias = min(x) and scale = (max(x) - min(x)) / (2**bits - 1), as MLX's own
mx.quantize stores a matrix along its last axis.  A chain block's rows are
whole head vectors, so for a head_dim that GROUP divides (64, 128, 256)
each group is a slice of one token's vector in one head, as mx.quantize
and mlx-lm's QuantizedKVCache group them.  scale and bias are kept in the
tensor's dtype (a 16-bit float beside 16-bit KV): 8 bits store 64 + 4
bytes a group of 128, 0.53 of the raw bytes; 4 bits 32 + 4, 0.28.

The stored form is the integers (8 bits: one byte each; 4 bits: two a
byte, the earlier in the low nibble), then every group's scale, then every
group's bias.  The bias, a value of the dtype, is kept exactly and the
scale rounded up into the dtype, so every value of the group stays inside
the range the integers span.

A block that holds a value that is not finite, or whose range does not fit
the dtype, is not quantised (the caller stores it raw): a restore never
hands a NaN back for a value that was a number.

Restoring multiplies out into the tensor's dtype (bfloat16 rounded to the
nearest even, as MLX casts); the canary (kvstore.mlx.canary) then checks
the state with the tolerance of the codec (LOSSY_TOLERANCE there).  Both
directions run in C with the GIL released (csrc/quant.c; its NumPy twin is
tests/reference.py: quantize, dequantize).
"""

from kvstore import _native
from kvstore.errors import CorruptCheckpoint
from kvstore.payload.buffers import thread_scratch

BITS = {"q8": 8, "q4": 4}
GROUPS = (64, 32, 16)
QUANTIZABLE = frozenset({"bfloat16", "float16", "float32"})
MIN_BYTES = 1 << 10
_WIDTH = {"bfloat16": 2, "float16": 2, "float32": 4}


def quantizable(dtype, nbytes):
    """Whether a tensor block of dtype and nbytes is tried quantised."""
    return dtype in QUANTIZABLE and nbytes >= MIN_BYTES and group_of(nbytes // _WIDTH[dtype]) is not None


def group_of(count):
    """The group size of a block of count elements, or None when none divides it."""
    return next((g for g in GROUPS if count and count % g == 0), None)


def stored_size(count, dtype, bits, group):
    """The stored bytes of a quantised block of count elements."""
    return count * bits // 8 + 2 * (count // group) * _WIDTH[dtype]


def pack(pieces, dtype, codec):
    """The quantised form of a block of dtype laid in pieces
    (kvstore._native.quantize, GIL released).

    Returns:
        (desc, parts): desc {"group": g} for the manifest, parts the stored
        bytes as buffers in order (integers, scales, biases); None where the
        block is not quantised (a value not finite, a range the dtype
        cannot hold).
    """
    views = [memoryview(b).cast("B") for b in pieces]
    n = sum(v.nbytes for v in views)
    count = n // _WIDTH[dtype]
    group = group_of(count)
    if group is None:
        return None
    bits, groups = BITS[codec], count // group
    q, scales, biases = bytearray(count * bits // 8), bytearray(groups * _WIDTH[dtype]), \
        bytearray(groups * _WIDTH[dtype])
    runs = _runs(views, dtype, bits, group)
    if runs is None:                                # a piece ends inside a group: end to end first
        src = thread_scratch("quantize", n)
        _native.planes_split(views, [src])          # one plane of whole bytes: the pieces end to end
        views, runs = [src], _runs([src], dtype, bits, group)
    qv, sv, bv = memoryview(q), memoryview(scales), memoryview(biases)
    for v, (qs, gs) in zip(views, runs):
        if not _native.quantize(v, dtype, bits, group, qv[qs], sv[gs], bv[gs]):
            return None
    return {"group": group}, [q, scales, biases]


def _runs(pieces, dtype, bits, group):
    """[(slice of the integers, slice of the scales and biases)] of each
    piece, in order, or None when a piece is not whole groups."""
    w, out, at = _WIDTH[dtype], [], 0
    for p in pieces:
        c = memoryview(p).nbytes // w
        if c % group:
            return None
        out.append((slice(at * bits // 8, (at + c) * bits // 8), slice(at // group * w, (at + c) // group * w)))
        at += c
    return out


def check(desc, codec, dtype, nbytes):
    """(stored bytes, group) of a quantised block's description, or the
    error text (for the caller's CorruptCheckpoint)."""
    if dtype not in QUANTIZABLE:
        return f"a {codec} block of dtype {dtype}"
    count = nbytes // _WIDTH[dtype]
    group = desc.get("group")
    if group not in GROUPS or count % group:
        return f"group {group!r} is not one of {GROUPS} dividing its {count} elements"
    return stored_size(count, dtype, BITS[codec], group), group


class Form:
    """How one quantised block is restored (the manifest's row, checked)."""

    __slots__ = ("codec", "dtype", "group")

    def __init__(self, codec, dtype, group):
        self.codec, self.dtype, self.group = codec, dtype, group

    def native_for(self, run):
        """The form as csrc/packed.h reads it, ("quant", bits, dtype,
        group), where a run of run bytes is whole groups (a chain block's
        rows: whole head vectors); else None (restored by unpack)."""
        if run % _WIDTH[self.dtype] or (run // _WIDTH[self.dtype]) % self.group:
            return None
        return ("quant", BITS[self.codec], self.dtype, self.group)

    def unpack(self, stored, dst, runs, path, what):
        """Restores the block from its stored bytes into dst at runs
        (offset, run, count, stride: kvstore.payload.forms)."""
        offset, run, count, stride = runs
        pieces = [dst[offset + r * stride:offset + r * stride + run] for r in range(count)]
        mv = memoryview(stored).cast("B")
        count = sum(memoryview(p).nbytes for p in pieces) // _WIDTH[self.dtype]
        bits, w = BITS[self.codec], _WIDTH[self.dtype]
        size = stored_size(count, self.dtype, bits, self.group)
        if count % self.group or mv.nbytes != size:
            raise CorruptCheckpoint("bad_payload", path, f"{what}: {mv.nbytes} stored bytes for "
                                    f"{count} elements of {self.codec}")
        nq, ng = count * bits // 8, count // self.group
        q, scales, biases = mv[:nq], mv[nq:nq + ng * w], mv[nq + ng * w:]
        runs = _runs(pieces, self.dtype, bits, self.group)
        if runs is not None:                        # each piece straight from its groups
            for p, (qs, gs) in zip(pieces, runs):
                _native.dequantize(q[qs], scales[gs], biases[gs], self.dtype, bits, self.group, p)
            return
        out = thread_scratch("dequantize", count * w)
        _native.dequantize(q, scales, biases, self.dtype, bits, self.group, out)
        _native.planes_join([out], pieces)
