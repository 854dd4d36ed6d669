"""An Anthropic Messages request as the chat-completions body mlx-lm serves.

One rendering path: `POST /v1/messages` is turned into the body of `POST
/v1/chat/completions` that carries the same conversation, and mlx-lm renders
that through the model's chat template.  A conversation sent through either
door therefore renders to the same prompt bytes and shares one cache.

The mapping (the chat side is what OpenAI clients send for the same turns):

    system (a string or text blocks)    -> a first {"role": "system"} message
    text blocks                         -> content parts {"type": "text"}
    image blocks (base64 or url)        -> content parts {"type": "image_url"}
    an assistant's tool_use blocks      -> its "tool_calls" (arguments: the input object)
    an assistant's thinking blocks      -> its "reasoning_content"
    a user's tool_result blocks         -> {"role": "tool", "tool_call_id"} messages,
                                           before the rest of that user turn
    tools [{name, description, input_schema}] -> [{"type": "function", "function": {...}}]
    stop_sequences, max_tokens, temperature, top_p, top_k -> the chat fields (and mlx-lm's
                                           own: min_p, seed, logit_bias, repetition_penalty)
    thinking {"type": ...}              -> chat_template_kwargs enable_thinking (false for "disabled")
    cache_control at the top level      -> a breakpoint on the last message
    model                               -> the server's model (the answer names the one asked for)

`cache_control` stays where pinning (kvstore.serve.pinning) reads it: on the
message, or on the content part, it came with.  One on a tool definition
pins the prefix that ends with the first message (chat templates render the
tools in or before it).  Every request error is a BadRequest naming the
field, answered as Anthropic's invalid_request_error.
"""

import json

# Anthropic's content block types kvstore renders; redacted_thinking is
# dropped (its content is opaque to any template).
_USER_BLOCKS = ("text", "image", "tool_result")
_ASSISTANT_BLOCKS = ("text", "thinking", "redacted_thinking", "tool_use")

# Fields with the same meaning on both doors: Anthropic's sampling, kvstore's
# own, and mlx-lm's sampling extensions (a client's extra body fields).
_SAME_FIELDS = ("temperature", "top_p", "top_k", "stream", "cache_salt", "prompt_cache_key",
                "prompt_cache_retention", "min_p", "seed", "logit_bias", "repetition_penalty",
                "repetition_context_size")


class BadRequest(ValueError):
    """A /v1/messages body kvstore cannot serve; the message names the field."""


def _short(value):
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _need(cond, where, what):
    if not cond:
        raise BadRequest(f"{where}: {what}")


def _blocks(content, where, allowed):
    """A message's content as a list of blocks (a string is one text block)."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    _need(isinstance(content, list), where, f"content must be a string or a list of blocks, not {_short(content)}")
    for i, b in enumerate(content):
        _need(isinstance(b, dict) and b.get("type") in allowed, f"{where}[{i}]",
              f"block type {_short(b.get('type') if isinstance(b, dict) else b)} is not one of {', '.join(allowed)}")
    return content


def _with_control(part, block):
    if "cache_control" in block:
        part["cache_control"] = block["cache_control"]
    return part


def _text_part(block, where):
    _need(isinstance(block.get("text"), str), where, "a text block needs a string \"text\"")
    return _with_control({"type": "text", "text": block["text"]}, block)


def _image_part(block, where):
    source = block.get("source")
    _need(isinstance(source, dict), where, "an image block needs a \"source\" object")
    if source.get("type") == "base64":
        url = f"data:{source.get('media_type', 'image/png')};base64,{source.get('data', '')}"
    elif source.get("type") == "url" and isinstance(source.get("url"), str):
        url = source["url"]
    else:
        raise BadRequest(f"{where}: image source type {_short(source.get('type'))} is not base64 or url")
    return _with_control({"type": "image_url", "image_url": {"url": url}}, block)


def _result_text(block, where):
    content = block.get("content", "")
    if isinstance(content, str):
        return content
    parts = _blocks(content, f"{where}.content", ("text",))
    return "".join(_text_part(p, f"{where}.content[{i}]")["text"] for i, p in enumerate(parts))


def _user_messages(content, where):
    """A user turn: its tool results as tool messages, then the rest as one user message."""
    out, parts = [], []
    for i, b in enumerate(_blocks(content, f"{where}.content", _USER_BLOCKS)):
        at = f"{where}.content[{i}]"
        if b["type"] == "tool_result":
            _need(isinstance(b.get("tool_use_id"), str), at, "a tool_result block needs a string \"tool_use_id\"")
            out.append(_with_control({"role": "tool", "tool_call_id": b["tool_use_id"],
                                      "content": _result_text(b, at)}, b))
        else:
            parts.append(_text_part(b, at) if b["type"] == "text" else _image_part(b, at))
    if parts or not out:
        out.append({"role": "user", "content": parts})
    return out


def _assistant_message(content, where):
    parts, thinking, calls, control = [], [], [], None
    for i, b in enumerate(_blocks(content, f"{where}.content", _ASSISTANT_BLOCKS)):
        at = f"{where}.content[{i}]"
        if b["type"] == "text":
            parts.append(_text_part(b, at))
        elif b["type"] == "thinking":
            _need(isinstance(b.get("thinking"), str), at, "a thinking block needs a string \"thinking\"")
            thinking.append(b["thinking"])
        elif b["type"] == "tool_use":
            _need(isinstance(b.get("id"), str) and isinstance(b.get("name"), str), at,
                  "a tool_use block needs string \"id\" and \"name\"")
            _need(isinstance(b.get("input", {}), dict), at, "a tool_use block's \"input\" must be an object")
            calls.append({"id": b["id"], "type": "function",
                          "function": {"name": b["name"], "arguments": b.get("input", {})}})
        if b["type"] != "text":
            control = b.get("cache_control", control)
    message = {"role": "assistant", "content": parts}
    if thinking:
        message["reasoning_content"] = "".join(thinking)
    if calls:
        message["tool_calls"] = calls
    if control is not None and not any("cache_control" in p for p in parts):
        message["cache_control"] = control          # it came on a thinking or tool_use block
    return message


def _system(system):
    if system is None:
        return []
    parts = _blocks(system, "system", ("text",))
    return [{"role": "system", "content": [_text_part(p, f"system[{i}]") for i, p in enumerate(parts)]}]


def _messages(body):
    """(the chat messages, where each came from in the body: "system" or "messages[i]")."""
    messages = body.get("messages")
    _need(isinstance(messages, list) and messages, "messages", "must be a non-empty list")
    out = _system(body.get("system"))
    origins = ["system"] * len(out)
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        _need(isinstance(m, dict) and m.get("role") in ("user", "assistant"), where,
              "each message needs a role of \"user\" or \"assistant\"")
        _need("content" in m, where, "a message needs \"content\"")
        made = _user_messages(m["content"], where) if m["role"] == "user" else \
            [_assistant_message(m["content"], where)]
        out += made
        origins += [where] * len(made)
    return out, origins


def origins_of(body):
    """Where each chat message of to_chat(body) came from: "system" or "messages[i]"
    (a user turn with tool results becomes several chat messages)."""
    return _messages(body)[1]


def _tools(tools):
    _need(isinstance(tools, list), "tools", "must be a list")
    out, control = [], None
    for i, t in enumerate(tools):
        _need(isinstance(t, dict) and isinstance(t.get("name"), str), f"tools[{i}]", "a tool needs a string \"name\"")
        function = {"name": t["name"], "parameters": t.get("input_schema", {"type": "object"})}
        if "description" in t:
            function["description"] = t["description"]
        out.append({"type": "function", "function": function})
        control = t.get("cache_control", control)
    return out, control


# Anthropic's thinking types: every one but "disabled" lets the model think.
THINKING_TYPES = ("enabled", "adaptive", "between_tools", "disabled")


def _thinking(value):
    _need(isinstance(value, dict) and value.get("type") in THINKING_TYPES, "thinking",
          f"must be {{\"type\": ...}} with a type of {', '.join(THINKING_TYPES)}, not {_short(value)}")
    return {"enable_thinking": value["type"] != "disabled"}


def to_chat(body, counting=False):
    """The chat-completions body of a /v1/messages body (module docstring);
    counting: a /v1/messages/count_tokens body (no max_tokens).

    Raises:
        BadRequest: a message naming the field that is missing or malformed.
    """
    _need(isinstance(body, dict), "body", "must be a JSON object")
    max_tokens = body.get("max_tokens", 1 if counting else None)
    _need(isinstance(max_tokens, int) and not isinstance(max_tokens, bool) and max_tokens >= 1, "max_tokens",
          f"must be an integer >= 1, not {_short(max_tokens)}")
    # The server's own model, whatever `model` names: Anthropic's clients
    # send their own model ids, which mlx-lm would try to fetch.
    chat = {"model": "default_model", "messages": _messages(body)[0], "max_tokens": max_tokens}
    chat.update({k: body[k] for k in _SAME_FIELDS if k in body})
    stops = body.get("stop_sequences")
    if stops is not None:
        _need(isinstance(stops, list) and all(isinstance(s, str) for s in stops), "stop_sequences",
              "must be a list of strings")
        chat["stop"] = stops
    if body.get("tools"):
        chat["tools"], control = _tools(body["tools"])
        if control is not None and not _has_control(chat["messages"][0]):
            chat["messages"][0]["cache_control"] = control
    if body.get("cache_control") is not None and not _has_control(chat["messages"][-1]):
        # Top-level cache_control: a breakpoint on the last message.
        chat["messages"][-1]["cache_control"] = body["cache_control"]
    if body.get("thinking") is not None:
        chat["chat_template_kwargs"] = _thinking(body["thinking"])
    return chat


def _has_control(message):
    parts = message.get("content")
    return "cache_control" in message or (isinstance(parts, list) and any("cache_control" in p for p in parts))
