"""A tensor block's stored form (docs/format.md §20): raw, packed lossless
(kvstore.payload.packing: byte planes and zstd) or quantised lossy
(kvstore.payload.quantizing: q8, q4).

pack() is what a save makes of a block for the store's kv_codec; parse()
reads a manifest row's "packed" object back, checked, into the block's
stored size and a Form that restores it.  The file's payload ABI says which
codecs its rows may name (codecs_of_abi): a quantised block makes a file
of ABI 145, which no build before quantised blocks loads.
"""

from kvstore.format import PAYLOAD_ABI_LOSSY_CHAIN, PAYLOAD_ABI_PACKED_CHAIN
from kvstore.payload import packing, quantizing

KV_CODECS = ("raw", "lossless", "q8", "q4")
LOSSY = tuple(quantizing.BITS)
_LOSSLESS = frozenset({packing.CODEC})


def codecs_of_abi(abi):
    """The codecs a manifest row of a file of payload ABI abi may name."""
    if abi == PAYLOAD_ABI_PACKED_CHAIN:
        return _LOSSLESS
    if abi == PAYLOAD_ABI_LOSSY_CHAIN:
        return _LOSSLESS | frozenset(LOSSY)
    return frozenset()


def abi_of(codecs, plain_abi):
    """The payload ABI of a chain block whose rows name codecs."""
    if any(c in LOSSY for c in codecs):
        return PAYLOAD_ABI_LOSSY_CHAIN
    return PAYLOAD_ABI_PACKED_CHAIN if codecs else plain_abi


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
        return ({"codec": packing.CODEC, "stored": size, "planes": planes}, parts) if size < nbytes else None
    got = quantizing.pack(pieces, dtype, kv_codec)
    if got is None:
        return None
    desc, parts = got
    return {"codec": kv_codec, "stored": sum(len(p) for p in parts), **desc}, parts


class _Planes:
    """How one lossless block is restored (its planes, checked)."""

    __slots__ = ("codec", "planes")

    def __init__(self, planes):
        self.codec, self.planes = packing.CODEC, planes

    def unpack(self, stored, pieces, path, what):
        packing.unpack(stored, self.planes, pieces, path, what)


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
