"""What one kvstore serve process has served since it started, for the admin API and page.

Activity counts finished completions by where their prefix came from (the
hit rate by source over the server's lifetime), the tokens each source gave
and the tokens prefilled, the requests of each tenant (by the first digits
of its tag: a tag, never a salt), and keeps the traces of the last
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
            self._recent.append(dict(trace, at=round(self._clock(), 3), tenant=tenant))

    def snapshot(self):
        """{"since", "requests": {source: n}, "hit_rate": {source: share}, "tokens_reused": {source: n},
        "tokens_prefilled", "tenants": {tag: requests}, "recent": [trace, newest first]}."""
        with self._lock:
            total = sum(self._requests.values())
            return {
                "since": round(self.started, 3),
                "requests": {s: self._requests[s] for s in SOURCES},
                "hit_rate": {s: (self._requests[s] / total if total else 0.0) for s in SOURCES},
                "tokens_reused": {s: self._reused[s] for s in SOURCES if s != "none"},
                "tokens_prefilled": self._prefilled,
                "tenants": dict(self._tenants.most_common()),
                "recent": list(reversed(self._recent)),
            }


__all__ = ["Activity", "RECENT"]
