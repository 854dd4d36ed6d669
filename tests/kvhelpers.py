"""Small helpers shared by the store tests (imported as a plain module)."""

import hashlib

from kvstore import KVStore
from kvstore.policy import Options

# Most store tests save a handful of tokens: lift the 512-token minimum.
OPTS = Options(min_tokens=1)


def make_store(path, **kw):
    """A KVStore for tests: min_tokens=1 and no fsync unless asked."""
    kw.setdefault("options", OPTS)
    kw.setdefault("durable", False)
    return KVStore(path, **kw)


def flip(path, offset, mask=0x01):
    """Flips bits of one byte of a file in place."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([b ^ mask]))


def colliding_texts(digits, base="session"):
    """Two texts whose SHA1 hex digests (file names) share the first `digits` digits."""
    seen = {}
    i = 0
    while True:
        t = f"{base} {i}".encode()
        h = hashlib.sha1(t).hexdigest()[:digits]
        if h in seen:
            return seen[h], t
        seen[h] = t
        i += 1
