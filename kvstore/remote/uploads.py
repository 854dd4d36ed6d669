"""The upload queue: local checkpoints go to the bucket on one background thread.

A save never waits for the network.  Each saved file is queued by name; one
thread uploads the oldest first with ``If-None-Match: *`` (a single PUT, or
multipart parts for big files), so that the first host to upload a
checkpoint wins and the others count it as already there.  While the
breaker is open the queue waits; when it is full the oldest item is dropped
with one log line (during a long outage the newest checkpoints are the
likeliest to be asked for).  See docs/remote.md §13.
"""

import collections
import dataclasses
import logging
import os
import threading
import time

from kvstore.errors import CheckpointMissing
from kvstore.files import READ_FLAGS, short_name, verify_file
from kvstore.remote.s3 import CONFLICT, UNAVAILABLE, classify

log = logging.getLogger("kvstore")

# The shortest wait of the upload thread while the breaker holds it back:
# a breaker that reports no wait left must not make the thread spin.
BREAKER_POLL_S = 0.05


@dataclasses.dataclass
class Upload:
    """One queued checkpoint: its digest, local path and text length; for a
    chain block its parent ("" for a first block) and whether it is
    restorable (parent None for a whole checkpoint)."""
    sha: str
    path: str
    text_bytes: int
    parent: str = None
    restorable: bool = True

    @classmethod
    def of(cls, entry):
        if entry.is_block:
            return cls(entry.sha, entry.path, entry.text_bytes, entry.parent, entry.restorable)
        return cls(entry.sha, entry.path, entry.text_bytes)


class _Exists(Exception):
    """The object is already in the bucket (found before a multipart upload)."""


class _LocalChanged(Exception):
    """The local file got shorter while it was uploaded (its trailer was rewritten)."""


def _pread_all(fd, n, offset):
    """n bytes of fd at offset (an upload body); _LocalChanged if the file got shorter."""
    data = os.pread(fd, n, offset)
    if len(data) != n:
        raise _LocalChanged(f"read_{len(data)}_of_{n}")
    return data


class UploadQueue:
    """A bounded queue of checkpoints to upload and the thread that uploads them.

    Args:
        bucket: the Bucket.
        fingerprint: the store's key fingerprint.
        index: the RemoteIndex (an uploaded object joins it at once).
        health: the tier's Health (counters, breaker).
        options: resolved remote options (upload_queue, part_size).
        start: start the upload thread (False: a read-only client, which
            may still call upload() itself).
    """

    def __init__(self, bucket, fingerprint, index, health, options, start=True, check=None):
        # check(path) -> None or a reason: files.verify_file, or a sealed
        # store's (which authenticates) -- nothing bad reaches the bucket.
        self.check = check if check is not None else verify_file
        self.bucket = bucket
        self.fingerprint = fingerprint
        self.index = index
        self.health = health
        self.breaker = health.breaker
        self.limit = int(options["upload_queue"])
        self.part_size = int(options["part_size"])
        self._queue = collections.deque()
        self._queued = set()
        self._cond = threading.Condition()
        self._busy = False
        self._stop = threading.Event()
        self._thread = None
        if start:
            self._thread = threading.Thread(target=self._loop, name="kvstore-remote-upload", daemon=True)
            self._thread.start()

    def __len__(self):
        with self._cond:
            return len(self._queue)

    def enqueue(self, entry):
        """Queues a local checkpoint; never blocks (a full queue drops its oldest item)."""
        dropped = None
        with self._cond:
            if entry.sha in self._queued:
                return
            if len(self._queue) >= self.limit:
                dropped = self._queue.popleft()
                self._queued.discard(dropped.sha)
            self._queue.append(Upload.of(entry))
            self._queued.add(entry.sha)
            self._cond.notify_all()
        if dropped is not None:
            self.health.count(upload_dropped=1)
            log.warning("kvstore: remote_upload_dropped reason=queue_full queue=%d file=%s",
                        self.limit, short_name(dropped.sha))

    def _loop(self):
        while True:
            with self._cond:
                while not self._queue and not self._stop.is_set():
                    self._cond.wait()
                if self._stop.is_set():
                    return
                item = self._queue[0]
                self._busy = True
            try:
                if not self.breaker.allow():
                    with self._cond:
                        self._busy = False
                        self._cond.notify_all()
                        self._wait_for_breaker()
                    continue
                done = self.upload(item)
            except Exception as e:          # noqa: BLE001 - a bug must not kill the thread
                log.warning("kvstore: remote_upload_failed kind=error code=%s file=%s", type(e).__name__,
                            short_name(item.sha))
                done = True
            finally:
                self.breaker.release()      # an upload skipped locally made no call
            with self._cond:
                self._busy = False
                if done and self._queue and self._queue[0] is item:
                    self._queue.popleft()
                    self._queued.discard(item.sha)
                self._cond.notify_all()
                if not done and not self._stop.is_set():
                    self._wait_for_breaker()

    def _wait_for_breaker(self):
        """Waits on the queue (its lock held) until the breaker may let a call
        through again, or an enqueue or stop wakes the thread."""
        self._cond.wait(max(BREAKER_POLL_S, self.breaker.wait_s()))

    def upload(self, item):
        """Uploads one queued checkpoint now.

        Returns:
            True when done with it (uploaded, already there, gone locally, or
            refused for good), False to keep it queued (the remote is down).
        """
        if not isinstance(item, Upload):
            item = Upload.of(item)
        key = self.bucket.key(self.fingerprint, item.sha, item.text_bytes, item.parent, item.restorable)
        t0 = time.perf_counter()
        # A corrupt file must not reach a tier that other hosts trust.  (A
        # save of the same text may replace the file between this check
        # and the open below: that file was checked as it was written.)
        try:
            reason = self.check(item.path)
            fd = os.open(item.path, READ_FLAGS)
        except (CheckpointMissing, FileNotFoundError):
            log.info("kvstore: remote_upload_skipped reason=gone file=%s", short_name(item.sha))
            return True
        except OSError as e:
            log.warning("kvstore: remote_upload_skipped reason=unreadable errno=%s file=%s", e.errno,
                        short_name(item.sha))
            return True
        try:
            if reason is not None:
                log.warning("kvstore: remote_upload_skipped reason=corrupt detail=%s file=%s",
                            reason.split(":")[0], short_name(item.sha))
                return True
            size = os.fstat(fd).st_size
            try:
                parts = self._put(key, fd, size)
            except _Exists:
                return self._uploaded(item, size, exists=True)
            except _LocalChanged as e:
                log.info("kvstore: remote_upload_skipped reason=changed detail=%s file=%s", e,
                         short_name(item.sha))
                return True
            except Exception as e:          # noqa: BLE001 - classified
                return self._failed(item, size, e)
        finally:
            os.close(fd)
        dt = time.perf_counter() - t0
        self.health.count(upload_bytes=size)
        log.info("kvstore: remote_uploaded bytes=%d parts=%d upload_ms=%.1f file=%s", size, parts, dt * 1e3,
                 short_name(item.sha))
        return self._uploaded(item, size, exists=False)

    def _put(self, key, fd, size):
        """Puts the size bytes of fd at key if no object is there: one PUT, or
        multipart parts of part_size for a bigger file.

        Returns:
            the number of parts sent.

        Raises:
            _Exists: found in the bucket before a multipart upload.
            _LocalChanged: the file got shorter meanwhile.
        """
        part = self.part_size
        if size <= part:
            self.bucket.put_if_absent(key, _pread_all(fd, size, 0))
            return 1
        if self.bucket.exists(key):
            raise _Exists()
        self.bucket.multipart_if_absent(key, size, lambda off, n: _pread_all(fd, n, off), part)
        return -(-size // part)

    def _failed(self, item, size, e):
        """What upload returns when putting item failed with e: True when done
        with it, False to keep it queued (the remote is down)."""
        if classify(e).kind == CONFLICT:     # If-None-Match: the same checkpoint is there
            return self._uploaded(item, size, exists=True)
        f = self.health.failed("upload", e, item.sha)
        if f.kind == UNAVAILABLE:
            return False
        self.health.count(upload_errors=1)
        return True

    def _uploaded(self, item, size, exists):
        self.breaker.success()
        self.index.add(item.sha, item.text_bytes, size, item.parent, item.restorable)
        if exists:
            self.health.count(upload_exists=1)
            log.info("kvstore: remote_upload_exists file=%s", short_name(item.sha))
        else:
            self.health.count(uploads=1)
        return True

    def flush(self, timeout=None):
        """Waits until the queue is empty; returns False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._queue or self._busy:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left if left is not None else 0.5)
        return True

    def stop(self):
        """Stops the thread after its current call; returns how many items were left."""
        with self._cond:
            left = len(self._queue)
            self._stop.set()
            self._queue.clear()
            self._queued.clear()
            self._cond.notify_all()
        # The thread ends after its current call; one stuck on a hung remote
        # ends at its read timeout, without holding up the caller.
        if self._thread is not None:
            self._thread.join(timeout=0.2)
        return left
