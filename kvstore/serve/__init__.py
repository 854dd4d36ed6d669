"""kvstore serve: mlx-lm's OpenAI-compatible server with a disk tier behind its RAM cache.

mlx_lm.server keeps prompt caches in RAM only (LRUPromptCache): after a
restart, or once its LRU drops an entry, a long prompt is prefilled again.
This package runs mlx-lm's own server with that cache replaced by
TieredPromptCache, a subclass that adds a kvstore directory behind it:

    request ──► HTTP thread: tokenize; RAM (mlx-lm's trie) or the longest
            │   stored byte prefix on disk or in the bucket (store.find),
            │   whichever reuses more; a disk or bucket hit is loaded here,
            │   while the running batch keeps decoding
            └─► generation thread: the request joins the batch with its
                cache and prefills only the remaining tokens
    stored on disk (background writer; requests never wait for a write):
      cold      the system-prompt segment mlx-lm already cuts at the first
                user turn (the anchor of docs/semantics.md §7: agent sessions share it)
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
(kvstore.mlx.engine.token_bytes_function), opened by the tenant's tag when the
request carries a cache_salt (kvstore.tenants).  Token prefixes map to
byte prefixes, so the longest-prefix lookup finds what a token trie would.
A hit is used only when its stored token ids equal the request's first
tokens, so a different tokenization of the same bytes can never feed the
model a state it did not compute.

Models.  Every model shares one cache root and its budget; each file names the
model that made it (kvstore.mlx.model_fingerprint of the loaded weights, with
the server's KV options) and a model is offered only its own files; a disk
hit is checked against the live model by the canary (docs/semantics.md §17).

Modules: tier (the RAM + disk cache, admission), generator (prefetch on the
HTTP thread, waypoints), http (cache_salt, cache_control, usage.kvstore,
GET /metrics), ticket (what the server knows of one request: its trace),
pinning (cache_control breakpoints, docs/semantics.md §19), activity (what the
server has served: hit rates by source, recent traces), warm (--warm FILE:
prompts prefilled after start-up), admin (GET/DELETE /v1/cache and its
access rule) and page (GET /cache), metrics (Prometheus),
server (options, start and stop).

Integration.  Every use of mlx-lm's internals (LRUPromptCache's order and
trie, ResponseGenerator's tokenizer and request loop, APIHandler's headers,
ModelProvider's maps) goes through kvstore.mlx.mlxlm, which subclasses them
behind public hooks and checks the installed mlx-lm against
SUPPORTED_MLX_LM when imported: an unsupported release fails there, naming
the installed version and the supported range.  `kvstore serve` parses its
own options, hands every other option to mlx-lm's own argument parser and
runs the server in this process.
"""

import importlib

# Where each public name lives.  They are imported when first asked for, so
# that kvstore.serve.options (the option parser, which `kvstore serve --help`
# prints) imports without MLX or mlx-lm installed.
_NAMES = {"TieredResponseGenerator": "generator", "split_at_waypoints": "generator",
          "SUPPORTED_MLX_LM": "server", "main": "server", "build_parser": "options",
          "TieredPromptCache": "tier"}
__all__ = sorted(_NAMES)


def __getattr__(name):
    if name not in _NAMES:
        raise AttributeError(f"module 'kvstore.serve' has no attribute {name!r}")
    return getattr(importlib.import_module(f"kvstore.serve.{_NAMES[name]}"), name)

__all__ = ["TieredPromptCache", "TieredResponseGenerator", "split_at_waypoints", "build_parser", "main",
           "SUPPORTED_MLX_LM"]
