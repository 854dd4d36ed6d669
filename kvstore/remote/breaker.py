"""The circuit breaker and the health counters of the remote tier.

A dead or hung remote must not slow anything local: after a few network
failures in a row the breaker opens, and while it is open lookups see only
the local tier and uploads wait in their queue.  Health keeps the counters
of every remote call and feeds each failure to the breaker, classified.
"""

import collections
import logging
import threading
import time

from kvstore.files import short_name
from kvstore.remote.options import BREAKER_COOLDOWN_S, BREAKER_FAILURES, BREAKER_MAX_COOLDOWN_S
from kvstore.remote.s3 import CONFLICT, DENIED, ERROR, MISSING, UNAVAILABLE, classify

log = logging.getLogger("kvstore")

class CircuitBreaker:
    """Closed: calls go through.  Open: none do, until the cool-down ends.
    Half-open: one probe goes through; success closes, failure re-opens with
    twice the cool-down (up to BREAKER_MAX_COOLDOWN_S).

    Only network-level failures count (timeouts, refused connections, 5xx):
    a 403 says the remote is up and the credentials are wrong.
    """

    def __init__(self, failures=BREAKER_FAILURES, cooldown_s=BREAKER_COOLDOWN_S,
                 max_cooldown_s=BREAKER_MAX_COOLDOWN_S):
        self.threshold = int(failures)
        self.base_cooldown = float(cooldown_s)
        self.max_cooldown = max(float(max_cooldown_s), self.base_cooldown)
        self._lock = threading.Lock()
        self._fails = 0
        self._open_until = None
        self._cooldown = self.base_cooldown
        self._prober = None                   # the thread holding the half-open probe
        self.opened = 0                       # times it opened (a stat)

    @property
    def state(self):
        with self._lock:
            if self._open_until is None:
                return "closed"
            return "half_open" if self._prober is not None or time.monotonic() >= self._open_until else "open"

    def closed(self):
        """True while calls flow freely (no lock: a hot-path check)."""
        return self._open_until is None

    def wait_s(self):
        """Seconds until a probe may go (0 when one may go now)."""
        with self._lock:
            if self._open_until is None:
                return 0.0
            return max(0.0, self._open_until - time.monotonic())

    def allow(self):
        """May a call go now?  When open and cooled down, the caller is the probe."""
        with self._lock:
            if self._open_until is None:
                return True
            if self._prober is not None or time.monotonic() < self._open_until:
                return False
            self._prober = threading.get_ident()
            return True

    def release(self):
        """Gives back this thread's probe if it made no remote call: the next caller probes."""
        with self._lock:
            if self._prober == threading.get_ident():
                self._prober = None

    def success(self):
        with self._lock:
            was_open = self._open_until is not None
            self._fails = 0
            self._open_until = None
            self._prober = None
            self._cooldown = self.base_cooldown
            if was_open:
                log.warning("kvstore: remote_breaker state=closed")

    def failure(self):
        with self._lock:
            self._fails += 1
            if self._prober is not None:
                self._prober = None
                self._cooldown = min(self._cooldown * 2, self.max_cooldown)
            elif self._open_until is not None or self._fails < self.threshold:
                return
            self._open_until = time.monotonic() + self._cooldown
            self.opened += 1
            # Logged under the lock: whoever sees the breaker open sees the line.
            log.warning("kvstore: remote_breaker state=open failures=%d cooldown_s=%.1f", self._fails,
                        self._cooldown)

class Health:
    """Counters of the remote calls, the last failure, and the breaker they feed."""

    def __init__(self, breaker, bucket_name):
        self.breaker = breaker
        self.bucket_name = bucket_name
        self.last_error = None
        self._counts = collections.Counter()
        self._lock = threading.Lock()

    def count(self, **kv):
        with self._lock:
            self._counts.update(kv)

    def counts(self):
        with self._lock:
            return dict(self._counts)

    def failed(self, what, exc, sha=None):
        """Logs a failed call (one key=value line) and feeds the breaker; returns the Failure."""
        f = classify(exc)
        self.last_error = f
        if f.kind == UNAVAILABLE:
            self.count(errors=1)
            self.breaker.failure()
        else:
            # The server answered (a refusal is an answer): it is reachable.
            self.breaker.success()
            if f.kind == DENIED:
                self.count(denied=1)
            elif f.kind == ERROR:
                self.count(errors=1)
        where = f" file={short_name(sha)}" if sha else f" bucket={self.bucket_name}"
        level = logging.INFO if f.kind in (MISSING, CONFLICT) else logging.WARNING
        log.log(level, "kvstore: remote_%s_failed %s%s", what, f.fields(), where)
        return f
