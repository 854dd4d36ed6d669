"""kvstore serve at scale: real server processes and real concurrent clients.

- a disk load runs on the HTTP thread of its request: the batch keeps
  decoding while it streams in (a test whose load is held open by a gate
  fails if the load blocks other sessions' decoding);
- a client that leaves while its cache loads: the load is dropped;
- a checkpoint that is corrupt when its request comes: a cold prefill, the
  other sessions untouched;
- tenants (cache_salt), GET /metrics, the write budget and admission.

The gate: the server runs in a child process whose KVStore.load first
creates <gate>/entered and then waits until <gate>/release exists; nothing
else of the server is changed.
"""

import glob
import http.client
import json
import os
import shutil
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

pytest.importorskip("mlx_lm")
prometheus = pytest.importorskip("prometheus_client.parser")

from kvstore import KVStore
from kvstore import tenants
import kvhelpers
from kvhelpers import Server, flip, kvstore_server, system_prompt, wait_for_file

SYSTEM = system_prompt()
GATE_S = 120

_GATED = """
import os, sys, time
import kvstore.store
gate = os.environ["KVSTORE_TEST_GATE"]
_load = kvstore.store.KVStore.load
def load(self, *a, **kw):
    open(os.path.join(gate, "entered"), "w").close()
    deadline = time.monotonic() + %d
    while not os.path.exists(os.path.join(gate, "release")) and time.monotonic() < deadline:
        time.sleep(0.02)
    return _load(self, *a, **kw)
kvstore.store.KVStore.load = load
import threading
import kvstore.payload
_readinto = kvstore.payload.VirtualBlob.readinto
def readinto(self, b):
    # Python entered from a thread Python did not start: an MLX task (mx.load's callback).
    if isinstance(threading.current_thread(), threading._DummyThread):
        open(os.path.join(gate, "python_in_mlx"), "w").close()
    return _readinto(self, b)
kvstore.payload.VirtualBlob.readinto = readinto
from kvstore.cli import main
sys.exit(main(sys.argv[1:]))
""" % GATE_S


_SLOW_START = """
import sys, time
from mlx_lm import server
_load = server.ModelProvider.load_default
def load_default(self):
    time.sleep(3)
    return _load(self)
server.ModelProvider.load_default = load_default
from kvstore.cli import main
sys.exit(main(sys.argv[1:]))
"""


# The model directory (tests/conftest.py model_dir) is seeded with this.
MODEL_SEED = 5


def gated_server(model_dir, cache_dir, workdir, name, gate, *extra):
    return kvhelpers.gated_server(_GATED, model_dir, cache_dir, workdir, name, gate, *extra)


def messages_b(i=0):
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Summarise part {i}."}]


class Stream:
    """A streaming chat completion read on a thread: the tokens as they arrive."""

    def __init__(self, server, messages, max_tokens, **extra):
        self.tokens = []
        self.done = threading.Event()
        self.error = None
        body = json.dumps({"messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
                           "stream": True, **extra}).encode()
        self.conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=300)
        self.conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self):
        try:
            r = self.conn.getresponse()
            assert r.status == 200, r.read()
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                delta = json.loads(line[6:])["choices"][0]
                if delta.get("delta", {}).get("content") is not None or delta.get("finish_reason"):
                    self.tokens.append(time.monotonic())
        except Exception as e:        # noqa: BLE001 - reported by the test
            self.error = e
        finally:
            self.done.set()

    def wait_for(self, n, timeout):
        deadline = time.monotonic() + timeout
        while len(self.tokens) < n and time.monotonic() < deadline and not self.done.is_set():
            time.sleep(0.02)
        return len(self.tokens) >= n


@pytest.fixture(scope="module")
def stored(model_dir, workdir):
    """A cache directory holding conversation B (system prompt + a user turn) from a first server."""
    cache = os.path.join(workdir, "cache-b")
    first = kvstore_server(model_dir, cache, workdir, "store-b")
    try:
        first.chat(messages_b(), max_tokens=4)
    finally:
        assert first.stop() == 0
    return cache


def test_a_disk_load_does_not_stop_other_sessions_decoding(model_dir, workdir, stored, tmp_path):
    gate = tmp_path / "gate"
    server = gated_server(model_dir, stored, workdir, "gated", gate)
    try:
        a = Stream(server, [{"role": "user", "content": "Count slowly."}], max_tokens=400)
        assert a.wait_for(5, 60), (a.error, server.text())
        result = {}
        b = threading.Thread(target=lambda: result.setdefault("b", server.chat(messages_b(), max_tokens=4)))
        b.start()
        wait_for_file(gate / "entered", server)
        # B's load is held open: A must keep decoding meanwhile.
        n0 = len(a.tokens)
        progressed = a.wait_for(n0 + 20, 30)
        held = not (gate / "release").exists() and "b" not in result
        (gate / "release").touch()
        b.join(120)
        assert progressed and held, f"A decoded {len(a.tokens) - n0} tokens while B loaded"
        assert "b" in result
        assert any("source=disk" in line for line in server.request_lines()), server.request_lines()
        # The load ran beside the decoding thread without calling Python from inside MLX.
        assert not (gate / "python_in_mlx").exists()
        a.done.wait(300)
        assert a.error is None
    finally:
        (gate / "release").touch()
        server.stop()


def test_a_request_that_comes_while_the_model_loads_still_gets_its_disk_hit(model_dir, workdir, stored):
    cmd = [sys.executable, "-c", _SLOW_START, "serve", "--model", model_dir, "--cache-dir", str(stored)]
    server = Server(cmd, workdir, os.path.join(workdir, "slow-start.log"), ready=False)
    try:
        # Until its store is open the server is not ready: /health says so,
        # and the store's directory may not exist yet.
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(server.url("/health"), timeout=10)
        assert e.value.code == 503 and json.loads(e.value.read()) == {"status": "loading"}
        assert e.value.headers["Retry-After"]
        server.chat(messages_b(), max_tokens=4)         # sent at once: the model is still loading
        assert server.request_lines()[0].startswith("request source=disk "), server.request_lines()
        assert "load_on_generation_thread" not in server.text()      # loaded on its HTTP thread
        with urllib.request.urlopen(server.url("/health"), timeout=10) as r:
            assert r.status == 200 and json.load(r)["status"] == "ok"
    finally:
        server.stop()


def test_a_client_that_leaves_while_its_cache_loads_drops_the_load(model_dir, workdir, stored, tmp_path):
    gate = tmp_path / "gate"
    server = gated_server(model_dir, stored, workdir, "gone", gate)
    try:
        body = json.dumps({"messages": messages_b(), "max_tokens": 4, "temperature": 0.0}).encode()
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
        conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        wait_for_file(gate / "entered", server)
        conn.sock.shutdown(2)
        conn.close()
        (gate / "release").touch()
        deadline = time.monotonic() + 60
        while "request_dropped reason=client_gone loaded=1" not in server.text():
            assert time.monotonic() < deadline, server.text()
            time.sleep(0.1)
        # The dropped request never reached the generation thread; the next one is served.
        assert not any("source=disk" in line for line in server.request_lines())
        r = server.chat(messages_b(), max_tokens=4)
        assert r["choices"][0]["message"]["content"] is not None
        assert any("source=disk" in line for line in server.request_lines())
    finally:
        (gate / "release").touch()
        server.stop()


def test_a_corrupt_checkpoint_is_a_cold_prefill_and_the_batch_goes_on(model_dir, workdir, tmp_path):
    cache = tmp_path / "cache"
    first = kvstore_server(model_dir, cache, workdir, "corrupt-1")
    try:
        cold = first.chat(messages_b(1), max_tokens=4)
    finally:
        first.stop()
    with KVStore(str(cache)) as s:
        for e in s.entries():
            flip(e.path, e.file_size - 100)
    server = kvstore_server(model_dir, cache, workdir, "corrupt-2")
    try:
        a = Stream(server, [{"role": "user", "content": "Count slowly."}], max_tokens=200)
        assert a.wait_for(3, 60)
        again = server.chat(messages_b(1), max_tokens=4)
        assert again["choices"][0]["message"]["content"] == cold["choices"][0]["message"]["content"]
        lines = server.request_lines()
        assert not any("source=disk" in line for line in lines), lines
        assert "corrupt" in server.text()
        a.done.wait(300)
        assert a.error is None and len(a.tokens) > 3
    finally:
        server.stop()


# ---- tenants ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def salted(model_dir, workdir):
    cache = os.path.join(workdir, "cache-salt")
    server = kvstore_server(model_dir, cache, workdir, "salt-1")
    try:
        a1 = server.post(_body(messages_b(2), "tenant-a-secret-salt"))
        b1 = server.post(_body(messages_b(2), "tenant-b-secret-salt"))
        a2 = server.post(_body(messages_b(2), "tenant-a-secret-salt"))
        first_lines = server.request_lines()
    finally:
        server.stop()
    server = kvstore_server(model_dir, cache, workdir, "salt-2")
    try:
        after = [server.post(_body(messages_b(2), s)) for s in ("tenant-b-secret-salt", "tenant-c-secret-salt")]
        second_lines = server.request_lines()
    finally:
        server.stop()
    return dict(cache=cache, first=(a1, b1, a2), first_lines=first_lines, after=after, second_lines=second_lines)


def _body(messages, salt, max_tokens=4):
    return {"messages": messages, "max_tokens": max_tokens, "temperature": 0.0, "cache_salt": salt}


def test_tenants_never_share_a_cached_prefix(salted):
    assert all(status == 200 for status, _ in salted["first"] + tuple(salted["after"]))
    first = salted["first_lines"]
    # In RAM: b's identical prompt is not served from a's cache; a's second request is.
    assert first[0].startswith("request source=none") and first[1].startswith("request source=none"), first
    assert first[2].startswith("request source=ram"), first
    # On disk, after a restart: b finds its own checkpoint, c (never seen) nothing.
    second = salted["second_lines"]
    assert second[0].startswith("request source=disk") and second[1].startswith("request source=none"), second


def test_the_salt_is_never_written_in_clear(salted):
    needle = b"secret-salt"
    for root, _, names in os.walk(salted["cache"]):
        for name in names:
            with open(os.path.join(root, name), "rb") as f:
                assert needle not in f.read(), name
    for line in salted["first_lines"] + salted["second_lines"]:
        assert "secret" not in line


@pytest.mark.parametrize("salt, message", [(7, "must be a string"), ("", "must not be empty"),
                                           ("x" * (tenants.MAX_SALT_CHARS + 1), "at most")])
def test_a_bad_cache_salt_is_a_400(model_dir, workdir, salt, message, running):
    status, r = running.post(_body(messages_b(), salt))
    assert status == 400 and message in r["error"], r


@pytest.fixture(scope="module")
def running(model_dir, workdir):
    server = kvstore_server(model_dir, os.path.join(workdir, "cache-running"), workdir, "running")
    yield server
    server.stop()


def test_require_cache_salt_refuses_requests_without_one(model_dir, workdir, tmp_path):
    server = kvstore_server(model_dir, tmp_path / "c", workdir, "require", "--require-cache-salt")
    try:
        status, r = server.post({"messages": messages_b(), "max_tokens": 2})
        assert status == 400 and "cache_salt is required" in r["error"]
        status, _ = server.post(_body(messages_b(), "t1"))
        assert status == 200
    finally:
        server.stop()


# ---- metrics ----------------------------------------------------------------------------------

def scrape(server):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("GET", "/metrics")
    r = conn.getresponse()
    body = r.read().decode()
    assert r.status == 200, body
    out = {}
    for family in prometheus.text_string_to_metric_families(body):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_metrics_count_requests_by_source_and_the_directory(model_dir, workdir, stored):
    server = kvstore_server(model_dir, stored, workdir, "metrics")
    try:
        server.chat(messages_b(), max_tokens=4)                       # a disk hit
        server.chat([{"role": "user", "content": "hello"}], max_tokens=2)   # nothing to reuse
        m = scrape(server)
        assert m[("kvstore_requests_total", (("source", "disk"),))] == 1
        assert sum(m[("kvstore_requests_total", (("source", s),))] for s in ("ram", "disk", "remote", "none")) == 2
        assert m[("kvstore_tokens_reused_total", (("source", "disk"),))] > 500
        assert m[("kvstore_tokens_prefilled_total", ())] > 0
        assert m[("kvstore_request_load_seconds_count", (("source", "disk"),))] == 1
        assert m[("kvstore_entries", ())] >= 1 and m[("kvstore_bytes", ())] > 0
        # No --budget-mb: the default derived from the filesystem; no chain near it.
        with KVStore(stored) as s:
            assert s.budget_derived and m[("kvstore_budget_bytes", ())] == s.budget_bytes
        # Said once at start, with where it came from.
        said = [line for line in server.text().splitlines() if "budget" in line and "kvstore:" in line]
        assert len(said) == 1 and f"store_budget bytes={s.budget_bytes} derived_from_filesystem=yes" in said[0], said
        assert m[("kvstore_chains_over_half_budget_total", ())] == 0
        # The directory's cumulative counters: the first server's saves, this one's load.
        assert m[("kvstore_directory_loads_total", ())] >= 1
        assert m[("kvstore_directory_load_seconds_count", ())] >= 1
        assert m[("kvstore_directory_saves_total", ())] >= 1
        assert m[("kvstore_directory_written_bytes_total", ())] > 0
    finally:
        server.stop()


def test_metrics_scraped_while_the_store_is_wiped(model_dir, workdir, tmp_path, stored):
    import shutil
    import subprocess
    cache = tmp_path / "c"
    shutil.copytree(stored, cache)
    server = kvstore_server(model_dir, cache, workdir, "wipe")
    try:
        wipe = subprocess.Popen([sys.executable, "-m", "kvstore", "wipe", str(cache), "--yes"],
                                cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        while wipe.poll() is None:
            scrape(server)
        assert wipe.returncode == 0, wipe.stdout.read()
        assert scrape(server)[("kvstore_entries", ())] == 0
    finally:
        server.stop()


# ---- admission --------------------------------------------------------------------------------

def test_admit_after_stores_a_prefix_once_enough_requests_used_it(model_dir, workdir, tmp_path):
    cache = tmp_path / "c"
    server = kvstore_server(model_dir, cache, workdir, "admit", "--admit-after", "2")
    try:
        server.chat(messages_b(1), max_tokens=4)
        assert "why=admission" in server.text()
        time.sleep(0.5)
        assert not glob.glob(os.path.join(cache, "*.kv"))            # used once: nothing stored
        server.chat(messages_b(2), max_tokens=4)
    finally:
        assert server.stop() == 0
    # The system prompt was used by both requests: stored, up to its last
    # 256-token boundary; neither user turn was used twice.
    with KVStore(str(cache)) as s:
        entries = s.entries()
        assert entries and max(e.tokens for e in entries) % 256 == 0
        for e in entries:
            with open(e.path, "rb") as f:
                assert b"Summarise part" not in f.read()


def test_a_disk_hit_is_not_captured_again_when_it_finishes(model_dir, workdir, stored, tmp_path):
    # The finished request's whole blocks are the chain it loaded: the tier
    # knows they are on disk and does not copy the state to store it again
    # (a capture of a large state costs the generation thread a copy).
    cache = tmp_path / "c"
    shutil.copytree(stored, cache)
    server = kvstore_server(model_dir, cache, workdir, "known")
    try:
        server.chat(messages_b(), max_tokens=4)
    finally:
        assert server.stop() == 0
    text = server.text()
    line = server.request_lines()[0]
    assert line.startswith("request source=disk "), line
    reused = int(line.split("reused=")[1].split()[0])
    assert f"store_skipped reason=continued why=stored tokens={reused // 256 * 256}" in text
    assert "save_kept" not in text, text


# ---- the write budget ---------------------------------------------------------------------------

def long_turn(i):
    return [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Question {i}: " + SYSTEM[::-1][:2400]}]


def test_the_write_budget_skips_waypoints_before_anchors_and_shows_in_metrics(model_dir, workdir, tmp_path):
    """A budget of 1.2 anchors: the system anchor is stored; the finished
    requests' new blocks (worth less: their floor is half the budget) are
    skipped, logged and counted in GET /metrics and in the directory."""
    probe = tmp_path / "probe"
    server = kvstore_server(model_dir, probe, workdir, "budget-probe")
    try:
        server.chat(long_turn(0), max_tokens=4)
    finally:
        server.stop()
    with KVStore(str(probe)) as s:
        entries = s.entries()
        cold = [e for e in entries if e.reason.name == "COLD"]
        # The anchor's bytes: its own block and the blocks before it.
        assert len(cold) == 1
        anchor = sum(e.file_size for e in entries if e.tokens <= cold[0].token_start) + cold[0].file_size
        assert anchor < sum(e.file_size for e in entries)
    cache = tmp_path / "c"
    mb = 1.2 * anchor / (1 << 20)
    server = kvstore_server(model_dir, cache, workdir, "budget", "--max-write-mb-per-hour", f"{mb:.6f}")
    try:
        server.chat(long_turn(1), max_tokens=4)
        deadline = time.monotonic() + 30
        while "why=write_budget" not in server.text():
            assert time.monotonic() < deadline, server.text()
            time.sleep(0.1)
        m = scrape(server)
        assert m[("kvstore_directory_stores_skipped_write_budget_total", ())] >= 1
        capacity = m[("kvstore_write_budget_capacity_bytes", ())]
        assert abs(capacity - mb * (1 << 20)) < 2
        assert m[("kvstore_write_budget_available_bytes", ())] < 0.5 * capacity
    finally:
        server.stop()
    with KVStore(str(cache)) as s:
        entries = s.entries()
        leaf = max(entries, key=lambda e: e.tokens)
        assert leaf.reason.name == "COLD" and leaf.tokens == cold[0].tokens       # the anchor alone
        assert sum(e.file_size for e in entries) == anchor
        assert s.counters()["stores_skipped_write_budget"] >= 1
