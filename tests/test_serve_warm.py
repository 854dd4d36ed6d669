"""Warm prompts (`kvstore serve --warm FILE`): prefilled and stored in the background
after start-up, skipped once stored, progress on /health and /metrics, and bad
files refused at start-up; against real server processes (urllib, as
tests/test_serve.py)."""

import json
import os
import subprocess
import sys
import time
import urllib.request

import pytest

pytest.importorskip("mlx_lm")

from kvstore import KVStore
from kvstore.demo.model import prose
from kvstore.serve import metrics as metrics_mod
from kvstore.serve.warm import read_file
from kvhelpers import free_port, kvstore_server

# Startup, model load and three warm prompts on a small CPU model.
WARM_TIMEOUT_S = 300


def chat_prompt(topic, question):
    """A chat of a system prompt of about 1,200 tokens and one question."""
    return [{"role": "system", "content": prose([topic])[:3000]}, {"role": "user", "content": question}]


CHAT_1 = ("json", "What is this about?")
CHAT_2 = ("csv", "Summarise it.")
TEXT_TOPIC = "logging"


def warm_prompts():
    return [chat_prompt(*CHAT_1), chat_prompt(*CHAT_2), prose([TEXT_TOPIC])[:3000]]


def write_json(path, doc):
    with open(path, "w") as f:
        json.dump(doc, f, indent=2)
    return str(path)


def get(server, path):
    with urllib.request.urlopen(server.url(path), timeout=30) as r:
        return r.status, r.read().decode()


def warm_status(server):
    status, body = get(server, "/health")
    assert status == 200, body
    return json.loads(body)["warm"]


def wait_warmed(server):
    deadline = time.monotonic() + WARM_TIMEOUT_S
    while True:
        warm = warm_status(server)
        if warm["finished"]:
            return warm
        assert server.proc.poll() is None, server.text()
        assert time.monotonic() < deadline, f"warming did not finish: {warm}\n{server.text()}"
        time.sleep(0.5)


def text_completion(server, prompt):
    req = urllib.request.Request(server.url("/v1/completions"),
                                 data=json.dumps({"prompt": prompt, "max_tokens": 2, "temperature": 0.0}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.load(r)


def checkpoints(cache):
    """(reason, tokens) of each save's last file in cache (what each store asked for)."""
    with KVStore(cache) as store:
        return sorted((e.reason.name.lower(), e.tokens) for e in store.entries() if e.ends_save)


@pytest.fixture(scope="module")
def warmed(model_dir, workdir):
    """A first server that warms the three prompts into an empty cache directory:
    its warm status and metrics once finished, and a request for the first prompt."""
    cache = os.path.join(workdir, "cache")
    # The object form, naming the served model by its label (the directory's name).
    warm = write_json(os.path.join(workdir, "warm.json"),
                      {"model": os.path.basename(model_dir), "prompts": warm_prompts()})
    server = kvstore_server(model_dir, cache, workdir, "warm-1", "--warm", warm)
    try:
        status = wait_warmed(server)
        saved = checkpoints(cache)          # while it runs: finished means on disk
        metrics = get(server, "/metrics")[1] if metrics_mod.available() else None
        code, r = server.post({"messages": chat_prompt(*CHAT_1), "max_tokens": 2, "temperature": 0.0})
        assert code == 200, r
        log = server.text()
    finally:
        assert server.stop() == 0
    return {"cache": cache, "warm": warm, "status": status, "saved": saved, "metrics": metrics, "usage": r["usage"],
            "log": log}


def test_warm_prompts_are_stored_in_the_background_and_health_says_when(warmed):
    assert warmed["status"] == {"total": 3, "done": 3, "stored": 3, "skipped": 0, "failed": 0, "finished": True}
    # Each prompt's state is on disk once warming has finished (the server
    # still running): one save of its whole blocks per prompt, at least.
    assert len([n for _, n in warmed["saved"] if n >= 512]) >= 3, warmed["saved"]
    # A request for a warm prompt reuses it.
    usage = warmed["usage"]
    reused = sum(usage["kvstore"]["reused_tokens"].values())
    assert reused > 0 or usage.get("prompt_tokens_details", {}).get("cached_tokens", 0) > 0, usage
    # Logged by index and outcome; never the prompts' text.
    assert warmed["log"].count("kvstore: warm index=") == 3 and "warm_done prompts=3 stored=3" in warmed["log"]
    assert prose([CHAT_2[0]])[:3000][200:260] not in warmed["log"]


def test_warm_prompts_are_counted_in_the_metrics(warmed):
    if warmed["metrics"] is None:
        pytest.skip("prometheus_client is not installed")
    text = warmed["metrics"]
    assert 'kvstore_warm_prompts_total{outcome="stored"} 3.0' in text, text
    assert 'kvstore_warm_prompts_total{outcome="skipped"} 0.0' in text
    assert 'kvstore_warm_prompts_total{outcome="failed"} 0.0' in text


def test_a_restart_skips_the_stored_prompts_and_serves_them_from_disk(warmed, model_dir, workdir):
    server = kvstore_server(model_dir, warmed["cache"], workdir, "warm-2", "--warm", warmed["warm"])
    try:
        status = wait_warmed(server)
        assert status == {"total": 3, "done": 3, "stored": 0, "skipped": 3, "failed": 0, "finished": True}
        # Skipped without a request: nothing was prefilled.
        assert server.request_lines() == [], server.request_lines()
        # What the first server stored is what a request for each prompt reuses.
        code, r = server.post({"messages": chat_prompt(*CHAT_2), "max_tokens": 2, "temperature": 0.0})
        assert code == 200, r
        trace = r["usage"]["kvstore"]
        assert trace["source"] == "disk" and trace["reused_tokens"]["disk"] >= 512, trace
        trace = text_completion(server, warm_prompts()[2])["usage"]["kvstore"]
        assert trace["source"] == "disk" and trace["reused_tokens"]["disk"] >= 512, trace
    finally:
        assert server.stop() == 0


def run_serve(model_dir, cache, warm, workdir, timeout=240):
    return subprocess.run([sys.executable, "-m", "kvstore", "serve", "--model", model_dir, "--cache-dir", str(cache),
                           "--warm", warm, "--host", "127.0.0.1", "--port", str(free_port())],
                          cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=timeout)


@pytest.mark.parametrize("name, text, message", [
    ("not-json.json", '[\n  ["a",\n', "is not valid JSON: line 3 column 1"),
    ("bad-item.json", '[\n  "a prompt",\n  42\n]\n', "prompts[1]: a number, not a list of chat messages"),
    ("bad-message.json", '{"prompts": [[{"role": "user", "content": 7}]]}', 'prompts[0][0]: "content" must be'),
    ("bad-key.json", '{\n  "prompts": [],\n  "modle": "x"\n}', "line 3: unknown key 'modle'"),
])
def test_a_bad_warm_file_is_a_startup_error_naming_the_file(model_dir, workdir, name, text, message):
    path = os.path.join(workdir, name)
    with open(path, "w") as f:
        f.write(text)
    cache = os.path.join(workdir, "cache-" + name)
    p = run_serve(model_dir, cache, path, workdir, timeout=120)
    assert p.returncode == 2, p.stdout
    assert f"kvstore serve: error: --warm {path}: {message}" in p.stdout, p.stdout
    assert not os.path.exists(cache)


def test_a_warm_file_for_another_model_stops_the_server_before_it_serves(model_dir, workdir):
    path = write_json(os.path.join(workdir, "other-model.json"),
                      {"model": "another-model", "prompts": [chat_prompt(*CHAT_1)]})
    cache = os.path.join(workdir, "cache-other")
    p = run_serve(model_dir, cache, path, workdir)
    assert p.returncode == 2, p.stdout
    # json.dump(indent=2) puts "model" on line 2.
    assert f"kvstore serve: error: --warm {path}: line 2: \"model\" is 'another-model', but this server's model " \
           f"is '{os.path.basename(model_dir)}'" in p.stdout, p.stdout
    # Nothing warmed, nothing stored.
    assert "warm_start" not in p.stdout and "kvstore: request " not in p.stdout
    assert not any(n.endswith(".kv") for _, _, names in os.walk(cache) for n in names)


def test_read_file_takes_each_form_of_prompt_and_finds_the_model_line(tmp_path):
    path = write_json(tmp_path / "w.json", {"prompts": [[{"role": "user", "content": "hi"}], "text",
                                                        {"messages": [{"role": "system", "content": "s"}]},
                                                        {"prompt": "p"}], "model": "m"})
    w = read_file(path)
    assert [(p.messages is not None, p.prompt) for p in w.prompts] == [(True, None), (False, "text"),
                                                                       (True, None), (False, "p")]
    assert (w.model, w.model_line) == ("m", 22)          # json.dump(indent=2): its last key
    assert "text" not in repr(w)           # prompt text stays out of a repr
    assert read_file(write_json(tmp_path / "l.json", ["a"])).model is None
