"""kvstore serve: real server processes on 127.0.0.1 against stock mlx_lm.server.

Each server is a child process started from a directory outside the
repository (the source tree would shadow the installed package), with a
random-weight model directory written here (config, weights, an offline
tokenizer and a chat template).
"""

import contextlib
import glob
import http.client
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

pytest.importorskip("mlx_lm")

from kvstore import KVStore, registry
from kvstore.format import Reason, read_entry
from kvstore.demo.model import prose, text_of_tokens, write_model_dir
from kvstore.serve import split_at_waypoints
from kvstore.files import verify_file
from kvhelpers import USER_TURNS, answer, conversation, free_port, kvstore_server, stock_server, system_prompt

SYSTEM_PROMPT = system_prompt()      # about 1600 tokens


@pytest.fixture(scope="module")
def stock(model_dir, workdir):
    """A stock mlx_lm.server that answered the four-turn conversation."""
    server = stock_server(model_dir, workdir, "stock")
    try:
        _, answers, usages = conversation(server, USER_TURNS)
        yield server, answers, usages
    finally:
        server.kill()


@pytest.fixture(scope="module")
def restarted(model_dir, workdir, stock):
    """Three turns on kvstore serve, SIGTERM, a new server, the fourth turn."""
    cache = os.path.join(workdir, "cache-restart")
    first = kvstore_server(model_dir, cache, workdir, "first")
    try:
        messages, answers, _ = conversation(first, USER_TURNS[:3])
    finally:
        rc = first.stop()
    second = kvstore_server(model_dir, cache, workdir, "second")
    try:
        _, last, usages = conversation(second, USER_TURNS[3:], messages)
    finally:
        second.stop()
    return dict(cache=cache, first=first, second=second, rc=rc,
                answers=answers + last, usage4=usages[0])


def test_restart_serves_the_fourth_turn_from_disk_with_stock_output(restarted, stock):
    _, stock_answers, stock_usages = stock
    assert restarted["rc"] == 0, restarted["first"].text()
    first_log = restarted["first"].text()
    assert "kvstore: saved reason=cold" in first_log          # the system-prompt anchor
    assert "kvstore: saved reason=shutdown" in first_log      # the RAM entries on SIGTERM

    usage = restarted["usage4"]
    lines = restarted["second"].request_lines()
    assert len(lines) == 1 and lines[0].startswith("request source=disk"), lines
    reused = int(lines[0].split("reused=")[1].split()[0])
    assert usage["prompt_tokens_details"]["cached_tokens"] == reused > 0
    # The shutdown checkpoint covers the third prompt to its last token but
    # one (its answer's few tokens are no whole block: prefilled again).
    assert reused == stock_usages[2]["prompt_tokens"] - 1
    assert usage["prompt_tokens"] == stock_usages[3]["prompt_tokens"]
    assert restarted["answers"] == stock_answers


def test_checkpoints_are_private_and_valid(restarted):
    cache = restarted["cache"]
    assert os.stat(cache).st_mode & 0o777 == 0o700
    files = glob.glob(os.path.join(cache, "*.kv"))
    assert files
    for path in files:
        assert os.stat(path).st_mode & 0o777 == 0o600
        assert verify_file(path) is None


def test_request_log_lines_hold_no_prompt_text(restarted):
    for server in (restarted["first"], restarted["second"]):
        text = server.text()
        for fragment in (SYSTEM_PROMPT[100:140], "Summarise all three", "json module"):
            assert fragment not in text


def test_corrupt_checkpoint_is_a_miss_and_is_removed(restarted, model_dir, workdir, stock):
    cache = os.path.join(workdir, "cache-corrupt")
    shutil.copytree(restarted["cache"], cache)
    os.chmod(cache, 0o700)
    # Damage the payload of the system-prompt anchor, the one checkpoint
    # that prefixes a new conversation: the request must still succeed.
    anchors = [p for p in glob.glob(os.path.join(cache, "*.kv")) if read_entry(p).reason == Reason.COLD]
    assert len(anchors) == 1
    anchor = read_entry(anchors[0])
    size = os.path.getsize(anchors[0])
    with open(anchors[0], "r+b") as f:
        f.seek(size - 100)
        b = f.read(1)
        f.seek(size - 100)
        f.write(bytes([b[0] ^ 0xFF]))
    server = kvstore_server(model_dir, cache, workdir, "corrupt")
    try:
        messages = [{"role": "system", "content": SYSTEM_PROMPT}]
        _, answers, usages = conversation(server, USER_TURNS[:1], messages)
    finally:
        server.stop()
    assert answers[0] == stock[1][0]
    # The anchor is the last block of a chain: it goes, and the request
    # reuses the longest valid ancestor (a block boundary), or nothing.
    cached = usages[0]["prompt_tokens_details"]["cached_tokens"]
    assert cached < anchor.tokens and cached % anchor.block_grid == 0
    assert "kvstore: corrupt" in server.text()
    assert server.request_lines()[0].startswith("request source=disk " if cached else "request source=none ")
    # Removed, and then stored again, sound, by the same request.
    assert not os.path.exists(anchors[0]) or verify_file(anchors[0]) is None
    assert "kvstore: saved reason=cold" in server.text()


def test_two_servers_share_one_directory(model_dir, workdir):
    cache = os.path.join(workdir, "cache-shared")
    a = kvstore_server(model_dir, cache, workdir, "share-a")
    try:
        b = kvstore_server(model_dir, cache, workdir, "share-b")
    except BaseException:
        a.kill()
        raise
    try:
        conversation(a, ["First user, first question."])
        # The anchor is written by a's background writer, its chain's blocks
        # parent first: wait for the block that ends the save.
        deadline = time.monotonic() + 30
        while True:
            ends = [e for e in map(read_entry, glob.glob(os.path.join(cache, "*.kv")))
                    if e.ends_save and e.reason == Reason.COLD]
            if ends or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert len(ends) == 1, ends
        anchor = ends[0]
        _, _, usages = conversation(b, ["Another user with another question."])
        assert usages[0]["prompt_tokens_details"]["cached_tokens"] == anchor.tokens
        assert b.request_lines()[0].startswith(f"request source=disk reused={anchor.tokens} ")
    finally:
        a.stop()
        b.stop()


def test_long_prompts_store_waypoints_and_ram_drops_store_evict(model_dir, workdir):
    cache = os.path.join(workdir, "cache-waypoints")
    server = kvstore_server(model_dir, cache, workdir, "waypoints", "--prompt-cache-size", "1",
                            "--waypoint-tokens", "2000")       # every 2048 tokens
    long_system = (prose(["argparse", "asyncio", "collections", "email", "logging"]) * 4)[:20000]
    try:
        _, _, usages = conversation(server, USER_TURNS[:1], [{"role": "system", "content": long_system}])
        assert usages[0]["prompt_tokens"] > 2 * 2048
        # Another conversation: mlx-lm's LRU (one entry) drops the first one.
        conversation(server, USER_TURNS[1:2])
    finally:
        assert server.stop() == 0
    text = server.text()
    assert "kvstore: saved reason=continued tokens=2048 " in text
    assert "kvstore: saved reason=continued tokens=4096 " in text
    assert "kvstore: saved reason=evict " in text
    with KVStore(cache) as store:
        reasons = {Reason(e.reason).name for e in store.entries()}
    assert {"COLD", "CONTINUED", "EVICT", "SHUTDOWN"} <= reasons


BAD_REQUESTS = {
    "invalid_json": (None, b"{not json"),
    "not_an_object": (None, b"[1, 2]"),
    "empty_messages": ({"messages": [], "max_tokens": 4}, None),
    "no_messages": ({"max_tokens": 4}, None),
    "negative_max_tokens": ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": -5}, None),
    "string_max_tokens": ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": "many"}, None),
}


def test_bad_requests_answer_like_stock(model_dir, workdir, stock):
    cache = os.path.join(workdir, "cache-bad")
    server = kvstore_server(model_dir, cache, workdir, "bad")
    try:
        for case, (body, raw) in BAD_REQUESTS.items():
            got, want = server.post(body, raw), stock[0].post(body, raw)
            assert got[0] == want[0] and got[0] >= 400, (case, got, want)
        # The server and its cache stay usable after them.
        _, answers, _ = conversation(server, USER_TURNS[:1])
        assert answers[0] == stock[1][0]
    finally:
        assert server.stop() == 0
    with KVStore(cache) as store:
        assert store.entries()
        for e in store.entries():
            assert verify_file(e.path) is None


@pytest.mark.parametrize("args, message", [
    ([], "--model PATH is required"),
    (["--model", "/nonexistent/model-dir"], "--model /nonexistent/model-dir: no such model directory"),
    (["--model", "."+ os.sep + "missing", "--budget-mb", "1"], "no such model directory"),
])
def test_bad_command_lines_exit_2_with_one_message(args, message, workdir):
    p = subprocess.run([sys.executable, "-m", "kvstore", "serve", *args], cwd=workdir,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr
    assert message in p.stderr and "Traceback" not in p.stderr


def test_bad_option_values_exit_2(model_dir, workdir):
    p = subprocess.run([sys.executable, "-m", "kvstore", "serve", "--model", model_dir, "--budget-mb", "-1"],
                       cwd=workdir, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "--budget-mb -1.0 must be >= 0" in p.stderr


def test_a_model_that_does_not_load_stops_the_server_with_status_1(tmp_path, workdir):
    empty = tmp_path / "not-a-model"
    empty.mkdir()
    p = subprocess.run([sys.executable, "-m", "kvstore", "serve", "--model", str(empty),
                        "--cache-dir", str(tmp_path / "cache"), "--port", str(free_port())],
                       cwd=workdir, capture_output=True, text=True, timeout=120)
    assert p.returncode == 1
    assert "kvstore: generation thread stopped; shutting down" in p.stderr


def test_split_at_waypoints_cuts_at_absolute_multiples():
    segs, types = split_at_waypoints([list(range(5)), list(range(5, 23))], ["system", "user"], 4)
    assert [len(s) for s in segs] == [4, 1, 3, 4, 4, 4, 3]
    assert types == ["user", "system", "user", "user", "user", "user", "user"]
    assert sum(segs, []) == list(range(23))
    ends = [sum(len(s) for s in segs[:i + 1]) for i in range(len(segs))]
    assert ends == [4, 5, 8, 12, 16, 20, 23]


def test_a_prompt_that_leaves_the_conversation_reuses_it_up_to_its_last_block(model_dir, workdir, tmp_path):
    """Chains: after a restart, a client that renders the last answer differently
    (its reasoning stripped, say) gets the stored conversation back up to the
    last block boundary before the difference, not only the system anchor."""
    from kvstore.demo.model import make_tokenizer
    tok = make_tokenizer(tmp_path / "tok")             # the model directory's tokenizer, trained alike
    tools = prose(["json", "csv", "logging", "argparse"])
    turns = [f"Tool output {i}:\n{tools[3000 * i:3000 * i + 2400]}" for i in range(3)]
    cache = os.path.join(workdir, "cache-edited")
    first = kvstore_server(model_dir, cache, workdir, "edited-first")
    try:
        messages, _, _ = conversation(first, turns)
    finally:
        assert first.stop() == 0
    # The client sends back the third answer rewritten: the prompt leaves the
    # stored conversation where that answer starts.
    edited = messages[:-1] + [{"role": "assistant", "content": "(reasoning removed) Done."}]
    second = kvstore_server(model_dir, cache, workdir, "edited-second")
    try:
        _, _, usages = conversation(second, ["Thanks, one more question."], edited)
    finally:
        second.stop()
    stored = tok.encode(tok.render_chat(messages[:-1]))            # the third turn's prompt
    new = tok.encode(tok.render_chat(edited + [{"role": "user", "content": "Thanks, one more question."}]))
    common = next((i for i, (a, b) in enumerate(zip(stored, new)) if a != b), min(len(stored), len(new)))
    anchor = len(tok.encode(tok.render_chat(messages[:1] + [{"role": "user", "content": ""}])))
    cached = usages[0]["prompt_tokens_details"]["cached_tokens"]
    assert common > 3 * 256 and anchor < 0.8 * common              # the system anchor alone would miss
    assert common - 256 <= cached <= common and cached >= 0.9 * common, (cached, common)
    assert second.request_lines()[0].startswith("request source=disk ")


def test_two_models_one_cache_root_each_gets_only_its_own_state(model_dir, workdir, tmp_path, stock):
    """Two model directories that differ only in their weights (same config,
    tokenizer and file sizes), served one after the other on one cache root:
    each server reuses only its own model's state and answers as it does
    cold; then a file rewritten to pass for A's with B's tensors (A's name,
    tag and manifest, valid CRCs) is caught by the canary."""
    other = str(tmp_path / "model-b")
    write_model_dir(other, seed=4)
    assert os.path.getsize(os.path.join(other, "model.safetensors")) == \
        os.path.getsize(os.path.join(model_dir, "model.safetensors"))
    cache = os.path.join(workdir, "cache-two-models")
    messages = [{"role": "system", "content": SYSTEM_PROMPT}]

    def turn(model, name, cache_dir=cache):
        server = kvstore_server(model, cache_dir, workdir, name)
        try:
            _, answers, _ = conversation(server, USER_TURNS[:1], messages)
        finally:
            assert server.stop() == 0
        return answers[0], server.request_lines()[0].split()[1], server.text()

    b_cold, source, _ = turn(other, "b-alone", os.path.join(workdir, "cache-b-alone"))
    assert source == "source=none"
    a1, source, _ = turn(model_dir, "a-first")
    assert source == "source=none" and a1 == stock[1][0]
    assert a1 != b_cold
    b1, source, _ = turn(other, "b-second")          # A's anchor is there: not B's
    assert source == "source=none" and b1 == b_cold
    a2, source, log_a = turn(model_dir, "a-again")
    assert source == "source=disk" and a2 == a1 and "canary_failed" not in log_a
    b2, source, _ = turn(other, "b-again")
    assert source == "source=disk" and b2 == b_cold

    # Both models are named, and share one budget, in kvstore ls and stats.
    ls = subprocess.run([sys.executable, "-m", "kvstore", "ls", cache], capture_output=True, text=True,
                        cwd=str(workdir))
    assert ls.returncode == 0 and "serve-model" in ls.stdout and "model-b" in ls.stdout, ls.stdout

    # The forgery: B's chain, saved again through a store opened with A's identity.
    rows = registry.read_registry(cache)
    ident = {r["label"]: r["identity"] for r in rows.values()}
    a_id, b_id = ident[os.path.basename(model_dir)], ident["model-b"]
    with KVStore(cache, model_identity=b_id, budget_mb=0) as b_store:
        b_entries = [e for e in b_store.entries() if e.model_tag == b_store.model_tag and e.ends_save]
        forged = [b_store.load(e, min_tokens=0, consume=False) for e in b_entries]
    with KVStore(cache, model_identity=a_id, budget_mb=0) as a_store:
        for e in a_store.entries():
            if e.model_tag == a_store.model_tag:
                os.unlink(e.path)                       # A's own state gone: only the forgery is left
        for ck in forged:
            assert a_store.save(ck.text_bytes, ck.tokens, ck.tensors, meta=ck.meta, reason=ck.entry.reason,
                                positional=ck.positional, text_offsets=ck.cuts, dtypes=ck.dtypes) is not None
    a3, source, log_a = turn(model_dir, "a-forged")
    assert a3 == a1, "the forged state must never answer"
    assert "kvstore: canary_failed" in log_a and source == "source=none", log_a
    assert os.listdir(os.path.join(cache, ".quarantine"))


# ---- SIGTERM drains ----------------------------------------------------------------------------

def stream(server, max_tokens, events, ban=(1,)):
    """A streaming chat completion read event by event into events (the parsed
    data lines; "[DONE]" as it is); the EOS token banned so that the answer runs
    to max_tokens."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    body = json.dumps({"messages": [{"role": "user", "content": "Tell me everything about shelves."}],
                       "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
                       "logit_bias": {str(t): -100.0 for t in ban}}).encode()
    try:
        conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        events.append(("status", resp.status))
        while True:
            line = resp.readline()
            if not line:
                break
            if line.startswith(b"data:"):
                payload = line[5:].strip()
                events.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
    finally:
        conn.close()


def chunks(events):
    return [e for e in events if isinstance(e, dict) and e.get("choices")]


def wait_for(cond, timeout=60):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


@contextlib.contextmanager
def signalled_mid_stream(server, max_tokens):
    """A streaming answer of max_tokens, SIGTERM after its fifth chunk.

    Yields {"events": the stream's events as they come}; on leaving, the
    stream has been read to its end and "rc" holds the server's exit code.
    """
    events = []
    t = threading.Thread(target=stream, args=(server, max_tokens, events))
    t.start()
    out = {"events": events}
    try:
        wait_for(lambda: len(chunks(events)) >= 5)
        server.proc.send_signal(signal.SIGTERM)
        yield out
    finally:
        t.join(120)
        out["rc"] = server.proc.wait(120)
        server.log.close()


def test_sigterm_lets_a_streaming_answer_finish_and_refuses_new_requests(model_dir, workdir):
    server = kvstore_server(model_dir, os.path.join(workdir, "cache-drain"), workdir, "drain")
    with signalled_mid_stream(server, 300) as run:
        wait_for(lambda: "kvstore: draining" in server.text())
        # A request sent now is refused, politely, while the stream goes on.
        status, r = server.post({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        assert status == 503 and "retry" in r["error"]
        req = urllib.request.Request(server.url("/health"))
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=10)
        assert e.value.code == 503 and e.value.headers["Retry-After"]
    events, rc = run["events"], run["rc"]
    got = chunks(events)
    assert events[0] == ("status", 200) and events[-1] == "[DONE]"
    assert got[-1]["choices"][0]["finish_reason"] == "length", got[-1]
    assert len(got) >= 250                                   # the whole answer, not a cut one
    assert rc == 0, server.text()
    log = server.text()
    assert "kvstore: drained ok=1 left=0" in log and "kvstore: shutdown queued=" in log


def test_a_stream_the_drain_timeout_cuts_ends_with_an_error_not_a_silent_end(model_dir, workdir):
    server = kvstore_server(model_dir, os.path.join(workdir, "cache-cut"), workdir, "cut",
                            "--drain-timeout", "0.5")
    with signalled_mid_stream(server, 100_000) as run:
        pass
    events, rc = run["events"], run["rc"]
    assert "[DONE]" not in events and all(c["choices"][0]["finish_reason"] is None for c in chunks(events))
    assert "error" in events[-1] and events[-1]["error"]["code"] == "server_shutting_down", events[-1]
    assert rc == 0
    assert "kvstore: request_cut reason=shutdown stream=1" in server.text()


# ---- requests that arrive together are admitted together ---------------------------------------

def test_requests_that_arrive_together_prefill_as_one_batch(tmp_path, workdir):
    """Four clients send distinct ~700-token prompts at once, the last one's
    body 0.1 s after its headers.  Stock mlx-lm takes every queued request
    before it prefills; kvstore serve prepares each on its HTTP thread first,
    so without the admission wait (which counts a request in from its request
    line) the first request starts prefilling alone and the others, starved,
    join seconds later.  The model is big enough (8 layers, hidden 256) that
    a prefill takes seconds here."""
    model = str(tmp_path / "model-8")
    _, tok = write_model_dir(model, seed=0, layers=8, hidden=256, heads=4, kv_heads=2, head_dim=64)
    text = prose(("argparse", "json", "logging", "pathlib", "threading"))
    systems, at = [], 0
    for i in range(4):
        t = text_of_tokens(tok, text[at:], 700)
        systems.append(f"Session {i}. {t}")
        at += len(t) + 1
    server = kvstore_server(model, tmp_path / "cache", workdir, "admit")
    try:
        server.chat([{"role": "user", "content": "hi"}], max_tokens=2)           # warm
        answers = server.post_together([{"messages": [{"role": "system", "content": s},
                                                      {"role": "user", "content": "Go on."}],
                                         "max_tokens": 8, "temperature": 0.0} for s in systems],
                                       late_body_s=0.1)
        assert [status for status, _ in answers] == [200] * 4, answers
    finally:
        server.stop()
    lines = [ln for ln in server.text().splitlines()
             if "kvstore: request source=" in ln or "Prompt processing progress" in ln]
    big = [i for i, ln in enumerate(lines) if "kvstore: request" in ln and int(ln.split("prefilled=")[1].split()[0]) > 500]
    progress = [i for i, ln in enumerate(lines) if "Prompt processing progress" in ln
                and int(ln.rsplit("/", 1)[1]) > 500]
    assert len(big) == 4 and progress
    # Every one of the four joined before any of them was prefilled.
    assert max(big) < min(progress), "\n".join(lines)


def test_a_prompt_repeated_after_a_restart_is_reused_to_its_last_token(model_dir, workdir):
    # Whole blocks alone would stop at the last 256-token boundary: the
    # shutdown also stores the state at the prompt's last token but one (a
    # tail), and the server prefills only the last token.
    cache = os.path.join(workdir, "cache-tail")
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": USER_TURNS[0]}]
    first = kvstore_server(model_dir, cache, workdir, "tail-1")
    try:
        r1 = first.chat(messages)
    finally:
        assert first.stop() == 0
    n = r1["usage"]["prompt_tokens"]
    assert n % 256 > 1                                    # the prompt does not end on a block boundary
    second = kvstore_server(model_dir, cache, workdir, "tail-2")
    try:
        r2 = second.chat(messages)
    finally:
        second.stop()
    assert r2["usage"]["prompt_tokens_details"]["cached_tokens"] == n - 1
    assert second.request_lines()[0].startswith(f"request source=disk reused={n - 1} prefilled=1 ")
    assert answer(r2) == answer(r1)


def test_disk_kv_bits_stores_quantised_blocks_and_a_restart_hits_them(model_dir, workdir):
    """kvstore serve --disk-kv-bits 8: the blocks are quantised (ABI 145) and
    the next server's disk hit passes the canary with q8's tolerance."""
    cache = os.path.join(workdir, "cache-q8")
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": USER_TURNS[0]}]
    first = kvstore_server(model_dir, cache, workdir, "q8-1", "--disk-kv-bits", "8")
    try:
        r1 = first.chat(messages)
    finally:
        assert first.stop() == 0
    abis = {read_entry(p).payload_abi for p in glob.glob(os.path.join(cache, "**", "*.kv"), recursive=True)}
    assert 145 in abis, abis
    second = kvstore_server(model_dir, cache, workdir, "q8-2", "--kv-codec", "q8")
    try:
        r2 = second.chat(messages)
    finally:
        second.stop()
    n = r1["usage"]["prompt_tokens"]
    assert r2["usage"]["prompt_tokens_details"]["cached_tokens"] == n - 1
    assert second.request_lines()[0].startswith(f"request source=disk reused={n - 1} prefilled=1 ")
    # The demo model's KV is float32, whose own tolerance (1e-3) a q8 restore
    # passes (~5e-3): the hit is the canary passing with q8's tolerance.
    with open(os.path.join(workdir, "q8-2.log")) as f:
        assert "canary_failed" not in f.read()


def test_kv_bits_states_are_stored_exact_under_disk_kv_bits(workdir, tmp_path):
    """kvstore serve --kv-bits 8 --disk-kv-bits 8: mlx-lm's QuantizedKVCache is
    8-bit already; its words, scales and biases are stored as they are (no
    block quantised again), and the next server's disk hit is the same state."""
    model = tmp_path / "model64"
    write_model_dir(model, seed=3, head_dim=64, hidden=128, heads=4, kv_heads=2)
    cache = tmp_path / "cache"
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": USER_TURNS[0]}]
    flags = ("--kv-bits", "8", "--kv-group-size", "64", "--quantized-kv-start", "0", "--disk-kv-bits", "8")
    first = kvstore_server(str(model), cache, workdir, "kvbits-1", *flags)
    try:
        r1 = first.chat(messages)
    finally:
        assert first.stop() == 0
    files = glob.glob(os.path.join(cache, "**", "*.kv"), recursive=True)
    assert files and {read_entry(p).payload_abi for p in files} == {17}, files    # raw chain blocks only
    second = kvstore_server(str(model), cache, workdir, "kvbits-2", *flags)
    try:
        r2 = second.chat(messages)
    finally:
        second.stop()
    n = r1["usage"]["prompt_tokens"]
    assert r2["usage"]["prompt_tokens_details"]["cached_tokens"] == n - 1     # the QuantizedKVCache restored
    assert second.request_lines()[0].startswith(f"request source=disk reused={n - 1} prefilled=1 ")
    # The same greedy answer (its logprobs differ in the last digits: the cold
    # prefill attended over chunks quantised as it went, the hit prefills one token).
    assert answer(r2)[0] == answer(r1)[0]
