"""Eviction (docs/semantics.md §8): the decayed hit count, the score, the victim order.

The score is ds4's (``ds4_kvstore.c`` as of upstream commit ec6a82a, which
added the anchor factor and the superseded waypoint scale); the order adds
kvstore's stale rule and keeps chains whole.  Pure functions: the caller
passes the entries and the clock.
"""

import collections
import heapq
import math

from kvstore.format import Reason
from kvstore.settings import DEFAULT_HALF_LIFE

# Decayed hit counts below this are noise and count as zero
# (KV_CACHE_MIN_EFFECTIVE_HITS).
MIN_EFFECTIVE_HITS = 0.01
# Cold, evict and shutdown checkpoints are kept on purpose; a soft prior lets
# them outlive comparable waypoints while pressure and poor density can still
# evict them (KV_CACHE_ANCHOR_REASON_SCORE_FACTOR).
ANCHOR_SCORE_FACTOR = 2.0
# A continued waypoint that the incoming store supersedes is a routine stop on
# the same path: never-hit or stale ones become cheap victims, recently hit
# ones keep up to half their score (KV_CACHE_CONTINUED_PREFIX_MIN_FACTOR and
# KV_CACHE_CONTINUED_PREFIX_HIT_FACTOR).
SUPERSEDED_MIN_FACTOR = 0.05
SUPERSEDED_HIT_FACTOR = 0.45

_ANCHOR_REASONS = frozenset({Reason.COLD, Reason.EVICT, Reason.SHUTDOWN})


def _exp2(x):
    # ds4 decays with C exp2(); math.exp2 (Python 3.11+) calls the same libm
    # function, so scores match ds4 to the bit.
    return math.exp2(x) if hasattr(math, "exp2") else 2.0 ** x


def is_anchor(reason):
    """True for checkpoints kept on purpose: reasons cold, evict and shutdown.

    Args:
        reason: a :class:`kvstore.format.Reason` or its integer value.

    Returns:
        bool.
    """
    return reason in _ANCHOR_REASONS


def effective_hits(hits, last_used, created_at, now, half_life_s):
    """A checkpoint's hit count, decayed by the time since it was last useful.

    ``t`` is ``last_used``, or ``created_at`` for a file never hit.  A file
    with no time at all has no evidence (0).  A file used "in the future"
    (clock skew) keeps its raw count.  Otherwise the count halves every
    ``half_life_s`` seconds and drops to 0 under 0.01.

    Args:
        hits: the header's hit count.
        last_used: unix seconds of the last hit (0: never).
        created_at: unix seconds the file was written (0: unknown).
        now: unix seconds.
        half_life_s: seconds for the count to halve.

    Returns:
        float.
    """
    t = last_used or created_at
    if t == 0:
        return 0.0
    if now <= t:
        return float(hits)
    decayed = float(hits) * _exp2(-float(now - t) / float(half_life_s))
    return 0.0 if decayed < MIN_EFFECTIVE_HITS else decayed


def eviction_score(entry, now, superseded=False, protected=False,
                   half_life_s=DEFAULT_HALF_LIFE):
    """How much a checkpoint is worth keeping; the lowest score is deleted first.

    ``(effective_hits + 1) * tokens / file_size``: tokens saved per byte of
    disk, weighted by recent use.  Anchors (cold, evict, shutdown) count
    double.  A continued waypoint that the incoming store supersedes is scaled
    by ``0.05 + 0.45 * h / (h + 1)`` (h its effective hits): a never-hit one
    keeps 5 %, a busy one up to half.

    Args:
        entry: anything with ``hits``, ``last_used``, ``created_at``,
            ``tokens``, ``file_size`` and ``reason`` (a :class:`kvstore.format.Entry`).
        now: unix seconds.
        superseded: the caller found the entry's text a strict byte prefix of
            the incoming checkpoint's text, and the incoming one at least as
            widely reusable (same model, context <= the entry's, same quant
            when quant matters).  Applies only to reason continued, as in ds4.
        protected: the entry is the file just written; it scores infinity.
        half_life_s: hit half-life in seconds.

    Returns:
        float; 0.0 for an empty or unreadable file (file_size <= 0), inf for a
        protected one.
    """
    # Empty or unreadable files go first, protected or not (ds4 tests the
    # size before the protected sha).
    if entry.file_size <= 0:
        return 0.0
    if protected:
        # ds4 returned DBL_MAX for the just-renamed file; later ds4 evicts room
        # *before* writing instead.  kvstore keeps the "never the victim" rule.
        return math.inf
    hits = effective_hits(entry.hits, entry.last_used, entry.created_at, now, half_life_s)
    score = (hits + 1.0) * float(entry.tokens) / float(entry.file_size)
    if is_anchor(entry.reason):
        score *= ANCHOR_SCORE_FACTOR
    # ds4 decides "superseded" inside the score (it hashes the incoming text);
    # here the caller, which has the text, decides and passes a flag.
    if superseded and entry.reason == Reason.CONTINUED:
        share = hits / (hits + 1.0) if hits > 0.0 else 0.0
        score *= SUPERSEDED_MIN_FACTOR + SUPERSEDED_HIT_FACTOR * share
    return score


def _used_at(entry):
    return entry.last_used or entry.created_at


def _named_in(entry, names):
    return getattr(entry, "sha", None) in names or getattr(entry, "name", None) in names


def eviction_order(entries, now, superseded=frozenset(), protected=frozenset(),
                   half_life_s=DEFAULT_HALF_LIFE, stale_after_s=None):
    """Every entry in the order eviction deletes them: the next victim first.

    Stale entries (unused for more than stale_after_s; an entry without
    any time is not) go first, the one used longest ago first.  Then the lowest :func:`eviction_score` goes
    first; on a tie, the one used longest ago (``last_used``, or
    ``created_at`` when never hit); on a further tie, the earlier in
    ``entries``.  Protected entries (the file just written) come after all
    the others, in the same order among themselves.  Scores do not change
    as victims go, so this one ordering serves the store, the command
    line's dry run and the bucket's janitor.

    Args:
        entries: candidate entries (:class:`kvstore.format.Entry` or alike).
        now: unix seconds.
        superseded: shas of continued waypoints the incoming store supersedes.
        protected: shas (or file names) to keep while others remain.
        half_life_s: hit half-life in seconds.
        stale_after_s: Settings.stale_after_s (None: no stale rule).

    Returns:
        list of the entries.
    """
    # ds4 breaks ties on the raw last_used, so there a never-hit file (0)
    # loses every tie however new it is; this module uses the same time the
    # decay uses, t = last_used or created_at.
    def rank(indexed):
        index, entry = indexed
        used = _used_at(entry)
        if stale_after_s is not None and used and now - used > stale_after_s:
            return (_named_in(entry, protected), False, used, 0.0, index)
        score = eviction_score(entry, now, superseded=_named_in(entry, superseded),
                               half_life_s=half_life_s)
        return (_named_in(entry, protected), True, score, used, index)

    entries = list(entries)
    # A chain block another entry continues waits until that entry has gone:
    # chains go leaves first, never cut in the middle (docs/format.md §14).
    present = {getattr(e, "sha", None) for e in entries}
    waiting = collections.Counter(e.parent for e in entries
                                  if getattr(e, "parent", "") and e.parent in present)
    if not waiting:
        return [e for _, e in sorted(enumerate(entries), key=rank)]
    by_sha = {e.sha: (i, e) for i, e in enumerate(entries) if getattr(e, "sha", None)}
    heap = [(rank(ie), ie[0]) for ie in enumerate(entries) if waiting[getattr(ie[1], "sha", None)] == 0]
    heapq.heapify(heap)
    out = []
    while heap:
        _, i = heapq.heappop(heap)
        e = entries[i]
        out.append(e)
        parent = getattr(e, "parent", "")
        if parent in waiting:
            waiting[parent] -= 1
            if waiting[parent] == 0:
                heapq.heappush(heap, (rank(by_sha[parent]), by_sha[parent][0]))
    return out


def select_victims(entries, budget_bytes, now, superseded=frozenset(), protected=frozenset(),
                   half_life_s=DEFAULT_HALF_LIFE, kept_bytes=0, stale_after_s=None):
    """The entries to delete, in order, until the rest fit the budget.

    Args:
        entries: the candidates (``file_size`` each); all count for the budget.
        budget_bytes: the budget; 0 means unlimited (nothing is selected).
        now, superseded, protected, half_life_s, stale_after_s: as :func:`eviction_order`.
        kept_bytes: bytes that count for the budget but are never candidates.

    Returns:
        list of victims, the first to delete first.
    """
    entries = list(entries)
    total = kept_bytes + sum(e.file_size for e in entries)
    victims = []
    if not budget_bytes:
        return victims
    for e in eviction_order(entries, now, superseded, protected, half_life_s, stale_after_s):
        if total <= budget_bytes:
            break
        victims.append(e)
        total -= e.file_size
    return victims


def pick_victim(entries, now, superseded=frozenset(), protected=frozenset(),
                half_life_s=DEFAULT_HALF_LIFE):
    """The entry to delete next (the head of :func:`eviction_order`), or None when none."""
    order = eviction_order(entries, now, superseded, protected, half_life_s)
    return order[0] if order else None
