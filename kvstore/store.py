"""KVStore: the directory cache (docs/semantics.md §4-§8 and §11).

One directory of .kv files shared by any number of processes.  KVStore keeps
the public methods and wires the store's parts, each with one job:

- kvstore.directory.Directory: the open directory (settings, index, locks,
  counters, the codec) and what fits this engine;
- kvstore.codec: how a file's bytes are read and written (plain, or a codec
  registered from above, such as kvstore.seal's);
- kvstore.reader.Reader: find() and load(), falling back past a bad block,
  fetching remote hits;
- kvstore.saver.Saver: save(), writing only the blocks the directory lacks;
- kvstore.evictor.Evictor: eviction, expiry, orphans, superseded waypoints;
- kvstore.writer.BackgroundWriter: save_async() on a background thread.

Nothing here knows about models: the tensors are named arrays and the meta is
the engine's JSON.  Corrupt files never reach the caller: they are removed (or
moved aside) and the lookup is a miss.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any, Literal

import numpy as np

from kvstore import files, payload, tiers
from kvstore import pins as pins_mod
from kvstore import identity as identity_mod
from kvstore.codec import make_codec
from kvstore.directory import LOCK_NAME, Directory
from kvstore.divergence import divergence
from kvstore.errors import PinRefused, StoreClosed
from kvstore.files import short_name
from kvstore.evictor import ORPHAN_SWEEP_INTERVAL_S, Evictor
from kvstore.format import Entry, Reason
from kvstore.identity import ModelIdentity
from kvstore.settings import Settings, settings_of
from kvstore.divergence import Divergence
from kvstore.reader import LOAD_TRIES, Checkpoint, Match, Reader
from kvstore.saver import Saver, as_bytes, token_array
from kvstore.writer import ProcessWriter

log = logging.getLogger("kvstore")


def _of_directory(name, doc):
    """A read-only attribute of the store that is its directory's."""
    return property(lambda self: getattr(self._dir, name), doc=doc)


class KVStore:
    """A directory of KV checkpoints.

    Args:
        path: the directory; created 0700 if missing.
        settings: a kvstore.Settings (every setting, its default and its
            check; docs/semantics.md §7 for the policy's); None: the
            defaults.
        **changes: settings by name, over settings (``KVStore(path,
            budget_mb=8192, layout="whole")``); a name that is not a
            setting is a TypeError naming it.
        model_identity: the exact model this store holds state of: a string
            (kvstore.mlx.model_fingerprint(model), or a name of the exact
            artifact such as its repository and revision) or a
            kvstore.identity.ModelIdentity.  Every file the store writes
            records it (the header's model tag, the name's namespace, the
            manifest), and lookups and loads offer only its own files:
            another model's are foreign (listed, counted in the budget,
            evictable, never loaded), so that many models can share one
            directory and one budget (docs/semantics.md §17).  It also makes
            the remote key prefix.  None (the default): files that name no
            model, as before identities (the raw tensor store).
        key: seal every file this store writes (docs/format.md §16): 32
            raw bytes, or the path of a key file (``kvstore key new FILE``;
            mode 0600, 32 bytes).  Text, payload and trailer are encrypted
            and authenticated (AES-256-GCM), names are keyed MACs; a file
            that fails authentication is treated as corrupt.  Header fields
            (sizes, token counts, times, reason, model id) stay readable.
            None (the default): files are plain; sealed files are foreign.
        remote: ``s3://bucket/prefix``: share checkpoints through a bucket on
            any S3-compatible store, a second tier behind this directory
            (kvstore.remote; needs boto3: ``pip install 'kvstore[s3]'``).
        remote_options: dict for the remote tier: endpoint_url, region,
            profile, connect_timeout, read_timeout, refresh_interval_s,
            upload_queue, ... (kvstore.remote.resolve_options lists them).
            Credentials come from the standard AWS chain, never from here.

    Raises:
        kvstore.settings.BadSetting (a ValueError) or TypeError: a setting
            out of range or of the wrong type, named with its value, before
            anything touches the directory.
    """

    def __init__(self, path: str | os.PathLike, settings: Settings | None = None, *,
                 model_identity: str | ModelIdentity | None = None, key: bytes | str | os.PathLike | None = None,
                 remote: str | None = None, remote_options: Mapping[str, Any] | None = None, **changes: Any) -> None:
        settings = settings_of(settings, changes)                  # BadSetting, TypeError if bad
        identity = identity_mod.as_identity(model_identity)      # ValueError if bad
        codec = make_codec(key, identity, settings.accept_unsealed, settings.accept_unidentified)  # BadKey if bad
        self._dir = Directory(path, codec, identity, settings)
        self.settings = settings
        self.path = self._dir.path
        self.sealed = key is not None
        self._closed = False
        self._writer = ProcessWriter()
        self._evictor = Evictor(self._dir)
        self.evict()            # lists the directory (the first index refresh) and applies the budget
        self._dir.sweep_temps()  # what that listing saw of writers gone
        self.remote = None if remote is None else tiers.open_remote(remote, self, remote_options)
        enqueue = self.remote.enqueue if self.remote is not None else None
        self._reader = Reader(self._dir, self.remote, on_fetched=self._evictor.evict_if_over)
        self._saver = Saver(self._dir, enqueue, after_write=self._evictor.evict_if_over)

    identity = _of_directory("identity", "The store's kvstore.identity.ModelIdentity, or None.")
    accept_unidentified = _of_directory("accept_unidentified", "Lookups also offer files that name no model "
                                   "(the setting, with an identity).")
    write_budget_bytes = _of_directory("write_budget_bytes", "The write budget's capacity in bytes, or None.")
    model_identity = _of_directory("model_identity", "The identity string of the store's model, or None.")
    model_tag = _of_directory("model_tag", "The header model tag of the store's files (0: they name no model).")
    budget_derived = _of_directory("budget_derived", "The budget is the default derived from the filesystem's size.")

    @property
    def budget_bytes(self) -> int:
        """The disk budget in bytes (0: unlimited)."""
        return self._dir.budget_bytes

    @budget_bytes.setter
    def budget_bytes(self, value: int) -> None:
        self._dir.budget_bytes, self._dir.budget_derived = int(value), False

    @property
    def sealer(self):
        """The kvstore.seal.Sealer of the store's key, or None (a plain store)."""
        return getattr(self._dir.codec, "sealer", None)

    def _check_open(self):
        if self._closed:
            raise StoreClosed(f"KVStore({self.path!r}) is closed")

    # -- lookup and load (sections 4, 5) -----------------------------------

    def misfit(self, entry: Entry, ctx_size: int | None = None) -> str | None:
        """Why this store cannot load a checkpoint, or None when it fits (kvstore.policy.misfit).

        Args:
            entry: an Entry.
            ctx_size: the context to judge against (default: the store's).
        """
        return self._dir.misfit(entry, ctx_size)

    def find(self, prompt: str | bytes, accept: Callable[[Entry], bool] | None = None) -> Match | None:
        """The entry with the longest stored text that is a byte prefix of prompt.

        Every loadable block of a complete chain counts, as does every ABI 16
        file (docs/semantics.md §4, docs/format.md §14).

        Args:
            prompt: str (UTF-8) or bytes.
            accept: optional predicate on a local Entry; a match it refuses
                is passed over for the next longest (a caller that can use
                only some cut points, say whole UTF-8 characters).

        Returns:
            kvstore.reader.Match (the Entry, with the lookup's state), or None on a miss.
        """
        self._check_open()
        match, orphans = self._reader.find(as_bytes(prompt), accept)
        if orphans:
            self._evictor.sweep_orphans()
        return match

    def explain(self, prompt: str | bytes) -> Divergence | None:
        """Where prompt (str or bytes) parts from what is stored: kvstore.divergence.Divergence, or None."""
        self._check_open()
        return divergence(self._dir.index, as_bytes(prompt), self._reader.segment, self._dir.lock)

    def load(self, entry: Entry, into: Literal["numpy", "mlx"] = "numpy", *, min_tokens: int | None = None,
             consume: bool = False) -> Checkpoint | None:
        """Loads a checkpoint found by find() (or listed by entries()).

        Args:
            entry: an Entry.
            into: "numpy" or "mlx" (arrays of that library; bfloat16 tensors
                come back as uint16 bit patterns in NumPy, which has no bfloat16).
            min_tokens: the shortest checkpoint this load accepts (default
                options.min_tokens).  Agent sessions, addressed by name rather
                than found by lookup, load at any length.
            consume: delete a whole checkpoint (ABI 16) of more than
                options.cold_max_tokens after loading it, as a server that
                takes a long state over and will store it again does
                (docs/semantics.md §5; PromptCache and kvstore serve ask for
                it).  Default False: a load deletes nothing.  Chain blocks
                and agent sessions are never consumed.

        Returns:
            Checkpoint, or None when the file vanished, is corrupt (it is then
            removed or quarantined) or its text does not match the prompt.
        """
        self._check_open()
        if into not in ("numpy", "mlx"):
            raise ValueError(f"into={into!r}; expected 'numpy' or 'mlx'")
        return self._reader.load(entry, into, min_tokens, consume)

    def discard(self, entry: Entry, reason: str, quarantine: bool | None = None) -> bool:
        """Removes (or quarantines) a checkpoint found unusable by a caller.

        For engines that load a payload and then find it cannot be used (a
        cache that does not rebuild, say).  The file is removed only if it is
        still the one the entry describes (same inode), never a newer save;
        a chain block takes the blocks after it along.

        Args:
            entry: the Entry (a Checkpoint's).
            reason: a word for the log line.
            quarantine: move it to <dir>/.quarantine instead of deleting it
                (None: the store's own setting).

        Returns:
            True when the file was removed or moved aside.
        """
        return self._dir.discard(entry, reason, quarantine)

    def record_canary(self, entry: Entry, ok: bool, detail: str = "") -> None:
        """Counts a canary check of a restored checkpoint (kvstore.mlx.canary).

        A failed one (the live model would not have produced the stored
        state: another model's weights, RoPE or KV dtype, or damage no CRC
        caught) is logged and quarantined, so that no later request loads
        it and a person can look at it.

        Args:
            entry: the restored Checkpoint's Entry.
            ok: the canary's verdict.
            detail: key=value words for the log line (never prompt text).
        """
        self._dir.count(canary_checks=1, canary_failures=0 if ok else 1)
        if ok:
            return
        log.warning("kvstore: canary_failed tokens=%d %s file=%s", entry.tokens, detail, short_name(entry.name))
        self.discard(entry, "canary", quarantine=True)

    # -- save (section 6) --------------------------------------------------

    def save(self, text: str | bytes, tokens: Sequence[int] | np.ndarray, tensors: Mapping[str, Any],
             meta: Mapping[str, Any] | None = None, reason: Reason = Reason.COLD, ctx_size: int | None = None,
             trailers: Mapping[int, Any] | None = None, *, min_tokens: int | None = None,
             positional: Mapping[str, int] | None = None, text_offsets: Sequence[int] | np.ndarray | None = None,
             dtypes: Mapping[str, str] | None = None, exact: Sequence[str] = ()) -> Entry | None:
        """Stores a checkpoint for the prompt text.

        With layout "chain" (the default) the state is cut into blocks of
        block_tokens tokens and only the blocks not stored yet are written,
        parent first, each durable (docs/format.md §14); the returned entry
        is the last block.  Cutting needs text_offsets and knowing which
        tensors grow along the sequence (positional); without them the save
        is one block.

        Args:
            text: the rendered prompt prefix (str or bytes) the state belongs to.
            tokens: the exact token ids prefilled for it (sequence or array).
            tensors: dict name -> numpy or MLX array.
            meta: engine JSON (dict) stored in the manifest.
            reason: kvstore.format.Reason.
            ctx_size: context size the state was made with (default: the store's).
            trailers: dict ext-bit -> value for the trailer hooks (docs/format.md §10).
            min_tokens: refuse fewer tokens than this (default
                options.min_tokens); agent sessions are saved at any length.
            positional: dict name -> axis of every tensor that holds one row
                per token along that axis (KV caches); the others are
                snapshots of the state at the end.
            text_offsets: the byte length of the text of the first i tokens,
                for i in 0..len(tokens) (a sequence of len(tokens) + 1 ints,
                or a callable i -> int, or a dict {i: length} of some cut
                points): where blocks may be cut.
            dtypes: name -> the dtype to record for a tensor whose array
                cannot hold it (bfloat16 bits in a NumPy uint16 array).
            exact: names of tensors a lossy kv_codec leaves exact: a state
                quantised already (kvstore.mlx.codecs.quantized_names).

        Returns:
            the new (or kept) Entry, or None when refused (too few tokens, over
            budget) or when the disk failed; the log says why.
        """
        self._check_open()
        return self._saver.save(as_bytes(text), token_array(tokens), tensors, meta, reason, ctx_size, trailers,
                                min_tokens, positional, text_offsets, dtypes, exact)

    def verify_file(self, path: str | os.PathLike, name: str | None = None) -> str | None:
        """Checks one file as a load would, without keeping arrays (kvstore verify).

        A sealed file of this store's key is authenticated chunk by chunk
        (kvstore.seal.Sealer.verify_file); any other file as
        kvstore.files.verify_file checks it.

        Args:
            path: the file.
            name: the checkpoint name it will have, for a file not yet under
                it (a download in a temporary file): a sealed file's tags
                bind its name.

        Returns:
            None when sound, else a one-line reason (never prompt text).
        """
        return self._dir.codec.verify_file(path, name=name)

    def save_async(self, text: str | bytes, tokens: Sequence[int] | np.ndarray, tensors: Mapping[str, Any],
                   **kwargs: Any) -> Future:
        """save() on the background writer; returns a concurrent.futures.Future.

        The arrays are captured now: NumPy arrays are copied (the caller may
        reuse its buffers at once), MLX arrays are evaluated on the calling
        thread and handed to the writer as NumPy views of their memory, no
        copy (bfloat16 as its bits, recorded as bfloat16): the writer runs no
        MLX op.  Blocks only while the writer's bounded queue is full.
        """
        self._check_open()
        # Shape checked before the copy: a broadcast view of 2**32 ids costs
        # nothing, its copy 16 GiB.
        tokens = np.array(token_array(tokens), copy=True)
        captured, dtypes = self.capture(tensors, kwargs.get("dtypes"))
        if dtypes:
            kwargs["dtypes"] = dtypes
        return self.submit(self.save, as_bytes(text), tokens, captured, **kwargs)

    def capture(self, tensors: Mapping[str, Any], dtypes: Mapping[str, str] | None = None
                ) -> tuple[dict[str, np.ndarray], Mapping[str, str]]:
        """(tensors as the background writer may use them later, the dtypes to
        record): save_async's capture, on the calling thread (see save_async).

        Returns:
            (dict name -> NumPy array, dict name -> recorded dtype or {}).
        """
        # MLX arrays: NumPy views of their memory, made here in one evaluation
        # (payload.host_tensors says why no MLX op may run on the writer's
        # thread, and why a view keeps today's data).  NumPy arrays are copied.
        host, dtypes = payload.host_tensors(tensors, dtypes)
        return {k: a if host[k] is not tensors[k] else np.array(a, copy=True) for k, a in host.items()}, dtypes

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Future:
        """Runs fn(*args, **kwargs) on the store's background writer, after the
        saves queued before it; returns a concurrent.futures.Future.

        For work that belongs beside a save (naming, checking, then saving
        what capture() took), off the caller's thread.  Blocks only while the
        writer's bounded queue is full.
        """
        return self._background().submit(fn, *args, **kwargs)

    def try_submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Future | None:
        """submit() that never blocks: None when the writer's queue is full.

        For a serving loop, which must not wait for the disk: what it does
        not queue it does not store.
        """
        return self._background().try_submit(fn, *args, **kwargs)

    def _background(self):
        """The store's background writer in this process (kvstore.writer.ProcessWriter)."""
        self._check_open()
        return self._writer.get()

    def flush(self) -> None:
        """Waits for every queued save_async to finish."""
        self._writer.flush()

    # -- eviction (section 8) ----------------------------------------------

    def evict(self, protect: Entry | None = None, incoming_text: bytes | None = None) -> list[Entry]:
        """Deletes lowest-score checkpoints until the directory fits the budget.

        Runs under the directory's exclusive lock (<dir>/.kvstore.lock) so
        that two evicting processes never delete more than needed and no
        chained save is publishing blocks meanwhile.  Chain blocks go leaves
        first: a block is a candidate only once no stored block continues it,
        so no chain is ever cut in the middle.  Orphaned blocks (whose chain
        does not reach a first block) are removed first.

        Args:
            protect: an Entry never chosen (unless it alone exceeds the budget).
            incoming_text: the text of the checkpoint just written; continued
                waypoints it supersedes score lower.

        Returns:
            the list of evicted entries.
        """
        self._check_open()
        return self._evictor.evict(protect, incoming_text)

    # -- listing, stats, wipe, close ---------------------------------------

    def pin(self, text: str | bytes, ttl_s: float, tenant: str = "") -> Entry:
        """Keeps the checkpoint stored for exactly text through eviction for ttl_s seconds.

        While the pin lives, eviction (budget, stale, maximum age) never
        chooses that file nor, for a chain block, a block before it; pinning
        again extends the lifetime, never shortens it.  Pins are kept in the
        directory (kvstore.pins), so they outlive this process.

        Args:
            text: str (UTF-8) or bytes: the whole prefix, as saved.
            ttl_s: seconds, or "5m" / "1h"; cut to Settings.max_pin_ttl_s.
            tenant: the pinning tenant's tag as hex (kvstore serve), or "".

        Returns:
            the kvstore.pins.Pin granted.

        Raises:
            ValueError: ttl_s is not a lifetime.
            PinRefused: no checkpoint holds exactly text ("not_stored"), or
                pinned bytes would pass Settings.max_pinned_share of the
                budget ("share"); other pins are never removed to make room.
        """
        self._check_open()
        pins_mod.parse_ttl(ttl_s)
        data = as_bytes(text)
        match = self.find(data)
        if match is None or match.text_bytes != len(data):
            raise PinRefused("not_stored", f"no checkpoint of this store holds exactly this {len(data)}-byte "
                                           "prefix: save it first")
        return self._evictor.pin(match, ttl_s, tenant)

    def unpin(self, entry: Entry) -> bool:
        """Lifts the pin of a checkpoint (an Entry from find or entries()); True when it had one."""
        self._check_open()
        return self._evictor.unpin([entry.sha]) > 0

    def pins(self) -> list[Any]:
        """The live pins of this directory's files, the latest lifetime first ([kvstore.pins.Pin])."""
        self._check_open()
        return self._evictor.pins()

    def entries(self) -> list[Entry]:
        """Every valid envelope in the directory (foreign payload ABIs included)."""
        self._check_open()
        with self._dir.lock:
            self._dir.index.refresh()
            return sorted(self._dir.index.entries.values(), key=lambda e: e.name)

    def stats(self) -> dict[str, Any]:
        """Counters of this process plus the directory's current size.

        "models" lists the models whose files the directory holds
        (kvstore.registry.summarize); "pins" and "pinned_bytes" count the
        live pins of files present and the bytes they keep (kvstore.pins).
        "write_budget" is None without max_write_mb_per_hour, else
        {"capacity_bytes", "available_bytes", "rate_bytes_per_s"} (the
        bucket every process on the directory draws from, as this store
        sees it).  The cumulative counters of every process are counters().
        """
        self._check_open()
        out = self._dir.report()
        if self.remote is not None:
            out.update(self.remote.stats())
        return out

    def counters(self) -> dict[str, Any]:
        """The directory's cumulative counters: every process that used it, across restarts.

        Read from ``<dir>/.counters`` (docs/semantics.md §15); `kvstore stats
        --json` prints the same numbers.  Counting is best-effort: when the
        file cannot be used, this process's own counts.

        Returns:
            a dict: "saves", "bytes_written", "loads", "bytes_read", "hits",
            "misses", "evictions", "bytes_evicted", "corrupt",
            "stores_skipped_write_budget" (ints); "load_seconds" and
            "save_seconds", each {"buckets": [[le, cumulative count], ...]
            (le a float, the last float("inf")), "count": n, "sum_s":
            seconds}; and "write_budget": None, or {"capacity_bytes",
            "available_bytes", "rate_bytes_per_s"} (this store's budget, else
            the one the directory's last budgeted writer recorded).
        """
        self._check_open()
        return self._dir.counters.report(self.write_budget_bytes)

    def starts_with(self, entry: Entry, prefix: bytes) -> bool:
        """True when the stored text of entry (a chain block's whole sequence) starts with prefix bytes; the
        text is compared here and never returned (kvstore serve's tenant delete compares a tenant's key prefix)."""
        self._check_open()
        return self._reader.text_head(entry, len(prefix)) == prefix

    def wipe(self, entry: Entry | None = None) -> int:
        """Overwrites then unlinks one checkpoint, or every checkpoint.

        The text copy in every file is prompt content: wipe overwrites the
        bytes with zeros (and syncs) before unlinking, so a later reader of
        the disk blocks does not find them in freed space.  The directory's
        counters file stays: it is not a checkpoint and holds no prompt text.

        Returns:
            the number of files wiped.
        """
        self._check_open()
        targets = [entry] if entry is not None else self.entries()
        if entry is not None and entry.is_block:
            # The blocks after it could never be loaded again.
            with self._dir.lock:
                self._dir.index.refresh()
                targets += self._dir.index.descendants(entry)
        n = 0
        for e in targets:
            st = files.overwrite(e.path)
            if st is not None and self._dir.unlink_if_same(e.path, st):
                n += 1
        self._evictor.unpin(e.sha for e in targets)
        return n

    def close(self) -> None:
        """Waits for queued saves and closes the store."""
        if self._closed:
            return
        self._writer.close()
        if self.remote is not None:
            self.remote.close()
        self._dir.close()
        self._closed = True

    def __enter__(self) -> KVStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["KVStore", "Checkpoint", "Match", "LOCK_NAME",
           "LOAD_TRIES", "ORPHAN_SWEEP_INTERVAL_S"]
