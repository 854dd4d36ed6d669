"""Agents' front doors on kvstore serve: POST /v1/messages with the `anthropic`
SDK as the client, the same conversation through /v1/chat/completions with
the `openai` SDK, and the miss explained (usage.kvstore.miss, `kvstore explain`).

The server's model directory has a chat template that renders tools, tool
calls, tool results and reasoning (kvstore.demo.model.TOOL_CHAT_TEMPLATE), so the same conversation
sent through /v1/messages and through /v1/chat/completions (with the
`openai` SDK) can be checked to render to the same prompt.
"""

import glob
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

anthropic = pytest.importorskip("anthropic")
try:                        # the HTTP package the SDK is built on (httpx2 from anthropic 2.x on)
    import httpx2 as httpx
except ImportError:
    httpx = pytest.importorskip("httpx")
pytest.importorskip("mlx_lm")

from mlx_lm.server import ToolCallFormatter

from kvstore.pins import read_pins
from kvstore.serve.anthropic import BadRequest, Reply, origins_of, to_chat, usage_of
from kvstore.serve.anthropic.reply import sse
from kvstore.serve.pinning import PinRequest
from kvhelpers import kvstore_server, system_prompt

SYSTEM = system_prompt()

TOOLS = [{"name": "read_file", "description": "Reads a file of the project.",
          "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}]


# ---- the request as the chat body ------------------------------------------------------------

def test_a_tool_loop_turns_into_the_chat_messages_an_openai_client_sends():
    chat = to_chat({
        "model": "claude-x", "max_tokens": 9, "tools": TOOLS, "stop_sequences": ["END"],
        "system": [{"type": "text", "text": "S", "cache_control": {"type": "ephemeral", "ttl": "1h"}}],
        "messages": [
            {"role": "user", "content": "read it"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "I should look.", "signature": "sig"},
                {"type": "text", "text": "Reading."},
                {"type": "tool_use", "id": "toolu_1", "name": "read_file", "input": {"path": "a.py"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "x = 1"}],
                 "cache_control": {"type": "ephemeral"}},
                {"type": "text", "text": "and now?"}]}]})
    assert chat["model"] == "default_model" and chat["max_tokens"] == 9 and chat["stop"] == ["END"]
    assert chat["tools"] == [{"type": "function", "function": {
        "name": "read_file", "parameters": TOOLS[0]["input_schema"], "description": "Reads a file of the project."}}]
    assert chat["messages"] == [
        {"role": "system", "content": [{"type": "text", "text": "S",
                                        "cache_control": {"type": "ephemeral", "ttl": "1h"}}]},
        {"role": "user", "content": [{"type": "text", "text": "read it"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Reading."}], "reasoning_content": "I should look.",
         "tool_calls": [{"id": "toolu_1", "type": "function",
                         "function": {"name": "read_file", "arguments": {"path": "a.py"}}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "x = 1", "cache_control": {"type": "ephemeral"}},
        {"role": "user", "content": [{"type": "text", "text": "and now?"}]}]


def test_each_chat_message_names_where_the_body_held_it():
    body = {"max_tokens": 1, "system": "S", "messages": [
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "n", "input": {}},
                                          {"type": "tool_use", "id": "t2", "name": "n", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "a"},
                                     {"type": "tool_result", "tool_use_id": "t2", "content": "b"},
                                     {"type": "text", "text": "next"}]}]}
    assert origins_of(body) == ["system", "messages[0]", "messages[1]", "messages[2]", "messages[2]",
                                "messages[2]"]
    assert len(origins_of(body)) == len(to_chat(body)["messages"])


def test_top_level_and_tool_cache_control_become_breakpoints():
    chat = to_chat({"max_tokens": 1, "cache_control": {"type": "ephemeral"},
                    "tools": [dict(TOOLS[0], cache_control={"type": "ephemeral", "ttl": "1h"})],
                    "system": "S", "messages": [{"role": "user", "content": "u"}]})
    assert chat["messages"][0]["cache_control"] == {"type": "ephemeral", "ttl": "1h"}
    assert chat["messages"][-1]["cache_control"] == {"type": "ephemeral"}
    assert to_chat({"max_tokens": 1, "thinking": {"type": "enabled", "budget_tokens": 9},
                    "messages": [{"role": "user", "content": "u"}]})["chat_template_kwargs"] == {"enable_thinking": True}


@pytest.mark.parametrize("body, where", [
    ({"messages": [{"role": "user", "content": "u"}]}, "max_tokens"),
    ({"max_tokens": 1, "messages": []}, "messages"),
    ({"max_tokens": 1, "messages": [{"role": "system", "content": "u"}]}, "messages[0]"),
    ({"max_tokens": 1, "messages": [{"role": "user", "content": [{"type": "video"}]}]}, "messages[0].content[0]"),
    ({"max_tokens": 1, "messages": [{"role": "user", "content": [{"type": "tool_result"}]}]},
     "messages[0].content[0]"),
    ({"max_tokens": 1, "messages": [{"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "n", "input": [1]}]}]}, "messages[0].content[0]"),
    ({"max_tokens": 1, "stop_sequences": "END", "messages": [{"role": "user", "content": "u"}]}, "stop_sequences"),
    ({"max_tokens": 1, "thinking": {"type": "maybe"}, "messages": [{"role": "user", "content": "u"}]}, "thinking"),
])
def test_a_malformed_request_names_its_field(body, where):
    with pytest.raises(BadRequest) as e:
        to_chat(body)
    assert str(e.value).startswith(where + ":"), str(e.value)


# ---- the answer's events, parsed by the SDK -----------------------------------------------------

def _chunks():
    """mlx-lm's chat chunks of an answer that thinks, says something and calls a tool."""
    calls = ToolCallFormatter(lambda text, tools: json.loads(text), None, streaming=True)(
        ['{"name": "read_file", "arguments": {"path": "a.py"}}'])
    return [({"role": "assistant", "reasoning": "Let me "}, None), ({"reasoning": "look."}, None),
            ({"content": "Reading "}, None), ({"content": "it."}, None), ({"tool_calls": calls}, "tool_calls")]


def _sdk_over(body, content_type):
    transport = httpx.MockTransport(lambda request: httpx.Response(200, content=body,
                                                                   headers={"content-type": content_type}))
    return anthropic.Anthropic(base_url="http://test", api_key="x", http_client=httpx.Client(transport=transport))


USAGE = usage_of(100, {"reused_tokens": {"ram": 0, "disk": 60, "bucket": 0}, "stored": [{"kind": "anchor",
                                                                                        "tokens": 96}]})


def test_a_streamed_reply_is_the_event_sequence_the_sdk_assembles():
    reply = Reply("claude-x", stream=True)
    events = reply.start(USAGE)
    for delta, finish in _chunks():
        events += reply.chunk(delta, finish)
    events += reply.finish(7)
    names = [n for n, _ in events]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    assert names.count("content_block_start") == names.count("content_block_stop") == 3
    client = _sdk_over(sse(events), "text/event-stream")
    with client.messages.stream(model="claude-x", max_tokens=9, messages=[{"role": "user", "content": "u"}]) as s:
        message = s.get_final_message()
    assert [b.type for b in message.content] == ["thinking", "text", "tool_use"]
    assert message.content[0].thinking == "Let me look." and message.content[1].text == "Reading it."
    assert message.content[2].name == "read_file" and message.content[2].input == {"path": "a.py"}
    assert message.stop_reason == "tool_use" and message.usage.output_tokens == 7
    assert message.usage.cache_read_input_tokens == 60 and message.usage.cache_creation_input_tokens == 36


def test_a_whole_reply_is_the_message_the_sdk_parses():
    reply = Reply("claude-x", stream=False)
    reply.start(USAGE)
    for delta, finish in _chunks():
        reply.chunk(delta, finish)
    client = _sdk_over(json.dumps(reply.finish(7)).encode(), "application/json")
    message = client.messages.create(model="claude-x", max_tokens=9, messages=[{"role": "user", "content": "u"}])
    assert [b.type for b in message.content] == ["thinking", "text", "tool_use"]
    assert message.content[2].input == {"path": "a.py"} and message.stop_reason == "tool_use"


def test_usage_splits_the_prompt_into_read_created_and_input():
    trace = {"reused_tokens": {"ram": 0, "disk": 512, "bucket": 0},
             "stored": [{"kind": "pin", "tokens": 1024}, {"kind": "anchor", "tokens": 1500},
                        {"kind": "assistant", "tokens": 1700}]}
    pins = [PinRequest(0, 3600, tokens=1024, state="pinned")]
    u = usage_of(1600, trace, pins)
    assert (u["cache_read_input_tokens"], u["cache_creation_input_tokens"], u["input_tokens"]) == (512, 988, 100)
    assert u["cache_creation"] == {"ephemeral_5m_input_tokens": 476, "ephemeral_1h_input_tokens": 512}
    nothing = usage_of(40, {"reused_tokens": {}, "stored": []})
    assert (nothing["input_tokens"], nothing["cache_creation_input_tokens"], nothing["cache_read_input_tokens"]) == \
        (40, 0, 0)


# ---- a real server -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tool_model(tmp_path_factory):
    """A random-weight model directory whose chat template renders tools, tool
    calls, tool results and reasoning (kvstore.demo.model.TOOL_CHAT_TEMPLATE)."""
    from kvstore.demo.model import TOOL_CHAT_TEMPLATE, write_model_dir
    path = tmp_path_factory.mktemp("agents-model")
    write_model_dir(path, seed=3, chat_template=TOOL_CHAT_TEMPLATE)
    return str(path)


def _client(server):
    return anthropic.Anthropic(base_url=server.url(""), api_key="unused", max_retries=0)


def _total(usage):
    return usage.input_tokens + usage.cache_creation_input_tokens + usage.cache_read_input_tokens


def _loop_messages(turns):
    """A tool loop of `turns` rounds: each round an assistant that thinks and
    calls read_file, then the tool's result and a user line."""
    messages = [{"role": "user", "content": "Look at the project and tell me what a.py does."}]
    for i in range(turns):
        messages.append({"role": "assistant", "content": [
            {"type": "thinking", "thinking": f"Round {i}: I need file {i}.", "signature": ""},
            {"type": "tool_use", "id": f"toolu_{i}", "name": "read_file", "input": {"path": f"f{i}.py"}}]})
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": f"toolu_{i}", "content": f"def f{i}():\n    return {i} * 2\n" * 20},
            {"type": "text", "text": f"That was file {i}."}]})
    return messages


def _ask(client, messages, stream, **kw):
    kw = dict(model="claude-local", max_tokens=4, tools=TOOLS,
              system=[{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral", "ttl": "1h"}}],
              messages=messages, **kw)
    if not stream:
        return client.messages.create(**kw)
    with client.messages.stream(**kw) as s:
        kinds = [e.type for e in s]
        message = s.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop", kinds
    return message


def test_a_tool_loop_reads_each_turn_from_the_last_and_a_restart_reads_from_disk(tool_model, workdir, tmp_path):
    cache = tmp_path / "cache"
    server = kvstore_server(tool_model, cache, workdir, "anthropic-loop")
    try:
        client = _client(server)
        usages = [_ask(client, _loop_messages(t), stream=t % 2 == 1).usage for t in range(3)]
    finally:
        assert server.stop() == 0
    first = usages[0]
    assert first.cache_read_input_tokens == 0 and first.cache_creation_input_tokens > 1000
    assert first.cache_creation.ephemeral_1h_input_tokens > 1000      # the system prompt's 1h pin
    for before, after in zip(usages, usages[1:]):
        # Each turn's prompt starts with the last one's (its answer replaced
        # by the tool call): all of it is read from RAM.
        assert after.cache_read_input_tokens >= _total(before) - 1, (before, after)
        assert _total(after) > _total(before)
    server = kvstore_server(tool_model, cache, workdir, "anthropic-loop-2")
    try:
        after = _ask(_client(server), _loop_messages(3), stream=True).usage
    finally:
        server.stop()
    kv = after.model_extra["kvstore"]
    assert kv["source"] == "disk" and after.cache_read_input_tokens > 1000, after
    assert after.cache_read_input_tokens == kv["reused_tokens"]["disk"]


def test_the_same_conversation_through_chat_completions_reuses_all_of_it(tool_model, workdir, tmp_path):
    openai = pytest.importorskip("openai")
    server = kvstore_server(tool_model, tmp_path / "cache", workdir, "anthropic-doors")
    try:
        messages = _loop_messages(2)
        first = _ask(_client(server), messages, stream=False)
        counted = _client(server).messages.count_tokens(model="claude-local", system=SYSTEM, tools=TOOLS,
                                                        messages=messages, thinking={"type": "adaptive"})
        chat = to_chat({"max_tokens": 4, "system": SYSTEM, "tools": TOOLS, "messages": messages})
        for m in chat["messages"]:
            for call in m.get("tool_calls", ()):        # as OpenAI clients send them
                call["function"]["arguments"] = json.dumps(call["function"]["arguments"])
        r = openai.OpenAI(base_url=server.url("/v1"), api_key="unused").chat.completions.create(
            model="default_model", max_tokens=4, messages=chat["messages"], tools=chat["tools"])
    finally:
        server.stop()
    assert r.usage.prompt_tokens == _total(first.usage) == counted.input_tokens
    assert r.usage.prompt_tokens_details.cached_tokens == r.usage.prompt_tokens - 1


def _post(server, body):
    return server.post(None, raw=body, path="/v1/messages?beta=true")


def test_errors_come_in_anthropics_shape(tool_model, workdir, tmp_path):
    server = kvstore_server(tool_model, tmp_path / "cache", workdir, "anthropic-errors")
    try:
        client = _client(server)
        with pytest.raises(anthropic.BadRequestError) as e:
            client.messages.create(model="m", max_tokens=4, messages=[{"role": "user", "content": [
                {"type": "video", "source": {}}]}])
        assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
        assert "messages[0].content[0]" in e.value.body["error"]["message"]
        with pytest.raises(anthropic.BadRequestError) as e:        # refused by pinning
            client.messages.create(model="m", max_tokens=4, messages=[{"role": "user", "content": [
                {"type": "text", "text": "hi", "cache_control": {"type": "ephemeral", "ttl": "2d"}}]}])
        assert "ttl" in e.value.body["error"]["message"]
        assert _post(server, b"{not json") == (400, {"type": "error", "error": {
            "type": "invalid_request_error", "message": _post(server, b"{not json")[1]["error"]["message"]}})
        status, body = _post(server, json.dumps({"max_tokens": 2, "messages": [
            {"role": "user", "content": "hello"}]}).encode())
        assert status == 200 and body["type"] == "message" and body["usage"]["output_tokens"] == 2
    finally:
        server.stop()


# ---- the miss explained ------------------------------------------------------------------------

SESSION_AT = 3000          # where the system prompt's session id sits: past its first blocks


def _with_session(session):
    return SYSTEM[:SESSION_AT] + f"\nsession id: {session}\n" + SYSTEM[SESSION_AT:]


def _wait_saved(server, tokens, timeout=30):
    """Waits until the server has logged a save of at least tokens tokens."""
    deadline = time.monotonic() + timeout
    while max(map(int, re.findall(r"kvstore: saved reason=\w+ tokens=(\d+)", server.text())), default=0) < tokens:
        assert time.monotonic() < deadline, server.text()
        time.sleep(0.05)


def test_a_prompt_that_differs_by_one_id_in_its_system_message_is_explained(tool_model, workdir, tmp_path):
    openai = pytest.importorskip("openai")
    cache = tmp_path / "cache"
    ids = ("3f1c9a7e-0b52-4d8e-9a61-5c2f7e8d4b10", "3f1c9a7e-0b52-4d8e-9a61-7d0e1b2c3a49",
           "3f1c9a7e-0b52-4d8e-9a61-9a8b7c6d5e4f")
    user = {"role": "user", "content": "Summarise the module in one line."}
    server = kvstore_server(tool_model, cache, workdir, "explain")
    try:
        chat = openai.OpenAI(base_url=server.url("/v1"), api_key="unused").chat.completions
        first = chat.create(model="default_model", max_tokens=4,
                            messages=[{"role": "system", "content": _with_session(ids[0])}, user])
        assert "miss" not in first.usage.model_extra["kvstore"]          # nothing stored yet
        _wait_saved(server, first.usage.prompt_tokens // 256 * 256)       # its blocks are on disk (background writer)
        # The same system prompt with the other id, through the other door.
        second = _client(server).messages.create(model="claude-local", max_tokens=4, system=_with_session(ids[1]),
                                                 messages=[user])
    finally:
        server.stop()
    miss = second.usage.model_extra["kvstore"]["miss"]
    rendered = "<s><|system|>\n" + _with_session(ids[0])
    differs = next(i for i, (a, b) in enumerate(zip(ids[0], ids[1])) if a != b)
    byte = len((rendered[:rendered.index(ids[0])] + ids[0][:differs]).encode())
    assert (miss["byte"], miss["message"], miss["role"]) == (byte, 0, "system"), miss
    assert miss["request_message"] == "system"          # where the Anthropic body holds it
    assert miss["shared_tokens"] <= miss["token"] < first.usage.prompt_tokens
    stored = first.usage.prompt_tokens + first.usage.completion_tokens
    assert 0 < miss["stored_tokens_after"] <= stored - miss["token"]
    assert second.usage.cache_read_input_tokens <= miss["token"]
    lines = [line for line in server.text().splitlines() if "kvstore: request_done" in line]
    assert f"miss=byte:{byte},token:{miss['token']},message:0,role:system," in lines[-1]
    assert ids[1] not in server.text() and "session id" not in server.text()

    # The same from the command line, on the directory the server left
    # (both sessions stored now): a third session's prompt.
    prompt = tmp_path / "prompt.txt"
    prompt.write_bytes((rendered.replace(ids[0], ids[2]) + "</s>\n").encode())
    out = subprocess.run([sys.executable, "-m", "kvstore", "explain", str(cache), str(prompt), "--json", "--text"],
                         capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["byte"] == byte and report["parted"] and report["stored_tokens"] >= miss["token"]
    assert report["before"].endswith(ids[0][:differs]) and report["after"].startswith(ids[2][differs:])


# ---- OpenAI's prompt-cache fields ----------------------------------------------------------------

def _get(server, path):
    with urllib.request.urlopen(server.url(path), timeout=30) as r:
        return r.read().decode()


def test_prompt_cache_key_counts_as_reuse_and_is_never_written(tool_model, workdir, tmp_path):
    openai = pytest.importorskip("openai")
    cache, key = tmp_path / "cache", "agent-session-KEY-51d0e2"
    server = kvstore_server(tool_model, cache, workdir, "cache-key", "--admit-after", "3", "--admin")
    try:
        chat = openai.OpenAI(base_url=server.url("/v1"), api_key="unused").chat.completions

        def ask(system, turn, **kw):
            return chat.create(model="default_model", max_tokens=4, messages=[
                {"role": "system", "content": system}, {"role": "user", "content": f"Question {turn}?"}], **kw)
        # Without a key, a prefix two requests used is not admitted yet (--admit-after 3) ...
        plain = [ask("Plain.\n" + SYSTEM, t).usage.model_extra["kvstore"] for t in range(2)]
        # ... under one key, the second use of the same prefix is reuse enough.
        keyed = [ask("Keyed.\n" + SYSTEM, t, prompt_cache_key=key).usage.model_extra["kvstore"] for t in range(2)]
        view = json.loads(_get(server, "/v1/cache"))
        metrics = _get(server, "/metrics")
        with pytest.raises(openai.BadRequestError) as bad:
            ask("x", 0, prompt_cache_key="")
        assert "prompt_cache_key" in json.dumps(bad.value.body)
    finally:
        server.stop()
    assert "cache_key" not in plain[1]
    tag = keyed[0]["cache_key"]
    assert keyed[1]["cache_key"] == tag and keyed[1]["reused_tokens"]["ram"] > 1000
    stored = b""
    for name in glob.glob(os.path.join(cache, "*.kv")):
        with open(name, "rb") as f:
            stored += f.read()
    assert b"Keyed." in stored and b"Plain." not in stored      # admitted under the key only
    row = view["activity"]["cache_keys"][tag]
    assert row["requests"] == 2 and row["reused_tokens"]["ram"] == sum(k["reused_tokens"]["ram"] for k in keyed)
    assert f'kvstore_cache_key_requests_total{{cache_key="{tag}",source="ram"}} 2.0' in metrics
    assert f'kvstore_cache_key_tokens_reused_total{{cache_key="{tag}",source="ram"}} ' \
           f'{float(row["reused_tokens"]["ram"])}' in metrics
    assert key not in server.text() and f"cache_key={tag}" in server.text()
    for root, _, files in os.walk(cache):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                assert key.encode() not in f.read(), name


def test_prompt_cache_retention_24h_pins_the_prefix_as_a_breakpoint_would(tool_model, workdir, tmp_path):
    openai = pytest.importorskip("openai")
    server = kvstore_server(tool_model, tmp_path / "cache", workdir, "retention", "--max-pin-ttl", "2h")
    try:
        chat = openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0).chat.completions
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Keep this a day."}]
        kept = chat.create(model="default_model", max_tokens=4, messages=messages, prompt_cache_retention="24h")
        memory = chat.create(model="default_model", max_tokens=4, messages=messages[:1] + [
            {"role": "user", "content": "Only in memory."}], prompt_cache_retention="in_memory")
        short = chat.create(model="default_model", max_tokens=4, messages=[{"role": "user", "content": "hi"}],
                            prompt_cache_retention="24h")
        with pytest.raises(openai.BadRequestError) as bad:
            chat.create(model="default_model", max_tokens=4, messages=messages, extra_body={
                "prompt_cache_retention": "1w"})
        assert "prompt_cache_retention" in json.dumps(bad.value.body)
    finally:
        server.stop()
    [pin] = kept.usage.model_extra["kvstore"]["pins"]
    assert (pin["origin"], pin["message"], pin["ttl_s"]) == ("retention", 1, 86400)
    assert pin["state"] in ("queued", "storing", "pinned") and pin["tokens"] > 1000
    if pin["state"] == "pinned":
        assert 7100 < pin["granted_s"] <= 7200          # cut to --max-pin-ttl
    [kept_pin] = read_pins(str(tmp_path / "cache"), time.time()).values()
    assert kept_pin.tokens == pin["tokens"] and kept_pin.until - kept_pin.created == 7200
    assert "pins" not in memory.usage.model_extra["kvstore"]
    assert short.usage.model_extra["kvstore"]["pins"][0]["state"] == "not_stored"    # too short: no error
    assert "pinned tokens=" in server.text()


def test_prompt_cache_retention_past_the_pinned_share_is_refused(tool_model, workdir, tmp_path):
    openai = pytest.importorskip("openai")
    cache = tmp_path / "cache"
    server = kvstore_server(tool_model, cache, workdir, "retention-share", "--budget-mb", "64",
                            "--max-pinned-share", "0.001")
    try:
        chat = openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0).chat.completions
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Keep this a day."}]
        first = chat.create(model="default_model", max_tokens=4, messages=messages, prompt_cache_retention="24h")
        deadline = time.monotonic() + 30                # its prefix stored (and its pin refused) ...
        while "pin_refused reason=share" not in server.text():
            assert time.monotonic() < deadline, server.text()
            time.sleep(0.1)
        with pytest.raises(openai.ConflictError) as refused:       # ... so a second ask is refused upfront
            chat.create(model="default_model", max_tokens=4, messages=messages, prompt_cache_retention="24h")
    finally:
        server.stop()
    assert first.usage.model_extra["kvstore"]["pins"][0]["origin"] == "retention"
    assert "messages[1]" in json.dumps(refused.value.body)
    assert read_pins(str(cache), time.time()) == {}


# ---- one shared prefix across tenants ------------------------------------------------------------

PRIVATE_TURN = "Tenant A's private question: what does invoice 8841-QX cover?"


def _tenant_messages(scope_at=0, scope="global", turn=PRIVATE_TURN):
    """The system prompt and a user turn; a global breakpoint on message scope_at (None: none)."""
    messages = [{"role": "system", "content": [{"type": "text", "text": SYSTEM}]},
                {"role": "user", "content": [{"type": "text", "text": turn}]}]
    if scope_at is not None:
        messages[scope_at]["content"][0]["cache_control"] = {"type": "ephemeral", "scope": scope}
    return messages


def _as(server, salt, messages):
    status, r = server.post({"messages": messages, "max_tokens": 4, "cache_salt": salt})
    assert status == 200, r
    return r["usage"]["kvstore"]


def _wait_pinned(server, n):
    deadline = time.monotonic() + 30
    while server.text().count("kvstore: pinned ") < n:
        assert time.monotonic() < deadline, server.text()
        time.sleep(0.1)


def test_tenants_share_a_global_system_prompt_and_never_each_others_turns(tool_model, workdir, tmp_path):
    cache = tmp_path / "cache"
    server = kvstore_server(tool_model, cache, workdir, "global")
    try:
        a = _as(server, "tenant-a", _tenant_messages())
        _wait_pinned(server, 1)
        # B sends A's very messages: it gets the global system prompt, not A's turn.
        b = _as(server, "tenant-b", _tenant_messages())
        # E marks the turn global too: still only what is stored globally (the
        # system prompt), never A's turn, which A stored under its salt.
        e = _as(server, "tenant-e", _tenant_messages(scope_at=1))
        _wait_pinned(server, 3)             # A's, B's (stored already) and E's: E's turn is global now
        # F marks only the system prompt: it finds no more than that without its salt.
        f = _as(server, "tenant-f", _tenant_messages())
        # Without a global breakpoint a tenant reads nothing of the others'.
        d = _as(server, "tenant-d", _tenant_messages(scope_at=None))
    finally:
        assert server.stop() == 0
    system = a["pins"][0]["tokens"]
    assert a["pins"][0]["scope"] == "global" and a["source"] == "none" and system > 1000
    assert b["source"] == "disk" and 1000 < b["reused_tokens"]["disk"] <= system
    assert e["source"] == "disk" and e["reused_tokens"]["disk"] <= system
    assert e["pins"][0]["tokens"] > system and f["reused_tokens"]["disk"] <= system
    assert d["source"] == "none" and d["reused_tokens"] == {"ram": 0, "disk": 0, "bucket": 0}
    server = kvstore_server(tool_model, cache, workdir, "global-2")
    try:
        c = _as(server, "tenant-c", _tenant_messages())
    finally:
        server.stop()
    assert c["source"] == "disk" and 1000 < c["reused_tokens"]["disk"] <= system


def test_global_system_prompt_option_and_a_bad_scope(tool_model, workdir, tmp_path):
    server = kvstore_server(tool_model, tmp_path / "cache", workdir, "global-option", "--global-system-prompt")
    try:
        a = _as(server, "tenant-a", _tenant_messages(scope_at=None))
        _wait_pinned(server, 1)
        b = _as(server, "tenant-b", _tenant_messages(scope_at=None, turn="Another tenant's own turn."))
        status, r = server.post({"messages": _tenant_messages(scope="everyone"), "max_tokens": 4})
    finally:
        server.stop()
    assert a["pins"][0]["scope"] == "global" and a["pins"][0]["origin"] == "server"
    assert b["source"] == "disk" and 1000 < b["reused_tokens"]["disk"] <= a["pins"][0]["tokens"]
    assert status == 400 and "scope" in json.dumps(r)


def test_a_stream_the_drain_timeout_cuts_ends_with_an_anthropic_error_event(tool_model, workdir, tmp_path):
    server = kvstore_server(tool_model, tmp_path / "cache", workdir, "anthropic-cut", "--drain-timeout", "0.5")
    deltas, caught = [], []

    def read():
        try:
            with _client(server).messages.stream(
                    model="claude-local", max_tokens=100_000, messages=[{"role": "user", "content": "Go on."}],
                    extra_body={"logit_bias": {"1": -100.0}}) as s:        # no EOS: it runs until cut
                for event in s:
                    if event.type == "content_block_delta":
                        deltas.append(event)
        except anthropic.APIError as e:
            caught.append(e)

    t = threading.Thread(target=read)
    t.start()
    try:
        deadline = time.monotonic() + 60
        while len(deltas) < 5:
            assert time.monotonic() < deadline and t.is_alive(), server.text()
            time.sleep(0.02)
        server.proc.send_signal(signal.SIGTERM)
    finally:
        t.join(120)
        rc = server.proc.wait(120)
        server.log.close()
    assert rc == 0 and len(caught) == 1, (caught, server.text())
    assert "server stopped" in str(caught[0]) and caught[0].body["error"]["type"] == "overloaded_error"
    assert "kvstore: request_cut reason=shutdown stream=1" in server.text()
