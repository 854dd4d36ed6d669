"""The one module that reaches into mlx-lm's internals, and the mlx-lm releases kvstore supports.

kvstore needs a few things from mlx-lm that it offers no public way to do:
the write index of a RotatingKVCache, the Hugging Face tokenizer inside a
TokenizerWrapper, how the server's ModelProvider resolves a requested model,
hooks into the server's ResponseGenerator steps (tokenize, take the next
request, the generation loop) and APIHandler headers, and a view of
LRUPromptCache's trie and LRU order.  Every private attribute or method of
mlx-lm that kvstore uses is named here and nowhere else (the tests parse the
package to hold that): the rest of kvstore calls the public functions below,
and subclasses the classes below, whose hooks are public methods.

A new mlx-lm release that renames one of these internals is then one module
to check, not a search.  Importing this module (and so kvstore.mlx or
kvstore.serve) with an mlx-lm outside SUPPORTED_MLX_LM raises ImportError
naming the installed release and the supported range; `import kvstore` alone
never imports mlx-lm.
"""

import queue

import mlx_lm

# The mlx-lm releases kvstore is tested with, as (major, minor): from the
# first, inclusive, to the second, exclusive (pyproject pins the same).
SUPPORTED_MLX_LM = ((0, 32), (0, 33))


def version_tuple(version):
    """(major, minor) of a release string: "0.32.2" -> (0, 32)."""
    return tuple(int(p) for p in str(version).split(".")[:2] if p.isdigit())


def check_version(version=None):
    """Refuses an mlx-lm release outside SUPPORTED_MLX_LM.

    Args:
        version: a release string; None for the installed mlx_lm.__version__.

    Raises:
        ImportError: the release is not supported; the message names it and
            the supported range.
    """
    version = mlx_lm.__version__ if version is None else version
    lo, hi = SUPPORTED_MLX_LM
    if not lo <= version_tuple(version) < hi:
        lo_s, hi_s = ".".join(map(str, lo)), ".".join(map(str, hi))
        raise ImportError(f"kvstore.mlx supports mlx-lm >= {lo_s}, < {hi_s}; installed: mlx-lm {version} "
                          f"(pip install 'mlx-lm>={lo_s},<{hi_s}')")


check_version()

# After the check: an unsupported release fails with the message above, not
# with whatever these imports would raise.
from mlx_lm import server as mlx_server                                   # noqa: E402
from mlx_lm.models.cache import BatchKVCache, KVCache, LRUPromptCache, can_trim_prompt_cache  # noqa: E402


# ---- caches and tokenizers ----------------------------------------------------

def rotating_write_index(cache):
    """Where a RotatingKVCache writes its next token (its buffer's write index)."""
    return cache._idx


def set_rotating_write_index(cache, idx):
    """Sets a rebuilt RotatingKVCache's write index (see rotating_write_index)."""
    cache._idx = idx


def _extract_view(self, idx):
    """BatchKVCache.extract without the contiguous copy: sequence idx's keys
    and values as views of the batch's buffers (the same values)."""
    import mlx.core as mx
    mx.eval(self.left_padding)
    padding = self.left_padding.tolist()[idx]
    cache = KVCache()
    cache.keys = self.keys[idx:idx + 1, :, padding:self._idx]
    cache.values = self.values[idx:idx + 1, :, padding:self._idx]
    cache.offset = cache.keys.shape[2]
    return cache


def extract_views():
    """Makes mlx-lm's batches hand out a finished or segmented sequence's KV
    as views of the batch's buffers instead of lazy contiguous copies
    (kvstore serve calls it at start; idempotent).

    mlx-lm's BatchKVCache.extract returns mx.contiguous of the sequence's
    slice, a copy computed only when something evaluates it: stock keeps it
    lazy in its RAM cache, but a store must read the bytes, and evaluating
    the copy on the generation thread held the batch for the whole copy
    (seen: 0.72 s for a 2,048-token state at 144 KiB a token, every decoding
    session waiting).  A view costs nothing to evaluate; the writer writes
    its contiguous runs (kvstore.payload.plan.contiguous_runs).  Like the
    lazy copy, a view keeps the batch's old buffer alive while it is held;
    the batch itself moves on to new buffers (its filter after a finished
    sequence, its merges).
    """
    BatchKVCache.extract = _extract_view


def hf_tokenizer(tokenizer):
    """The Hugging Face tokenizer inside mlx-lm's TokenizerWrapper; any other tokenizer as is."""
    return getattr(tokenizer, "_tokenizer", tokenizer)


# ---- the server ---------------------------------------------------------------

def requested_model_key(provider, model):
    """The (model, adapter, draft model) key the server's ModelProvider loads for a request.

    Args:
        provider: mlx-lm's ModelProvider.
        model: the request's model description (GenerationArguments.model:
            model, adapter and draft names as the client sent them).

    Returns:
        a tuple comparable with provider.model_key.
    """
    return (provider._model_map.get(model.model, model.model),
            provider._adapter_map.get(model.model, model.adapter),
            provider._draft_model_map.get(model.draft, model.draft))


class _ReportingQueue(queue.Queue):
    """The generation thread's request queue, calling on_put after each request is put on it."""

    def __init__(self, on_put):
        super().__init__()
        self._on_put = on_put

    def put(self, item, block=True, timeout=None):
        super().put(item, block, timeout)
        self._on_put()


class _CountedBudget:
    """mlx-lm's per-loop time budget, calling on_step after each batch step of its loop.

    The server runs `for _ in budget: batch_generator.next() ...`: every
    __next__ after the first of a loop follows a step that returned.
    """

    def __init__(self, budget, on_step):
        self._budget = budget
        self._on_step = on_step
        self._inner = None
        self._first = True

    def __iter__(self):
        self._inner = iter(self._budget)
        self._first = True
        return self

    def __next__(self):
        if not self._first:
            self._on_step()
        self._first = False
        return next(self._inner)


class HookedResponseGenerator(mlx_server.ResponseGenerator):
    """mlx-lm's ResponseGenerator with its private steps behind public hooks.

    mlx-lm's generation thread tokenizes each request, takes the next queued
    request and runs its loop in private methods; each of them here calls a
    public hook a subclass overrides.  stock_* run mlx-lm's own step.  Its
    request queue calls request_queued() after each put (on the thread that
    put it), and batch_step_done() runs after each step of the batch.
    """

    def __init__(self, model_provider, prompt_cache):
        super().__init__(model_provider, prompt_cache)
        # Before any request: the generation thread is still loading its model.
        self.requests = _ReportingQueue(self.request_queued)
        self._time_budget = _CountedBudget(self._time_budget, self.batch_step_done)

    def batch_step_done(self):
        """Called on the generation thread after each step of the running batch (prefill or decode)."""

    def request_queued(self):
        """Called on the putting thread once a request is on the generation thread's queue."""

    def _tokenize(self, tokenizer, request, args):
        return self.tokenize(tokenizer, request, args)

    def _next_request(self, timeout=None):
        return self.next_request(timeout)

    def _generate(self):
        return self.generation_loop()

    def tokenize(self, tokenizer, request, args):
        """(prompt, segments, segment types, initial state, vision) of a request."""
        return self.stock_tokenize(tokenizer, request, args)

    def next_request(self, timeout=None):
        """The next queued request, waiting at most timeout seconds (None: not at all), or None."""
        return self.stock_next_request(timeout)

    def generation_loop(self):
        """The generation thread's body."""
        return self.stock_generation_loop()

    def render_messages(self, tokenizer, request, args, n, tokenize=True):
        """The tokens (tokenize=False: the text) of a chat request's first n
        messages as its prompt renders them (the same template and options),
        without a generation prompt."""
        messages = request.messages[:n]
        if not tokenizer.has_chat_template:
            text = mlx_server.convert_chat(messages, request.role_mapping)
            return tokenizer.encode(text) if tokenize else text
        template_args = dict(self.model_provider.cli_args.chat_template_args)
        template_args.update(args.chat_template_kwargs or {})
        out = tokenizer.apply_chat_template(messages, add_generation_prompt=False, tools=request.tools,
                                            tokenize=tokenize, **template_args)
        return list(out) if tokenize else out

    def stock_tokenize(self, tokenizer, request, args):
        """mlx-lm's own tokenize step."""
        return super()._tokenize(tokenizer, request, args)

    def stock_next_request(self, timeout=None):
        """mlx-lm's own next-request step."""
        return super()._next_request(timeout)

    def stock_generation_loop(self):
        """mlx-lm's own generation loop."""
        return super()._generate()


class HookedAPIHandler(mlx_server.APIHandler):
    """mlx-lm's APIHandler with its header helpers behind public methods."""

    def _set_stream_headers(self, status_code=200):
        self.on_stream_headers(status_code)
        if self.stream_goes_whole():
            super()._set_completion_headers(status_code)
        else:
            super()._set_stream_headers(status_code)

    def stream_goes_whole(self):
        """True when the answer mlx-lm streams reaches the client as one JSON
        body (a subclass whose wfile collects the stream); False by default."""
        return False

    def on_stream_headers(self, status_code):
        """Called before a streamed answer's headers go out (200: the stream starts)."""

    def _set_completion_headers(self, status_code=200):
        super()._set_completion_headers(self.completion_status(status_code))

    def completion_status(self, status_code):
        """The status a completion answer goes out with; mlx-lm's own by
        default (it answers 404 to whatever the generator raised)."""
        return status_code

    def generate_response(self, *args, **kwargs):
        return self.with_usage(super().generate_response(*args, **kwargs))

    def completion_usage_response(self, *args, **kwargs):
        return self.with_usage(super().completion_usage_response(*args, **kwargs))

    def with_usage(self, response):
        """A response mlx-lm built, before it is sent: a subclass may add to its "usage"."""
        return response

    def send_json_headers(self, status_code):
        """mlx-lm's headers of a JSON answer (status, content type, CORS); the caller ends them."""
        super()._set_completion_headers(status_code)


class _ReportingOrder(LRUPromptCache.CacheOrder):
    """mlx-lm's LRU order that tells its owner which entries come and go."""

    def __init__(self, owner, ordering=None):
        super().__init__(ordering)
        self._owner = owner

    def push(self, model, tokens, cache_type="assistant"):
        super().push(model, tokens, cache_type)
        self._owner.entry_pushed(model, tokens)

    def remove(self, model, tokens):
        super().remove(model, tokens)
        self._owner.entry_removed(model, tokens)

    def pop(self):
        model, tokens = super().pop()
        self._owner.entry_dropped(model, tokens)
        return model, tokens


class ReportingPromptCache(LRUPromptCache):
    """mlx-lm's LRUPromptCache that reports its LRU's entries and answers RAM reuse.

    Hooks a subclass overrides, called under whatever lock holds the insert:
    entry_pushed (an entry joins the LRU), entry_removed (replaced, or a
    prefix of a longer trimmable entry: nothing is lost), entry_dropped (the
    LRU lets it go).
    """

    def __init__(self, max_size=10, max_bytes=1 << 63):
        super().__init__(max_size, max_bytes)
        self._lru = _ReportingOrder(self, self._lru._ordering)

    def entry_pushed(self, model, tokens):
        """An entry for tokens under model joined the LRU."""

    def entry_removed(self, model, tokens):
        """The entry for tokens under model left the LRU with nothing lost."""

    def entry_dropped(self, model, tokens):
        """The LRU let the entry for tokens under model go (over its size or bytes)."""

    def drop_entries(self, select):
        """Drops every entry that select(model key, tokens) accepts, each reported as
        entry_removed (nothing stored of it); the caller holds its lock.  Returns how many."""
        gone = [(m, t) for lru in self._lru._lrus.values() for m, t in lru if select(m, t)]
        for model, tokens in gone:
            entry = self._trie.pop(model, tokens)
            self._n_bytes -= entry.nbytes
            self._n_bytes_by_type[entry.cache_type] -= entry.nbytes
            self._lru.remove(model, tokens)
        return len(gone)

    def ram_reuse_bounds(self, model, tokens):
        """(at least, at most) the tokens fetch_nearest_cache(model, tokens) would
        reuse now, from one walk down the trie (the caller holds its lock).

        mlx-lm's search also looks below where the walk stops, for the shortest
        entry that continues past it (usable only if its cache can be trimmed):
        in a trie of many long prompts that share a few tokens with this one,
        that search visits all of them.  The bounds differ only when such an
        entry may exist; ram_reuse() then gives the exact figure.
        """
        node = self._trie._trie.get(model)
        if node is None:
            return 0, 0
        walked, last = 0, -1
        for t in tokens:
            node = node.get(t)
            if node is None:
                break
            if "__value__" in node:
                last = walked
            walked += 1
        if tokens and last == len(tokens) - 1:
            return len(tokens), len(tokens)
        short = last + 1 if last > 0 else 0
        if walked > short:
            return short, min(len(tokens) - 1, walked)
        return short, short

    def ram_reuse(self, model, tokens):
        """How many tokens fetch_nearest_cache(model, tokens) would reuse now (the caller holds its lock)."""
        result = self._trie.search(model, tokens)
        if result.exact is not None:
            return len(tokens)
        short = len(result.shorter) if result.shorter is not None else 0
        if result.longer is not None and result.common_prefix > short:
            entry = self._trie.get(result.model, result.longer)
            if can_trim_prompt_cache(entry.prompt_cache):
                return min(len(tokens) - 1, result.common_prefix)
        return short
