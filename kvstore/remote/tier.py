"""RemoteTier: one bucket behind one KVStore (docs/remote.md §13).

A KVStore opened with ``remote="s3://bucket/prefix"`` keeps its local
directory as the first tier and the bucket as a second one behind it:

- the listing of the model's key prefix is the remote index: a background
  thread lists it every ``refresh_interval_s`` into ``length -> digests`` in
  memory, and the process adds its own uploads at once; the store searches
  it together with its local index in one SHA1 pass (kvstore.index), so a
  lookup never waits on the network;
- a fetch is parallel ranged GETs into a temporary file in the store
  directory, the checks of ``kvstore verify``, then the durable rename; a
  404, a short read or an object replaced between two ranges is a clean miss;
- after a local save the file is queued for upload (kvstore.remote.uploads);
- clients never delete objects: one janitor (kvstore.remote.janitor) does;
- a circuit breaker keeps a dead or hung remote from slowing anything local.

What this module leaves to the store: the local index, the eligibility rule
(passed in as a predicate), the budget and eviction of the local directory.
"""

import concurrent.futures
import logging
import os
import threading
import time

from kvstore import _native, policy
from kvstore.errors import CheckpointOSError, KVStoreError
from kvstore.files import short_name, verify_file
from kvstore.publish import TempFile
from kvstore.format import (CHAIN_RESTORABLE, PAYLOAD_ABI_CHAIN, PAYLOAD_ABI_TENSORS, PREFIX_SIZE, ExtFlag,
                            Reason, entry_from_fd)
from kvstore.reader import Match
from kvstore.remote.breaker import CircuitBreaker, Health
from kvstore.remote.index import RemoteIndex
from kvstore.remote.options import parse_key
from kvstore.remote.s3 import CONFLICT, MISSING, Bucket
from kvstore.remote.uploads import UploadQueue

log = logging.getLogger("kvstore")

# Fetch: the first GET takes the envelope and, for all but huge prompts, the
# whole text (eligibility is decided before the payload is asked for); the
# rest comes in ranges of FETCH_RANGE over fetch_threads connections.  Each
# range streams through a STREAM_CHUNK buffer, so a fetch holds
# fetch_threads * STREAM_CHUNK of memory whatever the checkpoint size.
HEAD_BYTES = 1 << 20
FETCH_RANGE = 16 << 20
STREAM_CHUNK = 1 << 20


class _ShortRead(Exception):
    """A ranged GET returned fewer bytes than asked for."""


def _total_size(resp, fallback):
    cr = resp.get("ContentRange") or ""
    _, _, total = cr.rpartition("/")
    return int(total) if total.isdigit() else fallback


def _stream_into(fd, body, offset, limit=None):
    """Writes a streaming body to fd at offset, STREAM_CHUNK at a time; returns bytes written."""
    got = 0
    try:
        while limit is None or got < limit:
            chunk = body.read(STREAM_CHUNK if limit is None else min(STREAM_CHUNK, limit - got))
            if not chunk:
                break
            _native.pwrite_from(fd, chunk, offset + got)
            got += len(chunk)
    finally:
        body.close()
    return got


class RemoteTier:
    """The bucket behind one KVStore: index, fetch, upload queue, breaker.

    KVStore creates it (``remote=``, ``remote_options=``) and calls: entry()
    for a remote lookup hit, fetch() to load one, enqueue() after a local
    save, close(); stats() adds the ``remote_*`` counters.  ``index`` is the
    remote half of the store's lookup (None while the breaker is open).

    Args:
        url: ``s3://bucket/prefix``.
        local_dir: the store directory (fetches land there).
        fingerprint: key_fingerprint(...) of the store.
        options: remote options; see KVStore.
        check: check(path, name) -> None or a one-line reason: how a file is
            checked before it is published or uploaded (the store's
            verify_file: a sealed store authenticates it); default
            kvstore.files.verify_file.
    """

    def __init__(self, url, local_dir, fingerprint, options=None, check=None):
        self.check = check if check is not None else verify_file
        self.bucket = Bucket(url, options)
        self.options = self.bucket.options
        self.url = url
        self.local_dir = local_dir
        self.fingerprint = fingerprint
        self.base = self.bucket.model_base(fingerprint)
        o = self.options
        self.breaker = CircuitBreaker(o["breaker_failures"], o["breaker_cooldown_s"])
        self.health = Health(self.breaker, self.bucket.name)
        self.index = RemoteIndex()
        self._pid = os.getpid()
        self._start()
        log.info("kvstore: remote_open bucket=%s prefix=%s fingerprint=%s", self.bucket.name,
                 self.bucket.prefix or "-", fingerprint)

    def _start(self):
        self._stop = threading.Event()
        self._list_lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(int(self.options["fetch_threads"]),
                                                           thread_name_prefix="kvstore-fetch")
        self.uploads = UploadQueue(self.bucket, self.fingerprint, self.index, self.health, self.options,
                                   start=bool(self.options["upload"]), check=self.check)
        self._thread = threading.Thread(target=self._refresh_loop, name="kvstore-remote-index", daemon=True)
        self._thread.start()

    def _check_fork(self):
        """A forked child gets neither the threads nor a usable connection pool: rebuild them."""
        if self._pid == os.getpid():
            return
        self._pid = os.getpid()
        self.bucket = Bucket(self.url, self.options)
        self.health = Health(self.breaker, self.bucket.name)
        self._start()

    @property
    def last_error(self):
        return self.health.last_error

    # -- index --------------------------------------------------------------

    def refresh(self):
        """Lists the model's prefix now (the background thread does this every interval).

        Returns:
            True when the listing completed.
        """
        self._check_fork()
        with self._list_lock:
            self.index.begin_listing()
            objects = {}
            try:
                for key, size, _ in self.bucket.list(self.base):
                    info = parse_key(key, self.base)
                    # (A block stores only its own text segment.)
                    if info is not None and size >= PREFIX_SIZE + (0 if info.is_block else info.text_bytes):
                        objects[info.sha] = (info, size)
            except Exception as e:          # noqa: BLE001 - classified and logged
                self.index.abort_listing()
                self.health.failed("list", e)
                return False
            self.index.finish_listing(objects)
        self.breaker.success()
        self.health.count(listings=1)
        return True

    def _refresh_loop(self):
        interval = float(self.options["refresh_interval_s"])
        wait = 0.0
        while not self._stop.wait(wait):
            if self.breaker.allow():
                try:
                    self.refresh()
                finally:
                    self.breaker.release()
            wait = interval if self.breaker.closed() else min(interval, max(0.05, self.breaker.wait_s()))

    def searchable(self):
        """The remote index when lookups may use it (breaker closed, something listed), else None."""
        return self.index if self.breaker.closed() and len(self.index) else None

    def entry(self, sha):
        """The kvstore.reader.Match of a remote lookup hit: ``path`` where it will land, ``remote`` its key.

        Only sha, text_bytes, file_size and (for a chain block) the parent are
        known until fetch() reads the header.
        """
        n, size = self.index.get(sha)
        info = self.index.info(sha)
        block = info is not None and info.is_block
        return Match(sha=sha, path=os.path.join(self.local_dir, sha + ".kv"), quant_bits=0,
                     reason=Reason.UNKNOWN, ext_flags=ExtFlag(0), model_id=0, tokens=0, hits=0,
                     ctx_size=0, payload_abi=PAYLOAD_ABI_CHAIN if block else PAYLOAD_ABI_TENSORS,
                     created_at=0, last_used=0, payload_bytes=0, text_bytes=n, file_size=size,
                     parent=info.parent if block else "", chain_flags=CHAIN_RESTORABLE if block else 0,
                     remote=self.bucket.key(self.fingerprint, sha, n, info.parent if block else None,
                                            info.restorable if block else True))

    # -- fetch --------------------------------------------------------------

    def fetch(self, entry, eligible, budget_bytes=0, durable=True, fits=None, have=None, published=None):
        """Copies a remote hit into the local directory; returns its local Entry or None.

        The object lands in a TempFile (0600; removed on any failure, and by
        the store's stale-file sweep after a crash), is checked like
        ``kvstore verify`` checks a file, then published (fsync, rename,
        directory fsync when durable).

        A miss (None) is clean: the object vanished (404), is shorter than
        listed (416, a short body), changed between two ranges (412 on
        If-Match), does not suit this store (eligible() said no: context,
        tokens, model), does not fit the budget, fails a check, the remote is
        unreachable, or the local disk failed.  Vanished and unusable objects
        leave the index.

        A chain block comes with every block of its chain this directory
        lacks (have(sha) says which it has): fetched in parallel, then
        checked and published parent first, so the directory never holds a
        block whose parent is missing (fits judges the ancestors, eligible
        the block itself).

        published: a list that gets the local Entry of every file published
        (a chain's blocks, parent first), for the caller's index.
        """
        self._check_fork()
        published = [] if published is None else published
        if entry.is_block:
            return self._fetch_chain(entry, eligible, fits or eligible, have or (lambda sha: False),
                                     budget_bytes, durable, published)
        sha = entry.sha
        if budget_bytes and not policy.file_size_fits(0, max(0, entry.file_size - PREFIX_SIZE), 0, budget_bytes):
            return self._miss(sha, "budget", drop=False, reject=True)
        if not self.breaker.closed():
            return self._miss(sha, "breaker_open", drop=False)
        t0 = time.perf_counter()
        final = os.path.join(self.local_dir, sha + ".kv")
        try:
            with TempFile(final) as tmp:
                if self._download(tmp, entry, eligible, budget_bytes) is None:
                    return None
                tmp.publish(durable)
                local = entry_from_fd(tmp.fd, os.fstat(tmp.fd), final)
                published.append(local)
        except OSError as e:                # the local disk (full, failing): a miss, not the remote's fault
            return self._local_failed(sha, e)
        dt = time.perf_counter() - t0
        self.health.count(hits=1, bytes_fetched=local.file_size, fetch_s=dt)
        log.info("kvstore: remote_hit tokens=%d text=%d bytes=%d fetch_ms=%.1f mb_s=%.0f file=%s",
                 local.tokens, local.text_bytes, local.file_size, dt * 1e3, local.file_size / 1e6 / max(dt, 1e-9),
                 short_name(sha))
        return local

    def _fetch_chain(self, entry, eligible, fits, have, budget_bytes, durable, published):
        shas = self.index.chain(entry.sha)
        if shas is None:
            return self._miss(entry.sha, "broken_chain", drop=False)
        missing = [self.entry(s) for s in shas if not have(s)]
        if not missing:
            return None
        need = sum(max(0, e.file_size - PREFIX_SIZE) for e in missing)
        if budget_bytes and not policy.file_size_fits(0, need, 0, budget_bytes):
            return self._miss(entry.sha, "budget", drop=False, reject=True)
        if not self.breaker.closed():
            return self._miss(entry.sha, "breaker_open", drop=False)
        t0 = time.perf_counter()
        tmps = []
        try:
            for e in missing:
                tmps.append(TempFile(os.path.join(self.local_dir, e.sha + ".kv")))

            def one(et):
                e, tmp = et
                check = eligible if e.sha == entry.sha else fits
                return self._download(tmp, e, check, budget_bytes, verify=False)
            with concurrent.futures.ThreadPoolExecutor(min(len(missing), int(self.options["fetch_threads"])),
                                                       thread_name_prefix="kvstore-fetch-chain") as ex:
                got = list(ex.map(one, zip(missing, tmps)))
            if any(g is None for g in got):
                return None
            local = None
            for e, tmp in zip(missing, tmps):       # parent first: a block's checks read its parents
                reason = self.check(tmp.path, name=e.sha + ".kv")
                if reason is not None:
                    log.warning("kvstore: remote_corrupt reason=%s file=%s", reason.split(":")[0], short_name(e.sha))
                    return self._miss(e.sha, "corrupt", reject=True)
                tmp.publish(durable, exclusive=True)   # (another process may have put it there first)
                local = entry_from_fd(tmp.fd, os.fstat(tmp.fd), tmp.final)
                published.append(local)
        except OSError as e:                # the local disk (full, failing): a miss, not the remote's fault
            return self._local_failed(entry.sha, e)
        finally:
            for tmp in tmps:
                tmp.close()
        dt = time.perf_counter() - t0
        nbytes = sum(e.file_size for e in missing)
        self.health.count(hits=1, bytes_fetched=nbytes, fetch_s=dt)
        log.info("kvstore: remote_hit tokens=%d text=%d blocks=%d bytes=%d fetch_ms=%.1f file=%s", local.tokens,
                 local.text_bytes, len(missing), nbytes, dt * 1e3, short_name(entry.sha))
        return local

    def _download(self, tmp, entry, eligible, budget_bytes, verify=True):
        """The object into the temporary file, checked; True, or None after recording the miss."""
        sha, key, fd = entry.sha, entry.remote, tmp.fd
        # A checkpoint of one range comes in one GET; a bigger one starts
        # with its envelope and text, so that eligibility is known before
        # the payload is asked for.
        first = entry.file_size if PREFIX_SIZE <= entry.file_size <= FETCH_RANGE else HEAD_BYTES
        try:
            r = self.bucket.get_range(key, 0, first)
            etag = r.get("ETag")
            size = _total_size(r, entry.file_size)
            got = _stream_into(fd, r["Body"], 0)
        except Exception as e:              # noqa: BLE001 - classified
            return self._fetch_failed(sha, e)
        if got < min(first, size):
            return self._miss(sha, "short")
        if budget_bytes and not policy.file_size_fits(0, max(0, size - PREFIX_SIZE), 0, budget_bytes):
            return self._miss(sha, "budget", reject=True)
        os.ftruncate(fd, size)
        try:
            local = entry_from_fd(fd, os.fstat(fd), tmp.final)
        except KVStoreError:
            return self._miss(sha, "corrupt", reject=True)
        if not eligible(local):
            return self._miss(sha, "not_eligible", reject=True)
        ranges = [(off, min(off + FETCH_RANGE, size)) for off in range(got, size, FETCH_RANGE)]
        jobs = [self._pool.submit(self._fetch_range, fd, key, a, b, etag) for a, b in ranges]
        failure = None
        for j in jobs:
            err = j.result()
            if err is not None and failure is None:
                failure = err
        if failure is not None:
            return self._fetch_failed(sha, failure)
        self.breaker.success()
        reason = self.check(tmp.path, name=sha + ".kv") if verify else None
        if reason is not None:
            log.warning("kvstore: remote_corrupt reason=%s file=%s", reason.split(":")[0], short_name(sha))
            return self._miss(sha, "corrupt", reject=True)
        return True

    def _local_failed(self, sha, exc):
        log.warning("kvstore: remote_miss reason=local_io errno=%s file=%s", getattr(exc, "errno", None),
                    short_name(sha))
        self.health.count(misses=1)
        return None

    def _fetch_range(self, fd, key, start, end, etag):
        """One ranged GET streamed into fd; returns None or the exception (or a short-read marker)."""
        try:
            r = self.bucket.get_range(key, start, end, if_match=etag)
            got = _stream_into(fd, r["Body"], start, end - start)
        except Exception as e:              # noqa: BLE001 - handed back to fetch()
            return e
        return None if got == end - start else _ShortRead()

    def _fetch_failed(self, sha, exc):
        if isinstance(exc, _ShortRead):
            return self._miss(sha, "short")
        if isinstance(exc, CheckpointOSError):      # writing the temporary file failed
            return self._local_failed(sha, exc)
        f = self.health.failed("fetch", exc, sha)
        if f.kind == MISSING:
            return self._miss(sha, "vanished")
        if f.kind == CONFLICT:
            return self._miss(sha, "changed")       # replaced between two ranges: list again
        return self._miss(sha, f.kind, drop=False)

    def _miss(self, sha, reason, drop=True, reject=False):
        if drop or reject:
            self.index.discard(sha, reject=reject)
        self.health.count(misses=1)
        log.info("kvstore: remote_miss reason=%s file=%s", reason, short_name(sha))
        return None

    # -- upload -------------------------------------------------------------

    def enqueue(self, entry):
        """Queues a local checkpoint for upload; never blocks (see UploadQueue)."""
        if not self.options["upload"] or not entry.sha or entry.sha in self.index:
            return
        self._check_fork()
        self.uploads.enqueue(entry)

    def upload(self, entry):
        """Uploads one local checkpoint now (entry: sha, path, text_bytes); see UploadQueue.upload."""
        self._check_fork()
        return self.uploads.upload(entry)

    def flush(self, timeout=None):
        """Waits until the upload queue is empty; returns False on timeout."""
        return self.uploads.flush(timeout)

    # -- stats, close -------------------------------------------------------

    def stats(self):
        """The ``remote_*`` counters that KVStore.stats() adds to its own."""
        s = self.health.counts()
        last = self.health.last_error
        return {
            "remote_objects": len(self.index),
            "remote_hits": s.get("hits", 0),
            "remote_misses": s.get("misses", 0),
            "remote_bytes_fetched": s.get("bytes_fetched", 0),
            "remote_fetch_s": s.get("fetch_s", 0.0),
            "remote_uploads": s.get("uploads", 0),
            "remote_upload_exists": s.get("upload_exists", 0),
            "remote_upload_bytes": s.get("upload_bytes", 0),
            "remote_upload_errors": s.get("upload_errors", 0),
            "remote_upload_dropped": s.get("upload_dropped", 0),
            "remote_queue": len(self.uploads),
            "remote_errors": s.get("errors", 0),
            "remote_denied": s.get("denied", 0),
            "remote_listings": s.get("listings", 0),
            "remote_listed_at": self.index.listed_at,
            "remote_breaker": self.breaker.state,
            "remote_breaker_opened": self.breaker.opened,
            "remote_last_error": None if last is None else f"{last.kind}:{last.code}",
        }

    def close(self, timeout=None):
        """Stops the threads, first giving queued uploads a bounded time to drain."""
        if self._pid != os.getpid():
            return
        timeout = float(self.options["close_timeout_s"]) if timeout is None else timeout
        if self.breaker.closed():
            self.flush(timeout)
        self._stop.set()
        left = self.uploads.stop()
        self._thread.join(timeout=0.2)
        self._pool.shutdown(wait=False)
        if left:
            log.warning("kvstore: remote_close pending_uploads=%d", left)
