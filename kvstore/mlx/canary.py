"""The canary: does a restored state come from the live model? (docs/semantics.md §17)

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

The positional slots with a floating dtype are compared (the K/V rows of
attention layers, MLA latents), a quantised KV cache's keys and values
dequantised.  The distance of one slot is the relative L2 norm
||recomputed - stored|| / ||stored|| over the rows compared; a restore
passes when every slot's distance is within the tolerance of its dtype and
every stored dtype is one the live model writes.  Another prefill chunking
rounds differently, so each tolerance sits between the rounding measured
and the distances another model, another RoPE or a replaced block make
(docs/semantics.md §17 has the figures).  The canary is not a corruption
detector (a few damaged values stay under the tolerance: the CRCs and tags
catch those); it tells whether the live model made the state.
"""

import dataclasses
import logging
import weakref

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

from kvstore.mlx.codecs import cache_state

log = logging.getLogger("kvstore")

__all__ = ["TOLERANCE", "QUANTIZED_TOLERANCE", "LOSSY_TOLERANCE", "HEAD_TOKENS", "Verdict", "Probe", "tolerance", "rows", "compare",
           "kv_dtypes", "prepare", "finish", "check"]

# The largest relative L2 distance of a recomputed row that passes, by the
# KV dtype (docs/semantics.md §17 has the measurements behind them).  Rounding:
# float32 ~1e-6; float16 and bfloat16 0 on the CPU, up to 7e-3 and 5.4e-2
# where the rows were computed in another precision (as another device's
# kernels would); a quantised cache 0.17 (4 bits) to 0.34 (8 bits, bfloat16)
# after requantising.  Another model's weights, rope_theta x10 or x1.1 and a
# replaced block gave 0.56 and more everywhere, with one exception: a YaRN
# factor x2 (6e-2), which float32 and float16 still catch.  About 25 times
# the half types' epsilon, with a floor of 1e-3:
TOLERANCE = {"float32": 1e-3, "float16": 2.5e-2, "bfloat16": 0.2}
# Rows of a quantised KV cache (dequantised), whatever the dtype.
QUANTIZED_TOLERANCE = 0.5
# Any other floating dtype.
DEFAULT_TOLERANCE = 0.2
# A state restored from lossy blocks (kvstore.payload.quantizing): a slot
# passes up to the larger of its dtype's tolerance and its codec's.  The
# model's own state, restored through the codec, measured up to 0.24 (q8)
# and 0.43 (q4) over the 118 architectures of tests/test_mlx_architectures
# with rows (float32, tail canary; most under 0.02 and 0.25), another
# model's weights 1.16 and more: each tolerance is 1.4 times its largest
# own distance.  A lossy tolerance lets through what sits under it: a
# rope_theta x1.1 (0.56 measured exact) still fails q8's, not surely q4's.
LOSSY_TOLERANCE = {"q8": 0.35, "q4": 0.6}

# The head canary's prefix: long enough that RoPE has turned every
# frequency band by a visible angle (position 1 barely turns the slow ones;
# 16 positions give 8-15 times the signal of 2).
HEAD_TOKENS = 16


def tolerance(dtype, lossy=""):
    """The tolerance of rows of a slot whose dtype is dtype ("q:<dtype>" for
    a quantised one), restored from blocks of the codec lossy ("" exact)."""
    if dtype.startswith("q:"):
        return max(QUANTIZED_TOLERANCE, LOSSY_TOLERANCE.get(lossy, 0.0))
    return max(TOLERANCE.get(dtype, DEFAULT_TOLERANCE), LOSSY_TOLERANCE.get(lossy, 0.0))


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
    kv_dtypes: frozenset = frozenset()
    lossy: str = ""


def _name(dtype):
    """An MLX dtype's name as the manifest writes it ("float16", not "mlx.core.float16")."""
    return str(dtype).rsplit(".", 1)[-1]


def _quantized_groups(meta):
    """[(slot names of the packed words, scales, biases), group size, bits] of
    every quantised keys or values of a cache meta (CacheList children too)."""
    out = []

    def walk(layers, li, at):
        for lm in layers:
            if lm["class"] == "CacheList":
                at = walk(lm["meta_state"]["children"], li, at)
                continue
            n = lm["n_state"]
            if lm["class"] == "QuantizedKVCache" and lm["meta_state"]["parts"] == 3:
                ms = lm["meta_state"]
                for first in (at, at + 3):
                    out.append(([f"{li}.{first + j}" for j in range(3)], ms["group_size"], ms["bits"]))
            at += n
        return at

    for li, lm in enumerate(meta["layers"]):
        walk([lm], li, 0)
    return out


def rows(cache, start, stop):
    """{slot name: (dtype, float32 NumPy copy of positions [start, stop))} of
    every floating positional slot of cache that holds them; a quantised
    cache's keys and values dequantised, under their packed slot's name and
    the dtype "q:<scales dtype>".  Copies: the cache may be changed in place
    afterwards, and no view keeps its buffer from it."""
    tensors, meta, positional = cache_state(cache)

    def cut(name):
        axis = positional[name]
        return tensors[name][(slice(None),) * axis + (slice(start, stop),)]
    views, kinds = {}, {}
    for names, group, bits in _quantized_groups(meta):
        if all(n in positional and tensors[n].shape[positional[n]] >= stop for n in names):
            views[names[0]] = mx.dequantize(*(cut(n) for n in names), group_size=group, bits=bits)
            kinds[names[0]] = "q:" + _name(tensors[names[1]].dtype)
        positional = {k: v for k, v in positional.items() if k not in names}
    for name, axis in positional.items():
        a = tensors[name]
        if mx.issubdtype(a.dtype, mx.floating) and a.shape[axis] >= stop:
            views[name] = cut(name)
            kinds[name] = _name(a.dtype)
    mx.eval(list(views.values()))
    return {name: (kinds[name], np.array(v.astype(mx.float32))) for name, v in views.items()}


def compare(stored, recomputed, kv_dtypes=None, lossy=""):
    """The Verdict of recomputed rows against stored ones (rows() of each), kind unset.

    lossy: the codec the stored rows were restored from ("" exact; tolerance()).

    kv_dtypes: the floating dtypes the live model's KV cache holds
    (kv_dtypes()); a stored slot of another dtype fails at once (the rows
    written back into a buffer take its dtype, so the distance alone would
    not see it).
    """
    common = sorted(stored.keys() & recomputed.keys())
    if not common:
        return Verdict(ok=True, kind="none")
    worst, distance, over = "", 0.0, 0.0
    for name in common:
        (dt_s, s), (dt_r, r) = stored[name], recomputed[name]
        if dt_s != dt_r or s.shape != r.shape or (kv_dtypes and dt_s.removeprefix("q:") not in kv_dtypes):
            return Verdict(ok=False, kind="", distance=float("inf"), worst=name, reason="dtype", compared=len(common))
        norm = float(np.linalg.norm(s))
        d = float(np.linalg.norm(r - s)) / max(norm, 1e-30) if norm or np.any(r) else 0.0
        if not np.isfinite(d):
            d = float("inf")
        if d / tolerance(dt_s, lossy) > over or not worst:
            worst, distance, over = name, d, d / tolerance(dt_s, lossy)
    return Verdict(ok=over <= 1.0, kind="", distance=distance, worst=worst,
                   reason="" if over <= 1.0 else "distance", compared=len(common))


# The KV dtypes of models already seen (by object, with a weak reference).
_kv_dtypes = {}


def kv_dtypes(model):
    """The floating dtypes of the KV rows the model writes: one token's forward
    into a fresh cache, once per model and process."""
    hit = _kv_dtypes.get(id(model))
    if hit is not None and hit[0]() is model:
        return hit[1]
    cache = make_prompt_cache(model)
    model(mx.array([[0]], dtype=mx.uint32), cache=cache)
    tensors, _, positional = cache_state(cache)
    got = frozenset(_name(tensors[k].dtype) for k in positional if mx.issubdtype(tensors[k].dtype, mx.floating))
    try:
        _kv_dtypes[id(model)] = (weakref.ref(model, lambda _r, k=id(model): _kv_dtypes.pop(k, None)), got)
    except TypeError:
        pass
    return got


def _head(model, cache, tokens, lossy):
    """The head canary: HEAD_TOKENS tokens prefilled from nothing, their rows compared."""
    k = min(HEAD_TOKENS, len(tokens))
    stored = rows(cache, 0, k)
    if not stored:
        return Verdict(ok=True, kind="none")
    fresh = make_prompt_cache(model)
    model(mx.array([int(t) for t in tokens[:k]], dtype=mx.uint32)[None], cache=fresh)
    v = compare(stored, rows(fresh, 0, k), lossy=lossy)
    return dataclasses.replace(v, kind="head" if v.applies else "none")


def prepare(model, cache, tokens, lossy=""):
    """Starts the canary of a cache just restored with tokens (their count is
    the cache's), from blocks of the codec lossy ("" exact: Checkpoint.lossy).

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
            return Probe(n - 1, stored, kv_dtypes(model), lossy), None
    if n < 1:
        return None, Verdict(ok=True, kind="none")
    return None, _head(model, cache, tokens, lossy)


def finish(probe, cache):
    """The tail canary's Verdict, once the cache holds probe.position again."""
    v = compare(probe.stored, rows(cache, probe.position, probe.position + 1), probe.kv_dtypes, probe.lossy)
    return dataclasses.replace(v, kind="tail" if v.applies else "none")


def check(model, cache, tokens, lossy=""):
    """The whole canary of a restored cache, on its own (one token's forward
    for a tail canary): afterwards the cache holds every token again, the
    last one's rows as the live model recomputed them.

    Returns:
        Verdict.
    """
    probe, verdict = prepare(model, cache, tokens, lossy)
    if probe is None:
        return verdict
    model(mx.array([int(tokens[-1])], dtype=mx.uint32)[None], cache=cache)
    return finish(probe, cache)
