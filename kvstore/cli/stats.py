"""`kvstore stats`: a directory's totals, its models, and every process's cumulative counters.

Read without opening a store (which would evict) and without creating or
changing the counters file: the envelopes through
kvstore.files.scan_directory, the models through kvstore.registry, the
counters through kvstore.counters.read_directory (docs/semantics.md §15).
"""

import collections
import json
import math
import os
import time

from kvstore import counters, files, registry, settings
from kvstore.cli import text
from kvstore.cli.local import directory
from kvstore.files import scan_directory
from kvstore.directory import budget_bytes_for


def summary(d, entries, bad, budget, budget_derived=False):
    """What `kvstore stats --json` prints (the counters as read, infinities and all)."""
    total = sum(e.file_size for e in entries)
    by_reason = collections.Counter(text.reason_name(e.reason) for e in entries)
    times = [e.created_at for e in entries if e.created_at]
    return {
        "dir": os.path.abspath(d),
        "entries": len(entries),
        "bytes": total,
        "budget_bytes": budget,
        "budget_derived": budget_derived,
        "budget_use": (total / budget) if budget else None,
        "by_reason": {r: by_reason[r] for r in sorted(by_reason)},
        "hits": sum(e.hits for e in entries),
        "tokens": sum(e.tokens for e in entries),
        "not_loadable": sum(1 for e in entries if not e.loadable),
        "bad_envelopes": len(bad),
        "oldest": min(times) if times else None,
        "newest": max(times) if times else None,
        "sync": files.SYNC_PRIMITIVE,
        # Every model's share of the directory (docs/semantics.md §17).
        "models": registry.summarize(entries, registry.read_registry(d)),
        # Every process's cumulative counters (KVStore.counters()), read
        # without creating or changing the file.
        "directory": counters.read_directory(d),
    }


def json_counters(c):
    """The directory counters for JSON, which has no infinity: the last bucket's bound as "+Inf"."""
    out = dict(c)
    for h in counters.HISTOGRAMS:
        out[h] = dict(c[h], buckets=[["+Inf" if le == math.inf else le, n] for le, n in c[h]["buckets"]])
    return out


def totals_rows(out, now):
    """(label, value) of the directory's totals."""
    rows = [
        ("entries", f"{out['entries']}" + (f" ({out['not_loadable']} with a foreign payload ABI)"
                                           if out["not_loadable"] else "")),
        ("bytes", text.budget_line(out["bytes"], out["budget_bytes"], out["budget_derived"])),
        ("by reason", ", ".join(f"{r} {n}" for r, n in out["by_reason"].items()) or "-"),
        ("hits", out["hits"]),
        ("tokens", out["tokens"]),
        ("models", "; ".join(f"{m['name']} ({m['tag']}): {text.plural(m['entries'], 'file')}, "
                             f"{text.size(m['bytes'])}" for m in out["models"]) or "-"),
        ("oldest", text.stamp(out["oldest"], now)),
        ("newest", text.stamp(out["newest"], now)),
        ("sync", f"{out['sync']} (what a durable save calls on this platform)"),
    ]
    if out["bad_envelopes"]:
        rows.append(("bad envelopes", f"{out['bad_envelopes']} (see `kvstore verify`)"))
    return rows


def counter_rows(c):
    """(label, value) of the directory's cumulative counters."""
    budget = c["write_budget"]
    return [
        ("saves", c["saves"]),
        ("bytes written", text.size(c["bytes_written"])),
        ("loads", c["loads"]),
        ("bytes read", text.size(c["bytes_read"])),
        ("evictions", f"{c['evictions']} ({text.size(c['bytes_evicted'])})"),
        ("corrupt", c["corrupt"]),
        ("canary", f"{c['canary_checks']} restores checked, {c['canary_failures']} failed (quarantined)"),
        ("skipped (write budget)", c["stores_skipped_write_budget"]),
        ("write budget", "none" if budget is None else
         f"{text.size(budget['available_bytes'])} of {text.size(budget['capacity_bytes'])} available, "
         f"refills {text.size(budget['capacity_bytes'])} an hour"),
    ]


def cmd_stats(args):
    d = directory(args.dir)
    entries, bad = scan_directory(d)
    now = int(time.time())
    out = summary(d, entries, bad, *budget_bytes_for(d, text.budget_mb(args)))
    if args.json:
        print(json.dumps(dict(out, directory=json_counters(out["directory"])), indent=2))
        return 0
    print(text.pairs(totals_rows(out, now)))
    print("directory counters (every process, cumulative):")
    print(text.pairs(counter_rows(out["directory"]), indent="  "))
    return 0


def add_parsers(sub):
    """`kvstore stats`."""
    s = sub.add_parser("stats", help="totals: entries, bytes, reasons, hits, ages; the directory's cumulative counters")
    s.add_argument("dir", metavar="DIR")
    s.add_argument("--json", action="store_true")
    settings.add_arguments(s, ["budget_mb"], doc={"budget_mb": text.budget_help("disk budget in MiB")})
    s.set_defaults(func=cmd_stats)
