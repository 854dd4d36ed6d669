"""TieredResponseGenerator: mlx-lm's ResponseGenerator with disk loads off the generation thread.

mlx-lm queues each request for its one generation thread, which tokenizes
it, looks up the prompt cache and adds it to the running batch.  A disk load
there would stop every sequence in the batch for as long as it streams in.
Here the HTTP thread that received the request tokenizes it and loads its
longest stored prefix first (TieredPromptCache.prefetch); only then does the
request join the queue, with its cache ready.  The generation thread takes
the tokens and the cache as they are (no disk read, no tokenization), so
the batch keeps decoding while a load runs.
"""

import logging
import threading
import time

from kvstore.mlx.mlxlm import HookedResponseGenerator, requested_model_key
from kvstore.payload import lower_thread_priority
from kvstore.serve.pinning import BadPin, shared_prefix
from kvstore.serve.ticket import Ticket
from kvstore.serve.tier import WAYPOINT_TYPE

log = logging.getLogger("kvstore")

# How long a request that arrives while the server loads its model waits for it.
MODEL_WAIT_S = 600

# Requests that arrive together are admitted together, as stock mlx-lm
# admits the requests its queue holds: once the generation thread takes a
# request, it waits for the others still being prepared on their HTTP threads
# (tokenized, looked up, loaded) for at most this long before it starts the
# prefill, so that they join one batch instead of each prefilling behind the
# other.  Tokenizing and looking up a prompt takes milliseconds; a request
# whose preparation takes longer (a large load) joins the next step.
ADMIT_WAIT_S = 0.25

# CPU niceness of the threads that prepare a request (tokenize, load its
# cache) and of the payload I/O threads: the generation thread keeps the CPU
# it needs to decode, and a load takes what is left (Linux; see
# kvstore.payload.lower_thread_priority).
LOAD_NICE = 19


class ClientGone(Exception):
    """The client disconnected while its request was being prepared."""


class TieredResponseGenerator(HookedResponseGenerator):
    """mlx-lm's ResponseGenerator: prefetch on the HTTP thread, waypoints in the prompt segments.

    mlx-lm hands the cache to insert_cache at the end of each prompt
    segment; cutting a long segment at every multiple of the waypoint step
    gives the disk tier the states docs/format.md §7 stores as `continued`.
    """

    def __init__(self, model_provider, prompt_cache):
        self.tier = prompt_cache
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
        """Tokenizes and prefetches on this (HTTP) thread, then queues the request as mlx-lm does.

        Raises:
            ClientGone: the client disconnected while its cache was loading
                (the loaded cache is dropped).
        """
        ticket = getattr(request, "kvstore_ticket", None)
        if ticket is None:
            ticket = request.kvstore_ticket = Ticket()
        with self._admission:
            self._preparing += 1
        try:
            self._prepare(request, generation_args, ticket)
        finally:
            with self._admission:
                self._preparing -= 1
                self._admission.notify_all()
        return super().generate(request, generation_args, progress_callback)

    def _prepare(self, request, generation_args, ticket):
        """Tokenizes the request and loads its cache on this HTTP thread (see generate())."""
        if self._serves(generation_args):
            # This HTTP thread serves only this connection: it may yield.
            lower_thread_priority(LOAD_NICE)
            tokenizer = self.model_provider.tokenizer
            try:
                with self._tokenizer_lock:
                    ticket.tokenized = (tokenizer, self.stock_tokenize(tokenizer, request, generation_args))
            except Exception as e:            # the generation thread reports it, as mlx-lm does
                ticket.tokenized = (tokenizer, e)
            else:
                prompt, _, _, _, vision = ticket.tokenized[1]
                if ticket.pins:
                    self._judge_pins(tokenizer, request, generation_args, prompt, ticket)
                if vision is None and len(prompt) > 1:
                    ticket.prefetched = self.tier.prefetch(prompt, ticket.tenant)
            if ticket.gone is not None and ticket.gone():
                dropped = ticket.prefetched is not None
                ticket.prefetched = None
                log.info("kvstore: request_dropped reason=client_gone loaded=%d", dropped)
                raise ClientGone("the client disconnected")

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
                p.tokens = shared_prefix(head, prompt)
            self.tier.judge_pins(prompt, ticket)
        except BadPin as e:
            ticket.error = e
            raise

    # -- the generation thread ------------------------------------------------

    def next_request(self, timeout=None):
        """mlx-lm's next queued request; after one, also the requests that
        arrived with it and are still being prepared (ADMIT_WAIT_S)."""
        request = self.stock_next_request(timeout)
        now = time.monotonic()
        if request is not None:
            if now >= self._gather_until:
                self._gather_until = now + ADMIT_WAIT_S
            return request
        if now >= self._gather_until:
            return None
        with self._admission:
            waited = False
            while self._preparing and time.monotonic() < self._gather_until and self.requests.empty():
                waited = True
                self._admission.wait(self._gather_until - time.monotonic())
        if not waited:
            # Nobody was being prepared: the batch's next step must not wait.
            return self.stock_next_request(None)
        # A request whose preparation has just ended is put on the queue next.
        return self.stock_next_request(0.005)

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
