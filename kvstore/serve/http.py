"""The HTTP side of kvstore serve: mlx-lm's APIHandler plus cache_salt, /metrics and draining."""

import json
import logging
import select
import socket

from mlx_lm import server as mlx_server

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


def handler_class(require_salt, metrics, drain):
    """An APIHandler subclass for one server.

    Args:
        require_salt: refuse completions without a cache_salt (400).
        metrics: the server's Metrics (GET /metrics), or None.
        drain: the server's kvstore.serve.drain.Drain.
    """

    class Handler(mlx_server.APIHandler):

        def handle_completion(self, request, stop_words):
            if drain.draining:
                self._error(503, "the server is shutting down; retry shortly", retry_after=RETRY_AFTER_S)
                return
            try:
                salt = tenants.check_salt(self.body.get("cache_salt"))
                if salt is None and require_salt:
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

        def _set_stream_headers(self, status_code=200):
            self._kv_streaming = status_code == 200
            super()._set_stream_headers(status_code)

        def _cut(self):
            """The generation thread stopped under this request (the drain timed out)."""
            log.warning("kvstore: request_cut reason=shutdown stream=%d", bool(getattr(self, "_kv_streaming", 0)))
            try:
                if getattr(self, "_kv_streaming", False):
                    self.wfile.write(f"data: {json.dumps(STOPPED_EVENT)}\n\n".encode())
                    self.wfile.flush()
            except OSError:
                pass
            self.close_connection = True

        def do_GET(self):
            if self.path == "/metrics" or self.path.startswith("/metrics?"):
                self._metrics()
            elif self.path == "/health" and drain.draining:
                self._error(503, "draining", retry_after=RETRY_AFTER_S, key="status")
            else:
                super().do_GET()

        def _metrics(self):
            if metrics is None:
                self._error(503, "metrics need prometheus_client: pip install 'kvstore[serve]'")
                return
            body, content_type = metrics.exposition()
            self.send_response(200)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _error(self, status, message, retry_after=None, key="error"):
            self._set_completion_headers(status)
            if retry_after is not None:
                self.send_header("Retry-After", str(retry_after))
            self.end_headers()
            self.wfile.write(json.dumps({key: message}).encode())

    return Handler
