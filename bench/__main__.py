"""Runs every benchmark against its peers and publishes the tables and plots.

    python -m bench                      # the full run (about 35 minutes), writes the results
    python -m bench --quick              # the quick variants (under 3 minutes)
    python -m bench --quick --no-write   # CI smoke: runs everything, writes into a temp dir
    python -m bench --only store,e2e     # some harnesses; the others' last results are kept

Each harness (bench/foundation.py: hashing and header touch; bench/store.py:
lookup scaling and payload save/load; bench/ttft.py: time to first token;
bench/e2e.py: the demo's agent workload; bench/serve.py: kvstore serve after
a restart; bench/chains.py: chained checkpoints against whole-prefix files;
bench/serve_load.py: kvstore serve and stock mlx_lm.server under concurrent
sessions, and decoding while a checkpoint loads; bench/canary.py: the
canary's distances, states the live model made against states it did not)
runs in its own process, from a temporary directory so that the repository's
kvstore/ does not shadow the installed package, and prints a markdown
report.  This script collects the reports into bench/README.md (the machine
and the versions on top, one table per section), keeps the JSON results in
bench/results/, draws bench/*.png from them (bench/plots.py; matplotlib, the
`bench` extra) and copies the headline rows into the top-level README between
its `<!-- bench:start -->` and `<!-- bench:end -->` markers, so that no
number in the README is typed by hand.  Nothing here imports kvstore.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

import plots  # noqa: E402

HARNESSES = ["foundation", "store", "ttft", "e2e", "serve", "chains", "serve_load", "canary"]

# The rows quoted in the README: (harness, substring of the comparison).
HEADLINE = [
    ("foundation", "sha1 400 KB vs hashlib.sha1"),
    ("foundation", "sha1_prefixes 400 KB × 1000 lengths, random order vs one hashlib"),
    ("foundation", "crc32c 64 MiB vs zlib.crc32"),
    ("foundation", "touch, 2 processes on one file vs ds4 way (os.open"),
    ("store", "find, N=10,000, miss vs ds4"),
    ("store", "find, N=10,000, hit vs ds4"),
    ("store", "find, N=10,000, miss vs one hashlib"),
    ("store", "load 512 MiB, 1st in a fresh process, into MLX, CRC on vs mlx_lm"),
    ("store", "save 512 MiB, durable=False vs mlx_lm"),
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
    ("serve_load", "8 sessions, turns 3-4 after SIGTERM + restart: TTFT p50"),
    ("serve_load", "8 sessions, turns 3-4 after SIGTERM + restart: TTFT p95"),
    ("serve_load", "cold page cache, vs without load"),
    ("canary", "canary llama bfloat16, tail: largest rounding vs smallest wrong-model distance"),
]

LOAD_NOTE = """\
## Why loads stream through `mx.load`, and prefault their pages

A load is bounded by the kernel mapping the destination arrays' fresh pages
(a trap, a zeroed page and a page-table entry per 4 KiB: about 2 GB/s here
for a single thread, whatever reads into them), not by the disk or the page
cache (a warm raw read runs at 12+ GB/s). The routes measured on this
machine:

- `mx.zeros` + eval, then read into the array: the zero fill touches every
  page once, the read a second time (about 0.5 s per GiB before any data).
- Read into NumPy arrays, then `mx.array(...)`: the copy runs at about
  1.4 GB/s.
- kvstore's route: the payload's tensor data is presented to `mx.load` as
  a virtual safetensors file holding one uint8 blob. MLX allocates the blob
  (no fill) and calls `readinto` once with its memory; kvstore queues the
  parallel `pread`s of every tensor's slices into it at once (GIL released,
  CRC32C computed on each 1 MiB chunk as it lands) and returns, so Python
  is entered once per load rather than once per tensor, and the reads run
  on every core. After `mx.eval` every read is joined, every CRC checked,
  and the blob's memory is checked to be the buffer MLX handed over
  (otherwise the load is redone synchronously); the tensors are views of
  the blob (no copy).
- On Linux 5.14 and later each 1 MiB chunk's pages are first mapped with
  one `madvise(MADV_POPULATE_WRITE)`, then the `pread` fills them. Without
  it every page faults inside the kernel's copy: a trap and a restart of
  the copy per 4 KiB. With it the kernel time of a 512 MiB load fell from
  about 320 ms to 205 ms (2 threads, fresh memory, `perf` and `getrusage`).
  The chunking matters: populating a whole 256 MiB slice before reading it
  measured no better than plain faulting, because the zeroed pages leave
  the cache before the read fills them and both threads populate at once.
- On x86-64 with AVX-512 VPCLMULQDQ the CRC32C folds 256 bytes per step
  with carry-less multiplies: 57 GB/s against 28 GB/s for three streams of
  the `crc32` instruction, which halves the CRC's share of a load.

Every load child (kvstore's and the peers') imports the same modules, numpy,
mlx, mlx_lm and kvstore, and waits 0.2 s before its clock starts: `import
numpy` starts OpenBLAS's threads, which keep one core busy for about 50 ms,
and a load timed inside that window would be judged by import order.

Transparent huge pages (`MADV_HUGEPAGE`) are not used: on this virtual
machine clearing a fresh 2 MiB page ran as slowly as 0.8 GB/s (the host maps
the guest's never-used memory on first touch), so huge-page loads took from
75 ms to 385 ms for 256 MiB.

Saves write each block from the arrays' memory with `pwrite`; the CRC of a
slice is computed by one thread while another writes the previous slice
(a file takes one writer at a time in the kernel), so it costs no wall time.
A new file's blocks are allocated with one `fallocate()` before the first
write: without it ext4's delayed allocation reserves space and records a
delayed extent page by page inside every write. A 512 MiB buffered write
ran 29% faster with it (14% faster with the fsync of `durable=True`), and a
disk without room fails the save before any data is written.
"""


CHAINS_NOTE = """\
## Chained checkpoints

A store with `layout="chain"` (the default, docs/format.md §14) writes a
sequence as blocks of 256 tokens, one file each, named by the SHA1 of the
whole text up to the block's end and pointing to its parent. Each token's
KV is written once: the cold anchor, the waypoints and the shutdown state of
one session share their blocks, and a second session that shares the system
prompt adds only its own. With `layout="whole"` every checkpoint is a file
holding the whole prefix, so a session's first tokens are written again in
each one. Every block boundary is a hit, so a prompt that leaves a stored
session between two checkpoints still reuses it up to the last block
boundary before it. bench/chains.py measures both layouts on the same
scenario through `PromptCache` (a synthetic NumPy engine with 2 layers
instead of the issue's 32: the ratios change only by the per-file
overheads) and the lookup among 100,000 blocks; chains.png shows the
blocks three short sessions leave.
"""


def run(name, quick, results):
    """Runs one harness; returns (its markdown report, seconds)."""
    cmd = [sys.executable, os.path.join(HERE, f"{name}.py"), "--json", os.path.join(results, f"{name}.json")]
    if quick:
        cmd.append("--quick")
    print(f"bench: running {name}{' --quick' if quick else ''}", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    # Run outside the source tree: the repository's kvstore/ must not shadow
    # the installed package.  The harness's progress lines go to our stderr.
    with tempfile.TemporaryDirectory() as cwd:
        out = subprocess.run(cmd, cwd=cwd, stdout=subprocess.PIPE, text=True)
    seconds = time.perf_counter() - t0
    if out.returncode != 0:
        raise SystemExit(f"bench: {name} failed (exit {out.returncode})")
    print(f"bench: {name} done in {seconds:.0f} s", file=sys.stderr, flush=True)
    return out.stdout, seconds


def load_results(results, name):
    path = os.path.join(results, f"{name}.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def headline_rows(results):
    lines = ["| comparison | kvstore | peer | ratio (median) | target | result |", "|---|---|---|---|---|---|"]
    for name, needle in HEADLINE:
        data = load_results(results, name) or {}
        for r in data.get("rows", []):
            if needle in r.get("comparison", ""):
                ratio = r.get("ratio_text") or (f"{r['ratio']:.3g}" if isinstance(r["ratio"], (int, float))
                                                else r["ratio"])
                lines.append(f"| {r['comparison']} | {r.get('kvstore_cell', '')} | {r.get('peer_cell', '')} "
                             f"| {ratio} | {r.get('target', '')} | {r.get('result') or '—'} |")
                break
    return "\n".join(lines)


def machine_table(results, seconds, quick):
    """The machine and versions (from the harnesses' JSON) and the run's times."""
    runs = [d for d in (load_results(results, n) for n in HARNESSES) if d]
    m = runs[0]["machine"] if runs else {}
    impl = ", ".join(f"{k}={v}" for k, v in m.get("implementation", {}).items())
    times = ", ".join(f"{n} {d['elapsed_s']:.0f} s{' (quick)' if d.get('quick') else ''}"
                      for n, d in zip(HARNESSES, (load_results(results, n) for n in HARNESSES)) if d)
    rows = [
        ("CPU", f"{m.get('cpu', '?')} ({', '.join(m.get('cpu_flags', []))}); {m.get('cores', '?')} cores "
                f"({m.get('usable_cores', '?')} usable)"),
        ("platform", m.get("platform", "?")),
        ("Python", m.get("python", "?")),
        ("MLX", m.get("mlx", "?")),
        ("mlx-lm", m.get("mlx_lm", "?")),
        ("kvstore", f"{m.get('kvstore', '?')} ({impl})"),
        ("date", m.get("date", "?")),
        ("run", f"{'`python -m bench --quick`' if quick else '`python -m bench`'}: total wall time "
                f"{seconds:.0f} s; harnesses (their own clocks): {times}"),
    ]
    return "\n".join(["| | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows])


def write_readme_table(table):
    path = os.path.join(ROOT, "README.md")
    with open(path) as f:
        text = f.read()
    start, end = "<!-- bench:start -->", "<!-- bench:end -->"
    if start not in text or end not in text:
        raise SystemExit("bench: README.md has no bench markers")
    a = text.index(start) + len(start)
    b = text.index(end)
    with open(path, "w") as f:
        f.write(text[:a] + "\n" + table + "\n" + text[b:])


def publish(out, results, seconds, quick, pictures):
    parts = ["# kvstore benchmarks\n",
             "Generated by `python -m bench` from the harnesses' own output (bench/foundation.py, "
             "store.py, ttft.py, e2e.py, serve.py, chains.py, serve_load.py, canary.py). Each comparison was measured "
             "side by side with its peer in one run, after a warm-up, with repeats; cells are median / min (the "
             "canary's cells are distances, not times). The machine is a shared 2-core VM, so compare the ratios, "
             "not the absolute times.\n",
             machine_table(results, seconds, quick) + "\n"]
    parts += [f"![{title}]({os.path.basename(path)})\n" for title, path in pictures]
    for name in HARNESSES:
        path = os.path.join(results, f"{name}.md")
        if os.path.exists(path):
            with open(path) as f:
                body = f.read().strip()
            parts.append(body.replace("\n# ", "\n## ").replace("# ", "## ", 1) + "\n")
    parts.append(LOAD_NOTE)
    parts.append(CHAINS_NOTE)
    with open(os.path.join(out, "README.md"), "w") as f:
        f.write("\n".join(parts))


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the quick variants (CI smoke), under 3 minutes")
    ap.add_argument("--only", help=f"comma-separated harnesses (default: all of {','.join(HARNESSES)})")
    ap.add_argument("--no-write", action="store_true",
                    help="write the results, README and plots into a temporary directory and print "
                         "the README; leave the repository alone")
    args = ap.parse_args(argv)
    names = args.only.split(",") if args.only else HARNESSES
    unknown = sorted(set(names) - set(HARNESSES))
    if unknown:
        ap.error(f"unknown harness {', '.join(unknown)}; choose from {', '.join(HARNESSES)}")

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvstore-bench-out-") as scratch:
        out = scratch if args.no_write else HERE
        results = os.path.join(out, "results")
        os.makedirs(results, exist_ok=True)
        for name in names:
            text, _ = run(name, args.quick, results)
            with open(os.path.join(results, f"{name}.md"), "w") as f:
                f.write(text)
        pictures = plots.draw(results, out)
        seconds = time.perf_counter() - t0
        publish(out, results, seconds, args.quick, pictures)
        if args.no_write:
            with open(os.path.join(out, "README.md")) as f:
                print(f.read())
        else:
            write_readme_table(headline_rows(results))
            print("bench: wrote bench/README.md, bench/results/, "
                  + "".join(f"bench/{os.path.basename(p)}, " for _, p in pictures)
                  + "and the README table", file=sys.stderr)
    print(f"bench: total wall time {seconds:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
