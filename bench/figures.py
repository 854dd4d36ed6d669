"""The measured figures that the docs quote, generated from bench/results/.

Each generated block sits between two markers, ``<!-- TAG:start -->`` and
``<!-- TAG:end -->``:

- README.md ``bench``: three headline rows (README_HEADLINE), and the run
  and machine they come from;
- docs/benchmarks.md ``bench:headline``: the headline rows of every harness
  (HEADLINE), and the run and machine each harness's rows come from;
- docs/remote.md ``bench:remote``: the remote tier against the local one
  (bench/remote.py);
- docs/format.md ``bench:seal``: sealed against plain checkpoints (the
  sealed rows of bench/store.py, §16's costs).

``python -m bench`` rewrites the blocks after a run (``write_blocks``);
tests/test_figures.py checks that each block is what ``generate`` makes of
the results on disk, and that no measured figure outside the blocks is typed
by hand.  A block's text depends on the results only, never on the run that
writes it.  Nothing here imports kvstore or matplotlib.
"""

import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")

# A table is from "another machine" when one of these differs, and from
# "other versions" when one of VERSION_FIELDS does (bench/foundation.py's
# machine_info() writes both into every harness's JSON).
MACHINE_FIELDS = ("cpu", "cpu_flags", "cores", "usable_cores", "platform")
VERSION_FIELDS = ("python", "mlx", "mlx_lm", "kvstore", "implementation", "openssl")

# bench/remote.py's codec rows quoted in docs/benchmarks.md (their KV: REMOTE_KV).
REMOTE_CODEC_ROWS = ("remote hit (find + fetch + load), 256 MiB session: lossless vs raw",
                     "remote hit (find + fetch + load), 256 MiB session: q8 vs raw")

# The rows quoted in docs/benchmarks.md: (harness, substring of the
# comparison), or (harness, substring, substrings its section must hold)
# where a harness repeats a comparison per section (bench/shapes.py: per
# geometry and size).
HEADLINE = [
    ("foundation", "sha1 400 KB vs hashlib.sha1"),
    ("foundation", "sha1_prefixes 400 KB × 1000 lengths, random order vs one hashlib"),
    ("foundation", "crc32c 64 MiB vs zlib.crc32"),
    ("foundation", "touch, 2 processes on one file vs ds4 way (os.open"),
    ("store", "find, N=10,000, miss vs ds4"),
    ("store", "find, N=10,000, hit vs ds4"),
    ("store", "find, N=10,000, miss vs one hashlib"),
    ("store", "find, N=10,000, miss vs its digest pass alone"),
    ("store", "load 512 MiB chain (16 blocks), 1st in a fresh process, into MLX, CRC on vs mlx_lm"),
    ("store", "save 512 MiB chain (16 blocks), durable=True (KVStore defaults) vs mlx_lm save_prompt_cache + fsync"),
    ("store", "save 512 MiB chain (16 blocks), durable=True (KVStore defaults) vs mlx_lm save_prompt_cache (no fsync)"),
    ("shapes", "durable save, 32,768 tokens", ("Qwen3-8B:",)),
    ("shapes", "a turn of 1,000 tokens: bytes written", ("Qwen3-8B:", "32,768 tokens")),
    ("shapes", "load into MLX, cold", ("Qwen3-8B:", "32,768 tokens")),
    ("shapes", "load into MLX, warm", ("Qwen3-8B:", "32,768 tokens")),
    ("shapes", "load into MLX, cold", ("Qwen3-32B:", "32,768 tokens")),
    ("shapes", "load into MLX, cold", ("DeepSeek-V3", "32,768 tokens")),
    ("shapes", "model_fingerprint after mlx_lm's load"),
    ("serve_sizes", "decode rate of 2 streaming sessions while"),
    ("serve_sizes", "the longest gap between two tokens"),
    ("serve_sizes", "the batch's stall as P leaves it"),
    ("serve_sizes", "decode rate of 2 sessions while P's"),
    ("ttft", "TTFT 4,096 + 128 tokens: kvstore disk hit vs cold prefill"),
    ("ttft", "TTFT 4,096 + 128 tokens: kvstore disk hit vs mlx-lm"),
    ("ttft", "file 4,096 + 128: kvstore .kv vs mlx-lm .safetensors with the prompt text"),
    ("ttft", "TTFT 8,192 + 128 tokens: kvstore disk hit vs cold prefill"),
    ("e2e", "hit rate: kvstore vs mlx-lm"),
    ("e2e", "median TTFT per request: kvstore vs no prompt cache"),
    ("e2e", "mean TTFT per request (a round's total wait): kvstore vs mlx-lm"),
    ("serve", "turn 4"),
    ("chains", "agent session bytes written / KV bytes of distinct tokens"),
    ("chains", "at P = 15,000: chain vs whole"),
    ("chains", "400 KB prompt, miss vs one hashlib"),
    ("chains", "then leaves it inside the last (hit 99 blocks deep) vs one hashlib"),
    ("chains", "find, first lookup after another store on the directory saved"),
    ("serve_load", "8 sessions, turns 3-4 after SIGTERM + restart: TTFT p50"),
    ("serve_load", "8 sessions, turns 3-4 after SIGTERM + restart: TTFT p95"),
    ("serve_load", "cold page cache, vs without load"),
    ("serve_trace", "closed loop, 2 in flight: TTFT p50"),
    ("serve_trace", "closed loop, 2 in flight: TTFT mean"),
    ("serve_trace", "closed loop, 2 in flight: per-request TTFT ratio, median"),
    ("serve_trace", "open loop at 50% of the closed loop's throughput: TTFT mean"),
    ("serve_trace", "after a restart, closed loop: TTFT mean"),
    ("canary", "canary llama bfloat16, tail: largest rounding vs smallest wrong-model distance"),
    ("packed", "bytes stored, 8,192 tokens: lossless vs raw", ("Llama-3.1-8B:",)),
    ("packed", "bytes stored, 8,192 tokens: q8 vs raw", ("Llama-3.1-8B:",)),
    ("packed", "bytes stored, 8,192 tokens: q4 vs raw", ("Llama-3.1-8B:",)),
    ("packed", "load into MLX, cold, 9,192 tokens (1.12 GiB): lossless vs raw", ("Llama-3.1-8B:",)),
    ("packed", "load into MLX, warm, 9,192 tokens (1.12 GiB): lossless vs raw", ("Llama-3.1-8B:",)),
    ("packed", "durable save: lossless vs raw", ("Llama-3.1-8B:",)),
    ("quality", "q8: 1,024-token prefix stored"),
    ("quality", "q4: 1,024-token prefix stored"),
] + [("remote", row) for row in REMOTE_CODEC_ROWS]

# The three rows README.md quotes, each one of HEADLINE: (harness, substring,
# substrings its section must hold, the peer where the comparison does not
# name it).  A load and a save at a real model's size against mlx-lm's own
# prompt-cache files, and what a disk hit saves against a cold prefill.
README_HEADLINE = [
    ("shapes", "load into MLX, warm", ("Qwen3-8B:", "32,768 tokens"), "mlx-lm's load_prompt_cache"),
    ("ttft", "TTFT 8,192 + 128 tokens: kvstore disk hit vs cold prefill", (), ""),
    ("shapes", "durable save, 32,768 tokens", ("Qwen3-8B:",), "mlx-lm's save_prompt_cache + fsync"),
]

# The KV behind each harness's rows, as its configuration sets it (the
# harness's docstring says more).  "toy": a model far smaller than any
# served one, whose figures say nothing about real sizes (bench/shapes.py
# and bench/serve_sizes.py measure those); bench/shapes.py rows name their
# own geometry (their section).
TOY = "toy: 3 layers × 2 KV heads × 32, float32 (1.5 KiB a token)"
REMOTE_KV = "4 layers × 8 KV heads × 128, bfloat16 (16 KiB a token)"
GEOMETRY = {
    "foundation": "no model (bytes)",
    "store": "Llama-3.1-8B's, float16 (128 KiB a token), 4,096 tokens; warm page cache",
    "ttft": TOY,
    "e2e": "toy: the demo's model, 4 layers × 2 KV heads × 32, float32 (2 KiB a token)",
    "serve": TOY,
    "chains": "2 layers × 8 KV heads × 128, float16 (8 KiB a token)",
    "serve_load": TOY + "; its decode-while-loading rows: 16 layers × 16 KV heads × 128, float32 (256 KiB a token)",
    "serve_trace": TOY,
    "canary": "toy: a llama of 4 layers, hidden 256",
    "serve_sizes": "Qwen3-8B's: 36 layers × 8 KV heads × 128, bfloat16 (144 KiB a token)",
    "agents": TOY,
    "remote": "checkpoints of 4 and 64 MiB (bytes); its codec rows: " + REMOTE_KV,
    "lossless": "each section's: the trained model of quality.py (2 KV heads × 64) and the zoo's 8 heads × 128, "
                "bfloat16, blocks of 256 tokens",
    "packed": "each section's geometry: Llama-3.1-8B's (128 KiB a token) and gpt-oss-20b's, bfloat16; "
              "and the trained model of quality.py",
    "quality": "a llama trained here: 4 layers × 2 KV heads × 64, bfloat16 (2 KiB a token)",
}
GEOMETRY_ROWS = {
    **{("remote", row): REMOTE_KV for row in REMOTE_CODEC_ROWS},
    # serve_load's decode row runs its own model (bench/serve_load.py LOAD_MODEL).
    ("serve_load", "cold page cache, vs without load"): "16 layers × 16 KV heads × 128, float32 (256 KiB a token)",
}


def headline_geometry(name, needle, row):
    """The KV a headline row was measured at (GEOMETRY), or its section's first part."""
    if name in ("shapes", "packed"):
        return row.get("section", "").split(";")[0] + ", bfloat16"
    return GEOMETRY_ROWS.get((name, needle), GEOMETRY.get(name, ""))


# docs/format.md §16's cost table: (operation, substring of bench/store.py's sealed row).
SEAL_ROWS = [
    ("find, 10,000 files of distinct lengths, miss", "find, N=10,000 sealed (keyed names), miss"),
    ("find, 10,000 files, hit on the longest", "find, N=10,000 sealed (keyed names), hit"),
    ("load 512 MiB into MLX, 1st in a fresh process, one file (ABI 48 vs 16)",
     "load 512 MiB sealed (AES-256-GCM), 1st in a fresh process"),
    ("load 512 MiB into MLX, 1st in a fresh process, a chain of 16 blocks (ABI 49 vs 17)",
     "load 512 MiB sealed chain (16 blocks), 1st in a fresh process"),
    ("save 512 MiB, durable=False, one file", "save 512 MiB sealed (AES-256-GCM), durable=False"),
]


# ---------------------------------------------------------------- results

def load_results(results, name):
    """A harness's JSON results (bench/results/NAME.json), or None."""
    path = os.path.join(results, f"{name}.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def find_row(data, needle, section=()):
    """The first row of a harness's results whose comparison contains needle
    (and whose section contains every string of section), or None."""
    return next((r for r in (data or {}).get("rows", []) if needle in r.get("comparison", "")
                 and all(part in (r.get("section") or "") for part in section)), None)


def median_text(cell):
    """A cell's median: "797.29 µs / 767.57 µs (…)" -> "797.29 µs"."""
    return cell.split(" / ")[0]


# ---------------------------------------------------------------- stamps

def machine_text(m):
    """One line naming a machine: CPU, cores, platform."""
    return (f"{m.get('cpu', '?')}, {m.get('cores', '?')} cores ({m.get('usable_cores', '?')} usable), "
            f"{m.get('platform', '?')}")


def same_machine(a, b):
    return all(a.get(k) == b.get(k) for k in MACHINE_FIELDS)


def same_versions(a, b):
    return all(a.get(k) == b.get(k) for k in VERSION_FIELDS)


def run_id(data):
    """The id of the `python -m bench` run that wrote a harness's results (its UTC start), or None.

    Results written before runs had ids, or by a harness run on its own, have none.
    """
    return (data.get("run") or {}).get("id")


def run_label(data):
    """The run id, or, for results without one, when the harness started."""
    return run_id(data) or f"without id, started {data.get('machine', {}).get('date', '?')}"


def provenance(results, names):
    """One line: which run and machine each of the named harnesses' results come from."""
    groups = {}
    for name in dict.fromkeys(names):
        data = load_results(results, name)
        if data is None:
            continue
        m = data.get("machine", {})
        key = (run_label(data), f"{m.get('cpu', '?')}, {m.get('cores', '?')} cores")
        groups.setdefault(key, []).append(name + (" (quick)" if data.get("quick") else ""))
    return "; ".join(f"{', '.join(v)}: run {label} on {machine}" for (label, machine), v in groups.items())


# ---------------------------------------------------------------- blocks

def headline_row(results, name, needle, section=(), peer=""):
    """One table row of a harness's row (HEADLINE's columns), or None when the results lack it."""
    r = find_row(load_results(results, name), needle, section)
    if r is None:
        return None
    ratio = r.get("ratio_text") or (f"{r['ratio']:.3g}" if isinstance(r["ratio"], (int, float)) else r["ratio"])
    comparison = r["comparison"] + (f" vs {peer}" if peer else "")
    return (f"| {comparison} | {headline_geometry(name, needle, r)} | {r.get('kvstore_cell', '')} "
            f"| {r.get('peer_cell', '')} | {ratio} | {r.get('target', '')} | {r.get('result') or '—'} |")


HEADER = ["| comparison | KV measured at | kvstore | peer | ratio (median) | target | result |",
          "|---|---|---|---|---|---|---|"]


def _table(results, heads, after):
    """HEADER, the rows of heads (HEADLINE entries) that have results, then
    the runs they come from and the sentence after."""
    lines = list(HEADER)
    lines += [row for row in (headline_row(results, *h) for h in heads) if row]
    lines += ["", f"Rows from {provenance(results, [h[0] for h in heads])}{after}"]
    return "\n".join(lines)


def headline_block(results):
    """docs/benchmarks.md's table: the HEADLINE rows, then the runs they come from."""
    return _table(results, HEADLINE, " (bench/README.md stamps each table with its run, machine and date). Rows "
                  "marked toy come from models far smaller than any served one; the real-size rows are "
                  "bench/shapes.py's and bench/serve_sizes.py's.")


def readme_block(results):
    """README.md's table: the three README_HEADLINE rows, then the runs they come from."""
    return _table(results, README_HEADLINE, ". The row marked toy comes from a model far smaller than any served "
                  "one. docs/benchmarks.md has the headline row of every harness; bench/README.md every table, "
                  "its machine and the method.")


def skipped(data):
    """Why a harness was skipped whole (a sentence), or None.  A list under
    "skipped" names rows a harness left out (shapes.py's sizes too large for
    this machine): the harness ran, and its results are this run's."""
    why = data.get("skipped")
    return why if isinstance(why, str) and why else None


def remote_block(results):
    """docs/remote.md's remote tier figures (bench/remote.py), or why there are none."""
    data = load_results(results, "remote")
    if data is None or skipped(data):
        why = skipped(data) if data else "no results yet"
        return f"The remote tier's benchmark (`python -m bench --only remote`) has not measured it: {why}."
    hits = [r for r in data["rows"] if r["comparison"].startswith("hit (find + load)")]
    sha1 = find_row(data, "vs one hashlib.sha1")
    lines = [f"On loopback (SeaweedFS `weed mini`, `python -m bench --only remote`: run {run_label(data)} on "
             f"{machine_text(data['machine'])}{', quick' if data.get('quick') else ''}), a remote hit (`find` + "
             "`load` of a checkpoint only the bucket holds, fetch and checks included) against a local hit from "
             f"the page cache, median / min of {data['repeats']}:", "",
             "| checkpoint | remote hit | local hit | remote / local |", "|---|---|---|---|"]
    for r in hits:
        size = r["comparison"].split(", ")[1].split(" checkpoint")[0]
        lines.append(f"| {size} | {r['kvstore_cell']} | {r['peer_cell']} | {r['ratio_text']} |")
    if sha1:
        lines += ["", f"With {data['lookup']['n_remote']:,} objects listed, `find` on a 400 KB prompt (a miss) "
                      f"takes {median_text(sha1['kvstore_cell'])}, with no network call: one SHA1 pass over the "
                      f"prompt (one hashlib.sha1 of it: {median_text(sha1['peer_cell'])})."]
    return "\n".join(lines)


def seal_block(results):
    """docs/format.md §16's cost table: the sealed rows of bench/store.py, medians."""
    data = load_results(results, "store")
    lines = ["| operation | sealed | plain | sealed speed / plain |", "|---|---|---|---|"]
    for label, needle in SEAL_ROWS:
        r = find_row(data, needle)
        if r is None:
            lines.append(f"| {label} | — | — | not measured |")
            continue
        lines.append(f"| {label} | {median_text(r['kvstore_cell'])} | {median_text(r['peer_cell'])} "
                     f"| {1 / r['ratio']:.2f} |")
    if data:
        lines += ["", f"Run {run_label(data)} on {machine_text(data['machine'])}"
                      f"{', quick' if data.get('quick') else ''}; bench/results/store.md has the minimums and "
                      "the targets."]
    return "\n".join(lines)


# (file relative to the repository, marker tag, generator)
BLOCKS = [
    ("README.md", "bench", readme_block),
    ("docs/benchmarks.md", "bench:headline", headline_block),
    ("docs/remote.md", "bench:remote", remote_block),
    ("docs/format.md", "bench:seal", seal_block),
]


def markers(tag):
    return f"<!-- {tag}:start -->", f"<!-- {tag}:end -->"


def block_span(text, tag, path="?"):
    """(start, end) of the text between a block's markers; SystemExit when they are missing."""
    start, end = markers(tag)
    if text.count(start) != 1 or text.count(end) != 1 or text.index(start) > text.index(end):
        raise SystemExit(f"bench: {path} needs one {start} followed by one {end}")
    return text.index(start) + len(start), text.index(end)


def current_block(text, tag, path="?"):
    """The body of a generated block as the file holds it, without the newlines round it."""
    a, b = block_span(text, tag, path)
    return text[a:b].strip("\n")


def generate(results=RESULTS):
    """{(file, tag): body} of every block, from the results in results/."""
    return {(path, tag): fn(results) for path, tag, fn in BLOCKS}


def write_blocks(results=RESULTS, root=ROOT):
    """Rewrites every generated block from results/; returns the files changed."""
    changed = []
    bodies = generate(results)
    for path in dict.fromkeys(p for p, _ in bodies):
        full = os.path.join(root, path)
        with open(full) as f:
            text = old = f.read()
        for (p, tag), body in bodies.items():
            if p == path:
                a, b = block_span(text, tag, path)
                text = text[:a] + "\n" + body + "\n" + text[b:]
        if text != old:
            with open(full, "w") as f:
                f.write(text)
            changed.append(path)
    return changed


if __name__ == "__main__":
    # python bench/figures.py: rewrites the blocks from the results on disk (no benchmark runs).
    print("bench/figures.py: " + (", ".join(write_blocks()) or "every block already matches bench/results/"))
