"""The connection a /v1/messages answer goes out on: mlx-lm's writes, in Anthropic's shapes.

mlx-lm's handler writes its answer to `wfile` in whole pieces: the header
block, then per chunk one `data: {...}` event, `: keepalive` comments while
it prefills, `data: [DONE]`; or, for an error, a status and a JSON
`{"error": "..."}`.  A Wire stands in for `wfile` while a /v1/messages request
is answered and rewrites each piece: chunks go through a Reply
(kvstore.serve.anthropic.reply), errors become Anthropic's error object
`{"type": "error", "error": {"type": ..., "message": ...}}`.  The request is
always generated streaming; a client that did not ask for a stream gets the
one message object when the stream ends.
"""

import json

from kvstore.serve.anthropic.reply import Reply, sse, usage_of

# HTTP statuses as Anthropic's error types (any other 4xx: invalid_request_error).
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
               503: "overloaded_error", 529: "overloaded_error"}


def error_body(status, message):
    """Anthropic's error object for an HTTP status and a message."""
    kind = ERROR_TYPES.get(status, "invalid_request_error" if 400 <= status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


class Wire:
    """A handler's wfile while it answers one /v1/messages request.

    Args:
        out: the connection's real wfile.
        model: the model name of the request.
        stream: whether the client asked for a stream.
        ticket: callable returning the request's kvstore Ticket, or None.
        origins: where each chat message came from in the request's body
            (request.origins_of): a miss names it as request_message.
    """

    def __init__(self, out, model, stream, ticket, origins=()):
        self.out, self.stream, self.ticket, self.origins = out, stream, ticket, list(origins)
        self.reply = Reply(model, stream)
        self.status = None
        self.started = False
        self.output_tokens = 0
        self.final_usage = None

    @property
    def closed(self):
        return self.out.closed

    def flush(self):
        self.out.flush()

    def write(self, data):
        data = bytes(data)
        if data.startswith(b"HTTP/"):
            self.status = int(data.split(b" ", 2)[1])
            self.out.write(data)
        elif self.status is not None and self.status >= 400:
            self.out.write(self._error(data))
        elif data.startswith(b"data: "):
            self._event(data[6:].strip())
        elif data.startswith(b":"):         # a keepalive while the prompt prefills
            if self.stream:
                self.out.write(sse(self._start() + [("ping", {"type": "ping"})]) if self._served() else data)
        else:
            self.out.write(data)
        return len(data)

    def _error(self, data):
        try:
            message = json.loads(data).get("error")
        except (ValueError, AttributeError):
            message = None
        if not isinstance(message, str):
            message = data.decode("utf-8", "replace").strip() or "error"
        return json.dumps(error_body(self.status, message)).encode()

    def _event(self, payload):
        if payload == b"[DONE]":
            self._finish()
            return
        obj = json.loads(payload)
        if "error" in obj:                       # the stream was cut (kvstore.serve.http.STOPPED_EVENT)
            error = obj["error"]
            body = error_body(503, error.get("message", "error") if isinstance(error, dict) else str(error))
            self.out.write(sse([("error", body)]) if self.stream else json.dumps(body).encode())
            return
        usage = obj.get("usage")
        if usage is not None:
            self.output_tokens = usage.get("completion_tokens", 0)
            self.final_usage = self._usage(usage.get("prompt_tokens", 0), usage.get("kvstore"))
        for choice in obj.get("choices") or ():
            events = self._start() + self.reply.chunk(choice.get("delta") or {}, choice.get("finish_reason"))
            if self.stream:
                self.out.write(sse(events))

    def _served(self):
        ticket = self.ticket()
        return ticket is not None and ticket.source is not None

    def _start(self):
        if self.started:
            return []
        self.started = True
        ticket = self.ticket()
        prompt = ticket.reused + ticket.prefilled if self._served() else 0
        return self.reply.start(self._usage(prompt, None))

    def _usage(self, prompt_tokens, trace):
        ticket, served = self.ticket(), self._served()
        if trace is None:
            trace = ticket.trace() if served else {"reused_tokens": {}, "stored": []}
        usage = usage_of(prompt_tokens, trace, ticket.pins if served else ())
        if served:
            usage["kvstore"] = trace
            miss = trace.get("miss")
            if miss is not None and miss.get("message") is not None and miss["message"] < len(self.origins):
                # The chat message index, and where the request's body holds that message.
                trace["miss"] = dict(miss, request_message=self.origins[miss["message"]])
        return usage

    def _finish(self):
        start = self._start()
        end = self.reply.finish(self.output_tokens, self.final_usage)
        if self.stream:
            self.out.write(sse(start + end))
        else:
            self.out.write(json.dumps(end).encode())
