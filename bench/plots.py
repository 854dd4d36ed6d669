"""The plots of bench/README.md, drawn from the harnesses' JSON results by ``python -m bench``.

- lookup.png: time per lookup against the number of entries (log-log),
  kvstore's find against the ds4 loop and one hashlib pass, miss and hit;
- throughput.png: GB/s of each load and save method on the same KV state.

matplotlib is the ``bench`` extra (``pip install ".[bench]"``) and is imported
here only: when it is missing the plots are skipped with one message.
"""

import json
import os
import sys

# (key in a lookup_curve point, label, style): kvstore solid, ds4 dashed.
LOOKUP_LINES = (
    ("kv_miss", "kvstore find, miss", "-o"),
    ("kv_hit", "kvstore find, hit", "-s"),
    ("ds4_miss", "ds4 find loop (hashlib port), miss", "--o"),
    ("ds4_hit", "ds4 find loop (hashlib port), hit", "--s"),
    ("sha1", "one hashlib.sha1 pass over the prompt", ":^"),
)


# The throughput axis ends this far past the fastest load or save sample.
AXIS_SLACK = 1.15


def draw(results, out):
    """Draws every plot whose data is in results/; returns [(title, path)] of the files written."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print('bench: matplotlib is not installed (pip install ".[bench]"): no plots', file=sys.stderr)
        return []
    path = os.path.join(results, "store.json")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        store = json.load(f)
    written = []
    if store.get("lookup_curve"):
        written.append(("lookup scaling", lookup(plt, store["lookup_curve"], os.path.join(out, "lookup.png"))))
    if store.get("throughput"):
        written.append(("load and save throughput",
                        throughput(plt, store["throughput"], os.path.join(out, "throughput.png"))))
    return written


def lookup(plt, curve, path):
    ns = [p["n"] for p in curve]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key, label, style in LOOKUP_LINES:
        ax.plot(ns, [p[key]["median_ns"] / 1e6 for p in curve], style, label=label)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("checkpoints in the directory (N)")
    ax.set_ylabel("ms per lookup (median)")
    ax.set_title("Lookup of a 400 KB prompt")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def throughput(plt, bars, path):
    """Horizontal bars, grouped by operation: median GB/s, a tick at the best sample.

    The axis ends a little past the fastest load or save; a bar beyond it
    (the raw read of the page cache, several times faster) is cut there and
    labelled with its value.
    """
    labels = [f"{b['op']}: {b['method']}" for b in bars]
    median = [b["median_gbps"] for b in bars]
    best = [b["max_gbps"] for b in bars]
    colors = ["tab:blue" if b["method"].startswith("kvstore") else "tab:gray" for b in bars]
    limit = AXIS_SLACK * max(b["max_gbps"] for b in bars if not b["op"].startswith("raw"))
    fig, ax = plt.subplots(figsize=(8, 0.32 * len(bars) + 1.2))
    y = list(range(len(bars)))[::-1]
    ax.barh(y, [min(m, limit) for m in median], color=colors)
    ax.plot([min(b, limit) for b in best], y, "k|", markersize=10)
    for yi, m in zip(y, median):
        ax.text(min(m, limit), yi, f" {m:.2f}", va="center", fontsize=7,
                ha="right" if m > limit else "left", color="white" if m > limit else "black")
    ax.set_xlim(0, limit)
    ax.set_yticks(y)
    ax.set_yticklabels(labels, fontsize=8)
    ax.set_xlabel("GB/s (median, written at the bar's end; tick: best sample)")
    ax.set_title("Load and save of the same KV state (kvstore in blue)")
    ax.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
