"""End to end: the demo's agent workload with kvstore, with mlx-lm's in-memory prompt cache and with none.

Run as a script path (not ``python -m``), so the installed ``kvstore`` is the
one imported:

    python bench/e2e.py              # full run: a warm-up round and 3 counted rounds, about 4 minutes
    python bench/e2e.py --quick      # one round, about a minute and a half
    python bench/e2e.py --json results.json

The workload is ``kvstore demo``'s (kvstore/demo/workload.py): three users of one agent
whose long system prompt is the same for everyone, two turns each, a server
restart, a third turn each, one user switching back to an earlier session by
its hash.  Three configurations serve the same requests with the same model
(the demo's embedded random-weight llama, nothing downloaded):

(a) kvstore: ``demo.run_phase`` exactly as ``kvstore demo`` runs it
    (PromptCache over a KVStore: the live session in memory, checkpoints on
    disk).  The restart is a new KVStore, engine and PromptCache on the same
    directory: memory is gone, the disk stays.  (The demo runs its second
    phase in a new process; here it runs in this one, so the model stays
    loaded for the other two configurations.)
(b) mlx-lm: ``mlx_lm.models.cache.LRUPromptCache``, the in-memory cache
    ``mlx_lm.server`` keeps: the nearest cached token prefix, trimmed to the
    common prefix and copied, then the rest prefilled; the prompt's cache is
    inserted after each request.  The restart empties it.
(c) no prompt cache: every request prefills its whole prompt.

(b) and (c) serve the prompts (a) rendered, recorded as they pass through
``MLXEngine.generate``.  TTFT is from the prompt text to the first sampled
token; (a) reports it from ``MLXEngine.generate`` (find, load, prefill), (b)
and (c) time the same span around their own code.  A round runs the whole
workload once per configuration, in an order that alternates by round.

The machine this was written for is a shared, noisy 2-core VM with MLX's
CPU wheel (a slow reference BLAS): compare ratios, not absolute numbers.
"""

import contextlib
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from foundation import Table, harness_arguments, machine_info, machine_lines  # noqa: E402
from kvstore.demo import workload as demo  # noqa: E402
from ttft import first_token, fmt_cell as fmt_time_cell, fmt_ratio, prefill_aligned, request_cold  # noqa: E402
from ttft import stats  # noqa: E402

FULL_ROUNDS = 3
QUICK_ROUNDS = 1
# All three configurations prefill in the demo's chunks: the same chunks
# compute the same state (and on MLX's reference BLAS, 2,048-token chunks
# were slower than the demo's 256 on these prompts).
PREFILL_STEP = demo.PREFILL_STEP
WARMUP_CHARS = 2000
# mlx_lm.server's defaults: 10 cached sequences, no byte limit.
LRU_MAX_SIZE = 10
MODEL_KEY = "demo"

CONFIGS = ("kvstore", "mlx-lm", "none")
CONFIG_LABELS = {
    "kvstore": "kvstore (memory + disk; restart keeps the disk)",
    "mlx-lm": "mlx-lm LRUPromptCache (memory; restart empties it)",
    "none": "no prompt cache (every request prefills its whole prompt)",
}


def fmt_cell(s):
    if "hits" in s:
        return f"{s['hits']}/{s['requests']} ({100 * s['hits'] / s['requests']:.0f}%)"
    return fmt_time_cell(s)


class Report(Table):
    """Rows of the results table (the columns of bench/store.py)."""

    fmt_cell = staticmethod(fmt_cell)
    fmt_ratio = staticmethod(fmt_ratio)

    def add(self, comparison, kv, peer, note=""):
        """A context row: ratio = kvstore / peer on the medians (times: lower is
        better) or on the hit rates (higher is better)."""
        if "hits" in kv:
            kind, ratio = "hit rate", (kv["hits"] / kv["requests"]) / max(peer["hits"] / peer["requests"], 1e-9)
            ratio_min = ratio
        else:
            kind, ratio, ratio_min = "time", kv["median_ns"] / peer["median_ns"], kv["min_ns"] / peer["min_ns"]
        self._row(comparison, kv, peer, kind, ratio, ratio_min, "context", None, note)


# ---------------------------------------------------------------- (a) kvstore

@contextlib.contextmanager
def recording(prompts):
    """Appends every prompt MLXEngine.generate serves to prompts, while active."""
    from kvstore.mlx import MLXEngine
    original = MLXEngine.generate

    def generate(self, prompt_cache, prompt, *args, **kwargs):
        prompts.append(prompt)
        return original(self, prompt_cache, prompt, *args, **kwargs)

    MLXEngine.generate = generate
    try:
        yield
    finally:
        MLXEngine.generate = original


def run_kvstore(workdir):
    """The demo's two phases on a new cache directory.

    Returns:
        (one result per request, the prompts in order, the index of the first
        request after the restart).
    """
    directory = tempfile.mkdtemp(prefix="cache-", dir=workdir)
    prompts = []
    # The demo prints its rows on stdout; this harness's stdout is its report.
    with recording(prompts), contextlib.redirect_stdout(sys.stderr):
        rows = demo.run_phase(1, directory, None, workdir)
        restart = len(rows)
        rows += demo.run_phase(2, directory, None, workdir)
    results = [{"ttft_ns": r["ttft_ms"] * 1e6, "source": r["source"], "reused": r["reused_tokens"],
                "prefilled": r["prefilled_tokens"]} for r in rows]
    return results, prompts, restart


# ---------------------------------------------------------------- (b) mlx-lm, (c) none

def request_lru(model, tok, lru, prompt):
    """One request through mlx-lm's in-memory prompt cache, as mlx_lm.server serves it."""
    from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache
    from kvstore.mlx import MLXEngine
    engine = MLXEngine(model, tok)
    t0 = time.perf_counter_ns()
    ids = engine.tokenize(prompt.encode())
    cache, rest = lru.fetch_nearest_cache(MODEL_KEY, ids)
    if cache is None:
        cache = make_prompt_cache(model)
    elif not rest:                     # the whole prompt is cached: recompute its last token for logits
        trim_prompt_cache(cache, 1)
        rest = ids[-1:]
    engine.cache = cache
    first_token(prefill_aligned(engine, list(rest), len(ids) - len(rest), step=PREFILL_STEP))
    dt = time.perf_counter_ns() - t0
    lru.insert_cache(MODEL_KEY, ids, engine.cache)
    reused = len(ids) - len(rest)
    return {"ttft_ns": dt, "source": "memory" if reused else "none", "reused": reused, "prefilled": len(rest)}


def run_lru(chat, prompts, restart):
    from mlx_lm.models.cache import LRUPromptCache
    results = []
    for i, prompt in enumerate(prompts):
        if i in (0, restart):
            lru = LRUPromptCache(max_size=LRU_MAX_SIZE)
        results.append(request_lru(chat.model, chat.tokenizer, lru, prompt))
    return results


def run_none(chat, prompts):
    from kvstore.mlx import MLXEngine
    results = []
    for prompt in prompts:
        dt, _ = request_cold(chat.model, chat.tokenizer, prompt, step=PREFILL_STEP)
        n = len(MLXEngine(chat.model, chat.tokenizer).tokenize(prompt.encode()))
        results.append({"ttft_ns": dt, "source": "none", "reused": 0, "prefilled": n})
    return results


# ---------------------------------------------------------------- main

def summarize(results):
    """Hit counts, tokens and TTFT stats over every request of every counted round."""
    flat = [r for rnd in results for r in rnd]
    return {"requests": len(flat), "hits": sum(r["source"] != "none" for r in flat),
            "memory_hits": sum(r["source"] == "memory" for r in flat),
            "disk_hits": sum(r["source"] == "disk" for r in flat),
            "reused_tokens": sum(r["reused"] for r in flat), "prefilled_tokens": sum(r["prefilled"] for r in flat),
            "ttft": stats([r["ttft_ns"] for r in flat]),
            "round_mean_ttft": stats([statistics.mean(r["ttft_ns"] for r in rnd) for rnd in results])}


def workload_table(summary):
    lines = ["| configuration | requests | hits (memory / disk) | hit rate | tokens reused / prefilled "
             "| TTFT median / min | mean TTFT per round, median |",
             "|---|---|---|---|---|---|---|"]
    for name in CONFIGS:
        s = summary[name]
        lines.append(f"| {CONFIG_LABELS[name]} | {s['requests']} | {s['hits']} ({s['memory_hits']} / "
                     f"{s['disk_hits']}) | {100 * s['hits'] / s['requests']:.0f}% | {s['reused_tokens']:,} / "
                     f"{s['prefilled_tokens']:,} | {fmt_time_cell(s['ttft'])} "
                     f"| {fmt_time_cell(s['round_mean_ttft']).split(' / ')[0]} |")
    return "\n".join(lines)


def main(argv=None):
    args = harness_arguments(__doc__, "one round, no warm-up round", argv)

    t_start = time.perf_counter()
    info = machine_info()
    rounds = QUICK_ROUNDS if args.quick else FULL_ROUNDS
    results = {name: [] for name in CONFIGS}
    with tempfile.TemporaryDirectory(prefix="kvstore-bench-e2e-") as tmp:
        chat = demo.Chat(None, tmp)
        # Warm-up: MLX builds its kernels on the first calls (a prompt of a
        # few hundred tokens).  The full run also serves one whole uncounted
        # round (round -1).
        request_cold(chat.model, chat.tokenizer, demo.system_text()[:WARMUP_CHARS], step=PREFILL_STEP)
        prompts = restart = None
        for r in range(0 if args.quick else -1, rounds):
            t0 = time.perf_counter()
            # kvstore first in even rounds; the peers need its prompts, so round 0
            # of a quick run (no warm-up round) starts with it too.
            order = CONFIGS if r % 2 == 0 or prompts is None else CONFIGS[::-1]
            for name in order:
                if name == "kvstore":
                    out, prompts, restart = run_kvstore(tmp)
                elif name == "mlx-lm":
                    out = run_lru(chat, prompts, restart)
                else:
                    out = run_none(chat, prompts)
                if r >= 0:
                    results[name].append(out)
            label = f"round {r + 1}/{rounds}" if r >= 0 else "warm-up round"
            print(f"  [{label}: {time.perf_counter() - t0:.1f} s]", file=sys.stderr, flush=True)
    elapsed = time.perf_counter() - t_start

    summary = {name: summarize(results[name]) for name in CONFIGS}
    kv, lru, none = (summary[k] for k in CONFIGS)
    report = Report()
    report.section("End to end: the demo's agent workload (3 users, a restart, a session switch)")
    hit_note = f"no prompt cache: 0/{none['requests']}"
    report.add("hit rate: kvstore vs mlx-lm LRUPromptCache", kv, lru,
               note=f"{hit_note}; kvstore: {kv['memory_hits']} memory, {kv['disk_hits']} disk")
    report.add("median TTFT per request: kvstore vs no prompt cache", kv["ttft"], none["ttft"],
               note=f"speed-up {none['ttft']['median_ns'] / kv['ttft']['median_ns']:.1f}×")
    report.add("median TTFT per request: kvstore vs mlx-lm LRUPromptCache", kv["ttft"], lru["ttft"])
    report.add("mean TTFT per request (a round's total wait): kvstore vs no prompt cache",
               kv["round_mean_ttft"], none["round_mean_ttft"],
               note=f"median / min over {rounds} counted round{'s' if rounds > 1 else ''}")
    report.add("mean TTFT per request (a round's total wait): kvstore vs mlx-lm LRUPromptCache",
               kv["round_mean_ttft"], lru["round_mean_ttft"],
               note="mlx-lm's cache is empty after the restart: its first request there is cold")

    print(f"# kvstore end-to-end benchmark: the demo's agent workload ({'quick' if args.quick else 'full'} run)\n")
    print(machine_lines(info))
    print(f"- model: {chat.name}; {len(prompts)} requests a round ({restart} before the restart); demo "
          f"store policy {demo.DEMO_SETTINGS}; prefill step {PREFILL_STEP} in all three")
    print(f"- rounds: {rounds} counted" + ("" if args.quick else " after one uncounted warm-up round")
          + "; each serves the whole workload once per configuration, the order alternating by round")
    print(f"- elapsed {elapsed:.1f} s")
    print("- cells are median / min over every request of every counted round; ratio = kvstore / peer\n")
    print(workload_table(summary) + "\n")
    print(report.markdown())

    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": info, "quick": args.quick, "elapsed_s": elapsed, "rounds": rounds,
                       "summary": summary, "results": results, "rows": report.rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
