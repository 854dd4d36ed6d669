"""kvstore for MLX: mlx-lm prompt caches on disk and an engine for PromptCache.

    import kvstore, kvstore.mlx
    engine = kvstore.mlx.MLXEngine(model, tokenizer)
    store = kvstore.KVStore("~/.cache/kvstore", model_identity=engine.identity)
    server = kvstore.PromptCache(store, engine)
    text, report = engine.generate(server, prompt, max_tokens=64)

save_prompt_cache / load_prompt_cache store and restore any mlx-lm prompt
cache (a list of per-layer caches) under the prompt text it belongs to, for
the model it belongs to (model_fingerprint names it, docs/semantics.md §17).

Rooms: codecs (each mlx-lm cache class <-> named arrays and a JSON meta),
fingerprint (a model's identity), canary (a restored state checked against
the live model), stored (save and load through a store), engine (MLXEngine,
token bytes), mlxlm (the one module that touches mlx-lm's internals, and the
supported mlx-lm releases: an unsupported one fails this import).
"""

# First: an mlx-lm release outside SUPPORTED_MLX_LM fails here, with its version.
from kvstore.mlx.mlxlm import SUPPORTED_MLX_LM
from kvstore.mlx.codecs import cache_to_tensors, supported, tensors_to_cache
from kvstore.mlx.engine import MLXEngine
from kvstore.mlx.fingerprint import model_fingerprint
from kvstore.mlx.stored import load_prompt_cache, save_prompt_cache

# What an MLX user needs: mlx-lm's save/load_prompt_cache through a store,
# the engine PromptCache drives, a model's identity, a cache's tensors and
# back, and which caches and mlx-lm releases are supported.  The rest is in
# the submodules: codecs (cache classes, checked states, quantised names),
# engine (token bytes and text offsets), fingerprint (model_label), canary.
__all__ = ["MLXEngine", "save_prompt_cache", "load_prompt_cache", "model_fingerprint",
           "cache_to_tensors", "tensors_to_cache", "supported", "SUPPORTED_MLX_LM"]
