"""kvstore serve's own options: the parser and the checks of what it parsed.

Kept apart from the server (kvstore.serve.server) so that `kvstore serve
--help` prints them where mlx-lm is not installed: nothing here imports MLX
or mlx-lm.  Every other option goes to mlx_lm.server's own parser.
"""

import argparse
import os

from kvstore import host, remote, settings
from kvstore.serve import admin as admin_mod
from kvstore.serve import pinning
from kvstore.serve.drain import DEFAULT_DRAIN_TIMEOUT_S
from kvstore.serve.warm import add_arguments as add_warm_arguments

# Where checkpoints go when --cache-dir is not given: one directory, and one
# budget, for every model served from this machine; each file names its
# model (docs/semantics.md §17), so models never load each other's state.
# ~/.cache/kvstore/serve; on macOS ~/Library/Caches/kvstore/serve (kvstore.host).
DEFAULT_CACHE_ROOT = os.path.join(host.default_cache_root(), "serve")

# The store settings kvstore serve takes as options (kvstore.settings makes
# them, flag, type, default and help), and where its defaults or its words
# differ from a library store's.
STORE_SETTINGS = ("budget_mb", "stale_after_s", "min_tokens", "continued_interval_tokens", "layout",
                  "block_tokens", "kv_codec", "max_write_mb_per_hour", "max_pinned_share", "max_pin_ttl_s")
SERVE_DEFAULTS = settings.Settings(max_pin_ttl_s=pinning.DEFAULT_MAX_PIN_TTL_S)
SERVE_DOC = {
    "max_pinned_share": "the share of --budget-mb that prefixes pinned by cache_control may keep; a pin past "
                        "it is refused (409), never granted by unpinning others (0: no pins)",
    "max_pin_ttl_s": "the longest lifetime a pin is granted, in seconds or with a unit (90s, 5m, 1h, 2d); a "
                     "longer cache_control ttl is cut to it",
}


def build_parser():
    """The options `kvstore serve` adds to mlx_lm.server's own."""
    p = argparse.ArgumentParser(
        prog="kvstore serve", add_help=False,
        description="mlx-lm's OpenAI-compatible server with a persistent disk tier behind its "
                    "RAM prompt cache. Every mlx_lm.server option is accepted too "
                    "(see `mlx_lm.server --help`).")
    p.add_argument("-h", "--help", action="store_true", help="show this help and mlx_lm.server's")
    p.add_argument("--model", help="the mlx-lm model directory (required)")
    p.add_argument("--cache-dir", help="checkpoint directory, shared by every model (each file names its "
                   f"model; default: {DEFAULT_CACHE_ROOT})")
    settings.add_arguments(p, STORE_SETTINGS, SERVE_DEFAULTS, doc=SERVE_DOC)
    p.add_argument("--disk-kv-bits", type=int, choices=(8, 4), default=None,
                   help="the same as --kv-codec q8 or q4")
    p.add_argument("--admit-after", type=int, default=1,
                   help="store a prefix only once this many requests have used it (default 1: at first use)")
    p.add_argument("--drain-timeout", type=float, default=DEFAULT_DRAIN_TIMEOUT_S,
                   help="on SIGTERM or SIGINT, refuse new requests (503, Retry-After) and let those in flight "
                        f"finish for at most this many seconds, then store and exit (default "
                        f"{DEFAULT_DRAIN_TIMEOUT_S:g}; a second signal stops at once)")
    pinning.add_arguments(p)
    p.add_argument("--require-cache-salt", action="store_true",
                   help="refuse completions without a cache_salt (400); requests with different salts "
                        "never share a cached prefix, in RAM, on disk or in the bucket")
    p.add_argument("--cache-key-file", metavar="FILE", default=None,
                   help="seal every checkpoint with this 32-byte key (kvstore key new FILE): text and KV "
                        "encrypted and authenticated on disk and in the bucket; unsealed files are ignored")
    add_warm_arguments(p)
    admin_mod.add_arguments(p)
    remote.add_arguments(p)
    return p


def check(opts):
    """None when the parsed options hold together, else the message of the
    first that does not (naming the option and its value).  Folds
    --disk-kv-bits into opts.kv_codec and sets opts.settings, the store's
    kvstore.Settings."""
    if not opts.model:
        return "--model PATH is required"
    local = os.path.isabs(opts.model) or opts.model.startswith((".", "~"))
    if local and not os.path.isdir(os.path.expanduser(opts.model)):
        # (Anything else may be a hub repository id, which mlx-lm resolves.)
        return f"--model {opts.model}: no such model directory"
    if opts.admit_after < 1:
        return f"--admit-after {opts.admit_after} must be >= 1"
    if opts.drain_timeout < 0:
        return f"--drain-timeout {opts.drain_timeout} must be >= 0"
    if opts.disk_kv_bits is not None:
        codec = f"q{opts.disk_kv_bits}"
        if opts.kv_codec not in (None, "raw", codec):
            return f"--disk-kv-bits {opts.disk_kv_bits} with --kv-codec {opts.kv_codec}: choose one"
        opts.kv_codec = codec
    try:
        opts.settings = settings.from_arguments(opts, STORE_SETTINGS, SERVE_DEFAULTS)
    except settings.BadSetting as e:
        return str(e)
    return None
