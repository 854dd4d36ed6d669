"""Model identities (docs/semantics.md §17): which model a checkpoint belongs to.

A KV state is right only for the model that computed it: another model's
state of the same shapes (a fine-tune, a re-quantised copy, another seed of
one architecture) restores without an error and answers wrongly.  A CRC or
an AEAD tag proves that the bytes are the ones written, not whose they are.
So a store that knows its model (KVStore(model_identity=...)) records the
model in every file it writes and offers a lookup only its own:

- the header's bytes 21..23 (reserved, written 0, in ds4's layout) hold a
  24-bit model tag, so that the index tells a model's files apart from the
  52-byte prefix it reads anyway (another model's files are foreign: listed,
  counted in the budget, evictable, never found or loaded);
- the file name is the digest of the text in the model's namespace
  (kvstore.names): two models that store one text write two files, never
  one the other replaces;
- the payload manifest records the identity itself ("model"), checked on
  load and shown by kvstore inspect.

A file with tag 0 names no model: ds4's files, kvstore's own from before
identities, and every file of a store opened without one.  A store with an
identity loads them only when told to (accept_unidentified=True).

The identity is a string its maker chooses: kvstore.mlx.model_fingerprint()
for an MLX model (a digest of the weights, their dtypes and quantisation,
the config and the KV cache), or any name of the exact artifact (a
repository and revision).

The directory also keeps a registry of the models that have used it
(kvstore.registry), so that kvstore ls and kvstore stats can name them.
"""

import dataclasses
import functools
import hashlib

from kvstore.names import NameKey

# The digest behind a model's tag and namespace key: SHA-256 of this label
# and the identity string.
_DIGEST_LABEL = b"kvstore model v1\0"

# The tag is 24 bits (the header's three reserved bytes); 0 means "none".
TAG_BITS = 24
TAG_MAX = (1 << TAG_BITS) - 1

# Identities are names, not documents: a bound keeps manifests and the
# registry small.
MAX_IDENTITY_CHARS = 1024


@dataclasses.dataclass(frozen=True)
class ModelIdentity:
    """A model's identity string and what kvstore derives from it.

    Args:
        fingerprint: the string naming the exact model (1..1024 characters).
        label: a short name for people (kvstore ls, stats); never used to
            match anything.

    Raises:
        ValueError: an empty, over-long or non-string fingerprint.
    """
    fingerprint: str
    label: str = ""

    def __post_init__(self):
        if not isinstance(self.fingerprint, str) or not 0 < len(self.fingerprint) <= MAX_IDENTITY_CHARS:
            raise ValueError(f"model identity {self.fingerprint!r} must be a string of 1..{MAX_IDENTITY_CHARS} "
                             "characters")

    @functools.cached_property
    def digest(self):
        """SHA-256 of the identity: the namespace key of its plain files' names."""
        return hashlib.sha256(_DIGEST_LABEL + self.fingerprint.encode("utf-8")).digest()

    @functools.cached_property
    def tag(self):
        """The header's 24-bit model tag (never 0)."""
        return int.from_bytes(self.digest[:3], "little") or 1

    @property
    def names(self):
        """The NameKey of this model's plain files (kvstore.names)."""
        return NameKey(self.digest, inner=True)

    def __str__(self):
        return self.label or self.fingerprint


def as_identity(value):
    """A ModelIdentity from a string (or a ModelIdentity, or None)."""
    if value is None or isinstance(value, ModelIdentity):
        return value
    return ModelIdentity(value)


def tag_hex(tag):
    """A model tag as six hex digits ("-" for none)."""
    return f"{tag:06x}" if tag else "-"


__all__ = ["ModelIdentity", "as_identity", "tag_hex", "TAG_MAX", "MAX_IDENTITY_CHARS"]


def check_holds(path, held, wanted, open_with):
    """The one check that a store holds the state of the model at hand:
    another model's state would restore without an error and answer wrongly
    (docs/semantics.md §17).

    Args:
        path: the store's directory (for the message).
        held: the store's model identity string, or None (it names none).
        wanted: the identity string of the model at hand, or None (no model given).
        open_with: how to open the store for that model (for the message).

    Raises:
        ValueError: held is not wanted, saying which each is.
    """
    if held == wanted:
        return
    if wanted is None:
        raise ValueError(f"the store at {path} holds model {held}: pass the model (or its MLXEngine) to save "
                         "or load its state")
    raise ValueError(f"the store at {path} holds the state of model {held or '(none named)'}, not of this one "
                     f"({wanted[:16]}…): open it with {open_with}")
