"""An Anthropic Messages answer, built from the chat-completion chunks mlx-lm makes.

mlx-lm answers the translated request (kvstore.serve.anthropic.request) as a
stream of chat-completion chunks: text, reasoning and tool calls, a finish
reason, then a usage chunk.  A Reply turns them into Anthropic's answer:
content blocks (thinking, text, tool_use) and, streaming, the event sequence

    message_start, then per block content_block_start, its deltas
    (thinking_delta, text_delta, input_json_delta), content_block_stop,
    then message_delta (stop_reason, usage) and message_stop;

not streaming, one message object.  Usage follows Anthropic's split of the
prompt: cache_read_input_tokens (the tokens reused from RAM, disk or the
bucket), cache_creation_input_tokens (those this request stored beyond
them, split per pin lifetime in cache_creation) and input_tokens (the rest:
prefilled and not stored), which add up to the prompt.  kvstore's own trace
rides along as usage.kvstore.
"""

import json
import uuid

# mlx-lm's finish reasons as Anthropic's stop reasons.
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}

# A pin of at least this lifetime counts as Anthropic's "1h" cache creation;
# every other stored token as "5m" (an unpinned checkpoint lives until the
# budget evicts it, which the two names cannot say).
ONE_HOUR_S = 3600
# The states of a pin this request stored or is storing (kvstore.serve.pinning.PinRequest).
LIVE_PIN_STATES = ("queued", "storing", "pinned")


def usage_of(prompt_tokens, trace, pins=()):
    """The Anthropic usage of a prompt: input, cache read and cache creation tokens.

    Args:
        prompt_tokens: the prompt's length in tokens.
        trace: the request's kvstore trace (kvstore.serve.ticket.Ticket.trace()).
        pins: its PinRequests (kvstore.serve.pinning), for the per-lifetime split.
    """
    read = sum(trace["reused_tokens"].values())
    stored = max([s["tokens"] for s in trace["stored"] if s["tokens"] <= prompt_tokens] + [read])
    long_pins = [min(p.tokens, stored) for p in pins if p.ttl_s >= ONE_HOUR_S and p.state in LIVE_PIN_STATES]
    one_hour = max(0, max(long_pins, default=read) - read)
    created = stored - read
    return {"input_tokens": prompt_tokens - read - created, "cache_creation_input_tokens": created,
            "cache_read_input_tokens": read,
            "cache_creation": {"ephemeral_5m_input_tokens": created - one_hour, "ephemeral_1h_input_tokens": one_hour}}


class Reply:
    """One answer's content blocks and events; feed it chunk() per chat chunk.

    Args:
        model: the model name the request gave.
        stream: True: chunk() and finish() return events to send; False:
            finish() returns the message object.
    """

    def __init__(self, model, stream):
        self.id = f"msg_{uuid.uuid4().hex}"
        self.model, self.stream = model, stream
        self.blocks = []            # the content blocks so far
        self._open = None           # the kind of the block being streamed, or None
        self.stop_reason = None
        self.usage = None

    def start(self, usage):
        """The message_start event, with the prompt's usage (output_tokens 0)."""
        self.usage = dict(usage, output_tokens=0)
        message = {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
                   "stop_reason": None, "stop_sequence": None, "usage": self.usage}
        return [("message_start", {"type": "message_start", "message": message})]

    def chunk(self, delta, finish_reason):
        """The events of one chat chunk's delta (reasoning, content, tool_calls) and finish reason."""
        events = []
        if delta.get("reasoning"):
            events += self._text("thinking", delta["reasoning"])
        if delta.get("content"):
            events += self._text("text", delta["content"])
        for call in delta.get("tool_calls") or ():
            events += self._tool(call)
        if finish_reason is not None:
            self.stop_reason = STOP_REASONS.get(finish_reason, "end_turn")
        return events

    def finish(self, output_tokens, usage=None):
        """The closing events (streaming) or the whole message (not streaming)."""
        self.usage = dict(usage or self.usage or {}, output_tokens=output_tokens)
        if not self.stream:
            content = [_final(b) for b in self.blocks]
            return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                    "content": content, "stop_reason": self.stop_reason or "end_turn", "stop_sequence": None,
                    "usage": self.usage}
        return self._close() + [
            ("message_delta", {"type": "message_delta",
                               "delta": {"stop_reason": self.stop_reason or "end_turn", "stop_sequence": None},
                               "usage": self.usage}),
            ("message_stop", {"type": "message_stop"})]

    def _close(self):
        if self._open is None:
            return []
        self._open = None
        return [("content_block_stop", {"type": "content_block_stop", "index": len(self.blocks) - 1})]

    def _begin(self, block):
        events = self._close()
        self.blocks.append(block)
        self._open = block["type"]
        shown = dict(block, input={}) if block["type"] == "tool_use" else dict(block)
        return events + [("content_block_start", {"type": "content_block_start", "index": len(self.blocks) - 1,
                                                  "content_block": shown})]

    def _text(self, kind, text):
        events = []
        if self._open != kind:
            events = self._begin({"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking"
                                 else {"type": "text", "text": ""})
        self.blocks[-1][kind] += text
        delta = {"type": "thinking_delta", "thinking": text} if kind == "thinking" else \
            {"type": "text_delta", "text": text}
        return events + [("content_block_delta", {"type": "content_block_delta", "index": len(self.blocks) - 1,
                                                  "delta": delta})]

    def _tool(self, call):
        function = call.get("function") or {}
        arguments = function.get("arguments") or "{}"
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments)
        events = self._begin({"type": "tool_use", "id": call.get("id") or f"toolu_{uuid.uuid4().hex[:24]}",
                              "name": function.get("name", ""), "input": arguments})
        events.append(("content_block_delta", {"type": "content_block_delta", "index": len(self.blocks) - 1,
                                               "delta": {"type": "input_json_delta", "partial_json": arguments}}))
        return events + self._close()


def _final(block):
    """A block as the whole message holds it (a tool_use's input parsed)."""
    if block["type"] != "tool_use":
        return block
    try:
        value = json.loads(block["input"])
    except ValueError:
        value = {}
    return dict(block, input=value if isinstance(value, dict) else {})


def sse(events):
    """The bytes of (name, data) events on an event stream."""
    return b"".join(f"event: {name}\ndata: {json.dumps(data)}\n\n".encode() for name, data in events)
