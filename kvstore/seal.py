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

This module owns the key, the names, the sealed layout and its checks; the
store decides when to seal, and treats a file that fails authentication as
a corrupt one.
"""

import collections
import dataclasses
import errno
import hmac
import os
import stat
import struct

import numpy as np

try:
    from cryptography.exceptions import InvalidTag
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF
except ImportError as e:          # an optional extra: kvstore[seal]
    _CRYPTO_MISSING = e
else:
    _CRYPTO_MISSING = None

from kvstore import _native, files, names, payload
from kvstore.identity import ModelIdentity
from kvstore.names import NameKey
from kvstore.errors import BadKey, CheckpointMissing, CorruptCheckpoint
from kvstore.format import (CHAIN_HEAD_SIZE, HEADER_SIZE, PAYLOAD_ABI_CHAIN, PAYLOAD_ABI_SEALED_CHAIN,
                            PAYLOAD_ABI_TENSORS, PREFIX_SIZE, SEAL_HEAD,
                            SEAL_HEAD_SIZE, SEAL_MAGIC, SEAL_VERSION, SEALED_ABI_OFFSET, SEALED_ABIS, TOKEN_DIGEST,
                            Header, entry_from_fd, open_checkpoint, pack_chain_head, parse_chain_head)

KEY_BYTES = 32
KEY_ID_BYTES = 8
FILE_ID_BYTES = 16
TAG_BYTES = 16

# Chunks of 1 MiB: a load has work for every I/O thread from a block of a
# few MiB on (a 256-token block of a 1B model is 8 MiB), a chunk stays in
# L2 while it is read and decrypted, and the tags cost 16 bytes per MiB.
CHUNK_LOG2 = 20
CHUNK_BYTES = 1 << CHUNK_LOG2
# Chunk sizes a reader accepts (the seal head names the writer's).
MIN_CHUNK_LOG2, MAX_CHUNK_LOG2 = 12, 30

# The sealed body starts one page after the 52-byte prefix, so its offsets
# keep the plain file's alignment modulo 4096 (tensor data page- and
# cache-line-aligned, as §3 lays it out); the clear heads sit in that page.
BODY_OFFSET = PREFIX_SIZE + 4096

# HKDF labels: one key per purpose from the one store key.
_CONTENT_INFO = b"kvstore seal v1 contents"
_NAME_INFO = b"kvstore seal v1 names"
_FILE_INFO = b"kvstore seal v1 file"
_KEY_ID_MSG = b"kvstore key id"

_CHUNK_AAD = struct.Struct("<QB")
_NONCE = struct.Struct("<Q4x")

_KEY_OPEN = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0)
_KEY_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


# ---- the key --------------------------------------------------------------------

def load_key(value):
    """The 32 raw key bytes from bytes or from a key file.

    Args:
        value: 32 bytes, or the path of a file of exactly 32 bytes that only
            its owner may read or write (mode 0600 or 0400).

    Returns:
        bytes.

    Raises:
        BadKey (a ValueError): wrong length, a file others may read or write,
            a symlink or not a regular file; the message names the path.
        OSError: the file cannot be opened.
    """
    if isinstance(value, (bytes, bytearray, memoryview)):
        raw = bytes(value)
        if len(raw) != KEY_BYTES:
            raise BadKey(f"a store key is {KEY_BYTES} bytes, not {len(raw)}")
        return raw
    path = os.fspath(value)
    try:
        fd = os.open(path, _KEY_OPEN)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise BadKey(f"key file {path} is a symlink; give the file itself") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise BadKey(f"key file {path} is not a regular file")
        mode = stat.S_IMODE(st.st_mode)
        if mode & 0o077:
            who = "group" if mode & 0o070 else "world"
            how = "readable" if mode & 0o044 else "writable"
            raise BadKey(f"key file {path} is {who}-{how} (mode {mode:04o}); chmod 600 it")
        if st.st_size != KEY_BYTES:
            raise BadKey(f"key file {path} is {st.st_size} bytes; a key file holds exactly {KEY_BYTES} "
                         f"(make one with: kvstore key new FILE)")
        raw = os.pread(fd, KEY_BYTES + 1, 0)
    finally:
        os.close(fd)
    if len(raw) != KEY_BYTES:
        raise BadKey(f"key file {path} is {len(raw)} bytes; a key file holds exactly {KEY_BYTES}")
    return raw


def new_key_file(path):
    """Writes a fresh random key (os.urandom) to a new file, mode 0600, synced.

    Raises:
        FileExistsError: path exists (a key is never overwritten: the files
            it sealed would be lost).
    """
    path = os.fspath(path)
    fd = os.open(path, _KEY_CREATE, 0o600)
    try:
        os.fchmod(fd, 0o600)          # whatever the umask
        raw = os.urandom(KEY_BYTES)
        if os.write(fd, raw) != KEY_BYTES:
            raise OSError("short write of the key file")
        files.sync_fd(fd)
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    os.close(fd)
    files.sync_dir(os.path.dirname(os.path.abspath(path)))
    return path


class Grid:
    """Where the chunks of a sealed body lie: chunk 0 is [0, first), then
    one every size bytes; the last may be short.

    A writer puts the first boundary where the tensor data starts (modulo
    the chunk size), so the text, a block's chain header and the manifest
    make up the first chunk alone (a short one, unless the text is longer
    than a chunk) and tensor data starts on a chunk boundary: a load
    authenticates the heads of a file without decrypting any tensor bytes,
    and decrypts the tensors in whole chunks where they land.

    Args:
        body: the body's length (> 0).
        size: the chunk size.
        first: chunk 0's length, 1 to size (clipped to the body).
    """

    __slots__ = ("body", "size", "first", "count")

    def __init__(self, body, size, first):
        self.body, self.size, self.first = body, size, min(first, body)
        self.count = 1 + -(-(body - self.first) // size)

    @classmethod
    def for_data_at(cls, body, data_start, size=CHUNK_BYTES):
        """The writer's grid: a boundary at body offset data_start."""
        return cls(body, size, data_start % size or size)

    def of(self, x):
        """The chunk that holds body offset x; self.count for x >= body."""
        if x >= self.body:
            return self.count
        return 0 if x < self.first else 1 + (x - self.first) // self.size

    def span(self, i):
        """(lo, hi): chunk i's body range."""
        if i == 0:
            return 0, self.first
        lo = self.first + (i - 1) * self.size
        return lo, min(self.body, lo + self.size)

    def covering(self, lo, hi):
        """The chunks that hold bytes of [lo, hi), as a range."""
        return range(self.of(lo), self.of(hi - 1) + 1) if hi > lo else range(0)


def _hkdf(ikm, info, salt=None):
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=salt, info=info).derive(ikm)


class Sealer:
    """A store key's derived keys and the sealed format's operations.

    Args:
        key: the 32 raw key bytes (load_key gives them).
        identity: the store's kvstore.identity.ModelIdentity, or None: its
            files' names are keyed per model too (docs/format.md §17).
    """

    def __init__(self, key, identity=None):
        if _CRYPTO_MISSING is not None:
            raise ImportError("sealed stores need the cryptography package: pip install 'kvstore[seal]'") \
                from _CRYPTO_MISSING
        key = load_key(key)
        self._content = _hkdf(key, _CONTENT_INFO)
        # The key of the files' names: HMAC-SHA1(name_key, text), made by
        # kvstore._native (sha1 and its prefix passes with key=) so that a
        # lookup hashes the prompt once, as for SHA1 names.
        base = _hkdf(key, _NAME_INFO)
        self.key_id = hmac.digest(base, _KEY_ID_MSG, "sha256")[:KEY_ID_BYTES]
        self._key = key
        # A model's files have names of their own under the same key: two
        # models never share (or replace) one file.
        self.name_key = base if identity is None else self._model_name_key(identity)
        self.names = NameKey(self.name_key)
        self._tag = 0 if identity is None else identity.tag
        self._unidentified = NameKey(base)

    def __repr__(self):
        return f"Sealer(key_id={self.key_id.hex()})"

    def owns(self, entry):
        """True for a sealed file of this key (by the key id in its clear seal head)."""
        return entry.sealed and entry.key_id == self.key_id

    # -- names ---------------------------------------------------------------

    def name(self, text):
        """The 20-byte keyed name of text: HMAC-SHA1(name_key, text)."""
        return _native.sha1(text, self.name_key)

    def _model_name_key(self, identity):
        return _hkdf(self._key, _NAME_INFO + b"\0" + identity.digest)

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
        return NameKey(self._model_name_key(ModelIdentity(model)))

    def _file_key(self, file_id):
        return _hkdf(self._content, _FILE_INFO, salt=file_id)

    # -- writing -------------------------------------------------------------

    def write_checkpoint(self, path, header, text, plan, trailer_raw=b"", head=b"", durable=True, exclusive=False,
                         lookup_tag=b""):
        """files.write_checkpoint, sealed: the plain bytes go to a _SealingSink,
        which encrypts each chunk as soon as the writer has passed it and
        writes it on an I/O thread; nothing plain reaches a disk, and only a
        few chunks of plain bytes are in memory at a time.

        header and head are the plain file's (ABI 16 or 17; a block's chain
        header names its parent by its keyed name).  lookup_tag is the
        name's (kvstore.names.names_of; b"": none, found by its name alone).

        Returns:
            the new file's Entry (ABI 48 or 49), or None when exclusive and
            another file already had the name.
        """
        size = files.image_size(text, plan, trailer_raw)
        body = size - PREFIX_SIZE
        data_start = plan.payload_start + plan.data_offset - PREFIX_SIZE      # in the body
        grid = Grid.for_data_at(body, data_start)
        file_id = os.urandom(FILE_ID_BYTES)
        total = BODY_OFFSET + body + TAG_BYTES * grid.count
        outer = dataclasses.replace(header, payload_abi=header.payload_abi + SEALED_ABI_OFFSET,
                                    payload_bytes=total - PREFIX_SIZE - len(text))
        seal_head = SEAL_HEAD.pack(SEAL_MAGIC, SEAL_VERSION, CHUNK_LOG2, 0, self.key_id, file_id, body,
                                   header.payload_bytes, header.payload_abi, grid.first,
                                   lookup_tag or bytes(_native.LOOKUP_TAG))
        clear = seal_head + (_clear_chain_head(head, header.tokens) if head else b"")
        prefix = outer.pack() + len(text).to_bytes(4, "little")
        aad = _common_aad(bytes.fromhex(os.path.basename(path)[:40]), prefix, clear)
        with files.TempFile(path) as tmp:
            _native.preallocate(tmp.fd, total, tmp.path)
            _native.pwrite_from(tmp.fd, prefix + clear, 0, tmp.path)
            sink = _SealingSink(self._file_key(file_id), aad, tmp.fd, tmp.path, grid, data_start)
            try:
                # No CRCs: the tags check every byte (docs/format.md §16).
                files.write_image(sink, tmp.path, header, text, plan, trailer_raw, head, crc=False)
                sink.finish()
            finally:
                sink.wait()
            _native.pwrite_from(tmp.fd, sink.tags, BODY_OFFSET + body, tmp.path)
            os.ftruncate(tmp.fd, total)
            entry = entry_from_fd(tmp.fd, os.fstat(tmp.fd), path)
            if not tmp.publish(durable, exclusive):
                return None
        return entry

    # -- reading -------------------------------------------------------------

    def source(self, fd, st, entry):
        """A sealed file read in place: (SealedSource, the plain file's Entry).

        Nothing is decrypted ahead: each read (kvstore.payload.pread_into,
        and a chain load's pieces through SealedSource.read_pieces) reads the
        ciphertext of the chunks it covers, decrypts them and checks their
        tags before it returns.  Every byte a load uses is authenticated;
        the bytes it skips (padding) are not.

        The plain Entry keeps the sealed file's path, name, inode, hits and
        times, so that hits, discards and links act on the sealed file; its
        text digest checks go through name().

        Raises:
            CorruptCheckpoint: as open() (for the chunk that holds a block's
                chain header, read here).
        """
        head = os.pread(fd, BODY_OFFSET, 0)
        h, grid, file_id, inner_payload, inner_abi, aad = self._parse(head, st, entry)
        tags = self._tags(fd, entry, grid)
        src = SealedSource(fd, entry.path, self._file_key(file_id), aad, tags, grid)
        return src, self._plain_entry(h, head, entry, inner_abi, inner_payload, grid.body, src)

    @staticmethod
    def _tags(fd, entry, grid):
        tags = os.pread(fd, TAG_BYTES * grid.count, BODY_OFFSET + grid.body)
        if len(tags) != TAG_BYTES * grid.count:
            raise CorruptCheckpoint("truncated", entry.path, "tag table cut short")
        return tags

    def _plain_entry(self, h, head, entry, inner_abi, inner_payload, body, src):
        """The plain file's Entry, its chain header read (authenticated)
        through src; checked against the clear heads of the sealed file."""
        path = entry.path
        plain = dataclasses.replace(entry, payload_abi=inner_abi, payload_bytes=inner_payload,
                                    file_size=PREFIX_SIZE + body, key_id=self.key_id)
        if inner_abi == PAYLOAD_ABI_CHAIN:
            text_len = int.from_bytes(head[HEADER_SIZE:PREFIX_SIZE], "little")
            chain = parse_chain_head(src.pread(CHAIN_HEAD_SIZE, PREFIX_SIZE + text_len), h.tokens, path)
            if chain["text_start"] != entry.text_start:
                raise CorruptCheckpoint("auth_failed", path, "sealed body disagrees with the clear heads")
            plain = dataclasses.replace(plain, **chain)
        if (inner_abi not in (PAYLOAD_ABI_CHAIN, PAYLOAD_ABI_TENSORS) or plain.token_start != entry.token_start
                or plain.parent != entry.parent or plain.chain_flags != entry.chain_flags
                or plain.is_block != entry.is_block):
            raise CorruptCheckpoint("auth_failed", path, "sealed body disagrees with the clear heads")
        return plain

    def _parse(self, head, st, entry):
        """The seal head's fields, checked against the file: (header, Grid,
        file id, inner payload length, inner ABI, common AAD)."""
        path = entry.path
        if len(head) < PREFIX_SIZE + SEAL_HEAD_SIZE:
            raise CorruptCheckpoint("truncated", path, "sealed file shorter than its seal head")
        h = Header.unpack(head, path)
        if h.payload_abi not in SEALED_ABIS:
            raise CorruptCheckpoint("bad_seal_head", path, "not a sealed file")
        (_, _, log2, _, key_id, file_id, body, inner_payload, inner_abi,
         first, _) = SEAL_HEAD.unpack_from(head, PREFIX_SIZE)
        if key_id != self.key_id:
            raise CorruptCheckpoint("auth_failed", path, "sealed with another key")
        if not MIN_CHUNK_LOG2 <= log2 <= MAX_CHUNK_LOG2:
            raise CorruptCheckpoint("bad_seal_head", path, f"chunk size 2**{log2}")
        if not 0 < first <= 1 << log2:
            raise CorruptCheckpoint("bad_seal_head", path, f"first chunk of {first} bytes")
        clear_len = SEAL_HEAD_SIZE + (CHAIN_HEAD_SIZE if h.payload_abi == PAYLOAD_ABI_SEALED_CHAIN else 0)
        if body == 0:
            raise CorruptCheckpoint("bad_seal_head", path, "empty sealed body")
        grid = Grid(body, 1 << log2, first)
        if st.st_size != BODY_OFFSET + body + TAG_BYTES * grid.count:
            raise CorruptCheckpoint("truncated", path, f"sealed file is {st.st_size} bytes; its seal head "
                                    f"says {BODY_OFFSET + body + TAG_BYTES * grid.count}")
        aad = _common_aad(bytes.fromhex(entry.sha), head[:PREFIX_SIZE], head[PREFIX_SIZE:PREFIX_SIZE + clear_len])
        return h, grid, file_id, inner_payload, inner_abi, aad

    def verify_file(self, path, progress=None, name=None):
        """Authenticates every chunk of a sealed file and checks its plain
        copy: a whole file's text against the name, the manifest (its CRC
        and bounds; the payload's CRC fields are 0, the tags having checked
        every byte).  A block's chain is not walked: its parent's presence
        and link are the clear heads'.

        Args:
            name: the checkpoint name it will have, for a file not yet under
                it (a download): the tags bind the name.

        Returns:
            None when the file is sound, else a one-line reason (never prompt text).

        Raises:
            CheckpointMissing: the file vanished.
        """
        fd, st = open_checkpoint(path)
        try:
            e = entry_from_fd(fd, st, path if name is None else os.path.join(os.path.dirname(path), name))
            if not e.sealed:
                return "not_sealed: written without a key"
            if e.key_id != self.key_id:
                return "other_key: sealed with another key"
            src, plain = self.source(fd, st, e)
            # Every chunk, padding included, one scratch chunk per I/O thread.
            _wait([payload.io_pool().submit(_authenticate, src, lo, hi) for lo, hi in _runs(src.chunks)])
            if progress is not None:
                progress(st.st_size)
            # The manifest parses and its blocks lie in the payload; the
            # payload's CRC fields are 0 (the tags checked every byte).
            manifest = payload.read_manifest(src, plain)
            key = self.names_for(plain.model_tag, manifest.model)
            if key is None:
                return "model_mismatch: the manifest names another model than the header"
            if not plain.is_block:
                text = src.pread(plain.text_bytes, PREFIX_SIZE)
                (digest,), (tag,) = names.names_of(text, [len(text)], key)
                if digest.hex() != plain.sha:
                    return "text_hash: stored text does not match the file name"
                if plain.lookup_tag not in (tag, bytes(len(tag))):
                    return "lookup_tag: the lookup tag is not the name's (lookups pass the file over)"
            return None
        except CheckpointMissing:
            raise
        except Exception as err:      # noqa: BLE001 - one line per file, whatever broke
            return files.describe_error(err)
        finally:
            os.close(fd)


class _SealingSink:
    """Where files.write_image writes a sealed file's plain bytes
    (payload.pwrite_from's method), at plain-file offsets.

    The writer goes forward through the tensor data, so once a write reaches
    a chunk's end (or starts past it), that chunk has all its bytes: an I/O
    thread then encrypts it straight from the writer's buffers (the pieces
    recorded for it, zeros between them) into a chunk buffer and keeps its
    tag, while the writer
    goes on (cryptography releases the GIL while OpenSSL runs).  The
    writer's thread writes the encrypted chunks to the sealed file in order,
    as they come back: the kernel takes one buffered writer of a file at a
    time, so writes from the I/O threads would only queue on each other and
    hold up the encryption.  The chunks below ``held`` (the text and the
    manifest, whose CRCs are written last) are copied into buffers and wait
    for finish().  At most IN_FLIGHT chunks are queued at once.

    Args:
        key, aad: the file's AES key and common AAD.
        fd, path: the sealed file being written.
        grid: the body's chunks (Grid.for_data_at data_start).
        data_start: the body offset where the tensor data starts: the
            chunks below it (the text, a block's chain header and the
            manifest) are held.
    """

    IN_FLIGHT = 2 * payload.IO_THREADS + 2

    def __init__(self, key, aad, fd, path, grid, data_start):
        self.key, self.aad, self.fd, self.path, self.grid = key, aad, fd, path, grid
        self.body, self.chunks = grid.body, grid.count
        self.held = grid.of(data_start)
        self.next = self.held          # chunks [held, next) are queued
        self.staged = {}               # held chunk -> its bytes (numpy uint8, zero-filled)
        self.pieces = {}               # chunk >= held -> [(offset in chunk, memoryview)]
        self.jobs = collections.deque()
        self.spare = []
        self.tags = bytearray(TAG_BYTES * self.chunks)

    def pwrite_from(self, buf, offset, path=None):
        mv = payload.bytes_view(buf)
        lo = offset - PREFIX_SIZE
        if lo < 0:                     # the prefix is written in the clear, by the caller
            mv, lo = mv[-lo:], 0
        hi = lo + mv.nbytes
        if hi > self.body:
            raise ValueError(f"write of {mv.nbytes} bytes at {offset} passes the body ({self.body} bytes)")
        if lo == hi:
            return
        grid = self.grid
        self._queue_below(grid.of(lo))
        for i in grid.covering(lo, hi):
            c0, c1 = grid.span(i)
            a, b = max(lo, c0), min(hi, c1)
            part = mv[a - lo:b - lo]
            if i < self.held:
                self._staged(i)[a - c0:b - c0] = np.frombuffer(part, dtype=np.uint8)
                continue
            if i < self.next:
                raise RuntimeError(f"write behind sealed chunk {i}")
            pieces = self.pieces.setdefault(i, [])
            if pieces and pieces[-1][0] + pieces[-1][1].nbytes > a - c0:
                raise RuntimeError(f"write at {offset} goes back inside chunk {i}")
            pieces.append((a - c0, part))
        # The chunks this write completes go now, while the writer goes on.
        self._queue_below(grid.of(hi))

    def reserve(self, size, path=None):
        """The Source protocol's preallocation: the sealed file is sized by its writer."""

    def set_size(self, size):
        """The Source protocol's final size: the sealed file's is set when it is written."""

    def finish(self):
        """Queues every chunk not queued yet, the held ones last, and waits for them."""
        self._queue_below(self.chunks)
        for i in range(self.held):
            c0, c1 = self.grid.span(i)
            self._queue(i, [(0, memoryview(self._staged(i))[:c1 - c0])])
        self.staged.clear()
        self.wait()

    def wait(self):
        """Waits for every queued chunk and writes it (none after a failure);
        raises the first error."""
        error = None
        while self.jobs:
            try:
                self._write_oldest(write=error is None)
            except Exception as e:
                error = error or e
        if error is not None:
            raise error

    def _write_oldest(self, write=True):
        """Waits for the oldest queued chunk and writes it to the sealed file."""
        job, i, out, n = self.jobs.popleft()
        job.result()
        if write:
            _native.pwrite_from(self.fd, memoryview(out)[:n], BODY_OFFSET + self.grid.span(i)[0], self.path)
        self.spare.append(out)

    def _staged(self, i):
        buf = self.staged.get(i)
        if buf is None:
            buf = self.staged[i] = np.zeros(CHUNK_BYTES, dtype=np.uint8)
        return buf

    def _queue_below(self, k):
        while self.next < min(k, self.chunks):
            self._queue(self.next, self.pieces.pop(self.next, []))
            self.next += 1

    def _queue(self, i, pieces):
        while len(self.jobs) >= self.IN_FLIGHT:
            self._write_oldest()
        out = self.spare.pop() if self.spare else bytearray(CHUNK_BYTES)
        c0, c1 = self.grid.span(i)
        n = c1 - c0
        self.jobs.append((payload.io_pool().submit(_seal_chunk, self.key, self.aad, i, self.chunks, pieces,
                                                   memoryview(out)[:n], self.tags), i, out, n))


class SealedSource:
    """A sealed file's plain bytes, read on demand (kvstore.payload.pread_into,
    and read_pieces for a chain load).

    Offsets are the plain file's.  A read covering whole chunks reads their
    ciphertext into the destination and decrypts it in place (cryptography
    accepts the same buffer in and out, and releases the GIL while OpenSSL
    runs, so the I/O threads decrypt in parallel); a chunk cut by the read's
    edges is decrypted in a scratch buffer and the part asked for copied.
    The last such chunk is kept, so the text, a block's chain header and
    the manifest, which share the first chunk, decrypt it once.

    Args:
        grid: the body's chunks (the seal head's Grid).
    """

    def __init__(self, fd, path, key, aad, tags, grid):
        self.fd, self.path, self.key, self.aad, self.tags = fd, path, key, aad, tags
        self.grid, self.body, self.chunks = grid, grid.body, grid.count
        self._last = (-1, b"")          # (chunk index, its plain bytes); replaced, never changed

    def pread(self, n, offset):
        n = max(0, min(n, PREFIX_SIZE + self.body - offset))
        buf = bytearray(n)
        if n:
            self.pread_into(memoryview(buf), offset)
        return bytes(buf)

    def pread_into(self, buf, offset, path=None, crc=None):
        mv = payload.bytes_view(buf)
        n = mv.nbytes
        b0 = self._body_range(offset, n)
        if n == 0:
            return None if crc is None else crc
        for i in self.grid.covering(b0, b0 + n):
            lo, hi = self.grid.span(i)
            if b0 <= lo and hi <= b0 + n:
                self.decrypt(i, mv[lo - b0:hi - b0])
            else:
                last_i, plain = self._last
                if last_i != i:
                    plain = bytes(self.decrypt(i, bytearray(hi - lo)))
                    self._last = (i, plain)
                a, z = max(lo, b0), min(hi, b0 + n)
                mv[a - b0:z - b0] = plain[a - lo:z - lo]
        if crc is None:
            return None
        return _native.crc32c(mv) if crc == 0 else _native.crc32c_combine(crc, _native.crc32c(mv), n)

    def _body_range(self, offset, n):
        """The body offset of a read of n bytes at plain-file offset, checked."""
        b0 = offset - PREFIX_SIZE
        if b0 < 0 or b0 + n > self.body:
            raise CorruptCheckpoint("truncated", self.path, f"read of {n} bytes at {offset} passes the sealed body")
        return b0

    def decrypt(self, i, buf):
        """Reads chunk i's ciphertext into buf (at least the chunk's length),
        decrypts it in place and checks its tag.  Returns the view of the
        chunk's plain bytes in buf.

        Raises:
            CorruptCheckpoint: ``auth_failed`` (buf then holds no plain bytes
                of a forged chunk: they are wiped).
        """
        lo, hi = self.grid.span(i)
        part = memoryview(buf)[:hi - lo]
        _native.pread_into(self.fd, part, BODY_OFFSET + lo, self.path)
        dec = Cipher(algorithms.AES(self.key), modes.GCM(_NONCE.pack(i), self.tags[TAG_BYTES * i:TAG_BYTES * (i + 1)])
                     ).decryptor()
        dec.authenticate_additional_data(_chunk_aad(self.aad, i, self.chunks))
        dec.update_into(part, part)
        try:
            dec.finalize()
        except InvalidTag:
            part[:] = bytes(hi - lo)
            raise CorruptCheckpoint("auth_failed", self.path, f"chunk {i} does not authenticate") from None
        return part

    def decrypt_chunk(self, i, buffers, rows, scratch):
        """Reads chunk i into scratch, decrypts it there and checks its tag
        (decrypt), then copies rows out: [(body offset, buffer index,
        destination offset, run, count, stride)], count runs of run bytes,
        consecutive in the body, landing every stride bytes in buffers[b].

        The chunk is decrypted where it was read, still in cache, and no
        byte of it reaches a destination before its tag has checked.

        Raises:
            CorruptCheckpoint: ``auth_failed`` (nothing copied).
        """
        lo = self.grid.span(i)[0]
        plain = self.decrypt(i, scratch)
        for off, b, dst, run, count, stride in rows:
            _native.copy_runs(buffers[b], dst, plain, off - lo, run, count, stride)

    def close(self):
        """The Source protocol's close: the descriptor belongs to whoever opened the file."""

    @staticmethod
    def read_pieces(buffers, pieces, verify=False):
        """kvstore._native.pread_pieces for sealed sources (a chain load's
        reads, kvstore.payload._Batch): each piece (buffer index, source,
        file offset, run, count, stride, destination offset) covers
        run * count consecutive plain bytes that land every stride bytes.

        Each chunk the pieces touch is read and decrypted once (chunk_work,
        then read_chunks).  No CRC is computed: the tags vouch for the
        bytes.  Returns [(0, 0)] per piece; raises CorruptCheckpoint for a
        chunk that does not authenticate or a piece past the body.
        """
        SealedSource.read_chunks(buffers, SealedSource.chunk_work(buffers, pieces))
        return [(0, 0)] * len(pieces)

    @staticmethod
    def chunk_work(buffers, pieces):
        """What reading pieces (as read_pieces takes them) asks of each chunk
        they touch, in file order: [((source, chunk index), rows)], rows as
        decrypt_chunk takes them.  A run of the list is a share of the work
        for one I/O thread (whole chunks: a chunk cut between two threads
        would be read and decrypted by both).

        Also asks the kernel to read the pieces' ciphertext ahead.
        """
        _read_ahead(pieces)
        work = {}
        for b, src, off, run, count, stride, dst in pieces:
            n = run * count
            if count and dst + (count - 1) * stride + run > memoryview(buffers[b]).nbytes:
                raise ValueError("piece does not fit its buffer")
            b0 = src._body_range(off, n)
            for i in src.grid.covering(b0, b0 + n):
                lo, hi = src.grid.span(i)
                a, z = max(lo, b0), min(hi, b0 + n)
                rows = work.setdefault((src, i), [])
                rows.extend((b0 + k, b, at, r, k_rows, step) for k, at, r, k_rows, step
                            in _rows(dst, run, stride, a - b0, z - a))
        return list(work.items())

    @staticmethod
    def read_chunks(buffers, work):
        """Reads, decrypts and authenticates the chunks of work (chunk_work's,
        or a run of it) through one scratch chunk, each chunk's rows copied
        to their places once it has authenticated (decrypt_chunk).

        Returns [] (a job of kvstore.payload._Batch: no per-piece results).
        """
        views = [payload.bytes_view(x) for x in buffers]
        scratch = bytearray(max((src.grid.size for (src, _), _ in work), default=0))
        for (src, i), rows in work:
            src.decrypt_chunk(i, views, rows, scratch)
        return []


def _read_ahead(pieces):
    """Asks the kernel to read every piece's ciphertext in the background
    (POSIX_FADV_WILLNEED, where the platform has it), so that a cold file
    streams in while the chunks before are decrypted."""
    if not hasattr(os, "posix_fadvise"):
        return
    spans = {}
    for _, src, off, run, count, _, _ in pieces:
        lo, hi = spans.get(src, (off, off))
        spans[src] = (min(lo, off), max(hi, off + run * count))
    for src, (lo, hi) in spans.items():
        chunks = src.grid.covering(lo - PREFIX_SIZE, hi - PREFIX_SIZE)
        if not chunks:
            continue
        a, z = src.grid.span(chunks[0])[0], src.grid.span(chunks[-1])[1]
        try:
            os.posix_fadvise(src.fd, BODY_OFFSET + a, z - a, os.POSIX_FADV_WILLNEED)
        except OSError:
            return


def _rows(dst, run, stride, at, n):
    """Where bytes [at, at + n) of a piece land, the piece's row r starting
    at dst + r * stride: [(offset in the piece, destination offset, run,
    count, stride)], in order: a partial first row, whole rows, a partial
    last row."""
    out = []
    r, c = divmod(at, run)
    end = at + n
    if c:
        m = min(run - c, n)
        out.append((at, dst + r * stride + c, m, 1, m))
        at, r = at + m, r + 1
    rows = (end - at) // run
    if rows:
        out.append((at, dst + r * stride, run, rows, stride))
        at, r = at + rows * run, r + rows
    if at < end:
        out.append((at, dst + r * stride, end - at, 1, end - at))
    return out


# ---- the chunks -------------------------------------------------------------------

def _common_aad(name, prefix, clear):
    """What every chunk's tag binds besides its index: the file name, the
    52-byte prefix without the two fields a hit rewrites in place (hit count,
    last-used time), the seal head and a block's clear chain header."""
    p = bytearray(prefix)
    p[12:16] = bytes(4)          # hit count (kvs_touch_fd)
    p[32:40] = bytes(8)          # last-used time (kvs_touch_fd)
    return bytes(name) + bytes(p) + bytes(clear)


def _clear_chain_head(head, tokens):
    """A block's chain header as it stands in the clear: the parent's name
    and the ranges stay (eviction goes leaves first without the key), the
    token digests are zeroed (they would confirm a guessed prompt)."""
    f = parse_chain_head(head, tokens)
    parent = bytes.fromhex(f["parent"]) if f["parent"] else bytes(20)
    return pack_chain_head(parent, f["token_start"], f["text_start"], f["block_grid"], f["chain_flags"],
                           bytes(TOKEN_DIGEST), bytes(TOKEN_DIGEST))


def _runs(chunks):
    """Chunk ranges [lo, hi) for the I/O threads, about equal."""
    n = max(1, min(payload.IO_THREADS, chunks))
    step = -(-chunks // n)
    return [(lo, min(chunks, lo + step)) for lo in range(0, chunks, step)]


def _wait(jobs):
    """Every job's result, once all have ended (they hold views of one mapping)."""
    errors = [j.exception() for j in jobs]
    for err in errors:
        if err is not None:
            raise err
    return [j.result() for j in jobs]


def _chunk_aad(aad, i, chunks):
    return aad + _CHUNK_AAD.pack(i, i == chunks - 1)


_ZEROS = bytes(CHUNK_BYTES)


def _seal_chunk(key, aad, i, chunks, pieces, out, tags):
    """Encrypts chunk i into out: its plain bytes are pieces, (offset,
    memoryview) in order, with zeros between them and after the last.
    Fills the chunk's tag."""
    enc = Cipher(algorithms.AES(key), modes.GCM(_NONCE.pack(i))).encryptor()
    enc.authenticate_additional_data(_chunk_aad(aad, i, chunks))
    done = 0
    for at, part in [*pieces, (out.nbytes, memoryview(b""))]:
        if at > done:
            enc.update_into(memoryview(_ZEROS)[:at - done], out[done:at])
        if part.nbytes:
            enc.update_into(part, out[at:at + part.nbytes])
        done = at + part.nbytes
    enc.finalize()
    tags[TAG_BYTES * i:TAG_BYTES * (i + 1)] = enc.tag


def _authenticate(src, lo, hi):
    """Reads and authenticates chunks [lo, hi) of src, through one scratch chunk."""
    scratch = bytearray(src.grid.size)
    for i in range(lo, hi):
        src.decrypt(i, scratch)


__all__ = ["KEY_BYTES", "CHUNK_BYTES", "BODY_OFFSET", "load_key", "new_key_file", "Sealer"]
