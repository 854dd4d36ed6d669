"""Store and eviction policy (docs/semantics.md §7 and §8) as pure functions.

This package owns the arithmetic a server uses to decide *what* to store and
*what* to delete: the aligned store length, the chat anchor of a cold
checkpoint, the continued-waypoint schedule, the store targets and cuts
PromptCache and kvstore serve both apply, the decayed hit count, the
eviction score, the budget check and the choice of a victim.  It does no I/O
and keeps no state: the caller owns the directory, the index, the last stored
waypoint and the clock, and passes them in.

The numbers follow antirez's ds4 (``ds4_kvstore.c``; the eviction score as of
upstream commit ec6a82a, which added the anchor factor and the superseded
waypoint scale).  Where kvstore departs from ds4 the function says so in a
comment (docs/semantics.md §7 and §8 are the rules as implemented).

Modules: store (what to store, where and why), eviction (scores and the
victim order), budget (the disk and write budgets, and misfit: which
checkpoints an engine can load).  The policy's knobs and their defaults are
fields of kvstore.settings.Settings, which every function here takes.
"""

from kvstore.policy.budget import (BUDGET_SLACK_PERCENT, WRITE_BUDGET_FLOORS, bytes_fit, default_budget_bytes,
                                   file_size_fits, misfit, over_half_budget, write_allowed,
                                   write_budget_floor)
from kvstore.policy.eviction import (ANCHOR_SCORE_FACTOR, MIN_EFFECTIVE_HITS, SUPERSEDED_HIT_FACTOR,
                                     SUPERSEDED_MIN_FACTOR, effective_hits, eviction_order, eviction_score,
                                     is_anchor, pick_victim, select_victims)
from kvstore.policy.store import (ANCHOR, BLOCKS, LEAVING, PIN, SNAPSHOT, WAYPOINT, StoreTarget, chat_anchor_pos,
                                  cold_target, continued_step, continued_store_target, finished_stores,
                                  finished_tail, last_store_after, leaving_stores, pin_target, prefill_stores,
                                  snapshot_every_block, store_cut, store_len)

__all__ = [
    # store
    "store_len", "chat_anchor_pos", "continued_step", "continued_store_target", "snapshot_every_block",
    "StoreTarget", "ANCHOR", "WAYPOINT", "SNAPSHOT", "BLOCKS", "LEAVING", "PIN", "pin_target", "cold_target",
    "prefill_stores",
    "last_store_after", "finished_stores", "finished_tail", "leaving_stores", "store_cut",
    # eviction
    "MIN_EFFECTIVE_HITS", "ANCHOR_SCORE_FACTOR", "SUPERSEDED_MIN_FACTOR", "SUPERSEDED_HIT_FACTOR", "is_anchor",
    "effective_hits", "eviction_score", "eviction_order", "select_victims", "pick_victim",
    # budget
    "BUDGET_SLACK_PERCENT", "default_budget_bytes", "over_half_budget", "file_size_fits", "bytes_fit",
    "WRITE_BUDGET_FLOORS", "write_budget_floor",
    "write_allowed", "misfit",
]
