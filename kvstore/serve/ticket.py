"""What kvstore serve knows of one request: the Ticket its HTTP thread fills
and the tier completes (its cache, its breakpoints, its trace).

A Ticket rides on the request object from the HTTP thread that received it
to the generation thread that serves it.  Its trace() is the request's
`usage.kvstore` object (kvstore.serve.http): where its prefix came from,
how many tokens each tier gave and how many were prefilled, the load's
time, what was queued for storing and what became of its pins.  Numbers and
states only: never prompt text.
"""

import dataclasses

from kvstore.serve.routing import TAG_DIGITS


@dataclasses.dataclass
class Found:
    """The stored prefix a request's lookup found on its HTTP thread, not loaded yet."""
    entry: object             # the kvstore Entry (local, or the bucket's)
    key: bytes                # the request's key bytes (its prompt but the last token)
    source: str               # "disk" or "remote"


@dataclasses.dataclass
class Prefetched:
    """A request's checkpoint read on its HTTP thread, waiting for the generation thread."""
    tokens: list
    checkpoint: object        # a kvstore Checkpoint, its tensors evaluated MLX arrays
    n: int                    # tokens it holds
    source: str               # "disk" or "remote"
    load_s: float


@dataclasses.dataclass
class Ticket:
    """What the HTTP thread learned about a request before queueing it, and
    what the tier did for it (its trace)."""
    tenant: str = None        # tenants.tag() of its cache_salt, or None
    tokenized: object = None  # the generator's tokenize() result, or the exception it raised
    prefetched: Prefetched = None
    gone: object = None       # callable: True once the client has disconnected
    preparing: bool = False   # counted among the requests in the cheap half of their preparation
    pins: list = dataclasses.field(default_factory=list)    # [kvstore.serve.pinning.PinRequest]
    error: object = None      # the BadPin its answer is, or None
    # Where its prefix came from and what was stored of it (trace()).
    source: str = None        # "ram", "disk", "remote" or "none" once served
    reused: int = 0
    prefilled: int = 0
    load_ms: float = 0.0
    stored: list = dataclasses.field(default_factory=list)  # [(kvstore.policy target kind, tokens)] queued
    miss: dict = None         # where its prompt left the stored sequences (kvstore.serve.explain), or None
    cache_key: str = None     # the tag of its prompt_cache_key (kvstore.serve.routing), or None

    def trace(self):
        """The request's `usage.kvstore` object: numbers and states, never text."""
        source = {"remote": "bucket"}.get(self.source, self.source)
        out = {"source": source,
               "reused_tokens": {k: self.reused if source == k else 0 for k in ("ram", "disk", "bucket")},
               "prefilled_tokens": self.prefilled, "load_ms": round(self.load_ms, 1),
               "stored": [{"kind": k, "tokens": n} for k, n in self.stored]}
        if self.pins:
            out["pins"] = [p.view() for p in self.pins]
        if self.miss is not None:
            out["miss"] = dict(self.miss)
        if self.cache_key is not None:
            out["cache_key"] = self.cache_key[:TAG_DIGITS]
        return out
