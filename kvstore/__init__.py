"""kvstore: a disk cache of LLM KV-cache checkpoints.

A checkpoint file is named by the SHA1 of the rendered prompt bytes; a request
loads the longest stored checkpoint whose text is a byte prefix of its prompt
and prefills only the rest.  docs/format.md describes the file format,
docs/semantics.md what the store does with it; docs/ARCHITECTURE.md lists
the rooms of this package.
"""

from kvstore.errors import (BadKey, CheckpointOSError, CorruptCheckpoint, KVStoreError, PinRefused, SessionNotFound,
                            StoreClosed)
from kvstore.settings import Settings
from kvstore.store import Checkpoint, KVStore, Match
from kvstore.prompt_cache import PromptCache
# The remote tier registers itself with the store (KVStore(remote="s3://...")).
from kvstore import remote  # noqa: F401
# Sealing registers its codec with the store (KVStore(key=...)).
from kvstore.seal import codec as _seal_codec  # noqa: F401
# Agent sessions (kvstore.sessions: save with a title, list, switch).
from kvstore import sessions  # noqa: F401

__version__ = "0.1.0"

# The names a user needs: the store and its settings, what find() and
# load() return, the prompt cache, and the errors worth catching.  The file
# format's helpers (Header, Entry, read_entry, touch, sha1, crc32c ...) are
# kvstore.format's; every error is in kvstore.errors.
__all__ = [
    "KVStore", "Settings", "Match", "Checkpoint", "PromptCache",
    "KVStoreError", "CorruptCheckpoint", "CheckpointOSError", "StoreClosed", "SessionNotFound", "BadKey",
    "PinRefused",
]
