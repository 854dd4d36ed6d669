"""The plots of bench/README.md, drawn from the harnesses' JSON results by ``python -m bench``.

- lookup.png: time per lookup against the number of entries (log-log),
  kvstore's find against the ds4 loop and one hashlib pass, miss and hit;
- throughput.png: GB/s of each load and save method on the same KV state;
- chains.png: the blocks that three sessions leave in a chained store
  (bench/chains.py), along the token axis, with their parents;
- serve_load.png: time to first token (p50 and p95) against the number of
  concurrent agent sessions, kvstore serve and stock mlx_lm.server, before
  and after a restart (bench/serve_load.py).

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
    written = []
    store = _load(results, "store.json")
    if store.get("lookup_curve"):
        written.append(("lookup scaling", lookup(plt, store["lookup_curve"], os.path.join(out, "lookup.png"))))
    if store.get("throughput"):
        written.append(("load and save throughput",
                        throughput(plt, store["throughput"], os.path.join(out, "throughput.png"))))
    chains = _load(results, "chains.json")
    if chains.get("chain_picture"):
        written.append(("chained checkpoints", chain_blocks(plt, chains["chain_picture"],
                                                            os.path.join(out, "chains.png"))))
    serve_load = _load(results, "serve_load.json").get("load") or {}
    if serve_load.get("load_curve"):
        written.append(("time to first token under concurrent sessions, across a restart",
                        load_ttft(plt, serve_load, os.path.join(out, "serve_load.png"))))
    return written


def _load(results, name):
    """A harness's JSON results, or {} when it has none."""
    path = os.path.join(results, name)
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


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


# chains.png: fill by how many stored sequences run through a block.
CHAIN_FILLS = ((1, "#c6dbef", "on one stored sequence"), (2, "#6baed6", "shared by 2"),
               (3, "#2171b5", "shared by 3 or more"))
# Blocks are drawn this many tokens short of each end, so that the arrow
# from a block to its parent shows even when they sit side by side.
CHAIN_INSET = 14


def chain_blocks(plt, pic, path):
    """One row per save (in the order they were made), holding the blocks that
    save wrote; each block a box over its token range, an arrow to its parent.

    A box with a solid edge is a hit (restorable and at least min_tokens long:
    the lookup can return it); a hatched one only links its children.
    """
    from matplotlib.lines import Line2D
    from matplotlib.patches import FancyArrowPatch, Patch, Rectangle

    blocks = {b["sha"]: b for b in pic["blocks"]}
    saves = pic["saves"]
    grid, end = pic["grid"], max(b["end"] for b in pic["blocks"])
    fig, ax = plt.subplots(figsize=(9, 0.7 * len(saves) + 1.6))
    h = 0.62
    for b in pic["blocks"]:
        row = b["save"]
        fill = next(c for n, c, _ in reversed(CHAIN_FILLS) if b["sequences"] >= n)
        x0, x1 = b["start"] + CHAIN_INSET, b["end"] - CHAIN_INSET
        ax.add_patch(Rectangle((x0, row - h / 2), x1 - x0, h, facecolor=fill,
                               edgecolor="black", linewidth=1.2 if b["hit"] else 0.8,
                               linestyle="-" if b["hit"] else "--", hatch=None if b["hit"] else "///"))
        label = f"{b['start']:,}–{b['end']:,}"
        dark = b["sequences"] >= CHAIN_FILLS[-1][0]
        wide = x1 - x0 > 200
        size = 7 if wide else 6.5
        ax.text((x0 + x1) / 2, row, label if wide else label.replace("–", "–\n"), ha="center",
                va="center", fontsize=size, color="white" if dark and b["hit"] else "black",
                bbox=None if b["hit"] else dict(boxstyle="round,pad=0.15", facecolor="white", linewidth=0))
        if b["ends_save"]:
            ax.text(x1, row - h / 2 - 0.04, b["reason"], ha="right", va="bottom", fontsize=7, fontweight="bold",
                    color="tab:red")
        parent = blocks.get(b["parent"])
        if parent is not None:
            # Side by side: edge to edge; from a row below: the child's top
            # left corner to the parent's bottom right one.
            px, prow = parent["end"] - CHAIN_INSET, parent["save"]
            tail, head = ((x0, row), (px, prow)) if prow == row else ((x0, row - h / 2), (px, prow + h / 2))
            ax.add_patch(FancyArrowPatch(tail, head, arrowstyle="-|>", mutation_scale=9, linewidth=1.0,
                                         color="0.2", shrinkA=0, shrinkB=0, zorder=3))
    for x in range(0, end + grid, grid):
        ax.axvline(x, color="0.85", linewidth=0.6, zorder=0)
    ax.set_xlim(-20, (end // grid + 1) * grid + 20)
    ax.set_ylim(len(saves) - 0.4, -0.75)
    ax.set_yticks(range(len(saves)))
    ax.set_yticklabels([s["label"] for s in saves], fontsize=8)
    ax.set_xticks(range(0, end + grid, grid))
    ax.tick_params(axis="x", labelsize=8)
    ax.set_xlabel(f"tokens (grid lines every {grid}: the block size)")
    notes = "; ".join(f"{s['label']} reused {s['first']['reused_tokens']:,} from disk"
                      for s in pic["sessions"] if s["first"]["source"] == "disk")
    ax.set_title(f"A chained store after three sessions (one row per save: the blocks it wrote)\n"
                 f"after a restart {notes}", fontsize=9)
    handles = [Patch(facecolor=c, edgecolor="black", label=t) for _, c, t in CHAIN_FILLS]
    handles += [Patch(facecolor="white", edgecolor="black",
                      label=f"a hit (restorable, ≥ {pic['min_tokens']} tokens)"),
                Patch(facecolor="white", edgecolor="black", hatch="///", linestyle="--",
                      label=f"a link only (< {pic['min_tokens']} tokens)"),
                Line2D([], [], color="0.25", marker=">", markersize=4, linewidth=0.9, label="to its parent")]
    ax.legend(handles=handles, fontsize=7, loc="upper center", bbox_to_anchor=(0.45, -0.17), ncol=3, frameon=False)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# serve_load.png: (server kind, label, colour); p50 solid with dots, p95 dashed.
LOAD_KINDS = (("kvstore", "kvstore serve", "tab:blue"), ("stock", "stock mlx_lm.server", "tab:gray"))


def load_ttft(plt, load, path):
    """Two panels, before and after the restart: TTFT p50 and p95 against the concurrent sessions."""
    from matplotlib import ticker

    curve = load["load_curve"]
    sessions = [p["sessions"] for p in curve]
    restart = load.get("restart_after", 2)
    turns = load.get("turns", 4)
    fig, axes = plt.subplots(1, 2, figsize=(9, 4), sharey=True)
    panels = (("before", f"turns 1–{restart}: before the restart"),
              ("after", f"turns {restart + 1}–{turns}: after SIGTERM + restart"))
    for ax, (phase, title) in zip(axes, panels):
        for kind, label, color in LOAD_KINDS:
            for q, style in (("p50", "-o"), ("p95", "--s")):
                ax.plot(sessions, [p[kind][phase][f"{q}_ms"] for p in curve], style, color=color,
                        label=f"{label}, {q}", markersize=5)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sessions)
        ax.set_xticklabels([str(n) for n in sessions])
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:,.0f}"))
        ax.yaxis.set_minor_formatter(ticker.FuncFormatter(
            lambda v, _: f"{v:,.0f}" if f"{v:.0e}"[0] in "25" else ""))
        ax.set_xlabel("concurrent sessions")
        ax.set_title(title, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("time to first token, ms")
    axes[1].legend(fontsize=8)
    system = load.get("system_tokens")
    fig.suptitle("Agent sessions sharing a system prompt" + (f" of {system:,} tokens" if system else ""),
                 fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
