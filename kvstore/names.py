"""How a checkpoint file is named (docs/format.md §2, §16; docs/semantics.md §17).

A file is named by a 20-byte digest of its whole text, made one of three ways:

- SHA1(text): a plain file that names no model (ds4's files, kvstore's own
  before model identities, and every file of a store opened without one);
- SHA1(K ^ ipad || text), the inner hash of HMAC-SHA1 under a model's
  namespace key K: a plain file of that model.  Two models that store the
  same text write two files, and a lookup that hashes the prompt in one
  model's namespace never matches the other's names.  Starting from the
  state after the one key block, the pass over a prompt costs what a plain
  SHA1 pass does;
- HMAC-SHA1(K, text) under a sealed store's name key (per key and model):
  names that only the key's holder can compute.

A NameKey says which of the last two; None stands for plain SHA1.  The
digests come from kvstore._native in one pass over the text, whatever the
number of lengths.
"""

import dataclasses
import hashlib

from kvstore import _native

_BLOCK = 64              # SHA1's block: an HMAC key is padded to it


@dataclasses.dataclass(frozen=True)
class NameKey:
    """The key of keyed names: HMAC-SHA1 names, or with inner=True their inner hashes."""
    key: bytes
    inner: bool = False

    def __repr__(self):
        # Never print key bytes (a sealed store's name key is secret).
        return f"NameKey({'namespace' if self.inner else 'hmac'})"


def native_args(key):
    """(key bytes or None, inner) as kvstore._native's digest functions take them."""
    return (None, False) if key is None else (key.key, key.inner)


def name_of(text, key=None):
    """The 20-byte name digest of text under key (a NameKey, or None: SHA1)."""
    k, inner = native_args(key)
    return _native.sha1(text, k, inner)


def names_of(text, lengths, key=None):
    """(names, lookup tags) of the prefixes of text of the given lengths.

    Names are the digests under key, in one pass.  Tags are b"" but for HMAC
    names, whose lookup tags are the first _native.LOOKUP_TAG bytes of each
    name's inner hash (docs/format.md §16).
    """
    k, inner = native_args(key)
    names = _native.sha1_prefixes(text, lengths, k, inner)
    if k is None or inner:
        return names, [b""] * len(names)
    tags = _native.sha1_prefixes(text, lengths, k, inner=True)
    return names, [d[:_native.LOOKUP_TAG] for d in tags]


def hasher(key=None):
    """A hashlib SHA1 object that, fed a text in pieces, gives its name under
    key: None (SHA1) or a namespace (inner=True); the C passes' reference.

    Raises:
        ValueError: an HMAC key (those names need the key's outer block).
    """
    h = hashlib.sha1()
    if key is not None:
        if not key.inner:
            raise ValueError("HMAC names are not a plain SHA1 stream")
        # HMAC's inner hash: the key, zero-padded to one block, XOR 0x36.
        k = key.key if len(key.key) <= _BLOCK else hashlib.sha1(key.key).digest()
        h.update(bytes(b ^ 0x36 for b in k.ljust(_BLOCK, b"\0")))
    return h


def named_prefixes(entries, text, key_of):
    """The entries whose name is the digest of text's prefix of their length
    (under the NameKey key_of gives each): the ones text continues."""
    out = []
    for key in {key_of(e) for e in entries}:
        mine = [e for e in entries if key_of(e) == key]
        digests, _ = names_of(text, [e.text_bytes for e in mine], key)
        out.extend(e for e, dg in zip(mine, digests) if dg.hex() == e.sha)
    return out


__all__ = ["NameKey", "native_args", "name_of", "names_of", "named_prefixes", "hasher"]
