"""What one kvstore serve process has served since it started, for the admin API and page.

Activity counts finished completions by where their prefix came from (the
hit rate by source over the server's lifetime), the tokens each source gave
and the tokens prefilled, the requests of each tenant (by the first digits
of its tag: a tag, never a salt), the requests and tokens of each
prompt_cache_key (by its tag's first digits: never the key), and keeps the traces of the last
RECENT requests (kvstore.serve.ticket.Ticket.trace, with the time they
finished).  Numbers and tags only: never prompt text.  Thread-safe: every
HTTP thread records into it.
"""

import collections
import threading
import time

from kvstore.serve.metrics import SOURCES

# Traces kept for GET /v1/cache and the page.
RECENT = 50
# Tenants shown by their tag's first digits (the log lines' form).
TAG_DIGITS = 8
# prompt_cache_key tags counted, at most (the most recently used; kvstore.serve.routing).
MAX_CACHE_KEYS = 256


class Activity:
    """Counts and recent traces of the completions one server finished."""

    def __init__(self, clock=time.time):
        self._clock = clock
        self._lock = threading.Lock()
        self.started = clock()
        self._requests = collections.Counter()
        self._reused = collections.Counter()
        self._prefilled = 0
        self._tenants = collections.Counter()
        self._recent = collections.deque(maxlen=RECENT)
        self._keys = collections.OrderedDict()      # prompt_cache_key tag -> its counts, most recent last

    def record(self, ticket):
        """One finished completion (its Ticket, served: ticket.source set)."""
        trace = ticket.trace()
        tenant = ticket.tenant[:TAG_DIGITS] if ticket.tenant else None
        with self._lock:
            self._requests[ticket.source] += 1
            self._reused[ticket.source] += ticket.reused
            self._prefilled += ticket.prefilled
            if tenant is not None:
                self._tenants[tenant] += 1
            if ticket.cache_key is not None:
                self._keyed(ticket.cache_key[:TAG_DIGITS], ticket)
            self._recent.append(dict(trace, at=round(self._clock(), 3), tenant=tenant))

    def _keyed(self, tag, ticket):
        """Counts a request under its prompt_cache_key's tag (the lock held)."""
        row = self._keys.pop(tag, None) or {"requests": 0, "reused_tokens": dict.fromkeys(("ram", "disk", "bucket"), 0),
                                            "prefilled_tokens": 0}
        row["requests"] += 1
        source = {"remote": "bucket"}.get(ticket.source, ticket.source)
        if source in row["reused_tokens"]:
            row["reused_tokens"][source] += ticket.reused
        row["prefilled_tokens"] += ticket.prefilled
        self._keys[tag] = row
        while len(self._keys) > MAX_CACHE_KEYS:
            self._keys.popitem(last=False)

    def snapshot(self):
        """{"since", "requests": {source: n}, "hit_rate": {source: share}, "tokens_reused": {source: n},
        "tokens_prefilled", "tenants": {tag: requests}, "cache_keys": {tag: {"requests",
        "reused_tokens": {source: n}, "prefilled_tokens"}, most recent first}, "recent": [trace, newest first]}."""
        with self._lock:
            total = sum(self._requests.values())
            return {
                "since": round(self.started, 3),
                "requests": {s: self._requests[s] for s in SOURCES},
                "hit_rate": {s: (self._requests[s] / total if total else 0.0) for s in SOURCES},
                "tokens_reused": {s: self._reused[s] for s in SOURCES if s != "none"},
                "tokens_prefilled": self._prefilled,
                "tenants": dict(self._tenants.most_common()),
                "cache_keys": {k: {**v, "reused_tokens": dict(v["reused_tokens"])}
                               for k, v in reversed(self._keys.items())},
                "recent": list(reversed(self._recent)),
            }


__all__ = ["Activity", "RECENT"]
