"""How a store turns a file into bytes and back: the Codec protocol, and the plain codec.

Every part of a store (the reader, the saver, the evictor) meets a file's
encoding through one small object:

    key_id                      the id of the key the store writes with (None: plain)
    name_key                    the kvstore.names.NameKey the store names its texts under
    abis                        the payload ABIs a lookup may offer
    key_of(entry)               the NameKey an entry's name was made with
    lookup_keys()               the NameKeys a lookup hashes a prompt under, the store's own first
    open(fd, st, entry)         (a Source of the file's plain bytes, its plain Entry)
    rewrites_in_place(entry)    whether a trailer or reason byte may change in the file itself
    stage(path, header, text, plan, trailer_raw, head, lookup_tag)
                                a new file written under a temporary name, not yet
                                published (a kvstore.publish.TempFile holding its Entry)
    current(path)               the file's envelope now, authenticated where the codec can
    verify_file(path, name)     None when the file is sound, else a one-line reason

PlainCodec is the default.  Other codecs (kvstore.seal's) register a maker
with register_codec from the room above the store, as the remote tier
registers its opener; make_codec picks one by the store's key.  Nothing
here or below knows any other codec exists.
"""

import dataclasses
from typing import Protocol

from kvstore import files, publish
from kvstore.format import LOADABLE_ABIS, envelope_now

# Makers of keyed codecs, registered by their own package (kvstore.seal):
# callable(key, identity, accept_unsealed, accept_unidentified) -> Codec.
_KEYED = []


class Codec(Protocol):
    """What the store's parts need from a file's encoding (see the module docstring)."""

    key_id: object
    name_key: object
    abis: frozenset

    def key_of(self, entry): ...

    def lookup_keys(self): ...

    def open(self, fd, st, entry): ...

    def rewrites_in_place(self, entry): ...

    def stage(self, path, header, text, plan, trailer_raw=b"", head=b"", lookup_tag=b""): ...

    def current(self, path): ...

    def verify_file(self, path, name=None): ...


class PlainCodec:
    """Files as they are: SHA1 names (or a model's keyed names), bytes read in place.

    Args:
        identity: the store's kvstore.identity.ModelIdentity, or None.
        accept_unidentified: lookups also offer files that name no model.
    """

    key_id = None
    abis = LOADABLE_ABIS

    def __init__(self, identity=None, accept_unidentified=False):
        self.identity = identity
        self.accept_unidentified = accept_unidentified
        self.name_key = None if identity is None else identity.names

    def key_of(self, entry):
        """The NameKey entry's name was made with: its model's, or None (SHA1)."""
        return self.identity.names if entry.model_tag and self.identity is not None else None

    def lookup_keys(self):
        keys = [self.name_key] + ([None] if self.accept_unidentified else [])
        return tuple(dict.fromkeys(keys))

    def open(self, fd, st, entry):
        return fd, entry

    def rewrites_in_place(self, entry):
        return True

    def stage(self, path, header, text, plan, trailer_raw=b"", head=b"", lookup_tag=b""):
        return publish.stage_checkpoint(path, header, text, plan, trailer_raw, head)

    def current(self, path):
        return envelope_now(path)

    def verify_file(self, path, name=None):
        return files.verify_file(path, name=name)


def register_codec(maker):
    """Makes KVStore(key=...) build its codec with maker.

    Args:
        maker: callable(key, identity, accept_unsealed, accept_unidentified)
            returning a Codec; it raises kvstore.errors.BadKey for a bad key.
    """
    if maker not in _KEYED:
        _KEYED.append(maker)


def make_codec(key, identity, accept_unsealed=False, accept_unidentified=False):
    """The codec of a store opened with key (None: the plain codec).

    Raises:
        ValueError: a key was given and no keyed codec is registered.
    """
    accept_unidentified = bool(accept_unidentified) and identity is not None
    if key is None:
        return PlainCodec(identity, accept_unidentified)
    if not _KEYED:
        raise ValueError("key= needs a keyed codec; none is registered (import kvstore.seal)")
    return _KEYED[-1](key, identity, bool(accept_unsealed), accept_unidentified)


def stored_entry(plain, st, entry):
    """The Entry of a stored file seen through its plain view: the plain
    view's fields (which the codec vouched for: token digests, lengths),
    the stored file's payload ABI and size.  plain itself when the file is
    read as it is."""
    if plain is entry:
        return plain
    return dataclasses.replace(plain, payload_abi=entry.payload_abi, file_size=st.st_size)
