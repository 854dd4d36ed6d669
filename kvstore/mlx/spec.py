"""What kvstore reads of a model's configuration beside its identity: the
quant bits of its weights and its context size, in one place for the engine
(a loaded model's args) and for kvstore serve (the model directory's
config.json, read before the model loads).  Both go in every checkpoint's
header (docs/format.md §2): a checkpoint of a larger context is never
loaded, and the quant bits can be made part of the match."""

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
