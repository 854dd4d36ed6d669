"""Reading a sealed file: SealedSource, its plain bytes on demand, and open_sealed.

A load reads through a SealedSource, which decrypts the chunks a read covers
and checks their tags before the read returns (cryptography releases the GIL
while OpenSSL runs, so the I/O threads decrypt in parallel), as far as it
can straight into where the bytes go: MLX's blob, a NumPy array, a tensor's
rows.  Every byte a load uses is authenticated; the bytes it skips
(padding) are not.
"""

import dataclasses
import os

from kvstore import _native, host, payload
from kvstore.errors import CorruptCheckpoint
from kvstore.format import (CHAIN_HEAD_SIZE, HEADER_SIZE, PACKED_BLOCK_ABIS, PACKED_WHOLE_ABIS, PAYLOAD_ABI_CHAIN,
                            PAYLOAD_ABI_TENSORS, PREFIX_SIZE, parse_chain_head)
from kvstore.payload.chains import PREFETCH_ASK
from kvstore.payload.buffers import thread_scratch
from kvstore.seal.cipher import decrypt_in_place, decrypt_parts
from kvstore.seal.layout import BODY_OFFSET, TAG_BYTES, chunk_aad, chunk_nonce, parse_seal_head, read_tags


def open_sealed(sealer, fd, st, entry):
    """A sealed file read in place: (SealedSource, the plain file's Entry).

    Nothing is decrypted ahead: each read (kvstore.payload.pread_into, and a
    chain load's pieces through SealedSource.read_pieces) reads the
    ciphertext of the chunks it covers, decrypts them and checks their tags
    before it returns.

    The plain Entry keeps the sealed file's path, name, inode, hits and
    times, so that hits, discards and links act on the sealed file; its
    text digest checks go through the sealer's name().

    Args:
        sealer: the kvstore.seal.Sealer of the file's key (its key_id and
            file_key).
        fd, st: the open file and its os.stat_result.
        entry: the sealed file's Entry (kvstore.format.entry_from_fd).

    Raises:
        CorruptCheckpoint: as kvstore.seal.layout.parse_seal_head, or
            ``auth_failed`` for the chunk that holds a block's chain header
            (read here) or a body that disagrees with the clear heads.
    """
    head = os.pread(fd, BODY_OFFSET, 0)
    seal = parse_seal_head(head, st, entry, sealer.key_id)
    tags = read_tags(fd, entry.path, seal.grid)
    src = SealedSource(fd, entry.path, sealer.file_key(seal.file_id), seal.aad, tags, seal.grid)
    return src, plain_entry(seal, head, entry, sealer.key_id, src)


def plain_entry(seal, head, entry, key_id, src):
    """The plain file's Entry, its chain header read (authenticated) through
    src; checked against the clear heads of the sealed file.

    Args:
        seal: the file's kvstore.seal.layout.SealHead.
        head: the file's first BODY_OFFSET bytes.
        entry: the sealed file's Entry.
        key_id: the key id the plain Entry records.
        src: the file's SealedSource.
    """
    path, inner_abi = entry.path, seal.inner_abi
    plain = dataclasses.replace(entry, payload_abi=inner_abi, payload_bytes=seal.inner_payload,
                                file_size=PREFIX_SIZE + seal.grid.body, key_id=key_id)
    block = inner_abi == PAYLOAD_ABI_CHAIN or inner_abi in PACKED_BLOCK_ABIS
    if block:
        text_len = int.from_bytes(head[HEADER_SIZE:PREFIX_SIZE], "little")
        chain = parse_chain_head(src.pread(CHAIN_HEAD_SIZE, PREFIX_SIZE + text_len), seal.header.tokens, path)
        if chain["text_start"] != entry.text_start:
            raise CorruptCheckpoint("auth_failed", path, "sealed body disagrees with the clear heads")
        plain = dataclasses.replace(plain, **chain)
    whole = inner_abi == PAYLOAD_ABI_TENSORS or inner_abi in PACKED_WHOLE_ABIS
    if ((not block and not whole) or plain.token_start != entry.token_start
            or plain.parent != entry.parent or plain.chain_flags != entry.chain_flags
            or plain.is_block != entry.is_block):
        raise CorruptCheckpoint("auth_failed", path, "sealed body disagrees with the clear heads")
    return plain


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

    sealed = True               # (the Source protocol: kvstore.sources)

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
        b0 = self.body_range(offset, n)
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

    def body_range(self, offset, n):
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
        if not decrypt_in_place(self.key, chunk_nonce(i), self.tags[TAG_BYTES * i:TAG_BYTES * (i + 1)],
                                chunk_aad(self.aad, i, self.chunks), part):
            raise CorruptCheckpoint("auth_failed", self.path, f"chunk {i} does not authenticate")
        return part

    def decrypt_chunk(self, i, buffers, rows, scratch):
        """Reads chunk i straight to where its plain bytes go, decrypts it
        there and checks its tag.  rows: [(body offset, buffer index,
        destination offset, run, count, stride)], count runs of run bytes,
        consecutive in the body, landing every stride bytes in buffers[b];
        the bytes no row takes (padding) are read into scratch.

        Each byte is read once, into its place, and decrypted there while
        still in cache (no copy after the decryption), the chunk's parts in
        order through one GCM pass.  The places hold the plain bytes before
        the tag has checked: they are the load's own, and a chunk that does
        not authenticate wipes every byte it wrote before the load fails.
        Rows that overlap (no plan makes them) go through scratch instead.

        Raises:
            CorruptCheckpoint: ``auth_failed`` (nothing of the chunk left).
        """
        lo, hi = self.grid.span(i)
        places = _places(self.fd, lo, hi, buffers, sorted(rows), scratch)
        if places is None:
            plain = self.decrypt(i, scratch)
            for off, b, dst, run, count, stride in rows:
                _native.copy_runs(buffers[b], dst, plain, off - lo, run, count, stride)
            return
        views, reads, parts = places
        for rc, _ in _native.pread_pieces(views, reads, False):
            if rc:
                _native.raise_status(rc, self.path, f"chunk {i}")
        if not decrypt_parts(self.key, chunk_nonce(i), self.tags[TAG_BYTES * i:TAG_BYTES * (i + 1)],
                             chunk_aad(self.aad, i, self.chunks), parts):
            raise CorruptCheckpoint("auth_failed", self.path, f"chunk {i} does not authenticate")

    def authenticate(self, lo, hi):
        """Reads and authenticates chunks [lo, hi), through one scratch chunk
        (a check's share of the file: padding included)."""
        scratch = bytearray(self.grid.size)
        for i in range(lo, hi):
            self.decrypt(i, scratch)

    def close(self):
        """The Source protocol's close: the descriptor belongs to whoever opened the file."""

    @staticmethod
    def read_pieces(buffers, pieces, verify=False):
        """kvstore._native.pread_pieces for sealed sources (a chain load's
        reads, kvstore.payload.batch.Batch): each piece (buffer index, source,
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
        """
        work, sizes = {}, {}
        for b, src, off, run, count, stride, dst in pieces:
            n = run * count
            size = sizes.get(b)
            if size is None:
                size = sizes[b] = memoryview(buffers[b]).nbytes
            if count and dst + (count - 1) * stride + run > size:
                raise ValueError("piece does not fit its buffer")
            b0 = src.body_range(off, n)
            grid = src.grid
            i = grid.of(b0)
            if n and grid.of(b0 + n - 1) == i:
                # The common case (a tensor's share of a block within one
                # chunk): the piece's rows as they are.
                rows = work.get((src, i))
                if rows is None:
                    rows = work[(src, i)] = []
                rows.append((b0, b, dst, run, count, stride))
                continue
            for i in grid.covering(b0, b0 + n):
                lo, hi = src.grid.span(i)
                a, z = max(lo, b0), min(hi, b0 + n)
                rows = work.setdefault((src, i), [])
                rows.extend((b0 + k, b, at, r, k_rows, step) for k, at, r, k_rows, step
                            in _rows(dst, run, stride, a - b0, z - a))
        return list(work.items())

    @staticmethod
    def read_chunks(buffers, work):
        """Reads, decrypts and authenticates the chunks of work (chunk_work's,
        or a run of it), each where its plain bytes go (decrypt_chunk).

        First asks the kernel to read the work's ciphertext ahead, so that
        a cold file streams in while the chunks before are decrypted (each
        I/O thread asks for its own share: the asking costs a walk of the
        page cache, which the threads then share).

        Returns [] (a job of kvstore.payload.batch.Batch: no per-piece results).
        """
        _read_ahead(work)
        views = [payload.bytes_view(x) for x in buffers]
        # A chunk's padding and gaps (or a whole chunk whose rows overlap),
        # never bytes a job returns.
        scratch = thread_scratch("gaps", max((src.grid.size for (src, _), _ in work), default=0))
        for (src, i), rows in work:
            src.decrypt_chunk(i, views, rows, scratch)
        return []


def _places(fd, lo, hi, buffers, rows, scratch):
    """Where the bytes of the chunk at body [lo, hi) go, for decrypt_chunk:
    (the buffers the reads name, pread_pieces' reads, the chunk's parts in
    body order as writable views), or None when rows (sorted) overlap."""
    views, index, reads, parts, at = [scratch], {}, [], [], lo

    def gap(a, z):
        reads.append((0, fd, BODY_OFFSET + a, z - a, 1, z - a, a - lo))
        parts.append(scratch[a - lo:z - lo])
    for off, b, dst, run, count, stride in rows:
        if off < at:
            return None
        if off > at:
            gap(at, off)
        k = index.get(b)
        if k is None:
            k = index[b] = len(views)
            views.append(buffers[b])
        reads.append((k, fd, BODY_OFFSET + off, run, count, stride, dst))
        view = buffers[b]
        parts.extend(view[dst + r * stride:dst + r * stride + run] for r in range(count))
        at = off + run * count
    if at < hi:
        gap(at, hi)
    return views, reads, parts


def _read_ahead(work):
    """Asks for the ciphertext of work's chunks (chunk_work's) to be read in
    the background (kvstore.host.prefetch, in asks of at most
    chains.PREFETCH_ASK bytes, as a plain chain load asks): per source,
    from its first chunk in work to its last."""
    spans = {}
    for src, i in (key for key, _ in work):
        a, z = spans.get(src, (i, i))
        spans[src] = (min(a, i), max(z, i))
    for src, (a, z) in spans.items():
        if not host.prefetch_parts(src.fd, BODY_OFFSET + src.grid.span(a)[0], BODY_OFFSET + src.grid.span(z)[1],
                                   host.prefetch_ask(src.fd, PREFETCH_ASK)):
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
