"""`kvstore demo`: a scripted agent workload served through PromptCache.

Three users talk to one agent whose long system prompt (instructions plus tool
schemas) is the same for everyone.  The first request prefills everything and
stores the system prompt's checkpoint at the chat anchor; every later request
reuses the longest stored or live prefix and prefills only its own turn.  Half
way through, the server stops (the store is closed, the live session stored
as `shutdown`) and a new process reopens the directory: the checkpoints
survive, and the users' next turns are disk hits.  One user switches back to
an earlier agent session by its hash.

With no model path the model is an embedded random-weight llama and a byte-
level BPE tokenizer trained on the spot (kvstore.demo.model): nothing is
downloaded.  A local mlx-lm model directory can be used instead.

The command line (`kvstore demo`, in kvstore.cli) parses the options and
draws the progress bars; this module runs the workload and prints its rows.
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

# The embedded model: small enough that the whole demo runs in well under two
# minutes on two CPU cores with MLX's reference BLAS, big enough that a cold
# prefill of the system prompt is visibly slower than a cache hit.
DEMO_MODEL = dict(seed=0, layers=4, hidden=128, heads=4, kv_heads=2)
GENERATE_TOKENS = 8

# The store policy of a real server (ds4's defaults) but for the alignment:
# the demo's turns are a few hundred tokens, so waypoints every 1024 tokens
# on a 256-token grid show the mechanism without a 10,000-token prompt.
DEMO_SETTINGS = dict(min_tokens=256, continued_interval_tokens=1024, boundary_align_tokens=256)
PREFILL_STEP = 256

SYSTEM_PROMPT = """You are Harbor, an operations agent for a small logistics company. You plan
shipments, answer questions about orders and keep the warehouse records straight. Be brief and
exact; quote order numbers as given; never invent a tracking code. When a tool can answer, call
it instead of guessing, and explain in one sentence what you did.

Rules of the house:
1. Orders ship from the warehouse nearest to the customer unless stock is short there.
2. Fragile goods travel by road, never by air freight.
3. A refund above 500 euros needs a manager's approval; ask for it with the approvals tool.
4. Dates are written as YYYY-MM-DD; weights in kilograms; prices in euros with two decimals.
5. When two rules conflict, the safety of people and goods comes first, then the customer's
   deadline, then the cost.

You can call these tools. Reply with a JSON object {"tool": name, "arguments": {...}}.
"""

TOOLS = [
    ("lookup_order", "Finds an order by its number and returns items, status and address.",
     {"order_id": "string, like ORD-2024-00042"}),
    ("stock_level", "Returns units on hand for a product code in every warehouse.",
     {"product": "string, the product code", "warehouse": "optional string"}),
    ("plan_shipment", "Plans a shipment and returns carrier, route, cost and arrival date.",
     {"order_id": "string", "mode": "road | rail | air", "deadline": "YYYY-MM-DD"}),
    ("track", "Returns the tracking history of a shipment.", {"tracking_code": "string"}),
    ("approvals", "Asks a manager to approve an action; returns a ticket number.",
     {"action": "string", "amount_eur": "number", "reason": "string"}),
    ("weather", "Returns the forecast for a city for the next three days.", {"city": "string"}),
    ("calendar", "Lists the dock slots free at a warehouse on a date.",
     {"warehouse": "string", "date": "YYYY-MM-DD"}),
    ("customer_note", "Adds a note to a customer's file.", {"customer_id": "string", "note": "string"}),
]

USERS = {
    "ana": ["Where is order ORD-2024-00042 and when will it arrive?",
            "Can you move it to rail if that is cheaper but still on time?",
            "Please add a note that the customer prefers morning deliveries."],
    "ben": ["How many units of product GLASS-07 do we have in each warehouse?",
            "Plan a shipment of 40 units to Lyon by 2024-06-14, they are fragile.",
            "The customer wants a refund of 620 euros for two broken boxes. What now?"],
    "chloe": ["Which dock slots are free in Rotterdam tomorrow?",
              "Book the earliest one for the inbound container from Hamburg.",
              "Going back to my first question: is there anything free on Friday instead?"],
}
REPLY = "Understood. I checked the records with the tools and here is what I found, in short."


WAREHOUSES = ["Rotterdam", "Hamburg", "Lyon", "Milan", "Gdansk", "Valencia"]
PRODUCTS = ["GLASS", "STEEL", "PAPER", "RESIN", "CABLE", "TILES", "PAINT", "GRAIN"]


def catalog():
    """A product table of the kind agents carry in their context (deterministic)."""
    lines = ["code | description | weight kg | fragile | home warehouse | unit price EUR"]
    for i in range(40):
        p = PRODUCTS[i % len(PRODUCTS)]
        lines.append(f"{p}-{i:02d} | {p.lower()} lot {i} in {1 + i % 7} crates | {2.5 + (i * 37) % 90:.1f} | "
                     f"{'yes' if p in ('GLASS', 'TILES') else 'no'} | {WAREHOUSES[i % len(WAREHOUSES)]} | "
                     f"{9.99 + (i * 13) % 400:.2f}")
    return "\n".join(lines)


def system_text():
    tools = "\n".join(json.dumps({"name": n, "description": d, "parameters": p}) for n, d, p in TOOLS)
    return SYSTEM_PROMPT + "\nTools:\n" + tools + "\n\nCatalog:\n" + catalog() + "\n"


# ---- model and rendering -----------------------------------------------------

class Chat:
    """The model, its tokenizer and the chat rendering the demo uses."""

    def __init__(self, model_path=None, workdir=None):
        if model_path:
            import mlx_lm
            self.model, self.tokenizer = mlx_lm.load(model_path)
            self.name = os.path.basename(os.path.normpath(model_path))
            self.markers = {}
        else:
            from kvstore.demo import model as demo_model
            self.tokenizer = demo_model.make_tokenizer(os.path.join(workdir, "tokenizer"))
            self.model = demo_model.make_model(vocab=self.tokenizer.vocab_size, **DEMO_MODEL)
            self.name = "embedded random-weight llama ({layers} layers, hidden {hidden})".format(**DEMO_MODEL)
            self.markers = {}

    def render(self, messages):
        if hasattr(self.tokenizer, "render_chat"):
            return self.tokenizer.render_chat(messages)
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def conversation(user, turns, reply=REPLY):
    """The messages of a user's first `turns` questions, with scripted replies between."""
    msgs = [{"role": "system", "content": system_text()}]
    for i in range(turns):
        msgs.append({"role": "user", "content": f"({user}) " + USERS[user][i]})
        if i < turns - 1:
            msgs.append({"role": "assistant", "content": reply})
    return msgs


# ---- output ------------------------------------------------------------------

HEADER = f"{'user':<6} {'turn':>4}  {'cache':<7} {'reused':>7} {'prefilled':>9} {'TTFT ms':>9}  stored"


def print_row(row):
    stored = ", ".join(f"{r}@{n}" for r, n in row["stored"]) or "-"
    print(f"{row['user']:<6} {row['turn']:>4}  {row['source']:<7} {row['reused_tokens']:>7} "
          f"{row['prefilled_tokens']:>9} {row['ttft_ms']:>9.0f}  {stored}", flush=True)


# ---- one phase of the workload -----------------------------------------------

def run_phase(phase, directory, model_path, workdir, progress=None):
    """Runs the requests of one phase; returns their rows.

    Args:
        progress: optional factory of a prefill progress callback: each
            request gets progress() -> callable(done, total) with a clear()
            method, shown for prompts of at least two prefill chunks.
    """
    import kvstore
    from kvstore import sessions
    from kvstore.mlx import MLXEngine

    chat = Chat(model_path, workdir)
    engine = MLXEngine(chat.model, chat.tokenizer, **chat.markers)
    # The store holds this model's states (its fingerprint names every file).
    store = kvstore.KVStore(directory, model_identity=engine.identity, **DEMO_SETTINGS)
    server = kvstore.PromptCache(store, engine, prefill_step=PREFILL_STEP)
    rows = []
    if phase == 1:
        print(f"model: {chat.name}", flush=True)
        print(f"cache: {directory}\n", flush=True)
        print(HEADER, flush=True)
    plan = [(u, t) for t in ((1, 2) if phase == 1 else (3,)) for u in USERS]
    for user, turn in plan:
        if phase == 2 and user == "chloe":
            # Chloe goes back to her first exchange: switch to that session by hash.
            mine = [s for s in sessions.list(store) if s.title == "chloe: dock slots"]
            if mine:
                ckpt = sessions.switch(store, mine[0].sha[:8], into="mlx")
                server.adopt(ckpt)
                print(f"{'chloe':<6} {'':>4}  switch to session {mine[0].sha[:8]} "
                      f"({len(ckpt.tokens)} tokens, \"{mine[0].title}\")", flush=True)
            prompt = chat.render(conversation(user, 1) + [
                {"role": "assistant", "content": REPLY},
                {"role": "user", "content": "(chloe) " + USERS["chloe"][2]}])
        else:
            prompt = chat.render(conversation(user, turn))
        bar = progress() if progress is not None else None
        _, report = engine.generate(server, prompt, max_tokens=GENERATE_TOKENS, keep_generated=False,
                                    progress=None if bar is None else
                                    lambda done, total: bar(done, total) if total >= 2 * PREFILL_STEP else None)
        if bar is not None:
            bar.clear()
        row = dict(report, user=user, turn=turn)
        rows.append(row)
        print_row(row)
        if phase == 1 and user == "chloe" and turn == 1:
            tensors, meta, positional = engine.snapshot()
            sessions.save(store, server.live_text, server.live_tokens, tensors, meta=meta,
                          title="chloe: dock slots", positional=positional,
                          text_offsets=engine.text_offsets(server.live_tokens, len(server.live_text)))
    server.close()          # the live session is stored as `shutdown`
    store.close()
    return rows


def summary(rows, directory):
    import kvstore
    hits = [r for r in rows if r["source"] != "none"]
    cold = [r["ttft_ms"] for r in rows if r["source"] == "none"]
    warm = [r["ttft_ms"] for r in hits]
    with kvstore.KVStore(directory, **DEMO_SETTINGS) as store:
        entries = store.entries()
        counted = store.counters()
    by_reason = {}
    for e in entries:
        by_reason[e.reason.name.lower()] = by_reason.get(e.reason.name.lower(), 0) + 1
    print()
    print(f"requests: {len(rows)}; cache hits: {len(hits)} ({100 * len(hits) / len(rows):.0f}%: "
          f"{sum(r['source'] == 'memory' for r in rows)} memory, {sum(r['source'] == 'disk' for r in rows)} disk)")
    print(f"tokens reused: {sum(r['reused_tokens'] for r in rows)}, "
          f"prefilled: {sum(r['prefilled_tokens'] for r in rows)}")
    if cold and warm:
        c, w = statistics.median(cold), statistics.median(warm)
        print(f"median TTFT: cold {c:.0f} ms, hit {w:.0f} ms, speed-up {c / w:.1f}x")
    print(f"on disk: {len(entries)} checkpoints, {sum(e.file_size for e in entries) / 1e6:.1f} MB "
          f"({', '.join(f'{k} {v}' for k, v in sorted(by_reason.items()))})")
    print(f"canary: {counted['canary_checks']} restored states checked against the model, "
          f"{counted['canary_failures']} failed")


# ---- the whole demo ------------------------------------------------------------

def run(directory=None, model_path=None, progress=None, show_progress=False):
    """Runs both phases, the second in a new process; prints rows and a summary.

    Args:
        directory: the cache directory (default: a new temporary one).
        model_path: a local mlx-lm model directory (default: the embedded model).
        progress: prefill progress factory for this process (see run_phase).
        show_progress: ask the restarted process for progress bars too.

    Returns:
        the exit status.
    """
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvstore-demo-") as tmp:
        directory = os.path.abspath(directory) if directory else os.path.join(tmp, "cache")
        rows = run_phase(1, directory, model_path, tmp, progress)
        print(f"\n-- restart: the server stops; a new process opens {os.path.basename(directory)}/ --\n",
              flush=True)
        rows_file = os.path.join(tmp, "rows.json")
        cmd = [sys.executable, "-m", "kvstore", "demo", "--phase", "2", "--dir", directory,
               "--workdir", tmp, "--rows", rows_file] + (["--model", model_path] if model_path else []) \
            + (["--progress"] if show_progress else [])
        rc = subprocess.call(cmd, cwd=tmp)
        if rc != 0:
            print(f"kvstore: error: the restarted process failed (exit {rc})", file=sys.stderr)
            return 1
        with open(rows_file) as f:
            rows += json.load(f)
        summary(rows, directory)
    print(f"demo finished in {time.perf_counter() - t0:.0f} s")
    return 0


def run_restarted(directory, model_path, workdir, rows_file, progress=None):
    """The second phase, in the restarted process: runs it and writes its rows to rows_file."""
    rows = run_phase(2, directory, model_path, workdir, progress)
    with open(rows_file, "w") as f:
        json.dump(rows, f)
    return 0
