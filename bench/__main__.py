"""Runs every benchmark against its peers and publishes the tables and plots.

    python -m bench                      # the full run (over an hour), writes the results
    python -m bench --quick              # the quick variants (about 15 minutes here)
    python -m bench --quick --no-write   # a smoke run: writes into a temp dir (CI: .ci/run)
    python -m bench --only store,e2e     # some harnesses; the others' last results are kept

Each harness (bench/foundation.py: hashing and header touch; bench/store.py:
lookup scaling and payload save/load, plain and sealed; bench/ttft.py: time
to first token; bench/e2e.py: the demo's agent workload; bench/serve.py:
kvstore serve after a restart; bench/chains.py: chained checkpoints against
whole-prefix files; bench/serve_load.py: kvstore serve and stock
mlx_lm.server under concurrent sessions, and decoding while a checkpoint
loads; bench/serve_trace.py: a production-shaped trace (bench/mooncake.py)
replayed against kvstore serve and stock, open and closed loop, cold and
after a restart; bench/canary.py: the canary's distances, states the live model made
against states it did not; bench/remote.py: a hit from an S3 bucket against
a local one; bench/shapes.py: saves, loads, finds, evictions and the
canary at the KV geometry of the models people run, 8,192 and 32,768 tokens,
cold page cache included, and the fingerprint of an 8 GB model;
bench/serve_sizes.py: kvstore serve storing and loading a 1.1 GiB state
while two sessions decode; bench/agents.py: an agent's tool loop through
the anthropic SDK after a restart, its usage and an explained miss;
bench/lossless.py: kvstore's lossless block codec against zstd, LZ4,
zlib and Blosc2 on the trained model's KV and the zoo's;
bench/packed.py: packed and quantised checkpoints (kv_codec) against raw
and mlx-lm at real KV sizes; bench/quality.py: what each codec costs in
answers on a model trained here, cached after its first training) runs in its own process, from a temporary directory so that the
repository's kvstore/ does not shadow the installed package, writes its JSON
results and prints a markdown report.  A harness whose tools are missing
here (remote.py without boto3 or `weed`) reports itself skipped; the results
of an earlier run, if any, are then kept.

Every invocation has a run id, its UTC start, stored with the command and
the harness's wall time in the JSON of every harness it runs.  This script
collects the reports into bench/README.md: on top this run, its machine and
versions, its total wall time and its harnesses' times, and the tables that
come from earlier runs (``--only`` keeps the others' results) with their
machines; under each table's heading the run it comes from, its machine and
its date.  It keeps the JSON results in bench/results/, draws bench/*.png
from them (bench/plots.py; matplotlib, the `bench` extra) and rewrites the
generated blocks of README.md and docs/ from them (bench/figures.py:
the headline rows, the remote tier, the sealed costs), so that no measured
figure in them is typed by hand (tests/test_figures.py checks it).
Nothing here imports kvstore.
"""

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import figures  # noqa: E402
import plots  # noqa: E402

HARNESSES = ["foundation", "store", "ttft", "e2e", "serve", "chains", "serve_load", "serve_trace", "canary", "remote",
             "shapes", "serve_sizes", "agents", "lossless", "packed", "quality"]

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


TARGETS_NOTE = """\
## Targets moved, and why

- Time to first token of a disk hit against an mlx-lm prompt-cache file hit:
  the target was a ratio of at most 1.0 on the medians, and is now 1.05 on
  the median of the ratios of samples taken back to back (A B B A): a hit's
  time to first token moves by several per cent from one round to the next
  on this shared machine, and a ratio of medians compares samples taken at
  different moments (the row's note still gives it). The two hits
  prefill the same suffix with the same code; what differs is the work
  before it. mlx-lm's hit is handed the path of its file and trusts it:
  `load_prompt_cache` reads the tensors and checks nothing. kvstore's hit
  finds the file by the prompt's bytes, opens every block of the chain,
  checks the CRC32C of every byte it loads, and has the live model
  recompute the last restored token (the canary, docs/semantics.md §17) so that
  a file of another model is never used. The row's note measures that work
  in the same run (the load row's difference, and the canary as the same
  hit with and without it, paired: its recomputed token costs more than
  an average token of the suffix, since a 129-token prefill is not 1/128
  slower than a 128-token one) and prints the ratio it alone costs; with
  the checks on, the ratio cannot go below it. One pair's ratio spreads by
  about ±20% on this machine, so each size takes 60 pairs and the note
  gives their quartiles. The checks stay: 1.05 leaves them their share and
  a little noise, and a regression of the load or the prefill path past it
  still fails.
- kvstore serve on a production-shaped trace (bench/serve_trace.py): the
  upper quartile of the per-request TTFT ratio (kvstore / stock, over the
  requests both served with the same cached tokens) must be at most 1.10,
  or at most the same statistic between each server and itself in the
  same run (the floor), whichever is larger. In a closed loop the requests
  that run beside each one depend on when the ones before finished, so two
  replays of the same server batch the same arrivals differently, and a
  server's per-request ratios against itself spread past 1.10 (each row
  prints that floor beside it). A ratio between two servers cannot be
  judged more finely than the floor; a server slower on a share of the
  requests still widens the spread past it and fails. The median keeps
  its target of 1.02 (the replays alternate A B B A, so drift cancels in
  it).
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


def run_harness(name, quick, results, stamp):
    """Runs one harness; returns its JSON results, stamped with this run (stamp: id and command).

    The harness writes NAME.json.new and prints its markdown report; both replace
    bench/results/NAME.json and NAME.md with the run's stamp added to the JSON,
    except when the harness was skipped (what it needs is missing here) and an
    earlier run's results exist: those are kept, and their own stamp says so.
    """
    new = os.path.join(results, f"{name}.json.new")
    cmd = [sys.executable, os.path.join(HERE, f"{name}.py"), "--json", new] + (["--quick"] if quick else [])
    print(f"bench: running {name}{' --quick' if quick else ''}", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    # Run outside the source tree: the repository's kvstore/ must not shadow
    # the installed package.  The harness's progress lines go to our stderr.
    with tempfile.TemporaryDirectory() as cwd:
        out = subprocess.run(cmd, cwd=cwd, stdout=subprocess.PIPE, text=True)
    seconds = time.perf_counter() - t0
    if out.returncode != 0:
        if os.path.exists(new):
            os.unlink(new)
        raise SystemExit(f"bench: {name} failed (exit {out.returncode})")
    with open(new) as f:
        data = {"run": {**stamp, "wall_s": seconds}, **json.load(f)}
    os.unlink(new)
    if figures.skipped(data) and figures.load_results(results, name) is not None:
        print(f"bench: {name} skipped ({data['skipped']}); the results of an earlier run are kept",
              file=sys.stderr, flush=True)
        return data
    with open(os.path.join(results, f"{name}.json"), "w") as f:
        json.dump(data, f, indent=2)
    with open(os.path.join(results, f"{name}.md"), "w") as f:
        f.write(out.stdout)
    print(f"bench: {name} {'skipped' if figures.skipped(data) else 'done'} in {seconds:.0f} s",
          file=sys.stderr, flush=True)
    return data


def table_stamp(data, run):
    """The line under a harness's heading: the run it comes from, its machine and date."""
    m, here = data.get("machine", {}), run["machine"]
    if figures.run_id(data) == run["id"]:
        head = f"**Run** {run['id']} (this run)"
    else:
        cmd = (data.get("run") or {}).get("command")
        head = f"**From an earlier run**: {figures.run_label(data)}" + (f" (`{cmd}`)" if cmd else "")
        if data.get("name") in run["skipped"]:
            head += f"; skipped in this run: {run['skipped'][data['name']]}"
    where = "this run's" if figures.same_machine(m, here) else "**not this run's machine**"
    versions = "" if figures.same_versions(m, here) else "; other versions: its own lines below"
    return (f"> {head} · **machine** {figures.machine_text(m)} ({where}{versions}) · "
            f"**date** {m.get('date', '?')} (the harness's start)")


def earlier_tables(results, run):
    """[(name, its results)] of the harnesses whose tables come from another run than this one."""
    out = []
    for name in HARNESSES:
        data = figures.load_results(results, name)
        if data is not None and figures.run_id(data) != run["id"]:
            out.append((name, data))
    return out


def machine_table(results, run):
    """The header: this run, its machine and versions, its times, and the tables from other runs."""
    m = run["machine"]
    impl = ", ".join(f"{k}={v}" for k, v in m.get("implementation", {}).items())
    times = ", ".join(f"{n} {d['run']['wall_s']:.0f} s ({d['elapsed_s']:.0f} s"
                      f"{', quick' if d.get('quick') else ''}{', skipped' if figures.skipped(d) else ''})"
                      for n, d in run["ran"].items())
    rows = [
        ("run", f"{run['id']} (its UTC start): `{run['command']}`; total wall time {run['wall_s']:.0f} s; "
                f"harnesses of this run, wall time (own clock): {times}"),
        ("CPU", f"{m.get('cpu', '?')} ({', '.join(m.get('cpu_flags', []))}); {m.get('cores', '?')} cores "
                f"({m.get('usable_cores', '?')} usable)"),
        ("platform", m.get("platform", "?")),
        ("Python", m.get("python", "?")),
        ("MLX", m.get("mlx", "?")),
        ("mlx-lm", m.get("mlx_lm", "?")),
        ("kvstore", f"{m.get('kvstore', '?')} ({impl})"),
    ]
    if run["skipped"]:
        rows.append(("skipped", "; ".join(f"{n}: {why}" for n, why in run["skipped"].items())))
    earlier = earlier_tables(results, run)
    if earlier:
        rows.append(("tables of earlier runs", "; ".join(
            f"{n}: run {figures.run_label(d)}, {d['elapsed_s']:.0f} s{' (quick)' if d.get('quick') else ''}, "
            + ("this run's machine" if figures.same_machine(d["machine"], m)
               else f"**another machine**: {figures.machine_text(d['machine'])}")
            + ("" if figures.same_versions(d["machine"], m) else ", other versions")
            for n, d in earlier)))
    return "\n".join(["| | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows])


def provenance_note(results, run):
    """The header's sentence on where the tables come from."""
    earlier = earlier_tables(results, run)
    if not earlier:
        return "Every table below comes from this run, on this machine."
    other = sum(not figures.same_machine(d["machine"], run["machine"]) for _, d in earlier)
    return (f"{len(earlier)} of the tables below come from earlier runs"
            + (f", {other} of them from another machine" if other else ", on this run's machine")
            + " (the header's last row); each table's first line names its run, machine and date.")


def harness_section(results, name, run):
    """A harness's report as a section of bench/README.md, its stamp under the heading; or None."""
    path = os.path.join(results, f"{name}.md")
    data = figures.load_results(results, name)
    if not os.path.exists(path) or data is None:
        return None
    with open(path) as f:
        body = f.read().strip()
    body = body.replace("\n# ", "\n## ").replace("# ", "## ", 1)
    heading, _, rest = body.partition("\n")
    return f"{heading}\n\n{table_stamp({**data, 'name': name}, run)}\n{rest}\n"


def geometry_table():
    """What KV each harness's tables were measured at (bench/figures.py GEOMETRY)."""
    lines = ["The KV each harness stores (toy: far smaller than a served model's; the real sizes are "
             "shapes.py's, one section per geometry, and serve_sizes.py's):", "",
             "| harness | KV measured at |", "|---|---|"]
    lines += [f"| {name} | {figures.GEOMETRY[name]} |" for name in HARNESSES if name in figures.GEOMETRY]
    lines.append("| shapes | each section's geometry: Llama-3.1-8B to Llama-3.3-70B, Gemma-3, gpt-oss, "
                 "DeepSeek-V3's latent, bfloat16 |")
    return "\n".join(lines)


def publish(out, results, run, pictures):
    parts = ["# kvstore benchmarks\n",
             "Generated by `python -m bench` from the harnesses' own output (bench/foundation.py, "
             "store.py, ttft.py, e2e.py, serve.py, chains.py, serve_load.py, serve_trace.py, canary.py, remote.py, "
             "shapes.py, serve_sizes.py, agents.py, lossless.py, packed.py, quality.py). Each comparison "
             "was measured side by side with its peer in one run, after a warm-up, with repeats; cells are median / "
             "min (the canary's cells are distances, not times). The machine is a shared 2-core VM, so compare the "
             f"ratios, not the absolute times. {provenance_note(results, run)}\n",
             machine_table(results, run) + "\n", geometry_table() + "\n"]
    parts += [f"![{title}]({os.path.basename(path)})\n" for title, path in pictures]
    parts += [s for s in (harness_section(results, n, run) for n in HARNESSES) if s]
    parts.append(LOAD_NOTE)
    parts.append(CHAINS_NOTE)
    parts.append(TARGETS_NOTE)
    with open(os.path.join(out, "README.md"), "w") as f:
        f.write("\n".join(parts))

def arguments(argv):
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the quick variants (CI smoke), about 15 minutes here")
    ap.add_argument("--only", help=f"comma-separated harnesses (default: all of {','.join(HARNESSES)})")
    ap.add_argument("--no-write", action="store_true",
                    help="write the results, README and plots into a temporary directory (starting from a "
                         "copy of bench/results/) and print the README and the generated blocks; leave the "
                         "repository alone")
    args = ap.parse_args(argv)
    args.names = args.only.split(",") if args.only else HARNESSES
    unknown = sorted(set(args.names) - set(HARNESSES))
    if unknown:
        ap.error(f"unknown harness {', '.join(unknown)}; choose from {', '.join(HARNESSES)}")
    return args


def copy_results(src, dst):
    """Copies the kept results (NAME.json, NAME.md) into a --no-write run's directory."""
    for entry in sorted(os.listdir(src)) if os.path.isdir(src) else ():
        if entry.endswith((".json", ".md")):
            shutil.copyfile(os.path.join(src, entry), os.path.join(dst, entry))


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = arguments(argv)
    # The run's id is its UTC start; every harness it runs carries it in its JSON.
    run = {"id": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
           "command": " ".join(["python -m bench", *argv]), "ran": {}, "skipped": {}}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvstore-bench-out-") as scratch:
        out = scratch if args.no_write else HERE
        results = os.path.join(out, "results")
        os.makedirs(results, exist_ok=True)
        if args.no_write:
            copy_results(os.path.join(HERE, "results"), results)
        for name in args.names:
            data = run_harness(name, args.quick, results, {"id": run["id"], "command": run["command"]})
            run["ran"][name] = data
            run.setdefault("machine", data["machine"])
            if figures.skipped(data):
                run["skipped"][name] = figures.skipped(data)
        pictures = plots.draw(results, out)
        run["wall_s"] = time.perf_counter() - t0
        publish(out, results, run, pictures)
        if args.no_write:
            with open(os.path.join(out, "README.md")) as f:
                print(f.read())
            for (path, tag), body in figures.generate(results).items():
                start, end = figures.markers(tag)
                print(f"{path}:\n{start}\n{body}\n{end}\n")
        else:
            changed = figures.write_blocks(results)
            print("bench: wrote bench/README.md, bench/results/, "
                  + "".join(f"bench/{os.path.basename(p)}, " for _, p in pictures)
                  + f"and the generated blocks ({', '.join(changed) or 'unchanged'})", file=sys.stderr)
    print(f"bench: total wall time {run['wall_s']:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
