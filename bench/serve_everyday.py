"""C. kvstore serve on the everyday path, beside stock mlx_lm.server: part C of bench/serve_load.py.

The traffic the disk cannot help is the traffic a busy server sees most; a
cache earns its place only if that gets no slower.  Three measurements, each
side by side with stock in one run, the order of the two kinds alternated:

1. Cold concurrent traffic: N sessions (1, 4, 8) with distinct ~700-token
   system prompts, 2 turns each, each turn sent by every session at once,
   on a fresh server and an empty cache directory; the wall time of both
   turns, summed over COLD_REPEATS runs of each kind (in the order
   stock, kvstore, kvstore, stock, or the reverse).  Target: kvstore serve
   <= 1.05 x stock.
2. RAM hits: documents of DOC_TOKENS tokens already in RAM (one request each
   first), then new questions about them, 1 and 4 in flight at once; the
   time to first token (streaming) of every question.  Target: kvstore
   serve's median <= stock's + 5 ms.
3. A stored prompt after a restart (kvstore serve only): a prompt answered,
   then repeated (a RAM hit), SIGTERM, a fresh server on the same cache
   directory, the same prompt again (a disk hit); the TTFT of the disk hit
   against the RAM hit's.  Target: <= 3 x.

The model of 1 is a random-weight mlx-lm llama of 8 layers, hidden 256 (a
prefill takes seconds on these 2 cores, as a real model's does on real
hardware); 2 and 3 use bench/serve.py's model.
"""

import os
import statistics
import sys
import threading
import time

COLD_SESSIONS = (1, 4, 8)
COLD_TURNS = ("What does the first module do?", "Summarise it in one line.")
COLD_SYSTEM_TOKENS = 700
FULL_COLD_MODEL = dict(seed=0, layers=8, hidden=256, heads=4, kv_heads=2, head_dim=64)
QUICK_COLD_MODEL = dict(seed=0, layers=2, hidden=128, heads=2, kv_heads=2, head_dim=32)
COLD_TARGET = 1.05                      # kvstore wall / stock wall
FULL_COLD_REPEATS, QUICK_COLD_REPEATS = 2, 1

RAM_IN_FLIGHT = (1, 4)
FULL_DOC_TOKENS, QUICK_DOC_TOKENS = 2000, 1000
FULL_RAM_SAMPLES, QUICK_RAM_SAMPLES = 20, 6     # rounds of questions per in-flight count, per server
RAM_TARGET_MS = 5.0                     # kvstore median TTFT - stock median TTFT

FULL_PROMPT_TOKENS, QUICK_PROMPT_TOKENS = 4000, 1500
FULL_RESTARTS, QUICK_RESTARTS = 3, 1
FULL_RAM_REPEATS, QUICK_RAM_REPEATS = 5, 3
RESTART_TARGET = 3.0                    # disk-hit TTFT after a restart / RAM-hit TTFT

MAX_TOKENS = 8

CORPUS = ("argparse", "collections", "json", "logging", "pathlib", "subprocess", "threading", "asyncio",
          "email", "tarfile", "zipfile", "unittest")


def _texts(tok, n, tokens, skip=0):
    """n distinct texts of exactly `tokens` tokens, cut one after the other from the corpus."""
    from serve_load import distinct_texts
    return distinct_texts(tok, CORPUS, n, tokens, skip)


def _server(kind, model, tmp, name):
    """(process, base URL, log file) of a fresh server: stock, or kvstore serve on an empty cache directory."""
    from serve import start
    if kind == "stock":
        cmd = [sys.executable, "-m", "mlx_lm", "server", "--model", model]
    else:
        cmd = [sys.executable, "-m", "kvstore", "serve", "--model", model,
               "--cache-dir", os.path.join(tmp, f"cache-{name}")]
    log = open(os.path.join(tmp, f"everyday-{kind}-{name}.log"), "wb")
    proc, base = start(cmd, tmp, log)
    return proc, base, log


def _together(fns):
    """Runs fns at once, each in its own thread; returns their results in order."""
    out, errors = [None] * len(fns), []

    def run(i, fn):
        try:
            out[i] = fn()
        except BaseException as e:       # noqa: BLE001 - reported on the calling thread
            errors.append(e)
    threads = [threading.Thread(target=run, args=(i, fn), daemon=True) for i, fn in enumerate(fns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out


# ---- 1. cold concurrent traffic -------------------------------------------------------------

def _cold_run(kind, model, systems, ban, tmp, name):
    from serve_load import stop_server, stream_chat, warm_up
    proc, base, log = _server(kind, model, tmp, name)
    try:
        warm_up(base, ban)
        convs = [[{"role": "system", "content": s}] for s in systems]
        t0 = time.perf_counter()
        for q in COLD_TURNS:
            def turn(c, q=q):
                c.append({"role": "user", "content": q})
                c.append({"role": "assistant", "content": stream_chat(base, c, MAX_TOKENS, ban)["text"]})
            _together([lambda c=c: turn(c) for c in convs])
        return time.perf_counter() - t0
    finally:
        stop_server(proc)
        log.close()


def bench_cold(report, quick, tmp):
    from kvstore.demo import model as demo_model
    spec = QUICK_COLD_MODEL if quick else FULL_COLD_MODEL
    model = os.path.join(tmp, "model-cold")
    _, tok = demo_model.write_model_dir(model, **spec)
    ban = [tok.eos_id]
    sessions = COLD_SESSIONS[:2] if quick else COLD_SESSIONS
    systems = [f"Session {i}. {t}" for i, t in enumerate(_texts(tok, max(sessions), COLD_SYSTEM_TOKENS))]
    repeats = QUICK_COLD_REPEATS if quick else FULL_COLD_REPEATS
    out = []
    for i, n in enumerate(sessions):
        pair = ("stock", "kvstore") if i % 2 == 0 else ("kvstore", "stock")
        order = [k for r in range(repeats) for k in (pair if r % 2 == 0 else pair[::-1])]
        runs = {"stock": [], "kvstore": []}
        for r, kind in enumerate(order):
            runs[kind].append(_cold_run(kind, model, systems[:n], ban, tmp, f"cold-{n}-{r}"))
            print(f"  [C1 {n} sessions {kind}: {runs[kind][-1]:.1f} s]", file=sys.stderr, flush=True)
        walls = {k: sum(v) for k, v in runs.items()}
        ratio = walls["kvstore"] / walls["stock"]
        report.add(f"cold concurrent traffic, {n} session{'s' if n > 1 else ''} (distinct {COLD_SYSTEM_TOKENS}-token "
                   f"system prompts, {len(COLD_TURNS)} turns, each sent by all at once): wall time",
                   {"text": f"{walls['kvstore']:.2f} s"}, {"text": f"{walls['stock']:.2f} s"}, "time", ratio,
                   target=f"time ratio ≤ {COLD_TARGET}", passed=ratio <= COLD_TARGET,
                   note=f"the sum of {repeats} run(s) of each kind in the order {', '.join(order)}; per run: kvstore "
                        + ", ".join(f"{w:.2f}" for w in runs["kvstore"]) + " s, stock "
                        + ", ".join(f"{w:.2f}" for w in runs["stock"]) + " s; a fresh server and an empty cache "
                        f"each; {spec['layers']} layers, hidden {spec['hidden']}")
        out.append({"sessions": n, "wall_s": walls, "runs_s": runs, "order": order})
    return {"model": spec, "runs": out}


# ---- 2. RAM hits ----------------------------------------------------------------------------

def _ram_run(kind, model, docs, ban, samples, tmp, name):
    from serve_load import stop_server, stream_chat, warm_up
    proc, base, log = _server(kind, model, tmp, name)
    ttfts = {n: [] for n in RAM_IN_FLIGHT}
    try:
        warm_up(base, ban)
        for n in RAM_IN_FLIGHT:
            for d in docs[:n]:                             # the documents into RAM
                stream_chat(base, [{"role": "user", "content": d}], MAX_TOKENS, ban)
            for r in range(samples):
                qs = [[{"role": "user", "content": f"{d}\n\nQuestion {r}: what does part {r + 1} say?"}]
                      for d in docs[:n]]
                got = _together([lambda m=m: stream_chat(base, m, MAX_TOKENS, ban) for m in qs])
                ttfts[n] += [g["ttft_ns"] / 1e6 for g in got]
        return ttfts
    finally:
        stop_server(proc)
        log.close()


def bench_ram(report, quick, tmp, model, tok):
    ban = [tok.eos_id]
    docs = _texts(tok, max(RAM_IN_FLIGHT), QUICK_DOC_TOKENS if quick else FULL_DOC_TOKENS, skip=20000)
    samples = QUICK_RAM_SAMPLES if quick else FULL_RAM_SAMPLES
    pooled = {k: {n: [] for n in RAM_IN_FLIGHT} for k in ("stock", "kvstore")}
    for i, order in enumerate((("stock", "kvstore"), ("kvstore", "stock"))):
        for kind in order:
            for n, v in _ram_run(kind, model, docs, ban, samples, tmp, f"ram-{i}").items():
                pooled[kind][n] += v
            print(f"  [C2 round {i + 1} {kind} done]", file=sys.stderr, flush=True)
    out = {}
    for n in RAM_IN_FLIGHT:
        kv, st = (statistics.median(pooled[k][n]) for k in ("kvstore", "stock"))
        report.add(f"RAM hit: time to first token, {n} request{'s' if n > 1 else ''} in flight (a "
                   f"{len(tok.encode(docs[0])):,}-token document in RAM, a new question)",
                   {"text": f"{kv:.1f} ms"}, {"text": f"{st:.1f} ms"}, "time", kv / st,
                   ratio_text=f"{kv / st:.2f} ({kv - st:+.1f} ms)", target=f"≤ stock + {RAM_TARGET_MS:g} ms",
                   passed=kv - st <= RAM_TARGET_MS,
                   note=f"median of {len(pooled['kvstore'][n])} questions each, two servers of each kind, "
                        "the order alternated")
        out[n] = {"kvstore_ms": kv, "stock_ms": st}
    return out


# ---- 3. a stored prompt after a restart ---------------------------------------------------------

def bench_restart(report, quick, tmp, model, tok):
    from serve_load import stop_server, stream_chat, warm_up
    ban = [tok.eos_id]
    prompt = [{"role": "user", "content": _texts(tok, 1, QUICK_PROMPT_TOKENS if quick else FULL_PROMPT_TOKENS,
                                                  skip=60000)[0]}]
    cache = os.path.join(tmp, "cache-restart")
    ram, disk, reused = [], [], []
    for r in range(1 + (QUICK_RESTARTS if quick else FULL_RESTARTS)):
        from serve import start
        log_path = os.path.join(tmp, f"everyday-restart-{r}.log")
        with open(log_path, "wb") as log:
            proc, base = start([sys.executable, "-m", "kvstore", "serve", "--model", model, "--cache-dir", cache],
                               tmp, log)
            try:
                warm_up(base, ban)
                first = stream_chat(base, prompt, MAX_TOKENS, ban)
                if r == 0:
                    for _ in range(QUICK_RAM_REPEATS if quick else FULL_RAM_REPEATS):
                        ram.append(stream_chat(base, prompt, MAX_TOKENS, ban)["ttft_ns"] / 1e6)
                else:
                    disk.append(first["ttft_ns"] / 1e6)
                    reused.append(first["usage"] and (first["usage"].get("prompt_tokens_details") or {})
                                  .get("cached_tokens"))
            finally:
                stop_server(proc)
    n = len(tok.encode(prompt[0]["content"]))
    d, m = statistics.median(disk), statistics.median(ram)
    report.add(f"a {n:,}-token prompt repeated after SIGTERM + restart: TTFT of the disk hit vs the same "
               "prompt as a RAM hit before the restart (kvstore serve)", {"text": f"{d:.1f} ms"},
               {"text": f"{m:.1f} ms"}, "time", d / m, target=f"time ratio ≤ {RESTART_TARGET:g}",
               passed=d / m <= RESTART_TARGET,
               note=f"{len(disk)} restart(s), {len(ram)} RAM hits; reused after each restart: "
                    f"{', '.join(str(x) for x in reused)} tokens")
    return {"prompt_tokens": n, "disk_ms": disk, "ram_ms": ram, "reused": reused}


def bench_everyday(report, quick, tmp):
    """Part C: adds its rows to report (a bench.foundation.TextTable); returns its record."""
    from kvstore.demo import model as demo_model
    from serve import FULL_MODEL, QUICK_MODEL
    model = os.path.join(tmp, "model-everyday")
    _, tok = demo_model.write_model_dir(model, **(QUICK_MODEL if quick else FULL_MODEL))
    report.section("The everyday path: cold concurrent traffic, RAM hits and a stored prompt after a restart, "
                   "kvstore serve vs stock mlx_lm.server")
    t0 = time.perf_counter()
    out = {"cold": bench_cold(report, quick, tmp)}
    out["ram"] = bench_ram(report, quick, tmp, model, tok)
    out["restart"] = bench_restart(report, quick, tmp, model, tok)
    out["elapsed_s"] = time.perf_counter() - t0
    return out
