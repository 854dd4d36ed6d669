"""Second tiers behind a store's directory, by URL scheme: KVStore(remote=
"s3://...") opens the tier registered for "s3".  The tier's own package
(kvstore.remote) registers its opener, so that the store never imports a
room above it."""

_OPENERS = {}


def register_remote(scheme, opener):
    """Makes KVStore(remote="<scheme>://...") open a tier with opener.

    Args:
        scheme: the URL scheme, such as "s3".
        opener: callable(url, store, options) returning the tier object.
    """
    _OPENERS[scheme] = opener


def open_remote(url, store, options):
    """The tier for url, opened by its scheme's opener for store.

    Raises:
        ValueError: no tier is registered for url's scheme.
    """
    scheme = url.partition("://")[0] if isinstance(url, str) else None
    opener = _OPENERS.get(scheme)
    if opener is None:
        raise ValueError(f"remote={url!r}: no remote tier for this scheme "
                         f"(known: {', '.join(sorted(_OPENERS)) or 'none'})")
    return opener(url, store, options)
