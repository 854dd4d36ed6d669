"""The remote tier: one bucket on any S3-compatible object store, shared by many hosts.

    store = kvstore.KVStore(path, remote="s3://bucket/prefix",
                            remote_options={"endpoint_url": ...}, model_identity="...")

Rooms: options (defaults, key layout, argparse wiring), s3 (the S3 calls and
their failure kinds), breaker (circuit breaker and health counters), index
(the bucket listing in memory), uploads (the upload queue), tier
(RemoteTier: what KVStore calls), janitor (`kvstore remote gc`).  See
docs/remote.md §13.
"""

import logging

from kvstore.errors import RemoteError
from kvstore.format import PAYLOAD_ABI_CHAIN, PAYLOAD_ABI_TENSORS, SEALED_ABI_OFFSET
from kvstore.remote.breaker import CircuitBreaker, Health
from kvstore.remote.index import RemoteIndex
from kvstore.remote.janitor import (GC_MIN_AGE_S, GC_THREADS, RemoteObject, abort_stale_uploads, gc,
                                    list_objects, read_header)
from kvstore.remote.options import (KeyInfo, add_arguments, key_fingerprint, layout_prefix, object_key,
                                    options_from_args, parse_key, parse_url, resolve_options, store_kwargs)
from kvstore.remote.s3 import CONFLICT, DENIED, ERROR, MISSING, UNAVAILABLE, Bucket, Failure, classify
from kvstore.remote.tier import RemoteTier
from kvstore.tiers import register_remote

log = logging.getLogger("kvstore")


def open_tier(url, store, options=None):
    """The RemoteTier behind a KVStore (registered for ``s3://`` URLs)."""
    if store.model_identity is None:
        log.warning("kvstore: remote_model_identity_unset model_id=%d (every model with this id "
                    "shares one key prefix; pass model_identity=)", store.settings.model_id)
    # A chained store shares blocks (payload ABI 17), a whole one ABI 16 files:
    # two namespaces, since neither can continue the other's objects.  A
    # sealed store's objects (48, 49: docs/format.md §16) are two more: they
    # are uploaded as they are on disk, and authenticated before a fetch
    # publishes them, so hosts sharing a key accept only what they sealed.
    abi = PAYLOAD_ABI_CHAIN if store.settings.layout == "chain" else PAYLOAD_ABI_TENSORS
    if store.sealed:
        abi += SEALED_ABI_OFFSET
    s = store.settings
    fp = key_fingerprint(s.model_id, s.quant_bits, s.reject_different_quant, store.model_identity,
                         payload_abi=abi)
    return RemoteTier(url, store.path, fp, options, check=store.verify_file)


register_remote("s3", open_tier)

__all__ = ["KeyInfo", "RemoteTier", "Bucket", "CircuitBreaker", "Health", "RemoteIndex", "RemoteObject", "RemoteError",
           "Failure", "classify", "UNAVAILABLE", "DENIED", "MISSING", "CONFLICT", "ERROR",
           "parse_url", "parse_key", "object_key", "layout_prefix", "key_fingerprint", "resolve_options",
           "add_arguments", "options_from_args", "store_kwargs", "list_objects", "read_header", "gc",
           "abort_stale_uploads", "open_tier", "GC_MIN_AGE_S", "GC_THREADS"]
