"""kvstore: a disk cache of LLM KV-cache checkpoints.

A checkpoint file is named by the SHA1 of the rendered prompt bytes; a request
loads the longest stored checkpoint whose text is a byte prefix of its prompt
and prefills only the rest.  docs/format.md describes the file format and
the semantics; the README lists the rooms of this package.
"""

from kvstore._native import crc32c, sha1, sha1_prefixes
from kvstore.errors import (AmbiguousSession, BadKey, CheckpointMissing, CheckpointOSError, PinRefused,
                            CorruptCheckpoint, KVStoreError, SessionNotFound, StoreClosed,
                            UnsafePath)
from kvstore.format import Entry, ExtFlag, Header, Reason, read_entry, touch
from kvstore import policy
from kvstore.policy import Options
from kvstore.store import Checkpoint, KVStore
from kvstore.prompt_cache import PromptCache
from kvstore import sessions
# The remote tier registers itself with the store (KVStore(remote="s3://...")).
from kvstore import remote  # noqa: F401
# Sealing registers its codec with the store (KVStore(key=...)).
from kvstore.seal import codec as seal_codec  # noqa: F401

__version__ = "0.1.0"

__all__ = [
    "sha1", "sha1_prefixes", "crc32c",
    "KVStore", "Options", "Checkpoint", "PromptCache", "policy",
    "Header", "Reason", "ExtFlag", "Entry", "read_entry", "touch",
    "KVStoreError", "CorruptCheckpoint", "CheckpointOSError", "CheckpointMissing",
    "UnsafePath", "StoreClosed", "SessionNotFound", "AmbiguousSession", "BadKey", "PinRefused", "sessions",
]
