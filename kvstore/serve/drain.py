"""Draining on SIGTERM and SIGINT: finish what is in flight, refuse what comes, then stop.

A server that stops the moment it is told to cuts every answer in flight,
and a streaming answer cut by a closed connection looks to an OpenAI client
like a whole one (HTTP/1.0: the stream just ends).  So kvstore serve, on the
first SIGTERM or SIGINT:

1. answers every new completion 503 with Retry-After (and /health 503
   "draining", so a load balancer stops sending), while the requests in
   flight go on;
2. waits until none is left, for at most --drain-timeout seconds (a second
   signal cuts the wait short);
3. stops the generation thread, which stores every RAM entry as
   `shutdown`; a request still in flight then ends with an error the client
   sees (an `error` event on a stream, which the OpenAI clients raise), never
   with a silent end;
4. exits 0 once the stores are on disk.

Drain counts the requests in flight and knows whether the server drains.
"""

import contextlib
import threading
import time

# How long the server waits for in-flight requests after the first signal.
DEFAULT_DRAIN_TIMEOUT_S = 30.0

# What a refused request is told: retry after this many seconds (a restart
# of a small model takes a few).
RETRY_AFTER_S = 5

# After the generation thread has stopped, how long the HTTP threads get to
# tell their clients (each notices within a second: mlx-lm polls its queue).
ABORT_GRACE_S = 5.0


class Drain:
    """The requests in flight and the draining flag, shared by the HTTP threads and the main thread."""

    def __init__(self):
        self._cond = threading.Condition()
        self.in_flight = 0
        self.draining = False
        self.stopping = False          # the generation thread was told to stop: answers still open are cut

    @contextlib.contextmanager
    def request(self):
        """Counts one request in flight for the duration of the block."""
        with self._cond:
            self.in_flight += 1
        try:
            yield
        finally:
            with self._cond:
                self.in_flight -= 1
                self._cond.notify_all()

    def start(self):
        """Starts draining: new requests are refused from now on."""
        with self._cond:
            self.draining = True
            self._cond.notify_all()

    def wait_idle(self, timeout, cancel=None):
        """Waits until no request is in flight, at most timeout seconds, or
        until cancel() is true; returns True when none is left."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self.in_flight:
                left = deadline - time.monotonic()
                if left <= 0 or (cancel is not None and cancel()):
                    return False
                self._cond.wait(min(left, 0.1))
        return True


__all__ = ["Drain", "DEFAULT_DRAIN_TIMEOUT_S", "RETRY_AFTER_S", "ABORT_GRACE_S"]
