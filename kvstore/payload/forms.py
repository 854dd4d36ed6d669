"""A tensor block's stored form (docs/format.md §20): raw, packed lossless
(kvstore.payload.packing: byte planes, table planes where they shrink) or
quantised lossy (kvstore.payload.quantizing: q8, q4).

pack() is what a save makes of a block for the store's kv_codec; parse()
reads a manifest row's "packed" object back, checked, into the block's
stored size and a Form that restores it.  The file's payload ABI says which
codecs its rows may name (codecs_of_abi): packed blocks make a chain block
of ABI 209 or a whole file of 208, quantised ones 145 or 144, which no build
before them loads.

A Form restores its block with unpack(stored, dst, runs, path, what): the
stored bytes into dst, a writable byte buffer, at runs = (offset, run,
count, stride), count runs of run bytes stride apart (a chain block's rows
in the tensor it lands in).
"""

from kvstore.format import LOSSY_ABI_OFFSET, PACKED_ABIS, TABLE_ABI_OFFSET
from kvstore.payload import packing, quantizing

KV_CODECS = ("raw", "lossless", "q8", "q4")
LOSSY = tuple(quantizing.BITS)
# A lossless block that does not come below this share of its bytes is
# stored raw: the bytes saved would not pay for the lookups.
BLOCK_KEEP = 0.9
_LOSSLESS = frozenset({packing.CODEC})


def codecs_of_abi(abi):
    """The codecs a manifest row of a file of payload ABI abi may name: a
    packed whole file (208) or block (209) lossless, a quantised one (144,
    145) the lossy codecs, any other none."""
    if abi not in PACKED_ABIS:
        return frozenset()
    return _LOSSLESS if abi >= TABLE_ABI_OFFSET else frozenset(LOSSY)


def abi_of(codecs, plain_abi):
    """The payload ABI of a whole file (plain_abi 16) or a chain block (17)
    whose rows name codecs (one store writes one kv_codec: lossless and
    lossy rows never meet in a file)."""
    if any(c in LOSSY for c in codecs):
        return plain_abi + LOSSY_ABI_OFFSET
    return plain_abi + TABLE_ABI_OFFSET if codecs else plain_abi


def lossiest(codecs):
    """The lossiest of codecs ("q4" before "q8"), or "" when none is lossy."""
    return next((c for c in sorted(LOSSY, key=quantizing.BITS.get) if c in codecs), "")


def tries(kv_codec, dtype, nbytes, positional):
    """Whether a save with kv_codec tries to pack a block of dtype and nbytes.

    positional: the tensor holds a row per token (K, V, an MLA latent).  A
    lossy codec quantises only those: a snapshot (a recurrent state, a
    sliding window's ring) stays exact, as the canary compares rows only."""
    if kv_codec == "lossless":
        return packing.packable(dtype, nbytes)
    if kv_codec in LOSSY:
        return positional and quantizing.quantizable(dtype, nbytes)
    return False


def pack(kv_codec, dtype, width, nbytes, pieces):
    """A block's packed form for kv_codec: (row, parts), row the manifest's
    "packed" object and parts the stored bytes in order; None to store it
    raw (it would not shrink, or cannot be quantised)."""
    if kv_codec == "lossless":
        planes, parts = packing.pack(pieces, width)
        size = packing.stored_size(planes)
        return ({"codec": packing.CODEC, "stored": size, "planes": planes}, parts) \
            if size <= BLOCK_KEEP * nbytes else None
    got = quantizing.pack(pieces, dtype, kv_codec)
    if got is None:
        return None
    desc, parts = got
    return {"codec": kv_codec, "stored": sum(len(p) for p in parts), **desc}, parts


class _Planes:
    """How one lossless block is restored (its planes, checked).  A chain
    load joins such blocks in one native call per job (native_for)."""

    __slots__ = ("codec", "planes", "native")

    def __init__(self, planes):
        self.codec, self.planes = packing.CODEC, planes
        self.native = [(kind == "table", length) for kind, length in planes]

    def native_for(self, run):
        """The form as csrc/packed.h reads it, [(is_table, stored length)]."""
        return self.native

    def unpack(self, stored, dst, runs, path, what):
        packing.unpack(stored, self.planes, dst, runs, path, what)


def parse(p, dtype, width, nbytes, codecs):
    """(stored bytes, Form) of a manifest row's "packed" object p, or the
    error text (for the caller's CorruptCheckpoint).

    codecs: those the file's ABI allows (codecs_of_abi)."""
    codec = p.get("codec") if isinstance(p, dict) else None
    if codec not in codecs or type(p.get("stored")) is not int:
        return f"packed is not a block of {' or '.join(sorted(codecs)) or 'any codec'}"
    if codec == packing.CODEC:
        bad = packing.check_planes(p.get("planes"), width, nbytes)
        if bad is None and packing.stored_size(p["planes"]) != p["stored"]:
            bad = f"planes hold {packing.stored_size(p['planes'])} bytes, stored says {p['stored']}"
        return bad if bad is not None else (p["stored"], _Planes([tuple(x) for x in p["planes"]]))
    got = quantizing.check(p, codec, dtype, nbytes)
    if isinstance(got, str):
        return got
    size, group = got
    if size != p["stored"]:
        return f"{codec} of {nbytes} bytes in groups of {group} stores {size} bytes, stored says {p['stored']}"
    return size, quantizing.Form(codec, dtype, group)
