"""MLXEngine: the PromptCache engine protocol for any mlx-lm model.

    engine = kvstore.mlx.MLXEngine(model, tokenizer)
    server = kvstore.PromptCache(store, engine)
    text, report = engine.generate(server, prompt, max_tokens=64)

Also here: the exact bytes a tokenizer's ids render to (a checkpoint's key
is bytes, the engine's state is token ids).
"""

import time
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

from kvstore.mlx import canary
from kvstore.mlx.codecs import cache_state, quantized_names, tensors_to_cache
from kvstore.mlx.spec import ModelSpec
from kvstore.mlx.mlxlm import hf_tokenizer

__all__ = ["MLXEngine", "token_bytes_function", "text_offsets_function", "bytes_to_unicode"]


def bytes_to_unicode():
    """GPT-2's reversible byte <-> printable-character table (byte-level BPE)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def token_bytes_function(tokenizer):
    """A function ids -> the exact bytes those tokens render to.

    Uses the tokenizer's own ``token_bytes`` when it has one; otherwise the
    vocabulary of a byte-level BPE (GPT-2 style) or a SentencePiece model
    (``▁`` for spaces, ``<0xNN>`` byte tokens); otherwise decode().
    """
    own = getattr(tokenizer, "token_bytes", None)
    if callable(own):
        return own
    hf = hf_tokenizer(tokenizer)
    convert = getattr(hf, "convert_ids_to_tokens", None)
    if convert is not None:
        byte_of = {c: b for b, c in bytes_to_unicode().items()}
        specials = set(getattr(hf, "all_special_ids", []) or [])

        def piece_bytes(i, piece):
            if i in specials:
                return piece.encode("utf-8")
            if piece.startswith("<0x") and piece.endswith(">") and len(piece) == 6:
                return bytes([int(piece[3:5], 16)])
            if all(ch in byte_of for ch in piece):
                return bytes(byte_of[ch] for ch in piece)
            return piece.replace("\u2581", " ").encode("utf-8")

        # Each id's bytes, converted once: a server keys every request by
        # its whole prompt's bytes, and the tokenizer's per-id conversion
        # costs a few microseconds a token.
        known = {}

        def from_vocab(ids):
            ids = [int(i) for i in ids]
            new = [i for i in dict.fromkeys(ids) if i not in known]
            if new:
                for i, p in zip(new, convert(new)):
                    known[i] = piece_bytes(i, p)
            return b"".join([known[i] for i in ids])
        return from_vocab

    def from_decode(ids):
        return tokenizer.decode([int(i) for i in ids]).encode("utf-8")
    # decode() may merge or drop spaces across tokens: the bytes of a
    # sequence are not the tokens' own bytes joined.
    from_decode.concatenative = False
    return from_decode


def text_offsets_function(token_bytes):
    """A function (ids, text length) -> where each token's text starts, for chained saves.

    Returns an array of len(ids) + 1 byte offsets (offsets[i]: the bytes of
    the first i tokens), built from each token's own bytes (cached per id),
    or None when token_bytes(ids) is not the concatenation of the tokens' own
    bytes (a decode() that merges across tokens): the store then saves the
    sequence as one block.
    """
    lengths = {}
    if not getattr(token_bytes, "concatenative", True):
        return lambda ids, text_len: None

    def offsets(ids, text_len):
        ids = [int(i) for i in ids]
        for i in set(ids) - lengths.keys():
            lengths[i] = len(token_bytes([i]))
        out = np.zeros(len(ids) + 1, dtype=np.int64)
        np.cumsum(np.fromiter((lengths[i] for i in ids), dtype=np.int64, count=len(ids)), out=out[1:])
        return out if int(out[-1]) == text_len else None
    return offsets


class MLXEngine:
    """The PromptCache Engine protocol for any mlx-lm model.

    Args:
        model: an mlx-lm model (``mlx_lm.load(path)[0]`` or built in code).
        tokenizer: its tokenizer (an mlx-lm TokenizerWrapper, a transformers
            tokenizer, or anything with encode/decode).
        model_id: header model id (0..255) for this model's checkpoints.
            The model itself is named by its fingerprint (``identity``):
            open the store with ``KVStore(path, model_identity=engine.identity)``.
        quant_bits: quant bits of the weights (default: read from the model).
        ctx_size: context size (default: the model's max positions or 32768).
        user_marker, assistant_marker: token strings that open a user and an
            assistant turn in the chat rendering (default: the tokenizer's
            ``user_id``/``assistant_id`` attributes, else none).
        max_kv_size: a rotating cache of this many tokens (None: full cache).
    """

    load_into = "mlx"

    def __init__(self, model: Any, tokenizer: Any, model_id: int = 0, quant_bits: int | None = None,
                 ctx_size: int | None = None, user_marker: str | None = None, assistant_marker: str | None = None,
                 max_kv_size: int | None = None) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.model_id = model_id
        # What a store needs of the model, read once (kvstore.mlx.spec): its
        # checkpoints name it, and only its own are restored (docs/semantics.md §17).
        self.spec = ModelSpec.of(model, max_kv_size, quant_bits=quant_bits, ctx_size=ctx_size or None)
        self.identity, self.quant_bits, self.ctx_size = self.spec.identity, self.spec.quant_bits, self.spec.ctx_size
        self.user_id = self._marker_id(user_marker, "user_id")
        self.assistant_id = self._marker_id(assistant_marker, "assistant_id")
        self.max_kv_size = max_kv_size
        self.token_bytes = token_bytes_function(tokenizer)
        self.text_offsets = text_offsets_function(self.token_bytes)
        self.cache = make_prompt_cache(model, max_kv_size)
        self.eos_ids = self._eos_ids()
        self._no_specials = _accepts_special_flag(tokenizer)

    def _marker_id(self, marker, attr):
        if marker is None:
            v = getattr(self.tokenizer, attr, None)
            return int(v) if v is not None else -1
        ids = self.tokenizer.encode(marker, add_special_tokens=False) \
            if _accepts_special_flag(self.tokenizer) else self.tokenizer.encode(marker)
        if len(ids) != 1:
            raise ValueError(f"marker {marker!r} is not a single token (got {len(ids)} ids)")
        return int(ids[0])

    def _eos_ids(self):
        ids = set(getattr(self.tokenizer, "eos_token_ids", None) or [])
        eos = getattr(self.tokenizer, "eos_token_id", None) or getattr(self.tokenizer, "eos_id", None)
        if eos is not None:
            ids.add(int(eos))
        return ids

    # -- the Engine protocol -------------------------------------------------

    def tokenize(self, text):
        s = text.decode("utf-8")
        if not s:
            return []
        if self._no_specials:
            return list(self.tokenizer.encode(s, add_special_tokens=False))
        return list(self.tokenizer.encode(s))

    def reset(self):
        self.cache = make_prompt_cache(self.model, self.max_kv_size)

    def prefill(self, tokens):
        logits = self.model(mx.array(tokens, dtype=mx.uint32)[None], cache=self.cache)
        last = logits[0, -1]
        mx.eval(last, [c.state for c in self.cache])
        return last

    def snapshot(self):
        return cache_state(self.cache)

    def exact_names(self, meta):
        """The tensors of a snapshot's meta that are quantised already (a lossy codec leaves them exact)."""
        return quantized_names(meta)

    def restore(self, tensors, meta):
        self.cache = tensors_to_cache(tensors, meta)

    def trim(self, n):
        if not can_trim_prompt_cache(self.cache):
            return False
        return trim_prompt_cache(self.cache, n) == n

    @property
    def fingerprint(self):
        """The model's identity string (kvstore.mlx.model_fingerprint)."""
        return self.identity.fingerprint

    def canary_prepare(self, tokens, lossy=""):
        """Starts the canary of the state just restored (kvstore.mlx.canary.prepare)."""
        return canary.prepare(self.model, self.cache, tokens, lossy)

    def canary_finish(self, probe):
        """The tail canary's Verdict once the state holds probe.position again."""
        return canary.finish(probe, self.cache)

    # -- the whole request ---------------------------------------------------

    def generate(self, prompt_cache, prompt, max_tokens=32, temperature=0.0, progress=None, seed=None,
                 keep_generated=True):
        """Runs one request: lookup, load, chunked prefill with stores, sampling.

        Args:
            prompt_cache: kvstore.PromptCache over this engine.
            prompt: the rendered prompt (str or bytes).
            max_tokens: tokens to generate at most (stops at EOS).
            temperature: 0 for greedy decoding.
            progress: optional callable(done, total) during the prefill.
            keep_generated: keep the generated tokens in the live session
                (False: trim them, for a caller whose next prompt renders the
                reply its own way).

        Returns:
            (generated token ids, report dict: source, reused_tokens (the
            stored tokens restored), prefilled_tokens (the tokens the model
            computed: after a tail canary the last restored one again),
            ttft_ms, load_ms, save_ms, stored, generated, canary: "" (no
            restore), "tail", "head", "none" (nothing to compare) or
            "failed" (the restore became a cold start)).
        """
        if seed is not None:
            mx.random.seed(seed)
        req = prompt_cache.begin(prompt)
        logits = prompt_cache.prefill(req, progress=progress)
        out = []
        y = self._sample(logits, temperature)
        ttft = (time.perf_counter() - req.started) * 1e3
        while True:
            out.append(y)
            if y in self.eos_ids or len(out) >= max_tokens:
                break
            logits = self.prefill([y])
            prompt_cache.extend([y])
            y = self._sample(logits, temperature)
        if not keep_generated:
            prompt_cache.rewind(len(prompt_cache.live_tokens) - len(req.tokens))
        report = {"source": req.source, "reused_tokens": req.reused, "prefilled_tokens": req.prefilled,
                  "ttft_ms": ttft, "load_ms": req.load_ms, "save_ms": req.save_ms,
                  "stored": list(req.stored), "generated": len(out), "canary": req.canary}
        return out, report

    @staticmethod
    def _sample(logits, temperature):
        if temperature <= 0:
            return int(mx.argmax(logits).item())
        return int(mx.random.categorical(logits * (1.0 / temperature)).item())


def _accepts_special_flag(tok):
    try:
        tok.encode("a", add_special_tokens=False)
        return True
    except TypeError:
        return False
