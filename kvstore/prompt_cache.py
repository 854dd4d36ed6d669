"""PromptCache: the serving policy of docs/semantics.md §7, for a server's request loop.

A server keeps one live session (the model state in memory) and a KVStore on
disk.  For each request PromptCache decides where the prompt's prefix comes
from, builds the effective prompt, drives the chunked prefill and decides
what to store and when:

    prompt text ──► memory hit?  (the live session's text is a prefix)
                └─► disk hit?    (store.find: the longest stored byte prefix)
                └─► cold         (nothing reusable)
    effective prompt = reused exact tokens + tokenize(only the text suffix)
    prefill in chunks aligned to absolute multiples of the prefill step,
      storing `continued` waypoints at aligned frontiers and, for a cold
      request, the `cold` anchor (last user marker before the first
      assistant marker, else store_len)
    before a disk load replaces a live session of >= min_tokens: store it
      as `evict`; on close: store the live session as `shutdown`.

The engine is anything that implements the small Engine protocol below; the
MLX implementation is kvstore.mlx.MLXEngine.  Nothing here imports MLX.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from kvstore import policy
from kvstore.format import Reason
from kvstore.identity import check_holds

if TYPE_CHECKING:
    from kvstore.store import Checkpoint, KVStore

log = logging.getLogger("kvstore")

# ds4's prefill chunk and the boundary alignment: a checkpoint at a multiple
# of it restores to a state bit-identical to a cold prefill with this step.
DEFAULT_PREFILL_STEP = 2048


class Engine(Protocol):
    """What PromptCache needs from an inference engine."""
    model_id: int            # header model id (0..255)
    quant_bits: int          # quant bits of the weights (2,3,4,5,6,8,16)
    ctx_size: int            # context size of the live session
    user_id: int             # user-marker token id, negative when none
    assistant_id: int        # assistant-marker token id, negative when none

    def tokenize(self, text: bytes) -> list: ...
    """Token ids of a text suffix (bytes that start at a UTF-8 boundary)."""

    def token_bytes(self, tokens) -> bytes: ...
    """The exact bytes the tokens render to (for checkpoint keys)."""

    def reset(self) -> None: ...
    """Empties the live state."""

    def prefill(self, tokens) -> Any: ...
    """Extends the live state by tokens; returns the last position's logits."""

    def snapshot(self) -> tuple: ...
    """(tensors, meta) of the live state, captured now (immutable arrays); or
    (tensors, meta, positional) where positional maps each tensor that holds
    one row per token to its axis (KVStore.save), so a chained store writes
    each token's state once."""

    # Optional: exact_names(meta) -> the names of a snapshot's tensors that
    # are quantised already, which a lossy kv_codec leaves exact.

    # Optional: text_offsets(tokens, text_len) -> the byte offset where each
    # token's text starts (len(tokens) + 1 ints) or None; with it a chained
    # store cuts saves into blocks (a hit at every block boundary).

    # Optional: identity, the model's kvstore.identity.ModelIdentity; the
    # store must hold that model's state (KVStore(model_identity=...)).

    # Optional, the canary (kvstore.mlx.canary, docs/semantics.md §17):
    # canary_prepare(tokens, lossy) -> (probe, None) after trimming the
    # restored state by one token, or (None, verdict), lossy the codec the
    # state was stored with (Checkpoint.lossy: "" exact, "q8", "q4"; it sets
    # the tolerance); canary_finish(probe) -> verdict
    # once the state holds probe.position again.  A verdict has ok, applies
    # and words().

    def restore(self, tensors: dict, meta: dict) -> None: ...
    """Replaces the live state with a stored one."""


@dataclasses.dataclass
class Request:
    """One request's plan and, after prefill, its report."""
    source: str                   # "memory", "disk" or "none"
    tokens: list                  # the effective prompt (exact token ids)
    reused: int                   # tokens taken from memory or disk
    text: bytes = dataclasses.field(repr=False, default=b"")
    cold_target: int = 0          # position of the cold anchor (0: none)
    prefilled: int = 0
    load_ms: float = 0.0
    save_ms: float = 0.0
    stored: list = dataclasses.field(default_factory=list)   # (reason, tokens)
    started: float = 0.0
    canary: str = ""              # "", "tail", "head", "none" (not applicable) or "failed"
    probe: Any = dataclasses.field(default=None, repr=False)    # (tail probe, Entry) under way


class PromptCache:
    """The request-loop policy over one engine and one KVStore.

    Args:
        store: kvstore.KVStore (its settings give min_tokens, cold_max_tokens,
            the waypoint interval and the boundary rules).
        engine: an Engine.
        prefill_step: tokens per prefill chunk; chunks end at absolute
            multiples of it so that stored boundaries replay bit-exactly.
        async_saves: store checkpoints on the store's background writer.
    """

    def __init__(self, store: KVStore, engine: Engine, prefill_step: int = DEFAULT_PREFILL_STEP,
                 async_saves: bool = False) -> None:
        if prefill_step < 1:
            raise ValueError(f"prefill_step={prefill_step} must be >= 1")
        identity = getattr(engine, "identity", None)
        if identity is not None:            # one store, one model
            check_holds(store.path, store.model_identity, identity.fingerprint,
                        "KVStore(path, model_identity=engine.identity)")
        self.store = store
        self.engine = engine
        self.settings = store.settings
        self.prefill_step = int(prefill_step)
        self.async_saves = async_saves
        self.live_tokens: list[int] = []        # the tokens whose state is in the engine
        self._live_text: bytes | None = None   # cached token_bytes(live_tokens)
        self._last_store = 0             # token count of the last waypoint stored

    # -- the live session ----------------------------------------------------

    @property
    def live_text(self) -> bytes:
        text = self._live_text
        if text is None:
            text = self._live_text = self.engine.token_bytes(self.live_tokens)
        return text

    def _set_live(self, tokens, text=None):
        self.live_tokens = list(tokens)
        self._live_text = text

    # -- request start -------------------------------------------------------

    def begin(self, prompt: str | bytes) -> Request:
        """Decides memory / disk / cold for a prompt and sets the live state.

        Args:
            prompt: the rendered prompt (str or bytes).

        Returns:
            Request with the effective prompt; call prefill(request) next.
        """
        t0 = time.perf_counter()
        text = prompt.encode("utf-8") if isinstance(prompt, str) else bytes(prompt)
        live_n = len(self.live_tokens)
        memory_ok = live_n > 0 and len(self.live_text) <= len(text) and text.startswith(self.live_text)
        if memory_ok and not _utf8_boundary(self.live_text):
            # Generation stopped inside a character (byte tokens): the suffix
            # would start mid-character and cannot be tokenized on its own.
            memory_ok = self._rewind_to_whole_character()
            live_n = len(self.live_tokens)
        memory_len = len(self.live_text) if memory_ok else -1

        # Only cut points at whole characters: the text after a stored one
        # is tokenized on its own.
        entry = self.store.find(text, accept=lambda e: _utf8_boundary(text[:e.text_bytes]))
        req = None
        if entry is not None and entry.text_bytes > memory_len:
            req = self._disk_hit(entry, text)
        if req is None and memory_ok:
            suffix = text[len(self.live_text):]
            req = Request("memory", self.live_tokens + list(self.engine.tokenize(suffix)), live_n, text)
        if req is None:
            req = self._cold(text)
        req.started = t0
        return req

    def _rewind_to_whole_character(self):
        """Drops the live tokens after the last whole UTF-8 character; False if it cannot.

        A character has at most 4 bytes, so at most 4 tokens hold part of it.
        """
        n, text = len(self.live_tokens), self.live_text
        for k in range(1, min(4, n - 1) + 1):
            if _utf8_boundary(text[:len(text) - len(self.engine.token_bytes(self.live_tokens[n - k:]))]):
                return self.rewind(k)
        return False

    def _disk_hit(self, entry, text):
        # docs/semantics.md §7: the live session is about to be replaced; keep it.
        self._store_leaving(Reason.EVICT)
        t = time.perf_counter()
        ckpt = self.store.load(entry, into=self._load_into(), consume=True)
        if ckpt is None:
            return None
        self.engine.restore(ckpt.tensors, ckpt.meta)
        tokens = ckpt.tokens.tolist()
        self._set_live(tokens, ckpt.text_bytes)
        self._last_store = len(tokens)
        req = Request("disk", tokens + list(self.engine.tokenize(text[len(ckpt.text_bytes):])), len(tokens), text)
        if not self._start_canary(req, ckpt, tokens):
            return self._cold(text)
        req.load_ms = (time.perf_counter() - t) * 1e3
        return req

    # -- the canary (docs/semantics.md §17) -------------------------------------

    def _start_canary(self, req, ckpt, tokens):
        """Starts the canary of a state restored from ckpt; False when it already failed.

        A tail canary trims the live state by one token: the prefill then
        feeds that token again first, and prefill() finishes the check.
        """
        prepare = getattr(self.engine, "canary_prepare", None)
        if prepare is None:
            return True
        probe, verdict = prepare(tokens, ckpt.lossy)
        if probe is not None:
            self._set_live(tokens[:-1])
            req.probe = (probe, ckpt.entry)
            return True
        return self._canary_verdict(req, ckpt.entry, verdict)

    def _canary_verdict(self, req, entry, verdict):
        """Records a verdict; False (the state is reset) when it failed."""
        req.canary = verdict.kind if verdict.ok else "failed"
        if not verdict.applies:
            log.info("kvstore: canary_not_applicable reason=no_attention_rows tokens=%d", entry.tokens)
            return True
        self.store.record_canary(entry, verdict.ok, verdict.words())
        if verdict.ok:
            return True
        self.engine.reset()
        self._set_live([], b"")
        return False

    def _finish_canary(self, req):
        """After a chunk that recomputed the probed token: the verdict; on a
        failure the request starts again cold (the hit becomes a miss)."""
        probe, entry = req.probe
        req.probe = None
        if self._canary_verdict(req, entry, self.engine.canary_finish(probe)):
            return req
        cold = self._cold(req.text)
        cold.started, cold.canary, cold.load_ms = req.started, req.canary, req.load_ms
        return cold

    def _cold(self, text):
        self.engine.reset()
        self._set_live([], b"")
        self._last_store = 0
        tokens = list(self.engine.tokenize(text))
        req = Request("none", tokens, 0, text)
        anchor = policy.chat_anchor_pos(tokens, self.engine.user_id, self.engine.assistant_id, self.settings)
        req.cold_target = policy.cold_target(len(tokens), anchor, self.settings)
        return req

    def _load_into(self):
        return getattr(self.engine, "load_into", "numpy")

    # -- prefill -------------------------------------------------------------

    def prefill(self, req: Request, progress: Callable[[int, int], Any] | None = None) -> Any:
        """Prefills req.tokens beyond what is reused, storing checkpoints on the way.

        Chunks end at absolute multiples of prefill_step, at the cold anchor
        and at the end of the prompt.  Waypoints (docs/semantics.md §7) are stored when the
        live count is an exact multiple of the continued step; a cold anchor
        on that frontier suppresses the waypoint, and a failed cold store
        restores it.

        Args:
            req: the Request from begin().
            progress: optional callable(done_tokens, total_tokens).

        Returns:
            the engine's logits for the last prompt token (None if nothing was
            prefilled and the prompt is fully reused).
        """
        tokens = req.tokens
        pos = len(self.live_tokens)
        if pos > len(tokens) or self.live_tokens != tokens[:pos]:
            raise RuntimeError("live state does not match the request; call begin() first")
        if pos == len(tokens) and pos > 0:
            # Everything is cached: re-run the last token to get its logits.
            self._rewind_one()
            pos -= 1
        logits = None
        step = self.prefill_step
        while pos < len(tokens):
            # The canary's token goes with the chunk after it: chunks still
            # end at absolute multiples of the step.
            at = pos + 1 if req.probe is not None else pos
            end = min(len(tokens), (at // step + 1) * step)
            if pos < req.cold_target < end:
                end = req.cold_target
            logits = self.engine.prefill(tokens[pos:end])
            req.prefilled += end - pos
            pos = end
            self._set_live(tokens[:pos])
            if req.probe is not None:
                cold = self._finish_canary(req)
                if cold is not req:
                    # The restored state was not this model's: start again
                    # from nothing, in the same Request the caller holds.
                    vars(req).update(vars(cold))
                    tokens, pos = req.tokens, 0
                    continue
            if progress is not None:
                progress(pos, len(tokens))
            self._maybe_store(req, pos)
        return logits

    def _rewind_one(self):
        """Drops the last live token so that it can be fed again."""
        if self.rewind(1):
            return
        # No trim: rebuild from scratch (rare: a prompt equal to the live text).
        tokens = self.live_tokens[:-1]
        self.engine.reset()
        self._set_live([], b"")
        for i in range(0, len(tokens), self.prefill_step):
            self.engine.prefill(tokens[i:i + self.prefill_step])
        self._set_live(tokens)

    def _maybe_store(self, req, pos):
        """Stores the first of the policy's targets at pos that stores (kvstore.policy.prefill_stores)."""
        grid = self.settings.block_tokens if self.settings.layout == "chain" else 0
        for target in policy.prefill_stores(pos, self.settings, req.cold_target, self._last_store, grid):
            if target.kind == policy.SNAPSHOT and not self._snapshots_are_cheap(pos, grid):
                continue
            if self._store_live(target.reason, req) is not None:
                self._last_store = policy.last_store_after(self._last_store, pos, target)
                return

    def _snapshots_are_cheap(self, pos, grid):
        snap = self.engine.snapshot()
        if len(snap) < 3:
            return False
        tensors, _, positional = snap[0], snap[1], snap[2]
        return policy.snapshot_every_block(tensors, positional, pos, grid)

    def _store_live(self, reason, req):
        """Stores the live state under its exact text; returns the entry (or future).

        The whole state, when the policy finds it worth a file
        (kvstore.policy.store_cut: never cut here, so all of it or nothing).
        """
        n = len(self.live_tokens)
        if not policy.store_cut(n, self.settings):
            return None
        text = self.live_text
        if req is not None and not req.text.startswith(text):
            log.info("kvstore: store_skipped reason=text_not_prefix tokens=%d", n)
            return None
        if not _utf8_boundary(text):
            # The suffix after this text could not be tokenized on its own.
            log.info("kvstore: store_skipped reason=mid_character tokens=%d", n)
            return None
        t = time.perf_counter()
        snap = self.engine.snapshot()
        tensors, meta = snap[0], snap[1]
        chained = {}
        exact = getattr(self.engine, "exact_names", None)
        if exact is not None:
            chained["exact"] = exact(meta)          # a state quantised already (kvstore.mlx.codecs.quantized_names)
        if len(snap) > 2:
            chained["positional"] = snap[2]
            offsets = getattr(self.engine, "text_offsets", None)
            if offsets is not None:
                chained["text_offsets"] = offsets(self.live_tokens, len(text))
        save = self.store.save_async if self.async_saves else self.store.save
        result = save(text, self.live_tokens, tensors, meta=meta, reason=reason, ctx_size=self.engine.ctx_size,
                      **chained)
        if req is not None:
            req.save_ms += (time.perf_counter() - t) * 1e3
            if result is not None:
                req.stored.append((Reason(reason).name.lower(), n))
        return result

    def _store_leaving(self, reason):
        """Stores the live state as it leaves memory (evict, shutdown): kvstore.policy.leaving_stores.

        Whole: the session does not know which prompt its answer finished,
        so there is no tail to cut it to.
        """
        for target in policy.leaving_stores(reason, len(self.live_tokens)):
            if self._store_live(target.reason, None) is not None:
                return

    # -- after generation ----------------------------------------------------

    def extend(self, tokens: Sequence[int]) -> None:
        """Records tokens the engine added to the live state (generated tokens)."""
        self._set_live(self.live_tokens + list(tokens))

    def rewind(self, n: int) -> bool:
        """Drops the last n live tokens (e.g. generated tokens the next prompt
        renders differently); returns False when the engine cannot trim."""
        n = min(int(n), len(self.live_tokens))
        trim = getattr(self.engine, "trim", None)
        if n == 0:
            return True
        if trim is None or not trim(n):
            return False
        self._set_live(self.live_tokens[:-n])
        return True

    def adopt(self, checkpoint: Checkpoint) -> bool:
        """Makes a loaded checkpoint (an agent session, say) the live session.

        The live session it replaces is stored as `evict` first when it holds
        at least min_tokens (docs/semantics.md §7).  The canary checks the
        restored state (one token recomputed).

        Returns:
            True, or False when the canary found the state was not this
            model's (the checkpoint is quarantined, the live session empty).
        """
        self._store_leaving(Reason.EVICT)
        self.engine.restore(checkpoint.tensors, checkpoint.meta)
        tokens = checkpoint.tokens.tolist()
        self._set_live(tokens, checkpoint.text_bytes)
        self._last_store = len(tokens)
        req = Request("disk", tokens, len(tokens), checkpoint.text_bytes)
        if not self._start_canary(req, checkpoint, tokens):
            return False
        if req.probe is not None:
            self.engine.prefill(tokens[-1:])
            self._set_live(tokens, checkpoint.text_bytes)
            if self._finish_canary(req) is not req:
                return False
        return True

    def close(self) -> None:
        """Stores the live session as `shutdown` and waits for pending saves."""
        self._store_leaving(Reason.SHUTDOWN)
        self.store.flush()


def _utf8_boundary(text):
    """True when text ends at a UTF-8 character boundary."""
    tail = text[-4:]
    for i in range(len(tail) - 1, -1, -1):
        b = tail[i]
        if b < 0x80:
            return i == len(tail) - 1
        if b >= 0xC0:                    # a lead byte: is its sequence complete?
            need = 2 if b < 0xE0 else 3 if b < 0xF0 else 4
            return len(tail) - i == need
    return len(tail) == 0
