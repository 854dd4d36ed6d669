"""Operating a shared kvstore serve: cache_control pins, the per-request trace
(usage.kvstore), and bad input, against real server processes and an
OpenAI-style client (urllib, as tests/test_serve.py)."""

import json
import os
import subprocess
import sys
import time

import pytest

pytest.importorskip("mlx_lm")

from kvstore import KVStore, pins
from kvstore.demo.model import prose
from kvhelpers import kvstore_server

PIN_1H = {"type": "ephemeral", "ttl": "1h"}


def system(topic):
    """A system prompt of about 1,000 tokens on a topic (several files' worth of prefix)."""
    return prose([topic])[:2500]


def chat(server, messages, max_tokens=2, **extra):
    return server.post({"messages": messages, "max_tokens": max_tokens, "temperature": 0.0, **extra})


def pinned_messages(topic, ttl=PIN_1H, question="What is this about?"):
    return [{"role": "system", "content": system(topic), "cache_control": ttl},
            {"role": "user", "content": question}]


def live_pins(cache):
    with KVStore(cache) as store:
        return store.pins()


def wait_for(predicate, timeout=60.0, what="condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def test_a_cache_control_breakpoint_is_stored_pinned_and_kept_through_eviction_and_a_restart(model_dir, workdir):
    cache = os.path.join(workdir, "cache-pins")
    server = kvstore_server(model_dir, cache, workdir, "pins-1")
    try:
        status, r = chat(server, pinned_messages("json"))
        assert status == 200, r
        trace = r["usage"]["kvstore"]
        assert trace["source"] == "none" and trace["prefilled_tokens"] == r["usage"]["prompt_tokens"]
        [p] = trace["pins"]
        assert p["message"] == 0 and 512 <= p["tokens"] < r["usage"]["prompt_tokens"]
        assert p["state"] in ("storing", "pinned")
        [pin] = wait_for(lambda: live_pins(cache), what="the pin")
        assert pin.tokens == p["tokens"] and pin.until > time.time() + 3500 and pin.tenant == ""
        pinned_bytes = pin.bytes
    finally:
        assert server.stop() == 0
    # A second server whose budget holds about three such prefixes, and whose
    # pinned share holds one and a half: five other conversations evict
    # everything but the pinned prefix.
    budget_mb = 3 * pinned_bytes / 2**20
    server = kvstore_server(model_dir, cache, workdir, "pins-2", "--budget-mb", f"{budget_mb:.4f}",
                            "--max-pinned-share", "0.5")
    try:
        for topic in ("csv", "logging", "argparse", "collections", "email.message"):
            status, r = chat(server, [{"role": "system", "content": system(topic)},
                                      {"role": "user", "content": "And this one?"}])
            assert status == 200, r
        with KVStore(cache) as store:
            wait_for(lambda: store.stats()["bytes"] <= budget_mb * 2**20, what="the budget")
            names = {e.sha for e in store.entries()}
            kept = pins.kept([pin], {e.sha: e for e in store.entries()})
        assert pin.sha in names and kept[1] == pin.bytes      # the pinned file and every block before it
        evicted = [line for line in server.text().splitlines() if "kvstore: evicted reason=budget" in line]
        assert len(evicted) >= 5, server.text()
        evicted_bytes = sum(int(line.split(" bytes=")[1].split()[0]) for line in evicted)
        # The pinned prefix is a disk hit for a new question after it.
        status, r = chat(server, pinned_messages("json", question="Say more."))
        assert status == 200, r
        trace = r["usage"]["kvstore"]
        assert trace["source"] == "disk" and trace["reused_tokens"]["disk"] >= pin.tokens
        # A second pin does not fit the share: refused, the first one kept.
        status, r = chat(server, pinned_messages("csv"))
        assert status == 200, r
        wait_for(lambda: "pin_refused reason=share" in server.text(), what="the refusal")
        assert [q.sha for q in live_pins(cache)] == [pin.sha]
        # Asked again, now that the prefix is stored, it is refused up front.
        status, r = chat(server, pinned_messages("csv"))
        assert status == 409 and "pinned share" in r["error"], r
        import urllib.request
        metrics = urllib.request.urlopen(server.url("/metrics"), timeout=30).read().decode()
        assert 'kvstore_pin_requests_total{outcome="refused"} 2.0' in metrics, metrics
        values = dict(line.rsplit(" ", 1) for line in metrics.splitlines() if line and not line.startswith("#"))
        assert float(values["kvstore_pinned_bytes"]) == pin.bytes and float(values["kvstore_live_pins"]) == 1
        # The figures, for `pytest -s`.
        print(f"\npins: 1 pinned prefix of {pin.tokens} tokens ({len(kept[0])} files, {pin.bytes} B) kept "
              f"through 5 other conversations under a {int(budget_mb * 2**20)} B budget that evicted "
              f"{len(evicted)} files ({evicted_bytes} B); the pinned prefix then a disk hit of "
              f"{trace['reused_tokens']['disk']} tokens; 2 pins past the 0.5 share refused (1 after its store, "
              "1 up front with 409); live pins: 1")
    finally:
        assert server.stop() == 0


@pytest.mark.parametrize("control, message", [
    ({"type": "ephemeral", "ttl": "10m"}, "ttl '10m' is not one of 5m, 1h"),
    ({"type": "persistent"}, "cache_control must be"),
    ("yes", "cache_control must be"),
])
def test_malformed_cache_control_is_a_400_naming_it(ops_server, control, message):
    server, cache = ops_server
    before = sorted(os.listdir(cache))
    status, r = chat(server, pinned_messages("json", ttl=control))
    assert status == 400 and message in r["error"] and "messages[0]" in r["error"], r
    assert sorted(os.listdir(cache)) == before


def test_breakpoint_errors_are_4xx_and_store_nothing(ops_server):
    server, cache = ops_server
    before = sorted(os.listdir(cache))
    short = [{"role": "system", "content": "Be brief.", "cache_control": PIN_1H},
             {"role": "user", "content": "Hi"}]
    status, r = chat(server, short)
    assert status == 400 and "shorter than the 512 tokens" in r["error"], r
    many = [{"role": "user", "content": f"part {i}", "cache_control": PIN_1H} for i in range(5)]
    status, r = chat(server, many)
    assert status == 400 and "at most 4" in r["error"], r
    # Content parts carry it too.
    parts = [{"role": "system", "content": [{"type": "text", "text": "Be brief.", "cache_control": {"ttl": "1h"}}]},
             {"role": "user", "content": "Hi"}]
    status, r = chat(server, parts)
    assert status == 400 and "messages[0].content[0]" in r["error"], r
    assert sorted(os.listdir(cache)) == before
    # The server stays usable.
    status, r = chat(server, [{"role": "user", "content": "Hi"}])
    assert status == 200 and r["usage"]["kvstore"]["source"] in ("none", "ram")


def test_every_completion_carries_its_trace_and_logs_it_without_text(ops_server):
    server, _ = ops_server
    messages = [{"role": "system", "content": system("logging")}, {"role": "user", "content": "Go on."}]
    status, first = chat(server, messages)
    assert status == 200, first
    status, again = chat(server, messages)
    assert status == 200, again
    t1, t2 = first["usage"]["kvstore"], again["usage"]["kvstore"]
    assert set(t1) >= {"source", "reused_tokens", "prefilled_tokens", "load_ms", "stored"}
    assert t1["prefilled_tokens"] + sum(t1["reused_tokens"].values()) == first["usage"]["prompt_tokens"]
    assert t2["source"] == "ram" and t2["reused_tokens"]["ram"] > 0
    assert t2["prefilled_tokens"] + t2["reused_tokens"]["ram"] == again["usage"]["prompt_tokens"]
    assert any(s["kind"] in ("anchor", "blocks") for s in t1["stored"]), t1
    # Streaming with include_usage carries it too.
    status, body = stream(server, messages)
    assert status == 200 and body["usage"]["kvstore"]["source"] == "ram"
    lines = [line for line in server.text().splitlines() if "kvstore: request_done" in line]
    assert len(lines) >= 3 and all("source=" in line and "prefilled=" in line for line in lines)
    assert "logging" not in "\n".join(lines) and "Go on" not in server.text()


def test_a_lifetime_past_the_servers_limit_is_cut_to_it(ops_server):
    server, cache = ops_server
    t0 = time.time()
    status, r = chat(server, pinned_messages("argparse"))
    assert status == 200, r
    [p] = r["usage"]["kvstore"]["pins"]
    pin = wait_for(lambda: [q for q in live_pins(cache) if q.tokens == p["tokens"]], what="the pin")[0]
    assert t0 + 119 <= pin.until <= time.time() + 121          # --max-pin-ttl 2m, not the 1h asked
    assert json.loads(open(os.path.join(cache, pins.PINS)).read())[pin.sha]["until"] == pin.until


def stream(server, messages):
    """(status, the chunk that carries usage) of a streamed completion with include_usage."""
    import urllib.request
    body = json.dumps({"messages": messages, "max_tokens": 2, "temperature": 0.0, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()
    req = urllib.request.Request(server.url("/v1/chat/completions"), data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        chunks = [json.loads(line[6:]) for line in r.read().decode().splitlines()
                  if line.startswith("data: {")]
        return r.status, next(c for c in chunks if c.get("usage"))


@pytest.fixture(scope="module")
def ops_server(model_dir, workdir):
    cache = os.path.join(workdir, "cache-ops")
    server = kvstore_server(model_dir, cache, workdir, "ops", "--max-pin-ttl", "2m")
    try:
        yield server, cache
    finally:
        server.kill()


@pytest.mark.parametrize("args, message", [
    (["--max-pinned-share", "1.5"], "--max-pinned-share 1.5 must be between 0 and 1"),
    (["--max-pin-ttl", "soon"], "'soon' is not a duration"),
    (["--max-pin-ttl", "0"], "must be a positive duration"),
])
def test_bad_pin_options_exit_2(model_dir, workdir, args, message):
    p = subprocess.run([sys.executable, "-m", "kvstore", "serve", "--model", model_dir, *args],
                       cwd=workdir, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and message in p.stderr, p.stderr


# ---- the parts, without a server ---------------------------------------------------------

def test_breakpoints_are_read_from_messages_and_content_parts():
    from kvstore.serve.pinning import PinRequest, breakpoints
    messages = [{"role": "system", "content": "a", "cache_control": {"type": "ephemeral"}},
                {"role": "user", "content": [{"type": "text", "text": "b"},
                                             {"type": "text", "text": "c", "cache_control": PIN_1H}]},
                {"role": "user", "content": "d"}]
    assert breakpoints(messages) == [PinRequest(0, 300), PinRequest(1, 3600)]
    assert breakpoints([{"role": "user", "content": "x"}]) == [] and breakpoints(None) == []


@pytest.mark.parametrize("control, message", [
    ({"type": "ephemeral", "ttl": "2h"}, "ttl '2h' is not one of 5m, 1h"),
    ({"type": "ephemeral", "ttl": 300}, "ttl 300 is not one of"),
    ({"ttl": "5m"}, "cache_control must be"),
    ([], "cache_control must be"),
])
def test_bad_breakpoints_name_the_message_and_the_value(control, message):
    from kvstore.serve.pinning import BadPin, breakpoints
    with pytest.raises(BadPin) as e:
        breakpoints([{"role": "user", "content": "x"}, {"role": "user", "content": "y", "cache_control": control}])
    assert message in str(e.value) and str(e.value).startswith("messages[1]") and e.value.status == 400


def test_segments_are_cut_at_a_pinned_prefix_end_and_keep_their_boundaries():
    from kvstore.serve.generator import split_at, split_at_waypoints
    from kvstore.serve.tier import WAYPOINT_TYPE
    segments, types = [list(range(10)), list(range(10, 25))], ["system", "assistant"]
    out, kinds = split_at(segments, types, [4, 10, 17, 30])
    assert out == [list(range(4)), list(range(4, 10)), list(range(10, 17)), list(range(17, 25))]
    assert kinds == [WAYPOINT_TYPE, "system", WAYPOINT_TYPE, "assistant"]
    assert split_at(segments, types, []) == (segments, types)
    assert split_at_waypoints(segments, types, 8) == split_at(segments, types, [8, 16, 24])


def test_a_trace_holds_numbers_and_states_only():
    from kvstore.serve.pinning import PinRequest
    from kvstore.serve.ticket import Ticket
    t = Ticket(tenant="ab" * 32, pins=[PinRequest(0, 300, tokens=700, state="pinned", until=123, granted_s=299.6)])
    t.source, t.reused, t.prefilled, t.load_ms, t.stored = "remote", 512, 40, 3.14159, [("blocks", 768)]
    t.cache_key = "cd" * 32
    assert t.trace() == {"source": "bucket", "reused_tokens": {"ram": 0, "disk": 0, "bucket": 512},
                         "prefilled_tokens": 40, "load_ms": 3.1, "stored": [{"kind": "blocks", "tokens": 768}],
                         "pins": [{"message": 0, "tokens": 700, "state": "pinned", "origin": "cache_control",
                                   "ttl_s": 300, "scope": "tenant", "until": 123, "granted_s": 300}],
                         "cache_key": "cdcdcdcd"}
