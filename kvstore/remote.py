"""The remote tier: one bucket on any S3-compatible object store, shared by many hosts.

A KVStore opened with ``remote="s3://bucket/prefix"`` keeps its local
directory as the first tier and the bucket as a second one behind it:

- keys are ``<prefix>/v1/<model fingerprint>/<text length, 12 digits>/<sha1>.kv``
  and hold the very bytes of the local ``.kv`` file, so an object copied down
  is renamed into the local directory as is;
- the listing of the model's prefix is the index: a background thread lists
  it every ``refresh_interval_s`` (ListObjectsV2) into ``length -> digests``
  in memory, and the process adds its own uploads at once;
- lookup never waits on the network: one SHA1 pass over the prompt answers
  for the local and the remote lengths together, and a remote hit counts only
  when its text is longer than the best local one;
- a fetch is parallel ranged GETs into a temporary file in the store
  directory, the checks of ``kvstore verify`` (envelope, text hash, every
  payload CRC), then the store's durable rename; a 404, a short read or an
  object replaced between two ranges is a clean miss;
- after a local save the file is uploaded on a background thread with
  ``If-None-Match: *`` (single PUT, or multipart in 64 MiB parts); a 412
  means the same checkpoint is already there and counts as success;
- clients never delete objects: one janitor (``kvstore remote gc``) deletes
  by eviction score down to a budget, and readers take a vanished object as
  a miss;
- a circuit breaker keeps a dead or hung remote from slowing anything local:
  while it is open, lookups see only the local tier and uploads wait in a
  bounded queue (the oldest dropped, with one log line) until it closes.

What this module leaves to the store: the local index, the eligibility rules
(model, context, min_tokens), the budget and eviction of the local
directory.  boto3 is imported here only, and only when a bucket is opened:
``import kvstore`` works without it.  Credentials come from the standard AWS
chain (environment, shared credentials and config files, a profile, an
instance role); nothing in this project stores keys.
"""

import collections
import concurrent.futures
import dataclasses
import hashlib
import json
import logging
import os
import re
import secrets
import threading
import time

import numpy as np

from kvstore import _native, policy
from kvstore.errors import CheckpointMissing, CheckpointOSError, KVStoreError
from kvstore.format import (PAYLOAD_ABI_TENSORS, PREFIX_SIZE, Entry, ExtFlag, Header, Reason,
                            entry_from_fd)

log = logging.getLogger("kvstore")

# The key layout's version: a reader never mixes objects of two layouts.
LAYOUT = "v1"

# Upload: S3 caps a single PUT at 5 GiB and a multipart part at >= 5 MiB;
# 64 MiB parts (the choice) keep one part in memory at a time and
# a 1 GiB checkpoint at 16 requests.  Smaller files go in one PUT.
PART_SIZE = 64 << 20
MIN_PART_SIZE = 5 << 20

# Fetch: the first GET takes the envelope and, for all but huge prompts, the
# whole text (eligibility is decided before the payload is asked for); the
# rest comes in ranges of FETCH_RANGE over FETCH_THREADS connections.  Each
# range streams through a STREAM_CHUNK buffer, so a fetch holds
# FETCH_THREADS * STREAM_CHUNK of memory whatever the checkpoint size.
HEAD_BYTES = 1 << 20
FETCH_RANGE = 16 << 20
FETCH_THREADS = 4
STREAM_CHUNK = 1 << 20

# Timeouts: a connect on a LAN or to a region takes milliseconds; one
# second tells a dead host quickly.  A read may wait on a busy server.
CONNECT_TIMEOUT_S = 1.0
READ_TIMEOUT_S = 10.0
# boto3's own retries, per request (1 = no retry): the breaker, the upload
# queue and the next listing are the retry policy.
MAX_ATTEMPTS = 2

# The listing is the index; other hosts' uploads show up within this.
REFRESH_INTERVAL_S = 30.0

# Queued uploads hold only a file name; the bound keeps a long outage from
# growing the queue without end (the local files may be evicted anyway).
UPLOAD_QUEUE = 64

# Circuit breaker: this many consecutive network failures open it; it stays
# open for the cool-down, then lets one probe through; each failed probe
# doubles the cool-down up to the maximum.
BREAKER_FAILURES = 3
BREAKER_COOLDOWN_S = 5.0
BREAKER_MAX_COOLDOWN_S = 60.0

# gc: header reads in flight at once (52-byte GETs: latency-bound), and the
# age under which an object is kept (a host that listed it a moment ago may
# be about to fetch it; deleting it costs that host a miss, nothing worse).
GC_THREADS = 8
GC_MIN_AGE_S = 60.0

# close() gives queued uploads this long to drain (never while the breaker
# is open: a dead remote must not hold up a shutdown).
CLOSE_TIMEOUT_S = 10.0

_WRITE_FLAGS = (os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
                | getattr(os, "O_CLOEXEC", 0))
_READ_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)

_KEY_TAIL_RE = re.compile(r"^(\d{12})/([0-9a-f]{40})\.kv$")
_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.\-_]{1,254}$")

_OPTION_DEFAULTS = {
    "endpoint_url": None,           # None: AWS, or AWS_ENDPOINT_URL(_S3) / the profile's endpoint_url
    "region": None,                 # None: the credential chain's region (us-east-1 when unset)
    "profile": None,                # a profile of the shared AWS config/credentials files
    "session": None,                # a ready boto3.Session (its credentials, its region)
    "addressing_style": None,       # None: "path" with a custom endpoint, else "auto"
    "connect_timeout": CONNECT_TIMEOUT_S,
    "read_timeout": READ_TIMEOUT_S,
    "max_attempts": MAX_ATTEMPTS,
    "refresh_interval_s": REFRESH_INTERVAL_S,
    "upload_queue": UPLOAD_QUEUE,
    "fetch_threads": FETCH_THREADS,
    "part_size": PART_SIZE,
    "breaker_failures": BREAKER_FAILURES,
    "breaker_cooldown_s": BREAKER_COOLDOWN_S,
    "close_timeout_s": CLOSE_TIMEOUT_S,
    "upload": True,                 # False: a read-only client (no uploads queued)
}


class RemoteError(KVStoreError, OSError):
    """A remote-tier call failed in a way the caller must hear of (CLI, gc)."""


def _short(sha):
    return sha[:12] + "…kv"


# ---- addresses ------------------------------------------------------------------

def parse_url(url):
    """Splits ``s3://bucket/prefix`` into (bucket, prefix without slashes at the ends).

    Raises:
        ValueError: not an s3:// URL, or no valid bucket name.
    """
    if not isinstance(url, str) or not url.startswith("s3://"):
        raise ValueError(f"remote={url!r}: expected s3://bucket/prefix")
    bucket, _, prefix = url[len("s3://"):].partition("/")
    if not _BUCKET_RE.match(bucket):
        raise ValueError(f"remote={url!r}: {bucket!r} is not a bucket name")
    prefix = prefix.strip("/")
    if any(part in ("", ".", "..") for part in prefix.split("/")) and prefix:
        raise ValueError(f"remote={url!r}: the prefix has an empty, '.' or '..' segment")
    return bucket, prefix


def model_fingerprint(model_id=0, quant_bits=16, reject_different_quant=False, model_identity=None,
                      payload_abi=PAYLOAD_ABI_TENSORS):
    """The key segment that keeps one model's checkpoints apart from another's.

    It covers what must match for a checkpoint to be loadable at all: the
    header model id, the payload ABI, the engine's model identity string and
    the quant bits, the last only when the store makes quant part of the
    match (``reject_different_quant``), since otherwise a checkpoint of one
    quant is reused by another.  Context size and token counts are read from
    the header after the first GET, like the local tier does.

    Args:
        model_identity: a string naming the exact model (say the repository
            and revision, or a hash of its config and weights); two engines
            with the same identity must produce interchangeable KV states.

    Returns:
        32 lowercase hex digits.
    """
    parts = {"layout": LAYOUT, "model_id": int(model_id), "payload_abi": int(payload_abi),
             "quant_bits": int(quant_bits) if reject_different_quant else None,
             "model_identity": "" if model_identity is None else str(model_identity)}
    raw = json.dumps(parts, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(raw).hexdigest()[:32]


def layout_prefix(prefix):
    """``<prefix>/v1/`` (or ``v1/`` for an empty prefix): where every fingerprint lives."""
    return f"{prefix}/{LAYOUT}/" if prefix else f"{LAYOUT}/"


def object_key(prefix, fingerprint, sha, text_bytes):
    """``<prefix>/v1/<fingerprint>/<text length, 12 digits>/<sha1>.kv``."""
    return f"{layout_prefix(prefix)}{fingerprint}/{int(text_bytes):012d}/{sha}.kv"


def parse_key(key, base):
    """(text length, sha) of a key under base (``.../<fingerprint>/``), or None."""
    if not key.startswith(base):
        return None
    m = _KEY_TAIL_RE.match(key[len(base):])
    return (int(m.group(1)), m.group(2)) if m else None


def resolve_options(options):
    """The remote options with defaults filled in; ValueError names unknown keys."""
    options = dict(options or {})
    unknown = sorted(set(options) - set(_OPTION_DEFAULTS))
    if unknown:
        raise ValueError(f"remote_options: unknown key(s) {', '.join(unknown)}; "
                         f"known: {', '.join(sorted(_OPTION_DEFAULTS))}")
    out = {**_OPTION_DEFAULTS, **{k: v for k, v in options.items() if v is not None}}
    if out["part_size"] < MIN_PART_SIZE:
        raise ValueError(f"remote_options: part_size={out['part_size']} is under S3's "
                         f"minimum part of {MIN_PART_SIZE} bytes")
    for k in ("upload_queue", "fetch_threads", "breaker_failures", "max_attempts"):
        if int(out[k]) < 1:
            raise ValueError(f"remote_options: {k}={out[k]!r} must be >= 1")
    return out


# ---- errors ----------------------------------------------------------------------

# What a failed call means for the caller:
UNAVAILABLE = "unavailable"   # network, timeout, 5xx, throttling: the breaker counts it, retry later
DENIED = "denied"             # credentials or permissions: retrying does not help; logged
MISSING = "missing"           # 404 / 416: the object is gone or shorter than listed
CONFLICT = "conflict"         # 412: the precondition (If-None-Match / If-Match) failed
ERROR = "error"               # anything else the server refused (a missing bucket, a bad request)

_DENIED_CODES = frozenset({"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch",
                           "InvalidToken", "ExpiredToken", "TokenRefreshRequired", "AllAccessDisabled",
                           "AccountProblem", "InvalidSecurity", "Forbidden", "Unauthorized"})
_BUSY_CODES = frozenset({"SlowDown", "RequestTimeout", "ServiceUnavailable", "InternalError",
                         "RequestTimeTooSkewed", "ConditionalRequestConflict", "OperationAborted"})


@dataclasses.dataclass(frozen=True)
class Failure:
    """A failed remote call, classified: kind (one of the constants above), code, HTTP status."""
    kind: str
    code: str
    status: int = 0

    def fields(self):
        return f"kind={self.kind} code={self.code} status={self.status}"


def classify(exc):
    """The Failure that a boto3/botocore exception (or an OSError) stands for."""
    try:
        from botocore import exceptions as bx
    except ImportError:                     # pragma: no cover - only with boto3 gone mid-run
        bx = None
    if bx is not None and isinstance(exc, bx.ClientError):
        err = exc.response.get("Error", {}) or {}
        code = str(err.get("Code") or "?")
        status = int((exc.response.get("ResponseMetadata", {}) or {}).get("HTTPStatusCode") or 0)
        if code == "NoSuchBucket":
            return Failure(ERROR, code, status)
        if status == 412 or code == "PreconditionFailed":
            return Failure(CONFLICT, code, status)
        if status in (404, 416) or code in ("NoSuchKey", "NotFound", "InvalidRange"):
            return Failure(MISSING, code, status)
        if status in (401, 403) or code in _DENIED_CODES:
            return Failure(DENIED, code, status)
        if status >= 500 or status in (409, 429) or code in _BUSY_CODES:
            return Failure(UNAVAILABLE, code, status)
        return Failure(ERROR, code, status)
    if bx is not None and isinstance(exc, (bx.NoCredentialsError, bx.PartialCredentialsError,
                                           bx.ProfileNotFound, bx.NoRegionError)):
        return Failure(DENIED, type(exc).__name__)
    if bx is not None and isinstance(exc, bx.ParamValidationError):
        return Failure(ERROR, type(exc).__name__)
    if bx is not None and isinstance(exc, bx.BotoCoreError):
        return Failure(UNAVAILABLE, type(exc).__name__)
    if isinstance(exc, (OSError, TimeoutError)):
        return Failure(UNAVAILABLE, type(exc).__name__)
    return Failure(ERROR, type(exc).__name__)


# ---- the bucket -------------------------------------------------------------------

class Bucket:
    """The handful of S3 calls kvstore makes, on one thread-safe boto3 client.

    Args:
        url: ``s3://bucket/prefix``.
        options: remote options (see KVStore; resolve_options fills defaults).
    """

    def __init__(self, url, options=None):
        self.url = url
        self.name, self.prefix = parse_url(url)
        self.options = resolve_options(options)
        self.client = self._make_client()
        self._if_none_match = self._supports("PutObject", "IfNoneMatch") and \
            self._supports("CompleteMultipartUpload", "IfNoneMatch")
        if not self._if_none_match:
            # A botocore older than S3's conditional writes (August 2024) has
            # no IfNoneMatch parameter: send the header itself.
            for op in ("PutObject", "CompleteMultipartUpload"):
                self.client.meta.events.register(f"before-sign.s3.{op}", _add_if_none_match)

    def _make_client(self):
        try:
            import boto3
            from botocore.config import Config
        except ImportError:
            raise ImportError("the remote tier needs boto3: pip install 'kvstore[s3]'") from None
        o = self.options
        session = o["session"] or boto3.session.Session(profile_name=o["profile"])
        endpoint = o["endpoint_url"]
        style = o["addressing_style"]
        if style is None:
            custom = endpoint or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
            style = "path" if custom else "auto"
        threads = int(o["fetch_threads"])
        config = Config(connect_timeout=float(o["connect_timeout"]), read_timeout=float(o["read_timeout"]),
                        retries={"max_attempts": int(o["max_attempts"]), "mode": "standard"},
                        max_pool_connections=threads + 4, s3={"addressing_style": style})
        region = o["region"] or session.region_name or "us-east-1"
        return session.client("s3", endpoint_url=endpoint, region_name=region, config=config)

    def _supports(self, operation, member):
        try:
            return member in self.client.meta.service_model.operation_model(operation).input_shape.members
        except Exception:                   # noqa: BLE001 - an odd model: use the header hook
            return False

    def key(self, fingerprint, sha, text_bytes):
        return object_key(self.prefix, fingerprint, sha, text_bytes)

    def model_base(self, fingerprint):
        return f"{layout_prefix(self.prefix)}{fingerprint}/"

    def list(self, prefix):
        """Yields (key, size, last-modified unix seconds) under prefix, every page."""
        paginator = self.client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self.name, Prefix=prefix):
            for o in page.get("Contents", ()) or ():
                yield o["Key"], int(o["Size"]), o["LastModified"].timestamp()

    def get_range(self, key, start, end, if_match=None):
        """GET bytes [start, end) of key; returns the response (Body streams)."""
        kw = {"IfMatch": if_match} if if_match else {}
        return self.client.get_object(Bucket=self.name, Key=key, Range=f"bytes={start}-{end - 1}", **kw)

    def put_if_absent(self, key, body):
        kw = {"IfNoneMatch": "*"} if self._if_none_match else {}
        self.client.put_object(Bucket=self.name, Key=key, Body=body, **kw)

    def multipart_if_absent(self, key, size, read_part, part_size):
        """Uploads size bytes in parts (read_part(offset, n) -> bytes); aborts on any failure."""
        upload_id = self.client.create_multipart_upload(Bucket=self.name, Key=key)["UploadId"]
        try:
            parts = []
            for i, off in enumerate(range(0, size, part_size), 1):
                body = read_part(off, min(part_size, size - off))
                r = self.client.upload_part(Bucket=self.name, Key=key, UploadId=upload_id, PartNumber=i,
                                            Body=body)
                parts.append({"PartNumber": i, "ETag": r["ETag"]})
                del body
            kw = {"IfNoneMatch": "*"} if self._if_none_match else {}
            self.client.complete_multipart_upload(Bucket=self.name, Key=key, UploadId=upload_id,
                                                  MultipartUpload={"Parts": parts}, **kw)
        except BaseException:
            try:
                self.client.abort_multipart_upload(Bucket=self.name, Key=key, UploadId=upload_id)
            except Exception as e:          # noqa: BLE001 - the first error is the one to report
                log.warning("kvstore: remote_abort_failed %s upload=%s", classify(e).fields(), upload_id[:16])
            raise

    def exists(self, key):
        try:
            self.client.head_object(Bucket=self.name, Key=key)
            return True
        except Exception as e:              # noqa: BLE001 - classified
            if classify(e).kind == MISSING:
                return False
            raise

    def delete(self, keys):
        """Deletes keys (1000 a request); returns the keys the server reported as failed."""
        failed = []
        keys = list(keys)
        for i in range(0, len(keys), 1000):
            batch = keys[i:i + 1000]
            r = self.client.delete_objects(Bucket=self.name,
                                           Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True})
            failed += [e.get("Key") for e in r.get("Errors", ()) or ()]
        return failed


def _add_if_none_match(request, **_):
    request.headers["If-None-Match"] = "*"


# ---- circuit breaker ----------------------------------------------------------------

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
            fails, cooldown = self._fails, self._cooldown
        log.warning("kvstore: remote_breaker state=open failures=%d cooldown_s=%.1f", fails, cooldown)


# ---- the in-memory index of the bucket ---------------------------------------------

class RemoteIndex:
    """The model's objects as the last listing (plus this process's uploads) saw them.

    Lookups read one immutable snapshot (shas sorted by text length, their
    lengths, their digests joined), replaced whole on every change, so a
    lookup takes no lock.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._objects = {}          # sha -> (text length, size)
        self._rejected = set()      # shas this process found unusable (not eligible, corrupt)
        self._listing = False
        self._added = {}            # during a listing: objects added meanwhile
        self._dropped = set()       # during a listing: objects found gone meanwhile
        self.generation = 0
        self.listed_at = None       # time.time() of the last complete listing
        self.snapshot = ((), np.zeros(0, dtype=np.uint64), b"")

    def __len__(self):
        return len(self._objects)

    def __contains__(self, sha):
        return sha in self._objects

    def get(self, sha):
        """(text length, object size) of a listed object; (0, 0) if unknown."""
        return self._objects.get(sha, (0, 0))

    def text_bytes(self, sha):
        return self._objects.get(sha, (0, 0))[0]

    def begin_listing(self):
        with self._lock:
            self._listing = True
            self._added, self._dropped = {}, set()

    def finish_listing(self, objects):
        """Replaces the index with a complete listing, keeping what changed meanwhile."""
        with self._lock:
            objects = dict(objects)
            objects.update(self._added)
            for sha in self._dropped:
                objects.pop(sha, None)
            self._listing = False
            changed = objects != self._objects
            self._objects = objects
            self.listed_at = time.time()
            if changed:
                self._rebuild()

    def abort_listing(self):
        with self._lock:
            self._listing = False

    def add(self, sha, text_bytes, size):
        with self._lock:
            if self._listing:
                self._added[sha] = (text_bytes, size)
                self._dropped.discard(sha)
            if self._objects.get(sha) != (text_bytes, size):
                self._objects[sha] = (text_bytes, size)
                self._rebuild()

    def discard(self, sha, reject=False):
        with self._lock:
            if reject:
                self._rejected.add(sha)
            if self._listing:
                self._dropped.add(sha)
                self._added.pop(sha, None)
            if self._objects.pop(sha, None) is not None or reject:
                self._rebuild()

    def _rebuild(self):
        live = sorted(((n, sha) for sha, (n, _) in self._objects.items() if sha not in self._rejected))
        shas = tuple(sha for _, sha in live)
        lengths = np.fromiter((n for n, _ in live), dtype=np.uint64, count=len(live))
        digests = b"".join(bytes.fromhex(sha) for sha in shas)
        self.snapshot = (shas, lengths, digests)
        self.generation += 1


# ---- the tier ------------------------------------------------------------------------

@dataclasses.dataclass
class _Upload:
    sha: str
    path: str
    text_bytes: int


class RemoteTier:
    """The bucket behind one KVStore: index, lookup, fetch, upload queue, breaker.

    KVStore creates it (``remote=``, ``remote_options=``) and calls four
    hooks: longest_prefix (find), fetch (load of a remote hit), enqueue
    (after a local save) and close; stats() adds the ``remote_*`` counters.

    Args:
        url: ``s3://bucket/prefix``.
        local_dir: the store directory (fetches land there).
        fingerprint: model_fingerprint(...) of the store.
        options: remote options; see KVStore.
    """

    def __init__(self, url, local_dir, fingerprint, options=None):
        self.bucket = Bucket(url, options)
        self.options = self.bucket.options
        self.url = url
        self.local_dir = local_dir
        self.fingerprint = fingerprint
        self.base = self.bucket.model_base(fingerprint)
        o = self.options
        self.breaker = CircuitBreaker(o["breaker_failures"], o["breaker_cooldown_s"])
        self.index = RemoteIndex()
        self._stats = collections.Counter()
        self._stats_lock = threading.Lock()
        self.last_error = None
        self._merged_key = None
        self._merged = None
        self._queue = collections.deque()
        self._queued = set()
        self._cond = threading.Condition()
        self._busy = False
        self._stop = threading.Event()
        self._list_lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(int(o["fetch_threads"]),
                                                           thread_name_prefix="kvstore-fetch")
        self._pid = os.getpid()
        self._threads = []
        self._start_threads()
        log.info("kvstore: remote_open bucket=%s prefix=%s fingerprint=%s", self.bucket.name,
                 self.bucket.prefix or "-", fingerprint)

    def _start_threads(self):
        self._threads = [threading.Thread(target=self._refresh_loop, name="kvstore-remote-index", daemon=True)]
        if self.options["upload"]:
            self._threads.append(threading.Thread(target=self._upload_loop, name="kvstore-remote-upload",
                                                  daemon=True))
        for t in self._threads:
            t.start()

    def _check_fork(self):
        """A forked child gets neither the threads nor a usable connection pool: rebuild them."""
        if self._pid == os.getpid():
            return
        self._pid = os.getpid()
        self.bucket = Bucket(self.url, self.options)
        self._cond = threading.Condition()
        self._queue, self._queued, self._busy = collections.deque(), set(), False
        self._stop = threading.Event()
        self._stats_lock = threading.Lock()
        self._list_lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(int(self.options["fetch_threads"]),
                                                           thread_name_prefix="kvstore-fetch")
        self._start_threads()

    def _count(self, **kv):
        with self._stats_lock:
            self._stats.update(kv)

    def _failed(self, what, exc, sha=None):
        """Logs a failed call (one key=value line) and feeds the breaker; returns the Failure."""
        f = classify(exc)
        self.last_error = f
        if f.kind == UNAVAILABLE:
            self._count(errors=1)
            self.breaker.failure()
        else:
            # The server answered (a refusal is an answer): it is reachable.
            self.breaker.success()
            if f.kind == DENIED:
                self._count(denied=1)
            elif f.kind == ERROR:
                self._count(errors=1)
        where = f" file={_short(sha)}" if sha else f" bucket={self.bucket.name}"
        level = logging.INFO if f.kind in (MISSING, CONFLICT) else logging.WARNING
        log.log(level, "kvstore: remote_%s_failed %s%s", what, f.fields(), where)
        return f

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
                    parsed = parse_key(key, self.base)
                    if parsed is not None and size >= PREFIX_SIZE + parsed[0]:
                        objects[parsed[1]] = (parsed[0], size)
            except Exception as e:          # noqa: BLE001 - classified and logged
                self.index.abort_listing()
                self._failed("list", e)
                return False
            self.index.finish_listing(objects)
        self.breaker.success()
        self._count(listings=1)
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

    # -- lookup -------------------------------------------------------------

    def longest_prefix(self, data, local_index):
        """The longest hit of either tier; a remote one only when strictly longer.

        Called by KVStore.find under the store lock.  One SHA1 pass over the
        prompt serves both tiers: the local and the remote lengths are merged
        into one sorted array (rebuilt only when either index changed).  No
        network call is made.

        Returns:
            a local Entry, a remote Entry (``entry.remote`` is its key), or None.
        """
        if not self.breaker.closed() or not len(self.index):
            return local_index.longest_prefix(data)
        key = (id(local_index), local_index.generation, self.index.generation)
        if self._merged_key != key:
            self._merged = self._merge(local_index.lookup_arrays(), self.index.snapshot)
            self._merged_key = key
        owners, lengths, digests = self._merged
        n = int(np.searchsorted(lengths, len(data), side="right"))
        if n == 0:
            return None
        matches = _native.sha1_prefix_matches(data, lengths[:n], memoryview(digests)[:20 * n])
        local = remote = None
        for i in reversed(matches):
            o = owners[i]
            if isinstance(o, Entry):
                local = o
                break
            if remote is None:
                remote = o
        # The scan met the remote match first, so it is at least as long;
        # at equal length the local file wins (no transfer needed).
        if remote is not None and (local is None or self.index.text_bytes(remote) > local.text_bytes):
            return self._remote_entry(remote)
        return local

    @staticmethod
    def _merge(local, remote):
        l_entries, l_lengths, l_digests = local
        r_shas, r_lengths, r_digests = remote
        lengths = np.concatenate([l_lengths, r_lengths]).astype(np.uint64, copy=False)
        # Stable: at equal lengths local entries stay first (and in their
        # order: fewer tokens first), so the scan from the end meets the
        # remote one first and the best local one next.
        order = np.argsort(lengths, kind="stable")
        owners = [*l_entries, *r_shas]
        digests = np.frombuffer(bytes(l_digests) + bytes(r_digests), dtype=np.uint8).reshape(-1, 20)
        return [owners[i] for i in order.tolist()], lengths[order], digests[order].tobytes()

    def _remote_entry(self, sha):
        n, size = self.index.get(sha)
        return Entry(sha=sha, path=os.path.join(self.local_dir, sha + ".kv"), quant_bits=0,
                     reason=Reason.UNKNOWN, ext_flags=ExtFlag(0), model_id=0, tokens=0, hits=0,
                     ctx_size=0, payload_abi=PAYLOAD_ABI_TENSORS, created_at=0, last_used=0,
                     payload_bytes=0, text_bytes=n, file_size=size,
                     remote=self.bucket.key(self.fingerprint, sha, n))

    # -- fetch --------------------------------------------------------------

    def fetch(self, entry, eligible, budget_bytes=0, durable=True):
        """Copies a remote hit into the local directory; returns its local Entry or None.

        The object lands in ``<sha>.kv.tmp.<pid>.<random>`` (0600; removed on
        any failure, and by the store's stale-file sweep after a crash), is
        checked like ``kvstore verify`` checks a file, then fsync'd and
        renamed into place (and the directory fsync'd) when durable.

        A miss (None) is clean: the object vanished (404), is shorter than
        listed (416, a short body), changed between two ranges (412 on
        If-Match), does not suit this store (eligible() said no: context,
        tokens, model), does not fit the budget, fails a check, the remote is
        unreachable, or the local disk failed.  Vanished and unusable objects
        leave the index.
        """
        self._check_fork()
        sha = entry.sha
        if budget_bytes and not policy.file_size_fits(0, max(0, entry.file_size - PREFIX_SIZE), 0, budget_bytes):
            return self._miss(sha, "budget", drop=False, reject=True)
        if not self.breaker.closed():
            return self._miss(sha, "breaker_open", drop=False)
        t0 = time.perf_counter()
        final = os.path.join(self.local_dir, sha + ".kv")
        tmp = f"{final}.tmp.{os.getpid()}.{secrets.token_hex(4)}"
        try:
            fd = os.open(tmp, _WRITE_FLAGS, 0o600)
        except OSError as e:
            return self._local_failed(sha, e)
        published = False
        try:
            got = self._download(fd, tmp, entry, eligible, budget_bytes)
            if got is None:
                return None
            if durable:
                os.fsync(fd)
            os.rename(tmp, final)
            published = True
            if durable:
                from kvstore.store import _fsync_dir
                _fsync_dir(self.local_dir)
            local = entry_from_fd(fd, os.fstat(fd), final)
        except OSError as e:                # the local disk (full, failing): a miss, not the remote's fault
            return self._local_failed(sha, e)
        finally:
            os.close(fd)
            if not published:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
        dt = time.perf_counter() - t0
        self._count(hits=1, bytes_fetched=local.file_size)
        with self._stats_lock:
            self._stats["fetch_s"] += dt
        log.info("kvstore: remote_hit tokens=%d text=%d bytes=%d fetch_ms=%.1f mb_s=%.0f file=%s",
                 local.tokens, local.text_bytes, local.file_size, dt * 1e3, local.file_size / 1e6 / max(dt, 1e-9),
                 _short(sha))
        return local

    def _download(self, fd, tmp, entry, eligible, budget_bytes):
        """The object into fd, checked; True, or None after recording the miss."""
        from kvstore.store import verify_file      # the store imports this module lazily
        sha, key = entry.sha, entry.remote
        os.fchmod(fd, 0o600)
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
            local = entry_from_fd(fd, os.fstat(fd), os.path.join(self.local_dir, sha + ".kv"))
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
        reason = verify_file(tmp, name=sha + ".kv")
        if reason is not None:
            log.warning("kvstore: remote_corrupt reason=%s file=%s", reason.split(":")[0], _short(sha))
            return self._miss(sha, "corrupt", reject=True)
        return True

    def _local_failed(self, sha, exc):
        log.warning("kvstore: remote_miss reason=local_io errno=%s file=%s", getattr(exc, "errno", None),
                    _short(sha))
        self._count(misses=1)
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
        f = self._failed("fetch", exc, sha)
        if f.kind == MISSING:
            return self._miss(sha, "vanished")
        if f.kind == CONFLICT:
            return self._miss(sha, "changed")       # replaced between two ranges: list again
        return self._miss(sha, f.kind, drop=False)

    def _miss(self, sha, reason, drop=True, reject=False):
        if drop or reject:
            self.index.discard(sha, reject=reject)
        self._count(misses=1)
        log.info("kvstore: remote_miss reason=%s file=%s", reason, _short(sha))
        return None

    # -- upload -------------------------------------------------------------

    def enqueue(self, entry):
        """Queues a local checkpoint for upload; never blocks.

        A full queue drops its oldest item (one log line): during a long
        outage the newest checkpoints are the likeliest to be asked for.
        """
        if not self.options["upload"] or not entry.sha or entry.sha in self.index:
            return
        self._check_fork()
        dropped = None
        with self._cond:
            if entry.sha in self._queued:
                return
            if len(self._queue) >= int(self.options["upload_queue"]):
                dropped = self._queue.popleft()
                self._queued.discard(dropped.sha)
            self._queue.append(_Upload(entry.sha, entry.path, entry.text_bytes))
            self._queued.add(entry.sha)
            self._cond.notify_all()
        if dropped is not None:
            self._count(upload_dropped=1)
            log.warning("kvstore: remote_upload_dropped reason=queue_full queue=%d file=%s",
                        int(self.options["upload_queue"]), _short(dropped.sha))

    def _upload_loop(self):
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
                        self._cond.wait(max(0.05, self.breaker.wait_s()))
                    continue
                done = self.upload(item)
            except Exception as e:          # noqa: BLE001 - a bug must not kill the thread
                log.warning("kvstore: remote_upload_failed kind=error code=%s file=%s", type(e).__name__,
                            _short(item.sha))
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
                    self._cond.wait(max(0.05, self.breaker.wait_s()))

    def upload(self, item):
        """Uploads one queued checkpoint now.

        Returns:
            True when done with it (uploaded, already there, gone locally, or
            refused for good), False to keep it queued (the remote is down).
        """
        from kvstore.store import verify_file      # the store imports this module lazily
        key = self.bucket.key(self.fingerprint, item.sha, item.text_bytes)
        t0 = time.perf_counter()
        # A corrupt file must not reach a tier that other hosts trust.  (A
        # save of the same text may replace the file between this check
        # and the open below: that file was checked as it was written.)
        try:
            reason = verify_file(item.path)
            fd = os.open(item.path, _READ_FLAGS)
        except (CheckpointMissing, FileNotFoundError):
            log.info("kvstore: remote_upload_skipped reason=gone file=%s", _short(item.sha))
            return True
        except OSError as e:
            log.warning("kvstore: remote_upload_skipped reason=unreadable errno=%s file=%s", e.errno,
                        _short(item.sha))
            return True
        try:
            if reason is not None:
                log.warning("kvstore: remote_upload_skipped reason=corrupt detail=%s file=%s",
                            reason.split(":")[0], _short(item.sha))
                return True
            size = os.fstat(fd).st_size
            part = int(self.options["part_size"])
            try:
                if size <= part:
                    self.bucket.put_if_absent(key, _pread_all(fd, size, 0))
                    parts = 1
                else:
                    if self.bucket.exists(key):
                        raise _Exists()
                    self.bucket.multipart_if_absent(key, size, lambda off, n: _pread_all(fd, n, off), part)
                    parts = -(-size // part)
            except _Exists:
                return self._uploaded(item, size, exists=True)
            except _LocalChanged as e:
                log.info("kvstore: remote_upload_skipped reason=changed detail=%s file=%s", e, _short(item.sha))
                return True
            except Exception as e:          # noqa: BLE001 - classified
                if classify(e).kind == CONFLICT:     # If-None-Match: the same checkpoint is there
                    return self._uploaded(item, size, exists=True)
                f = self._failed("upload", e, item.sha)
                if f.kind == UNAVAILABLE:
                    return False
                self._count(upload_errors=1)
                return True
        finally:
            os.close(fd)
        dt = time.perf_counter() - t0
        self._count(upload_bytes=size)
        log.info("kvstore: remote_uploaded bytes=%d parts=%d upload_ms=%.1f file=%s", size, parts, dt * 1e3,
                 _short(item.sha))
        return self._uploaded(item, size, exists=False)

    def _uploaded(self, item, size, exists):
        self.breaker.success()
        self.index.add(item.sha, item.text_bytes, size)
        if exists:
            self._count(upload_exists=1)
            log.info("kvstore: remote_upload_exists file=%s", _short(item.sha))
        else:
            self._count(uploads=1)
        return True

    def flush(self, timeout=None):
        """Waits until the upload queue is empty; returns False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._queue or self._busy:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left if left is not None else 0.5)
        return True

    # -- stats, close -------------------------------------------------------

    def stats(self):
        """The ``remote_*`` counters that KVStore.stats() adds to its own."""
        with self._stats_lock:
            s = dict(self._stats)
        with self._cond:
            queued = len(self._queue)
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
            "remote_queue": queued,
            "remote_errors": s.get("errors", 0),
            "remote_denied": s.get("denied", 0),
            "remote_listings": s.get("listings", 0),
            "remote_listed_at": self.index.listed_at,
            "remote_breaker": self.breaker.state,
            "remote_breaker_opened": self.breaker.opened,
            "remote_last_error": None if self.last_error is None else
            f"{self.last_error.kind}:{self.last_error.code}",
        }

    def close(self, timeout=None):
        """Stops the threads, first giving queued uploads a bounded time to drain."""
        if self._pid != os.getpid():
            return
        timeout = float(self.options["close_timeout_s"]) if timeout is None else timeout
        if self.breaker.closed():
            self.flush(timeout)
        with self._cond:
            left = len(self._queue)
            self._stop.set()
            self._queue.clear()
            self._queued.clear()
            self._cond.notify_all()
        # The threads end after their current call; one stuck on a hung
        # remote ends at its read timeout, without holding up the caller.
        for t in self._threads:
            t.join(timeout=0.2)
        self._pool.shutdown(wait=False)
        if left:
            log.warning("kvstore: remote_close pending_uploads=%d", left)


class _Exists(Exception):
    """The object is already in the bucket (found before a multipart upload)."""


class _LocalChanged(Exception):
    """The local file got shorter while it was uploaded (its trailer was rewritten)."""


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


def _pread_all(fd, n, offset):
    """n bytes of fd at offset (an upload body); OSError if the file got shorter."""
    data = os.pread(fd, n, offset)
    if len(data) != n:
        raise _LocalChanged(f"read_{len(data)}_of_{n}")
    return data


# ---- listing and gc (the janitor) --------------------------------------------------

@dataclasses.dataclass(frozen=True)
class RemoteObject:
    """One object of the bucket as `kvstore ls --remote` and gc see it."""
    key: str
    fingerprint: str
    sha: str
    text_bytes: int
    size: int
    modified: float


def list_objects(bucket):
    """Every checkpoint object under the bucket's layout prefix, every model."""
    base = layout_prefix(bucket.prefix)
    out = []
    for key, size, modified in bucket.list(base):
        fp, _, rest = key[len(base):].partition("/")
        parsed = parse_key(key, f"{base}{fp}/") if fp else None
        if parsed is not None:
            out.append(RemoteObject(key, fp, parsed[1], parsed[0], size, modified))
    return out


def read_header(bucket, obj):
    """The object's envelope as an Entry (one ranged GET of 52 bytes), or None if gone or bad."""
    try:
        r = bucket.get_range(obj.key, 0, PREFIX_SIZE)
        raw = r["Body"].read()
        r["Body"].close()
        h = Header.unpack(raw)
    except Exception as e:                  # noqa: BLE001 - a gone or foreign object is skipped
        f = classify(e) if not isinstance(e, KVStoreError) else Failure(ERROR, "bad_header")
        if f.kind == UNAVAILABLE:
            raise RemoteError(f"reading {obj.key}: {f.code}") from e
        return None
    text_len = int.from_bytes(raw[48:52], "little")
    return Entry(sha=obj.sha, path=obj.key, quant_bits=h.quant_bits, reason=h.reason,
                 ext_flags=h.ext_flags, model_id=h.model_id, tokens=h.tokens, hits=h.hits,
                 ctx_size=h.ctx_size, payload_abi=h.payload_abi, created_at=h.created_at,
                 last_used=h.last_used, payload_bytes=h.payload_bytes, text_bytes=text_len,
                 file_size=obj.size, remote=obj.key)


def gc(bucket, budget_bytes, now=None, dry_run=False, max_age_s=None, min_age_s=0.0, threads=GC_THREADS):
    """Deletes objects until the bucket's checkpoints fit the budget (the janitor).

    Clients never delete remote objects; run this in one place (a cron job).
    Objects older than max_age_s (by last-modified) go first; then, while
    over budget, the lowest eviction score (kvstore.policy.eviction_score,
    from each object's header, read by one 52-byte ranged GET) goes first,
    the older last use breaking ties, as the local tier does.  Headers in
    the bucket keep the hit counts they were uploaded with: objects are
    never rewritten, so a hit on a fetched copy is counted locally only.
    Objects younger than min_age_s are kept (a just-published checkpoint
    another host is about to find).  An object whose header cannot be read
    scores 0 (SPEC section 8: unreadable files go first).

    Returns:
        (victims, total bytes before, total bytes after): victims as
        (RemoteObject, Entry or None) in deletion order.
    """
    now = int(time.time()) if now is None else int(now)
    objects = list_objects(bucket)
    before = sum(o.size for o in objects)
    victims = []
    if max_age_s is not None:
        old = [o for o in objects if now - o.modified > max_age_s]
        victims += [(o, None) for o in old]
        objects = [o for o in objects if now - o.modified <= max_age_s]
    total = sum(o.size for o in objects)
    if budget_bytes is not None and total > budget_bytes:
        with concurrent.futures.ThreadPoolExecutor(max(1, threads)) as pool:
            headers = list(pool.map(lambda o: read_header(bucket, o), objects))
        cands = [(o, e) for o, e in zip(objects, headers) if now - o.modified >= min_age_s]

        # The local tier's pick_victim, done once: scores do not change as
        # victims go (nothing is superseded or protected here).
        def rank(oe):
            o, e = oe
            if e is None:
                return (0.0, 0, o.key)
            return (policy.eviction_score(e, now), e.last_used or e.created_at, o.key)
        for o, e in sorted(cands, key=rank):
            if total <= budget_bytes:
                break
            victims.append((o, e))
            total -= o.size
    if victims and not dry_run:
        failed = set(bucket.delete([o.key for o, _ in victims]))
        if failed:
            log.warning("kvstore: remote_gc_delete_failed count=%d", len(failed))
            victims = [(o, e) for o, e in victims if o.key not in failed]
    after = before - sum(o.size for o, _ in victims)
    for o, e in victims:
        log.info("kvstore: remote_gc %s bytes=%d file=%s", "would_delete" if dry_run else "deleted", o.size,
                 _short(o.sha))
    return victims, before, after


def abort_stale_uploads(bucket, older_than_s=24 * 3600, now=None):
    """Aborts multipart uploads under the prefix started more than older_than_s ago; returns how many."""
    now = time.time() if now is None else now
    n = 0
    paginator = bucket.client.get_paginator("list_multipart_uploads")
    for page in paginator.paginate(Bucket=bucket.name, Prefix=layout_prefix(bucket.prefix)):
        for u in page.get("Uploads", ()) or ():
            if now - u["Initiated"].timestamp() > older_than_s:
                try:
                    bucket.client.abort_multipart_upload(Bucket=bucket.name, Key=u["Key"], UploadId=u["UploadId"])
                    n += 1
                except Exception as e:      # noqa: BLE001 - logged; the next run tries again
                    log.warning("kvstore: remote_abort_failed %s", classify(e).fields())
    return n


# ---- command-line wiring (kvstore serve, kvstore CLI) ----------------------------------

def add_arguments(parser, flag="--remote"):
    """Adds --remote and its options to an argparse parser (for `kvstore serve` and the CLI)."""
    g = parser.add_argument_group("remote tier (S3-compatible object store)")
    g.add_argument(flag, dest="remote", metavar="s3://BUCKET/PREFIX", default=None,
                   help="share checkpoints through this bucket (credentials: the standard AWS chain)")
    g.add_argument("--endpoint-url", dest="remote_endpoint_url", metavar="URL", default=None,
                   help="S3 endpoint of a non-AWS store (SeaweedFS, Ceph RGW, MinIO, R2, ...)")
    g.add_argument("--region", dest="remote_region", metavar="REGION", default=None, help="the bucket's region")
    g.add_argument("--profile", dest="remote_profile", metavar="NAME", default=None,
                   help="a profile of the AWS shared config/credentials files")
    g.add_argument("--connect-timeout", dest="remote_connect_timeout", metavar="SECONDS", type=float, default=None,
                   help=f"seconds (default {CONNECT_TIMEOUT_S})")
    return g


def options_from_args(args):
    """remote_options from the arguments add_arguments added (None values left out)."""
    return {k: v for k, v in {
        "endpoint_url": getattr(args, "remote_endpoint_url", None),
        "region": getattr(args, "remote_region", None),
        "profile": getattr(args, "remote_profile", None),
        "connect_timeout": getattr(args, "remote_connect_timeout", None),
    }.items() if v is not None}


def store_kwargs(args):
    """``remote=`` and ``remote_options=`` for KVStore(...) from parsed arguments ({} without --remote)."""
    if not getattr(args, "remote", None):
        return {}
    return {"remote": args.remote, "remote_options": options_from_args(args)}
