"""StepClock: the generation thread's batch steps, so that a store starts once the step in flight is done.

mlx-lm evaluates each batch step while it hands out the tokens of the one
before (async evaluation): when a request finishes, the step already in
flight still carries it.  With a long request in the batch that step is the
batch's slowest (at 8,192 tokens of Qwen3-8B's KV geometry on a 2-core CPU:
1.4 s against 0.12 s for the steps after it, stock mlx-lm the same), and a
store that starts at once competes with it for the CPU and the memory
bandwidth (it lengthened it by 0.25 s, about 18%).  The store of a
finished request therefore waits on its background writer until the
generation thread has completed that step (SETTLE_STEPS after the capture),
or has nothing to run, or SETTLE_WAIT_S has passed: a few tenths of a second
later on disk, the batch's own stall no longer for the store to lengthen.

The generation thread calls tick() after each batch step and idle() when it
waits for requests with no batch to run; deferred() wraps the writer's work.
"""

import threading

# Ticks after a capture before its store starts: the first comes as the
# generation thread finishes the step whose tokens it was handing out when it
# captured (the capture happens inside it), the second when the step that was
# in flight then is done.
SETTLE_STEPS = 2

# The longest a store waits for them (a long prefill chunk is one step).
SETTLE_WAIT_S = 5.0


class StepClock:
    """Counts the generation thread's completed batch steps; thread-safe."""

    def __init__(self):
        self._cond = threading.Condition()
        self._steps = 0
        self._idle = True

    @property
    def steps(self):
        """How many batch steps have completed."""
        with self._cond:
            return self._steps

    def tick(self):
        """A batch step completed (the generation thread)."""
        with self._cond:
            self._steps += 1
            self._idle = False
            self._cond.notify_all()

    def idle(self):
        """The generation thread has no batch to run until its next step (it waits for requests)."""
        with self._cond:
            self._idle = True
            self._cond.notify_all()

    def deferred(self, fn, steps=SETTLE_STEPS, timeout_s=SETTLE_WAIT_S):
        """fn, made to wait, wherever it later runs, until `steps` more steps
        than now have completed, the generation thread is idle, or timeout_s.

        Returns:
            a function taking fn's arguments and returning its result.
        """
        with self._cond:
            target = self._steps + steps

        def settled_then(*args, **kwargs):
            with self._cond:
                self._cond.wait_for(lambda: self._idle or self._steps >= target, timeout_s)
            return fn(*args, **kwargs)
        return settled_then
