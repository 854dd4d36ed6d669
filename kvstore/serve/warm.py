"""Warm prompts: `kvstore serve --warm FILE` prefills and stores a list of prompts after start-up.

A server that has just started has nothing on disk for the prompts its
clients are about to send (a new cache directory, a new model): the first
request of each pays the whole prefill.  A warm file names those prompts;
the server prefills each one once, in the background, as a request of its
own, and the tier's normal store policy puts its state on disk (the cold
anchor, the whole blocks of a finished request), so the first real request
is a disk or RAM hit.

The file.  JSON, either a list of prompts or an object
{"model": "<model>", "prompts": [...]}, where each prompt is

    [{"role": ..., "content": ...}, ...]   chat messages, rendered as a chat
                                           completion is (with the generation
                                           prompt)
    "text"                                 a rendered prompt, tokenized as a
                                           text completion is
    {"messages": [...]} or {"prompt": "..."}   the same, spelled out

and "model", when given, is the label of the served model (its
directory's name) or its identity fingerprint (docs/semantics.md §17): a file
made for another model stops the server before it serves or warms anything.
read_file checks everything but the model before the server listens; a
bad file is a start-up error naming the file and the line, or the prompt's
index, never its text.

Warming (Warmer).  On its own daemon thread, once the model has loaded and
its store is open, one prompt at a time: each goes through the server's
TieredResponseGenerator as a request with max_tokens 1 and temperature 0
(the same path as an HTTP request: tokenize, disk lookup, batch, store),
yielding to clients: it waits for the client requests in flight to finish
first (WARM_YIELD_S at most).  Its thread keeps the process's CPU priority:
it takes the tokenizer's lock and the GIL as a client's request does, and a
thread at a lower priority holding either while it waits for a CPU would
hold up the clients' requests (kvstore.serve.generator.generate); its loads'
bytes move on the I/O threads at LOAD_NICE, as every load's.  A prompt whose state the
directory holds already (up to its last whole block, as a restarted server
reuses it) is skipped without running.  Each outcome (stored, skipped,
failed) is counted for /health and the metrics; a prompt that fails is
logged by index and error type and never stops the server.  Warming stops
when the server starts draining.
"""

import copy
import dataclasses
import json
import logging
import threading
import time

from kvstore import policy
from kvstore.serve.metrics import WARM_OUTCOMES

log = logging.getLogger("kvstore")

# mlx-lm's name for the model given by --model: what a request that names
# no model asks for, and so what a warm prompt asks for.
DEFAULT_MODEL = "default_model"

# Client requests go first: before each warm prompt, wait this long at most
# for the requests in flight to finish.  Bounded, so that a server that is
# never idle still warms (a warm prompt then joins the batch as one more
# request).
WARM_YIELD_S = 5.0

# mlx-lm ends a finished request's answer and then, on the generation
# thread, hands its cache to the tier, which queues the whole blocks for the
# background writer: a few milliseconds later.  How long to wait for those
# blocks before the prompt counts as failed (the write budget ran low, a
# save failed).
SETTLE_S = 10.0

# How often to look for them meanwhile.
SETTLE_POLL_S = 0.05

# What a top-level object may hold.
FILE_KEYS = ("model", "prompts")


@dataclasses.dataclass(frozen=True)
class WarmPrompt:
    """One prompt of a warm file: chat messages, or a rendered prompt."""
    # Prompt text: never in a repr.
    messages: list = dataclasses.field(default=None, repr=False)
    prompt: str = dataclasses.field(default=None, repr=False)

    def request(self):
        """A new mlx-lm CompletionRequest of this prompt (mlx-lm's tokenization
        may rewrite a chat's content parts, so each use gets its own copy)."""
        from mlx_lm import server as mlx_server         # (this module's options parse without mlx-lm)
        if self.messages is not None:
            return mlx_server.CompletionRequest("chat", "", copy.deepcopy(self.messages), None, None)
        return mlx_server.CompletionRequest("text", self.prompt, [], None, None)


@dataclasses.dataclass
class WarmFile:
    """A checked warm file (read_file).

    Attributes:
        path: the file as given.
        prompts: [WarmPrompt].
        model: the "model" the file names, or None.
        model_line: the line of the "model" key (1-based), or None.
        refusal: the error once check_model refused the served model, else None.
    """
    path: str
    prompts: list = dataclasses.field(repr=False)
    model: str = None
    model_line: int = None
    refusal: str = None

    def check_model(self, identity):
        """Refuses a served model the file's "model" does not name.

        Args:
            identity: the served model's kvstore.identity.ModelIdentity.

        Raises:
            ValueError: "model" names neither its label nor its fingerprint;
                the message (also kept in refusal) names the file, the line
                and both models.
        """
        if self.model is None or self.model in (identity.label, identity.fingerprint):
            return
        self.refusal = (f"--warm {self.path}: line {self.model_line}: \"model\" is {self.model!r}, but this "
                        f"server's model is {identity.label!r} (fingerprint {identity.fingerprint})")
        raise ValueError(self.refusal)


def checked_open(open_store, warm_file):
    """open_store (kvstore.mlx.spec.ModelSpec -> KVStore) that first checks the warm file's model.

    The tier opens its store on the generation thread once the model has
    loaded, before it serves anything: a refused model stops the generation
    thread there (the server then exits with status 2, see WarmFile.refusal).
    """
    def open_checked(spec):
        warm_file.check_model(spec.identity)
        return open_store(spec)
    return open_checked


# ---- reading the file -------------------------------------------------------

def add_arguments(parser):
    """Adds --warm FILE to kvstore serve's options."""
    parser.add_argument(
        "--warm", metavar="FILE", default=None,
        help="after start-up, prefill and store these prompts in the background, skipping those stored already "
             "(GET /health shows \"warm\" progress): a JSON list whose items are chat message lists, rendered "
             "prompt strings, or {\"messages\": [...]} / {\"prompt\": \"...\"}; or an object {\"model\": NAME, "
             "\"prompts\": [...]} whose model (the model directory's name or identity fingerprint) must be the "
             "served one")


def read_file(path):
    """Reads and checks a warm file (everything but the model, which needs it loaded).

    Args:
        path: the file.

    Returns:
        WarmFile.

    Raises:
        ValueError: the file cannot be read, is not JSON (the message gives
            json's line and column) or not a warm file (the key's line, or
            the prompt's index, and why); never the prompts' text.
    """
    try:
        with open(path, encoding="utf-8-sig") as f:
            text = f.read()
    except OSError as e:
        raise ValueError(f"cannot be read ({e.strerror or type(e).__name__})") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"is not UTF-8 text (byte {e.start})") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"is not valid JSON: line {e.lineno} column {e.colno}: {e.msg}") from None
    model, line = None, None
    if isinstance(doc, dict):
        lines = _key_lines(text)
        for key in doc:
            if key not in FILE_KEYS:
                raise ValueError(f"line {lines.get(key)}: unknown key {key[:40]!r} (a warm file's object holds "
                                 "\"model\" and \"prompts\")")
        if "prompts" not in doc:
            raise ValueError("the object has no \"prompts\" list")
        model, line = doc.get("model"), lines.get("model")
        if "model" in doc and not (isinstance(model, str) and model):
            raise ValueError(f"line {line}: \"model\" must be the model's name or fingerprint, a non-empty string")
        doc = doc["prompts"]
    elif not isinstance(doc, list):
        raise ValueError(f"must hold a JSON list of prompts, or an object with \"prompts\"; found {_kind(doc)}")
    if not isinstance(doc, list):
        raise ValueError(f"\"prompts\" must be a list; found {_kind(doc)}")
    return WarmFile(path, [_prompt(i, item) for i, item in enumerate(doc)], model, line)


def _kind(value):
    """What a JSON value is, in words (never the value: it may be prompt text)."""
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null",
            int: "a number", float: "a number"}[type(value)]


def _prompt(i, item):
    """The WarmPrompt of prompts[i]; ValueError naming the index and why."""
    where = f"prompts[{i}]"
    if isinstance(item, dict):
        keys = set(item)
        if keys not in ({"messages"}, {"prompt"}):
            raise ValueError(f"{where}: an object must hold \"messages\" or \"prompt\", and nothing else "
                             f"(it holds {', '.join(sorted(repr(k[:40]) for k in keys)) or 'nothing'})")
        where, item = (f"{where}.messages", item["messages"]) if "messages" in keys else (f"{where}.prompt",
                                                                                         item["prompt"])
        if not isinstance(item, (list, str)):
            raise ValueError(f"{where}: must be a {'list' if where.endswith('messages') else 'string'}; "
                             f"found {_kind(item)}")
    if isinstance(item, str):
        if not item:
            raise ValueError(f"{where}: an empty prompt")
        return WarmPrompt(prompt=item)
    if not isinstance(item, list):
        raise ValueError(f"{where}: {_kind(item)}, not a list of chat messages, a prompt string or an object "
                         "with \"messages\" or \"prompt\"")
    if not item:
        raise ValueError(f"{where}: an empty list of messages")
    for j, m in enumerate(item):
        if not isinstance(m, dict):
            raise ValueError(f"{where}[{j}]: a message must be an object; found {_kind(m)}")
        if not (isinstance(m.get("role"), str) and m["role"]):
            raise ValueError(f"{where}[{j}]: a message needs a \"role\" string")
        if not isinstance(m.get("content"), (str, list, type(None))):
            raise ValueError(f"{where}[{j}]: \"content\" must be a string or a list of parts; "
                             f"found {_kind(m['content'])}")
    return WarmPrompt(messages=item)


def _key_lines(text):
    """{key: line} of the top-level object's keys in text (valid JSON whose value is an object).

    json gives no positions, so the object is walked here: each key with
    json's own string scanner, each value with its decoder.
    """
    decoder = json.JSONDecoder()
    skip = json.decoder.WHITESPACE.match
    lines = {}
    pos = skip(text, 0).end() + 1                     # past the "{"
    while True:
        pos = skip(text, pos).end()
        if text[pos] == "}":
            return lines
        key, end = json.decoder.scanstring(text, pos + 1)
        lines[key] = text.count("\n", 0, pos) + 1
        pos = skip(text, skip(text, end).end() + 1).end()   # past the ":"
        _, pos = decoder.raw_decode(text, pos)
        pos = skip(text, pos).end()
        if text[pos] == ",":
            pos += 1


# ---- warming ------------------------------------------------------------------

def generation_arguments(cli):
    """mlx-lm's GenerationArguments of a warm prompt: the served model, one
    greedy token, no penalties (the prompt's state is what is wanted)."""
    from mlx_lm import server as mlx_server
    return mlx_server.GenerationArguments(
        model=mlx_server.ModelDescription(model=DEFAULT_MODEL, draft=DEFAULT_MODEL, adapter=None),
        sampling=mlx_server.SamplingArguments(temperature=0.0, top_p=cli.top_p, top_k=cli.top_k, min_p=cli.min_p,
                                              xtc_probability=0.0, xtc_threshold=0.1),
        logits=mlx_server.LogitsProcessorArguments(logit_bias=None, repetition_penalty=0.0,
                                                   repetition_context_size=20, presence_penalty=0.0,
                                                   presence_context_size=20, frequency_penalty=0.0,
                                                   frequency_context_size=20),
        stop_words=[], max_tokens=1, num_draft_tokens=cli.num_draft_tokens, logprobs=False, top_logprobs=-1,
        seed=None, chat_template_kwargs=None)


class Warmer:
    """Warms a WarmFile's prompts on a background thread (see the module's docstring).

    Args:
        warm_file: the checked WarmFile.
        generator: the server's TieredResponseGenerator.
        tier: its TieredPromptCache.
        drain: the server's kvstore.serve.drain.Drain (requests in flight, draining).
        metrics: the server's Metrics, or None.
    """

    def __init__(self, warm_file, generator, tier, drain, metrics=None):
        self.file = warm_file
        self.generator = generator
        self.tier = tier
        self.drain = drain
        self.metrics = metrics
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(WARM_OUTCOMES, 0)
        self._finished = False
        self._thread = None

    def start(self):
        """Starts warming in the background (it first waits for the store to open)."""
        self._thread = threading.Thread(target=self._run, name="kvstore-warm", daemon=True)
        self._thread.start()

    def status(self):
        """/health's "warm": {total, done, stored, skipped, failed, finished}."""
        with self._lock:
            return {"total": len(self.file.prompts), "done": sum(self._counts.values()), **self._counts,
                    "finished": self._finished}

    def _stopping(self):
        return self.drain.draining or self.drain.stopping or not self.generator.generation_available()

    def _count(self, outcome):
        with self._lock:
            self._counts[outcome] += 1
        if self.metrics is not None:
            self.metrics.warm(outcome)

    def _run(self):
        while not self.tier.ready.wait(0.1):
            if self._stopping():
                return
        args = generation_arguments(self.generator.cli_args)
        log.info("kvstore: warm_start file=%s prompts=%d", self.file.path, len(self.file.prompts))
        t0 = time.monotonic()
        for index, prompt in enumerate(self.file.prompts):
            self.drain.wait_idle(WARM_YIELD_S, cancel=self._stopping)
            if self._stopping():
                log.info("kvstore: warm_stopped done=%d total=%d", self.status()["done"], len(self.file.prompts))
                return
            try:
                outcome = self._warm(index, prompt, args)
            except Exception as e:                # noqa: BLE001 - a warm prompt never stops the server
                if self._stopping():
                    log.info("kvstore: warm_stopped done=%d total=%d", self.status()["done"],
                             len(self.file.prompts))
                    return
                log.warning("kvstore: warm index=%d outcome=failed error=%s", index, type(e).__name__)
                outcome = "failed"
            self._count(outcome)
        with self._lock:
            self._finished = True
        s = self.status()
        log.info("kvstore: warm_done prompts=%d stored=%d skipped=%d failed=%d s=%.1f", s["total"], s["stored"],
                 s["skipped"], s["failed"], time.monotonic() - t0)

    def _warm(self, index, prompt, args):
        """Warms one prompt; returns its outcome."""
        t0 = time.monotonic()
        tokens = self.generator.tokenize_request(prompt.request(), args)[0]
        want = len(self.tier.key_bytes(tokens[:self._target(len(tokens))]))
        before = self._stored_bytes(tokens)
        if before is not None and before >= want:
            log.info("kvstore: warm index=%d outcome=skipped tokens=%d", index, len(tokens))
            return "skipped"
        ctx, response = self.generator.generate(prompt.request(), args)
        try:
            for _ in response:
                pass
        finally:
            ctx.stop()
        after = self._settle(tokens, want)
        if after is None or (before is not None and after <= before):
            # Nothing of it went to disk: shorter than --min-tokens, a write
            # budget or admission (--admit-after) said no, or with --layout
            # whole only the anchor is stored before the state leaves RAM.
            log.warning("kvstore: warm index=%d outcome=failed error=not_stored tokens=%d", index, len(tokens))
            return "failed"
        log.info("kvstore: warm index=%d outcome=stored tokens=%d ms=%.0f", index, len(tokens),
                 (time.monotonic() - t0) * 1e3)
        return "stored"

    def _target(self, n):
        """How many of a prompt's n tokens the directory must hold for the
        prompt to count as stored: what a restarted server reuses of it (up
        to its last whole block; with whole files, a store length)."""
        store = self.tier.store
        if store.settings.layout == "chain":
            return (n - 1) // store.settings.block_tokens * store.settings.block_tokens
        return policy.store_len(n - 1, store.settings)

    def _stored_bytes(self, tokens):
        """The key bytes of the longest stored prefix a request for the prompt
        would find, or None: in bytes, so that a bucket entry (whose tokens
        are known only once fetched) counts as well."""
        entry = self.tier.store.find(self.tier.key_bytes(tokens[:-1]))
        return None if entry is None else entry.text_bytes

    def _settle(self, tokens, want):
        """Waits until the store's writer has written what the warm request
        queued; returns _stored_bytes(tokens) then.

        A chained store gets the finished request's blocks a moment after its
        answer ends (SETTLE_S); any other store what it had queued by then.
        """
        store = self.tier.store
        n = self._target(len(tokens))
        expect = (store.settings.layout == "chain" and self.tier.admit_after <= 1
                  and policy.store_cut(n, store.settings) > 0)
        deadline = time.monotonic() + SETTLE_S
        while True:
            store.flush()
            stored = self._stored_bytes(tokens)
            if not expect or (stored is not None and stored >= want) or time.monotonic() > deadline \
                    or self._stopping():
                return stored
            time.sleep(SETTLE_POLL_S)
