"""What an eviction pass removes, decided in one place (docs/semantics.md §8).

``plan`` is the one function behind ``KVStore.evict`` (which deletes its
victims, in order) and ``kvstore evict --dry-run`` (which prints them):
orphaned chain blocks first, then checkpoints past the maximum age (chain
blocks leaves first: a parent is a candidate once no block continues it),
then, while the rest is over the budget, the order of
kvstore.policy.eviction_order (stale files first, superseded waypoints
next, then by score) over headers read again, since other processes
record hits in place.

``Evictor`` carries a plan out over one open directory: under the
directory's exclusive lock, torn files first, then the plan's victims.
It also grants and lifts pins (kvstore.pins): what a live pin keeps is
never a victim of the budget or of a maximum age.
"""

import dataclasses
import fcntl
import math
import time

from kvstore import names, pins, policy
from kvstore.errors import KVStoreError, PinRefused
from kvstore.format import Reason, envelope_now
from kvstore.settings import DEFAULT_HALF_LIFE, DEFAULT_STALE_AFTER_S

# Orphaned blocks (a chain broken by a crash or another tool) are removed
# under the directory lock; a lookup that sees some tries at most this often.
ORPHAN_SWEEP_INTERVAL_S = 10.0


@dataclasses.dataclass(frozen=True)
class Victim:
    entry: object     # the Entry to delete
    why: str          # "orphan", "max_age" or "budget": the log line's reason


def last_activity(e):
    """Unix seconds of a checkpoint's last use, else its creation, else (a
    header with neither, written by some other tool) its file's mtime: a
    maximum age must not spare a file for lack of a timestamp."""
    return e.last_used or e.created_at or e.mtime_ns // 10**9


def plan(entries, orphans, now, budget_bytes, *, max_age_s=None, protect=None, superseded=None,
         half_life_s=DEFAULT_HALF_LIFE, stale_after_s=DEFAULT_STALE_AFTER_S, current=envelope_now,
         pinned=frozenset()):
    """The victims of one eviction pass, the first to delete first.

    Args:
        entries: every valid checkpoint of the directory (the orphans too).
        orphans: the chain blocks whose chain does not reach a first block.
        now: unix seconds.
        budget_bytes: the budget; 0 means unlimited.
        max_age_s: delete what has not been used for this long (None: keep).
        protect: an Entry never chosen (the file just written).
        superseded: a callable (the entries, read again) -> shas of waypoints
            the incoming checkpoint supersedes; None: none.
        half_life_s, stale_after_s: as kvstore.policy.eviction_order.
        current: path -> the Entry there now or None (headers change in place).
        pinned: shas that live pins keep (kvstore.pins.kept): never chosen
            for age or budget; their bytes count for the budget.

    Returns:
        [Victim].
    """
    out = [Victim(e, "orphan") for e in orphans]
    if orphans:
        gone = {e.name for e in orphans}
        entries = [e for e in entries if e.name not in gone]
    if max_age_s is not None:
        expired = _expired([e for e in entries if e.sha not in pinned], now, max_age_s, protect, current)
        out += [Victim(e, "max_age") for e in expired]
        gone = {e.name for e in expired}
        entries = [e for e in entries if e.name not in gone]
    if not budget_bytes or sum(e.file_size for e in entries) <= budget_bytes:
        return out
    fresh = [c for c in (current(e.path) for e in entries) if c is not None]
    free = [e for e in fresh if e.sha not in pinned]
    protected = frozenset([protect.sha]) if protect is not None else frozenset()
    chosen = policy.select_victims(free, budget_bytes, now, superseded(fresh) if superseded else frozenset(),
                                   protected, half_life_s, stale_after_s=stale_after_s,
                                   kept_bytes=sum(e.file_size for e in fresh if e.sha in pinned))
    return out + [Victim(e, "budget") for e in chosen]


def _expired(entries, now, max_age_s, protect, current):
    """The entries unused for max_age_s, chain blocks leaves first (a parent
    once every block that continues it is expired)."""
    out, left = [], list(entries)
    while True:
        parents = {e.parent for e in left if e.is_block and e.parent}
        newly = []
        for e in policy.eviction_order(left, now):
            if e.sha in parents or (protect is not None and e.name == protect.name):
                continue
            t = last_activity(e)
            if not (t and now - t > max_age_s):
                continue
            # The index's copy predates hits recorded in place since (touch):
            # an entry that looks old is read again.
            cur = current(e.path)
            t = last_activity(cur) if cur is not None else None
            if t and now - t > max_age_s:
                newly.append(e)
        out += newly
        if not any(e.is_block for e in newly):
            return out
        gone = {e.name for e in newly}
        left = [e for e in left if e.name not in gone]


def pinned_now(directory, entries, now):
    """The shas the directory's live pins keep among entries (plan's pinned)."""
    return pins.kept(pins.read_pins(directory, now).values(), {e.sha: e for e in entries})[0]


class Evictor:
    """Eviction, expiry, orphans and superseded waypoints over one open directory.

    Args:
        d: the kvstore.directory.Directory.
    """

    def __init__(self, d):
        self.d = d
        self._orphans_swept = 0.0

    def evict(self, protect=None, incoming_text=None):
        """KVStore.evict (see there): the list of evicted entries."""
        d = self.d
        evicted = []
        with d.dir_lock(fcntl.LOCK_EX):
            with d.lock:
                d.index.refresh(force=True)
                orphans = list(d.index.orphans)
                entries = list(d.index.entries.values())
            d.discard_torn()
            now = int(time.time())
            victims = plan(entries, orphans, now, d.budget_bytes, max_age_s=d.settings.max_age_s,
                           protect=protect, superseded=lambda fresh: self.superseded(fresh, protect, incoming_text),
                           half_life_s=d.settings.hit_half_life_s, stale_after_s=d.settings.stale_after_s,
                           pinned=pinned_now(d.path, entries, now))
            for v in victims:
                if d.delete(v.entry, v.why):
                    evicted.append(v.entry)
        return evicted

    def evict_if_over(self, protect, incoming_text=None):
        """evict() after a new file, when the directory is over the budget (or
        a maximum age applies).  Under the budget the pass is skipped: it
        re-lists and re-reads the whole directory under the exclusive lock,
        which in a directory of 100,000 blocks costs far more than the save.
        The index is refreshed first (the journal names what other processes
        wrote since, a few names to look at): judged on a listing that missed
        their newest files, the last of several writers would skip a pass
        the directory needs."""
        d = self.d
        with d.lock:
            d.index.refresh()
            total = d.index.total_bytes()
        if d.settings.max_age_s is not None or (d.budget_bytes and total > d.budget_bytes):
            self.evict(protect=protect, incoming_text=incoming_text)

    def sweep_orphans(self):
        """Removes orphaned blocks under the exclusive lock, if it is free now (at
        most every ORPHAN_SWEEP_INTERVAL_S); a lookup never waits for it."""
        now = time.monotonic()
        if now - self._orphans_swept < ORPHAN_SWEEP_INTERVAL_S:
            return
        self._orphans_swept = now
        d = self.d
        try:
            with d.dir_lock(fcntl.LOCK_EX | fcntl.LOCK_NB):
                with d.lock:
                    d.index.refresh(force=True)
                    orphans = list(d.index.orphans)
                for e in orphans:
                    d.delete(e, "orphan")
        except (BlockingIOError, KVStoreError):
            pass

    def superseded(self, entries, incoming, text):
        """Shas of continued waypoints that the incoming checkpoint supersedes."""
        if incoming is None or text is None:
            return frozenset()
        d = self.d
        # At least as widely reusable: the incoming checkpoint fits every
        # engine that the waypoint fits.  (A chain's interior blocks may be
        # superseded too; they go only once no block continues them.)
        cands = [e for e in entries
                 if e.reason == Reason.CONTINUED and e.sha and e.text_bytes < len(text)
                 and policy.misfit(incoming, e.model_id, e.ctx_size, e.quant_bits, d.settings.reject_different_quant,
                                   d.codec.abis, d.codec.key_id, e.model_tag) is None]
        return frozenset(e.sha for e in names.named_prefixes(cands, text, d.codec.key_of))

    # -- pins -------------------------------------------------------------------

    def pins(self):
        """The live pins of files present, the latest lifetime first ([kvstore.pins.Pin])."""
        d = self.d
        with d.lock:
            d.index.refresh()
            entries = list(d.index.entries.values())
        return pins.present(d.path, entries, int(time.time()))[0]

    def pin(self, entry, ttl_s, tenant=""):
        """KVStore.pin (see there) of the file entry names: the Pin granted.

        Raises:
            ValueError: a bad ttl_s (kvstore.pins.parse_ttl).
            PinRefused: the file is gone, or the pin would pass the budget's pinned share.
        """
        d = self.d
        ttl = pins.parse_ttl(ttl_s)
        if d.settings.max_pin_ttl_s is not None:
            ttl = min(ttl, d.settings.max_pin_ttl_s)
        now = int(time.time())
        with d.dir_lock(fcntl.LOCK_EX):
            entries = self._listed()
            if entry.sha not in entries:
                raise PinRefused("not_stored", f"checkpoint {entry.sha[:12]} is no longer stored")
            live = {s: p for s, p in pins.read_pins(d.path, now).items() if s in entries}
            _, before = pins.kept(live.values(), entries)
            old = live.get(entry.sha)
            live[entry.sha] = pins.Pin(entry.sha, max(now + math.ceil(ttl), old.until if old else 0),
                                       tenant or (old.tenant if old else ""), old.created if old else now,
                                       entry.tokens, pins.kept([entry.sha], entries)[1])
            _, after = pins.kept(live.values(), entries)
            limit = int(d.settings.max_pinned_share * d.budget_bytes)
            if d.budget_bytes and after > before and after > limit:
                raise PinRefused("share", f"pinning {entry.tokens} tokens would keep {after} pinned bytes, "
                                          f"past the pinned share of the budget ({d.settings.max_pinned_share:g} "
                                          f"of {d.budget_bytes} bytes = {limit})")
            pins.write_pins(d.path, live, d.settings.durable)
        return live[entry.sha]

    def unpin(self, shas):
        """Lifts the pins of these files; the number lifted."""
        d = self.d
        shas = set(shas)
        with d.dir_lock(fcntl.LOCK_EX):
            live = pins.read_pins(d.path, int(time.time()))
            gone = shas & set(live)
            if gone:
                pins.write_pins(d.path, {s: p for s, p in live.items() if s not in gone}, d.settings.durable)
        return len(gone)

    def _listed(self):
        """{sha: Entry} of the directory, listed again (the caller holds its exclusive lock)."""
        d = self.d
        with d.lock:
            d.index.refresh(force=True)
            return {e.sha: e for e in d.index.entries.values()}
