"""Tenants: the `cache_salt` of a request keeps its cached prefixes to itself.

A request may carry `cache_salt` (the OpenAI-compatible field vLLM uses).
Requests with different salts never share a cached prefix: in RAM the salt's
tag is part of the model key of mlx-lm's trie, on disk and in the bucket the
tag opens the key bytes, so a checkpoint's name (the SHA1 of the key) and
its stored text differ per tenant and the longest-prefix lookup of one
tenant can never end in another's file.  One tenant therefore cannot learn
from the time to first token what another tenant sent.

The salt itself is never written: the tag is a SHA-256 of it under a fixed
domain string, and only the tag's hex digits reach memory keys, key bytes,
files and logs (logs show its first 8 digits).
"""

import hashlib

# Longest salt accepted, in characters: a salt is an opaque tenant id or a
# random token, not a document.
MAX_SALT_CHARS = 256

_DOMAIN = b"kvstore cache_salt v1\0"

# The key bytes of a salted checkpoint start with this, then the tag's 64 hex
# digits, then a NUL: no rendered prompt of an unsalted request starts with
# a NUL byte under a text template, and a salted key can only equal another
# salted key of the same tag.
KEY_MARK = b"\0kvstore-tenant:"


def check_salt(value):
    """The salt of a request body's `cache_salt` (None when absent).

    Raises:
        ValueError: a message naming the problem (not a string, empty, too long).
    """
    if value is None:
        return None
    if not isinstance(value, str):
        raise ValueError(f"cache_salt must be a string, not {type(value).__name__}")
    if not value:
        raise ValueError("cache_salt must not be empty")
    if len(value) > MAX_SALT_CHARS:
        raise ValueError(f"cache_salt is {len(value)} characters long; at most {MAX_SALT_CHARS} are accepted")
    return value


def tag(salt, domain=_DOMAIN):
    """The tenant tag of a salt: 64 hex digits (None for no salt); another
    domain string gives another kind of tag of a client's string (a
    prompt_cache_key's, kvstore.serve.routing)."""
    if salt is None:
        return None
    return hashlib.sha256(domain + salt.encode("utf-8", "surrogatepass")).hexdigest()


def key_prefix(tenant):
    """The bytes that open every key of a tenant (b"" for none)."""
    if tenant is None:
        return b""
    return KEY_MARK + tenant.encode("ascii") + b"\0"


def trie_key(model, tenant):
    """The model key of mlx-lm's trie for a tenant's entries: the model itself for none."""
    return model if tenant is None else (model, "tenant", tenant)


def split_trie_key(ns):
    """(model, tenant) of a trie model key."""
    if isinstance(ns, tuple) and len(ns) == 3 and ns[1] == "tenant":
        return ns[0], ns[2]
    return ns, None
