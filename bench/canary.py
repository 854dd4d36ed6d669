"""The canary's margins: distances of states the live model made against states it did not make.

Run as a script path (not ``python -m``), so the installed ``kvstore`` is the
one imported:

    python bench/canary.py            # full run: 5 architectures × 3 dtypes, under 8 minutes on 2 cores
    python bench/canary.py --quick    # llama and qwen3_next, float32 and bfloat16; under a minute
    python bench/canary.py --json results.json --strict

The canary (kvstore.mlx.canary, docs/semantics.md §17) has the live model
recompute part of a restored state and compares the K/V rows by relative L2
distance; a restore passes when the distance is within its KV dtype's
tolerance (canary.TOLERANCE).  A tolerance is right when every state the live
model could have made passes and every state it could not have made fails.
This harness measures both sides with kvstore's own code: the state goes
through kvstore.mlx.codecs (cache_state, fresh arrays, tensors_to_cache) as a
load restores it, canary.prepare picks the kind and trims, canary.finish or
canary.check gives the Verdict, and the distance is Verdict.distance (the
largest over layers and slots of ||recomputed - stored|| / ||stored||).

The models are tiny random-weight mlx-lm models (hidden 256, 4 layers,
vocabulary 512; nothing is downloaded) of five architectures: llama (dense),
qwen3_moe (MoE, 8 experts, top 2), deepseek_v3 (MLA latents, YaRN RoPE),
gemma3_text (sliding-window layers of 1,024 beside global ones) and
qwen3_next (gated-delta layers beside attention: its cache cannot go back a
token), in float32, float16 and bfloat16 (weights made in float32 and cast as
mlx_lm.utils casts them on load).  A prompt is N random token ids and 40
more after them; the stored state holds the N.

The canary kind is kvstore's choice: tail where the restored cache can be
trimmed (the cache trimmed by one, token N-1 fed again, its rows compared),
head where it cannot (qwen3_next; gemma3_text once N passes its window: the
first HEAD_TOKENS tokens recomputed from a fresh cache).  The tail runs with
two feeds: token N-1 with the 40 after it (PromptCache's chunk) and token N-1
alone (canary.check: load_prompt_cache users and kvstore serve).

Must pass (the largest distance is the kvstore cell):
- rounding: the model's own state, prefilled in chunks ending at multiples
  of 2,048 (PromptCache's default step) or of 512, checked by the model;
- proxy (float16, bfloat16): the same rounded weights computed in float32,
  the state's floating tensors cast to the model's own dtypes -- the state
  kernels accumulating in another precision (another device's) would write
  -- checked by the model in its dtype.

Must fail (the smallest distance is the peer cell):
- another model: the same configuration, other random weights (seed 1);
- rope_theta ×10 and ×1.1: the same weights, another RoPE base
  (gemma3_text: the global and the local base);
- RoPE scaling ×2: a linear factor 2 (llama, gemma3_text, qwen3_next), the
  YaRN factor 40 -> 80 (deepseek_v3); qwen3_moe ignores rope_scaling;
- a replaced last block (tail canary): rows N-256..N-1 of every positional
  slot taken from a sibling state (the same first N-256 tokens, 256 others
  after them), as a spliced chain would hold them.  The head canary compares
  the first HEAD_TOKENS rows only and cannot see it: not counted there
  (noted).

Each (architecture, dtype) runs in a worker process of its own, as many at
once as there are usable cores (MLX's CPU kernels run these models on one
core); the distances do not depend on it.

One row per (architecture, dtype, canary kind): PASS when the largest
must-pass distance is within the tolerance and the smallest must-fail one is
beyond it.  A case that the canary cannot separate is reported as the MISS it
is, with the case named: the tolerances are not tuned here.

On the CPU, MLX's GatherMM (the MoE expert matmul) runs float32 only: for
float16 and bfloat16 inputs SwitchLinear is patched, in the harness's
processes only, to multiply in float32 and round the product to the input
dtype (what a float32-accumulating GPU kernel writes).  On a GPU the stock
kernel runs.
"""

import concurrent.futures
import importlib
import multiprocessing
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from foundation import Table, finish, harness_arguments, machine_info, machine_lines  # noqa: E402

# ---------------------------------------------------------------- the workload

VOCAB = 512
EXTRA = 40                     # prompt tokens after the stored N (PromptCache's chunk feeds them with token N-1)
BLOCK = 256                    # the replaced last block (kvstore's chain block)
CHUNKS = (2048, 512)           # prefill steps of the stored states: PromptCache's default, and a smaller one
SEED = 20240501

# Prompt lengths N (one prompt each), sized for MLX's CPU wheel on 2 cores:
# a 2,100-token prefill of these models takes 6 to 12 s (its reference BLAS;
# float16 and bfloat16 do not use BLAS), and each (architecture, dtype)
# prefills every prompt three times (two chunkings, the float32 proxy).
FULL = dict(archs=("llama", "qwen3_moe", "deepseek_v3", "gemma3_text", "qwen3_next"),
            dtypes=("float32", "float16", "bfloat16"), lengths=(600, 1000, 2100))
QUICK = dict(archs=("llama", "qwen3_next"), dtypes=("float32", "bfloat16"), lengths=(500, 600))

_YARN = {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
         "original_max_position_embeddings": 4096, "type": "yarn"}

# model_type -> mlx-lm configuration (tests/test_mlx_architectures.py's, raised to hidden 256 and 4 layers).
CONFIGS = {
    "llama": dict(model_type="llama", hidden_size=256, num_hidden_layers=4, intermediate_size=512,
                  num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=VOCAB,
                  rope_theta=10000.0, max_position_embeddings=4096),
    "qwen3_moe": dict(model_type="qwen3_moe", hidden_size=256, num_hidden_layers=4, intermediate_size=512,
                      num_attention_heads=8, num_key_value_heads=4, head_dim=32, rms_norm_eps=1e-6,
                      vocab_size=VOCAB, max_position_embeddings=4096, tie_word_embeddings=False,
                      rope_theta=1_000_000.0, decoder_sparse_step=1, mlp_only_layers=[], num_experts_per_tok=2,
                      num_experts=8, moe_intermediate_size=128, norm_topk_prob=True),
    # MLA: the cache holds the normed KV latent (keys) and the roped k_pe (values).
    "deepseek_v3": dict(model_type="deepseek_v3", vocab_size=VOCAB, hidden_size=256, intermediate_size=512,
                        moe_intermediate_size=128, num_hidden_layers=4, num_attention_heads=8,
                        num_key_value_heads=8, n_routed_experts=8, n_group=2, topk_group=1, num_experts_per_tok=2,
                        n_shared_experts=1, kv_lora_rank=64, q_lora_rank=96, qk_rope_head_dim=16, v_head_dim=32,
                        qk_nope_head_dim=32, first_k_dense_replace=1, rope_theta=10000.0,
                        max_position_embeddings=163840, rope_scaling=dict(_YARN)),
    # Layers 0, 2: RotatingKVCache(1,024); layers 1, 3: KVCache.
    "gemma3_text": dict(model_type="gemma3_text", hidden_size=256, num_hidden_layers=4, intermediate_size=512,
                        num_attention_heads=8, head_dim=32, rms_norm_eps=1e-6, vocab_size=VOCAB,
                        num_key_value_heads=4, sliding_window=1024, sliding_window_pattern=2,
                        query_pre_attn_scalar=32, rope_theta=1_000_000.0, rope_local_base_freq=10000.0),
    # Layers 0, 2: gated delta (ArraysCache); layers 1, 3: attention (KVCache).
    "qwen3_next": dict(model_type="qwen3_next", hidden_size=256, num_hidden_layers=4, intermediate_size=512,
                       num_attention_heads=8, num_key_value_heads=4, vocab_size=VOCAB, linear_num_value_heads=8,
                       linear_num_key_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
                       linear_conv_kernel_dim=4, rms_norm_eps=1e-6, head_dim=32, rope_theta=1_000_000.0,
                       partial_rotary_factor=0.25, max_position_embeddings=4096, full_attention_interval=2,
                       num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1,
                       shared_expert_intermediate_size=128, mlp_only_layers=[], moe_intermediate_size=128,
                       norm_topk_prob=True),
}

KINDS = {"llama": "dense", "qwen3_moe": "MoE", "deepseek_v3": "MLA, MoE", "gemma3_text": "sliding window + global",
         "qwen3_next": "hybrid gated delta + attention, MoE"}

def rope_variants(arch):
    """Case name -> configuration changes of the RoPE must-fail cases (the same weights)."""
    c = CONFIGS[arch]
    out = {}
    for f, name in ((10.0, "θ×10"), (1.1, "θ×1.1")):
        o = {"rope_theta": c["rope_theta"] * f}
        if arch == "gemma3_text":                       # the sliding layers' own base
            o["rope_local_base_freq"] = c["rope_local_base_freq"] * f
        out[name] = o
    if arch == "deepseek_v3":
        out["scaling×2"] = {"rope_scaling": dict(_YARN, factor=2 * _YARN["factor"])}
    elif arch != "qwen3_moe":                           # qwen3_moe builds nn.RoPE(rope_theta) only
        out["scaling×2"] = {"rope_scaling": {"type": "linear", "factor": 2.0}}
    return out


SCALING = {"deepseek_v3": "YaRN factor 40 -> 80"}


# ---------------------------------------------------------------- models

def patch_switch_linear():
    """MLX's CPU GatherMM takes float32 only: half-precision expert matmuls
    run in float32 and are rounded to the input dtype (this process only)."""
    import mlx.core as mx
    from mlx_lm.models import switch_layers
    if mx.default_device().type != mx.DeviceType.cpu:
        return False
    stock = switch_layers.SwitchLinear.__call__
    if getattr(stock, "float32_on_cpu", False):
        return True

    def call(self, x, indices, sorted_indices=False):
        if x.dtype == mx.float32:
            return stock(self, x, indices, sorted_indices)
        y = mx.gather_mm(x.astype(mx.float32), self["weight"].swapaxes(-1, -2).astype(mx.float32),
                         rhs_indices=indices, sorted_indices=sorted_indices).astype(x.dtype)
        if "bias" in self:
            y = y + mx.expand_dims(self["bias"][indices], -2)
        return y

    call.float32_on_cpu = True
    switch_layers.SwitchLinear.__call__ = call
    return True


def _module(arch):
    return importlib.import_module(f"mlx_lm.models.{arch}")


def _random_weights(model):
    """As tests/test_mlx_architectures.py: the weights a model initialises to zero get 0.1 × normal."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten
    floats = [(k, p) for k, p in tree_flatten(model.parameters()) if mx.issubdtype(p.dtype, mx.floating)]
    zero = [mx.all(p == 0) for _, p in floats]
    mx.eval(zero)
    model.update(tree_unflatten([(k, 0.1 * mx.random.normal(p.shape) if z.item() else p.astype(mx.float32))
                                 for (k, p), z in zip(floats, zero)]))


def set_dtype(model, dtype):
    """Casts the floating parameters to dtype except those the model's
    cast_predicate spares (deepseek_v3's e_score_correction_bias), as mlx_lm.utils does on load."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten
    keep = getattr(model, "cast_predicate", None) or (lambda k: True)
    model.update(tree_unflatten([(k, p.astype(dtype)) for k, p in tree_flatten(model.parameters())
                                 if mx.issubdtype(p.dtype, mx.floating) and keep(k)]))
    mx.eval(model.parameters())
    return model


def build(arch, seed, dtype):
    """A random-weight model: float32 weights from seed, cast to dtype."""
    import mlx.core as mx
    m = _module(arch)
    mx.random.seed(seed)
    model = m.Model(m.ModelArgs.from_dict(dict(CONFIGS[arch])))
    _random_weights(model)
    return set_dtype(model, getattr(mx, dtype))


def with_config(arch, weights_of, overrides):
    """A model of another configuration holding weights_of's weights."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten
    m = _module(arch)
    model = m.Model(m.ModelArgs.from_dict({**CONFIGS[arch], **overrides}))
    src = dict(tree_flatten(weights_of.parameters()))
    if set(src) != {k for k, _ in tree_flatten(model.parameters())}:
        raise SystemExit(f"{arch} {overrides}: the parameters differ")
    model.update(tree_unflatten(list(src.items())))
    mx.eval(model.parameters())
    return model


# ---------------------------------------------------------------- states and the canary

def prefill(model, cache, ids, step, pos=0):
    """Feeds ids after pos cached tokens in chunks ending at multiples of step
    (PromptCache's chunks), each evaluated as MLXEngine.prefill does."""
    import mlx.core as mx
    while ids:
        k = (pos // step + 1) * step - pos
        logits = model(mx.array(ids[:k], dtype=mx.uint32)[None], cache=cache)
        mx.eval(logits[0, -1], [c.state for c in cache])
        pos, ids = pos + len(ids[:k]), ids[k:]
    return cache


def fresh_state(model, ids, step):
    from mlx_lm.models.cache import make_prompt_cache
    return prefill(model, make_prompt_cache(model), list(ids), step)


def restore(cache, like=None):
    """The cache as a load restores it: kvstore.mlx.codecs.cache_state, new
    arrays, tensors_to_cache.  like: a cache whose tensor dtypes the floating
    tensors are cast to (the proxy)."""
    import mlx.core as mx
    from kvstore.mlx.codecs import cache_state, tensors_to_cache
    tensors, meta, _ = cache_state(cache)
    dtypes = {k: v.dtype for k, v in cache_state(like)[0].items()} if like is not None else {}
    out = {}
    for k, v in tensors.items():
        if k in dtypes and mx.issubdtype(v.dtype, mx.floating):
            v = v.astype(dtypes[k])
        out[k] = mx.array(v)
    mx.eval(list(out.values()))
    return tensors_to_cache(out, meta)


def spliced(stored, sibling, n):
    """stored with rows n-BLOCK..n-1 of every positional slot taken from sibling (a replaced last block)."""
    import mlx.core as mx
    from kvstore.mlx.codecs import cache_state, tensors_to_cache
    a, meta, positional = cache_state(stored)
    b, _, _ = cache_state(sibling)
    out = dict(a)
    for k, axis in positional.items():
        if b[k].shape != a[k].shape:
            raise SystemExit(f"sibling slot {k} is {b[k].shape}, not {a[k].shape}")
        lo, hi = [slice(None)] * a[k].ndim, [slice(None)] * a[k].ndim
        lo[axis], hi[axis] = slice(0, n - BLOCK), slice(n - BLOCK, n)
        out[k] = mx.concatenate([a[k][tuple(lo)], b[k][tuple(hi)]], axis=axis)
    mx.eval(list(out.values()))
    return tensors_to_cache(out, meta)


def run_canary(model, stored, ids, n, feed):
    """The Verdict of kvstore's canary on a restore of stored (the state of ids[:n]).

    feed: tokens fed from N-1 for a tail canary (1: canary.check, as
    load_prompt_cache users and kvstore serve run it; more: prepare, the
    chunk PromptCache prefills, finish).  A head canary decides in prepare.
    """
    from kvstore.mlx import canary
    cache = restore(stored)
    tokens = list(ids[:n])
    if feed == 1:
        return canary.check(model, cache, tokens)
    probe, verdict = canary.prepare(model, cache, tokens)
    if probe is None:
        return verdict
    prefill(model, cache, list(ids[n - 1:n - 1 + feed]), step=10 ** 9, pos=n - 1)
    return canary.finish(probe, cache)


def measure(arch, dtype, prompts, log):
    """Every case's distances for one (architecture, dtype).

    Returns:
        list of records {arch, dtype, n, kind, side, case, detail, distance, ok, slot}.
    """
    import mlx.core as mx
    import numpy as np
    from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

    own = build(arch, 0, dtype)
    checkers = {"another model": build(arch, 1, dtype)}
    checkers.update({name: with_config(arch, own, o) for name, o in rope_variants(arch).items()})
    upcast = set_dtype(build(arch, 0, dtype), mx.float32) if dtype != "float32" else None
    records = []
    for pi, (n, ids) in enumerate(prompts):
        t0 = time.perf_counter()
        states = {step: fresh_state(own, ids[:n], step) for step in CHUNKS}
        kind = "tail" if can_trim_prompt_cache(restore(states[CHUNKS[0]])) else "head"
        feeds = (1, EXTRA + 1) if kind == "tail" else (0,)

        def add(side, case, detail, model, stored):
            for feed in feeds:
                v = run_canary(model, stored, ids, n, feed)
                if v.kind != kind:
                    raise SystemExit(f"{arch} {dtype} N={n} {case}: a {v.kind} canary, expected {kind}")
                where = ", ".join(x for x in (detail, f"feed {feed}" if feed else "") if x)
                records.append({"arch": arch, "dtype": dtype, "n": n, "prompt": pi, "kind": kind, "side": side,
                                "case": case, "detail": where, "distance": v.distance, "ok": v.ok, "slot": v.worst,
                                "reason": v.reason})

        for step in CHUNKS:
            add("pass", "rounding", f"{step}-token chunks", own, states[step])
        if upcast is not None:
            proxy = restore(fresh_state(upcast, ids[:n], CHUNKS[0]), like=states[CHUNKS[0]])
            add("pass", "proxy", "float32 compute, cast", own, proxy)
        for case, model in checkers.items():
            add("fail", case, SCALING.get(arch, "linear") if case == "scaling×2" else "", model, states[CHUNKS[0]])
        if kind == "tail":
            sibling = restore(states[CHUNKS[0]])
            if trim_prompt_cache(sibling, BLOCK) != BLOCK:
                raise SystemExit(f"{arch}: the sibling state cannot be trimmed")
            rng = np.random.default_rng(SEED + 7919 * (pi + 1))
            other = [int(t) for t in rng.integers(0, VOCAB, BLOCK)]
            prefill(own, sibling, other, CHUNKS[0], pos=n - BLOCK)
            add("fail", "replaced block", f"rows {n - BLOCK}..{n - 1}", own, spliced(states[CHUNKS[0]], sibling, n))
        log(f"  [{arch} {dtype} N={n} ({kind}): {time.perf_counter() - t0:.1f} s]")
    return records


def log(msg):
    print(msg, file=sys.stderr, flush=True)


# Relative cost of an (architecture, dtype): the costliest go first, so that
# the workers finish together.
COST = {"float16": 3, "bfloat16": 2, "float32": 1.5}
ARCH_COST = {"deepseek_v3": 1.3, "gemma3_text": 1.1, "qwen3_moe": 1.1, "llama": 1.0, "qwen3_next": 0.7}


def task(arch, dtype, prompts):
    """measure() in a worker process (its own MLX, the CPU patch applied)."""
    patch_switch_linear()
    t0 = time.perf_counter()
    records = measure(arch, dtype, prompts, log)
    log(f"  [{arch} {dtype}: {time.perf_counter() - t0:.1f} s]")
    return records


def measure_all(plan, prompts, workers):
    """Every (architecture, dtype) of the plan, in worker processes (spawned:
    MLX does not survive a fork); the records in plan order."""
    tasks = [(arch, dtype) for dtype in plan["dtypes"] for arch in plan["archs"]]
    order = sorted(tasks, key=lambda t: COST[t[1]] * ARCH_COST[t[0]], reverse=True)
    if workers <= 1:
        done = {t: task(*t, prompts) for t in order}
    else:
        with concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = {t: pool.submit(task, *t, prompts) for t in order}
            done = {t: f.result() for t, f in futures.items()}
    return [r for t in tasks for r in done[t]]


# ---------------------------------------------------------------- reporting

def fmt_distance(d):
    if d == 0:
        return "0"
    if d == float("inf"):
        return "∞"
    return f"{d:.1e}"


def fmt_cell(s):
    if s is None:
        return "—"
    if "text" in s:
        return s["text"]
    return fmt_distance(s["distance"])


def fmt_ratio(r):
    if r is None:
        return "—"
    if r == float("inf"):
        return "∞"
    return "0" if r == 0 else f"{r:.2g}"


class Report(Table):
    """Rows whose cells are distances: kvstore = the largest must-pass, peer =
    the smallest must-fail; ratio = must-pass / must-fail (lower is better)."""

    fmt_cell = staticmethod(fmt_cell)
    fmt_ratio = staticmethod(fmt_ratio)

    HEADER = ("| comparison | largest must-pass distance | smallest must-fail distance | ratio (pass / fail) "
              "| target | result | notes |")

    def add(self, comparison, must_pass, must_fail, tolerance, note=""):
        """A judged row: PASS when must_pass ≤ tolerance < must_fail."""
        ratio = must_pass / must_fail if must_fail else float("inf")
        ok = must_pass <= tolerance < must_fail
        self._row(comparison, {"distance": must_pass}, {"distance": must_fail}, "distance", ratio, ratio,
                  f"pass ≤ {tolerance:g} < fail", ok, note)

    def context(self, comparison, kv_text, peer_text, note=""):
        self._row(comparison, {"text": kv_text}, {"text": peer_text}, "context", None, None, "context", None, note)

    def line(self, r):
        return (f"| {r['comparison']} | {r['kvstore_cell']} | {r['peer_cell']} | {r['ratio_text']} "
                f"| {r['target']} | {r['result'] or '—'} | {r['note']} |")


def _extreme(records, side):
    """The record with the largest (pass) or smallest (fail) distance."""
    pick = max if side == "pass" else min
    return pick(records, key=lambda r: r["distance"])


def _case_text(r):
    """A record as "case distance (detail, N=n)"."""
    where = ", ".join(x for x in (r["detail"], f"N={r['n']:,}") if x)
    return f"{r['case']} {fmt_distance(r['distance'])} ({where})"


def summarise(report, records, tolerance):
    """One judged row from the records of one (architecture, dtype, kind)."""
    from kvstore.mlx.canary import HEAD_TOKENS
    head = f"rows 0..{HEAD_TOKENS - 1}"
    arch, dtype, kind = records[0]["arch"], records[0]["dtype"], records[0]["kind"]
    passing = [r for r in records if r["side"] == "pass"]
    failing = [r for r in records if r["side"] == "fail"]
    top, low = _extreme(passing, "pass"), _extreme(failing, "fail")
    # The smallest distance of each must-fail case, to name the runner-up.
    by_case = {}
    for r in failing:
        if r["case"] not in by_case or r["distance"] < by_case[r["case"]]["distance"]:
            by_case[r["case"]] = r
    ranked = sorted(by_case.values(), key=lambda r: r["distance"])
    rounding = max(r["distance"] for r in passing if r["case"] == "rounding")
    notes = [f"{kind} ({'feeds 1 and ' + str(EXTRA + 1) if kind == 'tail' else head})"]
    if top["distance"] == 0:
        notes.append("pass: every must-pass distance 0 (bit-identical rows)")
    else:
        notes.append(f"pass: {_case_text(top)}"
                     + ("" if top["case"] == "rounding" else f", rounding {fmt_distance(rounding)}"))
    notes.append(f"fail: {_case_text(low)}"
                 + (f", next {ranked[1]['case']} {fmt_distance(ranked[1]['distance'])}" if len(ranked) > 1 else ""))
    if kind == "head":
        notes.append(f"a replaced last block is not seen ({head} only), not counted")
    missed = [r for r in ranked if r["distance"] <= tolerance]
    if missed:
        notes.append("NOT separated: " + ", ".join(f"{r['case']} {fmt_distance(r['distance'])}" for r in missed)
                     + f" ≤ {tolerance:g}")
    over = sorted({r["case"] for r in passing if r["distance"] > tolerance})
    if over:
        notes.append("must-pass over the tolerance: " + ", ".join(over))
    notes.append(f"N = {', '.join(f'{n:,}' for n in sorted({r['n'] for r in records}))}")
    # The shipped verdicts agree with the judgement on the distances.
    wrong = [r for r in records if r["ok"] != (r["distance"] <= tolerance)]
    if wrong:
        raise SystemExit(f"{arch} {dtype}: Verdict.ok disagrees with its distance: {wrong[0]}")
    report.add(f"canary {arch} {dtype}, {kind}: largest rounding vs smallest wrong-model distance",
               top["distance"], low["distance"], tolerance, note="; ".join(notes))


def main(argv=None):
    args = harness_arguments(__doc__, "llama and qwen3_next, float32 and bfloat16, 2 short prompts; under a minute",
                             argv, strict_help="exit 1 when a target is missed")

    import mlx.core as mx
    import numpy as np
    from kvstore.mlx import canary

    t_start = time.perf_counter()
    info = machine_info()
    plan = QUICK if args.quick else FULL
    patched = patch_switch_linear()
    rng = np.random.default_rng(SEED)
    prompts = [(n, [int(t) for t in rng.integers(0, VOCAB, n + EXTRA)]) for n in plan["lengths"]]

    # MLX's CPU kernels here run on one core (float16 and bfloat16 do not use
    # BLAS): one worker process per usable core.  The distances do not depend
    # on the process that computes them.
    workers = max(1, min(info["usable_cores"] or 1, len(plan["archs"]) * len(plan["dtypes"])))
    records = measure_all(plan, prompts, workers)

    report = Report()
    lengths = ", ".join(f"{n:,}" for n in plan["lengths"])
    for dtype in plan["dtypes"]:
        tol = canary.tolerance(dtype)
        report.section(f"{dtype}: tolerance {tol:g}")
        report.context(f"canary {dtype}: prompts and lengths", f"{len(prompts)} prompts", f"N = {lengths}",
                       note=f"{len(plan['archs'])} architectures, every prompt in each; "
                            f"{sum(r['dtype'] == dtype for r in records)} canary verdicts; tail feeds 1 and "
                            f"{EXTRA + 1} tokens, head {canary.HEAD_TOKENS}")
        for arch in plan["archs"]:
            for kind in ("tail", "head"):
                group = [r for r in records if r["arch"] == arch and r["dtype"] == dtype and r["kind"] == kind]
                if group:
                    summarise(report, group, tol)
    elapsed = time.perf_counter() - t_start

    print(f"# kvstore canary benchmark ({'quick' if args.quick else 'full'} run)\n")
    print(machine_lines(info, extra=f" (device {mx.default_device()})"))
    print(f"- models: random-weight mlx-lm {', '.join(f'{a} ({KINDS[a]})' for a in plan['archs'])}; hidden 256, "
          f"4 layers, vocabulary {VOCAB}; dtypes {', '.join(plan['dtypes'])}"
          + ("; MoE expert matmuls in float32, rounded to the dtype (MLX's CPU GatherMM is float32-only)"
             if patched else ""))
    print(f"- prompts: {len(prompts)} of random token ids, N = {lengths} stored + {EXTRA} after; states prefilled "
          f"in chunks ending at multiples of {' or '.join(f'{c:,}' for c in CHUNKS)}, restored through "
          "kvstore.mlx.codecs (cache_state, tensors_to_cache); the canary is kvstore.mlx.canary's "
          "(prepare/finish, check) and each distance its Verdict.distance")
    print("- must pass: rounding (the model's own state, either chunking, either feed) and the proxy (float16, "
          "bfloat16: the same weights computed in float32, the state cast down); must fail: another model (seed 1), "
          "rope_theta ×10 and ×1.1, RoPE scaling ×2, a replaced last block of 256 rows (tail canary)")
    print(f"- elapsed {elapsed:.1f} s ({workers} worker process{'es' if workers > 1 else ''}, one "
          "(architecture, dtype) at a time each)")
    print("- cells are relative L2 distances (the largest over layers and slots); ratio = largest must-pass / "
          "smallest must-fail (lower is better); a row passes when the must-pass distance is within the dtype's "
          "tolerance and the must-fail one beyond it\n")
    print(report.markdown())

    return finish(args, info, elapsed, report, plan={k: list(v) for k, v in plan.items()}, extra_tokens=EXTRA,
                  block=BLOCK, chunks=list(CHUNKS), workers=workers, tolerance=dict(canary.TOLERANCE), cases=records)


if __name__ == "__main__":
    sys.exit(main())
