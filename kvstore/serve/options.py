"""kvstore serve's own options: the parser and the checks of what it parsed.

Kept apart from the server (kvstore.serve.server) so that `kvstore serve
--help` prints them where mlx-lm is not installed: nothing here imports MLX
or mlx-lm.  Every other option goes to mlx_lm.server's own parser.
"""

import argparse
import os

from kvstore import host, remote
from kvstore.chain import DEFAULT_BLOCK_TOKENS
from kvstore.payload.forms import KV_CODECS
from kvstore.policy import DEFAULT_STALE_AFTER_S, default_budget_text
from kvstore.serve import admin as admin_mod
from kvstore.serve import pinning
from kvstore.serve.drain import DEFAULT_DRAIN_TIMEOUT_S
from kvstore.serve.warm import add_arguments as add_warm_arguments
from kvstore.store import LAYOUTS

# Where checkpoints go when --cache-dir is not given: one directory, and one
# budget, for every model served from this machine; each file names its
# model (docs/semantics.md §17), so models never load each other's state.
# ~/.cache/kvstore/serve; on macOS ~/Library/Caches/kvstore/serve (kvstore.host).
DEFAULT_CACHE_ROOT = os.path.join(host.default_cache_root(), "serve")


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
    p.add_argument("--budget-mb", type=float, default=None,
                   help="disk budget of the directory, all models together, in MiB (default: "
                        f"{default_budget_text('it')}; 0: none)".replace("%", "%%"))
    p.add_argument("--stale-after-days", type=float, default=DEFAULT_STALE_AFTER_S / 86400,
                   help="checkpoints nobody has used for this many days go first when the directory is over "
                        f"its budget, whatever their model (default {DEFAULT_STALE_AFTER_S // 86400}; 0: never)")
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
    p.add_argument("--kv-codec", choices=KV_CODECS, default="raw",
                   help="raw: a chain block's KV as it is (default); lossless: its float tensors as byte planes, "
                        "4-bit table planes where that shrinks them; q8, q4: quantised to 8 or 4 bits a value, group-wise "
                        "(lossy: every restore then passes the canary with the codec's tolerance); "
                        "docs/format.md §20; with --cache-key-file, packed before sealed")
    p.add_argument("--disk-kv-bits", type=int, choices=(8, 4), default=None,
                   help="the same as --kv-codec q8 or q4")
    p.add_argument("--max-write-mb-per-hour", type=float, default=None,
                   help="SSD write budget in MiB per hour: when it runs low, stores are skipped in order "
                        "of value (waypoints and evict states first, anchors last); default: none")
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
    --disk-kv-bits into opts.kv_codec."""
    if not opts.model:
        return "--model PATH is required"
    local = os.path.isabs(opts.model) or opts.model.startswith((".", "~"))
    if local and not os.path.isdir(os.path.expanduser(opts.model)):
        # (Anything else may be a hub repository id, which mlx-lm resolves.)
        return f"--model {opts.model}: no such model directory"
    for name in ("block_tokens", "admit_after"):
        value = getattr(opts, name)
        if value < 1:
            return f"--{name.replace('_', '-')} {value} must be >= 1"
    if opts.max_write_mb_per_hour is not None and not opts.max_write_mb_per_hour > 0:
        return f"--max-write-mb-per-hour {opts.max_write_mb_per_hour} must be > 0"
    if not 0 <= opts.max_pinned_share <= 1:
        return f"--max-pinned-share {opts.max_pinned_share} must be between 0 and 1"
    for name in ("budget_mb", "min_tokens", "waypoint_tokens", "stale_after_days", "drain_timeout"):
        value = getattr(opts, name)
        if value is not None and value < 0:
            return f"--{name.replace('_', '-')} {value} must be >= 0"
    if opts.disk_kv_bits is not None:
        codec = f"q{opts.disk_kv_bits}"
        if opts.kv_codec not in ("raw", codec):
            return f"--disk-kv-bits {opts.disk_kv_bits} with --kv-codec {opts.kv_codec}: choose one"
        opts.kv_codec = codec
    if opts.kv_codec != "raw" and opts.layout != "chain":
        return (f"--kv-codec {opts.kv_codec} with --layout {opts.layout}: packed and quantised "
                "tensors are chain blocks'")
    return None
