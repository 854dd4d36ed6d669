"""The HTTP side of kvstore serve: mlx-lm's APIHandler plus cache_salt and /metrics."""

import json
import select
import socket

from mlx_lm import server as mlx_server

from kvstore.serve import tenants
from kvstore.serve.generator import ClientGone
from kvstore.serve.tier import Ticket


def _closed(sock):
    """True when the peer has closed the connection (its request body is read already)."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
        if not readable:
            return False
        return sock.recv(1, socket.MSG_PEEK) == b""
    except (OSError, ValueError):
        return True


def handler_class(require_salt, metrics):
    """An APIHandler subclass for one server.

    Args:
        require_salt: refuse completions without a cache_salt (400).
        metrics: the server's Metrics (GET /metrics), or None.
    """

    class Handler(mlx_server.APIHandler):

        def handle_completion(self, request, stop_words):
            try:
                salt = tenants.check_salt(self.body.get("cache_salt"))
                if salt is None and require_salt:
                    raise ValueError("cache_salt is required by this server (--require-cache-salt)")
            except ValueError as e:
                self._error(400, str(e))
                return
            sock = self.connection
            request.kvstore_ticket = Ticket(tenant=tenants.tag(salt), gone=lambda: _closed(sock))
            try:
                super().handle_completion(request, stop_words)
            except (ClientGone, BrokenPipeError, ConnectionResetError):
                pass            # the client left; nothing to answer

        def do_GET(self):
            if self.path == "/metrics" or self.path.startswith("/metrics?"):
                self._metrics()
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

        def _error(self, status, message):
            self._set_completion_headers(status)
            self.end_headers()
            self.wfile.write(json.dumps({"error": message}).encode())

    return Handler
