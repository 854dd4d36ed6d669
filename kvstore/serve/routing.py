"""OpenAI's prompt-cache fields on kvstore serve: `prompt_cache_key` and `prompt_cache_retention`.

prompt_cache_key is a client's hint that requests share a prefix (an agent's
session, a tenant's tool list).  kvstore keeps it only as a tag, a SHA-256
under its own domain string as cache_salt's (kvstore.tenants): the key as
given is never stored or logged; the tag's first TAG_DIGITS digits name it
in `usage.kvstore.cache_key`, GET /v1/cache and the metrics.  It changes no
key bytes (requests under different keys still share what they share), but
it is evidence of reuse: with --admit-after N, a prefix that the same key
has used before counts as reused at its second use (kvstore.serve.admission).

prompt_cache_retention "24h" asks for the request's prefix to be kept a day:
a pin of the prefix that ends with its last message, judged exactly as a
cache_control breakpoint is (kvstore.serve.pinning: cut to --max-pin-ttl,
refused past --max-pinned-share, both shown in usage.kvstore.pins), except
that a prompt too short for a checkpoint is not an error.  "in_memory" asks
for nothing beyond the store policy, which is what it gets.
"""

from kvstore import tenants
from kvstore.serve.pinning import PinRequest

MAX_KEY_CHARS = 256
TAG_DIGITS = 8
RETENTIONS = {"in_memory": None, "24h": 86400}

_DOMAIN = b"kvstore prompt_cache_key v1\0"


def key_tag(value):
    """The tag of a body's prompt_cache_key (None when absent).

    Raises:
        ValueError: naming the field (not a string, empty, too long).
    """
    if value is None:
        return None
    if not isinstance(value, str) or not value or len(value) > MAX_KEY_CHARS:
        shown = type(value).__name__ if not isinstance(value, str) else f"{len(value)} characters"
        raise ValueError(f"prompt_cache_key must be a string of 1 to {MAX_KEY_CHARS} characters, not {shown}")
    return tenants.tag(value, _DOMAIN)


def retention_pin(value, messages, pins):
    """Adds prompt_cache_retention's pin to pins (PinRequests) of a chat request's messages.

    Raises:
        ValueError: naming the field (an unknown value, or "24h" on a request without messages).
    """
    if value is None:
        return
    if value not in RETENTIONS:
        raise ValueError(f"prompt_cache_retention {value!r} is not one of {', '.join(map(repr, RETENTIONS))}")
    ttl = RETENTIONS[value]
    if ttl is None:
        return
    if not messages:
        raise ValueError(f"prompt_cache_retention {value!r} pins a chat request's messages: this request has none")
    last = len(messages) - 1
    for p in pins:
        if p.message == last:
            p.ttl_s, p.origin = max(p.ttl_s, ttl), "retention"
            return
    pins.append(PinRequest(last, ttl, origin="retention"))
