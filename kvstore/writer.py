"""The background writer behind KVStore.save_async.

Saving must not stall a serving loop for longer than it takes to capture the
arrays, so saves queue here and one thread writes them in order.  The queue
is bounded: when the disk cannot keep up, save_async blocks (back-pressure)
instead of holding an unbounded number of KV caches in memory.
"""

import concurrent.futures
import logging
import os
import queue
import threading

log = logging.getLogger("kvstore")

# Each queued save holds a full copy of a KV state; four bounds the extra
# memory to a few checkpoints while letting a burst of waypoints queue up.
DEFAULT_QUEUE_SIZE = 4

_STOP = object()


class BackgroundWriter:
    """One daemon thread running submitted calls in order."""

    def __init__(self, maxsize=DEFAULT_QUEUE_SIZE, name="kvstore-writer"):
        self._q = queue.Queue(maxsize)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._closed = False
        self._lock = threading.Lock()
        self._thread.start()

    def submit(self, fn, *args, **kwargs):
        """Queues fn(*args, **kwargs); blocks while the queue is full.

        Returns:
            concurrent.futures.Future with fn's result or exception.
        """
        return self._put(True, fn, args, kwargs)

    def try_submit(self, fn, *args, **kwargs):
        """Queues fn(*args, **kwargs) unless the queue is full; never blocks.

        Returns:
            concurrent.futures.Future, or None when the queue was full.
        """
        return self._put(False, fn, args, kwargs)

    def _put(self, block, fn, args, kwargs):
        # Under the lock, so that nothing is queued after close()'s stop.
        with self._lock:
            if self._closed:
                raise RuntimeError("background writer is closed")
            fut = concurrent.futures.Future()
            try:
                self._q.put((fut, fn, args, kwargs), block=block)
            except queue.Full:
                return None
        return fut

    def flush(self):
        """Waits until every call queued so far has finished."""
        self._q.join()

    def close(self):
        """Finishes the queued calls and stops the thread."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._q.put(_STOP)
        self._thread.join()

    def _run(self):
        while True:
            item = self._q.get()
            try:
                if item is _STOP:
                    return
                fut, fn, args, kwargs = item
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(fn(*args, **kwargs))
                    except BaseException as e:  # delivered through the future
                        log.warning("kvstore: async_save_failed error=%s", type(e).__name__)
                        fut.set_exception(e)
            finally:
                self._q.task_done()


class ProcessWriter:
    """A store's BackgroundWriter in this process: made on first use, and
    made again in a forked child, which inherits the writer object but not
    its thread (the parent's writer is never flushed or closed there)."""

    def __init__(self):
        self._writer = None
        self._pid = None
        self._lock = threading.Lock()

    def get(self):
        """This process's writer, made if it has none."""
        with self._lock:
            if self._writer is None or self._pid != os.getpid():
                self._writer, self._pid = BackgroundWriter(), os.getpid()
            return self._writer

    def _own(self):
        """This process's writer, or None when it made none."""
        return self._writer if self._writer is not None and self._pid == os.getpid() else None

    def flush(self):
        """Waits for every queued call of this process's writer."""
        w = self._own()
        if w is not None:
            w.flush()

    def close(self):
        """Runs what is queued and stops this process's writer."""
        w = self._own()
        if w is not None:
            w.close()
