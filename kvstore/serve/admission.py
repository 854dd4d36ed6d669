"""What the disk tier of kvstore serve stores: admission and what is stored already.

Two bounded tables of SHA1 digests of disk keys (the tier's key bytes, a
tenant's prefix included), kept by one ``Ledger`` for the tier:

- uses: with admit_after = N > 1 a prefix is stored only once N requests
  have used it.  Each request counts the prefixes of its prompt at every
  ADMISSION_GRID-token boundary, and a store keeps only the boundaries
  counted N times.
- stored: the keys this process loaded (every block end of the chain) or
  stored.  A state whose key is among them is not captured again: the store
  would keep the file it has and write nothing, and capturing a large state
  costs the generation thread a copy of it.  A file evicted since is stored
  again once its digest has aged out of the table.

Both are decided on the generation thread before a capture, in
microseconds (one SHA1 pass over the key).
"""

import collections
import threading

from kvstore import _native
from kvstore.settings import DEFAULT_BLOCK_TOKENS

# Admission counts prompt prefixes at multiples of this many tokens.
ADMISSION_GRID = DEFAULT_BLOCK_TOKENS

# How many prefix digests admission remembers (least recently counted go first).
ADMISSION_TABLE = 1 << 16

# How many stored or loaded keys the ledger remembers (least recently noted go first).
KNOWN_TABLE = 1 << 12


class Ledger:
    """The admission counts and the keys known on disk of one tier.

    Args:
        admit_after: store a prefix once this many requests have used it.
        offsets: a callable (tokens, tenant, key length) -> the key byte
            offset after each token (index i: after i tokens), or None.
    """

    def __init__(self, admit_after, offsets):
        self.admit_after = admit_after
        self._offsets = offsets
        self._lock = threading.Lock()
        self._uses = collections.OrderedDict()     # prefix digest -> requests that used it
        self._keyed = collections.OrderedDict()    # (prompt_cache_key tag, prefix digest) seen
        self._stored = collections.OrderedDict()   # digests of keys known on disk

    # -- stored already ---------------------------------------------------------

    def remember(self, key, lengths):
        """Notes that key's first n bytes are stored, for each n in lengths
        (a load's block ends, or a save's end)."""
        lengths = sorted({n for n in lengths if 0 < n <= len(key)})
        digests = _native.sha1_prefixes(key, lengths) if lengths else []
        with self._lock:
            for d in digests:
                self._stored[d] = True
                self._stored.move_to_end(d)
            while len(self._stored) > KNOWN_TABLE:
                self._stored.popitem(last=False)

    def known(self, key):
        """True when this process loaded or stored key (and it has not aged out)."""
        d = _native.sha1_prefixes(key, [len(key)])[0]
        with self._lock:
            return d in self._stored

    # -- admission ----------------------------------------------------------------

    def _grid_digests(self, tokens, tenant, key):
        """{boundary: digest of key up to it} at every ADMISSION_GRID-token multiple of tokens."""
        offsets = self._offsets(tokens, tenant, len(key))
        if offsets is None:
            return {}
        cuts = list(range(ADMISSION_GRID, len(tokens) + 1, ADMISSION_GRID))
        if not cuts:
            return {}
        return dict(zip(cuts, _native.sha1_prefixes(key, [int(offsets[c]) for c in cuts])))

    def count_uses(self, tokens, tenant, key, cache_key=None):
        """Counts one request's use of every grid prefix of tokens (key: their
        key bytes).  Under a prompt_cache_key's tag (cache_key), a prefix the
        same key used before is admitted at once: the client said these
        requests share it, and the second one shows that they do."""
        if self.admit_after <= 1:
            return
        digests = self._grid_digests(tokens, tenant, key)
        with self._lock:
            for d in digests.values():
                uses = self._uses.pop(d, 0) + 1
                if cache_key is not None:
                    if (cache_key, d) in self._keyed:
                        uses = max(uses, self.admit_after)
                    self._keyed[(cache_key, d)] = True
                self._uses[d] = uses
            for table in (self._uses, self._keyed):
                while len(table) > ADMISSION_TABLE:
                    table.popitem(last=False)

    def admitted(self, tokens, tenant, key):
        """The longest grid boundary <= len(tokens) that admit_after requests
        have used (0: none); all of tokens without admission."""
        if self.admit_after <= 1:
            return len(tokens)
        digests = self._grid_digests(tokens, tenant, key)
        with self._lock:
            ok = [n for n, d in digests.items() if self._uses.get(d, 0) >= self.admit_after]
        return max(ok, default=0)
