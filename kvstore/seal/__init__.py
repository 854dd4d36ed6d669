"""Sealed checkpoints (docs/format.md §16): keys, keyed names, AES-256-GCM in chunks.

A store opened with a key seals every file it writes: the text, the payload
and the trailer are encrypted and authenticated with AES-256-GCM (through
``cryptography``, which calls OpenSSL; no cipher is written here), and the
file is named by HMAC-SHA1 of the text under a name key instead of the
text's SHA1, so a directory listing tells nothing about which prompts are stored or
shared.  The 52-byte header stays clear: listing, the budget and eviction
work without the key, and a store without it sees a foreign payload ABI.

The sealed body is exactly the bytes of the unsealed file after its 52-byte
prefix (its payload CRC fields 0: the tags check every byte), cut into
chunks of CHUNK_BYTES (a Grid: the first ends where the tensor data starts),
each with its own tag.  A save encrypts each chunk as soon as the plain
writer has written its last byte, straight from the writer's buffers.  A load reads through a SealedSource, which
decrypts the chunks a read covers and checks their tags before the read
returns (cryptography releases the GIL while OpenSSL runs, so the I/O
threads decrypt in parallel), as far as it can straight into where the
bytes go: MLX's blob, a NumPy array, a tensor's rows.  Nothing plain is ever
written to a file.  What a chunk's tag binds (its AAD) is the file name,
every header field that never changes in place, the seal head (file id,
lengths, chunk grid, lookup tag), a block's clear chain header, the chunk
index and whether it is the last: a truncated, reordered, renamed,
re-headed or spliced file fails to authenticate.

This package owns the key, the names, the sealed layout and its checks; the
store decides when to seal, and treats a file that fails authentication as
a corrupt one.  Its modules, from the bottom up:

    layout   what a sealed file is: offsets, the chunk Grid, clear heads, AADs
    cipher   the AEAD (HKDF, AES-256-GCM over a chunk); the only user of cryptography
    keys     the store key: key files, the key id, the derived keys
    source   reading: SealedSource and open_sealed
    sink     writing: SealingSink and stage_sealed
    check    checking a whole file: verify_sealed
    sealer   Sealer: one key's names, and open / write / check through it
"""

from kvstore.seal.check import verify_sealed
from kvstore.seal.keys import KEY_BYTES, KEY_ID_BYTES, load_key, new_key_file
from kvstore.seal.layout import (BODY_OFFSET, CHUNK_BYTES, CHUNK_LOG2, FILE_ID_BYTES, MAX_CHUNK_LOG2, MIN_CHUNK_LOG2,
                                 TAG_BYTES, Grid, SealHead, parse_seal_head)
from kvstore.seal.sealer import Sealer
from kvstore.seal.sink import SealingSink, stage_sealed
from kvstore.seal.source import SealedSource, open_sealed

__all__ = ["KEY_BYTES", "CHUNK_BYTES", "BODY_OFFSET", "load_key", "new_key_file", "Sealer"]
