"""The bucket's janitor: `kvstore ls --remote` and `kvstore remote gc` (docs/remote.md §13).

Clients never delete remote objects; one janitor (a cron job) keeps the
bucket within a budget, with the local tier's eviction order read from each
object's header, and aborts multipart uploads that were never finished.
"""

import concurrent.futures
import dataclasses
import logging
import time

from kvstore import policy
from kvstore.errors import KVStoreError, RemoteError
from kvstore.files import short_name
from kvstore.format import PREFIX_SIZE, Entry, ExtFlag, Header, Reason, prefix_text_bytes
from kvstore.remote.options import layout_prefix, parse_key
from kvstore.remote.s3 import ERROR, UNAVAILABLE, Failure, classify

log = logging.getLogger("kvstore")

# Header reads in flight at once (52-byte GETs: latency-bound).
GC_THREADS = 8
# The age under which an object is kept: a host that listed it a moment ago
# may be about to fetch it; deleting it costs that host a miss, nothing worse.
GC_MIN_AGE_S = 60.0


@dataclasses.dataclass(frozen=True)
class RemoteObject:
    """One object of the bucket as `kvstore ls --remote` and gc see it."""
    key: str
    fingerprint: str
    sha: str
    text_bytes: int
    size: int
    modified: float
    parent: str = None           # a chain block's parent ("" for a first block); None: a whole checkpoint


def list_objects(bucket):
    """Every checkpoint object under the bucket's layout prefix, every model."""
    base = layout_prefix(bucket.prefix)
    out = []
    for key, size, modified in bucket.list(base):
        fp, _, rest = key[len(base):].partition("/")
        info = parse_key(key, f"{base}{fp}/") if fp else None
        if info is not None:
            out.append(RemoteObject(key, fp, info.sha, info.text_bytes, size, modified, info.parent))
    return out


def read_header(bucket, obj):
    """The object's envelope as an Entry (one ranged GET of 52 bytes), or None if gone or bad."""
    try:
        r = bucket.get_range(obj.key, 0, PREFIX_SIZE)
        raw = r["Body"].read()
        r["Body"].close()
        h, text_len = Header.unpack(raw), prefix_text_bytes(raw)
    except Exception as e:                  # noqa: BLE001 - a gone or foreign object is skipped
        f = classify(e) if not isinstance(e, KVStoreError) else Failure(ERROR, "bad_header")
        if f.kind == UNAVAILABLE:
            raise RemoteError(f"reading {obj.key}: {f.code}") from e
        return None
    return Entry.from_header(h, obj.sha, obj.key, text_len, obj.size, parent=obj.parent or "")


def _unreadable(obj):
    """An Entry for an object whose header cannot be read: no tokens, no times, so it scores 0."""
    return Entry(sha=obj.sha, path=obj.key, quant_bits=16, reason=Reason.UNKNOWN, ext_flags=ExtFlag(0),
                 model_id=0, tokens=0, hits=0, ctx_size=0, payload_abi=0, created_at=0, last_used=0,
                 payload_bytes=0, text_bytes=obj.text_bytes, file_size=obj.size,
                 parent=obj.parent or "")


def gc(bucket, budget_bytes, now=None, dry_run=False, max_age_s=None, min_age_s=0.0, threads=GC_THREADS):
    """Deletes objects until the bucket's checkpoints fit the budget (the janitor).

    Objects older than max_age_s (by last-modified) go first; then, while
    over budget, kvstore.policy.select_victims picks from each object's
    header (read by one 52-byte ranged GET), as the local tier does: chain
    blocks leaves first (their keys name their parents), so no chain in the
    bucket is cut in the middle.  Headers
    in the bucket keep the hit counts they were uploaded with: objects are
    never rewritten, so a hit on a fetched copy is counted locally only.
    Objects younger than min_age_s are kept (a just-published checkpoint
    another host is about to find).  An object whose header cannot be read
    scores 0 (unreadable files go first).

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
        young = sum(o.size for o in objects if now - o.modified < min_age_s)
        cands = sorted(((o, e) for o, e in zip(objects, headers) if now - o.modified >= min_age_s),
                       key=lambda oe: oe[0].key)
        by_key = {o.key: (o, e) for o, e in cands}
        # The young objects count for the budget but are never chosen.
        chosen = policy.select_victims([e if e is not None else _unreadable(o) for o, e in cands],
                                       budget_bytes, now, kept_bytes=young)
        victims += [by_key[e.path] for e in chosen]
    if victims and not dry_run:
        failed = set(bucket.delete([o.key for o, _ in victims]))
        if failed:
            log.warning("kvstore: remote_gc_delete_failed count=%d", len(failed))
            victims = [(o, e) for o, e in victims if o.key not in failed]
    after = before - sum(o.size for o, _ in victims)
    for o, e in victims:
        log.info("kvstore: remote_gc %s bytes=%d file=%s", "would_delete" if dry_run else "deleted", o.size,
                 short_name(o.sha))
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
