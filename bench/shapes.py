"""Real sizes: kvstore against mlx-lm's prompt-cache files at the KV geometry of the models people run.

Run as a script path (not ``python -m``), so the installed ``kvstore`` is the
one imported:

    python bench/shapes.py              # the zoo at 8,192 and 32,768 tokens
    python bench/shapes.py --quick      # three geometries at 2,048 tokens
    python bench/shapes.py --json results.json

Each geometry is a model's KV cache as mlx-lm holds it (bfloat16; a KVCache
per full-attention layer, a RotatingKVCache per sliding layer holding its
full window; the MLA latent as DeepSeek-V3's cache keeps it: a 512-wide
latent and a 64-wide RoPE key per layer), filled with random values: a
storage row needs no weights and no prefill.  Every row runs in fresh
processes, kvstore's and mlx-lm's one after the other, on the same arrays
(same seed):

- save: a durable chained save (kvstore.mlx.save_prompt_cache, block_tokens
  256, each block fsynced) against mlx-lm's save_prompt_cache followed by an
  fsync of the file and its directory; one process saves for both sides,
  taking turns, three rounds (one in a quick run), the disk synced before
  each save, and each side's median is reported: a save's time on this
  VM's disk swings by 2x from one run to the next;
- turn: the same session 1,000 tokens longer saved again: kvstore writes the
  new blocks (and the sliding windows, which are the state at the end),
  mlx-lm writes its whole file again; bytes and time;
- load, cold: the page cache dropped first (echo 3 > drop_caches, as root;
  otherwise the row says it was not), kvstore.mlx.load_prompt_cache (find
  and load, canary off: its cost is a row of its own) against mlx-lm's
  load_prompt_cache, each followed by mx.eval of every array;
- load, warm: the same, right after, with the file in the page cache;
  both sides take turns, three rounds (one in a quick run), and each
  side's median is reported (measure_loads says why the turns);
- peak memory of each load (the child's maximum resident set above what it
  held before loading) against the arrays' size;
- find: KVStore.find of the prompt 200 bytes longer, in the directory that
  holds the session's chain, against one hashlib.sha1 of that prompt (what
  any lookup by the prompt's name costs at least);
- evict: the store's budget set to 1 MiB and evict() timed (every block of
  the chain deleted, leaves first) against unlinking mlx-lm's file and
  syncing its directory;
- canary: kvstore.mlx.canary.check on the restored state of a model with
  the geometry's attention and a tiny hidden size (random weights), against
  one decode step of the same model on the same cache.

A size is skipped for a geometry when a process would need more memory
than this machine has (the arrays twice, as a load holds them beside the
state it came from); the report names every skipped row and why.
"""

import gc
import hashlib
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from foundation import TextTable, drop_page_cache, finish, harness_arguments, machine_info, machine_lines  # noqa: E402

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
SIZES, QUICK_SIZES = (8192, 32768), (2048,)
TURN_TOKENS = 1000
FIND_EXTRA = 200                  # the prompt of the find row: the session's text and this many bytes more
TOKEN_TEXT = 8                    # bytes of text per token: "t0000001 "-like words
BLOCK_TOKENS = 256
LOAD_ROUNDS = 5                   # cold and warm loads of each side per row (the median is reported)
SAVE_ROUNDS = 3                   # saves of each side per row, in one process (the median is reported)
SEED = 36
# Memory a child may use: the arrays of a state, twice (a load's blob and
# the cache objects around it, or a save's arrays and its page cache), under
# this share of the machine's memory.
MEMORY_SHARE = 0.8

# name, layers, KV heads, key dim, value dim, sliding layers, window, canary architecture
GEOMETRIES = [
    ("Llama-3.1-8B", 32, 8, 128, 128, 0, 0, "llama"),
    ("Qwen3-8B", 36, 8, 128, 128, 0, 0, "llama"),
    ("Qwen3-30B-A3B", 48, 4, 128, 128, 0, 0, "llama"),
    ("Qwen3-32B", 64, 8, 128, 128, 0, 0, "llama"),
    ("Llama-3.3-70B", 80, 8, 128, 128, 0, 0, "llama"),
    ("Gemma-3-12B", 48, 8, 256, 256, 40, 1024, None),
    ("gpt-oss-20b", 24, 8, 64, 64, 12, 128, None),
    ("DeepSeek-V3 (MLA latent)", 61, 1, 512, 64, 0, 0, None),
]
QUICK_GEOMETRIES = ("Llama-3.1-8B", "Gemma-3-12B", "DeepSeek-V3 (MLA latent)")
CANARY_NOTE = {
    "Gemma-3-12B": "canary not timed: its sliding layers hold more than a window, so the canary prefills "
                   "from nothing (a head canary) and needs Gemma's own attention, not built here",
    "gpt-oss-20b": "canary not timed: sliding layers past their window take the head canary (see Gemma)",
    "DeepSeek-V3 (MLA latent)": "canary not timed: the latent cache needs DeepSeek-V3's attention, not built here",
}


# ---- geometry ------------------------------------------------------------------

def layers_of(g):
    """[(kind, KV heads, key dim, value dim, window)] of a geometry, one per layer."""
    name, layers, heads, kd, vd, sliding, window, _ = g
    # Sliding layers interleave with full ones, as Gemma 3 (5 of 6) and gpt-oss (every other) do.
    out = []
    for i in range(layers):
        is_sliding = sliding and (i * sliding) // layers != ((i + 1) * sliding) // layers
        out.append(("rotating" if is_sliding else "full", heads, kd, vd, window if is_sliding else 0))
    return out


def state_bytes(g, tokens):
    """The bytes of a geometry's KV state after tokens tokens (bfloat16)."""
    total = 0
    for kind, heads, kd, vd, window in layers_of(g):
        rows = min(tokens, window) if kind == "rotating" else tokens
        total += heads * rows * (kd + vd) * 2
    return total


def per_token_text(g):
    full = sum(h * (kd + vd) * 2 for kind, h, kd, vd, _ in layers_of(g) if kind == "full")
    win = state_bytes(g, 10 ** 9) - full * 10 ** 9
    return f"{full / KiB:.0f} KiB a token" + (f" + {win / MiB:.0f} MiB of windows" if win else "")


def memory_total():
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


# ---- children: each measurement in a fresh process ---------------------------

def run_child(op, **kw):
    """Runs op in a fresh process of this script; returns its JSON answer."""
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", op, json.dumps(kw)],
                         stdout=subprocess.PIPE, text=True)
    if out.returncode != 0:
        raise SystemExit(f"shapes: child {op} failed (exit {out.returncode})")
    return json.loads(out.stdout.strip().splitlines()[-1])


def rss_peak():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * KiB


def geometry_named(name):
    return next(g for g in GEOMETRIES if g[0] == name)


def build_cache(g, tokens, capacity, seed):
    """mlx-lm cache objects of geometry g holding tokens tokens, their buffers capacity rows (random)."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache, RotatingKVCache
    mx.random.seed(seed)
    cache = []
    for kind, heads, kd, vd, window in layers_of(g):
        rows = window if kind == "rotating" else capacity
        k = mx.random.normal((1, heads, rows, kd), dtype=mx.bfloat16)
        v = mx.random.normal((1, heads, rows, vd), dtype=mx.bfloat16)
        mx.eval(k, v)
        c = RotatingKVCache(max_size=window) if kind == "rotating" else KVCache()
        c.keys, c.values = k, v
        if kind == "rotating":
            c._idx = window
        cache.append(c)
    set_offset(cache, tokens)
    return cache


def set_offset(cache, tokens):
    for c in cache:
        c.offset = tokens


def text_of(tokens, extra=0):
    """The session's text: one TOKEN_TEXT-byte word per token, then extra bytes."""
    words = b"".join(b"t%06d " % (i % 1_000_000) for i in range(tokens))
    return words + b"x" * extra


# The sides a row compares: kvstore's default store, kvstore packing or
# quantising its blocks (kv_codec "lossless", "q8", "q4": bench/packed.py),
# and mlx-lm's file.
KV_CODEC_OF = {"kvstore": "raw", "lossless": "lossless", "q8": "q8", "q4": "q4"}
SIDE_DIRS = {"kvstore": "kv", "lossless": "packed", "q8": "q8", "q4": "q4", "peer": "peer"}


def open_store(path, budget_mb=1 << 30, kv_codec="raw"):
    import kvstore
    return kvstore.KVStore(path, budget_mb=budget_mb, block_tokens=BLOCK_TOKENS, durable=True, kv_codec=kv_codec)


def kv_save(store, cache, tokens):
    import kvstore.mlx
    text = text_of(tokens)
    before = store.stats()["bytes_saved"]
    t0 = time.perf_counter()
    e = kvstore.mlx.save_prompt_cache(store, text, list(range(tokens)), cache, None, min_tokens=1,
                                      text_offsets=lambda i: i * TOKEN_TEXT)
    seconds = time.perf_counter() - t0
    assert e is not None and e.tokens == tokens, e
    return seconds, store.stats()["bytes_saved"] - before


def peer_save(path, cache):
    from mlx_lm.models.cache import save_prompt_cache
    t0 = time.perf_counter()
    save_prompt_cache(path, cache)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    dfd = os.open(os.path.dirname(path), os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    return time.perf_counter() - t0, os.path.getsize(path)


def child_saves(geometry, tokens, path, order, rounds):
    """Every side's saves of the session, then of the session a turn longer, in
    one process on one set of arrays: rounds of the sides taking turns (A B,
    B A, ...), the disk synced before each (so that neither side's save pays
    for the other's dirty pages); each side's times and bytes per round.
    The last round's files stay in path/<SIDE_DIRS[side]> for the loads."""
    g = geometry_named(geometry)
    cache = build_cache(g, tokens, tokens + TURN_TOKENS, SEED)
    runs = {side: [] for side in order}
    for r in range(rounds):
        for side in (order if r % 2 == 0 else order[::-1]):
            where = os.path.join(path, SIDE_DIRS[side])
            shutil.rmtree(where, ignore_errors=True)
            os.makedirs(where)
            os.sync()
            set_offset(cache, tokens)
            runs[side].append(_save_both(side, where, cache, tokens))
    return runs


def _save_both(side, where, cache, tokens):
    if side in KV_CODEC_OF:
        with open_store(where, kv_codec=KV_CODEC_OF[side]) as store:
            save_s, save_bytes = kv_save(store, cache, tokens)
            set_offset(cache, tokens + TURN_TOKENS)
            turn_s, turn_bytes = kv_save(store, cache, tokens + TURN_TOKENS)
    else:
        save_s, save_bytes = peer_save(os.path.join(where, "cache.safetensors"), cache)
        set_offset(cache, tokens + TURN_TOKENS)
        turn_s, turn_bytes = peer_save(os.path.join(where, "cache.safetensors"), cache)
    return dict(save_s=save_s, save_bytes=save_bytes, turn_s=turn_s, turn_bytes=turn_bytes)


def child_load(side, geometry, tokens, path):
    """One load into MLX in this fresh process, every array evaluated; time and peak memory."""
    import mlx.core as mx
    time.sleep(0.2)                      # numpy's OpenBLAS threads settle (bench/README.md)
    base = rss_peak()
    if side in KV_CODEC_OF:
        import kvstore.mlx
        with open_store(path) as store:
            t0 = time.perf_counter()
            got = kvstore.mlx.load_prompt_cache(store, text_of(tokens, FIND_EXTRA), None, check=False)
            cache = got[0]
            mx.eval([c.state for c in cache])
            seconds = time.perf_counter() - t0
        assert len(got[1]) == tokens, len(got[1])
    else:
        from mlx_lm.models.cache import load_prompt_cache
        t0 = time.perf_counter()
        cache = load_prompt_cache(os.path.join(path, "cache.safetensors"))
        mx.eval([c.state for c in cache])
        seconds = time.perf_counter() - t0
    return dict(seconds=seconds, peak_over=max(0, rss_peak() - base))


def child_find(geometry, tokens, path, repeats=21):
    """KVStore.find of the prompt against one hashlib.sha1 of it, interleaved; medians."""
    import statistics
    prompt = text_of(tokens, FIND_EXTRA)
    with open_store(path) as store:
        kv, peer = [], []
        for _ in range(repeats):
            t0 = time.perf_counter_ns()
            e = store.find(prompt)
            kv.append(time.perf_counter_ns() - t0)
            t0 = time.perf_counter_ns()
            hashlib.sha1(prompt).digest()
            peer.append(time.perf_counter_ns() - t0)
        assert e is not None and e.tokens == tokens, e
        return dict(kv_ns=statistics.median(kv), peer_ns=statistics.median(peer),
                    files=len(store.entries()))


def child_evict(geometry, tokens, path):
    """The chain evicted (budget 1 MiB) against mlx-lm's file unlinked and its directory synced."""
    with open_store(os.path.join(path, "kv")) as store:
        files = len(store.entries())
        t0 = time.perf_counter()
        store.budget_bytes = MiB
        evicted = store.evict()
        kv_s = time.perf_counter() - t0
        assert len(evicted) == files and not store.entries(), (len(evicted), files)
    peer_path = os.path.join(path, "peer", "cache.safetensors")
    t0 = time.perf_counter()
    os.unlink(peer_path)
    dfd = os.open(os.path.dirname(peer_path), os.O_RDONLY)
    os.fsync(dfd)
    os.close(dfd)
    return dict(kv_s=kv_s, peer_s=time.perf_counter() - t0, files=files)


CANARY_VOCAB = 1024


def canary_model(g):
    """A llama model with geometry g's attention and a tiny hidden size (random weights)."""
    import mlx.core as mx
    from mlx_lm.models import llama
    name, layers, heads, kd, vd, *_ = g
    args = llama.ModelArgs(model_type="llama", hidden_size=256, num_hidden_layers=layers, intermediate_size=512,
                           num_attention_heads=heads * 2, num_key_value_heads=heads, head_dim=kd,
                           rms_norm_eps=1e-5, vocab_size=CANARY_VOCAB, rope_theta=500000.0, tie_word_embeddings=True)
    model = llama.Model(args)
    model.set_dtype(mx.bfloat16)
    mx.eval(model.parameters())
    return model


def child_canary(geometry, tokens, repeats=5):
    """canary.check against one decode step, the same model and cache; medians."""
    import statistics

    import mlx.core as mx
    from kvstore.mlx import canary
    g = geometry_named(geometry)
    model = canary_model(g)
    cache = build_cache(g, tokens, tokens + repeats + 1, SEED)
    ids = [i % CANARY_VOCAB for i in range(tokens)]        # token ids the model's vocabulary holds
    kv, peer = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        verdict = canary.check(model, cache, ids)
        mx.eval([c.state for c in cache])
        kv.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        logits = model(mx.array([[7]], dtype=mx.uint32), cache=cache)
        mx.eval(logits)
        peer.append(time.perf_counter() - t0)
        set_offset(cache, tokens)            # the decoded token dropped again
    return dict(kv_s=statistics.median(kv), peer_s=statistics.median(peer), kind=verdict.kind)


# ---- the identity of a real-size model -------------------------------------------

# A Llama-3.1-8B-shaped model cut to FINGERPRINT_LAYERS layers: 8.4 GB of
# bfloat16 weights, the largest this machine's memory takes with room for
# the page cache of its files.
FINGERPRINT_LAYERS, QUICK_FINGERPRINT_LAYERS = 18, 1
FINGERPRINT_CONFIG = dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                          num_key_value_heads=8, rms_norm_eps=1e-5, vocab_size=32000, rope_theta=500000.0,
                          tie_word_embeddings=False)


def child_write_model(path, layers):
    """A random-weight model directory mlx_lm.utils.load_model reads (one safetensors shard a layer)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama
    config = dict(FINGERPRINT_CONFIG, num_hidden_layers=layers)
    shapes = {k: v.shape for k, v in tree_flatten(llama.Model(llama.ModelArgs.from_dict(config)).parameters())}
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    groups = {}
    for name in shapes:
        part = name.split(".")[2] if name.startswith("model.layers.") else "rest"
        groups.setdefault(part, []).append(name)
    mx.random.seed(SEED)
    total = 0
    for part, names in groups.items():
        arrays = {n: mx.random.normal(shapes[n], dtype=mx.bfloat16) * 0.02 for n in names}
        mx.eval(arrays)
        mx.save_safetensors(os.path.join(path, f"model-{part}.safetensors"), arrays)
        total += sum(a.nbytes for a in arrays.values())
        del arrays
    return dict(bytes=total)


def read_bytes():
    """Bytes this process has read from storage (Linux /proc/self/io; None elsewhere)."""
    try:
        with open("/proc/self/io") as f:
            return int(next(line for line in f if line.startswith("read_bytes:")).split()[1])
    except (OSError, StopIteration):
        return None


def child_fingerprint(path, lazy):
    """mlx_lm.utils.load_model, then kvstore.mlx.model_fingerprint: times and bytes read by each."""
    from pathlib import Path

    from mlx_lm.utils import load_model

    from kvstore.mlx import model_fingerprint
    time.sleep(0.2)
    r0, t0 = read_bytes(), time.perf_counter()
    model, _ = load_model(Path(path), lazy=lazy)
    r1, t1 = read_bytes(), time.perf_counter()
    model_fingerprint(model)
    r2, t2 = read_bytes(), time.perf_counter()
    return dict(load_s=t1 - t0, fingerprint_s=t2 - t1,
                load_read=None if r0 is None else r1 - r0, fingerprint_read=None if r0 is None else r2 - r1)


CHILDREN = {"saves": child_saves, "load": child_load, "find": child_find, "evict": child_evict,
            "canary": child_canary, "write_model": child_write_model, "fingerprint": child_fingerprint}


def bench_fingerprint(report, tmp, quick, dropped):
    """The fingerprint of an 8.4 GB model, loaded as mlx_lm loads it (all weights read) and lazily."""
    layers = QUICK_FINGERPRINT_LAYERS if quick else FINGERPRINT_LAYERS
    path = os.path.join(tmp, "model")
    size = run_child("write_model", path=path, layers=layers)["bytes"]
    report.section(f"The identity of a real-size model: model_fingerprint of {size / 1e9:.1f} GB of bfloat16 "
                   f"weights (Llama-3.1-8B's shapes, {layers} layers, random)")
    out = {"bytes": size}
    for lazy in (False, True):
        if dropped:
            drop_page_cache()
        r = out["lazy" if lazy else "loaded"] = run_child("fingerprint", path=path, lazy=lazy)
        how = "load_model(lazy=True): weights not read yet" if lazy else "mlx_lm's load: every weight read"
        read = "not measured" if r["fingerprint_read"] is None else cell_bytes(r["fingerprint_read"])["text"]
        ok = r["fingerprint_s"] <= FINGERPRINT_MAX_S and (r["fingerprint_read"] or 0) <= FINGERPRINT_MAX_READ
        note = "peer: the model's load itself (cold page cache)" if dropped else "peer: the model's load"
        if lazy:
            # MLX reads a lazily loaded tensor whole when any of it is first
            # evaluated: the sample reads what the model's first forward
            # would read anyway.  mlx_lm.load (and kvstore serve) read it all.
            ok = None
            note += "; a lazy model's sampled tensors are read whole, as its first forward reads them"
        report.add(f"model_fingerprint after {how}", {"text": f"{cell_s(r['fingerprint_s'])['text']}, {read} read"},
                   {"text": f"{cell_s(r['load_s'])['text']}, "
                            f"{cell_bytes(r['load_read'] or 0)['text'] if r['load_read'] is not None else '?'} read"},
                   "time", r["fingerprint_s"] / r["load_s"], target=f"≤ {FINGERPRINT_MAX_S:.0f} s and ≤ "
                   f"{FINGERPRINT_MAX_READ // MiB} MiB read" if ok is not None else "context", passed=ok,
                   note=note)
    shutil.rmtree(path)
    return out


def child_main(op, kw):
    result = CHILDREN[op](**json.loads(kw))
    print(json.dumps(result), flush=True)
    return 0


# ---- the parent: rows ------------------------------------------------------------

FINGERPRINT_MAX_S = 1.0
FINGERPRINT_MAX_READ = 64 * MiB
TIME_TARGET = 1.05                # a kvstore time / mlx-lm time, medians; 5% for this shared machine's noise


def cell_s(s):
    return {"text": f"{s * 1e3:,.0f} ms" if s < 10 else f"{s:,.1f} s"}


def cell_bytes(n):
    return {"text": f"{n / MiB:,.1f} MiB" if n < GiB else f"{n / GiB:,.2f} GiB"}


def add_time(report, label, kv_s, peer_s, note="", target=TIME_TARGET):
    """A time row: kvstore / peer; judged against target (None: a context row)."""
    ratio = kv_s / peer_s
    report.add(label, cell_s(kv_s), cell_s(peer_s), "time", ratio,
               target=f"time ratio ≤ {target}" if target is not None else "context",
               passed=None if target is None else ratio <= target, note=note)


def measure_saves(tmp, g, tokens, order, rounds):
    """Each side's median save and median turn (child_saves: one process, the sides taking turns)."""
    runs = run_child("saves", geometry=g[0], tokens=tokens, path=tmp, order=list(order), rounds=rounds)
    out = {}
    for side, rs in runs.items():
        save = sorted(rs, key=lambda r: r["save_s"])[(len(rs) - 1) // 2]
        turn = sorted(rs, key=lambda r: r["turn_s"])[(len(rs) - 1) // 2]
        out[side] = dict(save, turn_s=turn["turn_s"], turn_bytes=turn["turn_bytes"],
                         save_all=[r["save_s"] for r in rs], turn_all=[r["turn_s"] for r in rs])
    return out


def measure_loads(tmp, g, tokens, order, dropped, rounds):
    """Cold and warm loads of both sides, alternating (A B A B...: each cold
    load follows the other side's, so the storage under this VM cannot
    keep one side's bytes warmer than the other's: seen here, a file read
    again right after itself 30-50% faster than after the other side's,
    page cache dropped both times); the sides' order turns each round
    (A B, B A, ...); each side's median of rounds."""
    samples = {"cold": {s: [] for s in order}, "warm": {s: [] for s in order}}
    for r in range(rounds):
        for side in (order if r % 2 == 0 else order[::-1]):
            path = os.path.join(tmp, SIDE_DIRS[side])
            if dropped:
                drop_page_cache()
            samples["cold"][side].append(run_child("load", side=side, geometry=g[0], tokens=tokens, path=path))
            samples["warm"][side].append(run_child("load", side=side, geometry=g[0], tokens=tokens, path=path))
    return {temp: {side: median_run(runs) for side, runs in sides.items()} for temp, sides in samples.items()}


def median_run(runs):
    """The run of median time among runs (the lower middle one of an even count)."""
    return sorted(runs, key=lambda r: r["seconds"])[(len(runs) - 1) // 2]


def bench_geometry(report, tmp, g, tokens, order, dropped, rounds):
    """Every row of one geometry at one size; returns the raw measurements."""
    total = tokens + TURN_TOKENS
    arrays = state_bytes(g, total)
    report.section(f"{g[0]}: {per_token_text(g)}; a session of {tokens:,} tokens, then a turn to {total:,}")
    saves = measure_saves(tmp, g, tokens, order, min(rounds, SAVE_ROUNDS))
    kv, peer = saves["kvstore"], saves["peer"]
    add_time(report, f"durable save, {tokens:,} tokens ({state_bytes(g, tokens) / GiB:.2f} GiB)",
             kv["save_s"], peer["save_s"], note=f"kvstore chain of {BLOCK_TOKENS}-token blocks, each fsynced")
    report.add(f"a turn of {TURN_TOKENS:,} tokens: bytes written", cell_bytes(kv["turn_bytes"]),
               cell_bytes(peer["turn_bytes"]), "bytes", kv["turn_bytes"] / peer["turn_bytes"],
               target="bytes ratio ≤ 1.0", passed=kv["turn_bytes"] <= peer["turn_bytes"],
               note="mlx-lm writes its whole file again")
    add_time(report, f"a turn of {TURN_TOKENS:,} tokens: durable save", kv["turn_s"], peer["turn_s"])
    found = run_child("find", geometry=g[0], tokens=total, path=os.path.join(tmp, "kv"))
    report.add(f"find the session ({len(text_of(total, FIND_EXTRA)) / KiB:.0f} KiB prompt, {found['files']} files)",
               {"text": f"{found['kv_ns'] / 1e3:,.0f} µs"}, {"text": f"{found['peer_ns'] / 1e3:,.0f} µs"},
               "time", found["kv_ns"] / found["peer_ns"], target="context",
               note="peer: one hashlib.sha1 of the prompt")
    loads = measure_loads(tmp, g, total, order, dropped, rounds)
    for temp in ("cold", "warm"):
        k, p = loads[temp]["kvstore"], loads[temp]["peer"]
        note = "" if temp == "warm" or dropped else "page cache NOT dropped (not root)"
        add_time(report, f"load into MLX, {temp}, {total:,} tokens ({arrays / GiB:.2f} GiB)",
                 k["seconds"], p["seconds"], note=note)
    k, p = loads["cold"]["kvstore"]["peak_over"], loads["cold"]["peer"]["peak_over"]
    report.add("peak memory of a cold load, over the process before it", {"text": f"{k / arrays:.2f}× the arrays"},
               {"text": f"{p / arrays:.2f}× the arrays"}, "memory", k / max(p, 1), target="context")
    evicted = run_child("evict", geometry=g[0], tokens=total, path=tmp)
    add_time(report, f"evict the session ({evicted['files']} files)", evicted["kv_s"], evicted["peer_s"],
             target=None, note="peer: unlink one file and sync its directory")
    canary = None
    if g[7] == "llama":
        canary = run_child("canary", geometry=g[0], tokens=total)
        report.add("the canary of a restore", cell_s(canary["kv_s"]), cell_s(canary["peer_s"]), "time",
                   canary["kv_s"] / canary["peer_s"], target="context",
                   note=f"peer: one decode step on the same cache ({canary['kind']} canary; a llama model with "
                        "this attention, hidden 256)")
    return dict(geometry=g[0], tokens=tokens, arrays_bytes=arrays, saves=saves, find=found, loads=loads,
                evict=evicted, canary=canary)


def plan(quick, sizes=None):
    """[(geometry, tokens)] to run and [(geometry, tokens, why)] skipped."""
    sizes = sizes or (QUICK_SIZES if quick else SIZES)
    geometries = [g for g in GEOMETRIES if not quick or g[0] in QUICK_GEOMETRIES]
    limit = MEMORY_SHARE * memory_total()
    run, skipped = [], []
    for tokens in sizes:
        for g in geometries:
            need = 2 * state_bytes(g, tokens + TURN_TOKENS)
            if need > limit:
                skipped.append((g[0], tokens, f"a load needs about {need / GiB:.1f} GiB, over "
                                              f"{MEMORY_SHARE:.0%} of this machine's {memory_total() / GiB:.0f} GiB"))
            else:
                run.append((g, tokens))
    return run, skipped


def main(argv=None):
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--child":
        return child_main(sys.argv[2], sys.argv[3])
    sizes = None
    if argv is None and "--sizes" in sys.argv:       # e.g. --sizes 8192: some of SIZES only
        i = sys.argv.index("--sizes")
        sizes = tuple(int(x) for x in sys.argv[i + 1].split(","))
        del sys.argv[i:i + 2]
    args = harness_arguments(__doc__, "three geometries at 2,048 tokens", argv)
    args.strict = False
    t_start = time.perf_counter()
    info = machine_info()
    report = TextTable()
    todo, skipped = plan(args.quick, sizes)
    dropped = drop_page_cache()
    results = []
    for i, (g, tokens) in enumerate(todo):
        order = ("kvstore", "peer") if i % 2 == 0 else ("peer", "kvstore")
        print(f"shapes: {g[0]} at {tokens:,} tokens", file=sys.stderr, flush=True)
        with tempfile.TemporaryDirectory(prefix="kvstore-bench-shapes-", dir=os.environ.get("TMPDIR", "/tmp")) as tmp:
            results.append(bench_geometry(report, tmp, g, tokens, order, dropped, 1 if args.quick else LOAD_ROUNDS))
        gc.collect()
    with tempfile.TemporaryDirectory(prefix="kvstore-bench-shapes-", dir=os.environ.get("TMPDIR", "/tmp")) as tmp:
        fingerprint = bench_fingerprint(report, tmp, args.quick, dropped)
    elapsed = time.perf_counter() - t_start
    print(f"# kvstore at real KV sizes ({'quick' if args.quick else 'full'} run)\n")
    print(machine_lines(info))
    print(f"- memory {memory_total() / GiB:.1f} GiB; cold loads: "
          + ("page cache dropped before each (root)" if dropped else "page cache NOT dropped (not root)"))
    print("- skipped: " + ("; ".join(f"{n} at {t:,} tokens ({why})" for n, t, why in skipped) or "none"))
    print(f"- elapsed {elapsed:.1f} s\n")
    print(report.markdown())
    return finish(args, info, elapsed, report, geometries=results, fingerprint=fingerprint,
                  skipped=[dict(geometry=n, tokens=t, why=why) for n, t, why in skipped])


if __name__ == "__main__":
    sys.exit(main())
