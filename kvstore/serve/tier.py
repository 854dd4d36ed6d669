"""TieredPromptCache: mlx-lm's RAM prompt cache with a kvstore directory behind it.

Threads.  mlx-lm runs every model step on one generation thread; kvstore
serve keeps disk and bucket reads off it.  A request is tokenized, looked
up (lookup()) and its longest stored prefix read into MLX arrays (load())
on the HTTP thread that received it, before the request is queued for the
generation thread; the generation thread then only builds mlx-lm's cache objects
around those arrays (fetch_nearest_cache), and never waits for a disk.  Each
thread runs MLX on its own stream (MLX's thread-local default), and the
server sets kvstore.payload.set_mlx_threaded: a load's arrays are allocated
by an MLX op that never calls back into Python, so no MLX task ever waits
for the GIL while the generation thread holds it and waits for MLX (the
deadlock mx.load's read callback risks).  mlx-lm's trie is shared by both
kinds of thread, so every access to it here holds one lock.

Models.  Every model's checkpoints share one cache root and its budget; each
file names the model that made it (docs/semantics.md §17), and the store the
tier opens offers only its model's.  The model's identity is known once it
has loaded, so the generation thread opens the store then (open()), before
it serves anything; a request that arrives earlier waits for it.  Every disk
or bucket hit is checked by the canary (kvstore.mlx.canary) when the
generation thread builds its cache: the model recomputes the last stored
token and its K/V rows must match the stored ones, or the hit is a miss and
the file is quarantined.  That forward runs on the generation thread (about
one decode step per hit), never beside it: MLX on the CPU is not safe for two
threads running a model at once.

Tenants.  A request's tenant (kvstore.tenants) is part of every key it
uses: the model key of mlx-lm's trie, and the first bytes of the disk key.
The generation thread tells the tier which request comes next (begin());
mlx-lm's own insert_cache calls carry only token ids, so each insert goes to
the tenants of the requests whose prompt it continues or starts.

Admission.  What is stored is decided on the generation thread before a
state is captured (kvstore.serve.admission.Ledger): with admit_after = N > 1
only the prefixes N requests used, and never a key this process loaded or
stored already.
"""

import collections
import itertools
import logging
import threading
import time

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from kvstore import policy
from kvstore.chain import slice_along
from kvstore.settings import DEFAULT_BLOCK_TOKENS
from kvstore.format import Reason
from kvstore.mlx import canary
from kvstore.mlx.codecs import cache_from_checkpoint, checked_state, quantized_names, same_layout
from kvstore.mlx.engine import text_offsets_function, token_bytes_function
from kvstore.mlx.spec import ModelSpec
from kvstore.mlx.mlxlm import ReportingPromptCache
from kvstore import tenants
from kvstore.serve.admission import Ledger
from kvstore.serve.pinning import Pinner
from kvstore.serve.steps import StepClock
from kvstore.serve.ticket import Found, Prefetched, Ticket

log = logging.getLogger("kvstore")

# mlx-lm's cache types; a waypoint segment is inserted into RAM as "user".
WAYPOINT_TYPE = "user"

# A request that RAM serves but for fewer new tokens than this does not look
# on disk: a stored block could save it at most these tokens' prefill, less
# than its load costs, and a RAM hit then costs what stock mlx-lm's does (the
# lookup lists the directory again whenever it changed).  One block.
MIN_DISK_GAIN = DEFAULT_BLOCK_TOKENS

# Requests the tier keeps track of between begin() and their finished
# insert; one that never finishes (a dropped client) ages out past this.
MAX_ACTIVE = 1024


def _arrays(cache):
    """Every MLX array a list of mlx-lm caches holds (for one mx.eval)."""
    out = []
    for c in cache:
        state = c.state
        stack = [state]
        while stack:
            s = stack.pop()
            if isinstance(s, mx.array):
                out.append(s)
            elif isinstance(s, (list, tuple)):
                stack.extend(s)
    return out


class TieredPromptCache(ReportingPromptCache):
    """mlx-lm's RAM prompt cache with a kvstore directory behind it.

    Args:
        open_store: a callable kvstore.mlx.spec.ModelSpec -> the KVStore of
            that model's checkpoints (called once, by open()).
        provider: mlx-lm's ModelProvider (the tokenizer and model come from it).
        model_key: the provider's key of the model the store belongs to;
            requests for other models use RAM only.
        settings: the store's kvstore.Settings (what to store, when).
        cache_options: the server's options that change the KV cache (kv
            bits, max KV size...): part of the model's identity.
        label: a name for the model in kvstore ls and stats.
        config: the model directory's config.json (a dict), where the server read one (kvstore.mlx.spec).
        max_size, max_bytes: mlx-lm's LRU limits.
        metrics: a kvstore.serve.metrics.Metrics, or None.
        admit_after: store a prefix once this many requests have used it.
    """

    def __init__(self, open_store, provider, model_key, settings, cache_options=None, label="", max_size=10,
                 max_bytes=1 << 63, metrics=None, admit_after=1, config=None):
        super().__init__(max_size, max_bytes)
        self._open_store = open_store
        self.store = None                        # open() opens it once the model has loaded
        self.pinner = None                       # the store's pins (kvstore.serve.pinning.Pinner), with it
        self.ready = threading.Event()
        self.provider = provider
        self.model_key = model_key
        self.cache_options = dict(cache_options or {})
        self.label = label
        self.config = config
        self.settings = settings
        self.waypoint_step = policy.continued_step(self.settings)
        self.metrics = metrics
        self.admit_after = admit_after
        self._lock = threading.RLock()           # mlx-lm's trie and LRU, and the tables below
        self._keys_lock = threading.Lock()
        self._token_bytes = None
        self._text_offsets = None
        self._incoming = None
        self._held = {}            # (trie model key, tuple(tokens)) -> (the cache mlx-lm keeps for it,
        #                            the prompt length of the request it finished, or 0)
        self._next = None          # the Ticket of the request the generation thread serves next
        self._active = collections.OrderedDict()   # id -> (tenant, prompt) between begin() and finish
        self.ledger = Ledger(admit_after, self.key_offsets)
        self._serial = itertools.count()
        self.steps = StepClock()                 # the generation thread's batch steps (kvstore.serve.steps)

    # -- the model and its store ----------------------------------------------

    def open(self):
        """Opens the store of the loaded model; on the generation thread, before it serves.

        The identity covers the model (and a draft model, whose cache rides
        along) with the server's KV cache options.
        """
        self.spec = ModelSpec.of(self.provider.model, options=self.cache_options, draft=self.provider.draft_model,
                                 config=self.config, label=self.label or None)
        self.store = self._open_store(self.spec)
        self.settings = self.store.settings      # the server's, with the model's quant bits and context
        self.pinner = Pinner(self.store, self.settings, self.metrics)
        self.ready.set()
        return self.store

    # -- the tokens -> bytes key --------------------------------------------

    def _functions(self):
        with self._keys_lock:
            if self._token_bytes is None:
                self._token_bytes = token_bytes_function(self.provider.tokenizer)
                self._text_offsets = text_offsets_function(self._token_bytes)
        return self._token_bytes, self._text_offsets

    def key_bytes(self, tokens, tenant=None):
        """The disk key of tokens: the tenant's prefix, then the tokens' own bytes."""
        token_bytes, _ = self._functions()
        return tenants.key_prefix(tenant) + token_bytes(tokens)

    def key_offsets(self, tokens, tenant, text_len):
        """The key byte offset after each of tokens (index i: after i tokens), or None."""
        _, text_offsets = self._functions()
        head = len(tenants.key_prefix(tenant))
        offsets = text_offsets(tokens, text_len - head)
        return None if offsets is None else offsets + head

    # -- the HTTP thread ------------------------------------------------------

    def lookup(self, tokens, tenant, cache_key=None, shared=0):
        """Finds the longest stored prefix of tokens that beats RAM; on the calling (HTTP) thread.

        The cheap half of a request's preparation, at the thread's own
        priority, so that it never waits behind a prefill: one walk down
        mlx-lm's trie (RAM within a block of the whole prompt: no disk) and
        one SHA1 pass over the key (KVStore.find).  The walk stands for
        mlx-lm's full search (milliseconds in a large trie, and run again by
        the generation thread, as stock's) unless it cannot decide.  load()
        reads what it found.  Also counts the request's prefixes for
        admission (under the tag of its prompt_cache_key, cache_key, when it
        has one); its global prefix (first `shared` tokens) also without its
        salt.  Never raises: the disk tier must never fail a request.

        Returns:
            Found, or None (RAM as good, or nothing stored).
        """
        try:
            key = self.key_bytes(tokens[:-1], tenant)
            if self.admit_after > 1:
                self.ledger.count_uses(tokens[:-1], tenant, key, cache_key)
            ns = tenants.trie_key(self.model_key, tenant)
            with self._lock:
                lo, hi = self.ram_reuse_bounds(ns, tokens)
            if not self._beats(None, tokens, lo, tenant):
                return None
            entry = self.store.find(key)
            if shared and tenant is not None:       # its global prefix, without the salt, and no more
                head = self.key_bytes(tokens[:min(shared, len(tokens) - 1)], None)
                other = self.store.find(head)
                if other is not None and (entry is None or other.tokens > entry.tokens):
                    entry, key = other, head
            if entry is None:
                return None
            found = Found(entry, key, "remote" if getattr(entry, "remote", None) is not None else "disk")
            if lo != hi and self._beats(found, tokens, hi, tenant) != self._beats(found, tokens, lo, tenant):
                with self._lock:
                    lo = self.ram_reuse(ns, tokens)
            return found if self._beats(found, tokens, lo, tenant) else None
        except Exception as e:            # noqa: BLE001 - the disk tier must never fail a request
            log.warning("kvstore: disk_lookup_failed error=%s", type(e).__name__)
            return None

    def _beats(self, found, tokens, ram, tenant):
        """True when loading found (None: anything stored) is worth it while RAM reuses ram of tokens."""
        # Keep at least one token to prefill: the server needs its logits.
        # A RAM hit within MIN_DISK_GAIN of that is not worth a load: the
        # disk could save only those tokens' prefill.
        if len(tokens) - 1 - ram < min(MIN_DISK_GAIN, self.settings.block_tokens):
            return False
        if found is None:
            return True
        if found.source == "remote":
            # A remote entry's header is read when it is fetched: compare bytes.
            return found.entry.text_bytes > len(self.key_bytes(tokens[:ram], tenant))
        return found.entry.tokens > ram

    def load(self, tokens, found):
        """Reads what lookup() found into MLX arrays; on the calling (HTTP) thread.

        The bulk half of a request's preparation: the bytes move on the
        payload I/O threads (which yield the CPU: kvstore.payload.set_io_priority),
        into MLX arrays allocated without Python callbacks (see the module's
        docstring).  Never raises.

        Returns:
            Prefetched, or None (the file went, failed its checks or holds other tokens).
        """
        t0 = time.perf_counter()
        if self.metrics is not None:
            self.metrics.loading(+1)
        try:
            ckpt = self.store.load(found.entry, into="mlx", consume=True)
            if ckpt is None:
                return None
            n = len(ckpt.tokens)
            if ckpt.tokens.tolist() != list(tokens[:n]):
                log.info("kvstore: disk_miss reason=token_mismatch tokens=%d file=%s", n, found.entry.name[:12])
                return None
            self.ledger.remember(found.key, list(ckpt.cuts.values()) + [len(ckpt.text_bytes)])
            return Prefetched(list(tokens[:n]), ckpt, n, found.source, time.perf_counter() - t0)
        except Exception as e:            # noqa: BLE001 - the disk tier must never fail a request
            log.warning("kvstore: disk_load_failed error=%s", type(e).__name__)
            return None
        finally:
            if self.metrics is not None:
                self.metrics.loading(-1)

    def prefetch(self, tokens, tenant):
        """lookup() then load(), on the calling thread; Prefetched or None."""
        found = self.lookup(tokens, tenant)
        return None if found is None else self.load(tokens, found)

    def _build(self, ckpt):
        """The mlx-lm cache of a loaded checkpoint, checked by the canary and
        evaluated; None when it does not fit this model or fails the canary.

        On the generation thread, which owns the model and its caches: MLX on
        the CPU is not safe for two threads running a model at once (seen:
        an occasional segfault), and the canary runs the model (one token's
        forward for a tail canary, costing the batch about one decode step).
        """
        cache = cache_from_checkpoint(self.store, ckpt)
        if cache is None:
            return None
        models = [self.provider.model] + ([self.provider.draft_model] if self.provider.draft_model else [])
        parts, at = [], 0
        for m in models:
            expect = make_prompt_cache(m)
            parts.append((m, cache[at:at + len(expect)], expect))
            at += len(expect)
        if at != len(cache) or not all(same_layout(got, expect) for _, got, expect in parts):
            log.info("kvstore: disk_miss reason=cache_layout tokens=%d file=%s", len(ckpt.tokens),
                     ckpt.entry.name[:12])
            return None
        for m, got, _ in parts:
            verdict = canary.check(m, got, ckpt.tokens, ckpt.lossy)
            if not verdict.applies:
                log.info("kvstore: canary_not_applicable reason=no_attention_rows tokens=%d", len(ckpt.tokens))
                continue
            self.store.record_canary(ckpt.entry, verdict.ok, verdict.words())
            if not verdict.ok:
                return None
        mx.eval(_arrays(cache))
        return cache

    # -- the generation thread ------------------------------------------------

    def begin(self, ticket, prompt):
        """The generation thread is about to serve the request of ticket, with prompt."""
        ticket = ticket if ticket is not None else Ticket()
        with self._lock:
            self._next = (ticket, list(prompt))
            self._active[next(self._serial)] = (list(prompt), ticket)
            while len(self._active) > MAX_ACTIVE:
                self._active.popitem(last=False)

    def fetch_nearest_cache(self, model, tokens):
        """RAM first; the cache the HTTP thread loaded when it reuses more.  Logs one line per request."""
        with self._lock:
            nxt, self._next = self._next, None
        if nxt is not None and nxt[1] == list(tokens):
            ticket = nxt[0]
        else:
            # Not the request begin() announced: share nothing with anyone.
            log.warning("kvstore: request_unannounced tokens=%d", len(tokens))
            ticket = Ticket(tenant=f"unannounced-{next(self._serial)}")
        ns = tenants.trie_key(model, ticket.tenant)
        with self._lock:
            cache, rest = super().fetch_nearest_cache(ns, tokens)
        reused = len(tokens) - len(rest)
        source, load_ms = ("ram" if reused else "none"), 0.0
        pre, ticket.prefetched = ticket.prefetched, None
        if ticket.tokenized is None and model == self.model_key and reused < len(tokens) - 1:
            # The HTTP thread could not prepare it (another model was loaded
            # when it came): load here, as the only way to a disk hit.
            log.info("kvstore: load_on_generation_thread reason=not_prepared tokens=%d", len(tokens))
            pre = self.prefetch(tokens, ticket.tenant)
        if pre is not None and model == self.model_key and pre.n > reused and pre.n < len(tokens) \
                and list(tokens[:pre.n]) == pre.tokens:
            t0 = time.perf_counter()
            built = self._build(pre.checkpoint)
            if built is not None:
                cache, rest = built, tokens[pre.n:]
                reused, source = pre.n, pre.source
                load_ms = (pre.load_s + time.perf_counter() - t0) * 1e3
        del pre
        ticket.source, ticket.reused, ticket.prefilled, ticket.load_ms = source, reused, len(rest), load_ms
        if self.metrics is not None:
            self.metrics.request(source, reused, len(rest), load_ms / 1e3 if source in ("disk", "remote") else None)
        log.info("kvstore: request source=%s reused=%d prefilled=%d load_ms=%.1f%s",
                 source, reused, len(rest), load_ms,
                 "" if ticket.tenant is None else f" tenant={ticket.tenant[:8]}")
        return cache, rest

    def _tenants_of(self, tokens, finished):
        """({tenant: [the Tickets of its active requests whose prompt tokens
        start or continue]}, the prompt length of the request they finish or 0)."""
        n = len(tokens)
        out, done = {}, None
        for key, (prompt, ticket) in self._active.items():
            m = len(prompt)
            if (n <= m and prompt[:n] == tokens) or (n > m and tokens[:m] == prompt):
                out.setdefault(ticket.tenant, []).append(ticket)
                if finished and n >= m and done is None:
                    done = key
        if done is None:
            return out, 0
        return out, len(self._active.pop(done)[0])

    def insert_cache(self, model, tokens, prompt_cache, *, cache_type="assistant"):
        """mlx-lm's insert, under the tenant of the request it belongs to; then the disk."""
        tokens = list(tokens)
        with self._lock:
            owners, prompt_len = self._tenants_of(tokens, finished=cache_type == "assistant")
            if not owners:
                # No request started these tokens: keep nothing rather than
                # guess a tenant.
                log.info("kvstore: ram_insert_skipped reason=unknown_request tokens=%d", len(tokens))
                return
            for tenant in owners:
                self._incoming = (prompt_cache, prompt_len)
                try:
                    super().insert_cache(tenants.trie_key(model, tenant), tokens, prompt_cache, cache_type=cache_type)
                finally:
                    self._incoming = None
        targets = self._targets(tokens, cache_type)
        for tenant, tickets in owners.items():
            self._persist_pins(model, tenant, tokens, prompt_cache, tickets, finished=cache_type == "assistant")
            for target in targets:
                if self._persist(model, tenant, tokens, prompt_cache, target, tickets) is not None:
                    break

    def _targets(self, tokens, cache_type):
        """What to store of a cache mlx-lm inserts (kvstore.policy; the first that stores ends the list).

        mlx-lm's system segment is the cold anchor; a segment that ends on
        the waypoint grid (generator.split_at_waypoints cuts them there) is
        a waypoint; a finished request (its prompt and answer) keeps its
        whole blocks in a chained store.
        """
        if cache_type == "assistant":
            return policy.finished_stores(self.settings.block_tokens if self.settings.layout == "chain" else 0)
        anchor = len(tokens) if cache_type == "system" else 0
        return policy.prefill_stores(len(tokens), self.settings, cold_target=anchor)

    # -- pins (kvstore.serve.pinning, docs/semantics.md §19) -----------------------

    def judge_pins(self, prompt, ticket):
        """Judges a request's breakpoints on its HTTP thread (kvstore.serve.pinning.Pinner.judge).

        Raises:
            BadPin: the request's answer.
        """
        self.pinner.judge(prompt, ticket, self.key_bytes)

    def _persist_pins(self, model, tenant, tokens, cache, tickets, finished):
        """Stores (then pins) the queued breakpoints of these requests that the
        state mlx-lm inserts reaches: exactly at a breakpoint's end, or, when
        the request finishes past it, cut there if the state can be.  A
        breakpoint its finished request could not store is not_stored."""
        for ticket in tickets:
            for p in ticket.pins:
                if p.state != "queued" or p.tokens > len(tokens):
                    continue
                if self._persist(model, p.tenant_of(tenant), tokens, cache, policy.pin_target(p.tokens), (ticket,),
                                 pin=p):
                    p.state = "storing"
                elif finished:
                    self.pinner.refused(p, "not_stored")

    def trim_to(self, *, n_sequences=None, n_bytes=None):
        with self._lock:
            super().trim_to(n_sequences=n_sequences, n_bytes=n_bytes)

    def forget(self, select=None):
        """After an admin delete (kvstore.serve.admin): drops the RAM entries select(tenant, tokens)
        accepts (None: every entry; tenant None: no salt), storing nothing of them, and which keys
        are stored (a new Ledger).  Returns how many went."""
        with self._lock:
            self.ledger = Ledger(self.admit_after, self.key_offsets)
            return self.drop_entries(lambda ns, tokens: select is None or select(tenants.split_trie_key(ns)[1], tokens))

    def entry_pushed(self, ns, tokens):
        if self._incoming is not None:
            self._held[(ns, tuple(tokens))] = self._incoming

    def entry_removed(self, ns, tokens):
        # Replaced by a newer cache for the same tokens, or a prefix of a
        # longer trimmable entry: nothing is lost.
        self._held.pop((ns, tuple(tokens)), None)

    def entry_dropped(self, ns, tokens):
        held = self._held.pop((ns, tuple(tokens)), None)
        if held is not None:
            self._persist_held(ns, tokens, held, Reason.EVICT)

    def _persist_held(self, ns, tokens, held, reason, wait=False):
        """Stores a RAM entry mlx-lm lets go (evicted, or at shutdown).

        For the entry of a finished request, the state at its prompt's last
        token but one (kvstore.policy.finished_tail), not only the whole
        blocks stored when the request finished; the rest of its answer
        (less than a block) is not worth a second tail of the same block.  It
        is a tail of the chain, one block at most, and goes when a later save
        of the sequence grows past it (KVStore's replaced tails,
        docs/format.md §14).  A state that cannot be cut there (recurrent,
        windowed), and an entry of no finished request, is stored whole.
        """
        model, tenant = tenants.split_trie_key(ns)
        cache, prompt_len = held
        for target in policy.leaving_stores(reason, len(tokens), prompt_len):
            result = self._persist(model, tenant, tokens, cache, target, wait=wait)
            if result is not None:
                return result
        return None

    def _persist(self, model, tenant, tokens, cache, target, tickets=(), pin=None, wait=False):
        """Stores cache under its tokens' key for a kvstore.policy.StoreTarget, in the background.

        Nothing is stored for another model than the store's, when the same
        text is stored already, or beyond what admission allows; how many
        tokens, and whether any are worth a file, is kvstore.policy.store_cut
        (a target's grid or preferred cut; a recurrent or windowed state is
        never cut: it would be a link without its snapshot).

        On the generation thread the key is made and judged (_worth_storing:
        microseconds) and the state captured (the arrays it must copy on its
        own MLX stream: what the save costs it is the bytes); the save runs
        on the store's background writer (_store), never between the batch's
        steps and not before the step in flight is done (kvstore.serve.steps),
        and is skipped (counted: kvstore_stores_skipped{why="writer_busy"})
        rather than waited for when the writer's queue is full; with wait
        (the stores at shutdown, when no batch runs) it waits for room.
        """
        if model != self.model_key:
            return None
        reason = target.reason
        why = target.kind if pin is not None else reason.name.lower()
        try:
            n = cache[0].offset if cache and hasattr(cache[0], "offset") else len(tokens)
            if n > len(tokens) or not policy.store_cut(n, self.settings):
                return None
            tensors, meta, positional = checked_state(cache, n)
            all_positional = len(positional) == len(tensors)
            cut = policy.store_cut(n, self.settings, all_positional, prefer=target.prefer, grid=target.grid)
            if pin is not None:
                # Exactly the pinned prefix, whatever admission says.
                if cut != pin.tokens:
                    return None
                key = self.key_bytes(tokens[:cut], tenant)
            else:
                cut, key = self._worth_storing(tokens, tenant, cut, all_positional, why)
            if not cut:
                return None
            if cut < n:
                tensors = {k: slice_along(a, positional[k], 0, cut) for k, a in tensors.items()}
            captured, dtypes = self.store.capture(tensors)
            submit = self.store.submit if wait else self.store.try_submit
            queued = submit(self.steps.deferred(self._store), tenant, list(tokens[:cut]), key, captured, dtypes,
                            meta, positional, reason, pin)
            if queued is None:
                # The writer is behind: the batch does not wait for the disk.
                log.info("kvstore: store_skipped reason=%s why=writer_busy tokens=%d", why, cut)
                if self.metrics is not None:
                    self.metrics.skipped("writer_busy")
                return None
            for t in tickets:
                t.stored.append((target.kind, cut))
            return queued
        except (TypeError, ValueError) as e:   # a cache class kvstore cannot store
            log.info("kvstore: store_skipped reason=%s detail=%s", why, type(e).__name__)
        except Exception as e:                 # noqa: BLE001 - never fail a request for the disk tier
            log.warning("kvstore: store_failed reason=%s error=%s", why, type(e).__name__)
        return None

    def _worth_storing(self, tokens, tenant, cut, all_positional, why):
        """(how many of tokens[:cut] to store, their key), or (0, None):
        nothing when the key is stored already (Ledger.known), and, with
        admit_after, only up to the longest prefix enough requests used (a
        positional state is cut there, any other is skipped whole).  Decided
        before the capture, which is what costs the generation thread."""
        key = self.key_bytes(tokens[:cut], tenant)
        if self.ledger.known(key):
            log.info("kvstore: store_skipped reason=%s why=stored tokens=%d", why, cut)
            return 0, None
        admitted = self.ledger.admitted(tokens[:cut], tenant, key)
        if admitted < cut:
            admitted = policy.store_cut(cut, self.settings, all_positional, limit=admitted)
            if not admitted:
                log.info("kvstore: store_skipped reason=%s why=admission tokens=%d", why, cut)
                if self.metrics is not None:
                    self.metrics.skipped("admission")
                return 0, None
            cut, key = admitted, self.key_bytes(tokens[:admitted], tenant)
        return cut, key

    def _store(self, tenant, tokens, key, tensors, dtypes, meta, positional, reason, pin=None):
        """_persist's second half, on the store's background writer: returns the Entry or None;
        then pins it when pin (a PinRequest) asks."""
        try:
            # A text stored already is kept as it is (KVStore.save reads its
            # header and writes nothing), chain blocks stored already too.
            entry = self.store.save(key, tokens, tensors, meta=meta, reason=reason, ctx_size=self.settings.ctx_size,
                                    positional=positional, text_offsets=self.key_offsets(tokens, tenant, len(key)),
                                    dtypes=dtypes or None, exact=quantized_names(meta))
            if entry is not None:
                self.ledger.remember(key, [len(key)])
            if pin is not None:
                self.pinner.grant(pin, key, tenant)
            return entry
        except Exception as e:                 # noqa: BLE001 - never fail a request for the disk tier
            log.warning("kvstore: store_failed reason=%s error=%s", Reason(reason).name.lower(), type(e).__name__)
        return None

    def persist_all(self):
        """Stores every RAM entry worth keeping as `shutdown` (on the background writer).

        Runs on the generation thread: MLX evaluates an array only on the
        thread whose stream made it.
        """
        saved = 0
        if self.store is None:
            return
        with self._lock:
            held = list(self._held.items())
        for (ns, tokens), entry in held:
            saved += self._persist_held(ns, tokens, entry, Reason.SHUTDOWN, wait=True) is not None
        log.info("kvstore: shutdown queued=%d", saved)

    def close(self):
        """Waits for the background writer and closes the store (if it was opened)."""
        if self.store is None:
            return
        try:
            self.store.flush()
        finally:
            self.store.close()
