"""Sealer: one store key's derived keys and names, and the sealed format's operations over them.

What the store holds for a key: it names a text (name, names_for), opens a
sealed file's bytes (source), writes one (write_checkpoint) and checks one
(verify_file).  The work is done by kvstore.seal.source, kvstore.seal.sink
and kvstore.seal.check, which take the Sealer for its key id and keys.
"""

from kvstore import _native
from kvstore.identity import ModelIdentity
from kvstore.names import NameKey
from kvstore.seal import keys
from kvstore.seal.check import verify_sealed
from kvstore.seal.cipher import require_crypto
from kvstore.seal.sink import stage_sealed
from kvstore.seal.source import open_sealed


class Sealer:
    """A store key's derived keys and the sealed format's operations.

    Args:
        key: the 32 raw key bytes (load_key gives them).
        identity: the store's kvstore.identity.ModelIdentity, or None: its
            files' names are keyed per model too (docs/semantics.md §17).
    """

    def __init__(self, key, identity=None):
        require_crypto()
        key = keys.load_key(key)
        self._content = keys.content_key(key)
        # The key of the files' names: HMAC-SHA1(name_key, text), made by
        # kvstore._native (sha1 and its prefix passes with key=) so that a
        # lookup hashes the prompt once, as for SHA1 names.
        base = keys.names_key(key)
        self.key_id = keys.key_id(key)
        self._key = key
        # A model's files have names of their own under the same key: two
        # models never share (or replace) one file.
        self.name_key = base if identity is None else keys.names_key(key, identity)
        self.names = NameKey(self.name_key)
        self._tag = 0 if identity is None else identity.tag
        self._unidentified = NameKey(base)

    def __repr__(self):
        return f"Sealer(key_id={self.key_id.hex()})"

    def owns(self, entry):
        """True for a sealed file of this key (by the key id in its clear seal head)."""
        return entry.sealed and entry.key_id == self.key_id

    def file_key(self, file_id):
        """The AES-256 key of the file with this random id (its seal head's)."""
        return keys.file_key(self._content, file_id)

    # -- names ---------------------------------------------------------------

    def name(self, text):
        """The 20-byte keyed name of text: HMAC-SHA1(name_key, text)."""
        return _native.sha1(text, self.name_key)

    def names_for(self, model_tag, model=None):
        """The NameKey of this key's files of a model tag: the store's own, for
        0 (a file that names no model) the key's names without a model, for
        another tag the names of model (its identity string, as a file's
        manifest records it); None when model does not have that tag."""
        if model_tag == self._tag:
            return self.names
        if not model_tag:
            return self._unidentified
        if model is None or ModelIdentity(model).tag != model_tag:
            return None
        return NameKey(keys.names_key(self._key, ModelIdentity(model)))

    # -- files ---------------------------------------------------------------

    def stage(self, path, header, text, plan, trailer_raw=b"", head=b"", lookup_tag=b""):
        """publish.stage_checkpoint, sealed (kvstore.seal.sink.stage_sealed):
        each chunk is encrypted as soon as the writer has passed it; nothing
        plain reaches a disk.

        Returns:
            the unpublished TempFile, its ``entry`` the new file's Entry (ABI 48 or 49).
        """
        return stage_sealed(self, path, header, text, plan, trailer_raw, head, lookup_tag)

    def source(self, fd, st, entry):
        """A sealed file read in place: (SealedSource, the plain file's Entry)
        (kvstore.seal.source.open_sealed).

        Raises:
            CorruptCheckpoint: a bad seal head, another key, or a chain
                header that does not authenticate.
        """
        return open_sealed(self, fd, st, entry)

    def verify_file(self, path, progress=None, name=None):
        """Authenticates every chunk of a sealed file and checks its plain
        copy (kvstore.seal.check.verify_sealed).

        Returns:
            None when the file is sound, else a one-line reason (never prompt text).

        Raises:
            CheckpointMissing: the file vanished.
        """
        return verify_sealed(self, path, progress, name)
