"""Time to first token after a server restart: kvstore serve vs stock mlx_lm.server.

Run as a script path (not ``python -m``), so the installed ``kvstore`` is the
one imported:

    python bench/serve.py             # full run: a conversation of >= 4,096 tokens
    python bench/serve.py --quick     # a smaller model and conversation
    python bench/serve.py --json results.json

The workload is a four-turn chat with a long system prompt on a random-weight
mlx-lm llama (kvstore.demo.model) served over HTTP on 127.0.0.1.  For each
server kind, each round: start the server, play turns 1-3, stop it with
SIGTERM, start it again and time turn 4 (a non-streaming request with
max_tokens=1, request sent to response read: the time to first token plus
one HTTP round trip, the same for both).  Stock mlx_lm.server keeps its
prompt cache in RAM only, so after the restart it prefills the whole
conversation; kvstore serve loads the shutdown checkpoint of turn 3 from its
directory and prefills only the new turn.  Both servers must give the same
first token.
"""

import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from foundation import Report, finish, harness_arguments, machine_info, machine_lines  # noqa: E402

# Models sized for MLX's reference BLAS on 2 cores (as bench/ttft.py): the
# full model's cold prefill of 4,096 tokens takes several seconds.
FULL_MODEL = dict(seed=0, layers=3, hidden=128, heads=2, kv_heads=2, head_dim=32, intermediate=512)
QUICK_MODEL = dict(seed=0, layers=2, hidden=64, heads=2, kv_heads=1, head_dim=16)
FULL_SYSTEM_CHARS, QUICK_SYSTEM_CHARS = 20000, 9000     # about 4,300 and 1,950 tokens
FULL_ROUNDS, QUICK_ROUNDS = 3, 1
TARGET = 10.0                                            # stock / kvstore, the target
STARTUP_S = 120
TURNS = ["What does this module do?", "Show a short example.", "What can go wrong?",
         "Summarise the conversation in one line."]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cmd, cwd, log):
    """Starts a server; returns (process, base URL) once /health answers."""
    port = _free_port()
    proc = subprocess.Popen(cmd + ["--host", "127.0.0.1", "--port", str(port), "--log-level", "WARNING"],
                            cwd=cwd, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + STARTUP_S
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}: {' '.join(cmd)}")
        try:
            urllib.request.urlopen(base + "/health", timeout=2).read()
            return proc, base
        except OSError:
            if time.monotonic() > deadline:
                proc.kill()
                raise SystemExit(f"server not up after {STARTUP_S} s: {' '.join(cmd)}")
            time.sleep(0.2)


def stop(proc):
    proc.send_signal(signal.SIGTERM)
    proc.wait(120)


def chat(base, messages, max_tokens):
    body = json.dumps({"messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
                       "logprobs": True}).encode()
    req = urllib.request.Request(base + "/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter_ns()
    with urllib.request.urlopen(req, timeout=600) as r:
        out = json.load(r)
    return time.perf_counter_ns() - t0, out


def play(base, system, turns):
    """Turns 1-3; returns the messages for turn 4."""
    messages = [{"role": "system", "content": system}]
    for turn in turns:
        messages.append({"role": "user", "content": turn})
        _, r = chat(base, messages, 8)
        messages.append({"role": "assistant", "content": r["choices"][0]["message"]["content"]})
    return messages + [{"role": "user", "content": TURNS[3]}]


def first_token(r):
    return r["choices"][0]["logprobs"]["content"][0]["id"]


def round_for(kind, cmd, system, tmp, log):
    """One round of one server kind: (ttft_ns, usage, first token)."""
    proc, base = start(cmd, tmp, log)
    try:
        messages = play(base, system, TURNS[:3])
    finally:
        stop(proc)
    proc, base = start(cmd, tmp, log)
    try:
        ns, r = chat(base, messages, 1)
    finally:
        stop(proc)
    return ns, r["usage"], first_token(r)


def main(argv=None):
    args = harness_arguments(__doc__, "a smaller model and conversation", argv,
                             strict_help="exit 1 when the target is missed")

    from kvstore.demo import model as demo_model

    t_start = time.perf_counter()
    info = machine_info()
    spec = QUICK_MODEL if args.quick else FULL_MODEL
    rounds = QUICK_ROUNDS if args.quick else FULL_ROUNDS
    system = (demo_model.prose(["argparse", "collections", "json", "logging", "pathlib"]) * 4)[
        :QUICK_SYSTEM_CHARS if args.quick else FULL_SYSTEM_CHARS]
    samples = {"stock": [], "kvstore": []}
    seen = {}
    with tempfile.TemporaryDirectory(prefix="kvstore-bench-serve-") as tmp:
        model = os.path.join(tmp, "model")
        demo_model.write_model_dir(model, **spec)
        cmds = {"stock": [sys.executable, "-m", "mlx_lm", "server", "--model", model],
                "kvstore": [sys.executable, "-m", "kvstore", "serve", "--model", model,
                            "--cache-dir", os.path.join(tmp, "cache")]}
        with open(os.path.join(tmp, "servers.log"), "wb") as log:
            for i in range(rounds):
                # Alternate which kind goes first, so drift hits both alike.
                for kind in (("stock", "kvstore") if i % 2 == 0 else ("kvstore", "stock")):
                    ns, usage, tok = round_for(kind, cmds[kind], system, tmp, log)
                    samples[kind].append(ns)
                    seen.setdefault(kind, []).append((usage, tok))
                    print(f"  round {i + 1} {kind}: {ns / 1e6:.0f} ms, cached "
                          f"{usage['prompt_tokens_details']['cached_tokens']} of {usage['prompt_tokens']} "
                          "tokens", file=sys.stderr, flush=True)
    tokens = {tok for v in seen.values() for _, tok in v}
    if len(tokens) != 1:
        raise SystemExit(f"the servers sampled different first tokens: {seen}")
    prompt_tokens = seen["stock"][0][0]["prompt_tokens"]
    cached = seen["kvstore"][0][0]["prompt_tokens_details"]["cached_tokens"]

    report = Report()
    report.section("Time to first token of turn 4 after a restart: kvstore serve vs stock mlx_lm.server")
    st = {k: {"median_ns": statistics.median(v), "min_ns": min(v), "n": len(v)} for k, v in samples.items()}
    report.add(f"turn 4, {prompt_tokens:,}-token prompt, after SIGTERM + restart", st["kvstore"], st["stock"],
               "throughput", target=TARGET,
               note=f"kvstore reused {cached:,} tokens from disk; stock prefilled all")
    elapsed = time.perf_counter() - t_start
    cfg = demo_model.model_config(**{k: v for k, v in spec.items() if k != "seed"})
    print(f"# kvstore serve benchmark ({'quick' if args.quick else 'full'} run)\n")
    print(machine_lines(info))
    print(f"- model: random-weight mlx-lm llama, float32, {cfg['num_hidden_layers']} layers, hidden "
          f"{cfg['hidden_size']}; offline byte-level BPE tokenizer with a chat template")
    print(f"- rounds: {rounds}; each: start, turns 1-3 (8 tokens each), SIGTERM, start, turn 4 timed "
          "(max_tokens=1, request to response); ratio = stock time / kvstore time (higher is better)")
    print(f"- same first token from both servers in every round: {tokens.pop()}")
    print(f"- elapsed {elapsed:.1f} s\n")
    print(report.markdown())
    return finish(args, info, elapsed, report, model=cfg, samples_ns=samples)


if __name__ == "__main__":
    sys.exit(main())
