"""kvstore for MLX: mlx-lm prompt caches on disk and an engine for PromptCache.

    import kvstore, kvstore.mlx
    engine = kvstore.mlx.MLXEngine(model, tokenizer)
    store = kvstore.KVStore("~/.cache/kvstore", model_identity=engine.identity)
    server = kvstore.PromptCache(store, engine)
    text, report = engine.generate(server, prompt, max_tokens=64)

save_prompt_cache / load_prompt_cache store and restore any mlx-lm prompt
cache (a list of per-layer caches) under the prompt text it belongs to, for
the model it belongs to (model_fingerprint names it, docs/format.md §17).

Rooms: codecs (each mlx-lm cache class <-> named arrays and a JSON meta),
fingerprint (a model's identity), canary (a restored state checked against
the live model), stored (save and load through a store), engine (MLXEngine,
token bytes), mlxlm (the one module that touches mlx-lm's internals, and the
supported mlx-lm releases: an unsupported one fails this import).
"""

# First: an mlx-lm release outside SUPPORTED_MLX_LM fails here, with its version.
from kvstore.mlx.mlxlm import SUPPORTED_MLX_LM
from kvstore.mlx.codecs import (CACHE_CLASSES, cache_from_checkpoint, cache_state, cache_to_tensors,
                                checked_state, checked_tensors, quantized_names, same_layout, supported,
                                tensors_to_cache)
from kvstore.mlx.engine import (DEFAULT_CTX_SIZE, MLXEngine, bytes_to_unicode, text_offsets_function,
                                token_bytes_function)
from kvstore.mlx.fingerprint import model_fingerprint, model_label
from kvstore.mlx.stored import load_prompt_cache, save_prompt_cache

__all__ = ["MLXEngine", "save_prompt_cache", "load_prompt_cache", "model_fingerprint", "model_label",
           "cache_to_tensors", "tensors_to_cache", "cache_state", "checked_state", "checked_tensors",
           "cache_from_checkpoint", "quantized_names", "same_layout", "supported", "CACHE_CLASSES",
           "token_bytes_function", "text_offsets_function", "bytes_to_unicode", "DEFAULT_CTX_SIZE", "SUPPORTED_MLX_LM"]
