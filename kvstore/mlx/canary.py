"""The canary: does a restored state come from the live model? (docs/format.md §17)

A CRC or an AEAD tag proves that a checkpoint's bytes are the ones written;
the model identity proves who wrote them, as far as the writer was honest.
Neither proves that the live model would have computed the state: a file
rewritten by someone with write access (valid CRCs, the right name), a
model whose weights changed under the same identity, or another RoPE or KV
setting all restore and decode without an error, and answer wrongly.  The
canary recomputes a little of the state with the live model and compares:

- tail (every cache that can be trimmed: dense, MoE, MLA, quantised KV, a
  window that has not wrapped): the cache is trimmed by one token and the
  last stored token is fed again, as the first token of the rest of the
  prompt, which the engine prefills anyway.  The recomputed K/V row of that
  token in every attention layer is compared with the stored row;
- head (caches that cannot go back a token: a recurrent state beside the
  attention layers, a window that has wrapped): a fresh cache prefills the
  first HEAD_TOKENS stored tokens, and their rows are compared with the
  stored ones, in the layers that keep them;
- none: a state with no positional rows (a pure SSM, windows only) has
  nothing to compare: the log says the canary does not apply.

Only positional slots with a floating dtype are compared (the K/V rows of
attention layers, MLA latents, the scales and biases of a quantised KV
cache; packed integers are not).  The distance of one slot is the relative
L2 norm ||recomputed - stored|| / ||stored|| over the rows compared; a
restore passes when every slot's distance is at most TOLERANCE and every
dtype agrees.  Another prefill chunking rounds differently, so the
tolerance sits between the rounding measured and the distances another
model, another RoPE or damage make (docs/format.md §17 has the figures).
"""

import dataclasses
import logging

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

from kvstore.mlx.codecs import cache_state

log = logging.getLogger("kvstore")

__all__ = ["TOLERANCE", "HEAD_TOKENS", "Verdict", "Probe", "rows", "compare", "prepare", "finish", "check"]

# The largest relative L2 distance of a recomputed row that passes.  Rounding
# (another chunking of the prefill, float16 or bfloat16 included) stayed
# below 0.03 in every architecture measured; another model's weights, another
# rope_theta and damaged rows gave 0.3 and more (docs/format.md §17).
TOLERANCE = 0.1

# The head canary's prefix: long enough that RoPE has turned every
# frequency band by a visible angle (position 1 barely turns the slow ones).
HEAD_TOKENS = 16


@dataclasses.dataclass(frozen=True)
class Verdict:
    """The canary's finding.

    kind: "tail", "head" or "none" (nothing to compare: ok, not applicable);
    distance: the largest relative L2 distance of a compared slot;
    worst: that slot's name ("{layer}.{i}"); reason: "" when ok, else
    "distance" or "dtype".
    """
    ok: bool
    kind: str
    distance: float = 0.0
    worst: str = ""
    reason: str = ""
    compared: int = 0

    @property
    def applies(self):
        return self.kind != "none"

    def words(self):
        """key=value words for a log line."""
        if not self.applies:
            return "canary=none"
        return (f"canary={self.kind} distance={self.distance:.3g} slot={self.worst or '-'} "
                f"slots={self.compared}" + (f" why={self.reason}" if self.reason else ""))


@dataclasses.dataclass
class Probe:
    """A tail canary under way: the stored rows at position, waiting for the recompute."""
    position: int
    stored: dict


def rows(cache, start, stop):
    """{slot name: float32 NumPy copy of positions [start, stop)} of every
    floating positional slot of cache that holds them (copies: the cache may
    be changed in place afterwards, and no view keeps its buffer from it)."""
    tensors, _, positional = cache_state(cache)
    out = {}
    views = {}
    for name, axis in positional.items():
        a = tensors[name]
        if not mx.issubdtype(a.dtype, mx.floating) or a.shape[axis] < stop:
            continue
        views[name] = a[(slice(None),) * axis + (slice(start, stop),)]
    mx.eval(list(views.values()))
    for name, v in views.items():
        out[name] = (str(v.dtype), np.array(v.astype(mx.float32)))
    return out


def compare(stored, recomputed):
    """The Verdict of recomputed rows against stored ones (rows() of each), kind unset."""
    common = sorted(stored.keys() & recomputed.keys())
    if not common:
        return Verdict(ok=True, kind="none")
    worst, distance = "", 0.0
    for name in common:
        (dt_s, s), (dt_r, r) = stored[name], recomputed[name]
        if dt_s != dt_r or s.shape != r.shape:
            return Verdict(ok=False, kind="", distance=float("inf"), worst=name, reason="dtype", compared=len(common))
        norm = float(np.linalg.norm(s))
        d = float(np.linalg.norm(r - s)) / max(norm, 1e-30) if norm or np.any(r) else 0.0
        if not np.isfinite(d):
            d = float("inf")
        if d > distance or not worst:
            worst, distance = name, d
    return Verdict(ok=distance <= TOLERANCE, kind="", distance=distance, worst=worst,
                   reason="" if distance <= TOLERANCE else "distance", compared=len(common))


def _head(model, cache, tokens):
    """The head canary: HEAD_TOKENS tokens prefilled from nothing, their rows compared."""
    k = min(HEAD_TOKENS, len(tokens))
    stored = rows(cache, 0, k)
    if not stored:
        return Verdict(ok=True, kind="none")
    fresh = make_prompt_cache(model)
    model(mx.array([int(t) for t in tokens[:k]], dtype=mx.uint32)[None], cache=fresh)
    v = compare(stored, rows(fresh, 0, k))
    return dataclasses.replace(v, kind="head" if v.applies else "none")


def prepare(model, cache, tokens):
    """Starts the canary of a cache just restored with tokens (their count is the cache's).

    Returns:
        (Probe, None): a tail canary; the cache is now one token shorter, and
            the caller prefills tokens[-1] again (with whatever follows it),
            then calls finish();
        (None, Verdict): a head canary (already decided) or none.
    """
    n = len(tokens)
    if n >= 1 and can_trim_prompt_cache(cache):
        stored = rows(cache, n - 1, n)
        if stored and trim_prompt_cache(cache, 1) == 1:
            return Probe(n - 1, stored), None
    if n < 1:
        return None, Verdict(ok=True, kind="none")
    return None, _head(model, cache, tokens)


def finish(probe, cache):
    """The tail canary's Verdict, once the cache holds probe.position again."""
    v = compare(probe.stored, rows(cache, probe.position, probe.position + 1))
    return dataclasses.replace(v, kind="tail" if v.applies else "none")


def check(model, cache, tokens):
    """The whole canary of a restored cache, on its own (one token's forward
    for a tail canary): afterwards the cache holds every token again, the
    last one's rows as the live model recomputed them.

    Returns:
        Verdict.
    """
    probe, verdict = prepare(model, cache, tokens)
    if probe is None:
        return verdict
    model(mx.array([int(tokens[-1])], dtype=mx.uint32)[None], cache=cache)
    return finish(probe, cache)
