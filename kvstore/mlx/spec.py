"""What kvstore knows of a model: its identity, the quant bits of its
weights, its context size and the KV cache it makes, built once from the
model (ModelSpec.of) for the engine, the MLX adapter and kvstore serve.

The quant bits and the context size go in every checkpoint's header
(docs/format.md §2): a checkpoint of a larger context is never loaded, and
the quant bits can be made part of the match.  They are read here only:
from the model directory's config.json where the caller has it (kvstore
serve), else from the loaded model (its args, its quantised layers)."""

from __future__ import annotations

import collections
import dataclasses
import hashlib
from collections.abc import Mapping
from typing import Any

from kvstore.identity import ModelIdentity
from kvstore.mlx.fingerprint import cache_kinds, model_fingerprint, model_label, quantization

# The context size of a model whose configuration names none.
DEFAULT_CTX_SIZE = 32768
WEIGHT_BITS = (2, 3, 4, 5, 6, 8)


def _get(config, key):
    """config[key] of a dict (config.json) or an args object (model.args), or None."""
    return config.get(key) if isinstance(config, dict) else getattr(config, key, None)


def quant_bits(config):
    """The quant bits of the weights config describes (16 when unquantised)."""
    q = _get(config, "quantization") or _get(config, "quantization_config") or {}
    return int(q["bits"]) if isinstance(q, dict) and q.get("bits") in WEIGHT_BITS else 16


def ctx_size(config):
    """The context size config describes (DEFAULT_CTX_SIZE when it names none)."""
    return int(_get(config, "max_position_embeddings") or DEFAULT_CTX_SIZE)


# (ModelSpec.of's arguments of the same names hide these.)
_bits_of, _ctx_of = quant_bits, ctx_size


def weight_bits(model):
    """The quant bits of most of a loaded model's quantised layers (16: none is)."""
    bits = collections.Counter(row[2] for row in quantization(model) if row[2] in WEIGHT_BITS)
    return bits.most_common(1)[0][0] if bits else 16


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A model as a store sees it.

    Attributes:
        identity: its kvstore.identity.ModelIdentity (the fingerprint names
            every file its state is stored in; docs/semantics.md §17).
        quant_bits: the quant bits of its weights (16: unquantised).
        ctx_size: its context size.
        kv_kinds: the class of each layer's KV cache ("KVCache",
            "RotatingKVCache", "ArraysCache", ...).
    """
    identity: ModelIdentity
    quant_bits: int
    ctx_size: int
    kv_kinds: tuple[str, ...]

    @classmethod
    def of(cls, model: Any, max_kv_size: int | None = None, options: Mapping[str, Any] | None = None,
           draft: Any = None, config: Mapping[str, Any] | None = None, label: str | None = None,
           quant_bits: int | None = None, ctx_size: int | None = None) -> ModelSpec:
        """The spec of a loaded mlx-lm model.

        Args:
            max_kv_size, options: what else changes its KV state (a
                rotating cache's size; a server's kv_bits, kv_group_size,
                quantized_kv_start): part of the identity.
            draft: a draft model whose cache rides along (its fingerprint
                joins the identity).
            config: the model directory's config.json, where the caller
                has it: the quant bits and the context size are read from
                it first.
            label: a name for people (default: the model type and size).
            quant_bits, ctx_size: the caller's, over what the model says.
        """
        fingerprint = model_fingerprint(model, max_kv_size, options)
        if draft is not None:
            fingerprint = hashlib.sha256(
                f"{fingerprint}+draft:{model_fingerprint(draft, options=options)}".encode()).hexdigest()
        args = getattr(model, "args", None)
        if quant_bits is None:
            quant_bits = _bits_of(config) if config is not None else 16
            quant_bits = quant_bits if quant_bits != 16 else weight_bits(model)
        if ctx_size is None:
            named = config if config is not None and _get(config, "max_position_embeddings") else args
            ctx_size = _ctx_of(named)
        kinds = tuple(kind for kind, _ in cache_kinds(model, max_kv_size))
        return cls(ModelIdentity(fingerprint, label or model_label(model)), int(quant_bits), int(ctx_size), kinds)

    def store_settings(self) -> dict[str, int]:
        """The kvstore.Settings a store of this model's state takes from it."""
        return {"quant_bits": self.quant_bits, "ctx_size": self.ctx_size}


__all__ = ["ModelSpec", "quant_bits", "ctx_size", "weight_bits", "DEFAULT_CTX_SIZE", "WEIGHT_BITS"]
