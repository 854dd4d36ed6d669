"""TieredResponseGenerator: mlx-lm's ResponseGenerator with disk loads off the generation thread.

mlx-lm queues each request for its one generation thread, which tokenizes
it, looks up the prompt cache and adds it to the running batch.  A disk load
there would stop every sequence in the batch for as long as it streams in.
Here the HTTP thread that received the request tokenizes it, looks its
prompt up (TieredPromptCache.lookup) and loads the longest stored prefix
(TieredPromptCache.load); only then does the request join the queue, with
its cache ready.  The generation thread takes the tokens and the cache as
they are (no disk read, no tokenization), so the batch keeps decoding while
a load runs, and a request that arrives during a long prefill is tokenized
and looked up at once, beside it, not between two of its steps.
"""

import logging
import threading
import time

from kvstore.mlx.mlxlm import HookedResponseGenerator, extract_views, requested_model_key
from kvstore.serve.explain import explain as explain_miss
from kvstore.divergence import common_prefix
from kvstore.serve.pinning import GLOBAL_SCOPE, BadPin
from kvstore.serve.ticket import Ticket
from kvstore.serve.tier import WAYPOINT_TYPE

log = logging.getLogger("kvstore")

# How long a request that arrives while the server loads its model waits for it.
MODEL_WAIT_S = 600

# Requests that arrive together are admitted together, as stock mlx-lm
# admits the requests its queue holds: once the generation thread takes a
# request, it waits for the others still in the cheap half of their
# preparation on their HTTP threads (tokenized and looked up: milliseconds)
# for at most this long before it starts the prefill, so that they join one
# batch instead of each prefilling behind the other.  It never waits for a
# load (a request that loads joins the step after its load), nor when nobody
# is being prepared.
ADMIT_WAIT_S = 0.25

# CPU niceness of the payload I/O threads, which move a load's and a save's
# bytes (reads, writes, CRC32C, with the GIL released), and of the bulk
# thread, which zero-fills a load's MLX memory: the generation thread
# keeps the CPU it needs to prefill and decode, and the bulk of the disk tier
# takes what is left (Linux; see kvstore.payload.set_io_priority).  No thread
# that runs Python runs at it: one that held the GIL, or a lock the serving
# path takes, while it waited for a CPU would hold up the batch (generate()).
LOAD_NICE = 19


class ClientGone(Exception):
    """The client disconnected while its request was being prepared."""


class TieredResponseGenerator(HookedResponseGenerator):
    """mlx-lm's ResponseGenerator: prefetch on the HTTP thread, waypoints in the prompt segments.

    mlx-lm hands the cache to insert_cache at the end of each prompt
    segment; cutting a long segment at every multiple of the waypoint step
    gives the disk tier the states docs/semantics.md §7 stores as `continued`.
    """

    def __init__(self, model_provider, prompt_cache):
        self.tier = prompt_cache
        # A finished request's KV reaches the store as views of the batch's
        # buffers: no copy evaluated on this thread (mlxlm.extract_views).
        extract_views()
        # One tokenization at a time: a tokenizer object is not meant to be
        # shared by threads (the HTTP threads and the generation thread).
        self._tokenizer_lock = threading.Lock()
        # Requests being prepared on HTTP threads, and until when the
        # generation thread waits for them (see ADMIT_WAIT_S).
        self._preparing = 0
        self._admission = threading.Condition()
        self._gather_until = 0.0
        super().__init__(model_provider, prompt_cache)

    # -- the HTTP thread ------------------------------------------------------

    def _serves(self, args):
        """True when the request is for the tier's model, that model is loaded and its store open.

        While the server starts (the generation thread loads the model and
        opens its store first), waits for it: a request that arrives then
        still gets its disk hit.
        """
        provider = self.model_provider
        key = requested_model_key(provider, args.model)
        if key != self.tier.model_key:
            return False
        deadline = time.monotonic() + MODEL_WAIT_S
        while not self.tier.ready.is_set() and self.generation_available() and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.tier.ready.is_set() and provider.model_key == key and provider.tokenizer is not None

    def generate(self, request, generation_args, progress_callback=None):
        """Prepares the request on this (HTTP) thread, then queues it as mlx-lm does.

        Preparing has a cheap half and a bulk half.  The cheap half
        (tokenize, judge the breakpoints, look RAM and the store up: what
        stock mlx-lm does on its generation thread, and milliseconds) runs
        at this thread's own priority, never below the generation thread's:
        it must not wait behind a prefill, and a thread at a lower priority
        that holds the GIL or a lock the generation thread takes next (the
        trie's, the tokenizer's) would hold up the batch too.  From its
        arrival until the generation thread takes it off the queue the
        request counts as being prepared, which the generation thread may
        wait for (ADMIT_WAIT_S); a request that loads stops
        counting when its load begins.  The bulk half (that load) runs
        uncounted: its bytes move on the payload I/O threads, which yield
        the CPU (LOAD_NICE), and the request joins the batch at the step
        after its load.

        Raises:
            ClientGone: the client disconnected while its cache was loading
                (the loaded cache is dropped).
        """
        ticket = getattr(request, "kvstore_ticket", None)
        if ticket is None:
            ticket = request.kvstore_ticket = Ticket()
        self.arriving(ticket)
        try:
            found = self._prepare(request, generation_args, ticket)
            if found is not None:
                self.prepared(ticket)            # a load: the batch does not wait for it
                ticket.prefetched = self.tier.load(ticket.tokenized[1][0], found)
            if ticket.tokenized is not None and ticket.gone is not None and ticket.gone():
                dropped = ticket.prefetched is not None
                ticket.prefetched = None
                log.info("kvstore: request_dropped reason=client_gone loaded=%d", dropped)
                raise ClientGone("the client disconnected")
            return super().generate(request, generation_args, progress_callback)
        finally:
            # (Once the generation thread has taken it, this finds it counted off already.)
            self.prepared(ticket)

    def arriving(self, ticket):
        """Counts ticket's request among those being prepared (the admission
        wait's), once: the HTTP handler counts a completion in as soon as its
        request line is read, before its body is (kvstore.serve.http), and
        generate() counts in a request nobody counted."""
        with self._admission:
            if not ticket.preparing:
                self._preparing += 1
                ticket.preparing = True

    def prepared(self, ticket):
        """The request of ticket is no longer in the cheap half of its preparation."""
        with self._admission:
            if ticket.preparing:
                ticket.preparing = False
                self._preparing -= 1
                self._admission.notify_all()

    def _prepare(self, request, generation_args, ticket):
        """The cheap half of generate(): tokenizes the request and looks its
        prompt up; returns the tier's Found to load, or None."""
        if not self._serves(generation_args):
            return None
        tokenizer = self.model_provider.tokenizer
        try:
            with self._tokenizer_lock:
                ticket.tokenized = (tokenizer, self.stock_tokenize(tokenizer, request, generation_args))
        except Exception as e:            # the generation thread reports it, as mlx-lm does
            ticket.tokenized = (tokenizer, e)
            return None
        prompt, _, _, _, vision = ticket.tokenized[1]
        if ticket.pins:
            self._judge_pins(tokenizer, request, generation_args, prompt, ticket)
        if vision is not None or len(prompt) <= 1:
            return None
        shared = max((p.tokens for p in ticket.pins if p.scope == GLOBAL_SCOPE), default=0)
        found = self.tier.lookup(prompt, ticket.tenant, ticket.cache_key, shared)
        ticket.miss = self._explain(tokenizer, request, generation_args, prompt, ticket.tenant)
        return found

    def _explain(self, tokenizer, request, args, prompt, tenant):
        """Where the prompt left what is stored (kvstore.serve.explain), or None.  Never raises."""
        def render(n):
            with self._tokenizer_lock:
                return self.render_messages(tokenizer, request, args, n, tokenize=False)
        chat = request.request_type == "chat"
        try:
            return explain_miss(self.tier, prompt, tenant, request.messages if chat else None, render)
        except Exception as e:            # noqa: BLE001 - an explanation must never fail a request
            log.warning("kvstore: explain_failed error=%s", type(e).__name__)
            return None

    def tokenize_request(self, request, generation_args):
        """(prompt, segments, types, state, vision) of a request as generate()
        tokenizes it, on the calling thread (kvstore.serve.warm: is it stored already?)."""
        with self._tokenizer_lock:
            return self.stock_tokenize(self.model_provider.tokenizer, request, generation_args)

    def _judge_pins(self, tokenizer, request, args, prompt, ticket):
        """Finds where each breakpoint's prefix ends in the prompt's tokens
        and has the tier judge it (kvstore.serve.pinning).

        Raises:
            BadPin: the request's answer is that 4xx (ticket.error).
        """
        try:
            for p in ticket.pins:
                with self._tokenizer_lock:
                    head = self.render_messages(tokenizer, request, args, p.message + 1)
                p.tokens = common_prefix(list(head), list(prompt))
            self.tier.judge_pins(prompt, ticket)
        except BadPin as e:
            ticket.error = e
            raise

    # -- the generation thread ------------------------------------------------

    def batch_step_done(self):
        self.tier.steps.tick()

    def next_request(self, timeout=None):
        """mlx-lm's next queued request; after one, also the requests that
        arrived with it and are still being prepared (ADMIT_WAIT_S)."""
        if timeout is not None:
            # mlx-lm waits for requests only when no batch runs.
            self.tier.steps.idle()
        request = self._taken(self.stock_next_request(timeout))
        now = time.monotonic()
        if request is not None:
            if now >= self._gather_until:
                self._gather_until = now + ADMIT_WAIT_S
            return request
        if now >= self._gather_until:
            return None
        with self._admission:
            waited, preparing = False, self._preparing
            while self._preparing and time.monotonic() < self._gather_until and self.requests.empty():
                waited = True
                self._admission.wait(self._gather_until - time.monotonic())
        # (Nobody was being prepared: the batch's next step did not wait.)
        if waited:
            log.info("kvstore: admission_wait ms=%.1f preparing=%d", (time.monotonic() - now) * 1e3, preparing)
        return self._taken(self.stock_next_request(None))

    def request_queued(self):
        # The admission wait also ends when a request it waits for is queued.
        with self._admission:
            self._admission.notify_all()

    def _taken(self, request):
        """A request the generation thread takes off the queue, counted off as prepared."""
        if request is not None:
            ticket = getattr(request[1], "kvstore_ticket", None)
            if ticket is not None:
                self.prepared(ticket)
        return request

    def tokenize(self, tokenizer, request, args):
        """mlx-lm's tokenization, done already on the HTTP thread when it could; the
        segments cut at the waypoints."""
        ticket = getattr(request, "kvstore_ticket", None)
        done = ticket.tokenized if ticket is not None else None
        if done is not None and done[0] is tokenizer:
            if isinstance(done[1], Exception):
                raise done[1]
            prompt, segments, types, state, vision = done[1]
            # The lists are the generation thread's to change.
            prompt, segments, types = list(prompt), [list(s) for s in segments], list(types)
        else:
            with self._tokenizer_lock:
                prompt, segments, types, state, vision = self.stock_tokenize(tokenizer, request, args)
        self.tier.begin(ticket, prompt)
        step = self.tier.waypoint_step
        if vision is None and 0 < step < len(prompt):
            segments, types = split_at_waypoints(segments, types, step)
        cuts = [p.tokens for p in (ticket.pins if ticket is not None else ()) if p.state == "queued"]
        if vision is None and cuts:
            segments, types = split_at(segments, types, cuts)
        return prompt, segments, types, state, vision

    def generation_loop(self):
        try:
            # mlx-lm's loop loads the default model first; here that load
            # comes before it, so that the model's store opens (its identity
            # needs the weights) before any request is served.  The loop's
            # own load_default then finds the model loaded.
            self.model_provider.load_default()
            if self.model_provider.model_key == self.tier.model_key:
                self.tier.open()
            self.stock_generation_loop()
        finally:
            self.tier.steps.idle()
            self.tier.persist_all()


def split_at(segments, types, cuts):
    """Cuts segments at these absolute token positions (a pinned prefix's end);
    the cut-off heads are WAYPOINT_TYPE, as split_at_waypoints makes them."""
    out, out_types, pos = [], [], 0
    for seg, kind in zip(segments, types):
        start = 0
        for cut in sorted(c for c in set(cuts) if pos < c < pos + len(seg)):
            out.append(seg[start:cut - pos])
            out_types.append(WAYPOINT_TYPE)
            start = cut - pos
        out.append(seg[start:])
        out_types.append(kind)
        pos += len(seg)
    return out, out_types


def split_at_waypoints(segments, types, step):
    """Cuts segments at every absolute multiple of step; the cut-off heads are WAYPOINT_TYPE.

    The last piece of each segment keeps the segment's own type, so every
    boundary mlx-lm had is kept.
    """
    return split_at(segments, types, range(step, sum(len(s) for s in segments), step))
