"""The HTTP side of kvstore serve: mlx-lm's APIHandler plus cache_salt, /metrics and draining."""

import dataclasses
import io
import json
import logging
import select
import socket

from mlx_lm import server as mlx_server

from kvstore.mlx.mlxlm import HookedAPIHandler
from kvstore import tenants
from kvstore.serve import anthropic, explain, pinning, routing
from kvstore.serve.drain import RETRY_AFTER_S
from kvstore.serve.generator import ClientGone
from kvstore.serve.ticket import Ticket
from kvstore.serve.warm import generation_arguments

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


# The paths answered with a completion: mlx-lm's, and Anthropic's (kvstore.serve.anthropic).
COMPLETION_PATHS = ("/v1/completions", "/v1/chat/completions", "/chat/completions", anthropic.PATH)
CHAT_PATH = "/v1/chat/completions"


def _route(path):
    """A request path without its query (Anthropic's clients may add ?beta=true)."""
    return path.split("?", 1)[0]


class _Handler(HookedAPIHandler):
    """mlx-lm's APIHandler with cache_salt, /metrics and draining; handler_class
    binds one server's options and parts to it."""

    kv_require_salt = False
    kv_global_system = False        # --global-system-prompt (kvstore.serve.pinning.global_system)
    kv_metrics = None
    kv_drain = None
    kv_activity = None              # kvstore.serve.activity.Activity, or None
    kv_warm = None                  # kvstore.serve.warm.Warmer (/health says where warming stands), or None
    kv_admin = None                 # kvstore.serve.admin.Admin (/v1/cache, /cache), or None: those paths 404
    _kv_streaming = False           # set once this request's stream headers are sent
    _kv_ticket = None               # this request's kvstore.serve.ticket.Ticket

    def parse_request(self):
        # A completion counts among the requests being prepared from its
        # request line on (TieredResponseGenerator.arriving): one whose body
        # is still being read or parsed when the generation thread takes
        # another that arrived with it joins that one's batch.
        ok = super().parse_request()
        if ok and self.command == "POST" and _route(self.path) in COMPLETION_PATHS:
            self._kv_ticket = Ticket()
            self.response_generator.arriving(self._kv_ticket)
        return ok

    def handle_one_request(self):
        try:
            super().handle_one_request()
        finally:
            if self._kv_ticket is not None:     # (counted off already unless it was answered before the generator)
                self.response_generator.prepared(self._kv_ticket)
                self._kv_ticket = None      # the connection's next request has its own

    def do_POST(self):
        if _route(self.path) == anthropic.PATH:
            self._messages()
        elif _route(self.path) == anthropic.COUNT_PATH:
            self._count_tokens()
        else:
            super().do_POST()

    def _count_tokens(self):
        """POST /v1/messages/count_tokens: the prompt's tokens as /v1/messages would render them."""
        try:
            chat = anthropic.to_chat(json.loads(self.rfile.read(int(self.headers.get("Content-Length", "")))),
                                     counting=True)
        except ValueError as e:             # no length, not JSON, anthropic.BadRequest
            return self._anthropic_error(400, str(e))
        generator = self.response_generator
        if generator.model_provider.tokenizer is None:
            return self._anthropic_error(503, "the model is loading; retry shortly")
        request = mlx_server.CompletionRequest("chat", "", chat["messages"], chat.get("tools"), None)
        args = dataclasses.replace(generation_arguments(generator.cli_args),
                                   chat_template_kwargs=chat.get("chat_template_kwargs"))
        try:
            n = len(generator.tokenize_request(request, args)[0])
        except Exception as e:              # noqa: BLE001 - the template refused the conversation
            return self._anthropic_error(400, f"the chat template cannot render this conversation: {e}")
        self.send_json_headers(200)
        self.end_headers()
        self.wfile.write(json.dumps({"input_tokens": n}).encode())

    def _messages(self):
        """POST /v1/messages: the body translated to the chat-completions one, answered
        by mlx-lm through an anthropic.Wire that writes Anthropic's shapes."""
        try:
            n = int(self.headers.get("Content-Length", ""))
        except ValueError:
            return self._anthropic_error(411, "the body needs a valid Content-Length header")
        try:
            body = json.loads(self.rfile.read(n))
            chat = anthropic.to_chat(body)
        except ValueError as e:             # not JSON, or anthropic.BadRequest
            return self._anthropic_error(400, str(e) if isinstance(e, anthropic.BadRequest) else f"invalid JSON: {e}")
        real, body_in = self.wfile, self.rfile
        self.wfile = anthropic.Wire(real, str(body.get("model", "")), bool(chat.get("stream")), lambda: self._kv_ticket,
                                    anthropic.origins_of(body))
        chat.update(stream=True, stream_options={"include_usage": True})
        raw = json.dumps(chat).encode()
        self.rfile, self.path = io.BytesIO(raw), CHAT_PATH
        del self.headers["Content-Length"]
        self.headers["Content-Length"] = str(len(raw))
        try:
            super().do_POST()
        finally:
            self.wfile, self.rfile = real, body_in

    def stream_goes_whole(self):
        return isinstance(self.wfile, anthropic.Wire) and not self.wfile.stream

    def _anthropic_error(self, status, message):
        self.send_json_headers(status)
        self.end_headers()
        self.wfile.write(json.dumps(anthropic.error_body(status, message)).encode())

    def handle_completion(self, request, stop_words):
        drain = self.kv_drain
        if drain.draining:
            self._error(503, "the server is shutting down; retry shortly", retry_after=RETRY_AFTER_S)
            return
        try:
            salt = tenants.check_salt(self.body.get("cache_salt"))
            if salt is None and self.kv_require_salt:
                raise ValueError("cache_salt is required by this server (--require-cache-salt)")
            chat = request.request_type == "chat"
            breakpoints = pinning.breakpoints(request.messages) if chat else []
            if chat and self.kv_global_system:
                pinning.global_system(request.messages, breakpoints)
            cache_key = routing.key_tag(self.body.get("prompt_cache_key"))
            routing.retention_pin(self.body.get("prompt_cache_retention"), request.messages if chat else None,
                                  breakpoints)
        except ValueError as e:
            self._error(400, str(e))
            return
        sock = self.connection
        ticket = self._kv_ticket = self._kv_ticket or Ticket()
        ticket.tenant, ticket.gone, ticket.pins = tenants.tag(salt), lambda: _closed(sock), breakpoints
        ticket.cache_key = cache_key
        request.kvstore_ticket = ticket
        with drain.request():
            try:
                super().handle_completion(request, stop_words)
            except (ClientGone, BrokenPipeError, ConnectionResetError):
                pass            # the client left; nothing to answer
            except RuntimeError:
                if not drain.stopping:
                    raise
                self._cut()
        self._log_trace()

    def completion_status(self, status_code):
        # mlx-lm answers whatever the generator raised with 404: a refused
        # breakpoint is the client's 400 or 409.
        error = getattr(self._kv_ticket, "error", None)
        if status_code == 404 and error is not None:
            return error.status
        return status_code

    def with_usage(self, response):
        """Adds the request's trace as usage.kvstore (OpenAI clients ignore a field they do not know)."""
        usage = response.get("usage")
        if isinstance(usage, dict) and self._kv_ticket is not None and self._kv_ticket.source is not None:
            usage["kvstore"] = self._kv_ticket.trace()
        return response

    def _log_trace(self):
        """The request log line: its trace, numbers only."""
        ticket = self._kv_ticket
        if ticket is None or ticket.source is None:
            return
        if self.kv_activity is not None:
            self.kv_activity.record(ticket)
        if self.kv_metrics is not None and ticket.cache_key is not None:
            self.kv_metrics.keyed(ticket.cache_key[:routing.TAG_DIGITS], ticket.source, ticket.reused)
        t = ticket.trace()
        log.info("kvstore: request_done source=%s reused_ram=%d reused_disk=%d reused_bucket=%d prefilled=%d "
                 "load_ms=%.1f stored=%s pins=%s miss=%s cache_key=%s", t["source"], t["reused_tokens"]["ram"],
                 t["reused_tokens"]["disk"], t["reused_tokens"]["bucket"], t["prefilled_tokens"], t["load_ms"],
                 ",".join(f"{s['kind']}:{s['tokens']}" for s in t["stored"]) or "-",
                 ",".join(f"{p['tokens']}:{p['state']}" for p in t.get("pins", ())) or "-",
                 explain.log_words(ticket.miss), t.get("cache_key", "-"))

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
        if self.kv_admin is not None and self.kv_admin.handles("GET", self.path):
            self.kv_admin.serve(self)
        elif self.path == "/metrics" or self.path.startswith("/metrics?"):
            self._metrics()
        elif self.path == "/health" and self.kv_drain.draining:
            self._error(503, "draining", retry_after=RETRY_AFTER_S, key="status")
        elif self.path == "/health" and self._kv_loading():
            self._error(503, "loading", retry_after=RETRY_AFTER_S, key="status")
        elif self.path == "/health" and self.kv_warm is not None and self.response_generator.is_healthy:
            self.send_json_headers(200)
            self.end_headers()
            self.wfile.write(json.dumps({"status": "ok", "warm": self.kv_warm.status()}).encode())
        else:
            super().do_GET()

    def do_DELETE(self):
        if self.kv_admin is not None and self.kv_admin.handles("DELETE", self.path):
            self.kv_admin.serve(self)
        else:                           # what mlx-lm answers a path it does not know
            self.send_json_headers(404)
            self.end_headers()
            self.wfile.write(b"Not Found")

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

    def _kv_loading(self):
        """True while the generation thread loads the model and opens its
        store: /health answers 503 "loading" until a request can be served
        from the store (mlx-lm's own /health says ok as soon as it listens)."""
        generator = self.response_generator
        return generator.generation_available() and not generator.tier.ready.is_set()

    def _error(self, status, message, retry_after=None, key="error"):
        self.send_json_headers(status)
        if retry_after is not None:
            self.send_header("Retry-After", str(retry_after))
        self.end_headers()
        self.wfile.write(json.dumps({key: message}).encode())


def handler_class(require_salt, metrics, drain, activity=None, warm=None, admin=None, global_system=False):
    """An APIHandler subclass for one server.

    Args:
        require_salt: refuse completions without a cache_salt (400).
        metrics: the server's Metrics (GET /metrics), or None.
        drain: the server's kvstore.serve.drain.Drain.
        activity: the server's kvstore.serve.activity.Activity (each
            finished completion is recorded there), or None.
        warm: the server's kvstore.serve.warm.Warmer (GET /health adds
            its status() as "warm"), or None.
        admin: the server's kvstore.serve.admin.Admin (GET and DELETE
            /v1/cache, GET /cache), or None (those paths answer 404).
        global_system: every system message's breakpoint is global
            (--global-system-prompt).
    """

    class Handler(_Handler):
        kv_require_salt = require_salt
        kv_metrics = metrics
        kv_drain = drain
        kv_activity = activity
        kv_warm = warm
        kv_admin = admin
        kv_global_system = global_system

    return Handler
