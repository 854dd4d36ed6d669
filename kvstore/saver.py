"""The saver: store a checkpoint, writing only what the directory lacks (docs/semantics.md §6, §15; docs/format.md §10, §14).

A whole save writes one file (ABI 16, or 208 or 144 with the store's
kv_codec, docs/format.md §20); a chained save cuts the state into
blocks and writes only the blocks not stored yet, parent first, each
published by the one publish sequence (kvstore.publish), within the disk
budget and the directory's write budget: all the blocks are written first,
each one's data synced while the next is written, then each is put in
place in order.
A compatible file already under a name is kept (its trailer merged in
place, a session promoted) instead of written again.  The saver counts and
logs; what happens after a file is published (upload, eviction) is the
caller's, through the callables it hands in.
"""

import errno
import fcntl
import logging
import os
import time

import numpy as np

from kvstore import _native, chain, files, names, payload, policy, publish
from kvstore import trailers as trailer_mod
from kvstore.codec import stored_entry
from kvstore.errors import CheckpointMissing, CorruptCheckpoint, UnsafePath
from kvstore.files import RDWR_FLAGS, short_name
from kvstore.format import (CHAIN_HEAD_SIZE, PAYLOAD_ABI_CHAIN, PAYLOAD_ABI_TENSORS,
                            PREFIX_SIZE, Header, Reason, entry_from_fd, open_checkpoint, pack_chain_head)
from kvstore.payload import forms
from kvstore.payload.plan import PackAhead

log = logging.getLogger("kvstore")

# The reasons of tails a longer save of the same sequence replaces (see
# Saver.drop_replaced_tails): the states kept because a live session went
# away (evicted from RAM, or the server stopped), not anchors, waypoints or
# sessions that the store policy or a person asked for.
REPLACEABLE = frozenset({Reason.EVICT, Reason.SHUTDOWN})


class Saver:
    """save over one open directory.

    Args:
        d: the kvstore.directory.Directory.
        enqueue: called with each Entry published or kept (the remote
            tier's upload queue), or None.
        after_write: called with (Entry, text) after a save wrote a file
            (the store applies its budget), or None.
    """

    def __init__(self, d, enqueue=None, after_write=None):
        self.d = d
        self.enqueue = enqueue or (lambda e: None)
        self.after_write = after_write or (lambda e, text: None)

    def refuse(self, why, **kv):
        """Counts and logs a refused save; None."""
        self.d.count(refused=1)
        extra = "".join(f" {k}={v}" for k, v in kv.items())
        log.info("kvstore: save_refused reason=%s%s", why, extra)
        return None

    def save(self, text, tokens, tensors, meta, reason, ctx, trailers, min_tokens, positional, text_offsets,
             dtypes, exact=()):
        """KVStore.save (see there), with text as bytes and tokens as an array."""
        d = self.d
        if tokens.size and (tokens.dtype.kind not in "ui" or tokens.min() < 0 or tokens.max() >= 2**32):
            raise ValueError("tokens must be integer ids in 0..2**32-1")
        if len(text) >= 2**32:
            raise ValueError(f"text of {len(text)} bytes is longer than 2**32-1")
        n = int(tokens.size)
        if min_tokens is None:
            min_tokens = d.settings.min_tokens
        if n == 0 or n < min_tokens:
            return self.refuse("min_tokens", tokens=n, min_tokens=min_tokens)
        ctx = d.settings.ctx_size if ctx is None else int(ctx)
        axes = check_axes(positional, tensors, n)
        # MLX arrays as NumPy views of their memory, evaluated once: a chain's
        # blocks slice them without an MLX op per block and tensor.
        tensors, dtypes = payload.host_tensors(tensors, dtypes)
        values = {trailer_mod.bit_index(k): v for k, v in (trailers or {}).items()}
        trailer_raw, ext = trailer_mod.encode_trailer(values) if values else (b"", 0)
        if d.settings.layout != "chain":
            return self._save_whole(text, tokens, tensors, meta, Reason(reason), ctx, values, trailer_raw, ext,
                                    axes, text_offsets, dtypes, exact)
        return self._save_chain(text, tokens, tensors, meta, Reason(reason), ctx, values, trailer_raw, ext, axes,
                                text_offsets, dtypes, exact)

    # -- a whole file -------------------------------------------------------

    def _save_whole(self, text, tokens, tensors, meta, reason, ctx, values, trailer_raw, ext, axes, text_offsets,
                    dtypes, exact=()):
        """save() in the whole layout: one file, ABI 16 (208 or 144 with tensors packed)."""
        d = self.d
        plan = payload.Plan(len(text), tokens, tensors, meta, axes=axes, dtypes=dtypes, model=d.model_identity,
                            exact=exact)
        codec, codecs = d.settings.kv_codec, None
        if d.budget_bytes and not policy.file_size_fits(len(text), plan.payload_bytes, len(trailer_raw),
                                                        d.budget_bytes):
            # The budget counts stored bytes: one over it raw may fit packed.
            codecs = plan.pack(codec)       # (raw packs nothing: no codecs)
            if not policy.file_size_fits(len(text), plan.payload_bytes, len(trailer_raw), d.budget_bytes):
                return self.refuse("budget", bytes=PREFIX_SIZE + len(text) + plan.payload_bytes,
                                   budget=d.budget_bytes)
        (digest,), (tag,) = names.names_of(text, [len(text)], d.codec.name_key)
        name = digest.hex() + ".kv"
        path = os.path.join(d.path, name)
        t0 = time.perf_counter()
        try:
            kept = self.keep_existing(path, text, ctx, values, reason)
            if kept is not None:
                self.enqueue(kept)
                return kept
            if codecs is None:
                codecs = plan.pack(codec)
            if self.over_write_budget(reason, PREFIX_SIZE + len(text) + plan.payload_bytes + len(trailer_raw)):
                return None
            header = self._header(reason, int(tokens.size), ctx, plan, ext,
                                  forms.abi_of(codecs, PAYLOAD_ABI_TENSORS), int(time.time()))
            entry = publish.publish_staged(d.codec.stage(path, header, text, plan, trailer_raw, lookup_tag=tag),
                                           d.settings.durable)
        except OSError as e:
            d.count(save_errors=1)
            log.warning("kvstore: save_failed errno=%s error=%s file=%s", e.errno,
                        errno.errorcode.get(e.errno, "?"), short_name(name))
            return None
        dt = time.perf_counter() - t0
        with d.lock:
            d.index.add(entry)
        raw, stored = plan.tensor_bytes()
        d.count(saves=1, bytes_written=entry.file_size, save_seconds=dt, kv_raw_bytes=raw, kv_stored_bytes=stored)
        log.info("kvstore: saved reason=%s tokens=%d text=%d bytes=%d save_ms=%.1f file=%s",
                 reason.name.lower(), tokens.size, len(text), entry.file_size, dt * 1e3, short_name(name))
        self.enqueue(entry)          # never blocks: a background thread uploads
        self.after_write(entry, text)
        return entry

    def _note_chain_size(self, last, before, after):
        """Logs and counts a chain this save took past half the budget: kept,
        it would evict everything else (its blocks go last, leaves first)."""
        d = self.d
        if policy.over_half_budget(before, after, d.budget_bytes):
            d.count(chains_over_half_budget=1)
            log.warning("kvstore: chain_over_half_budget tokens=%d bytes=%d budget=%d file=%s", last.tokens, after,
                        d.budget_bytes, short_name(last.name))

    def _header(self, reason, tokens, ctx, plan, ext, abi, now):
        d = self.d
        return Header(quant_bits=d.settings.quant_bits, tokens=tokens, ctx_size=ctx or 0,
                      payload_bytes=plan.payload_bytes,
                      reason=reason, ext_flags=ext, model_id=d.settings.model_id, payload_abi=abi, created_at=now,
                      last_used=0, model_tag=d.model_tag)

    # -- a chain of blocks --------------------------------------------------

    def _save_chain(self, text, tokens, tensors, meta, reason, ctx, values, trailer_raw, ext, axes, text_offsets,
                    dtypes, exact=()):
        """save() in the chain layout: the blocks not stored yet, parent first."""
        d = self.d
        blocks = chain.plan_blocks(text, tokens, d.settings.block_tokens, text_offsets, d.codec.name_key)
        last = blocks[-1]
        t0 = time.perf_counter()
        written, nbytes = [], []     # nbytes: of the files this save wrote (not another writer's)
        try:
            # Evictors (exclusive lock) wait while the blocks go in, so no
            # parent this save relies on is removed under it.
            with d.dir_lock(fcntl.LOCK_SH):
                kept, todo, have = self._missing_blocks(blocks, text, tokens, tensors, meta, reason, ctx, values,
                                                        trailer_raw, axes, dtypes, exact)
                total = sum(PREFIX_SIZE + len(seg) + plan.payload_bytes + len(tr) for _, _, _, seg, plan, tr in todo)
                codec = d.settings.kv_codec
                if d.budget_bytes and not policy.bytes_fit(have + total, d.budget_bytes) and codec != "raw":
                    # Over the budget raw: what the blocks come to packed decides.
                    total = sum(PREFIX_SIZE + len(seg) + plan.packed_bytes(codec) + len(tr)
                                for _, _, _, seg, plan, tr in todo)
                # The whole chain must fit: the blocks it already has stay.
                if d.budget_bytes and not policy.bytes_fit(have + total, d.budget_bytes):
                    return self.refuse("budget", bytes=have + total, budget=d.budget_bytes)
                # Only the blocks really to be written draw on the write budget.
                if self.over_write_budget(reason, total):
                    return None
                self._publish_blocks(todo, reason, ctx, ext, written, nbytes)
        except OSError as e:
            # Blocks published before the failure stay (a valid chain prefix).
            d.count(save_errors=1, bytes_written=sum(nbytes))
            log.warning("kvstore: save_failed errno=%s error=%s blocks_written=%d file=%s", e.errno,
                        errno.errorcode.get(e.errno, "?"), len(written), short_name(last.name))
            return None
        if not written:
            if kept is not None:
                self.enqueue(kept)
            return kept
        dt = time.perf_counter() - t0
        d.count(saves=1, bytes_written=sum(nbytes), save_seconds=dt)
        log.info("kvstore: saved reason=%s tokens=%d text=%d blocks=%d written=%d bytes=%d save_ms=%.1f file=%s",
                 reason.name.lower(), last.tokens, last.text_bytes, len(blocks), len(written), sum(nbytes),
                 dt * 1e3, short_name(last.name))
        self._note_chain_size(last, have, have + total)
        for e in written:
            self.enqueue(e)          # never blocks: a background thread uploads
        entry = kept if kept is not None else written[-1]
        self.drop_replaced_tails(blocks, text)
        self.after_write(entry, text)
        if not os.path.lexists(entry.path):
            # Removed at once (by another process's wipe, say): not stored.
            log.info("kvstore: save_lost reason=removed file=%s", short_name(entry.name))
            return None
        return entry

    def _missing_blocks(self, blocks, text, tokens, tensors, meta, reason, ctx, values, trailer_raw, axes, dtypes,
                        exact):
        """(the kept last block or None, the blocks to write as (block,
        restorable, path, text segment, payload plan, trailer), the bytes of
        the blocks already stored)."""
        d = self.d
        snapshots = any(k not in axes for k in tensors)
        kept, todo, have = None, [], 0
        for b in blocks:
            restorable = b.last or not snapshots
            path = os.path.join(d.path, b.name)
            if b.last:
                kept = self.keep_existing(path, text, ctx, values, reason, block=b)
                if kept is not None:
                    have += kept.file_size
                    continue
            else:
                cur = d.codec.current(path)
                if chain.same_block(cur, b) and d.misfit(cur, ctx) is None and (cur.restorable or not restorable):
                    have += cur.file_size
                    continue
            seg = text[b.text_start:b.text_bytes]
            plan = payload.Plan(len(seg), tokens[b.token_start:b.tokens],
                                chain.block_tensors(tensors, axes, b, restorable), meta, axes=axes,
                                head=CHAIN_HEAD_SIZE, dtypes=dtypes, model=d.model_identity, exact=exact)
            todo.append((b, restorable, path, seg, plan, trailer_raw if b.last else b""))
        return kept, todo, have

    def _publish_blocks(self, todo, reason, ctx, ext, written, nbytes):
        """Writes the blocks of todo, then publishes them in order, appending
        each Entry to written and the bytes this process wrote to nbytes;
        indexes them.

        Every block is staged (written under a temporary name) first, its
        data synced on a sync thread while the next one is written; each is
        then linked in place, parent first, only once its own data is on the
        disk, and its directory synced before the next: a crash leaves a
        chain prefix, never a visible block whose parent is not there.
        """
        d = self.d
        now = int(time.time())
        staged = []
        packs = PackAhead(d.settings.kv_codec, [t[4] for t in todo])
        try:
            for k, (b, restorable, path, seg, plan, tr) in enumerate(todo):
                abi = forms.abi_of(packs.codecs(k), PAYLOAD_ABI_CHAIN)
                header = self._header(reason if b.last else Reason.CONTINUED, b.tokens, ctx, plan,
                                      ext if b.last else 0, abi, now)
                head = pack_chain_head(b.parent_digest, b.token_start, b.text_start, d.settings.block_tokens,
                                       b.flags(restorable), b.token_digest, b.parent_token_digest)
                staged.append((b, restorable, d.codec.stage(path, header, seg, plan, tr, head,
                                                            lookup_tag=b.lookup_tag)))
                if d.settings.durable:
                    staged[-1][2].sync_soon()
                raw, stored = plan.tensor_bytes()
                d.count(kv_raw_bytes=raw, kv_stored_bytes=stored)
            for k, (b, restorable, tmp) in enumerate(staged):
                written.append(self._publish_block(tmp, b, restorable, nbytes, last=k == len(staged) - 1))
        finally:
            for _, _, tmp in staged:
                tmp.close()
            with d.lock:
                d.index.add(*written)

    def _publish_block(self, tmp, b, restorable, nbytes, last):
        """Puts one staged block in place; its Entry, or the same block another
        writer put there first (the chains that already continue it keep
        their parent).  last: the save's last block (its directory sync
        makes the save durable: TempFile.publish)."""
        d = self.d
        # A new name is taken only if still free: of two writers of the
        # same block the first wins.
        if tmp.publish(d.settings.durable, exclusive=not os.path.lexists(tmp.final), last=last):
            nbytes.append(tmp.entry.file_size)
            return tmp.entry
        e = d.codec.current(tmp.final)
        if chain.same_block(e, b) and (e.restorable or not restorable):
            if last and d.settings.durable:
                files.sync_dir(d.path)   # the save's earlier steps, made durable
            return e
        tmp.publish(d.settings.durable, last=last)    # another file had the name: this block replaces it
        nbytes.append(tmp.entry.file_size)
        return tmp.entry

    def drop_replaced_tails(self, blocks, text):
        """Removes the tails this chained save grew past (docs/format.md §14).

        A tail is the last block of a save that does not end on the grid (a
        server stores one at a prompt's end, so that a restart reuses all of
        it).  Once a save of the same sequence writes the whole block it lay
        in, the sequence has moved on past it: a leaf beside that whole
        block, whose text is a strict prefix of this save's, with reason
        evict or shutdown (anchors, waypoints and sessions stay), goes.
        Another tail beside it (an answer's end beside its prompt's end)
        replaces nothing.
        """
        d = self.d
        shas = {b.sha for b in blocks}
        grid = d.settings.block_tokens
        with d.lock:
            cands = [e for b in blocks if b.parent and b.tokens % grid == 0
                     for e in d.index.kids_in_forest(b.parent)
                     if e.sha not in shas and e.ends_save and e.block_grid and e.tokens % e.block_grid
                     and e.reason in REPLACEABLE and e.tokens < b.tokens and e.text_bytes < len(text)]
            cands = [e for e in cands if not d.index.kids_in_forest(e.sha)]
        for e in names.named_prefixes(cands, text, d.codec.key_of):
            with d.dir_lock(fcntl.LOCK_EX):
                self.d.delete(e, "replaced_tail")

    # -- keeping what is there ----------------------------------------------

    def keep_existing(self, path, text, ctx, values, reason, block=None):
        """docs/semantics.md §6: a compatible file with the same name is kept; only its trailer changes.

        One header byte may change too: a file saved again as an agent
        session becomes one (reason byte 5), so that a named session whose
        text a server had already stored still shows in the session list.
        A session is never demoted by a later automatic save.  For the last
        block of a chained save (block), the file on disk is kept when it is
        that very block and restorable, or a whole file of the same text.
        A file the codec cannot change in place (a sealed one: its tags bind
        every byte) is kept only when nothing in it would change.
        """
        d = self.d
        try:
            fd, st = open_checkpoint(path, RDWR_FLAGS)
        except CheckpointMissing:
            return None
        except UnsafePath:
            return None              # a planted symlink: the rename replaces the name
        try:
            e = entry_from_fd(fd, st, path)
            if d.misfit(e, ctx) is not None or e.text_bytes != len(text):
                return None
            promote = reason == Reason.AGENT_SESSION and e.reason != Reason.AGENT_SESSION
            if (values or promote) and not d.codec.rewrites_in_place(e):
                return None
            src, plain = d.codec.open(fd, st, e)
            if payload.pread(src, plain.segment_bytes, PREFIX_SIZE) != text[e.text_start:]:
                return None
            # A block is kept when it stands on its own; by a chained save,
            # only when it is the very block that save would write.
            if e.is_block and (not e.restorable or (block is not None
                                                    and not chain.same_block(stored_entry(plain, st, e), block))):
                return None
            if values:
                e = self._rewrite_trailer(fd, e, values)
            if promote:
                os.pwrite(fd, bytes([int(Reason.AGENT_SESSION)]), 5)
                if d.settings.durable:
                    files.sync_fd(fd, data_only=True)
                e = entry_from_fd(fd, os.fstat(fd), e.path)
            with d.lock:
                d.index.add(e)
            log.info("kvstore: save_kept file=%s", short_name(e.name))
            return e
        except CorruptCheckpoint:
            # Corrupt, or made so under us (another process wiping it): not
            # kept; the save writes a fresh file and renames it over this one.
            return None
        finally:
            os.close(fd)

    def _rewrite_trailer(self, fd, e, values):
        """Merges values into the file's trailer in place; unknown sections stay.

        A crash half-way leaves a trailer section whose CRC fails: readers drop
        that section and the checkpoint itself stays usable (docs/format.md §10).
        """
        old_raw = os.pread(fd, e.file_size - e.trailer_offset, e.trailer_offset)
        old_values, sections, _ = trailer_mod.parse_trailer(old_raw, e.path, log)
        # encode_trailer writes back only the sections it cannot read itself.
        raw, ext = trailer_mod.encode_trailer({**old_values, **values}, sections)
        if raw == old_raw:
            return e
        try:
            _native.pwrite_from(fd, raw, e.trailer_offset, e.path)
            os.ftruncate(fd, e.trailer_offset + len(raw))
        except OSError:
            # A full disk half-way: put the old trailer back (it fitted
            # before), so that a failed save leaves the file as it was.
            try:
                _native.pwrite_from(fd, old_raw, e.trailer_offset, e.path)
                os.ftruncate(fd, e.trailer_offset + len(old_raw))
            except OSError:
                pass
            raise
        had = 0
        for s in sections:
            had |= 1 << s.bit
        os.pwrite(fd, bytes([(int(e.ext_flags) & ~had & 0xFF) | ext]), 6)
        if self.d.settings.durable:
            files.sync_fd(fd)           # the size changed too: not data only
        return entry_from_fd(fd, os.fstat(fd), e.path)

    def over_write_budget(self, reason, nbytes):
        """Takes nbytes from the write budget for a save of reason; True (the
        skip logged and counted) when the policy says the save must wait.

        The bucket is shared by every process on the directory
        (kvstore.counters); which reason may spend how much is
        kvstore.policy.write_allowed.
        """
        d = self.d
        cap = d.write_budget_bytes
        if cap is None or nbytes <= 0:
            return False
        ok, available = d.counters.take(nbytes, cap, lambda level: policy.write_allowed(reason, nbytes, level, cap))
        if ok:
            return False
        d.count(stores_skipped_write_budget=1)
        log.info("kvstore: store_skipped reason=%s why=write_budget bytes=%d available=%d",
                 Reason(reason).name.lower(), nbytes, available)
        return True


def as_bytes(text):
    """A prompt's text as bytes (str as UTF-8), or TypeError."""
    if isinstance(text, str):
        return text.encode("utf-8")
    if isinstance(text, (bytes, bytearray, memoryview)):
        return bytes(text)
    raise TypeError(f"prompt text must be str or bytes, not {type(text).__name__}")


def token_array(tokens):
    """tokens as a 1-D array (no copy) of fewer than 2**32 ids, or ValueError."""
    tokens = np.asarray(tokens)
    if tokens.ndim != 1 or tokens.size >= 2**32:
        raise ValueError(f"tokens must be a 1-D sequence of < 2**32 ids, got shape {tokens.shape}")
    return tokens


def check_axes(positional, tensors, n):
    """positional as {name: axis}, checked: each a tensor holding n rows along axis."""
    if not positional:
        return {}
    out = {}
    for name, axis in dict(positional).items():
        if name not in tensors:
            raise ValueError(f"positional names tensor {name!r}, which is not among the tensors")
        shape = tuple(int(dim) for dim in tensors[name].shape)
        if type(axis) is not int or not 0 <= axis < len(shape) or shape[axis] != n:
            raise ValueError(f"positional[{name!r}]={axis!r}: the tensor's shape {shape} does not hold "
                             f"{n} tokens along that axis")
        out[name] = axis
    return out
