"""The `kvstore` command line: look after a directory of checkpoints, run the demo or the server.

    kvstore ls DIR [--json] [--budget-mb N]       one row per checkpoint, best kept first
    kvstore inspect FILE|SHA-PREFIX [--dir DIR] [--text]
    kvstore explain DIR PROMPT_FILE [--text] [--cache-salt SALT] [--json]
    kvstore verify DIR [--quarantine] [--progress]
    kvstore evict DIR --budget-mb N [--dry-run]
    kvstore stats DIR [--json] [--budget-mb N]
    kvstore wipe DIR [SHA-PREFIX] --yes
    kvstore session list DIR [--json]
    kvstore ls --remote s3://BUCKET/PREFIX [--endpoint-url URL] [--json]
    kvstore remote gc --remote s3://BUCKET/PREFIX --budget-gb N [--dry-run]
    kvstore demo [--dir DIR] [--model PATH]
    kvstore serve --model PATH [...]

Rooms: text (formatting, the progress bar, usage errors); local (what the
directory commands share) and one module per group of them, each
registering its own sub-commands: listing (ls), inspection (inspect),
explain, verify, evict, stats, wipe, exchange (export, import), sessions (session
list), keys (--key, key new); remote (the bucket commands).  This module
holds the parser, the demo command and main().

Exit status: 0 success; 1 a corrupt checkpoint was found (verify, inspect) or
the disk failed; 2 a usage error (missing directory, unknown or ambiguous
prefix, bad number, wipe without --yes).  Errors are one line on stderr,
``kvstore: error: ...``; set KVSTORE_DEBUG=1 to see the traceback of an
unexpected one.
"""

import argparse
import importlib
import logging
import os
import sys

from kvstore import __version__
from kvstore.cli import (evict, exchange, explain, inspection, keys, listing, remote, sessions, stats, text, verify,
                         wipe)
from kvstore.cli.text import PROG, UsageError
from kvstore.errors import KVStoreError

log = logging.getLogger("kvstore")


def cmd_demo(args):
    """`kvstore demo`: the scripted agent workload (kvstore.demo)."""
    for name in ("mlx.core", "tokenizers", "mlx_lm"):
        try:
            importlib.import_module(name)
        except ImportError as e:
            raise UsageError(f"kvstore demo needs MLX, mlx-lm and tokenizers ({e.name or name} is missing): "
                             "pip install 'kvstore[demo]'") from None
    from kvstore.demo import workload
    if args.model and not os.path.isfile(os.path.join(args.model, "config.json")):
        raise UsageError(f"{args.model}: not an mlx-lm model directory (no config.json)")
    show = args.progress or sys.stderr.isatty()

    def prefill_bar():
        return text.Progress(0, "  prefill", show, unit="tokens")

    if args.phase == 2:
        return workload.run_restarted(args.dir, args.model, args.workdir, args.rows, prefill_bar)
    return workload.run(args.dir, args.model, prefill_bar, show)


def _add_demo(sub):
    p = sub.add_parser("demo", help="run the scripted agent workload (the main job)",
                       description="A scripted agent workload served through PromptCache, with a restart.")
    p.add_argument("--dir", help="cache directory (default: a new temporary one)")
    p.add_argument("--model", help="a local mlx-lm model directory (default: the embedded model)")
    p.add_argument("--progress", action="store_true", help="always show the prefill progress bar")
    # The restarted second phase runs as `kvstore demo --phase 2 ...`.
    p.add_argument("--phase", type=int, choices=(1, 2), help=argparse.SUPPRESS)
    p.add_argument("--workdir", help=argparse.SUPPRESS)
    p.add_argument("--rows", help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_demo)


def build_parser():
    """The argparse parser of the `kvstore` command."""
    p = text.Parser(prog=PROG, description="Look after a directory of kvstore KV-cache checkpoints.")
    p.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    p.add_argument("-v", "--verbose", action="store_true", help="log every store event (key=value lines)")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)
    # The directory commands, in the order --help lists them.
    for group in (listing, inspection, explain, verify, evict, stats, wipe, exchange, sessions, keys):
        group.add_parsers(sub)
    remote.add_parsers(sub)
    _add_demo(sub)
    # `kvstore serve` takes mlx_lm.server's options as well as its own, so
    # main() hands its arguments to kvstore.serve untouched; this entry only
    # lists it in --help.
    sub.add_parser("serve", add_help=False,
                   help="mlx-lm's OpenAI-compatible server with this disk tier (kvstore serve --help)")
    return p

def _error(message):
    print(f"{PROG}: error: {message}", file=sys.stderr)


def _serve(argv):
    """`kvstore serve`: mlx-lm's server with kvstore's tier (kvstore.serve),
    which sets up logging (its --log-level) itself.  Where mlx-lm cannot be
    imported, --help still prints kvstore's own options and says what to
    install; anything else is an error that says so."""
    try:
        from kvstore.serve import server
    except ImportError as e:         # mlx-lm missing, or a release outside SUPPORTED_MLX_LM
        why = f"{e}; `pip install 'kvstore[serve]'` installs what it needs"
        if "-h" in argv or "--help" in argv:
            from kvstore.serve import options
            options.build_parser().print_help()
            print(f"\nmlx_lm.server options: not available here ({why})")
            return 0
        _error(f"kvstore serve: {why}")
        return 2
    return server.main(argv)


def main(argv=None):
    """Runs the `kvstore` command line; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:
        return _serve(argv[1:])
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    old_level, old_propagate = log.level, log.propagate
    log.addHandler(handler)
    log.propagate = False
    log.setLevel(logging.WARNING)
    try:
        try:
            args = build_parser().parse_args(argv)
        except SystemExit as e:          # --help, --version
            return e.code if isinstance(e.code, int) else 0
        if args.verbose:
            log.setLevel(logging.INFO)
        return args.func(args)
    except UsageError as e:
        _error(e)
        return 2
    except KeyboardInterrupt:
        _error("interrupted")
        return 130
    except BrokenPipeError:
        # `kvstore ls DIR | head`: the reader left; say nothing more.
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return 1
    except (KVStoreError, OSError) as e:
        _error(f"{e.filename}: {e.strerror}" if isinstance(e, OSError) and e.filename and e.strerror else e)
        return 1
    except Exception as e:                 # noqa: BLE001 - one line, never a traceback
        if os.environ.get("KVSTORE_DEBUG"):
            raise
        _error(f"unexpected {type(e).__name__}: {e} (set KVSTORE_DEBUG=1 for the traceback)")
        return 1
    finally:
        log.removeHandler(handler)
        log.setLevel(old_level)
        log.propagate = old_propagate
