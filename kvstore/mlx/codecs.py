"""mlx-lm prompt caches <-> kvstore payloads: the cache codecs.

This module owns the mapping between a list of mlx-lm cache objects (one per
layer: KVCache, RotatingKVCache, QuantizedKVCache, ArraysCache, ...) and a
kvstore payload: named MLX arrays plus a JSON meta.  It leaves the file, the
lookup and every storage policy to KVStore, and the serving policy (what to
store, when) to its callers.

Tensors are named "{layer}.{i}": slot i of the layer's flattened state.  The
meta is

    {"version": 1,
     "layers": [{"class": "KVCache", "offset": 300, "meta_state": {...},
                 "n_state": 2, "state_is_none": [false, false]}, ...]}

where "class" is a name in CACHE_CLASSES (an explicit registry: nothing read
from a file ever names a Python object directly), "meta_state" holds the
class's scalars by name, and "state_is_none" marks the slots that are None
(an empty ArraysCache slot, an unused left_padding) and so have no tensor.

For chained checkpoints (docs/format.md §14) every slot that holds the
positions 0..offset along axis 2 (KVCache, QuantizedKVCache and a filled
ConcatenateKVCache: the KV of every token, MLA latents included) is
"positional": the store keeps each block's slice of it.  Every other slot (a
RotatingKVCache window, a ChunkedKVCache chunk, an ArraysCache's recurrent
state) is a snapshot of the state at the end of the save.

Only the filled part of each buffer is written.  mlx-lm grows KVCache and
QuantizedKVCache buffers in steps of 256 tokens and its own `state` returns
the whole buffer, so its save_prompt_cache writes a 300-token cache as 512
tokens; here it is 300.  A restored KVCache holds a buffer exactly `offset`
long; the first update_and_fetch grows it the way mlx-lm grows any buffer
whose length is not a multiple of the step, and the attention sees the same
keys in the same order, so generation continues bit for bit.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
from collections.abc import Mapping
from typing import Any, Callable

import mlx.core as mx
from mlx_lm.models import cache as mlc

from kvstore.errors import CorruptCheckpoint
from kvstore.mlx.mlxlm import rotating_write_index, set_rotating_write_index

log = logging.getLogger("kvstore")

META_VERSION = 1

# A CacheList nests caches; real models nest one level.  A deeper nesting in
# a file is a corrupt (or hostile) meta, not a model.
MAX_NESTING = 4


# ---- per-class codecs ------------------------------------------------------
#
# Each codec turns one cache into (slots, meta_state) and back.  The slots are
# a flat list of MLX arrays or None; meta_state is a dict of named ints.  The
# codecs read and set the caches' attributes instead of going through
# mlx-lm's `state` / `from_state`: `state` returns unfilled buffer space, and
# the scalars it carries have moved between mlx-lm releases (meta_state in
# older ones, state in newer ones), while the attribute names have not.


def _bad(detail, reason="bad_cache_meta"):
    return CorruptCheckpoint(reason, None, detail)


# Every array handed out is a new array object viewing the cache's memory
# (a slice: no copy).  Never the cache's own object: mlx-lm updates caches in
# place with `self.keys[..., i:j, :] = ...`, which rebinds that very Python
# object to the new contents, so a tensors dict holding it (a save queued on
# a background writer) would silently write tokens from later steps.  A view
# keeps the old buffer alive, so MLX cannot donate it to the update either.

def _filled(a, n):
    """View of the first n positions of a [..., positions, dim] buffer."""
    return a[..., :n, :]


def _view(a):
    """View of a whole array (anything else, None included, as is)."""
    return a[...] if isinstance(a, mx.array) else a


def _check_kv(keys, values, length, what):
    """keys/values must both be present (or both None), 4-D, `length` tokens long."""
    if keys is None or values is None:
        if keys is not values:
            raise _bad(f"{what}: keys and values must both be present or both absent")
        if length:
            raise _bad(f"{what}: no keys but length {length}")
        return
    if keys.ndim != 4 or values.ndim != 4 or keys.shape[:3] != values.shape[:3]:
        raise _bad(f"{what}: keys {keys.shape} and values {values.shape} do not pair")
    if keys.shape[2] != length:
        raise _bad(f"{what}: buffer holds {keys.shape[2]} tokens, expected {length}")


def _dump_kv(c):
    if c.keys is None:
        return [None, None], {}
    return [_filled(c.keys, c.offset), _filled(c.values, c.offset)], {}


def _build_kv(cls, slots, ms, offset, what):
    keys, values = slots
    _check_kv(keys, values, offset, what)
    c = cls()
    c.keys, c.values, c.offset = keys, values, offset
    return c


def _dump_concat(c):
    # ConcatenateKVCache has no spare buffer space (it concatenates), and its
    # keys_and_values ignores offset: the arrays are kept whole.
    return [_view(c.keys), _view(c.values)], {}


def _build_concat(cls, slots, ms, offset, what):
    keys, values = slots
    _check_kv(keys, values, 0 if keys is None else keys.shape[2], what)
    if keys is not None and offset > keys.shape[2]:
        raise _bad(f"{what}: offset {offset} beyond {keys.shape[2]} stored tokens")
    c = cls()
    c.keys, c.values, c.offset = keys, values, offset
    return c


def _dump_quantized(c):
    ms = {"group_size": int(c.group_size), "bits": int(c.bits), "parts": 0}
    if c.keys is None:
        return [], ms
    ms["parts"] = len(c.keys)
    return [_filled(a, c.offset) for a in (*c.keys, *c.values)], ms


def _build_quantized(cls, slots, ms, offset, what):
    parts = ms["parts"]
    if len(slots) != 2 * parts:
        raise _bad(f"{what}: {len(slots)} slots for {parts} quantized parts")
    c = cls(group_size=ms["group_size"], bits=ms["bits"])
    if parts:
        keys, values = list(slots[:parts]), list(slots[parts:])
        for k, v in zip(keys, values):
            _check_kv(k, v, offset, what)
        if parts >= 2:
            # Packed uint32 words vs scales: both must describe one head_dim.
            for q in (keys, values):
                dim = q[0].shape[-1] * 32 // ms["bits"]
                if q[1].shape[-1] * ms["group_size"] != dim:
                    raise _bad(f"{what}: scales {q[1].shape} do not match packed {q[0].shape}")
        c.keys, c.values = keys, values
    elif offset:
        raise _bad(f"{what}: no keys but offset {offset}")
    c.offset = offset
    return c


def _dump_rotating(c):
    ms = {"keep": int(c.keep), "max_size": int(c.max_size), "idx": int(rotating_write_index(c))}
    if c.keys is None:
        return [None, None], ms
    # Before the window wraps, a buffer grown in place is filled up to offset
    # and the rest is spare; once it wraps (or after a prompt longer than the
    # window went in at once) every position is live and the order of the
    # positions (the write index, the `keep` prefix) is kept as is.
    n = min(c.offset, c.keys.shape[2])
    return [_filled(c.keys, n), _filled(c.values, n)], ms


def _build_rotating(cls, slots, ms, offset, what):
    keys, values = slots
    length = 0 if keys is None else keys.shape[2]
    _check_kv(keys, values, length, what)
    if ms["max_size"] < 1 or ms["keep"] > ms["max_size"]:
        raise _bad(f"{what}: keep={ms['keep']} max_size={ms['max_size']}")
    if length > offset or ms["idx"] > length:
        raise _bad(f"{what}: idx={ms['idx']} length={length} offset={offset}")
    c = cls(max_size=ms["max_size"], keep=ms["keep"])
    c.keys, c.values, c.offset = keys, values, offset
    set_rotating_write_index(c, ms["idx"])
    return c


def _dump_chunked(c):
    ms = {"chunk_size": int(c.chunk_size), "start_position": int(c.start_position)}
    if c.keys is None:
        return [None, None], ms
    n = c.offset - c.start_position
    return [_filled(c.keys, n), _filled(c.values, n)], ms


def _build_chunked(cls, slots, ms, offset, what):
    keys, values = slots
    if ms["start_position"] > offset:
        raise _bad(f"{what}: start_position {ms['start_position']} beyond offset {offset}")
    _check_kv(keys, values, offset - ms["start_position"], what)
    c = cls(ms["chunk_size"])
    c.keys, c.values, c.offset, c.start_position = keys, values, offset, ms["start_position"]
    return c


def _dump_arrays(c):
    # Model-owned recurrent state (conv / SSM states): no spare space to cut.
    slots = [*c.cache, c.left_padding, getattr(c, "lengths", None)]
    return [_view(a) for a in slots], {"size": len(c.cache)}


def _build_arrays(cls, slots, ms, offset, what):
    size = ms["size"]
    if len(slots) != size + 2:
        raise _bad(f"{what}: {len(slots)} slots for size {size}")
    # Like mlx-lm's from_state: no __init__, whose signature differs between
    # ArraysCache(size) and its subclasses (MambaCache(left_padding=None)).
    c = cls.__new__(cls)
    c.cache = list(slots[:size])
    c.left_padding, c.lengths = slots[size], slots[size + 1]
    return c


def _dump_layer_cache(c):
    # deepseek_v41.LayerCache: a sliding window, compressed groups of
    # `ratio` tokens and their index keys, and the rows of the open group.
    # Nothing grows one row per token: every slot is a snapshot.
    slots = [c.window, c.compress_kv, c.index_k, c.pending_kv, c.pending_gate]
    return [_view(a) for a in slots], {"window_size": int(c.window_size)}


def _build_layer_cache(cls, slots, ms, offset, what):
    if len(slots) != 5:
        raise _bad(f"{what}: {len(slots)} slots, expected 5")
    window = slots[0]
    if window is not None and (window.ndim < 2 or window.shape[1] > max(ms["window_size"], offset)):
        raise _bad(f"{what}: window of {window.shape} for window_size {ms['window_size']}")
    c = cls(ms["window_size"])
    c.window, c.compress_kv, c.index_k, c.pending_kv, c.pending_gate = slots
    c.offset = offset
    return c


@dataclasses.dataclass(frozen=True)
class _Codec:
    cls: type
    dump: Callable            # cache -> (slots, meta_state)
    build: Callable           # (cls, slots, meta_state, offset, what) -> cache
    fields: tuple = ()        # meta_state keys, each a non-negative int
    has_offset: bool = True   # the cache counts tokens in .offset
    positional: bool = False  # its slots hold positions 0..offset along axis 2


def _codecs():
    table = [
        ("KVCache", _dump_kv, _build_kv, (), True),
        ("ConcatenateKVCache", _dump_concat, _build_concat, (), True),
        ("QuantizedKVCache", _dump_quantized, _build_quantized, ("group_size", "bits", "parts"), True),
        ("RotatingKVCache", _dump_rotating, _build_rotating, ("keep", "max_size", "idx"), False),
        ("ChunkedKVCache", _dump_chunked, _build_chunked, ("chunk_size", "start_position"), False),
        ("ArraysCache", _dump_arrays, _build_arrays, ("size",), False),
        ("MambaCache", _dump_arrays, _build_arrays, ("size",), False),     # older mlx-lm only
    ]
    out = {}
    for name, dump, build, fields, positional in table:
        cls = getattr(mlc, name, None)      # a class this mlx-lm lacks is left out
        if cls is not None:
            out[name] = _Codec(cls, dump, build, fields, has_offset=build is not _build_arrays,
                               positional=positional)
    # Cache classes a model module defines for itself, by "module.Class".
    for name, dump, build, fields in [("deepseek_v41.LayerCache", _dump_layer_cache, _build_layer_cache,
                                       ("window_size",))]:
        module, _, attr = name.partition(".")
        try:
            cls = getattr(importlib.import_module(f"mlx_lm.models.{module}"), attr, None)
        except Exception:                   # noqa: BLE001 - a model module this mlx-lm lacks or cannot import
            cls = None
        if cls is not None:
            out[name] = _Codec(cls, dump, build, fields)
    return out


_CODECS = _codecs()
_CACHE_LIST = getattr(mlc, "CacheList", None)

#: Stable name -> mlx-lm cache class: the only classes a payload can name.
CACHE_CLASSES = {name: codec.cls for name, codec in _CODECS.items()}
if _CACHE_LIST is not None:
    CACHE_CLASSES["CacheList"] = _CACHE_LIST

_NAMES = {cls: name for name, cls in CACHE_CLASSES.items()}


# ---- whole caches ----------------------------------------------------------

def _name_of(c):
    # Exact type: a subclass saved under its parent's name would come back as
    # the parent, without whatever the subclass changes.
    name = _NAMES.get(type(c))
    if name is None:
        raise TypeError(f"cache class {type(c).__module__}.{type(c).__qualname__} is not supported; "
                        f"supported: {sorted(CACHE_CLASSES)}")
    return name


def _dump_layer(c, depth=0):
    """One cache -> (layer meta, flat slot list, the positional axis of each slot or None)."""
    name = _name_of(c)
    if name == "CacheList":
        if depth >= MAX_NESTING:
            raise TypeError(f"CacheList nested deeper than {MAX_NESTING}")
        children, slots, axes = [], [], []
        for sub in c.caches:
            m, s, a = _dump_layer(sub, depth + 1)
            children.append(m)
            slots += s
            axes += a
        meta = {"class": name, "offset": None, "meta_state": {"children": children}}
    else:
        codec = _CODECS[name]
        slots, ms = codec.dump(c)
        meta = {"class": name, "offset": int(c.offset) if codec.has_offset else None, "meta_state": ms}
        # Positional: one row per token along axis 2, all of them (a
        # concatenating cache holding more than offset rows is a snapshot).
        axes = [2 if codec.positional and a is not None and a.ndim == 4 and a.shape[2] == c.offset else None
                for a in slots]
    for a in slots:
        if a is not None and not isinstance(a, mx.array):
            raise TypeError(f"{name} state holds a {type(a).__name__}, not an mx.array")
    meta["n_state"] = len(slots)
    meta["state_is_none"] = [a is None for a in slots]
    return meta, slots, axes


# Caches whose state is quantised already: a lossy disk codec leaves their
# tensors exact (quantising a scale again would move every value of its group).
QUANTIZED_CLASSES = ("QuantizedKVCache",)


def same_layout(got, expect):
    """Whether a restored cache (a list of layers) stands where mlx-lm made
    expect (make_prompt_cache): the same classes layer by layer, except that
    a QuantizedKVCache stands for a KVCache (mlx-lm quantises a KVCache as
    its prompt grows, with --kv-bits, and attends over either)."""
    return len(got) == len(expect) and all(
        type(g) is type(e) or (type(g).__name__ in QUANTIZED_CLASSES and type(e).__name__ == "KVCache")
        for g, e in zip(got, expect))


def _slot_classes(layer_meta):
    """The class of the cache each slot of a layer meta came from, CacheList children flattened."""
    if layer_meta["class"] == "CacheList":
        return [c for m in layer_meta["meta_state"]["children"] for c in _slot_classes(m)]
    return [layer_meta["class"]] * layer_meta["n_state"]


def quantized_names(meta):
    """The names (cache_state's) of the tensors of caches quantised already
    (QUANTIZED_CLASSES), for KVStore.save's exact=."""
    return {f"{li}.{i}" for li, lm in enumerate(meta["layers"]) for i, c in enumerate(_slot_classes(lm))
            if c in QUANTIZED_CLASSES}


def _offsets(layer_meta):
    """Every token offset recorded in a layer meta, CacheList children included."""
    if layer_meta["class"] == "CacheList":
        return [o for m in layer_meta["meta_state"]["children"] for o in _offsets(m)]
    off = layer_meta.get("offset")
    return [] if off is None else [off]


def cache_to_tensors(cache: list) -> tuple[dict[str, Any], dict[str, Any]]:
    """Flattens an mlx-lm prompt cache into named arrays and a JSON meta.

    Only the filled part of each buffer is kept (a slice, not yet a copy:
    KVStore.save makes it contiguous as it writes).

    Args:
        cache: list of mlx-lm cache objects, one per layer, of the classes in
            CACHE_CLASSES (exact types).

    Returns:
        (tensors, meta): tensors is a dict "{layer}.{i}" -> mx.array; meta is
        a JSON-serialisable dict (see the module docstring).

    Raises:
        TypeError: a cache of a class not in CACHE_CLASSES.
    """
    tensors, meta, _ = cache_state(cache)
    return tensors, meta


def cache_state(cache):
    """cache_to_tensors(cache) and the positional axis of each tensor that has one.

    Returns:
        (tensors, meta, positional): positional maps the name of every
        tensor that holds one row per token along an axis to that axis
        (KVSTore.save's positional=); the other tensors are snapshots.
    """
    tensors, layers, positional = {}, [], {}
    for li, c in enumerate(cache):
        meta, slots, axes = _dump_layer(c)
        layers.append(meta)
        for i, (a, axis) in enumerate(zip(slots, axes)):
            if a is not None:
                tensors[f"{li}.{i}"] = a
                if axis is not None:
                    positional[f"{li}.{i}"] = axis
    return tensors, {"version": META_VERSION, "layers": layers}, positional


def _nonneg_int(v, what):
    if type(v) is not int or v < 0:
        raise _bad(f"{what}={v!r} is not a non-negative int")
    return v


def _build_layer(lm, slots_of, what, depth=0, tokens=None):
    """Layer meta + a function giving its slots -> one cache object (offsets = tokens when given)."""
    if not isinstance(lm, dict):
        raise _bad(f"{what} is not an object")
    name = lm.get("class")
    if not isinstance(name, str) or name not in CACHE_CLASSES:
        raise CorruptCheckpoint("unknown_cache_class", None,
                                f"{what}: class {str(name)[:64]!r} is not one of {sorted(CACHE_CLASSES)}")
    n = _nonneg_int(lm.get("n_state"), f"{what}.n_state")
    is_none = lm.get("state_is_none")
    if not isinstance(is_none, list) or len(is_none) != n or any(type(b) is not bool for b in is_none):
        raise _bad(f"{what}.state_is_none does not list {n} booleans")
    ms = lm.get("meta_state")
    if not isinstance(ms, dict):
        raise _bad(f"{what}.meta_state is not an object")
    if name == "CacheList":
        children = ms.get("children")
        if depth >= MAX_NESTING or not isinstance(children, list):
            raise _bad(f"{what}: bad CacheList children")
        subs, at = [], 0
        for j, m in enumerate(children):
            k = m.get("n_state") if isinstance(m, dict) else None
            if type(k) is not int or k < 0 or at + k > n:
                raise _bad(f"{what}.{j}: children slots do not add up")
            subs.append(_build_layer(m, lambda k=k, at=at: slots_of()[at:at + k], f"{what}.{j}", depth + 1,
                                     tokens))
            at += k
        if at != n:
            raise _bad(f"{what}: children hold {at} slots, layer {n}")
        return CACHE_CLASSES[name](*subs)
    codec = _CODECS[name]
    values = {k: _nonneg_int(ms.get(k), f"{what}.meta_state.{k}") for k in codec.fields}
    offset = lm.get("offset")
    if codec.has_offset:
        offset = _nonneg_int(offset, f"{what}.offset")
        if tokens is not None:
            offset = tokens
    slots = slots_of()
    if len(slots) != n or [a is None for a in slots] != is_none:
        raise _bad(f"{what}: stored slots do not match state_is_none")
    return codec.build(codec.cls, slots, values, offset, what)


def tensors_to_cache(tensors: Mapping[str, Any], meta: Mapping[str, Any], tokens: Any = None) -> list:
    """Rebuilds the mlx-lm prompt cache written by cache_to_tensors.

    Args:
        tensors: dict "{layer}.{i}" -> mx.array (as KVStore.load(into="mlx")
            returns them).
        meta: the meta dict cache_to_tensors made.

    Returns:
        list of cache objects, ready for further update_and_fetch calls.

    Raises:
        kvstore.CorruptCheckpoint: the meta names a class outside
            CACHE_CLASSES (reason "unknown_cache_class"), or meta and tensors
            disagree (reason "bad_cache_meta").
    """
    if not isinstance(meta, dict) or meta.get("version") != META_VERSION:
        raise _bad(f"cache meta version is not {META_VERSION}")
    layers = meta.get("layers")
    if not isinstance(layers, list):
        raise _bad("cache meta has no layer list")
    used = set()
    for a in tensors.values():
        if not isinstance(a, mx.array):
            raise TypeError(f"tensors must be mx.array, not {type(a).__name__} (load with into='mlx')")

    def slots_of(li, lm):
        def get():
            out = []
            for i, none in enumerate(lm["state_is_none"]):
                if none:
                    out.append(None)
                    continue
                key = f"{li}.{i}"
                if key not in tensors:
                    raise _bad(f"tensor {key!r} is missing")
                used.add(key)
                out.append(tensors[key])
            return out
        return get

    cache = [_build_layer(lm, slots_of(li, lm), f"layer {li}", tokens=tokens) for li, lm in enumerate(layers)]
    extra = set(tensors) - used
    if extra:
        raise _bad(f"{len(extra)} tensors belong to no layer, e.g. {sorted(extra)[0]!r}")
    return cache


def supported(cache: list) -> bool:
    """True when every layer's class (CacheList children included) is in CACHE_CLASSES."""
    def ok(c):
        name = _NAMES.get(type(c))
        return name is not None and (name != "CacheList" or all(ok(s) for s in c.caches))
    return all(ok(c) for c in cache)


# ---- checked states, and a checkpoint back into a cache -----------------------

def checked_tensors(cache, n):
    """cache_to_tensors(cache), checking that every layer holds exactly n tokens.

    Raises:
        TypeError: an unsupported cache class.
        ValueError: a cache offset differs from n.
    """
    tensors, meta, _ = checked_state(cache, n)
    return tensors, meta


def checked_state(cache, n):
    """cache_state(cache) -> (tensors, meta, positional), checking that every layer holds n tokens.

    Raises:
        TypeError: an unsupported cache class.
        ValueError: a cache offset differs from n.
    """
    tensors, meta, positional = cache_state(cache)
    for li, lm in enumerate(meta["layers"]):
        for off in _offsets(lm):
            if off != n:
                raise ValueError(f"layer {li} ({lm['class']}) holds {off} tokens, "
                                 f"but {n} token ids were given")
    return tensors, meta, positional


def cache_from_checkpoint(store, ckpt):
    """The mlx-lm cache of a checkpoint loaded with into="mlx"; None when it does not rebuild.

    A checkpoint whose payload loaded but whose meta and tensors disagree is
    corrupt: it is removed (or quarantined) from store.
    """
    n = len(ckpt.tokens)
    try:
        if ckpt.entry.is_block:
            # A chain block's meta is the one of the save it came from, which
            # may have ended later: the growing slots hold exactly n tokens
            # (the store assembled them), so every offset is n.
            cache = tensors_to_cache(ckpt.tensors, ckpt.meta, tokens=n)
            for li, lm in enumerate(ckpt.meta["layers"]):
                if any(off < n for off in _offsets(lm)):
                    raise _bad(f"layer {li} holds fewer tokens than the chain", "cache_offset")
        else:
            cache = tensors_to_cache(ckpt.tensors, ckpt.meta)
        for li, lm in enumerate(ckpt.meta["layers"]):
            if not ckpt.entry.is_block and any(off != n for off in _offsets(lm)):
                raise _bad(f"layer {li} holds a different token count than the file", "cache_offset")
    except CorruptCheckpoint as e:
        _discard(store, ckpt.entry, e.reason)
        return None
    return cache


def _discard(store, entry, reason):
    """Removes (or quarantines) a file whose payload loaded but whose cache did not rebuild."""
    if not store.discard(entry, reason):
        log.warning("kvstore: corrupt reason=%s action=gone file=%s", reason, entry.name[:12] + "…kv")
