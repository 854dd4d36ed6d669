"""kvstore serve under load: concurrent agent sessions across a restart, and decoding while a checkpoint loads.

Run as a script path (not ``python -m``), so the installed ``kvstore`` is the
one imported:

    python bench/serve_load.py             # full run, about 8 minutes on the 2-core VM
    python bench/serve_load.py --quick     # a smaller model and prompts, about 2 minutes
    python bench/serve_load.py --json results.json --strict

Both servers run the same random-weight mlx-lm llama (kvstore.demo.model)
with the same flags, over HTTP on 127.0.0.1: kvstore serve and stock
`python -m mlx_lm server`.  Every request is a streaming chat completion
(temperature 0, the end-of-sequence token banned with logit_bias so every
answer has its full length), and the time to first token (TTFT) is measured
from the request being sent to the first `data:` chunk (mlx-lm writes one
only once a token has text); the token counts come from the usage chunk
(stream_options.include_usage).

A. Load.  1, 4 and 8 agent sessions run at once (one thread each; the
   sessions of a phase start together).  Every session opens with the same
   system prompt (about 4,000 tokens of standard-library docstrings; 2,000
   with --quick) and plays 4 turns; each user turn pastes a tool output of
   its own (300 tokens; 200 with --quick; no two sessions or turns share
   one) and asks a question, with max_tokens=16.  The history is re-sent
   each turn with the server's own answers, as chat clients do.  After
   turn 2 of every session both servers are stopped with SIGTERM and
   started again (kvstore serve on the same cache directory, a fresh one
   for each concurrency), and the sessions play turns 3 and 4.  Stock
   mlx_lm.server keeps its prompt cache in RAM only, so turn 3 prefills
   every session's whole conversation; kvstore serve loads what it stored
   (the system-prompt anchor, the whole blocks of every finished request,
   the shutdown states) and prefills the rest.  Reported per server kind
   and concurrency:
   - TTFT p50 and p95 over the turns after the restart (3 and 4: the
     headline, ratio = kvstore / stock, lower is better), over turns 1-2
     and over all turns (p95: linear interpolation between the samples,
     so with 2 samples it is almost the larger one);
   - throughput: completion tokens and prompt tokens per second of wall
     time, summed over both phases (the restart itself is not counted;
     its time, SIGTERM to exit plus start to /health, is in the notes);
   - the bytes kvstore serve left in its cache directory (and its
     `bytes_written` counter, where `kvstore stats --json` has one), against
     the KV bytes of the distinct tokens the sessions sent and received;
   - where kvstore serve's requests after the restart found their prefix
     (its `kvstore: request source=... reused=...` log lines).
   The kinds take turns going first from one concurrency to the next.
   bench/serve_load.png draws the TTFT p50/p95 by concurrency.

B. Decoding while another session's checkpoint loads (kvstore serve only;
   stock mlx_lm.server has no disk tier).  A second model with a large KV
   per token (16 layers x 16 KV heads x 128 dims, float32: 256 KiB per
   token, a small hidden size so that it decodes quickly) and a prompt P of
   about 4,200 tokens (a long system prompt and a short question) whose
   first len(P) - 1 tokens hold over 1 GiB of KV.  P's checkpoint is
   written straight into the cache directory as kvstore serve would store
   it (a cold prefill of P takes minutes on 2 cores): random KV arrays of
   the model's cache shapes but for the last token's, which the model
   computes over them (so the state passes the canary), the key the exact
   bytes of P's token ids (kvstore.mlx.engine.token_bytes_function of mlx-lm's own
   tokenizer), chained blocks of 256 tokens, named by the model's identity
   (kvstore.mlx.model_fingerprint, as kvstore serve names it).
   Each round runs two fresh servers (with --admit-after 2, so that the
   decoding sessions' own states, each used once, are never stored and no
   background write runs while the rates are taken; P's checkpoint is on
   disk already): the first after P's pages were dropped from the page cache
   (posix_fadvise DONTNEED, best effort: a cold page cache), the second
   right after (a warm one).  On each server:
   - disk: two streaming sessions with short prompts (no hit) decode with a
     long max_tokens; once both have a token, after SETTLE_S, their decode
     rate (content chunks per second, both sessions together) is taken over
     a window without load; then P is sent (max_tokens=1) and the rate is
     taken again from the moment P is sent until P's first token arrives.
     The server's `kvstore: hit` line (its wall time, mapped onto the
     client's clock at P's send; millisecond steps) splits that window: the
     load part (P's tokenization, lookup and disk load on its HTTP thread,
     the headline: what a load costs the batch) and the join part (mlx-lm
     merges the loaded cache into the running batch on the generation
     thread, and a one-token prefill).  The sessions are hung up once both
     have a token after P's.
   - RAM: the same with two new sessions, and P sent again: now a hit in
     mlx-lm's own RAM prompt cache (no disk; mlx-lm deep-copies the cached
     state on the generation thread, then joins it to the batch as above):
     what stock mlx_lm.server would do with P, the peer of the join.
   - control (first server only): two new sessions decode while `cat`, in
     another process at normal priority, reads P's files (cold: pages
     dropped first; then warm): what reading those bytes costs this
     machine's decoding, whoever reads them.
   Reported: the decode rate during the load part against the rate without
   load (target >= 0.8), cold and warm, beside the `cat` control; the rate
   over the whole window and the RAM phase's (the join); P's time to first
   token from disk and from RAM, and its load_ms (from the server's
   `kvstore: request source=disk` line, which must say the whole stored
   prefix was reused, prefilled=1).

C. The everyday path, beside stock (bench/serve_everyday.py): cold concurrent
   traffic at 1, 4 and 8 sessions (wall time, target <= 1.05 x stock), RAM-hit
   time to first token at 1 and 4 in flight (target <= stock + 5 ms), and a
   stored prompt repeated after a restart (target <= 3 x its RAM-hit TTFT).
"""

import contextlib
import glob
import http.client
import itertools
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from foundation import TextTable, finish, fmt_time, harness_arguments, machine_info, machine_lines  # noqa: E402
from serve import FULL_MODEL, QUICK_MODEL, request_lines, start  # noqa: E402
from serve_everyday import bench_everyday  # noqa: E402

from kvstore.serve.generator import LOAD_NICE  # noqa: E402

# ---- A. load --------------------------------------------------------------------

CONCURRENCY = (1, 4, 8)
TURNS = 4
RESTART_AFTER = 2                 # turns played before the restart
MAX_TOKENS = 16                   # > 1, so that every request decodes too
FULL_SYSTEM_TOKENS, QUICK_SYSTEM_TOKENS = 4000, 2000
FULL_TOOL_TOKENS, QUICK_TOOL_TOKENS = 300, 200
SYSTEM_HEAD = ("You are a coding agent working in a Python repository. Run one command at a time, read "
               "its output and answer the user's question about it in one short paragraph. The reference "
               "material below describes the standard library modules the project uses.\n\n")
SYSTEM_MODULES = ["argparse", "collections", "json", "logging", "pathlib", "subprocess", "threading",
                  "functools", "itertools", "contextlib"]
# The tool outputs are cut, one after the other, from these modules' docstrings.
TOOL_MODULES = ["asyncio", "email", "http.client", "unittest", "tarfile", "zipfile", "sqlite3", "socket",
                "datetime", "decimal", "difflib", "inspect", "io", "os", "pickle", "shutil", "tempfile",
                "urllib.parse", "uuid", "warnings", "textwrap", "statistics", "random", "re", "queue"]
COMMANDS = ["python -m pytest -x -q", "git diff HEAD~1 -- src/", "grep -rn 'TODO' src/", "make check"]
QUESTIONS = ["Which test fails, and why?", "Which change in this diff could cause it?",
             "Which of these places need the same fix?", "Is the build fixed now? Answer yes or no first."]

# ---- B. decoding while a checkpoint loads ---------------------------------------------

# 16 x 16 x 128 x 2 (K, V) x 4 bytes = 256 KiB of KV per token; hidden 64
# keeps the weights (and a decode step) small.
LOAD_MODEL = dict(seed=1, layers=16, hidden=64, heads=16, kv_heads=16, head_dim=128, intermediate=128)
CHECKPOINT_BYTES = 1 << 30        # P's stored prefix holds at least this much KV
P_EXTRA_TOKENS = 100              # a margin: P's stored KV stays over 1 GiB if the template changes
SESSIONS = 2                      # streaming sessions decoding while P loads
SESSION_MAX_TOKENS = 4000         # longer than any phase lasts; the client hangs up
SETTLE_S = 1.0                    # after each session's first token, before the baseline window
FULL_BASELINE_S, QUICK_BASELINE_S = 3.0, 2.0    # the window without load
FULL_ROUNDS, QUICK_ROUNDS = 3, 1
DECODE_TARGET = 0.8               # decode rate during the load / without (the target)
BYTES_TARGET = 1.15               # bytes written / KV bytes of the distinct tokens (tails write a block twice at most)

# A request that gets no byte for this long has hung the server (the
# longest legitimate silence is one prefill step of 8 prompts, seconds).
REQUEST_TIMEOUT_S = 120
STOP_S = 120                      # SIGTERM to exit: the shutdown stores included
FAILED_STOP_S = 10                # the same after a failed request, before SIGKILL

SEED = 20240501
MiB = 1 << 20
GiB = 1 << 30


# ---- the client -----------------------------------------------------------------

def stream_chat(base, messages, max_tokens, ban, on_start=None, hang_up=None, out=None):
    """One streaming chat completion.

    Args:
        base: the server's URL.
        ban: token ids given logit_bias -100 (the end of sequence).
        on_start: called once the request is sent.
        hang_up: a threading.Event; once set, the client closes the
            connection at the next chunk (mlx-lm then stops the request).
        out: the dict to fill (its "chunks_ns" grows as chunks arrive).

    Returns:
        out: {"sent_ns", "chunks_ns" (arrival of each data chunk with text),
        "ttft_ns", "text", "usage" (None when hung up)}.

    Raises:
        ServerStuck: no byte came for REQUEST_TIMEOUT_S.
    """
    url = urllib.parse.urlsplit(base)
    body = json.dumps({"messages": messages, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
                       "stream_options": {"include_usage": True},
                       "logit_bias": {str(t): -100.0 for t in ban}}).encode()
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=REQUEST_TIMEOUT_S)
    out = {} if out is None else out
    out.update(chunks_ns=[], ttft_ns=None, text="", usage=None)
    try:
        out["sent_ns"] = time.perf_counter_ns()
        conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        if on_start is not None:
            on_start()
        resp = conn.getresponse()
        if resp.status != 200:
            raise SystemExit(f"server answered {resp.status}: {resp.read()[:200]!r}")
        parts = []
        while True:
            line = resp.readline()
            now = time.perf_counter_ns()
            if not line:
                break
            if not line.startswith(b"data:"):       # blank lines, ": keepalive" comments
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                break
            chunk = json.loads(payload)
            if chunk.get("usage"):
                out["usage"] = chunk["usage"]
            for choice in chunk.get("choices") or []:
                text = (choice.get("delta") or {}).get("content") or ""
                if text:
                    parts.append(text)
                    out["chunks_ns"].append(now)
                    if out["ttft_ns"] is None:
                        out["ttft_ns"] = now - out["sent_ns"]
            if hang_up is not None and hang_up.is_set():
                break
        out["text"] = "".join(parts)
    except TimeoutError:
        raise ServerStuck(f"no answer for {REQUEST_TIMEOUT_S} s") from None
    finally:
        conn.close()
    return out


class ServerStuck(Exception):
    """A request got no byte from the server for REQUEST_TIMEOUT_S."""


def stop_server(proc, failed=False):
    """SIGTERM, then SIGKILL after STOP_S (at once after FAILED_STOP_S when a request failed).

    Returns:
        seconds from SIGTERM to exit.

    Raises:
        SystemExit: the server had to be killed.
    """
    if failed and proc.poll() is None and hasattr(signal, "SIGUSR1"):
        # kvstore serve writes every thread's stack to its log on SIGUSR1
        # (stock mlx_lm.server would die of it).
        if "kvstore" in " ".join(map(str, proc.args)):
            proc.send_signal(signal.SIGUSR1)
            time.sleep(1.0)
    t0 = time.perf_counter()
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(FAILED_STOP_S if failed else STOP_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        if not failed:
            raise SystemExit(f"the server did not stop within {STOP_S} s of SIGTERM; killed") from None
    return time.perf_counter() - t0


def log_tail(path, lines=12):
    """The last lines of a server log; a thread dump (SIGUSR1) whole."""
    with open(path, "rb") as f:
        text = f.read().decode("utf-8", "replace")
    at = min((i for i in (text.find("Current thread 0x"), text.find("Thread 0x")) if i >= 0), default=-1)
    if at >= 0:
        return text[at:]
    return "\n".join(text.splitlines()[-lines:])


def warm_up(base, ban):
    """One short request: the generation thread and its batch are up before anything is timed."""
    stream_chat(base, [{"role": "user", "content": "Hello."}], 2, ban)


def percentile(values, q):
    """The q-th percentile (0-100) by linear interpolation between the sorted values."""
    v = sorted(values)
    if len(v) == 1:
        return v[0]
    pos = (len(v) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def dir_bytes(path):
    """The sizes of every file under path, summed."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(root, name))
            except OSError:
                pass
    return total


def stats_json(path):
    """`kvstore stats --json DIR` of path, or {} when it fails."""
    out = subprocess.run([sys.executable, "-m", "kvstore", "stats", path, "--json"], stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL, text=True, check=False)
    try:
        return json.loads(out.stdout) if out.returncode == 0 else {}
    except ValueError:
        return {}


def progress(msg):
    print(f"  {msg}", file=sys.stderr, flush=True)


# ---- the report -----------------------------------------------------------------

def fmt_ms(ns):
    return fmt_time(ns) if ns < 1e9 else f"{ns / 1e9:.2f} s"


def ms_text(ns):
    return {"text": fmt_ms(ns), "ns": ns}


# ---- A. the sessions ------------------------------------------------------------------

def distinct_texts(tok, modules, n, tokens, skip=0):
    """n distinct texts of exactly `tokens` tokens each, cut one after the other from the
    docstrings of modules (from character skip on)."""
    from kvstore.demo import model as demo_model

    rest = demo_model.prose(modules)[skip:]
    out = []
    while len(out) < n:
        piece = demo_model.text_of_tokens(tok, rest, tokens)
        if piece is None:
            raise SystemExit(f"the corpus ran out after {len(out)} texts of {tokens} tokens")
        out.append(piece)
        rest = rest[len(piece):].lstrip()
    return out


def tool_outputs(tok, n, tokens):
    """n distinct tool outputs of exactly `tokens` tokens each (TOOL_MODULES)."""
    return distinct_texts(tok, TOOL_MODULES, n, tokens)


class Session:
    """One agent conversation: the shared system prompt, then a tool output and a question per turn."""

    def __init__(self, index, system, outputs):
        self.index = index
        self.messages = [{"role": "system", "content": system}]
        self.outputs = outputs            # one per turn
        self.turns = []                   # {"turn", "ttft_ns", "prompt_tokens", "completion_tokens", "cached"}

    def play(self, base, turn, ban):
        self.messages.append({"role": "user", "content": f"$ {COMMANDS[turn]}\n{self.outputs[turn]}\n\n"
                                                         f"{QUESTIONS[turn]}"})
        r = stream_chat(base, self.messages, MAX_TOKENS, ban)
        if r["usage"] is None or r["ttft_ns"] is None:
            raise SystemExit(f"session {self.index} turn {turn + 1}: no answer ({r})")
        self.messages.append({"role": "assistant", "content": r["text"]})
        usage = r["usage"]
        self.turns.append({"turn": turn + 1, "ttft_ns": r["ttft_ns"], "prompt_tokens": usage["prompt_tokens"],
                           "completion_tokens": usage["completion_tokens"],
                           "cached": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)})


def play_phase(base, sessions, turns, ban):
    """Every session plays turns (in order) in its own thread, all starting together; returns the wall ns."""
    barrier = threading.Barrier(len(sessions) + 1)
    errors = []

    def run(s):
        barrier.wait()
        try:
            for t in turns:
                s.play(base, t, ban)
        except BaseException as e:        # noqa: BLE001 - reported on the main thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(s,), daemon=True) for s in sessions]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter_ns()
    for t in threads:
        t.join()
    wall = time.perf_counter_ns() - t0
    if errors:
        raise errors[0]
    return wall


def run_load(kind, cmd, n, system, outputs, ban, tmp):
    """One server kind at concurrency n: turns 1-2, SIGTERM, start, turns 3-4.

    Returns:
        the record of bench_load for this kind and n.
    """
    sessions = [Session(i, system, outputs[i * TURNS:(i + 1) * TURNS]) for i in range(n)]
    cache_dir = os.path.join(tmp, f"cache-{n}")
    if kind == "kvstore":
        cmd = cmd + ["--cache-dir", cache_dir]
    logs = [os.path.join(tmp, f"load-{kind}-{n}-{phase}.log") for phase in ("before", "after")]
    walls, restart = [], {}
    phases = (range(RESTART_AFTER), range(RESTART_AFTER, TURNS))
    for i, (turns, path) in enumerate(zip(phases, logs)):
        with open(path, "wb") as log:
            t0 = time.perf_counter()
            proc, base = start(cmd, tmp, log)
            if i == 1:
                restart["start_s"] = time.perf_counter() - t0
            try:
                warm_up(base, ban)
                walls.append(play_phase(base, sessions, turns, ban))
            except ServerStuck as e:
                stop_server(proc, failed=True)
                raise SystemExit(f"{kind} server, {n} sessions, turns {turns[0] + 1}-{turns[-1] + 1}: {e}; "
                                 f"its log ends:\n{log_tail(path)}") from None
            except BaseException:
                stop_server(proc, failed=True)
                raise
            restart["stop_s" if i == 0 else "final_stop_s"] = stop_server(proc)
    turns = [dict(t, session=s.index) for s in sessions for t in s.turns]
    rec = {"kind": kind, "sessions": n, "wall_ns": walls, "restart": restart, "turns": turns}
    if kind == "kvstore":
        lines = [request_lines(p) for p in logs]
        rec["log_lines"] = {"before": lines[0], "after": lines[1]}
        rec["dir_bytes"] = dir_bytes(cache_dir)
        rec["stats"] = stats_json(cache_dir)
    return rec


def summarize(rec):
    """TTFT percentiles (ns) and throughputs of one run_load record."""
    def ttfts(lo, hi):
        return [t["ttft_ns"] for t in rec["turns"] if lo <= t["turn"] <= hi]

    out = {}
    for name, (lo, hi) in (("before", (1, RESTART_AFTER)), ("after", (RESTART_AFTER + 1, TURNS)),
                           ("all", (1, TURNS)), ("first_after", (RESTART_AFTER + 1, RESTART_AFTER + 1))):
        v = ttfts(lo, hi)
        out[name] = {"p50_ns": statistics.median(v), "p95_ns": percentile(v, 95), "n": len(v)}
    wall = sum(rec["wall_ns"]) / 1e9
    out["wall_s"] = wall
    out["completion_tokens"] = sum(t["completion_tokens"] for t in rec["turns"])
    out["prompt_tokens"] = sum(t["prompt_tokens"] for t in rec["turns"])
    out["cached_tokens"] = sum(t["cached"] for t in rec["turns"])
    out["completion_tps"] = out["completion_tokens"] / wall
    out["prompt_tps"] = out["prompt_tokens"] / wall
    return out


def distinct_tokens(rec, system_tokens):
    """Tokens of the system prompt once, plus every session's own history (its last prompt and answer)."""
    total = system_tokens
    for s in sorted({t["session"] for t in rec["turns"]}):
        last = max((t for t in rec["turns"] if t["session"] == s), key=lambda t: t["turn"])
        total += last["prompt_tokens"] + last["completion_tokens"] - system_tokens
    return total


def bench_load(report, quick, tmp):
    """Part A (module docstring); adds its rows to report, returns its record."""
    from mlx_lm.utils import load_tokenizer

    from kvstore.demo import model as demo_model

    spec = QUICK_MODEL if quick else FULL_MODEL
    model = os.path.join(tmp, "model")
    _, tok = demo_model.write_model_dir(model, **spec)
    head = SYSTEM_HEAD
    system = head + demo_model.text_of_tokens(tok, demo_model.prose(SYSTEM_MODULES),
                                              (QUICK_SYSTEM_TOKENS if quick else FULL_SYSTEM_TOKENS)
                                              - len(tok.encode(head)))
    tool_tokens = QUICK_TOOL_TOKENS if quick else FULL_TOOL_TOKENS
    outputs = tool_outputs(tok, max(CONCURRENCY) * TURNS, tool_tokens)
    hf = load_tokenizer(model)
    system_tokens = len(hf.apply_chat_template([{"role": "system", "content": system}], tokenize=True))
    cmds = {"stock": [sys.executable, "-m", "mlx_lm", "server", "--model", model],
            "kvstore": [sys.executable, "-m", "kvstore", "serve", "--model", model]}
    ban = [tok.eos_id]
    cfg = demo_model.model_config(**{k: v for k, v in spec.items() if k != "seed"})
    kv_per_token = cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * cfg["head_dim"] * 2 * 4
    records = []
    for i, n in enumerate(CONCURRENCY):
        for kind in (("stock", "kvstore") if i % 2 == 0 else ("kvstore", "stock")):
            t0 = time.perf_counter()
            rec = run_load(kind, cmds[kind], n, system, outputs, ban, tmp)
            rec["summary"] = summarize(rec)
            records.append(rec)
            s = rec["summary"]
            progress(f"load {kind} x{n}: TTFT p50/p95 before {s['before']['p50_ns'] / 1e6:.0f}/"
                     f"{s['before']['p95_ns'] / 1e6:.0f} ms, after the restart {s['after']['p50_ns'] / 1e6:.0f}/"
                     f"{s['after']['p95_ns'] / 1e6:.0f} ms; {s['completion_tps']:.1f} tok/s generated, "
                     f"{s['prompt_tps']:.0f} prompt tok/s; {time.perf_counter() - t0:.0f} s"
                     + (f"; after-restart sources {[l[0] for l in rec['log_lines']['after']]}"
                        if kind == "kvstore" else ""))

    report.section(f"Concurrent agent sessions across a restart: kvstore serve vs stock mlx_lm.server "
                   f"({TURNS} turns, SIGTERM + restart after turn {RESTART_AFTER})")
    curve = []
    for n in CONCURRENCY:
        by = {r["kind"]: r for r in records if r["sessions"] == n}
        kv, st = by["kvstore"]["summary"], by["stock"]["summary"]
        curve.append({"sessions": n, **{k: {p: {"p50_ms": by[k]["summary"][p]["p50_ns"] / 1e6,
                                                "p95_ms": by[k]["summary"][p]["p95_ns"] / 1e6}
                                            for p in ("before", "after", "all")} for k in by}})
        after = by["kvstore"]["log_lines"]["after"]
        # The warm-up request is the first line of each server run.
        measured = [l for l in after if l[1] + l[2] > 64] if after else []
        sources = {src: sum(1 for l in measured if l[0] == src) for src in sorted({l[0] for l in measured})}
        reused = [l[1] for l in measured]
        prefilled = [l[2] for l in measured]
        st_first = by["stock"]["turns"]
        first_prompt = statistics.median(t["prompt_tokens"] for t in st_first if t["turn"] == RESTART_AFTER + 1)
        note_after = (f"{kv['after']['n']} requests each; kvstore serve after the restart: "
                      + ", ".join(f"{c} {src}" for src, c in sources.items())
                      + (f", median reused {statistics.median(reused):,.0f} and prefilled "
                         f"{statistics.median(prefilled):,.0f} tokens" if measured else "")
                      + f"; turn {RESTART_AFTER + 1} prompts: {first_prompt:,.0f} tokens (median); turn "
                        f"{RESTART_AFTER + 1} alone: p50 {fmt_ms(kv['first_after']['p50_ns'])} vs "
                        f"{fmt_ms(st['first_after']['p50_ns'])}")
        for p, label in (("p50", "p50"), ("p95", "p95")):
            report.add(f"{n} session{'s' if n > 1 else ''}, turns {RESTART_AFTER + 1}-{TURNS} after SIGTERM + "
                       f"restart: TTFT {label}", ms_text(kv["after"][f"{p}_ns"]), ms_text(st["after"][f"{p}_ns"]),
                       "time", kv["after"][f"{p}_ns"] / st["after"][f"{p}_ns"],
                       note=note_after if p == "p50" else f"{kv['after']['n']} requests each")
        for p in ("p50", "p95"):
            report.add(f"{n} session{'s' if n > 1 else ''}, turns 1-{RESTART_AFTER} (before the restart): "
                       f"TTFT {p}", ms_text(kv["before"][f"{p}_ns"]), ms_text(st["before"][f"{p}_ns"]), "time",
                       kv["before"][f"{p}_ns"] / st["before"][f"{p}_ns"],
                       note=f"{kv['before']['n']} requests each; all {TURNS} turns: kvstore "
                            f"{fmt_ms(kv['all'][f'{p}_ns'])}, stock {fmt_ms(st['all'][f'{p}_ns'])}")
        rs, rk = by["stock"]["restart"], by["kvstore"]["restart"]
        report.add(f"{n} session{'s' if n > 1 else ''}: completion tokens per second of wall time",
                   {"text": f"{kv['completion_tps']:.1f} tok/s"}, {"text": f"{st['completion_tps']:.1f} tok/s"},
                   "throughput", kv["completion_tps"] / st["completion_tps"],
                   note=f"{kv['completion_tokens']:,} vs {st['completion_tokens']:,} tokens in {kv['wall_s']:.1f} s "
                        f"vs {st['wall_s']:.1f} s (both phases; the restart not counted: SIGTERM to exit "
                        f"{rk['stop_s']:.1f} s vs {rs['stop_s']:.1f} s, start to /health {rk['start_s']:.1f} s vs "
                        f"{rs['start_s']:.1f} s)")
        report.add(f"{n} session{'s' if n > 1 else ''}: prompt tokens per second of wall time",
                   {"text": f"{kv['prompt_tps']:,.0f} tok/s"}, {"text": f"{st['prompt_tps']:,.0f} tok/s"},
                   "throughput", kv["prompt_tps"] / st["prompt_tps"],
                   note=f"{kv['prompt_tokens']:,} vs {st['prompt_tokens']:,} prompt tokens, of which reused "
                        f"(cached_tokens) {kv['cached_tokens']:,} vs {st['cached_tokens']:,}")
        rec = by["kvstore"]
        written = (rec["stats"].get("directory") or {}).get("bytes_written")
        distinct = distinct_tokens(rec, system_tokens)
        kv_bytes = distinct * kv_per_token
        shown = written if written is not None else rec["dir_bytes"]
        report.add(f"{n} session{'s' if n > 1 else ''}: bytes kvstore serve wrote to its cache directory / KV "
                   "bytes of the distinct tokens",
                   {"text": f"{shown / MiB:.2f} MiB"}, {"text": f"{kv_bytes / MiB:.2f} MiB"}, "size",
                   shown / kv_bytes, ratio_text=f"{shown / kv_bytes:.2f}",
                   target=f"size ratio ≤ {BYTES_TARGET}", passed=shown / kv_bytes <= BYTES_TARGET,
                   note=(f"bytes_written counter {written:,} B; " if written is not None
                         else "no bytes_written counter in `kvstore stats --json`: the directory's size; ")
                        + f"directory {rec['dir_bytes']:,} B in {rec['stats'].get('entries', '?')} files; "
                        f"{distinct:,} distinct tokens x {kv_per_token:,} B; stock writes nothing")
    return {"model": cfg, "system_tokens": system_tokens, "tool_tokens": tool_tokens, "turns": TURNS,
            "restart_after": RESTART_AFTER, "max_tokens": MAX_TOKENS, "concurrency": list(CONCURRENCY), "runs": records, "load_curve": curve}


# ---- B. decoding while a checkpoint loads -------------------------------------------------

def long_prompt(tok, hf, tokens):
    """P's messages: a system prompt and a short question, rendering to exactly `tokens` tokens or a few more."""
    from kvstore.demo import model as demo_model

    question = "Summarise the reference material above in three sentences."
    prose = demo_model.prose(SYSTEM_MODULES + TOOL_MODULES)

    def render(system):
        return list(hf.apply_chat_template([{"role": "system", "content": system},
                                            {"role": "user", "content": question}],
                                           add_generation_prompt=True, tokenize=True))
    overhead = len(render("x")) - 1
    for want in range(tokens - overhead, tokens - overhead + 8):
        system = demo_model.text_of_tokens(tok, prose, want)
        if system is None:
            raise SystemExit("the prose is too short for P")
        ids = render(system)
        if len(ids) >= tokens:
            return [{"role": "system", "content": system}, {"role": "user", "content": question}], ids
    raise SystemExit(f"no system prompt renders to {tokens} tokens")


def write_checkpoint(model, cache_dir, hf, ids, seed, layout="chain"):
    """Stores a state of ids[:-1] as kvstore serve would, without the minutes of a cold prefill.

    Random KV arrays of the model's cache shapes for every token but the
    last stored one; that one the model computes over them, so the state is
    one the model would have written after that random history and passes
    the canary (kvstore.mlx.canary recomputes exactly that token).  Named
    by the model's identity as kvstore serve names it (model_fingerprint of
    the loaded weights, no KV options); the arrays in the model's dtype;
    layout "chain" (kvstore serve's default) or "whole" (one file).

    Returns:
        (bytes of the files written, tensor bytes, blocks).
    """
    import mlx.core as mx
    import mlx_lm
    import numpy as np
    from mlx_lm.models.cache import KVCache

    import kvstore
    from kvstore.format import Reason
    from kvstore.identity import ModelIdentity
    from kvstore.mlx.codecs import checked_state
    from kvstore.mlx import model_fingerprint
    from kvstore.mlx.engine import text_offsets_function, token_bytes_function

    with open(os.path.join(model, "config.json")) as f:
        cfg = json.load(f)
    loaded, _ = mlx_lm.load(model)
    identity = ModelIdentity(model_fingerprint(loaded), os.path.basename(os.path.normpath(model)))
    n = len(ids) - 1
    shape = (1, cfg["num_key_value_heads"], n - 1, cfg["head_dim"])
    rng = np.random.default_rng(seed)
    dtype = loaded.model.embed_tokens.weight.dtype
    cache = []
    for _ in range(cfg["num_hidden_layers"]):
        c = KVCache()
        c.update_and_fetch(mx.array(rng.random(shape, dtype=np.float32) - 0.5).astype(dtype),
                           mx.array(rng.random(shape, dtype=np.float32) - 0.5).astype(dtype))
        cache.append(c)
    loaded(mx.array([[ids[n - 1]]]), cache=cache)
    mx.eval([c.state for c in cache])
    # The store as kvstore serve opens it (kvstore/serve/server.py: _Server),
    # with its defaults: chain layout, 256-token blocks.
    store = kvstore.KVStore(cache_dir, quant_bits=16,
                            ctx_size=kvstore.mlx.spec.ctx_size(cfg),
                            layout=layout, model_identity=identity)
    try:
        token_bytes = token_bytes_function(hf)
        key = token_bytes(ids[:n])
        tensors, meta, positional = checked_state(cache, n)
        entry = store.save(key, ids[:n], tensors, meta=meta, reason=Reason.SHUTDOWN, ctx_size=store.settings.ctx_size,
                           positional=positional, text_offsets=text_offsets_function(token_bytes)(ids[:n], len(key)))
        if entry is None:
            raise SystemExit("the store refused P's checkpoint")
    finally:
        store.close()
    files = glob.glob(os.path.join(cache_dir, "*.kv"))
    return sum(os.path.getsize(p) for p in files), sum(a.nbytes for a in tensors.values()), len(files)


def drop_page_cache(cache_dir):
    """Asks the kernel to drop the checkpoint files' pages (best effort)."""
    for path in glob.glob(os.path.join(cache_dir, "*.kv")):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


_LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) - \w+ - (kvstore: .*)$", re.MULTILINE)


def log_events(path):
    """[(unix time, message)] of the kvstore lines in a server log (mlx-lm's logging format)."""
    with open(path, "rb") as f:
        text = f.read().decode("utf-8", "replace")
    out = []
    for m in _LOG_TIME.finditer(text):
        t = time.mktime(time.strptime(m[1], "%Y-%m-%d %H:%M:%S")) + int(m[2]) / 1e3
        out.append((t, m[3]))
    return out


def rate(chunks, lo, hi):
    """Chunks per second (all sessions together) arriving in [lo, hi) (perf_counter_ns)."""
    n = sum(1 for c in chunks if lo <= c < hi)
    return n / ((hi - lo) / 1e9) if hi > lo else float("nan")


def wait_for_chunks(live, after_ns, errors, limit_s=REQUEST_TIMEOUT_S):
    """Waits until every session has a chunk that arrived after after_ns."""
    deadline = time.monotonic() + limit_s
    while not all(o.get("chunks_ns") and o["chunks_ns"][-1] > after_ns for o in live):
        if errors:
            raise errors[0]
        if time.monotonic() > deadline:
            raise ServerStuck(f"the decoding sessions produced nothing for {limit_s} s")
        time.sleep(0.02)


@contextlib.contextmanager
def decoding_sessions(base, label, ban):
    """SESSIONS fresh streaming sessions with short prompts decode until the block ends (then hang up).

    Yields:
        (live, errors): each session's stream_chat record as it fills, and
        the exceptions of sessions that failed (raised on leaving).
    """
    live = [{} for _ in range(SESSIONS)]
    hang_up = threading.Event()
    errors = []

    def session(i):
        msgs = [{"role": "user", "content": f"Session {i} of the {label}: tell me a long story."}]
        try:
            stream_chat(base, msgs, SESSION_MAX_TOKENS, ban, hang_up=hang_up, out=live[i])
        except BaseException as e:            # noqa: BLE001 - raised on the main thread
            errors.append(e)

    threads = [threading.Thread(target=session, args=(i,), daemon=True) for i in range(SESSIONS)]
    for t in threads:
        t.start()
    try:
        wait_for_chunks(live, 0, errors)
        yield live, errors
    finally:
        hang_up.set()
        for t in threads:
            t.join(REQUEST_TIMEOUT_S)
    if errors:
        raise errors[0]


def baseline_then_p(base, messages, ban, baseline_s):
    """With the decoding sessions running: SETTLE_S, a baseline window of
    baseline_s, then P sent (max_tokens=1) and streamed to its end.

    Returns:
        (the baseline window's start in perf_counter ns, P's stream record,
        the wall / perf_counter clock pair taken when P was sent).
    """
    time.sleep(SETTLE_S)
    t_base = time.perf_counter_ns()
    time.sleep(baseline_s)
    clocks = {}
    p = stream_chat(base, messages, 1, ban,
                    on_start=lambda: clocks.update(wall=time.time(), ns=time.perf_counter_ns()))
    return t_base, p, clocks


def decode_phase(base, source, messages, ban, baseline_s):
    """SESSIONS fresh streaming sessions decode; a baseline window; then P (max_tokens=1).

    Returns:
        the phase's record: rates, P's times and usage, the perf_counter /
        wall clock pair taken when P was sent.
    """
    with decoding_sessions(base, f"{source} phase", ban) as (live, errors):
        t_base, p, clocks = baseline_then_p(base, messages, ban, baseline_s)
        if p["ttft_ns"] is None:
            raise SystemExit(f"P ({source}) got no token: {p}")
        first = p["sent_ns"] + p["ttft_ns"]
        # The sessions' first token after P's: the end of the stall.
        wait_for_chunks(live, first, errors)
    chunks = sorted(c for o in live for c in o["chunks_ns"])
    sent = p["sent_ns"]
    gaps = []
    for o in live:
        seq = [c for c in o["chunks_ns"] if c < sent][-1:] + [c for c in o["chunks_ns"] if c >= sent]
        gaps += [b - a for a, b in itertools.pairwise(seq)]
    return {"source": source, "baseline_tps": rate(chunks, t_base, sent), "during_tps": rate(chunks, sent, first),
            "window_s": (first - sent) / 1e9, "ttft_ns": p["ttft_ns"], "usage": p["usage"],
            "max_gap_ms": max(gaps) / 1e6, "sent_ns": sent, "first_ns": first, "clocks": clocks,
            "chunks_ns": chunks}


def split_at_hit(phase, log_path):
    """Adds the load part (P sent to the `kvstore: hit` line) and the join part (to P's first token)."""
    clocks = phase["clocks"]
    hits = [clocks["ns"] + int((t - clocks["wall"]) * 1e9) for t, msg in log_events(log_path)
            if msg.startswith("kvstore: hit ")]
    # The log's clock has millisecond steps: a hit logged within one of P's send is P's.
    hits = [h for h in hits if phase["sent_ns"] - 1_000_000 <= h < phase["first_ns"]]
    if not hits:
        return
    hit = max(hits[0], phase["sent_ns"])
    chunks = phase["chunks_ns"]
    phase.update(load_part_s=(hit - phase["sent_ns"]) / 1e9, load_part_tps=rate(chunks, phase["sent_ns"], hit),
                 join_part_s=(phase["first_ns"] - hit) / 1e9, join_part_tps=rate(chunks, hit, phase["first_ns"]))


def control_phase(base, cache_dir, ban, baseline_s, cold):
    """The machine's own cost of reading P's files: `cat` (another process, normal priority) reads them
    while SESSIONS streaming sessions decode.

    Returns:
        {"baseline_tps", "during_tps", "window_s"}.
    """
    with decoding_sessions(base, f"{'cold' if cold else 'warm'} control", ban) as (live, errors):
        if cold:
            drop_page_cache(cache_dir)
        time.sleep(SETTLE_S)
        t_base = time.perf_counter_ns()
        time.sleep(baseline_s)
        sent = time.perf_counter_ns()
        files = sorted(glob.glob(os.path.join(cache_dir, "*.kv")))
        subprocess.run(["cat", *files], stdout=subprocess.DEVNULL, check=True)
        done = time.perf_counter_ns()
        wait_for_chunks(live, done, errors)
    chunks = sorted(c for o in live for c in o["chunks_ns"])
    return {"baseline_tps": rate(chunks, t_base, sent), "during_tps": rate(chunks, sent, done),
            "window_s": (done - sent) / 1e9}


def decode_round(cmd, tmp, index, messages, ban, baseline_s, cache_dir=None):
    """One round of part B on a fresh server: P from disk, then P again from RAM; with cache_dir, the
    `cat` controls too (cold, then warm page cache).

    Returns:
        {"disk": phase, "ram": phase, "request_lines": the server's[, "control": {"cold", "warm"}]}.
    """
    path = os.path.join(tmp, f"decode-{index}.log")
    out = {}
    with open(path, "wb") as log:
        proc, base = start(cmd, tmp, log)
    failed = True
    try:
        warm_up(base, ban)
        out["disk"] = decode_phase(base, "disk", messages, ban, baseline_s)
        n_lines = len(request_lines(path))        # the RAM phase's lines come after these
        out["ram"] = decode_phase(base, "ram", messages, ban, baseline_s)
        if cache_dir is not None:
            out["control"] = {c: control_phase(base, cache_dir, ban, baseline_s, c == "cold")
                              for c in ("cold", "warm")}
        failed = False
    except ServerStuck as e:
        raise SystemExit(f"kvstore serve, part B round {index}: {e}; its log ends:\n{log_tail(path)}") from None
    finally:
        stop_server(proc, failed)
    lines = request_lines(path)
    out["request_lines"] = {"disk": lines[:n_lines], "ram": lines[n_lines:]}
    split_at_hit(out["disk"], path)
    for phase in (out["disk"], out["ram"]):
        del phase["chunks_ns"]
    return out


def bench_decode(report, quick, tmp):
    """Part B (module docstring); adds its rows to report, returns its record."""
    from mlx_lm.utils import load_tokenizer

    from kvstore.demo import model as demo_model

    model = os.path.join(tmp, "model-large-kv")
    _, tok = demo_model.write_model_dir(model, **LOAD_MODEL)
    hf = load_tokenizer(model)
    cfg = demo_model.model_config(**{k: v for k, v in LOAD_MODEL.items() if k != "seed"})
    kv_per_token = cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * cfg["head_dim"] * 2 * 4
    tokens = math.ceil(CHECKPOINT_BYTES / kv_per_token) + 1 + P_EXTRA_TOKENS
    messages, ids = long_prompt(tok, hf, tokens)
    cache_dir = os.path.join(tmp, "cache-large-kv")
    t0 = time.perf_counter()
    file_bytes, tensor_bytes, blocks = write_checkpoint(model, cache_dir, hf, ids, SEED)
    progress(f"decode: P has {len(ids):,} tokens; its checkpoint {file_bytes / GiB:.2f} GiB in {blocks} blocks, "
             f"written in {time.perf_counter() - t0:.1f} s")
    # --admit-after 2: the decoding sessions' own states (each used once)
    # are never stored, so no background write runs during a measurement.
    # It changes nothing for P, whose checkpoint is on disk already.
    cmd = [sys.executable, "-m", "kvstore", "serve", "--model", model, "--cache-dir", cache_dir, "--admit-after", "2"]
    rounds = QUICK_ROUNDS if quick else FULL_ROUNDS
    baseline_s = QUICK_BASELINE_S if quick else FULL_BASELINE_S
    ban = [tok.eos_id]
    recs = {"cold": [], "warm": []}
    for i in range(rounds):
        # Cold: P's pages dropped first (the `cat` controls run on this
        # server too); warm: right after, P's pages still cached.
        for cache in ("cold", "warm"):
            if cache == "cold":
                drop_page_cache(cache_dir)
            rec = decode_round(cmd, tmp, f"{i + 1}-{cache}", messages, ban, baseline_s,
                               cache_dir if cache == "cold" else None)
            for source in ("disk", "ram"):
                got = [l for l in rec["request_lines"][source] if l[1] + l[2] == len(ids)]
                if len(got) != 1 or got[0][0] != source or got[0][1] != len(ids) - 1:
                    raise SystemExit(f"decode round {i + 1} ({cache}): P was not a whole {source} hit: "
                                     f"{rec['request_lines'][source]} (P has {len(ids)} tokens)")
                rec[source]["request_line"] = got[0]
            rec["load_ms"] = rec["disk"]["request_line"][3]
            recs[cache].append(rec)
            d, r = rec["disk"], rec["ram"]
            progress(f"decode round {i + 1} ({cache} page cache): {d['baseline_tps']:.1f} tok/s without load; "
                     f"load part {d.get('load_part_s', float('nan')):.2f} s at "
                     f"{d.get('load_part_tps', float('nan')):.1f} tok/s, join {d.get('join_part_s', float('nan')):.2f} s "
                     f"at {d.get('join_part_tps', float('nan')):.1f}; load_ms {rec['load_ms']:.0f}; RAM hit: "
                     f"{r['baseline_tps']:.1f} without, {r['during_tps']:.1f} during P's {r['window_s']:.2f} s"
                     + "".join(f"; cat {c}: {x['during_tps'] / x['baseline_tps']:.2f} of {x['baseline_tps']:.1f} "
                               f"over {x['window_s']:.2f} s" for c, x in rec.get("control", {}).items()))

    def med(cache, source, key):
        v = [r[source][key] for r in recs[cache] if key in r[source]]
        return statistics.median(v) if v else None

    def load_ratio(cache):
        v = [r["disk"]["load_part_tps"] / r["disk"]["baseline_tps"] for r in recs[cache] if "load_part_tps" in r["disk"]]
        return statistics.median(v) if v else None

    def per_round(cache):
        return ", ".join(f"{r['disk']['load_part_tps'] / r['disk']['baseline_tps']:.2f}"
                         for r in recs[cache] if "load_part_tps" in r["disk"])

    def control(cache):
        v = [r["control"][cache] for r in recs["cold"]]
        return (statistics.median(x["during_tps"] / x["baseline_tps"] for x in v),
                statistics.median(x["window_s"] for x in v))

    size = f"{file_bytes / GiB:.2f} GiB"
    report.section(f"Decoding while another session's {size} checkpoint loads: kvstore serve")
    ratio = None
    for cache in ("cold", "warm"):
        got, base_tps = load_ratio(cache), med(cache, "disk", "baseline_tps")
        cat_ratio, cat_s = control(cache)
        if cache == "cold":
            ratio = got
        loads = [r["load_ms"] for r in recs[cache]]
        report.add(f"decode rate of {SESSIONS} streaming sessions while P's HTTP thread tokenizes, looks up and "
                   f"loads its {size} disk hit (P sent to the `kvstore: hit` line), {cache} page cache, vs "
                   "without load",
                   {"text": f"{med(cache, 'disk', 'load_part_tps') or float('nan'):.1f} tok/s"},
                   {"text": f"{base_tps:.1f} tok/s"}, "throughput", got if got is not None else float("nan"),
                   target=f"throughput ratio ≥ {DECODE_TARGET}",
                   passed=got is not None and got >= DECODE_TARGET,
                   note=f"load part {med(cache, 'disk', 'load_part_s') or float('nan'):.2f} s, load_ms "
                        f"{statistics.median(loads):,.0f} ({file_bytes / GiB / (statistics.median(loads) / 1e3):.2f} "
                        f"GiB/s, loads at CPU niceness {LOAD_NICE}); the machine's own cost: `cat` of the same files by "
                        f"another process at normal priority leaves {cat_ratio:.2f} of the rate ({cat_s:.2f} s); "
                        f"ratio per round {per_round(cache)}")
    for cache in ("cold",):
        report.add(f"decode rate of {SESSIONS} sessions from P sent to P's first token, P a {size} disk hit "
                   f"({cache} page cache), vs without load",
                   {"text": f"{med(cache, 'disk', 'during_tps'):.1f} tok/s"},
                   {"text": f"{med(cache, 'disk', 'baseline_tps'):.1f} tok/s"}, "throughput",
                   med(cache, "disk", "during_tps") / med(cache, "disk", "baseline_tps"),
                   note=f"window {med(cache, 'disk', 'window_s'):.2f} s: the load part above, then P joins the "
                        f"running batch ({med(cache, 'disk', 'join_part_s') or float('nan'):.2f} s at "
                        f"{med(cache, 'disk', 'join_part_tps') or float('nan'):.1f} tok/s: mlx-lm merges P's "
                        f"4,000-token cache into the batch and every step then attends over it); longest gap "
                        f"between two tokens of a session {med(cache, 'disk', 'max_gap_ms'):,.0f} ms")
    report.add(f"decode rate of {SESSIONS} sessions from P sent to P's first token, P a RAM hit (mlx-lm's own "
               "prompt cache, the same server, no disk) vs without load",
               {"text": f"{med('cold', 'ram', 'during_tps'):.1f} tok/s"},
               {"text": f"{med('cold', 'ram', 'baseline_tps'):.1f} tok/s"}, "throughput",
               med("cold", "ram", "during_tps") / med("cold", "ram", "baseline_tps"),
               note=f"window {med('cold', 'ram', 'window_s'):.2f} s, longest gap "
                    f"{med('cold', 'ram', 'max_gap_ms'):,.0f} ms: the join costs the same without any disk (stock "
                    "mlx_lm.server joins a long cached prompt the same way)")
    load_ms = statistics.median(r["load_ms"] for r in recs["cold"])
    ttft_disk, ttft_ram = med("cold", "disk", "ttft_ns"), med("cold", "ram", "ttft_ns")
    report.add(f"P's time to first token with {SESSIONS} sessions decoding: {size} disk hit (cold page cache) vs "
               "RAM hit",
               ms_text(ttft_disk), ms_text(ttft_ram), "time", ttft_disk / ttft_ram,
               note=f"load_ms {load_ms:,.0f} (from the server's `kvstore: request source=disk "
                    f"reused={len(ids) - 1:,} prefilled=1` line); {blocks} chain blocks, {file_bytes:,} B of files "
                    f"for {tensor_bytes:,} B of KV tensors")
    return {"model": cfg, "kv_bytes_per_token": kv_per_token, "prompt_tokens": len(ids), "file_bytes": file_bytes,
            "tensor_bytes": tensor_bytes, "blocks": blocks, "rounds": recs, "ratio": ratio}


# ---- main -----------------------------------------------------------------------------

def main(argv=None):
    args = harness_arguments(__doc__, "a smaller model and prompts, one round of part B", argv,
                             strict_help="exit 1 when the target is missed")
    t_start = time.perf_counter()
    info = machine_info()
    report = TextTable()
    with tempfile.TemporaryDirectory(prefix="kvstore-bench-serve-load-") as tmp:
        t0 = time.perf_counter()
        load = bench_load(report, args.quick, tmp)
        load["elapsed_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        decode = bench_decode(report, args.quick, tmp)
        decode["elapsed_s"] = time.perf_counter() - t0
        everyday = bench_everyday(report, args.quick, tmp)
    elapsed = time.perf_counter() - t_start
    cfg = load["model"]
    print(f"# kvstore serve under load ({'quick' if args.quick else 'full'} run)\n")
    print(machine_lines(info))
    print(f"- A ({load['elapsed_s']:.0f} s): random-weight mlx-lm llama, float32, {cfg['num_hidden_layers']} layers, "
          f"hidden {cfg['hidden_size']}; {', '.join(map(str, CONCURRENCY))} concurrent sessions of {TURNS} turns: a "
          f"shared {load['system_tokens']:,}-token system prompt, a {load['tool_tokens']}-token tool output per "
          f"turn, max_tokens={MAX_TOKENS} (end of sequence banned), streaming; SIGTERM + restart after turn "
          f"{RESTART_AFTER}; TTFT = request sent to first content chunk; time ratio = kvstore / stock (lower is "
          "better), throughput ratio = kvstore / stock (higher is better)")
    dc = decode["model"]
    print(f"- B ({decode['elapsed_s']:.0f} s): {dc['num_hidden_layers']} layers x {dc['num_key_value_heads']} KV heads x "
          f"{dc['head_dim']} dims, float32 ({decode['kv_bytes_per_token'] // 1024} KiB of KV per token), hidden "
          f"{dc['hidden_size']}; P = {decode['prompt_tokens']:,} tokens, its first {decode['prompt_tokens'] - 1:,} "
          f"stored; {len(decode['rounds']['cold'])} round(s) of a cold and a warm page cache, a fresh server each; decode rate = content chunks per second "
          f"of {SESSIONS} sessions together")
    print(f"- C ({everyday['elapsed_s']:.0f} s): the everyday path (bench/serve_everyday.py): cold concurrent "
          f"traffic on an {everyday['cold']['model']['layers']}-layer, hidden {everyday['cold']['model']['hidden']} "
          "llama; RAM hits and a stored prompt after a restart on A's model; time ratio = kvstore / stock")
    print(f"- elapsed {elapsed:.1f} s\n")
    print(report.markdown())
    # The JSON keeps everything but the per-chunk times.
    return finish(args, info, elapsed, report, load=load, decode=decode, everyday=everyday)


if __name__ == "__main__":
    sys.exit(main())
