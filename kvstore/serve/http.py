"""The HTTP side of kvstore serve: mlx-lm's APIHandler plus cache_salt, /metrics and draining."""

import json
import logging
import select
import socket

from kvstore.mlx.mlxlm import HookedAPIHandler
from kvstore.serve import tenants
from kvstore.serve.drain import RETRY_AFTER_S
from kvstore.serve.generator import ClientGone
from kvstore.serve.tier import Ticket

log = logging.getLogger("kvstore")

# What a stream that the server had to cut ends with: an OpenAI-style error
# event, which the OpenAI clients raise, instead of a silent end that would
# pass for a whole answer.
STOPPED_EVENT = {"error": {"message": "the server stopped before the answer was complete",
                           "type": "server_error", "code": "server_shutting_down"}}


def _closed(sock):
    """True when the peer has closed the connection (its request body is read already)."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
        if not readable:
            return False
        return sock.recv(1, socket.MSG_PEEK) == b""
    except (OSError, ValueError):
        return True


class _Handler(HookedAPIHandler):
    """mlx-lm's APIHandler with cache_salt, /metrics and draining; handler_class
    binds one server's options and parts to it."""

    kv_require_salt = False
    kv_metrics = None
    kv_drain = None
    _kv_streaming = False           # set once this request's stream headers are sent

    def handle_completion(self, request, stop_words):
        drain = self.kv_drain
        if drain.draining:
            self._error(503, "the server is shutting down; retry shortly", retry_after=RETRY_AFTER_S)
            return
        try:
            salt = tenants.check_salt(self.body.get("cache_salt"))
            if salt is None and self.kv_require_salt:
                raise ValueError("cache_salt is required by this server (--require-cache-salt)")
        except ValueError as e:
            self._error(400, str(e))
            return
        sock = self.connection
        request.kvstore_ticket = Ticket(tenant=tenants.tag(salt), gone=lambda: _closed(sock))
        with drain.request():
            try:
                super().handle_completion(request, stop_words)
            except (ClientGone, BrokenPipeError, ConnectionResetError):
                pass            # the client left; nothing to answer
            except RuntimeError:
                if not drain.stopping:
                    raise
                self._cut()

    def on_stream_headers(self, status_code):
        self._kv_streaming = status_code == 200

    def _cut(self):
        """The generation thread stopped under this request (the drain timed out)."""
        log.warning("kvstore: request_cut reason=shutdown stream=%d", self._kv_streaming)
        try:
            if self._kv_streaming:
                self.wfile.write(f"data: {json.dumps(STOPPED_EVENT)}\n\n".encode())
                self.wfile.flush()
        except OSError:
            pass
        self.close_connection = True

    def do_GET(self):
        if self.path == "/metrics" or self.path.startswith("/metrics?"):
            self._metrics()
        elif self.path == "/health" and self.kv_drain.draining:
            self._error(503, "draining", retry_after=RETRY_AFTER_S, key="status")
        else:
            super().do_GET()

    def _metrics(self):
        if self.kv_metrics is None:
            self._error(503, "metrics need prometheus_client: pip install 'kvstore[serve]'")
            return
        body, content_type = self.kv_metrics.exposition()
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _error(self, status, message, retry_after=None, key="error"):
        self.send_json_headers(status)
        if retry_after is not None:
            self.send_header("Retry-After", str(retry_after))
        self.end_headers()
        self.wfile.write(json.dumps({key: message}).encode())


def handler_class(require_salt, metrics, drain):
    """An APIHandler subclass for one server.

    Args:
        require_salt: refuse completions without a cache_salt (400).
        metrics: the server's Metrics (GET /metrics), or None.
        drain: the server's kvstore.serve.drain.Drain.
    """

    class Handler(_Handler):
        kv_require_salt = require_salt
        kv_metrics = metrics
        kv_drain = drain

    return Handler
