"""The reader: find a prompt's longest stored prefix and load it (docs/semantics.md §4, §5; docs/format.md §14).

find() hashes the prompt once and asks the index (and the remote tier's
index, in the same pass) for the longest stored text that is a byte prefix
of it; the answer is a Match, the file's Entry with the lookup's own state
beside it.  load() streams a whole file, or every block of a chain, into
one allocation per tensor, checks every CRC, compares the stored text with
the prompt and records the hit in place.  A corrupt block removes itself
and the blocks after it, and the load falls back to the longest valid
hit that remains; a remote hit is fetched first.  Corrupt files never
reach the caller.
"""

import dataclasses
import logging
import os
import time

import numpy as np

from kvstore import chain, files, names, payload
from kvstore import trailers as trailer_mod
from kvstore.codec import stored_entry
from kvstore.errors import CheckpointMissing, CheckpointOSError, CorruptCheckpoint, KVStoreError
from kvstore.files import short_name
from kvstore.format import PREFIX_SIZE, Entry, entry_from_fd, open_checkpoint, read_entry
from kvstore.payload import forms

log = logging.getLogger("kvstore")

# A load whose chain turns out to hold a corrupt block removes that block and
# the blocks after it, then looks again: the request gets the longest valid
# ancestor (or another hit).  Each try removes at least one file.
LOAD_TRIES = 3


@dataclasses.dataclass(frozen=True)
class Match(Entry):
    """What find() returns: the Entry of the file it matched, and the lookup's state.

    The state is never printed: query is prompt content.
    """
    # The prompt the lookup matched this entry against, so that load
    # compares the stored text with it byte for byte (a digest collision is
    # a miss, not someone else's state).
    query: bytes = dataclasses.field(default=None, repr=False, compare=False)
    # The lookup's accept predicate, so that a load which falls back to a
    # shorter hit applies it again.
    accept: object = dataclasses.field(default=None, repr=False, compare=False)
    # The object key of a hit in the remote tier, not yet copied to path:
    # only sha, text_bytes and file_size are known until load() fetches it.
    # None for a local file.
    remote: str = dataclasses.field(default=None, compare=False)

    @classmethod
    def of(cls, entry, query=None, accept=None, remote=None):
        """entry (an Entry or a Match) with this lookup state."""
        return entry.but(cls, query=query, accept=accept, remote=remote)


def lookup_state(entry):
    """(query, accept, remote) of a Match; (None, None, None) for a plain Entry."""
    return getattr(entry, "query", None), getattr(entry, "accept", None), getattr(entry, "remote", None)


@dataclasses.dataclass
class Checkpoint:
    """A loaded checkpoint: the exact tokens, the tensors and the engine meta."""
    entry: Entry
    tokens: np.ndarray
    tensors: dict
    meta: dict
    text_bytes: bytes = dataclasses.field(repr=False)
    # Prompt content too (the tool-call text map): kept out of repr, like the text.
    trailers: dict = dataclasses.field(default_factory=dict, repr=False)
    # name -> axis of the tensors that hold one row per token (KVStore.save's
    # positional=), as the file recorded them.
    positional: dict = dataclasses.field(default_factory=dict)
    # {tokens: text length} where the stored sequence may be cut into blocks
    # (a chain's block boundaries; an exported file's "cuts").
    cuts: dict = dataclasses.field(default_factory=dict, repr=False)
    # name -> the dtype the file stores (a NumPy load gives bfloat16 as uint16).
    dtypes: dict = dataclasses.field(default_factory=dict, repr=False)
    # The lossiest codec its tensors were stored with ("q4", "q8"; "" when
    # they are exactly the values saved): the canary's tolerance follows it.
    lossy: str = ""


class Reader:
    """find and load over one open directory.

    Args:
        d: the kvstore.directory.Directory.
        remote: the remote tier (kvstore.remote.RemoteTier), or None.
        on_fetched: called with the Entry of each checkpoint a remote fetch
            published here (the store applies its budget), or None.
    """

    def __init__(self, d, remote=None, on_fetched=None):
        self.d = d
        self.remote = remote
        self.on_fetched = on_fetched

    # -- lookup (section 4) -----------------------------------------------

    def find(self, data, accept=None):
        """(Match or None, whether the index saw orphaned blocks) for prompt bytes data."""
        d = self.d
        with d.lock:
            d.index.refresh()
            # Both tiers in one SHA1 pass, from memory; a remote hit only
            # when longer than the best local one.
            e, sha = d.lookup.longest_prefix(data, self.remote.searchable() if self.remote else None, accept)
            orphans = bool(d.index.orphans)
        if sha is not None:
            hit = self.remote.entry(sha)
            return Match.of(hit, data, accept, lookup_state(hit)[2]), orphans
        if e is None:
            d.count(misses=1)
            return None, orphans
        return Match.of(e, data, accept), orphans

    # -- load (section 5) -------------------------------------------------

    def load(self, entry, into, min_tokens, consume):
        """KVStore.load (see there): a Checkpoint, or None."""
        t0 = time.perf_counter()
        if lookup_state(entry)[2] is not None:
            entry = self._fetch_remote(entry, min_tokens)
            if entry is None:
                return None
        with payload.gc_paused():
            if entry.is_block:
                return self._load_chain(entry, into, min_tokens, t0)
            return self._load_whole(entry, into, min_tokens, consume, t0)

    def _open(self, entry):
        """(fd, stat) of entry's file, or None after counting the miss."""
        try:
            return open_checkpoint(entry.path)
        except CheckpointMissing:
            log.info("kvstore: miss reason=vanished file=%s", short_name(entry.name))
        except CheckpointOSError as e:
            log.warning("kvstore: miss reason=unreadable file=%s errno=%s", short_name(entry.name), e.errno)
        return self.d.miss(entry)

    def _load_whole(self, entry, into, min_tokens, consume, t0):
        """load() of a whole file (ABI 16, or 208 or 144 with packed tensors)."""
        d = self.d
        opened = self._open(entry)
        if opened is None:
            return None
        fd, st = opened
        try:
            cur = entry_from_fd(fd, st, entry.path)
            if not d.eligible(cur, min_tokens) or cur.is_block:
                # Rewritten since the lookup (another model, context, ABI...).
                log.info("kvstore: miss reason=not_eligible abi=%d file=%s", cur.payload_abi, short_name(entry.name))
                return d.miss(entry)
            got = self._read_whole(fd, st, cur, entry, into)
            if got is None:
                return d.miss(entry)
            # With fd still open the inode cannot be reused: the hit goes to
            # the file just read, never to a newer one renamed over its name.
            hits = files.record_hit(entry.path, st, cur.hits)
        except CorruptCheckpoint as e:
            d.discard_corrupt(entry.path, st, e.reason)
            return d.miss(entry)
        finally:
            os.close(fd)
        if consume and cur.tokens > d.settings.cold_max_tokens:
            # The live session now owns this state and writes fresh waypoints.
            d.unlink_if_same(entry.path, st)
            d.count(consumed=1)
        dt = time.perf_counter() - t0
        d.count(hits=1, loads=1, bytes_read=cur.file_size, load_seconds=dt)
        log.info("kvstore: hit tokens=%d text=%d load_ms=%.1f file=%s", cur.tokens, cur.text_bytes,
                 dt * 1e3, short_name(entry.name))
        text, manifest, tokens, tensors, trailer_values = got
        return Checkpoint(entry=dataclasses.replace(cur, hits=hits), tokens=tokens, tensors=tensors,
                          meta=manifest.meta, text_bytes=text, trailers=trailer_values,
                          positional=dict(manifest.axes), cuts=dict(manifest.cuts),
                          dtypes={t[0]: t[1] for t in manifest.tensors},
                          lossy=forms.lossiest({form.codec for _, form in manifest.packed.values()}))

    def _read_whole(self, fd, st, cur, entry, into):
        """(text, manifest, tokens, tensors, trailer values) of an open whole
        file, or None when its text is not the prompt's.  A file with packed
        tensors (ABI 208, 144) is read as a chain of one block is: each
        packed tensor's stored bytes checked, then unpacked into its array.

        Raises:
            CorruptCheckpoint: the file is damaged.
        """
        d = self.d
        # A sealed file is read in place: each read decrypts and
        # authenticates the chunks it covers before it returns.
        rfd, plain = d.codec.open(fd, st, cur)
        text = payload.pread(rfd, plain.text_bytes, PREFIX_SIZE)
        if len(text) != plain.text_bytes:
            raise CorruptCheckpoint("truncated", entry.path, "text cut short")
        if plain.sha and names.name_of(text, d.codec.key_of(cur)).hex() != plain.sha:
            raise CorruptCheckpoint("text_hash", entry.path, "stored text does not hash to the file name")
        query = lookup_state(entry)[0]
        if query is not None and query[:len(text)] != text:
            # A SHA1 collision: the digests matched, the bytes do not.
            log.warning("kvstore: miss reason=text_mismatch file=%s", short_name(entry.name))
            return None
        # The codec's own checks (a sealed file's tags) already vouch for
        # every byte of a file it reads through a view.
        verify = d.settings.verify and rfd is fd
        manifest = payload.read_manifest(rfd, plain)
        check_model(cur, manifest.model, d.model_identity)
        if manifest.packed:
            read = payload.read_chain_mlx if into == "mlx" else payload.read_chain_numpy
            tokens, tensors = read(payload.ChainLayout([(rfd, plain)], target_manifest=manifest), verify)
        else:
            tokens = payload.read_tokens(rfd, plain, manifest, verify)
            read = payload.read_tensors_mlx if into == "mlx" else payload.read_tensors_numpy
            tensors = read(rfd, plain, manifest, verify)
        return text, manifest, tokens, tensors, read_trailer(rfd, plain, cur.path)

    def _load_chain(self, entry, into, min_tokens, t0, tries=LOAD_TRIES):
        """load() of a chain block: every block of its chain into one allocation per tensor.

        A corrupt block removes itself and the blocks after it; the load
        then falls back to the longest valid ancestor that stands on its own
        (the same prompt prefixes it), or is a miss.
        """
        d = self.d
        with d.lock:
            d.index.refresh()
            cur = d.index.get(entry.sha)
            blocks = d.index.chain(cur) if cur is not None else None
        if blocks is None:
            # Not in the index, or its chain is broken there: the directory
            # says why.  A block damaged since the lookup drops out of the
            # index when it is listed again; find it by walking the chain.
            bad, end, reason = self._walk_chain(entry)
            if bad is None:
                log.info("kvstore: miss reason=%s file=%s", reason, short_name(entry.name))
                return d.miss(entry)
            d.discard_block(bad, reason)
            return self._fall_back(entry, end, into, min_tokens, t0, tries)
        try:
            got = self._read_chain(entry, blocks, into, min_tokens)
        except CheckpointMissing:
            log.info("kvstore: miss reason=vanished file=%s", short_name(entry.name))
            return d.miss(entry)
        except CheckpointOSError as e:
            log.warning("kvstore: miss reason=unreadable file=%s errno=%s", short_name(entry.name), e.errno)
            return d.miss(entry)
        except CorruptCheckpoint as e:
            at = next((i for i, b in enumerate(blocks) if b.path == e.path), len(blocks) - 1)
            d.discard_block(blocks[at], e.reason)
            return self._fall_back(entry, blocks[at].text_bytes, into, min_tokens, t0, tries)
        if got is None:
            return d.miss(entry)
        target, text, layout, tokens, tensors, trailer_values, nbytes = got
        dt = time.perf_counter() - t0
        d.count(hits=1, loads=1, bytes_read=nbytes, load_seconds=dt)
        log.info("kvstore: hit tokens=%d text=%d blocks=%d load_ms=%.1f file=%s", target.tokens,
                 target.text_bytes, len(blocks), dt * 1e3, short_name(entry.name))
        return Checkpoint(entry=target, tokens=tokens, tensors=tensors, meta=layout.meta,
                          text_bytes=text, trailers=trailer_values, positional=dict(layout.axes),
                          cuts={b.tokens: b.text_bytes for b in blocks},
                          dtypes={t.name: t.dtype for t in layout.tensors}, lossy=forms.lossiest(layout.codecs))

    def _read_chain(self, entry, blocks, into, min_tokens):
        """(the target's Entry with its hit, text, layout, tokens, tensors,
        trailer values, bytes read) of a chain, or None (logged) when it is
        not this store's to load or its text is not the prompt's.

        Raises:
            CorruptCheckpoint, CheckpointMissing, CheckpointOSError.
        """
        d = self.d
        sealed = any(b.sealed for b in blocks)
        if (sealed and not all(b.sealed for b in blocks)) or any(d.misfit(b) is not None for b in blocks):
            # Not this store's (another key, model, ABI...): a miss; the files stay.
            log.info("kvstore: miss reason=not_eligible file=%s", short_name(entry.name))
            return None
        with chain.OpenChain(blocks, d.codec.open if sealed else None, d.codec.key_of(blocks[-1])) as opened:
            target = opened.entries[-1]
            # Eligibility is the stored files' (a plain view carries the plain ABI).
            judged = [stored_entry(b, bst, orig) for (_, bst, b), orig in zip(opened.blocks, blocks)] \
                if sealed else opened.entries
            if not d.eligible(judged[-1], min_tokens) or not target.restorable \
                    or any(d.misfit(b) is not None for b in judged):
                log.info("kvstore: miss reason=not_eligible file=%s", short_name(entry.name))
                return None
            text = opened.text()
            query = lookup_state(entry)[0]
            if query is not None and query[:len(text)] != text:
                log.warning("kvstore: miss reason=text_mismatch file=%s", short_name(entry.name))
                return None
            layout = opened.layout()
            check_model(target, layout.model, d.model_identity)
            read = payload.read_chain_mlx if into == "mlx" else payload.read_chain_numpy
            tokens, tensors = read(layout, d.settings.verify and not sealed)
            fd = opened.blocks[-1][0]
            trailer_values = read_trailer(fd, target, target.path)
            # Every block read counts a hit: a block's score then holds
            # the loads that passed through it (docs/format.md §14).
            hits = opened.record_hits()
            nbytes = sum(b.file_size for b in opened.entries)
        return (dataclasses.replace(judged[-1], hits=hits[-1]), text, layout, tokens, tensors, trailer_values,
                nbytes)

    def _fall_back(self, entry, limit, into, min_tokens, t0, tries):
        """After a bad block (removed with the blocks after it): load the longest
        valid hit for the same prompt shorter than limit text bytes (an
        ancestor of the bad block, or another chain's), or count a miss."""
        query, accept, _ = lookup_state(entry)
        if query is None or tries <= 1:
            return self.d.miss(entry)

        def shorter(e):
            return e.text_bytes < limit and (accept is None or accept(e))
        with self.d.lock:
            self.d.index.refresh()
            back = self.d.index.longest_prefix(query, shorter)
        if back is None:
            return self.d.miss(entry)
        log.info("kvstore: retry reason=corrupt_block tokens=%d file=%s", back.tokens, short_name(back.name))
        back = Match.of(back, query, accept)
        if back.is_block:
            return self._load_chain(back, into, min_tokens, t0, tries - 1)
        return self._load_whole(back, into, min_tokens, True, t0)

    def _walk_chain(self, entry):
        """Walks entry's chain on disk, from entry towards its first block.

        Returns:
            (the first bad block met, or None; the text length it ends at;
            the corruption reason, or the miss reason when nothing is bad:
            "vanished" or "broken_chain").
        """
        try:
            cur = read_entry(os.path.join(self.d.path, entry.sha + ".kv"))
        except CorruptCheckpoint as e:
            return entry, entry.text_bytes, e.reason
        except KVStoreError:
            return None, 0, "vanished"
        try:
            for _ in files.ancestors(cur, self.d.path, limit=len(self.d.index.entries) + 1):
                pass
        except files.BrokenChain as broken:
            if isinstance(broken.error, CorruptCheckpoint):
                path = os.path.join(self.d.path, broken.name + ".kv")
                bad = dataclasses.replace(broken.child, path=path, sha=broken.name, inode=0)
                return bad, broken.child.text_start, broken.error.reason
        return None, 0, "broken_chain"

    # -- the remote tier --------------------------------------------------

    def _fetch_remote(self, entry, min_tokens):
        """The local entry to load for a remote hit: the fetched copy, or, when
        the fetch is a miss, the best local hit for the same prompt (None if none)."""
        d = self.d
        query, accept, _ = lookup_state(entry)
        if os.path.lexists(entry.path):      # fetched or saved here meanwhile
            return Match.of(entry, query, accept)
        published = []
        got = self.remote.fetch(entry, lambda e: d.eligible(e, min_tokens), d.budget_bytes, d.settings.durable,
                                fits=lambda e: d.misfit(e) is None, have=self.has_block, published=published)
        if published:
            with d.lock:
                d.index.add(*published)
        if got is not None:
            if self.on_fetched is not None:
                self.on_fetched(got)
            return Match.of(got, query)
        with d.lock:
            d.index.refresh()
            local = d.index.longest_prefix(query, accept) if query is not None else None
        if local is None:
            d.count(misses=1)
            return None
        return Match.of(local, query)

    def text_head(self, entry, n):
        """The first n bytes of entry's stored text (a chain block's: its sequence's, from its first
        block), fewer when it is shorter, b"" when it cannot be read (gone, corrupt, another key's).
        Prompt content: for comparing inside the process, never to show."""
        try:
            blocks = [entry] + (list(files.ancestors(entry, self.d.path, linked=False)) if entry.is_block else [])
        except files.BrokenChain:
            return b""
        out = b""
        for e in reversed(blocks):
            if len(out) >= n:
                break
            part = self.segment(e, n - len(out))
            if part is None:
                return b""
            out += part
        return out[:n]

    def segment(self, entry, n):
        """read_segment through this store's codec."""
        return read_segment(self.d.codec, entry, n)

    def has_block(self, sha):
        """True when the block named sha is here (for a remote fetch of its chain)."""
        with self.d.lock:
            self.d.index.refresh()
            return self.d.index.get(sha) is not None


def read_segment(codec, entry, n):
    """The first n bytes (fewer when it is shorter) of the text entry holds
    itself: a block's own range, a whole file's whole text; None when it
    cannot be read (gone, corrupt, another key's).  Prompt content: never to
    show unasked."""
    try:
        fd, st = open_checkpoint(entry.path)
    except KVStoreError:
        return None
    try:
        src, plain = codec.open(fd, st, entry_from_fd(fd, st, entry.path))
        return payload.pread(src, min(n, plain.segment_bytes), plain.text_offset)
    except (KVStoreError, OSError):
        return None
    finally:
        os.close(fd)


def read_trailer(src, entry, path):
    """The trailer values of an open file (its plain view): {} when it has none."""
    if entry.file_size <= entry.trailer_offset:
        return {}
    raw = payload.pread(src, entry.file_size - entry.trailer_offset, entry.trailer_offset)
    values, _, _ = trailer_mod.parse_trailer(raw, path, log)
    return values


def check_model(entry, model, identity):
    """A file that names a model (its tag) must carry that model's identity
    in its manifest: one whose tag and name say this store's model but
    whose manifest says another is not what it claims (corrupt).

    Raises:
        CorruptCheckpoint: "model_mismatch".
    """
    if entry.model_tag and model != identity:
        raise CorruptCheckpoint("model_mismatch", entry.path, "manifest names another model than the header")
