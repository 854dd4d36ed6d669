"""A tiny offline tokenizer and random-weight mlx-lm model: the demo's default, and the tests'.

Nothing here downloads anything:

- make_tokenizer(dir) trains a byte-level BPE (tokenizers library) on English
  text that ships with Python itself (standard-library docstrings), with the
  chat markers <s> </s> <|user|> <|assistant|> <|system|> as special tokens;
- make_model(...) builds an mlx_lm.models.llama.Model with random weights
  from a fixed seed; sliding_window=... gives a model whose sliding layers use
  RotatingKVCache (make_cache(model) is mlx-lm's own cache for it) and
  rotating_cache(model, max_kv_size) the RotatingKVCache(keep=4) list that
  mlx-lm's generate(max_kv_size=...) uses;
- write_model_dir(path, ...) writes config.json, model.safetensors and the
  tokenizer files so that mlx_lm.load(path) loads it offline.

Everything is small: a tokenizer trains in about 0.1 s (once per process),
a model builds in milliseconds.
"""

import functools
import json
import os

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models import cache as mlc
from mlx_lm.models import llama
from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers
from kvstore.mlx.engine import bytes_to_unicode

VOCAB_SIZE = 2000
SPECIAL_TOKENS = ["<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"]

# Jinja twin of Tokenizer.render_chat, for tokenizer.apply_chat_template.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

# CHAT_TEMPLATE plus what agents send: the tool list, an assistant's tool
# calls and reasoning, a tool result's call id.  Messages without them render
# as CHAT_TEMPLATE renders them; no marker mlx-lm would take for a tool
# parser (the random-weight model never calls a tool itself).
TOOL_CHAT_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|system|>\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}</s>\n{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>\n"
    "{% if m.get('reasoning_content') %}[think]{{ m['reasoning_content'] }}[/think]{% endif %}"
    "{{ m['content'] }}"
    "{% for c in m.get('tool_calls') or [] %}[call {{ c['id'] }}]{{ c['function'] | tojson }}[/call]{% endfor %}"
    "{% if m.get('tool_call_id') %}[for {{ m['tool_call_id'] }}]{% endif %}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

# Standard-library modules whose docstrings are the training text: plain
# English about programming, present in every CPython 3.11+.
_CORPUS_MODULES = [
    "argparse", "asyncio", "base64", "bisect", "calendar", "collections", "concurrent.futures",
    "contextlib", "csv", "dataclasses", "datetime", "decimal", "difflib", "email", "enum",
    "fractions", "functools", "gettext", "glob", "gzip", "heapq", "hmac", "html", "http.client",
    "inspect", "io", "ipaddress", "itertools", "json", "logging", "mailbox", "math", "os",
    "pathlib", "pickle", "pprint", "queue", "random", "re", "shlex", "shutil", "socket",
    "sqlite3", "statistics", "string", "subprocess", "tarfile", "tempfile", "textwrap",
    "threading", "timeit", "unittest", "urllib.parse", "uuid", "warnings", "zipfile",
]

_CHAT_TEXT = """\
<|system|>
You are a helpful assistant. Answer briefly and clearly.</s>
<|user|>
What is a key-value cache in a language model?</s>
<|assistant|>
It stores the attention keys and values of the tokens already processed, so the model
does not compute them again.</s>
<|user|>
Why would anyone keep it on disk?</s>
<|assistant|>
A long prompt that comes back later can be loaded instead of prefilled again, which saves time.</s>
"""


def module_docstrings(names):
    """The docstrings of the named modules and of the classes and functions
    each defines, in order (modules that do not import are skipped)."""
    import importlib
    import inspect
    parts = []
    for name in names:
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        parts.append(inspect.getdoc(mod) or "")
        for _, obj in sorted(vars(mod).items()):
            if (inspect.isfunction(obj) or inspect.isclass(obj)) and getattr(obj, "__module__", None) == name:
                parts.append(inspect.getdoc(obj) or "")
    return [p for p in parts if p]


def prose(names):
    """English text without chat markers for test prompts: module docstrings, ASCII only."""
    text = "\n\n".join(module_docstrings(names))
    return text.encode("ascii", "ignore").decode("ascii").replace("<|", "< |")


def text_of_tokens(tok, text, n):
    """The shortest prefix of text (whole characters) that tokenizes to exactly
    n tokens, or None when there is none (or text holds fewer than n)."""
    if len(tok.encode(text)) < n:
        return None
    lo, hi = 0, len(text)
    while lo < hi:                       # the first length with >= n tokens
        mid = (lo + hi) // 2
        if len(tok.encode(text[:mid])) >= n:
            hi = mid
        else:
            lo = mid + 1
    for c in range(lo, min(lo + 64, len(text))):
        if len(tok.encode(text[:c])) == n:
            return text[:c]
    return None


def _corpus():
    return [_CHAT_TEXT] + module_docstrings(_CORPUS_MODULES)


@functools.lru_cache(maxsize=None)
def _trained_json(vocab_size):
    tok = _HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_corpus(), trainer=trainer)
    return tok.to_str()


@functools.lru_cache(maxsize=None)
def _byte_decoder():
    """GPT-2's byte <-> printable-character table, inverted (char -> byte)."""
    return {c: b for b, c in bytes_to_unicode().items()}


class Tokenizer:
    """A byte-level BPE with chat markers; ids are plain Python ints.

    Attributes:
        path: directory holding tokenizer.json, tokenizer_config.json and
            special_tokens_map.json.
        bos_id, eos_id, user_id, assistant_id, system_id: marker token ids.
        vocab_size: number of ids (<= VOCAB_SIZE).
    """

    def __init__(self, hf, path):
        self.hf = hf
        self.path = path
        ids = {t: hf.token_to_id(t) for t in SPECIAL_TOKENS}
        self.bos_id, self.eos_id = ids["<s>"], ids["</s>"]
        self.user_id, self.assistant_id = ids["<|user|>"], ids["<|assistant|>"]
        self.system_id = ids["<|system|>"]
        self.special_ids = frozenset(ids.values())
        self.vocab_size = hf.get_vocab_size()

    def encode(self, text):
        """text (str) -> list of ids; chat markers in the text become their special ids."""
        return self.hf.encode(text, add_special_tokens=False).ids

    def decode(self, ids):
        """ids -> str (special tokens included)."""
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=False)

    def token_bytes(self, ids):
        """The exact bytes of the ids: a token may hold part of a UTF-8 character."""
        table = _byte_decoder()
        out = bytearray()
        for i in ids:
            piece = self.hf.id_to_token(int(i))
            if int(i) in self.special_ids:
                out += piece.encode("utf-8")
            else:
                out += bytes(table[ch] for ch in piece)
        return bytes(out)

    def render_chat(self, messages, add_generation_prompt=True):
        """messages [{"role", "content"}] -> the prompt text (same as CHAT_TEMPLATE)."""
        text = "<s>" + "".join(f"<|{m['role']}|>\n{m['content']}</s>\n" for m in messages)
        return text + ("<|assistant|>\n" if add_generation_prompt else "")


def make_tokenizer(tmpdir, vocab_size=VOCAB_SIZE, chat_template=CHAT_TEMPLATE):
    """Trains (once per process) and writes the tokenizer files into tmpdir
    (with chat_template: CHAT_TEMPLATE, or TOOL_CHAT_TEMPLATE for agents).

    Returns:
        Tokenizer.
    """
    path = os.fspath(tmpdir)
    os.makedirs(path, exist_ok=True)
    raw = _trained_json(vocab_size)
    with open(os.path.join(path, "tokenizer.json"), "w", encoding="utf-8") as f:
        f.write(raw)
    special = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": None, "pad_token": "</s>"}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 1 << 20,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "chat_template": chat_template,
        "additional_special_tokens": SPECIAL_TOKENS[2:],
        **{k: v for k, v in special.items() if v is not None},
    }
    with open(os.path.join(path, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=1)
    with open(os.path.join(path, "special_tokens_map.json"), "w", encoding="utf-8") as f:
        json.dump({k: v for k, v in special.items() if v is not None}, f, indent=1)
    return Tokenizer(_HFTokenizer.from_str(raw), path)


def model_config(layers=2, hidden=64, heads=4, kv_heads=2, vocab=VOCAB_SIZE, head_dim=None,
                 intermediate=None, sliding_window=None, sliding_layers=None):
    """The config.json dict of a small llama.

    Args:
        sliding_window: when set, the layers listed in sliding_layers (default:
            every layer but the last; llama needs one full-attention layer)
            attend over that many tokens and use RotatingKVCache.
    """
    cfg = {
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": intermediate or 2 * hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim or hidden // heads,
        "rms_norm_eps": 1e-5,
        "vocab_size": vocab,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "bos_token_id": 0,
        "eos_token_id": 1,
    }
    if sliding_window is not None:
        sliding = set(range(layers - 1) if sliding_layers is None else sliding_layers)
        cfg["sliding_window"] = sliding_window
        cfg["layer_types"] = ["sliding_attention" if i in sliding else "full_attention"
                              for i in range(layers)]
    return cfg


def make_model(seed=0, layers=2, hidden=64, heads=4, kv_heads=2, vocab=VOCAB_SIZE, dtype=None, **kw):
    """A random-weight mlx_lm llama Model (float32), the same for the same arguments.

    Args:
        seed: mx.random seed for the weights.
        dtype: the weights' dtype by name ("bfloat16": the KV cache is then
            bfloat16 too); None: float32.
        kw: head_dim, intermediate, sliding_window, sliding_layers (see model_config).
    """
    cfg = model_config(layers, hidden, heads, kv_heads, vocab, **kw)
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs.from_dict(cfg))
    if dtype is not None:
        model.set_dtype(getattr(mx, dtype))
    mx.eval(model.parameters())
    model.config = cfg
    return model


def make_cache(model):
    """mlx-lm's own prompt cache for model (RotatingKVCache on sliding layers)."""
    return mlc.make_prompt_cache(model)


def rotating_cache(model, max_kv_size, keep=4):
    """The cache mlx-lm's generate(max_kv_size=...) makes for a model without make_cache."""
    return [mlc.RotatingKVCache(max_size=max_kv_size, keep=keep) for _ in model.layers]


def prefill(model, cache, tokens, step=None):
    """Runs tokens through the model into cache; returns the last logits (evaluated).

    Args:
        step: chunk size (None: one chunk).
    """
    tokens = list(tokens)
    step = step or len(tokens)
    logits = None
    for i in range(0, len(tokens), step):
        logits = model(mx.array([tokens[i:i + step]]), cache=cache)
        mx.eval(logits, [a for _, a in tree_flatten([c.state for c in cache]) if isinstance(a, mx.array)])
    return logits[:, -1, :]


def write_model_dir(path, seed=0, tokenizer=None, chat_template=CHAT_TEMPLATE, **kw):
    """Writes a loadable model directory: config.json, model.safetensors, tokenizer files.

    Args:
        path: the directory (created).
        seed, kw: make_model arguments.
        tokenizer: a Tokenizer to copy the files of (default: make_tokenizer(path)).
        chat_template: the template of a tokenizer made here.

    Returns:
        (model, tokenizer) as built here; mlx_lm.load(path) gives the same model.
    """
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    if tokenizer is None or os.path.abspath(tokenizer.path) != os.path.abspath(path):
        tokenizer = make_tokenizer(path, chat_template=chat_template)
    model = make_model(seed, **kw)
    cfg = dict(model.config, bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_id)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    mx.save_safetensors(os.path.join(path, "model.safetensors"), dict(tree_flatten(model.parameters())),
                        metadata={"format": "mlx"})
    return model, tokenizer


__all__ = ["VOCAB_SIZE", "SPECIAL_TOKENS", "CHAT_TEMPLATE", "TOOL_CHAT_TEMPLATE", "Tokenizer", "make_tokenizer", "model_config",
           "module_docstrings", "prose", "text_of_tokens",
           "make_model", "make_cache", "rotating_cache", "prefill", "write_model_dir"]
