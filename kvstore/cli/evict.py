"""`kvstore evict`: lowest-score checkpoints go until the directory fits a budget.

The victims are kvstore.evictor.plan's, the plan KVStore.evict carries out:
the dry run prints it, the real run deletes it through a store.
"""

import os
import time

from kvstore import evictor
from kvstore.cli import text
from kvstore.cli.local import directory, open_store
from kvstore.cli.text import UsageError
from kvstore.index import DirectoryIndex


def cmd_evict(args):
    d = directory(args.dir)
    if args.budget_mb <= 0:
        raise UsageError("evict --budget-mb must be > 0 (to remove every checkpoint use `kvstore wipe`)")
    budget = text.mib_bytes(args.budget_mb)
    # KVStore.evict's plan (kvstore.evictor): the dry run prints it, the
    # real run carries it out; the same victims in the same order, orphans
    # first.  The index here is read only (no journal is created).
    index = DirectoryIndex(d, journal=False)
    index.refresh(force=True)
    before = index.total_bytes()
    now = int(time.time())
    if args.dry_run:
        entries = list(index.entries.values())
        victims = [v.entry for v in evictor.plan(entries, index.orphans, now, budget,
                                                 pinned=evictor.pinned_now(d, entries, now))]
        total = before - sum(v.file_size for v in victims)
        verb = "would evict"
    else:
        orphans = index.orphans
        store = open_store(d)           # its open removes the orphans
        # Opened with no budget so that the constructor deletes nothing else;
        # the explicit pass below evicts to the given one and reports its victims.
        store.budget_bytes = budget
        try:
            victims = [o for o in orphans if not os.path.lexists(o.path)] + store.evict()
            total = store.stats()["bytes"]
        finally:
            store.close()
        verb = "evicted"
    for v in victims:
        print(f"{verb} {v.sha[:12] or v.name}  {text.reason_name(v.reason)}  tokens {v.tokens}  "
              f"hits {v.hits}  {text.size(v.file_size)}")
    freed = sum(v.file_size for v in victims)
    print(f"{verb} {len(victims)} checkpoint{'s' if len(victims) != 1 else ''} ({text.size(freed)}); "
          f"{'would leave' if args.dry_run else 'now'} {text.budget_line(total, budget)}"
          f" (was {text.size(before)})")
    return 0


def add_parsers(sub):
    """`kvstore evict`."""
    s = sub.add_parser("evict", help="delete lowest-score checkpoints until DIR fits a budget")
    s.add_argument("dir", metavar="DIR")
    s.add_argument("--budget-mb", type=text.megabytes, required=True)
    s.add_argument("--dry-run", action="store_true", help="print what would go, delete nothing")
    s.set_defaults(func=cmd_evict)
