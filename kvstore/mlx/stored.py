"""mlx-lm prompt caches in a KVStore: save and load, for the model they belong to.

    store = kvstore.KVStore(path, model_identity=kvstore.mlx.model_fingerprint(model))
    kvstore.mlx.save_prompt_cache(store, text, tokens, cache, model)
    cache, tokens, text_bytes = kvstore.mlx.load_prompt_cache(store, prompt, model)

Both take the model (or an MLXEngine): a store holds one model's states
(docs/semantics.md §17), and a cache saved or restored through another model's
store would decode without an error and answer wrongly, so a mismatch is an
error here, not a miss.  A load checks what it restored with the live model
(kvstore.mlx.canary); a state the model would not have produced is a miss,
and its file is quarantined.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from kvstore.format import Entry, Reason
from kvstore.identity import check_holds
from kvstore.mlx import canary
from kvstore.mlx.codecs import cache_from_checkpoint, checked_state, quantized_names
from kvstore.mlx.fingerprint import model_fingerprint

if TYPE_CHECKING:
    from kvstore.store import KVStore

log = logging.getLogger("kvstore")

__all__ = ["save_prompt_cache", "load_prompt_cache", "model_of", "check_store"]


def model_of(model):
    """(the mlx-lm model, its identity string) of a model or an MLXEngine; (None, None) for None."""
    if model is None:
        return None, None
    identity = getattr(model, "identity", None)
    if identity is not None and hasattr(model, "model"):
        return model.model, identity.fingerprint
    return model, model_fingerprint(model)


def check_store(store, model):
    """The mlx-lm model of model (see model_of), after checking that store holds its state.

    Raises:
        ValueError: the store holds another model's state (or none named,
            for a model; or a model's, for None).
    """
    model, fingerprint = model_of(model)
    check_holds(store.path, store.model_identity, fingerprint,
                "KVStore(path, model_identity=kvstore.mlx.model_fingerprint(model))")
    return model


def save_prompt_cache(store: KVStore, text: str | bytes, tokens: Sequence[int] | np.ndarray, cache: list,
                      model: Any, reason: Reason = Reason.COLD, **kw: Any) -> Entry | None:
    """Stores an mlx-lm prompt cache as the checkpoint of text.

    Args:
        store: a kvstore.KVStore opened with the model's identity.
        text: the rendered prompt prefix (str or bytes) the cache was made from.
        tokens: the exact token ids prefilled into the cache; every cache
            offset must equal their count.
        cache: list of mlx-lm cache objects (see cache_to_tensors).
        model: the mlx-lm model that made the cache, or its MLXEngine (None
            only for a store that names no model).
        reason: kvstore.format.Reason recorded in the header.
        **kw: passed to KVStore.save (ctx_size, trailers, text_offsets: with
            them a chained store cuts the cache into blocks, each token's KV
            written once; see KVStore.save).

    Returns:
        the Entry written (or kept), or None when the store refused (too few
        tokens, over budget, disk error; logged).

    Raises:
        TypeError: an unsupported cache class.
        ValueError: a cache offset differs from the token count, or the
            store holds another model's state.
    """
    check_store(store, model)
    tensors, meta, positional = checked_state(cache, len(tokens))
    return store.save(text, tokens, tensors, meta=meta, reason=reason, positional=positional,
                      exact=quantized_names(meta), **kw)


def load_prompt_cache(store: KVStore, prompt: str | bytes, model: Any, check: bool = True
                      ) -> tuple[list, np.ndarray, bytes] | None:
    """Finds and loads the longest stored checkpoint that prefixes prompt.

    Args:
        store: a kvstore.KVStore opened with the model's identity.
        prompt: the full rendered prompt, str or bytes.
        model: the mlx-lm model to restore into, or its MLXEngine (None only
            for a store that names no model: nothing is checked then).
        check: run the canary (kvstore.mlx.canary.check): the last stored
            token is recomputed by the model (one token's forward) and its
            K/V rows compared with the stored ones; the cache returned then
            holds the recomputed rows of that token.  False: the state
            exactly as stored, unchecked.

    Returns:
        (cache, tokens, text_bytes): the rebuilt mlx-lm cache, the exact
        stored token ids (numpy uint32) and the stored text bytes (a byte
        prefix of prompt; prefill only the tokens of prompt after it).
        None on a miss, when the file was corrupt (it is then removed), or
        when the canary failed (it is then quarantined).

    Raises:
        ValueError: the store holds another model's state.
    """
    model = check_store(store, model)
    entry = store.find(prompt)
    if entry is None:
        return None
    ckpt = store.load(entry, into="mlx")
    if ckpt is None:
        return None
    cache = cache_from_checkpoint(store, ckpt)
    if cache is None:
        return None
    if check and model is not None:
        verdict = canary.check(model, cache, ckpt.tokens, ckpt.lossy)
        if not verdict.applies:
            log.info("kvstore: canary_not_applicable reason=no_attention_rows tokens=%d", len(ckpt.tokens))
        else:
            store.record_canary(ckpt.entry, verdict.ok, verdict.words())
            if not verdict.ok:
                return None
    return cache, ckpt.tokens, ckpt.text_bytes
