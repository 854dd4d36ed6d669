"""The remote tier's options, tuned defaults and bucket key layout (docs/remote.md §13).

Keys are ``<prefix>/v1/<fingerprint>/<text length, 12 digits>/<sha1>.kv``: the
fingerprint keeps one model's checkpoints apart from another's, and the text
length in the key lets a listing fill the lookup index without reading any
object.  A chain block's key also names its parent and whether it is
restorable on its own, ``<sha1>.<parent sha1, or 40 zeros>.<r|l>.kv``, so a
listing knows every chain without a GET.  Also here: the argparse wiring that `kvstore serve` and the command
line share.
"""

import collections
import hashlib
import json
import re

from kvstore.format import PAYLOAD_ABI_TENSORS

# The key layout's version: a reader never mixes objects of two layouts.
LAYOUT = "v1"

# Upload: S3 caps a single PUT at 5 GiB and a multipart part at >= 5 MiB;
# 64 MiB parts keep one part in memory at a time and a 1 GiB checkpoint at
# 16 requests.  Smaller files go in one PUT.
PART_SIZE = 64 << 20
MIN_PART_SIZE = 5 << 20

# Fetch: ranges of FETCH_RANGE over FETCH_THREADS connections (see tier.py).
FETCH_THREADS = 4

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

# close() gives queued uploads this long to drain (never while the breaker
# is open: a dead remote must not hold up a shutdown).
CLOSE_TIMEOUT_S = 10.0

_KEY_TAIL_RE = re.compile(r"^(\d{12})/([0-9a-f]{40})(?:\.([0-9a-f]{40})\.([rl]))?\.kv$")
_ROOT = "0" * 40
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


def key_fingerprint(model_id=0, quant_bits=16, reject_different_quant=False, model_identity=None,
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


class KeyInfo(collections.namedtuple("KeyInfo", "text_bytes sha parent restorable")):
    """What an object's key says: its text length and digest; for a chain
    block its parent ("" for a first block) and whether it is restorable
    on its own; parent None for a whole (ABI 16) checkpoint."""

    @property
    def is_block(self):
        return self.parent is not None


def object_key(prefix, fingerprint, sha, text_bytes, parent=None, restorable=True):
    """``<prefix>/v1/<fingerprint>/<text length, 12 digits>/<sha1>.kv``, or for a
    chain block (parent not None) ``.../<sha1>.<parent or 40 zeros>.<r|l>.kv``."""
    tail = "" if parent is None else f".{parent or _ROOT}.{'r' if restorable else 'l'}"
    return f"{layout_prefix(prefix)}{fingerprint}/{int(text_bytes):012d}/{sha}{tail}.kv"


def parse_key(key, base):
    """The KeyInfo of a key under base (``.../<fingerprint>/``), or None."""
    if not key.startswith(base):
        return None
    m = _KEY_TAIL_RE.match(key[len(base):])
    if not m:
        return None
    if m.group(3) is None:
        return KeyInfo(int(m.group(1)), m.group(2), None, True)
    parent = "" if m.group(3) == _ROOT else m.group(3)
    return KeyInfo(int(m.group(1)), m.group(2), parent, m.group(4) == "r")


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
