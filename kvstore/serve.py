"""kvstore serve: mlx-lm's OpenAI-compatible server with a disk tier behind its RAM cache.

mlx_lm.server keeps prompt caches in RAM only (LRUPromptCache): after a
restart, or once its LRU drops an entry, a long prompt is prefilled again.
This module runs mlx-lm's own server with that cache replaced by
TieredPromptCache, a subclass that adds a kvstore directory behind it:

    request tokens ──► RAM (mlx-lm's own trie and LRU)
                   └─► disk: the longest stored byte prefix (store.find), when
                       it reuses more tokens than RAM; the server gets the
                       loaded cache and prefills only the remaining tokens
    stored on disk (background writer; requests never wait for a write):
      cold      the system-prompt segment mlx-lm already cuts at the first
                user turn (the anchor of docs/format.md §7: agent sessions share it)
      continued waypoints every continued_step tokens of a long prefill
      evict     an entry mlx-lm's LRU drops, when worth keeping
      shutdown  every RAM entry, on SIGINT / SIGTERM
      blocks    the whole blocks of every finished request's prompt and
                answer (chained stores, docs/format.md §14): after a restart
                a prompt that leaves a stored conversation anywhere reuses it
                up to the last block boundary before it; the evict and
                shutdown states are then only their last block

Keys.  The server's cache API sees token ids only, so a checkpoint's key is
the detokenized token stream: the exact bytes of each token, concatenated
(kvstore.mlx.token_bytes_function).  Token prefixes map to byte prefixes, so
the longest-prefix lookup finds what a token trie would, and it is the same
key the chat-template text would give wherever the template's tokens are
the tokenizer's own.  A hit is used only when its stored token ids equal the
request's first tokens, so a different tokenization of the same bytes can
never feed the model a state it did not compute.

Integration.  Only mlx-lm's public classes are used: LRUPromptCache (and its
CacheOrder, replaced by a subclass that reports the entries the LRU drops),
ResponseGenerator (its prompt splitter is extended to cut long prompts at
waypoints), ModelProvider, APIHandler.  `kvstore serve` parses its own
options, hands every other option to mlx-lm's own argument parser and runs
the server in this process.  Tested with mlx-lm 0.32 (SUPPORTED_MLX_LM).
"""

import argparse
import hashlib
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from http.server import ThreadingHTTPServer

import mlx.core as mx
import mlx_lm
from mlx_lm import server as mlx_server
from mlx_lm.models.cache import LRUPromptCache, make_prompt_cache

from kvstore import remote
from kvstore.chain import DEFAULT_BLOCK_TOKENS, slice_along
from kvstore.format import Reason
from kvstore.mlx import (DEFAULT_CTX_SIZE, cache_from_checkpoint, checked_state, text_offsets_function,
                         token_bytes_function)
from kvstore.policy import Options, continued_step
from kvstore.store import DEFAULT_BUDGET_MB, LAYOUTS, KVStore

log = logging.getLogger("kvstore")

# The mlx-lm releases this module was tested with (pyproject pins the same).
SUPPORTED_MLX_LM = ((0, 32), (0, 33))

# Bytes read from each end of each weight file for the model fingerprint:
# enough to tell two checkpoints of one architecture apart (their weights
# differ everywhere), cheap even for a 100 GB model.
FINGERPRINT_SAMPLE = 1 << 16

# Where checkpoints go when --cache-dir is not given: one directory per
# model fingerprint, so that two models never share a directory by accident.
DEFAULT_CACHE_ROOT = os.path.join("~", ".cache", "kvstore", "serve")

# mlx-lm's cache types; a waypoint segment is inserted into RAM as "user".
WAYPOINT_TYPE = "user"


def model_fingerprint(path):
    """A hex SHA1 naming a model directory's contents.

    Covers config.json, the tokenizer files and, for every *.safetensors
    file, its name, size and its first and last FINGERPRINT_SAMPLE bytes.
    A path that is not a directory (a hub repo id) is named by itself.
    """
    h = hashlib.sha1()
    if not os.path.isdir(path):
        h.update(os.fspath(path).encode("utf-8"))
        return h.hexdigest()
    names = sorted(os.listdir(path))
    for name in names:
        full = os.path.join(path, name)
        if name in ("config.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model",
                    "chat_template.jinja"):
            with open(full, "rb") as f:
                h.update(name.encode() + b"\0" + f.read())
        elif name.endswith(".safetensors"):
            size = os.path.getsize(full)
            h.update(f"{name}\0{size}\0".encode())
            with open(full, "rb") as f:
                h.update(f.read(FINGERPRINT_SAMPLE))
                f.seek(max(0, size - FINGERPRINT_SAMPLE))
                h.update(f.read(FINGERPRINT_SAMPLE))
    return h.hexdigest()


class _ReportingOrder(LRUPromptCache.CacheOrder):
    """mlx-lm's LRU order that tells its owner which entries come and go."""

    def __init__(self, owner, ordering=None):
        super().__init__(ordering)
        self._owner = owner

    def push(self, model, tokens, cache_type="assistant"):
        super().push(model, tokens, cache_type)
        self._owner._pushed(model, tokens)

    def remove(self, model, tokens):
        super().remove(model, tokens)
        self._owner._removed(model, tokens)

    def pop(self):
        model, tokens = super().pop()
        self._owner._dropped(model, tokens)
        return model, tokens


class TieredPromptCache(LRUPromptCache):
    """mlx-lm's RAM prompt cache with a kvstore directory behind it.

    Args:
        store: a KVStore for this model's checkpoints.
        provider: mlx-lm's ModelProvider (the tokenizer and model come from it).
        model_key: the provider's key of the model the store belongs to;
            requests for other models use RAM only.
        fingerprint: model_fingerprint() of that model (kept in each
            checkpoint's meta and checked on load).
        max_size, max_bytes: mlx-lm's LRU limits.
    """

    def __init__(self, store, provider, model_key, fingerprint, max_size=10, max_bytes=1 << 63):
        super().__init__(max_size, max_bytes)
        self._lru = _ReportingOrder(self, self._lru._ordering)
        self.store = store
        self.provider = provider
        self.model_key = model_key
        self.fingerprint = fingerprint
        self.options = store.options
        self.waypoint_step = continued_step(self.options)
        self._token_bytes = None
        self._text_offsets = None
        self._incoming = None
        self._held = {}            # (model, tuple(tokens)) -> the cache mlx-lm keeps for it

    # -- the tokens -> bytes key --------------------------------------------

    def _key_bytes(self, tokens):
        if self._token_bytes is None:
            self._token_bytes = token_bytes_function(self.provider.tokenizer)
            self._text_offsets = text_offsets_function(self._token_bytes)
        return self._token_bytes(tokens)

    # -- lookup ---------------------------------------------------------------

    def fetch_nearest_cache(self, model, tokens):
        """RAM first; the disk when it reuses more tokens.  Logs one line per request."""
        t0 = time.perf_counter()
        cache, rest = super().fetch_nearest_cache(model, tokens)
        reused = len(tokens) - len(rest)
        source, load_ms = ("ram" if reused else "none"), 0.0
        # Keep at least one token to prefill: the server needs its logits.
        if model == self.model_key and reused < len(tokens) - 1:
            hit = self._load(tokens, reused)
            if hit is not None:
                cache, n = hit
                rest = tokens[n:]
                reused, source = n, "disk"
                load_ms = (time.perf_counter() - t0) * 1e3
        log.info("kvstore: request source=%s reused=%d prefilled=%d load_ms=%.1f",
                 source, reused, len(rest), load_ms)
        return cache, rest

    def _load(self, tokens, reused):
        """(cache, n) from the longest stored prefix of tokens[:-1] beyond reused; else None."""
        try:
            return self._load_longest(tokens, reused)
        except Exception as e:            # noqa: BLE001 - the disk tier must never fail a request
            log.warning("kvstore: disk_lookup_failed error=%s", type(e).__name__)
            return None

    def _load_longest(self, tokens, reused):
        entry = self.store.find(self._key_bytes(tokens[:-1]))
        if entry is None:
            return None
        if getattr(entry, "remote", None) is not None:
            # A remote entry's header is read when it is fetched: compare bytes.
            if entry.text_bytes <= len(self._key_bytes(tokens[:reused])):
                return None
        elif entry.tokens <= reused:
            return None
        ckpt = self.store.load(entry, into="mlx")
        if ckpt is None:
            return None
        n = len(ckpt.tokens)
        if ckpt.tokens.tolist() != list(tokens[:n]):
            log.info("kvstore: disk_miss reason=token_mismatch tokens=%d file=%s", n, entry.name[:12])
            return None
        if ckpt.meta.get("model") != self.fingerprint:
            log.info("kvstore: disk_miss reason=other_model tokens=%d file=%s", n, entry.name[:12])
            return None
        cache = cache_from_checkpoint(self.store, ckpt)
        if cache is None:
            return None
        expect = make_prompt_cache(self.provider.model)
        if self.provider.draft_model is not None:
            expect += make_prompt_cache(self.provider.draft_model)
        if [type(c) for c in cache] != [type(c) for c in expect]:
            log.info("kvstore: disk_miss reason=cache_layout tokens=%d file=%s", n, entry.name[:12])
            return None
        return cache, n

    # -- what goes to disk ----------------------------------------------------

    def insert_cache(self, model, tokens, prompt_cache, *, cache_type="assistant"):
        """mlx-lm's insert; then the system anchor and waypoints go to disk."""
        self._incoming = prompt_cache
        try:
            super().insert_cache(model, tokens, prompt_cache, cache_type=cache_type)
        finally:
            self._incoming = None
        if cache_type == "system":
            self._persist(model, tokens, prompt_cache, Reason.COLD)
        elif cache_type == WAYPOINT_TYPE and self.waypoint_step and len(tokens) % self.waypoint_step == 0:
            self._persist(model, tokens, prompt_cache, Reason.CONTINUED)
        elif cache_type == "assistant" and self.store.layout == "chain":
            # A finished request: its prompt and answer, whole blocks only.
            self._persist(model, tokens, prompt_cache, Reason.CONTINUED, whole_blocks=True)

    def _pushed(self, model, tokens):
        if self._incoming is not None:
            self._held[(model, tuple(tokens))] = self._incoming

    def _removed(self, model, tokens):
        # Replaced by a newer cache for the same tokens, or a prefix of a
        # longer trimmable entry: nothing is lost.
        self._held.pop((model, tuple(tokens)), None)

    def _dropped(self, model, tokens):
        cache = self._held.pop((model, tuple(tokens)), None)
        if cache is not None:
            self._persist(model, tokens, cache, Reason.EVICT)

    def _persist(self, model, tokens, cache, reason, whole_blocks=False):
        """Stores cache under its tokens' bytes on the background writer.

        Nothing is stored for another model than the store's, for fewer than
        min_tokens tokens, or when the same text is stored already.  With
        whole_blocks, only the tokens up to the last block boundary are
        stored, and only when the state is all positional (a recurrent or
        windowed state would be a link without its snapshot).
        """
        if model != self.model_key:
            return None
        try:
            n = cache[0].offset if cache and hasattr(cache[0], "offset") else len(tokens)
            if n > len(tokens) or n < self.options.min_tokens:
                return None
            tensors, meta, positional = checked_state(cache, n)
            if whole_blocks:
                cut = n // self.store.block_tokens * self.store.block_tokens
                if cut < self.options.min_tokens or len(positional) != len(tensors):
                    return None
                tensors = {k: slice_along(a, positional[k], 0, cut) for k, a in tensors.items()}
                n = cut
            tokens = list(tokens[:n])
            text = self._key_bytes(tokens)
            have = self.store.find(text)
            if have is not None and have.text_bytes == len(text):
                return None
            meta["model"] = self.fingerprint
            return self.store.save_async(text, tokens, tensors, meta=meta, reason=reason,
                                         ctx_size=self.store.ctx_size, positional=positional,
                                         text_offsets=self._text_offsets(tokens, len(text)))
        except (TypeError, ValueError) as e:   # a cache class kvstore cannot store
            log.info("kvstore: store_skipped reason=%s detail=%s", Reason(reason).name.lower(),
                     type(e).__name__)
        except Exception as e:                 # noqa: BLE001 - never fail a request for the disk tier
            log.warning("kvstore: store_failed reason=%s error=%s", Reason(reason).name.lower(),
                        type(e).__name__)
        return None

    def persist_all(self):
        """Stores every RAM entry worth keeping as `shutdown` (on the background writer).

        Runs on the generation thread: MLX evaluates an array only on the
        thread whose stream made it.
        """
        saved = 0
        for (model, tokens), cache in list(self._held.items()):
            saved += self._persist(model, tokens, cache, Reason.SHUTDOWN) is not None
        log.info("kvstore: shutdown queued=%d", saved)

    def close(self):
        """Waits for the background writer and closes the store."""
        try:
            self.store.flush()
        finally:
            self.store.close()


class TieredResponseGenerator(mlx_server.ResponseGenerator):
    """mlx-lm's ResponseGenerator whose prompt segments also end at waypoints.

    mlx-lm hands the cache to insert_cache at the end of each prompt
    segment; cutting a long segment at every multiple of the waypoint step
    gives the disk tier the states docs/format.md §7 stores as `continued`.
    """

    def __init__(self, model_provider, prompt_cache):
        self.tier = prompt_cache
        super().__init__(model_provider, prompt_cache)

    def _generate(self):
        try:
            super()._generate()
        finally:
            self.tier.persist_all()

    def _tokenize(self, tokenizer, request, args):
        prompt, segments, types, state, vision = super()._tokenize(tokenizer, request, args)
        step = self.tier.waypoint_step
        if vision is None and 0 < step < len(prompt):
            segments, types = split_at_waypoints(segments, types, step)
        return prompt, segments, types, state, vision


def split_at_waypoints(segments, types, step):
    """Cuts segments at every absolute multiple of step; the cut-off heads are WAYPOINT_TYPE.

    The last piece of each segment keeps the segment's own type, so every
    boundary mlx-lm had is kept.
    """
    out, out_types, pos = [], [], 0
    for seg, kind in zip(segments, types):
        start = 0
        cut = (pos // step + 1) * step
        while cut < pos + len(seg):
            out.append(seg[start:cut - pos])
            out_types.append(WAYPOINT_TYPE)
            start = cut - pos
            cut += step
        out.append(seg[start:])
        out_types.append(kind)
        pos += len(seg)
    return out, out_types


# ---- running the server ------------------------------------------------------

def _check_mlx_lm():
    version = tuple(int(p) for p in mlx_lm.__version__.split(".")[:2] if p.isdigit())
    lo, hi = SUPPORTED_MLX_LM
    if not lo <= version < hi:
        log.warning("kvstore: untested mlx_lm=%s supported=%s..%s", mlx_lm.__version__,
                    ".".join(map(str, lo)), ".".join(map(str, hi)))


def _config(path):
    try:
        with open(os.path.join(path, "config.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def _ctx_size(config):
    return int(config.get("max_position_embeddings") or DEFAULT_CTX_SIZE)


def _quant_bits(config):
    q = config.get("quantization") or config.get("quantization_config") or {}
    return int(q["bits"]) if isinstance(q, dict) and q.get("bits") in (2, 3, 4, 5, 6, 8) else 16


class _Server:
    """The HTTP server, the generation thread and the tier, stopped in that order."""

    def __init__(self, host, port, model_provider, opts):
        cli = model_provider.cli_args
        path = cli.model
        self.fingerprint = model_fingerprint(path)
        config = _config(path) if os.path.isdir(path) else {}
        cache_dir = opts.cache_dir or os.path.join(os.path.expanduser(DEFAULT_CACHE_ROOT),
                                                   self.fingerprint[:16])
        options = Options(**{k: v for k, v in (("min_tokens", opts.min_tokens),
                                                ("continued_interval_tokens", opts.waypoint_tokens))
                             if v is not None})
        extra = dict(model_identity=self.fingerprint, **remote.store_kwargs(opts))
        self.store = KVStore(cache_dir, budget_mb=opts.budget_mb,
                             model_id=int(self.fingerprint[:2], 16),
                             quant_bits=_quant_bits(config), ctx_size=_ctx_size(config),
                             options=options, layout=opts.layout, block_tokens=opts.block_tokens, **extra)
        if self.store.remote is not None:
            # The bucket's index before the first request (later refreshes
            # run in the background); a remote that is down costs one
            # connect timeout here and nothing afterwards.
            self.store.remote.refresh()
        model_key = (path, cli.adapter_path, cli.draft_model)
        self.tier = TieredPromptCache(self.store, model_provider, model_key, self.fingerprint,
                                      max_size=cli.prompt_cache_size)
        self.generator = TieredResponseGenerator(model_provider, self.tier)
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, _, _, _, address = infos[0]

        class Server(ThreadingHTTPServer):
            address_family = family
            daemon_threads = True

        fingerprint = mlx_server.get_system_fingerprint()
        self.httpd = Server(address, lambda *a, **kw: mlx_server.APIHandler(
            self.generator, *a, system_fingerprint=fingerprint, **kw))
        self.cache_dir = cache_dir

    def run(self):
        stop = threading.Event()

        def on_signal(signum, frame):
            stop.set()

        old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        thread = threading.Thread(target=self.httpd.serve_forever, name="kvstore-http", daemon=True)
        thread.start()
        host, port = self.httpd.server_address[:2]
        log.info("kvstore: serving host=%s port=%d cache_dir=%s entries=%d", host, port,
                 self.cache_dir, len(self.store.entries()))
        status = 0
        try:
            while not stop.wait(0.5):
                if not self.generator.generation_available():
                    log.error("kvstore: generation thread stopped; shutting down")
                    status = 1
                    break
        finally:
            for s, h in old.items():
                signal.signal(s, h)
            self.httpd.shutdown()
            self.httpd.server_close()
            self.generator.stop_and_join()
            self.tier.close()
        return status


def build_parser():
    """The options `kvstore serve` adds to mlx_lm.server's own."""
    p = argparse.ArgumentParser(
        prog="kvstore serve", add_help=False,
        description="mlx-lm's OpenAI-compatible server with a persistent disk tier behind its "
                    "RAM prompt cache. Every mlx_lm.server option is accepted too "
                    "(see `mlx_lm.server --help`).")
    p.add_argument("-h", "--help", action="store_true", help="show this help and mlx_lm.server's")
    p.add_argument("--model", help="the mlx-lm model directory (required)")
    p.add_argument("--cache-dir", help="checkpoint directory (default: "
                   f"{DEFAULT_CACHE_ROOT}/<model fingerprint>)")
    p.add_argument("--budget-mb", type=float, default=DEFAULT_BUDGET_MB,
                   help=f"disk budget of the directory in MiB (default {DEFAULT_BUDGET_MB})")
    p.add_argument("--min-tokens", type=int, default=None,
                   help="shortest prefix worth a checkpoint (default 512)")
    p.add_argument("--waypoint-tokens", type=int, default=None,
                   help="store a `continued` checkpoint every this many prompt tokens, rounded up "
                        "to 2048 (default 10000; 0: none)")
    p.add_argument("--layout", choices=LAYOUTS, default="chain",
                   help="chain: blocks of --block-tokens, every token's KV written once and a hit at every "
                        "block boundary (default); whole: one file per checkpoint")
    p.add_argument("--block-tokens", type=int, default=DEFAULT_BLOCK_TOKENS,
                   help=f"tokens per block of a chain (default {DEFAULT_BLOCK_TOKENS})")
    remote.add_arguments(p)
    return p


def main(argv=None):
    """Runs `kvstore serve`; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    opts, rest = parser.parse_known_args(argv)
    if opts.help:
        parser.print_help()
        print("\nmlx_lm.server options:")
        _run_mlx_lm_main(["--help"], None)
        return 0
    if not opts.model:
        parser.print_usage(sys.stderr)
        print("kvstore serve: error: --model PATH is required", file=sys.stderr)
        return 2
    local = os.path.isabs(opts.model) or opts.model.startswith((".", "~"))
    if local and not os.path.isdir(os.path.expanduser(opts.model)):
        # (Anything else may be a hub repository id, which mlx-lm resolves.)
        print(f"kvstore serve: error: --model {opts.model}: no such model directory", file=sys.stderr)
        return 2
    if opts.block_tokens < 1:
        print(f"kvstore serve: error: --block-tokens {opts.block_tokens} must be >= 1", file=sys.stderr)
        return 2
    for name in ("budget_mb", "min_tokens", "waypoint_tokens"):
        value = getattr(opts, name)
        if value is not None and value < 0:
            print(f"kvstore serve: error: --{name.replace('_', '-')} {value} must be >= 0", file=sys.stderr)
            return 2
    _check_mlx_lm()
    status = _run_mlx_lm_main(["--model", opts.model] + rest, opts)
    # Everything is stored and the store is closed.  The interpreter's own
    # teardown would now destroy MLX's per-thread stream state of the
    # finished generation thread and abort ("terminate called without an
    # active exception", seen with plain mlx_lm.server too): leave now.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _run_mlx_lm_main(argv, opts):
    """mlx_lm.server.main() parses argv with its own parser and calls run(host, port, provider).

    mlx-lm offers no other way to get its full option set; its run() is
    swapped for ours for the duration of the call, then restored.
    """
    result = {"status": 0}

    def run(host, port, model_provider):
        if mx.distributed.init().size() > 1:
            raise SystemExit("kvstore serve: distributed mlx_lm.server is not supported")
        logging.getLogger("kvstore").setLevel(logging.INFO)
        result["status"] = _Server(host, port, model_provider, opts).run()

    saved_argv, saved_run = sys.argv, mlx_server.run
    sys.argv = ["kvstore serve"] + argv
    mlx_server.run = run
    try:
        mlx_server.main()
    except SystemExit as e:                  # --help, a bad mlx-lm option
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    finally:
        sys.argv, mlx_server.run = saved_argv, saved_run
    return result["status"]
