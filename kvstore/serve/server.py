"""Running kvstore serve: mlx-lm's server with the tier, the metrics and the options."""

import faulthandler
import functools
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
from mlx_lm import server as mlx_server

from kvstore import payload, remote, seal
# SUPPORTED_MLX_LM (kvstore.serve shows it): an mlx-lm release outside it fails the import of kvstore.mlx.
from kvstore.mlx import SUPPORTED_MLX_LM  # noqa: F401
from kvstore.identity import tag_hex
from kvstore.serve import admin as admin_mod
from kvstore.serve import options
from kvstore.serve.options import DEFAULT_CACHE_ROOT
from kvstore.serve import metrics as metrics_mod
from kvstore.serve.activity import Activity
from kvstore.serve.drain import ABORT_GRACE_S, Drain
from kvstore.serve.generator import LOAD_NICE, TieredResponseGenerator
from kvstore.serve.http import handler_class
from kvstore.serve.tier import TieredPromptCache
from kvstore.serve.warm import Warmer, checked_open, read_file
from kvstore.store import KVStore

log = logging.getLogger("kvstore")

# The mlx_lm.server options that change the KV state (kv quantisation): part
# of the model's identity, as its weights are.
CACHE_OPTIONS = ("kv_bits", "kv_group_size", "quantized_kv_start")


def _config(path):
    try:
        with open(os.path.join(path, "config.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def _cache_options(cli):
    """The mlx_lm.server options that are part of the model's identity (CACHE_OPTIONS)."""
    # Without kv_bits the group size and start change nothing: the
    # identity is then the model's own, as an MLXEngine's is.
    if getattr(cli, "kv_bits", None) is None:
        return {}
    return {k: getattr(cli, k, None) for k in CACHE_OPTIONS}


def _server_metrics(store):
    """The server's Metrics over store() (the open KVStore or None), or None
    without prometheus_client."""
    if metrics_mod.available():
        return metrics_mod.Metrics(store)
    log.warning("kvstore: metrics_disabled reason=no_prometheus_client "
                "(pip install 'kvstore[serve]' for GET /metrics)")
    return None


def _open_store(cache_dir, opts, spec):
    """The KVStore of one model's checkpoints under cache_dir.

    Called on the generation thread, once the model has loaded: its
    identity names the store's files (docs/semantics.md §17).
    """
    identity = spec.identity
    store = KVStore(cache_dir, opts.settings, model_identity=identity, key=opts.cache_key_file,
                    **spec.store_settings(), **remote.store_kwargs(opts))
    if store.remote is not None:
        # The bucket's index before the first request (later refreshes
        # run in the background); a remote that is down costs one
        # connect timeout here and nothing afterwards.
        store.remote.refresh()
    # (The budget has its own line, store_budget, from the store's open.)
    log.info("kvstore: store_open cache_dir=%s model=%s tag=%s entries=%d", cache_dir,
             identity.label, tag_hex(identity.tag), len(store.entries()))
    return store


class _Server:
    """The HTTP server, the generation thread and the tier, stopped in that order."""

    def __init__(self, host, port, model_provider, opts):
        cli = model_provider.cli_args
        path = cli.model
        config = _config(path) if os.path.isdir(path) else {}
        self.cache_dir = cache_dir = opts.cache_dir or os.path.expanduser(DEFAULT_CACHE_ROOT)
        # Loads and saves run beside the generation thread: at a lower CPU
        # priority they take the time decoding leaves (docs/semantics.md §7).
        payload.set_io_priority(LOAD_NICE)
        # The HTTP threads load into MLX while the generation thread runs it:
        # no MLX task may call back into Python (kvstore.payload.set_mlx_threaded).
        payload.set_mlx_threaded(True)
        open_store = functools.partial(_open_store, cache_dir, opts)
        self.warm_file = getattr(opts, "warm", None)        # a checked kvstore.serve.warm.WarmFile (main)
        if self.warm_file is not None:
            open_store = checked_open(open_store, self.warm_file)
        model_key = (path, cli.adapter_path, cli.draft_model)
        self.metrics = _server_metrics(lambda: self.tier.store)
        self.tier = TieredPromptCache(open_store, model_provider, model_key, opts.settings, _cache_options(cli),
                                      config=config,
                                      label=os.path.basename(os.path.normpath(path)),
                                      max_size=cli.prompt_cache_size, metrics=self.metrics,
                                      admit_after=opts.admit_after)
        self.generator = TieredResponseGenerator(model_provider, self.tier)
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, _, _, _, address = infos[0]

        class Server(ThreadingHTTPServer):
            address_family = family
            daemon_threads = True

        fingerprint = mlx_server.get_system_fingerprint()
        self.drain = Drain()
        self.drain_timeout = opts.drain_timeout
        self.activity = Activity()
        self.warmer = None if self.warm_file is None else Warmer(self.warm_file, self.generator, self.tier,
                                                                 self.drain, self.metrics)
        admin = admin_mod.from_options(opts, lambda: self.tier.store, self.activity, self.tier)
        handler = handler_class(opts.require_cache_salt, self.metrics, self.drain, self.activity, warm=self.warmer,
                                admin=admin, global_system=opts.global_system_prompt)
        self.httpd = Server(address, lambda *a, **kw: handler(self.generator, *a, system_fingerprint=fingerprint,
                                                              **kw))

    def run(self):
        signals = []
        stop = threading.Event()

        def on_signal(signum, frame):
            signals.append(signum)
            stop.set()

        old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        thread = threading.Thread(target=self.httpd.serve_forever, name="kvstore-http", daemon=True)
        thread.start()
        host, port = self.httpd.server_address[:2]
        log.info("kvstore: serving host=%s port=%d cache_dir=%s", host, port, self.cache_dir)
        if self.warmer is not None:
            self.warmer.start()
        status = 0
        try:
            while not stop.wait(0.5):
                if not self.generator.generation_available() and self.warm_file is not None \
                        and self.warm_file.refusal:
                    status = _usage_error(self.warm_file.refusal)    # the warm file is for another model
                    break
                if not self.generator.generation_available():
                    log.error("kvstore: generation thread stopped; shutting down")
                    status = 1
                    break
            if status == 0:
                self._drain(lambda: len(signals) > 1)
        finally:
            for s, h in old.items():
                signal.signal(s, h)
            self.httpd.shutdown()
            self.drain.stopping = True
            self.generator.stop_and_join()           # stores every RAM entry as `shutdown`
            # Answers still open learn that their generation stopped (within
            # a second) and tell their clients before the process goes.
            self.drain.wait_idle(ABORT_GRACE_S)
            self.httpd.server_close()
            self.tier.close()
        return status

    def _drain(self, cancel):
        """Refuses new requests and lets those in flight finish (docs: kvstore.serve.drain)."""
        self.drain.start()
        log.info("kvstore: draining in_flight=%d timeout_s=%g", self.drain.in_flight, self.drain_timeout)
        t0 = time.monotonic()
        done = self.drain.wait_idle(self.drain_timeout, cancel)
        log.info("kvstore: drained ok=%d left=%d wait_s=%.2f", done, self.drain.in_flight, time.monotonic() - t0)


def _usage_error(message):
    """Prints one `kvstore serve: error: ...` line to stderr; returns the exit status 2."""
    print(f"kvstore serve: error: {message}", file=sys.stderr)
    return 2


def main(argv=None):
    """Runs `kvstore serve`; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = options.build_parser()
    opts, rest = parser.parse_known_args(argv)
    if opts.help:
        parser.print_help()
        print("\nmlx_lm.server options:")
        _run_mlx_lm_main(["--help"], None)
        return 0
    bad = options.check(opts)
    if bad is not None:
        if not opts.model:
            parser.print_usage(sys.stderr)
        return _usage_error(bad)
    if opts.cache_key_file is not None:
        try:
            seal.load_key(opts.cache_key_file)
        except (ValueError, OSError) as e:
            return _usage_error(f"--cache-key-file: {e}")
    if opts.warm is not None:
        try:
            opts.warm = read_file(opts.warm)            # the checked file (its model is checked once loaded)
        except ValueError as e:
            return _usage_error(f"--warm {opts.warm}: {e}")
    if hasattr(signal, "SIGUSR1"):
        # `kill -USR1 PID` writes every thread's Python stack to stderr: what
        # a server that stopped answering is waiting for (no prompt text).
        faulthandler.register(signal.SIGUSR1, all_threads=True)
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
