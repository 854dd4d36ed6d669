"""Thread pools made on first use, shut down at exit, made again in a forked child."""

import atexit
import os
import threading


class LazyExecutor:
    """A thread pool made by make() on first use and shut down at exit.

    A forked child inherits the object but none of its threads (work
    submitted to the parent's pool would wait forever): it makes its own.
    """

    def __init__(self, make):
        self._make = make
        self._pool = None
        self._lock = threading.Lock()
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=self._forget)

    def get(self):
        with self._lock:
            if self._pool is None:
                self._pool = self._make()
                atexit.register(self._pool.shutdown, wait=True)
            return self._pool

    def take(self):
        """The pool made so far (or None), forgotten: the next get() makes a new one."""
        with self._lock:
            old, self._pool = self._pool, None
        return old

    def _forget(self):
        self._pool = None
        self._lock = threading.Lock()
