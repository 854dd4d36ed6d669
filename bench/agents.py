"""An agent's session after a restart: the anthropic SDK on kvstore serve vs stock mlx_lm.server.

Run as a script path (not ``python -m``), so the installed ``kvstore`` is the
one imported:

    python bench/agents.py             # full run: a system prompt of ~4,300 tokens
    python bench/agents.py --quick     # a smaller model and prompt
    python bench/agents.py --json results.json

The workload is a coding agent's: a long system prompt with a session id in
it and a tool list, then a loop that grows by one tool call and its result
at a time.  kvstore serve is driven through POST /v1/messages by the
`anthropic` SDK, with the system prompt as a cache_control breakpoint (as
Claude Code sends it); stock mlx_lm.server gets the same conversation
through /v1/chat/completions as an OpenAI client sends it (the two render to
the same prompt: tests/test_serve_agents.py).  Each round, for each server:
start, turns 1-3 (max_tokens 8), SIGTERM, start again, turn 4 timed
(max_tokens 1, request to response), then a new session whose system prompt
differs only by its session id, timed too.  The report gives turn 4's time
to first token (stock / kvstore), kvstore's usage of every turn (cache read,
cache creation, input tokens) and what kvstore's usage.kvstore.miss says of
the new session: where its prompt left the stored one, in which message,
and how much stored prefill that id cost; then what that explanation costs
on a directory of conversations that share a system prompt (KVStore.explain
against the lookup, KVStore.find).  Both servers must answer turn 4
with the same text.  The rows are context, not targets: turn 4's gain is
bounded by the tool call and result it adds, which no cache can hold
(bench/serve.py judges the restart on a conversation that adds one line).
"""

import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from foundation import Report, finish, harness_arguments, machine_info, machine_lines  # noqa: E402
from serve import FULL_MODEL, QUICK_MODEL, long_system, start, stop  # noqa: E402
from serve import chat as chat_completion  # noqa: E402

FULL_ROUNDS, QUICK_ROUNDS = 3, 1
SESSION_IDS = ("5f0e3b1c-7d2a-4e9b-8c61-0a4d2e9f7b13", "5f0e3b1c-7d2a-4e9b-8c61-93b7e1c0d5a8")
TOOLS = [{"name": "read_file", "description": "Reads a file of the project.",
          "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}},
         {"name": "run", "description": "Runs a shell command in the project.",
          "input_schema": {"type": "object", "properties": {"command": {"type": "string"}},
                           "required": ["command"]}}]
TASK = "The release build fails in the option parser. Find the cause and fix it."
STEPS = [("read_file", {"path": "src/cli.py"}, "argparse"), ("run", {"command": "make check"}, "unittest"),
         ("read_file", {"path": "src/config.py"}, "configparser")]


def system_prompt(base, session):
    """The agent's system prompt: base text with its session id a third of the way in."""
    cut = len(base) // 3
    return base[:cut] + f"\nSession: {session}\n" + base[cut:]


def loop_messages(turns, prose):
    """The Anthropic messages of a tool loop after `turns` tool calls, ending with a user turn."""
    messages = [{"role": "user", "content": TASK}]
    for i, (name, args, module) in enumerate(STEPS[:turns]):
        messages.append({"role": "assistant", "content": [
            {"type": "text", "text": f"Step {i + 1}: calling {name}."},
            {"type": "tool_use", "id": f"toolu_{i:02d}", "name": name, "input": args}]})
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": f"toolu_{i:02d}", "content": prose([module])[:3000]}]})
    return messages


def anthropic_body(system, messages, max_tokens):
    return dict(model="claude-local", max_tokens=max_tokens, tools=TOOLS, messages=messages,
                system=[{"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}])


def kvstore_round(cmd, tmp, log, system, other, prose):
    """Turns 1-3, restart, turn 4 and the new session through the anthropic SDK: their timings and usage."""
    import anthropic
    usage = []

    def ask(base, system_text, turns, max_tokens):
        client = anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0)
        t0 = time.perf_counter_ns()
        m = client.messages.create(**anthropic_body(system_text, loop_messages(turns, prose), max_tokens))
        ns = time.perf_counter_ns() - t0
        usage.append(m.usage.model_dump())
        return ns, m

    ns4, m4, ns_new = play_round(cmd, tmp, log, ask, system, other)
    return ns4, "".join(b.text for b in m4.content if b.type == "text"), ns_new, usage


def play_round(cmd, tmp, log, ask, system, other):
    """Start, turns 1-3, SIGTERM, start, turn 4 and the new session, each asked with
    ask(base URL, system prompt, tool calls so far, max_tokens) -> (ns, answer).

    Returns:
        (turn 4's ns, its answer, the new session's ns).
    """
    proc, base = start(cmd, tmp, log)
    try:
        for turns in range(3):
            ask(base, system, turns, 8)
    finally:
        stop(proc)
    proc, base = start(cmd, tmp, log)
    try:
        ns4, answer = ask(base, system, 3, 1)
        ns_new, _ = ask(base, other, 0, 1)
    finally:
        stop(proc)
    return ns4, answer, ns_new


def stock_round(cmd, tmp, log, system, other, prose):
    """The same requests as OpenAI chat completions on stock mlx_lm.server."""
    from kvstore.serve.anthropic import to_chat

    def ask(base, system_text, turns, max_tokens):
        chat = to_chat(anthropic_body(system_text, loop_messages(turns, prose), max_tokens))
        for m in chat["messages"]:
            m.pop("cache_control", None)
            for call in m.get("tool_calls", ()):
                call["function"]["arguments"] = json.dumps(call["function"]["arguments"])
        return chat_completion(base, chat["messages"], max_tokens, tools=chat["tools"])

    ns4, r4, ns_new = play_round(cmd, tmp, log, ask, system, other)
    return ns4, r4["choices"][0]["message"]["content"] or "", ns_new, r4["usage"]["prompt_tokens"]


USAGE_HEAD = ("| request | input_tokens | cache_creation_input_tokens | cache_read_input_tokens | from | "
              "usage.kvstore.miss |\n|---|---|---|---|---|---|")
NAMES = ["turn 1", "turn 2", "turn 3", "turn 4, after SIGTERM + restart", "new session, another session id"]


def usage_table(usage):
    """The markdown rows of kvstore's usage for one round's five requests."""
    rows = []
    for name, u in zip(NAMES, usage):
        kv = u.get("kvstore") or {}
        miss = kv.get("miss")
        shown = "-" if miss is None else (f"byte {miss['byte']:,}, token {miss['token']:,}, message "
                                          f"{miss['message']} ({miss['role']}), {miss['stored_tokens_after']:,} "
                                          "stored tokens after it")
        rows.append(f"| {name} | {u['input_tokens']:,} | {u['cache_creation_input_tokens']:,} | "
                    f"{u['cache_read_input_tokens']:,} | {kv.get('source', '-')} | {shown} |")
    return "\n".join([USAGE_HEAD] + rows)


def measure(spec, rounds, system, other):
    """The rounds, each kind first in turn: (turn-4 ns by kind, new-session ns by kind,
    turn-4 answers, kvstore's usage per round, stock's turn-4 prompt tokens)."""
    from kvstore.demo import model as demo_model
    samples, new_samples, answers, usages, prompt_tokens = {"stock": [], "kvstore": []}, {}, set(), [], None
    with tempfile.TemporaryDirectory(prefix="kvstore-bench-agents-") as tmp:
        model = os.path.join(tmp, "model")
        demo_model.write_model_dir(model, chat_template=demo_model.TOOL_CHAT_TEMPLATE, **spec)
        with open(os.path.join(tmp, "servers.log"), "wb") as log:
            for i in range(rounds):
                for kind in (("stock", "kvstore") if i % 2 == 0 else ("kvstore", "stock")):
                    if kind == "kvstore":
                        cmd = [sys.executable, "-m", "kvstore", "serve", "--model", model,
                               "--cache-dir", os.path.join(tmp, f"cache-{i}")]
                        ns, text, ns_new, usage = kvstore_round(cmd, tmp, log, system, other, demo_model.prose)
                        usages.append(usage)
                    else:
                        cmd = [sys.executable, "-m", "mlx_lm", "server", "--model", model]
                        ns, text, ns_new, prompt_tokens = stock_round(cmd, tmp, log, system, other, demo_model.prose)
                    samples[kind].append(ns)
                    new_samples.setdefault(kind, []).append(ns_new)
                    answers.add(text)
                    print(f"  round {i + 1} {kind}: turn 4 {ns / 1e6:.0f} ms, new session {ns_new / 1e6:.0f} ms",
                          file=sys.stderr, flush=True)
    return samples, new_samples, answers, usages, prompt_tokens


# The explanation's cost (KVStore.explain against KVStore.find): conversations
# sharing a system prompt, as a server's directory holds them.
EXPLAIN_SHARED, EXPLAIN_OWN, EXPLAIN_CONVERSATIONS = 10000, 20000, 50
EXPLAIN_REPEATS = 50


def explain_cost(report, quick):
    """Rows: explain against find where a prompt parts after its own turns, and just
    after a system prompt 50 stored conversations share (50 blocks' text read)."""
    import numpy as np

    from kvstore import KVStore

    def text_of(ids):
        words = [f"w{t} ".encode() for t in ids]
        return b"".join(words), [0, *np.cumsum([len(w) for w in words]).tolist()]

    n = 10 if quick else EXPLAIN_CONVERSATIONS
    shared = list(range(EXPLAIN_SHARED))
    with tempfile.TemporaryDirectory(prefix="kvstore-bench-explain-") as d, KVStore(d, budget_mb=0) as store:
        for c in range(n):
            ids = shared + [100000 + c * EXPLAIN_OWN + i for i in range(EXPLAIN_OWN)]
            text, offsets = text_of(ids)
            store.save(text, np.array(ids, np.uint32), {"k": np.zeros((1, 1, len(ids), 2), np.float16)},
                       positional={"k": 2}, text_offsets=offsets)
        cases = [("parts after 15,000 of its own tokens (one block follows)",
                  shared + [100000 + 7 * EXPLAIN_OWN + i for i in range(15000)] + [9] * 5000),
                 (f"parts right after the shared system prompt ({n} blocks follow)", shared + [3] * 20000)]
        for name, ids in cases:
            prompt = text_of(ids)[0]
            times = {}
            for label, fn in (("explain", store.explain), ("find", store.find)):
                ts = []
                for _ in range(EXPLAIN_REPEATS):
                    t0 = time.perf_counter_ns()
                    fn(prompt)
                    ts.append(time.perf_counter_ns() - t0)
                times[label] = {"median_ns": statistics.median(ts), "min_ns": min(ts), "n": len(ts)}
            report.add(f"{len(ids):,}-token prompt that {name}, {len(store.entries()):,} files", times["explain"],
                       times["find"], "time", target=None,
                       note="peer = the same store's find (the lookup every request makes); explain reads "
                            "the followers' own text segments")


def main(argv=None):
    args = harness_arguments(__doc__, "a smaller model and prompt", argv)     # context rows: no --strict
    from kvstore.demo import model as demo_model

    t_start, info = time.perf_counter(), machine_info()
    spec, rounds = (QUICK_MODEL, QUICK_ROUNDS) if args.quick else (FULL_MODEL, FULL_ROUNDS)
    system, other = (system_prompt(long_system(args.quick), s) for s in SESSION_IDS)
    samples, new_samples, answers, usages, prompt_tokens = measure(spec, rounds, system, other)
    if len(answers) != 1:
        raise SystemExit(f"the servers answered turn 4 differently: {answers}")
    last = usages[-1]
    total4 = sum(last[3][k] for k in ("input_tokens", "cache_creation_input_tokens", "cache_read_input_tokens"))
    if total4 != prompt_tokens:
        raise SystemExit(f"kvstore's usage adds up to {total4} tokens, stock saw a {prompt_tokens}-token prompt")
    report = Report()
    report.section("Turn 4 of an agent's tool loop after a restart: kvstore serve (anthropic SDK, "
                   "/v1/messages) vs stock mlx_lm.server (/v1/chat/completions)")
    st = {k: {"median_ns": statistics.median(v), "min_ns": min(v), "n": len(v)} for k, v in samples.items()}
    report.add(f"turn 4, {prompt_tokens:,}-token prompt, after SIGTERM + restart", st["kvstore"], st["stock"],
               "throughput", target=None,
               note=f"kvstore read {last[3]['cache_read_input_tokens']:,} tokens from "
                    f"{last[3]['kvstore']['source']} (turn 3's whole prompt but its last token) and prefilled "
                    f"{prompt_tokens - last[3]['cache_read_input_tokens']:,} (turn 3's tool call and result, "
                    "which no cache holds); stock prefilled all")
    nw = {k: {"median_ns": statistics.median(v), "min_ns": min(v), "n": len(v)} for k, v in new_samples.items()}
    miss = last[4]["kvstore"].get("miss") or {}
    report.add("a new session whose system prompt differs by its session id, same server", nw["kvstore"],
               nw["stock"], "throughput", target=None,
               note=f"both reuse the prefix before the id from RAM; kvstore says where it left: byte "
                    f"{miss.get('byte', 0):,}, token {miss.get('token', 0):,}, message {miss.get('message')} "
                    f"({miss.get('role')})")
    report.section("What the explanation costs: KVStore.explain against KVStore.find on the same directory")
    explain_cost(report, args.quick)
    elapsed = time.perf_counter() - t_start
    cfg = demo_model.model_config(**{k: v for k, v in spec.items() if k != "seed"})
    print(f"# Agents' front doors benchmark ({'quick' if args.quick else 'full'} run)\n")
    print(machine_lines(info))
    print(f"- model: random-weight mlx-lm llama, float32, {cfg['num_hidden_layers']} layers, hidden "
          f"{cfg['hidden_size']}; offline byte-level BPE tokenizer, a chat template that renders tools and tool "
          "calls (kvstore.demo.model.TOOL_CHAT_TEMPLATE)")
    print(f"- rounds: {rounds}; each: start, turns 1-3 of a tool loop (max_tokens 8), SIGTERM, start, turn 4 "
          "timed (max_tokens 1, request to response), then a new session with another session id; ratio = "
          "stock time / kvstore time (higher is better); same turn-4 answer from both servers")
    print(f"- elapsed {elapsed:.1f} s\n")
    print(report.markdown())
    print("\n### kvstore serve's usage, last round (anthropic SDK, `usage` as the SDK parsed it)\n")
    print(usage_table(last))
    return finish(args, info, elapsed, report, model=cfg, samples_ns=samples, new_session_ns=new_samples,
                  usage=usages, prompt_tokens=prompt_tokens)


if __name__ == "__main__":
    sys.exit(main())
