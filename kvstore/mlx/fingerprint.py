"""model_fingerprint: the identity of an exact MLX model (docs/semantics.md §17).

A checkpoint is right only for the model that computed it, so a store keyed
by a model's name (or its architecture, or its file sizes) restores a
fine-tune's, a re-quantised copy's or another seed's state into it without
an error.  The fingerprint is a SHA-256 over what decides the KV state:

- the config (model.args), which holds the architecture, the sizes, the
  RoPE settings, the sliding windows;
- every parameter tensor's name, dtype and shape, and a sample of its bytes:
  SAMPLES windows of WINDOW bytes spread over the tensor, first and last
  included.  Two trainings, seeds or quantisations of one architecture
  differ in every tensor, so a sample tells them apart, and reading a few KiB
  per tensor keeps a 100 GB model's fingerprint at a fraction of a second;
- the quantisation of every quantised layer (bits, group size, mode);
- the KV cache the model makes (each layer's cache class and its window or
  chunk sizes), and the engine's own cache options (max_kv_size).

The KV dtype follows from the parameters' dtypes and the cache classes.
Nothing here reads files: a model built in code has a fingerprint as well as
one loaded from disk, and the same loaded model gives the same fingerprint in
every process.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any
import hashlib
import json
import weakref

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache

__all__ = ["model_fingerprint", "model_label", "quantization", "cache_kinds", "SAMPLES", "WINDOW"]

# Bytes sampled per tensor: SAMPLES windows of WINDOW bytes.  8 x 64 bytes
# covers a few hundred weights of every tensor, far more than it takes to
# tell two trainings apart, and costs ~4 KiB of reads per tensor.
SAMPLES = 8
WINDOW = 64

_VERSION = "kvstore model fingerprint v1"

# Fingerprints of models already seen, by object (a model is not hashable).
_seen = {}


def _config(model):
    args = getattr(model, "args", None)
    if args is None:
        return {}
    if dataclasses.is_dataclass(args):
        return dataclasses.asdict(args)
    return dict(vars(args))


def _sample(a):
    """An MLX array of the sampled bytes of a (lazy until evaluated)."""
    flat = a.reshape(-1).view(mx.uint8) if a.size else mx.zeros((0,), dtype=mx.uint8)
    n = flat.size
    if n <= SAMPLES * WINDOW:
        return flat
    starts = np.linspace(0, n - WINDOW, SAMPLES).astype(np.int64)
    idx = (starts[:, None] + np.arange(WINDOW)[None, :]).reshape(-1)
    return mx.take(flat, mx.array(idx))


def quantization(model):
    """[[module, its class, bits, group size, mode]] of every quantised layer of model, sorted."""
    out = []
    for name, module in model.named_modules():
        bits = getattr(module, "bits", None)
        if bits is not None:
            out.append([name, type(module).__name__, bits, getattr(module, "group_size", None),
                        getattr(module, "mode", None)])
    return sorted(out)


def cache_kinds(model, max_kv_size=None):
    """[[cache class, its int fields]] of each layer's KV cache as model makes it."""
    out = []
    for c in make_prompt_cache(model, max_kv_size):
        fields = {k: getattr(c, k) for k in ("max_size", "keep", "chunk_size", "step", "bits", "group_size")
                  if isinstance(getattr(c, k, None), int)}
        out.append([type(c).__name__, fields])
    return out


def model_fingerprint(model: Any, max_kv_size: int | None = None, options: Mapping[str, Any] | None = None) -> str:
    """A hex SHA-256 naming the exact model and the KV cache it makes.

    Args:
        model: an mlx-lm model (mlx_lm.load(path)[0], or built in code).
        max_kv_size: the engine's rotating-cache size, if any (it changes
            the cache, so the state).
        options: any other engine options that change the KV state (a
            server's kv_bits, kv_group_size, quantized_kv_start), as a
            JSON-able dict.

    Returns:
        64 hex digits; the same for the same weights, config and cache in
        any process, different when any of them differs.
    """
    extra = json.dumps(options or {}, sort_keys=True, default=str)
    key = (id(model), max_kv_size, extra)
    hit = _seen.get(key)
    if hit is not None and hit[0]() is model:
        return hit[1]
    h = hashlib.sha256()

    def put(obj):
        raw = json.dumps(obj, sort_keys=True, default=str, separators=(",", ":")).encode()
        h.update(len(raw).to_bytes(8, "little") + raw)

    put({"version": _VERSION, "config": _config(model), "quantization": quantization(model),
         "cache": cache_kinds(model, max_kv_size), "max_kv_size": max_kv_size, "options": options or {}})
    params = sorted(tree_flatten(model.parameters()), key=lambda kv: kv[0])
    samples = [_sample(a) for _, a in params]
    mx.eval(samples)
    for (name, a), s in zip(params, samples):
        put([name, str(a.dtype), list(a.shape)])
        h.update(memoryview(np.asarray(s)).cast("B"))
    fp = h.hexdigest()
    try:
        _seen[key] = (weakref.ref(model, lambda _r, k=key: _seen.pop(k, None)), fp)
    except TypeError:
        pass                # an object without weak references: computed again next time
    return fp


def model_label(model):
    """A short name for people: the model type and its parameter count."""
    kind = _config(model).get("model_type") or type(model).__module__.rsplit(".", 1)[-1]
    n = sum(a.size for _, a in tree_flatten(model.parameters()))
    return f"{kind} {n / 1e6:.1f}M" if n < 1e9 else f"{kind} {n / 1e9:.1f}B"
