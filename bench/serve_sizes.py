"""kvstore serve at a real model's KV size: a gigabyte stored, and loaded, while two sessions decode.

Run as a script path (not ``python -m``), so the installed ``kvstore`` is the
one imported:

    python bench/serve_sizes.py             # P of 8,192 tokens at 144 KiB a token (Qwen3-8B's KV)
    python bench/serve_sizes.py --quick     # P of 2,048 tokens
    python bench/serve_sizes.py --json results.json

The model has Qwen3-8B's KV geometry (36 layers x 8 KV heads x 128 dims,
bfloat16: 144 KiB of KV a token) and a tiny hidden size (random weights,
kvstore.demo.model), so that it decodes quickly on this CPU; a cold prefill
of P would still take many minutes, so P's state is written straight into
the cache directory (bench/serve_load.write_checkpoint: random KV, the last
token computed by the model, so the canary passes) as one whole-prefix file
(layout "whole").  The server, with its default chain layout, loads it (a
disk hit of len(P) - 1 tokens), prefills P's last token, answers one token,
and then stores the finished request as its chain of 256-token blocks: 1.1
GiB for 8,192 tokens, none of them on disk as blocks yet.

Each round starts a fresh server on a fresh copy of that directory (the
whole file hard-linked), with the page cache dropped (as root), and
runs: two streaming sessions with short prompts decode; a baseline window;
P is sent (max_tokens=1); after P's answer the sessions keep decoding until
the server's `kvstore: saved ... tokens=N` line for P's chain (its time and
save_ms place the store's window on the client's clock) and one token
more.  Two kinds of round, in the order store, no store, no store, store:

- store: `kvstore serve` with its defaults;
- no store: the same with `--admit-after 1000000`, so that nothing is
  stored: the same run without kvstore's store (stock mlx_lm.server stores
  nothing); its window is as long as the store rounds' median, from P's
  answer.

Reported: the sessions' decode rate from P's answer to the end of the
store, over at least MIN_WINDOW_S (so the window holds mlx-lm's own stall
after P's answer, which every round has, and decoding after it), against
the no-store rounds' over windows as long (target >= 0.9), the longest gap between two
tokens of a session in that window in decode steps, counted from each
session's own first token after P's answer (a step: the median gap between
a session's tokens in the baseline window; target <= 3, or no longer than
without the store), the stall before those first tokens (the batch finishes
the step it had in flight with P and drops P, as stock does) with the store
against without it (target <= 1.1: the store waits for that step,
kvstore.serve.steps), and the decode rate while P's disk hit loads (P sent to the `kvstore: hit`
line) against the baseline (issue 25's target, >= 0.8, cold page cache).
"""

import itertools
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from foundation import TextTable, drop_page_cache, finish, harness_arguments, machine_info, machine_lines  # noqa: E402
from serve import start  # noqa: E402
from serve_load import (ServerStuck, baseline_then_p, decoding_sessions, log_events, log_tail,  # noqa: E402
                        long_prompt, progress, rate, stop_server, wait_for_chunks, warm_up, write_checkpoint)

GiB = 1 << 30
# Qwen3-8B's KV geometry, a tiny hidden size, bfloat16.
MODEL = dict(seed=2, layers=36, hidden=256, heads=16, kv_heads=8, head_dim=128, intermediate=512, dtype="bfloat16")
KV_PER_TOKEN = 36 * 8 * 128 * 2 * 2
FULL_TOKENS, QUICK_TOKENS = 8192, 2048      # P's stored chain; P itself is 2 tokens longer
ROUNDS, QUICK_ROUNDS = 2, 1                 # of each kind, in the order store, none, none, store
BASELINE_S = 3.0
# The decode-rate window runs from P's answer to the end of P's store, and at
# least this long: mlx-lm stalls the batch after P's answer in every round
# (13 steps twice here, the same without the store), and a store that ends
# inside that stall must be judged by what it adds to it, over a window in
# which the sessions also decode.
MIN_WINDOW_S = 8.0
STORE_WAIT_S = 300
NO_STORE = ["--admit-after", "1000000"]
RATE_TARGET = 0.9
GAP_TARGET_STEPS = 3
# The store must not lengthen the stall stock mlx-lm has as P leaves the
# batch (kvstore.serve.steps: it waits for that step).
STALL_TARGET = 1.1
LOAD_TARGET = 0.8


def fresh_copy(src, dst):
    """dst: src's checkpoint files hard-linked, its other files copied (so each round starts the same)."""
    os.makedirs(dst, mode=0o700)
    for name in os.listdir(src):
        path = os.path.join(src, name)
        if name.endswith(".kv"):
            os.link(path, os.path.join(dst, name))
        elif os.path.isdir(path):
            shutil.copytree(path, os.path.join(dst, name))
        else:
            shutil.copy2(path, os.path.join(dst, name))


def to_ns(clocks, wall):
    """A server log's wall time on the client's perf_counter_ns clock (the pair taken at P's send)."""
    return clocks["ns"] + int((wall - clocks["wall"]) * 1e9)


def wait_for_save(log_path, tokens, clocks, deadline_s=STORE_WAIT_S):
    """(start, end) of the save of P's chain on the client's clock, from its `kvstore: saved` line."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        for wall, msg in log_events(log_path):
            if msg.startswith("kvstore: saved ") and f" tokens={tokens} " in msg:
                save_ms = float(msg.split(" save_ms=")[1].split()[0])
                end = to_ns(clocks, wall)
                return end - int(save_ms * 1e6), end
        time.sleep(0.1)
    raise ServerStuck(f"no `kvstore: saved ... tokens={tokens}` line in {deadline_s} s")


def gaps_in(live, lo, hi):
    """The gaps between consecutive tokens of each session that overlap [lo, hi)."""
    out = []
    for o in live:
        seq = o["chunks_ns"]
        out += [b - a for a, b in itertools.pairwise(seq) if b > lo and a < hi]
    return out


def gaps_from(live, t0, hi):
    """The gaps between consecutive tokens of each session that start in [t0, hi): each
    session's from its own first token at or after t0."""
    return [b - a for o in live for a, b in itertools.pairwise(o["chunks_ns"]) if t0 <= a < hi]


def resume_ns(live, t0):
    """The longest any session waited from t0 for its next token."""
    return max(min(c for c in o["chunks_ns"] if c > t0) - t0 for o in live)


def step_ns(live, lo, hi):
    """A decode step: the median gap between a session's tokens in [lo, hi)."""
    return statistics.median(gaps_in(live, lo, hi))


def one_round(cmd, tmp, index, src, messages, ban, tokens, window_s):
    """One fresh server: baseline, P's disk hit, then the store (or window_s without one)."""
    cache_dir = os.path.join(tmp, f"cache-{index}")
    fresh_copy(src, cache_dir)
    dropped = drop_page_cache()
    path = os.path.join(tmp, f"round-{index}.log")
    with open(path, "wb") as log:
        proc, base = start(cmd + ["--cache-dir", cache_dir], tmp, log)
    failed = True
    try:
        warm_up(base, ban)
        with decoding_sessions(base, f"round {index}", ban) as (live, errors):
            t_base, p, clocks = baseline_then_p(base, messages, ban, BASELINE_S)
            answered = time.perf_counter_ns()
            if window_s is None:
                s_lo, s_hi = wait_for_save(path, tokens, clocks)
                window_s = max((s_hi - answered) / 1e9, MIN_WINDOW_S)
            else:
                s_lo = s_hi = None
            lo, hi = answered, answered + int(window_s * 1e9)
            time.sleep(max(0.0, (hi - time.perf_counter_ns()) / 1e9))
            wait_for_chunks(live, hi, errors)
        failed = False
    except ServerStuck as e:
        raise SystemExit(f"serve_sizes round {index}: {e}; its log ends:\n{log_tail(path)}") from None
    finally:
        stop_server(proc, failed)
    hits = [to_ns(clocks, w) for w, msg in log_events(path) if msg.startswith("kvstore: hit ")]
    hit = next((h for h in hits if h >= p["sent_ns"] - 1_000_000), None)
    chunks = sorted(c for o in live for c in o["chunks_ns"])
    # Until each session's first token after P's answer the batch runs the
    # step it had in flight with P, then drops P (stock does the same): the
    # resume gap.  The gaps after it are the store's to answer for.
    sent, step = p["sent_ns"], step_ns(live, t_base, p["sent_ns"])
    shutil.rmtree(cache_dir)
    return {"baseline_tps": rate(chunks, t_base, sent), "answered_s": (answered - sent) / 1e9, "step_ms": step / 1e6, "dropped": dropped,
            "window_tps": rate(chunks, lo, hi), "window_s": (hi - lo) / 1e9,
            "store_start_after_answer_s": None if s_lo is None else (s_lo - answered) / 1e9,
            "store_s": None if s_lo is None else (s_hi - s_lo) / 1e9,
            "max_gap_steps": max(gaps_from(live, answered, hi), default=0) / step,
            "resume_gap_steps": resume_ns(live, answered) / step,
            "load_s": None if hit is None else (hit - sent) / 1e9,
            "load_tps": None if hit is None else rate(chunks, sent, hit), "ttft_s": p["ttft_ns"] / 1e9}


def prepare(tmp, quick):
    """The model directory, P's messages and ids, and the directory holding P's whole-prefix file."""
    from mlx_lm.utils import load_tokenizer

    from kvstore.demo import model as demo_model
    model = os.path.join(tmp, "model")
    _, tok = demo_model.write_model_dir(model, **MODEL)
    hf = load_tokenizer(model)
    tokens = QUICK_TOKENS if quick else FULL_TOKENS
    messages, ids = long_prompt(tok, hf, tokens + 2)
    src = os.path.join(tmp, "source")
    t0 = time.perf_counter()
    file_bytes, tensor_bytes, _ = write_checkpoint(model, src, hf, ids, 7, layout="whole")
    progress(f"serve_sizes: P has {len(ids):,} tokens; its whole file {file_bytes / GiB:.2f} GiB, written in "
             f"{time.perf_counter() - t0:.1f} s")
    return model, tok, messages, ids, src, file_bytes


def med(recs, key):
    v = [r[key] for r in recs if r[key] is not None]
    return statistics.median(v) if v else float("nan")


def report_rows(report, recs, size, stored_tokens):
    store, none = recs["store"], recs["none"]
    # (A quick run's window can be shorter than one step: no token, no ratio.)
    ratio = med(store, "window_tps") / med(none, "window_tps") if med(none, "window_tps") else float("nan")
    report.add(f"decode rate of 2 streaming sessions while a finished request's {size} chain "
               f"({stored_tokens:,} tokens) is stored, vs the same window without the store",
               {"text": f"{med(store, 'window_tps'):.1f} tok/s"}, {"text": f"{med(none, 'window_tps'):.1f} tok/s"},
               "throughput", ratio, target=f"throughput ratio ≥ {RATE_TARGET}", passed=ratio >= RATE_TARGET,
               note=f"window from P's answer to the store's end, at least {MIN_WINDOW_S:.0f} s "
                    f"({med(store, 'window_s'):.2f} s; the store {med(store, 'store_s'):.2f} s, starting "
                    f"{med(store, 'store_start_after_answer_s'):.2f} s after P's answer); baseline {med(store, 'baseline_tps'):.1f} and {med(none, 'baseline_tps'):.1f} "
                    "tok/s; per round " + ", ".join(f"{r['window_tps']:.1f}" for r in store) + " vs "
                    + ", ".join(f"{r['window_tps']:.1f}" for r in none))
    gap, floor = max(r["max_gap_steps"] for r in store), max(r["max_gap_steps"] for r in none)
    report.add("the longest gap between two tokens of a session during the store, in decode steps",
               {"text": f"{gap:.1f} steps"}, {"text": f"{floor:.1f} steps"},
               "steps", gap, target=f"≤ {GAP_TARGET_STEPS} steps, or ≤ the same window's without the store",
               passed=gap <= max(GAP_TARGET_STEPS, floor),
               note=f"each session's gaps from its first token after P's answer to the window's end; a step: the "
                    f"median gap in the baseline window, {med(store, 'step_ms'):.0f} ms; the worst round")
    stall, stock = max(r["resume_gap_steps"] for r in store), max(r["resume_gap_steps"] for r in none)
    report.add("the batch's stall as P leaves it: from P's answer to each session's next token (the step in flight "
               "still carries P, stock mlx-lm's own), with the store vs without", {"text": f"{stall:.1f} steps"},
               {"text": f"{stock:.1f} steps"}, "time", stall / stock, target=f"time ratio ≤ {STALL_TARGET}",
               passed=stall / stock <= STALL_TARGET,
               note="per round " + ", ".join(f"{r['resume_gap_steps']:.1f}" for r in store) + " vs "
                    + ", ".join(f"{r['resume_gap_steps']:.1f}" for r in none) + "; the worst round")
    load = [r["load_tps"] / r["baseline_tps"] for r in store + none if r["load_tps"] is not None]
    got = statistics.median(load) if load else float("nan")
    report.add(f"decode rate of 2 sessions while P's {size} disk hit loads (P sent to the `kvstore: hit` line), "
               "cold page cache, vs the baseline",
               {"text": f"{statistics.median(r['load_tps'] for r in store + none if r['load_tps']):.1f} tok/s"},
               {"text": f"{statistics.median(r['baseline_tps'] for r in store + none):.1f} tok/s"},
               "throughput", got, target=f"throughput ratio ≥ {LOAD_TARGET}", passed=got >= LOAD_TARGET,
               note=f"load part {med(store + none, 'load_s'):.2f} s; per round "
                    + ", ".join(f"{x:.2f}" for x in load))


def main(argv=None):
    args = harness_arguments(__doc__, "P of 2,048 tokens, one round of each kind", argv,
                             strict_help="exit 1 when a target is missed")
    t_start = time.perf_counter()
    info = machine_info()
    report = TextTable()
    with tempfile.TemporaryDirectory(prefix="kvstore-bench-serve-sizes-", dir="/tmp") as tmp:
        model, tok, messages, ids, src, file_bytes = prepare(tmp, args.quick)
        stored = (len(ids) // 256) * 256
        cmd = [sys.executable, "-m", "kvstore", "serve", "--model", model]
        rounds = QUICK_ROUNDS if args.quick else ROUNDS
        order = ["store", "none", "none", "store"][:2 * rounds]
        recs = {"store": [], "none": []}
        for i, kind in enumerate(order):
            window = None if kind == "store" else med(recs["store"], "window_s") if recs["store"] else 8.0
            r = one_round(cmd + (NO_STORE if kind == "none" else []), tmp, i, src, messages, [tok.eos_id],
                          stored, window)
            recs[kind].append(r)
            progress(f"serve_sizes round {i} ({kind}): {r['window_tps']:.1f} tok/s over {r['window_s']:.2f} s "
                     f"(baseline {r['baseline_tps']:.1f}), longest gap {r['max_gap_steps']:.1f} steps; load "
                     f"{r['load_s'] or float('nan'):.2f} s at {r['load_tps'] or float('nan'):.1f} tok/s")
    elapsed = time.perf_counter() - t_start
    size = f"{stored * KV_PER_TOKEN / GiB:.2f} GiB"
    report.section(f"kvstore serve at Qwen3-8B's KV size (144 KiB a token): a {size} store and a disk hit "
                   "beside two decoding sessions")
    report_rows(report, recs, size, stored)
    print(f"# kvstore serve at real KV sizes ({'quick' if args.quick else 'full'} run)\n")
    print(machine_lines(info))
    print(f"- model: a random-weight llama with Qwen3-8B's KV geometry, {MODEL}; P {len(ids):,} tokens, its "
          f"whole file {file_bytes / GiB:.2f} GiB; page cache "
          + ("dropped before each round" if recs["store"][0]["dropped"] else "NOT dropped (not root)"))
    print(f"- elapsed {elapsed:.1f} s\n")
    print(report.markdown())
    return finish(args, info, elapsed, report, rounds=recs, prompt_tokens=len(ids), stored_tokens=stored)


if __name__ == "__main__":
    sys.exit(main())
