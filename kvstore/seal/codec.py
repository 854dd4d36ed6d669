"""SealedCodec: sealing as a kvstore.codec.Codec, registered for KVStore(key=...).

A keyed store reads and writes through this codec: its own files sealed
with its key (names keyed, bytes read through an authenticating
SealedSource), and, when asked, plain files beside them (accept_unsealed)
or files that name no model (accept_unidentified).  The store's parts meet
it only through the Codec protocol; importing this module registers it.
"""

import os

from kvstore import codec, files
from kvstore.errors import CheckpointMissing, KVStoreError
from kvstore.format import LOADABLE_ABIS, SEALED_ABIS, envelope_now, open_checkpoint, read_entry
from kvstore.seal.sealer import Sealer


class SealedCodec:
    """The codec of a store opened with a key.

    Args:
        key: 32 raw bytes or a key file's path (kvstore.seal.load_key).
        identity: the store's kvstore.identity.ModelIdentity, or None.
        accept_unsealed: lookups and loads also take plain files.
        accept_unidentified: lookups also offer files that name no model.
    """

    def __init__(self, key, identity=None, accept_unsealed=False, accept_unidentified=False):
        self.sealer = Sealer(key, identity)             # BadKey if bad
        self.identity = identity
        self.accept_unsealed = accept_unsealed
        self.accept_unidentified = accept_unidentified
        self.key_id = self.sealer.key_id
        self.name_key = self.sealer.names
        self.abis = SEALED_ABIS | (LOADABLE_ABIS if accept_unsealed else frozenset())

    def key_of(self, entry):
        """The NameKey entry's name was made with: this key's for a sealed
        file, the model's (or SHA1) for a plain one."""
        if entry.sealed:
            return self.sealer.names_for(entry.model_tag)
        return self.identity.names if entry.model_tag and self.identity is not None else None

    def lookup_keys(self):
        """The NameKeys a lookup hashes the prompt under, the store's own first:
        one pass each (kvstore.forest.prefix_matches)."""
        keys = [self.name_key]
        if self.accept_unsealed:
            keys.append(None if self.identity is None else self.identity.names)
        if self.accept_unidentified:
            keys.append(self.sealer.names_for(0))
            if self.accept_unsealed:
                keys.append(None)
        return tuple(dict.fromkeys(keys))

    def open(self, fd, st, entry):
        """(source, Entry) of a file's plain bytes: its descriptor for a plain
        file, a SealedSource (which authenticates what it reads) for a sealed one."""
        if not entry.sealed:
            return fd, entry
        return self.sealer.source(fd, st, entry)

    def rewrites_in_place(self, entry):
        # A sealed file's tags bind its trailer and header: it is written anew.
        return not entry.sealed

    def stage(self, path, header, text, plan, trailer_raw=b"", head=b"", lookup_tag=b""):
        return self.sealer.stage(path, header, text, plan, trailer_raw, head, lookup_tag)

    def current(self, path):
        """The envelope at path now, or None (missing, corrupt, unsafe); for a
        sealed file of this key, its authenticated head (real token digests),
        or None when it does not authenticate."""
        e = envelope_now(path)
        if e is None or not self.sealer.owns(e):
            return e
        try:
            fd, st = open_checkpoint(path)
        except KVStoreError:
            return None
        try:
            _, plain = self.sealer.source(fd, st, e)
            return codec.stored_entry(plain, st, e)
        except KVStoreError:
            return None
        finally:
            os.close(fd)

    def verify_file(self, path, name=None):
        """A sealed file of this key is authenticated chunk by chunk
        (Sealer.verify_file); a plain one is refused unless accept_unsealed,
        then checked as kvstore.files.verify_file checks it."""
        try:
            e = read_entry(path)
        except CheckpointMissing:
            raise
        except (KVStoreError, OSError):
            e = None
        if e is not None and e.sealed:
            return self.sealer.verify_file(path, name=name)
        if e is not None and e.payload_abi not in self.abis:
            return "not_sealed: a sealed store takes only sealed files"
        return files.verify_file(path, name=name)


codec.register_codec(SealedCodec)
