"""The S3 calls kvstore makes, and what a failed call means (docs/remote.md §13).

boto3 is imported here only, and only when a Bucket is opened: ``import
kvstore`` works without it.  Credentials come from the standard AWS chain
(environment, shared credentials and config files, a profile, an instance
role); nothing in this project stores keys.
"""

import dataclasses
import logging
import os

from kvstore.remote.options import layout_prefix, object_key, parse_url, resolve_options

log = logging.getLogger("kvstore")

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

    def key(self, fingerprint, sha, text_bytes, parent=None, restorable=True):
        return object_key(self.prefix, fingerprint, sha, text_bytes, parent, restorable)

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
