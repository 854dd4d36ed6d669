"""The payload header and manifest: what a payload's tensors are and where they lie (docs/format.md §3, §14).

Layout, offsets relative to the payload start P = 52 + text length:

    0   "KVTP"                 magic
    4   u32 M                  manifest length
    8   u64 D                  data offset; P + D is a multiple of 4096
    16  u32                    CRC32C of the manifest bytes
    20  u32                    reserved, 0
    24  M bytes                manifest, UTF-8 JSON
    D   ...                    token ids (u32 LE), then each tensor; every
                               block starts at a file offset that is a
                               multiple of 64

An ABI 17 block holds the same structure after its 64-byte chain header.

read_manifest checks the header and the manifest against the file's
geometry and returns a Manifest, every offset and length bounded by the
payload.  The writing side (kvstore.payload.plan) lays out the same
manifest from the arrays.
"""

import collections
import copy
import json
import re
import struct
import threading

import numpy as np

from kvstore import _native
from kvstore.errors import CorruptCheckpoint
from kvstore.payload import forms
from kvstore.payload.buffers import pread

MAGIC = b"KVTP"
PAYLOAD_HEADER = struct.Struct("<4sIQII")     # 24 bytes
VERSION = 1

# File-offset alignment of the data start (a page, so the data can be mapped
# or read with O_DIRECT) and of every block (a cache line / SIMD width).
DATA_ALIGN = 4096
BLOCK_ALIGN = 64

# NumPy (and MLX) refuse an array whose dimensions, zeros taken as one,
# multiply past a signed 64-bit byte count, even when a zero dimension makes it
# empty: a manifest shape like [0, 2**62] is corruption, not an empty tensor.
MAX_ARRAY_BYTES = 2**63 - 1

# No manifest this big is ever written (a 400-layer model with 10 tensors per
# layer is ~0.5 MB); a larger length field is corruption, not a manifest.
MAX_MANIFEST_BYTES = 64 << 20

# The longest model identity a manifest may carry (kvstore.identity.MAX_IDENTITY_CHARS).
MAX_MODEL_CHARS = 1024

# dtype name (MLX's) -> (item size, safetensors code)
DTYPES = {
    "bool": (1, "BOOL"), "uint8": (1, "U8"), "uint16": (2, "U16"),
    "uint32": (4, "U32"), "uint64": (8, "U64"), "int8": (1, "I8"),
    "int16": (2, "I16"), "int32": (4, "I32"), "int64": (8, "I64"),
    "float16": (2, "F16"), "bfloat16": (2, "BF16"), "float32": (4, "F32"),
    "float64": (8, "F64"), "complex64": (8, "C64"),
}


def align(x, a):
    """x rounded up to a multiple of a."""
    return (x + a - 1) // a * a


def numpy_dtype(dtype):
    """The little-endian NumPy dtype a stored dtype name is read as."""
    if dtype == "bfloat16":
        # NumPy has no bfloat16: the bits come back as uint16 (documented).
        return np.dtype("<u2")
    return np.dtype(dtype).newbyteorder("<")


def _label(i):
    return "tokens" if i < 0 else f"tensor {i}"


class _Blocks:
    """The blocks of one manifest as they are checked: each one inside the
    payload data and aligned as it comes, then all of them for overlaps."""

    def __init__(self, path, base, limit, data_offset, codecs=frozenset()):
        self.path, self.base, self.limit, self.data_offset = path, base, limit, data_offset
        self.codecs = codecs        # those the file's ABI may pack tensors with
        self.seen = []              # (offset, nbytes, index)

    def take(self, d, i, stored=None):
        """(offset, nbytes, crc32c) of the block d describes, checked.

        i: the tensor's index, -1 for the tokens (names the block in errors).
        stored: a packed block's bytes in the file (its nbytes are what it
            unpacks to).
        """
        path = self.path
        if not isinstance(d, dict):
            raise CorruptCheckpoint("bad_manifest", path, f"{_label(i)} is not an object")
        off, n, crc = d.get("offset"), d.get("nbytes"), d.get("crc32c")
        if type(off) is not int or type(n) is not int or type(crc) is not int or min(off, n, crc) < 0:
            k = next(k for k, v in (("offset", off), ("nbytes", n), ("crc32c", crc))
                     if type(v) is not int or v < 0)
            raise CorruptCheckpoint("bad_manifest", path, f"{_label(i)}.{k} is not a non-negative int")
        self.place(off, n if stored is None else stored, crc, i)
        return off, n, crc

    def place(self, off, n, crc, i):
        """(off, n, crc) of block i, non-negative ints, checked: a CRC32C
        in range, inside the payload data, aligned."""
        path, limit = self.path, self.limit
        if crc > 0xFFFFFFFF or (n == 0 and crc != 0):
            # An empty block's CRC32C is 0: the readers skip empty blocks, so
            # any other value is a manifest that verify and load would judge apart.
            raise CorruptCheckpoint("bad_manifest", path, f"{_label(i)}.crc32c out of range")
        if off < self.data_offset or n > limit or off > limit - n:
            raise CorruptCheckpoint("bad_manifest", path, f"{_label(i)} lies outside the payload data")
        if (self.base + off) % BLOCK_ALIGN:
            raise CorruptCheckpoint("bad_manifest", path, f"{_label(i)} is not {BLOCK_ALIGN}-byte aligned")
        self.seen.append((off, n, i))
        return off, n, crc

    def check_overlaps(self):
        blocks = sorted(self.seen)
        for (o1, n1, w1), (o2, _, w2) in zip(blocks, blocks[1:]):
            if o1 + n1 > o2:
                raise CorruptCheckpoint("bad_manifest", self.path, f"{_label(w1)} overlaps {_label(w2)}")


def _parse(raw, path):
    """The manifest's JSON object, version 1."""
    try:
        m = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise CorruptCheckpoint("bad_manifest", path, "manifest is not UTF-8 JSON") from None
    except RecursionError:
        # Deep nesting ("[[[[…") exhausts the JSON scanner's stack.
        raise CorruptCheckpoint("bad_manifest", path, "manifest JSON is nested too deeply") from None
    if not isinstance(m, dict) or m.get("version") != VERSION:
        raise CorruptCheckpoint("bad_manifest", path, "manifest version is not 1")
    return m


def _tokens_block(m, path, stored):
    """The tokens block, its nbytes implied by a count that must be the header's."""
    tok = m.get("tokens")
    if not isinstance(tok, dict) or type(tok.get("count")) is not int:
        raise CorruptCheckpoint("bad_manifest", path, "tokens block missing")
    if tok["count"] != stored:
        raise CorruptCheckpoint("token_count", path, f"manifest has {tok['count']} tokens, header {stored}")
    return dict(tok, nbytes=4 * tok["count"])


def _shape_size(shape, item, i, path):
    """The element count of tensor i's shape (a list of at most 16 sizes)."""
    if not isinstance(shape, list) or len(shape) > 16:
        raise CorruptCheckpoint("bad_manifest", path, f"tensor {i} has a bad shape")
    size, nonzero = 1, 1
    for d in shape:
        if type(d) is not int or d < 0:
            raise CorruptCheckpoint("bad_manifest", path, f"tensor {i} has a bad shape")
        size *= d
        nonzero *= d or 1
    if nonzero * item > MAX_ARRAY_BYTES:
        raise CorruptCheckpoint("bad_manifest", path, f"tensor {i} has a bad shape")
    return size


def _tensor_row(t, i, names, blocks, stored):
    """Tensor i's row, checked: ((name, dtype, shape, offset, nbytes, crc32c), its axis or None).

    names: the names met so far; this one is added.
    """
    path = blocks.path
    if not isinstance(t, dict):
        raise CorruptCheckpoint("bad_manifest", path, f"tensor {i} is not an object")
    name, dtype, shape = t.get("name"), t.get("dtype"), t.get("shape")
    if not isinstance(name, str) or name in names:
        raise CorruptCheckpoint("bad_manifest", path, f"tensor {i} has a missing or repeated name")
    names.add(name)
    item = DTYPES.get(dtype, (None,))[0] if isinstance(dtype, str) else None
    if item is None:
        raise CorruptCheckpoint("bad_manifest", path, f"tensor {i} has unknown dtype")
    size = _shape_size(shape, item, i, path)
    packed = _packed(t, i, item, blocks)
    off, n, crc = blocks.take(t, i, None if packed is None else packed[0])
    if size * item != n:
        raise CorruptCheckpoint("bad_manifest", path, f"tensor {i} nbytes does not match its shape")
    axis = None
    if "axis" in t:
        axis = t["axis"]
        if type(axis) is not int or not 0 <= axis < len(shape) or shape[axis] != stored:
            raise CorruptCheckpoint("bad_manifest", path,
                                    f"tensor {i}: axis {axis!r} does not hold the file's tokens")
    return (name, dtype, tuple(shape), off, n, crc), axis, packed


def _packed(t, i, item, blocks):
    """(stored bytes, Form) of tensor i when it is packed
    (kvstore.payload.forms), checked; None when it is stored raw."""
    p = t.get("packed")
    if p is None:
        return None
    path = blocks.path
    if not blocks.codecs:
        raise CorruptCheckpoint("bad_manifest", path, f"tensor {i} is packed in a file whose ABI packs nothing")
    n = t.get("nbytes")
    got = forms.parse(p, t.get("dtype"), item, n, blocks.codecs) if type(n) is int and n >= 0 \
        else "nbytes is not a count"
    if isinstance(got, str):
        raise CorruptCheckpoint("bad_manifest", path, f"tensor {i}: {got}")
    return got


def _optional_fields(m, path, stored):
    """(meta, cuts, model) of the manifest, each checked."""
    meta = m.get("meta", {})
    if not isinstance(meta, dict):
        raise CorruptCheckpoint("bad_manifest", path, "meta is not an object")
    # Optional: where the sequence may be cut into blocks (an exported
    # chain's boundaries): [[tokens, text length], ...], both growing.
    cuts = m.get("cuts", [])
    if not isinstance(cuts, list) or len(cuts) > stored or not all(
            isinstance(c, list) and len(c) == 2 and all(type(v) is int and v > 0 for v in c) for c in cuts):
        raise CorruptCheckpoint("bad_manifest", path, "cuts is not a list of [tokens, text length] pairs")
    cuts = {t: n for t, n in cuts if t <= stored}
    # Optional: the identity of the model that made the state (docs/semantics.md §17).
    model = m.get("model")
    if model is not None and (not isinstance(model, str) or not 0 < len(model) <= MAX_MODEL_CHARS):
        raise CorruptCheckpoint("bad_manifest", path, "model is not a string of 1..1024 characters")
    return meta, cuts, model


class Manifest:
    """A validated manifest: every offset and length bounded by the payload."""

    @property
    def rows(self):
        """The tensor rows by name."""
        rows = self.__dict__.get("_rows")
        if rows is None:
            rows = self._rows = {r[0]: r for r in self.tensors}
        return rows

    def __init__(self, raw, entry, data_offset):
        path, stored = entry.path, entry.stored_tokens
        m = _parse(raw, path)
        blocks = _Blocks(path, entry.tensors_offset, entry.tensors_bytes, data_offset,
                          forms.codecs_of_abi(entry.payload_abi))
        self.tokens = blocks.take(_tokens_block(m, path, stored), -1)
        tensors = m.get("tensors")
        if not isinstance(tensors, list):
            raise CorruptCheckpoint("bad_manifest", path, "tensors is not a list")
        self.axes = {}
        self.tensors = []
        self.packed = {}            # name -> (stored bytes, Form) of a packed tensor
        names = set()
        for i, t in enumerate(tensors):
            row, axis, packed = _tensor_row(t, i, names, blocks, stored)
            if axis is not None:
                self.axes[row[0]] = axis
            if packed is not None:
                self.packed[row[0]] = packed
            self.tensors.append(row)
        blocks.check_overlaps()
        self.meta, self.cuts, self.model = _optional_fields(m, path, stored)

    def placed(self, values, entry, data_offset):
        """This manifest with other offsets and CRCs, checked as the full
        check would (_Blocks.place, then overlaps) against entry's geometry.

        values: [(field, digits)] as _values_apart cut them out of a manifest
        whose other bytes are this one's: "offset" and "crc32c" of the
        tokens' block, then of each tensor in turn.
        """
        blocks = _Blocks(entry.path, entry.tensors_offset, entry.tensors_bytes, data_offset)
        ints = [int(v) for _, v in values]
        out = copy.copy(self)
        out.__dict__.pop("_rows", None)
        out.tokens = blocks.place(ints[0], self.tokens[1], ints[1], -1)
        out.tensors = [(*r[:3], ints[2 * k + 2], r[4],
                        blocks.place(ints[2 * k + 2], self.packed[r[0]][0] if r[0] in self.packed else r[4],
                                     ints[2 * k + 3], k)[2])
                       for k, r in enumerate(self.tensors)]
        blocks.check_overlaps()
        return out

    def values(self):
        """[(field, value)]: the offset and CRC of the tokens' block, then of each tensor."""
        out = [("offset", self.tokens[0]), ("crc32c", self.tokens[2])]
        for r in self.tensors:
            out += [("offset", r[3]), ("crc32c", r[5])]
        return out


# Validated manifests of chain blocks met before, by their bytes and the
# geometry they were checked against (see read_manifest's cached).
_MANIFESTS = collections.OrderedDict()
_MANIFESTS_MAX = 4096
_manifests_lock = threading.Lock()

# The blocks of a chain have manifests alike but for their offsets and
# CRCs: the same tensors and shapes.  A manifest as kvstore writes it (the
# tokens' block first) whose bytes, with the digits of every offset and CRC
# cut out, are those of one validated before (with as many tokens) is that
# one with its own offsets and CRCs, checked (Manifest.placed): its JSON is
# not parsed nor its rows checked again, which in a fresh process is most
# of the planning of a chain load (a chain of 132 blocks of 122 tensors:
# 16,000 rows).  An offset or a CRC is a JSON integer; any other spelling
# leaves its digits in the template, which then matches no validated one.
_TEMPLATES = collections.OrderedDict()
_TEMPLATES_MAX = 256
_TEMPLATE_HEAD = b'{"version":1,"tokens":{'
# A block's offset (followed by its nbytes, or the tokens' count) and any
# CRC: the meta's "offset" of each cache layer is not one of them.
_PLACE_FIELD = re.compile(rb'"(offset)":(0|[1-9][0-9]*)(?=,"(?:nbytes|count)":)|"(crc32c)":(0|[1-9][0-9]*)(?=[,}])')


def _values_apart(raw):
    """(raw with the digits of every block's offset and CRC cut out and the
    spaces that pad it to its length dropped, [(field, digits)] in order)."""
    values = []

    def cut(m):
        field = m.group(1) or m.group(3)
        values.append((field.decode(), m.group(2) or m.group(4)))
        return b'"%s":' % field
    return _PLACE_FIELD.sub(cut, raw).rstrip(b" "), values


def _remember(table, key, value, limit):
    with _manifests_lock:
        table[key] = value
        while len(table) > limit:
            table.popitem(last=False)


def _lookup(table, key):
    with _manifests_lock:
        value = table.get(key)
        if value is not None:
            table.move_to_end(key)
        return value


def _pread(src, n, offset, first):
    """n bytes of src at offset: sliced from first (the file's first bytes) when it holds them."""
    if offset + n <= len(first):
        return first[offset:offset + n]
    return pread(src, n, offset)


def read_manifest(fd, entry, cached=False, first=b""):
    """Reads and validates the payload header and manifest of an open checkpoint.

    cached: a manifest with the same bytes, checked against the same file
    geometry before, is not parsed again (its CRC is checked as always).
    For a chain's middle blocks, whose tensors and tokens only are read:
    the Manifest returned may be shared, and must not be changed.
    first: the file's first bytes, read already (a plain file's, never a
    sealed one's): what they hold is not read again.
    """
    path, P, size = entry.path, entry.tensors_offset, entry.tensors_bytes
    if size < PAYLOAD_HEADER.size:
        raise CorruptCheckpoint("bad_payload", path, "payload shorter than its header")
    head = _pread(fd, PAYLOAD_HEADER.size, P, first)
    if len(head) < PAYLOAD_HEADER.size:
        raise CorruptCheckpoint("truncated", path, "payload header cut short")
    magic, mlen, data_offset, mcrc, _ = PAYLOAD_HEADER.unpack(head)
    if magic != MAGIC:
        raise CorruptCheckpoint("bad_payload_magic", path, "payload is not KVTP")
    if mlen > MAX_MANIFEST_BYTES or PAYLOAD_HEADER.size + mlen > size:
        raise CorruptCheckpoint("bad_payload", path, f"manifest length {mlen} exceeds the payload")
    if data_offset < PAYLOAD_HEADER.size + mlen or data_offset > size \
            or (P + data_offset) % DATA_ALIGN:
        raise CorruptCheckpoint("bad_payload", path, f"data offset {data_offset} is invalid")
    raw = _pread(fd, mlen, P + PAYLOAD_HEADER.size, first)
    if len(raw) != mlen:
        raise CorruptCheckpoint("truncated", path, "manifest cut short")
    if _native.crc32c(raw) != mcrc:
        raise CorruptCheckpoint("crc", path, "manifest CRC mismatch")
    if not cached:
        return Manifest(raw, entry, data_offset)
    key = (raw, data_offset, P, size, entry.stored_tokens)
    m = _lookup(_MANIFESTS, key)
    if m is not None:
        return m
    shape = None
    if raw.startswith(_TEMPLATE_HEAD):
        template, values = _values_apart(raw)
        shape = (template, entry.stored_tokens)
        like = _lookup(_TEMPLATES, shape)
        if like is not None:
            m = like.placed(values, entry, data_offset)
    if m is None:
        m = Manifest(raw, entry, data_offset)
        if shape is not None and m.values() == [(f, int(v)) for f, v in values]:
            _remember(_TEMPLATES, shape, m, _TEMPLATES_MAX)
    _remember(_MANIFESTS, key, m, _MANIFESTS_MAX)
    return m
