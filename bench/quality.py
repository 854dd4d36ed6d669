"""What lossy KV costs in answers, measured on a model trained here (random weights say nothing).

Run as a script path (not ``python -m``), so the installed ``kvstore`` is the
one imported:

    python bench/quality.py              # train (cached) and measure
    python bench/quality.py --quick      # a shorter training and fewer windows
    python bench/quality.py --json results.json

The model: a llama of 4 layers, hidden 256, 4 query and 2 KV heads of 64
dims, trained with AdamW on the Python standard library's own sources
(this machine has them; the demo tokenizer, kvstore.demo.model), its
weights cached under the kvstore cache root (``bench-trained-<key>``, a
loadable mlx-lm model directory; never in the repository) and reused while
the recipe is the same.  Its KV cache is bfloat16, as served models keep it.

For each held-out window (PREFIX tokens of a standard-library file the
training never saw, then CONTINUATION tokens) the prefix is prefilled, and
its KV state handed through each codec before the continuation is scored:

- raw: the state as it is (the reference);
- q8, q4: every K and V block through kvstore's own quantised block form
  (kvstore.payload.quantizing: groups of 64 values along head_dim, affine,
  scale and bias in bfloat16, as KVStore(kv_codec="q8"/"q4") stores a
  chain block and a restore hands it back): the stored bytes are the ones
  a chain block holds, the values the ones a restore gives the model.

Reported per codec: the bytes against raw (the quantised arrays with their
scales and biases); the perplexity of the continuation (teacher-forced)
against raw's; the share of continuation positions whose top token equals
raw's (teacher-forced), and how many tokens free-running greedy decoding
follows raw's before it first differs (at most CONTINUATION); the canary's
distance (kvstore.mlx.canary.check: the last stored token recomputed) of
the restored state, beside the distance of another model's state of the
same prefix (the same architecture, untrained), and the bytes' ratio
under byte-plane zlib (the exponent plane compresses, the mantissa plane
hardly: a first look at what a lossless codec can get on real KV).

``python -m bench`` runs it as its quality harness: the first full run
trains the model (about 19 minutes here), later ones load it.  The canary's
distances are taken with the tolerance of each codec
(kvstore.mlx.canary.LOSSY_TOLERANCE), as a lossy restore is checked.
"""

import hashlib
import json
import math
import os
import statistics
import sys
import sysconfig
import time
import zlib

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
import mlx.optimizers as optim  # noqa: E402
import numpy as np  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402
from mlx_lm.models import cache as mlc  # noqa: E402
from mlx_lm.models import llama  # noqa: E402

from foundation import TextTable, finish, harness_arguments, machine_info, machine_lines  # noqa: E402
from kvstore import host  # noqa: E402
from kvstore.demo import model as demo  # noqa: E402
from kvstore.mlx import canary  # noqa: E402
from kvstore.payload import quantizing  # noqa: E402

ARCH = dict(layers=4, hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=768)
# A step of 8 x 256 tokens takes about 19 s on this 2-core CPU (MLX's CPU
# backend): the 60 steps of the full recipe (about 19 minutes, once: the
# model is cached) reach a loss of 5.6 (a uniform guess over the 2,000
# tokens is 7.6).  The quick recipe (CI's smoke run) trains 3 short steps:
# its figures say nothing, it runs the code.
TRAIN = dict(steps=60, batch=8, seq=256, lr=2e-3, warmup=20, seed=0, corpus_bytes=6 << 20)
QUICK_TRAIN = dict(TRAIN, steps=3, batch=2, warmup=1, corpus_bytes=1 << 20)
PREFIX, CONTINUATION = 1024, 256
WINDOWS, QUICK_WINDOWS = 4, 1
GROUP = 64
CODECS = ("raw", "q8", "q4")


def progress(msg):
    print(f"  {msg}", file=sys.stderr, flush=True)


# ---- the corpus and the model -------------------------------------------------------

def corpus(tok, max_bytes):
    """(training ids, held-out files' ids): the standard library's top-level
    modules in name order, the last tenth of them held out."""
    root = sysconfig.get_path("stdlib")
    names = sorted(n for n in os.listdir(root) if n.endswith(".py"))
    held = set(names[::10])
    train, out, size = [], [], 0
    for n in names:
        if n not in held and size >= max_bytes:
            continue                        # (only what is used is tokenized)
        with open(os.path.join(root, n), encoding="utf-8", errors="replace") as f:
            text = f.read()
        ids = tok.encode(text) + [tok.eos_id]
        if n in held:
            out.append(ids)
        else:
            train += ids
            size += len(text)
    return np.array(train, dtype=np.int32), out


def recipe_key(recipe, tok):
    """A name for the recipe's model: the architecture, the training, the tokenizer and the corpus's Python."""
    with open(os.path.join(tok.path, "tokenizer.json"), "rb") as f:
        vocab = hashlib.sha256(f.read()).hexdigest()
    raw = json.dumps({"arch": ARCH, "train": recipe, "tokenizer": vocab, "python": sys.version_info[:2]},
                     sort_keys=True)
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def train(path, tok, recipe):
    """Trains the model and writes its directory at path; returns (model, log)."""
    ids, _ = corpus(tok, recipe["corpus_bytes"])
    mx.random.seed(recipe["seed"])
    cfg = demo.model_config(vocab=tok.vocab_size, **ARCH)
    model = llama.Model(llama.ModelArgs.from_dict(cfg))
    mx.eval(model.parameters())
    schedule = optim.join_schedules([optim.linear_schedule(1e-5, recipe["lr"], recipe["warmup"]),
                                     optim.cosine_decay(recipe["lr"], recipe["steps"] - recipe["warmup"])],
                                    [recipe["warmup"]])
    opt = optim.AdamW(learning_rate=schedule, weight_decay=0.01)

    def loss_fn(m, x, y):
        return nn.losses.cross_entropy(m(x), y, reduction="mean")
    step = nn.value_and_grad(model, loss_fn)
    rng = np.random.default_rng(recipe["seed"])
    seq, log, t0 = recipe["seq"], [], time.perf_counter()
    for i in range(recipe["steps"]):
        at = rng.integers(0, len(ids) - seq - 1, size=recipe["batch"])
        batch = np.stack([ids[a:a + seq + 1] for a in at])
        loss, grads = step(model, mx.array(batch[:, :-1]), mx.array(batch[:, 1:]))
        opt.update(model, grads)
        mx.eval(model.parameters(), opt.state, loss)
        log.append(float(loss))
        if (i + 1) % 25 == 0 or i + 1 == recipe["steps"]:
            progress(f"quality: training step {i + 1}/{recipe['steps']}, loss {statistics.mean(log[-25:]):.3f}, "
                     f"{time.perf_counter() - t0:.0f} s")
    tmp = path + ".part"
    os.makedirs(tmp, mode=0o700, exist_ok=True)
    demo.make_tokenizer(tmp)
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(dict(cfg, bos_token_id=tok.bos_id, eos_token_id=tok.eos_id), f, indent=1)
    mx.save_safetensors(os.path.join(tmp, "model.safetensors"), dict(tree_flatten(model.parameters())))
    with open(os.path.join(tmp, "training.json"), "w") as f:
        json.dump({"recipe": recipe, "arch": ARCH, "loss": log, "seconds": time.perf_counter() - t0}, f)
    os.replace(tmp, path)
    return model, log


def trained_model(recipe):
    """(the trained model in bfloat16, the tokenizer, its directory, its training log), trained once per recipe."""
    from mlx_lm import load
    root = os.path.expanduser(host.default_cache_root())
    os.makedirs(root, mode=0o700, exist_ok=True)
    tok = demo.make_tokenizer(os.path.join(root, "bench-tokenizer"))
    path = os.path.join(root, f"bench-trained-{recipe_key(recipe, tok)}")
    if not os.path.isfile(os.path.join(path, "model.safetensors")):
        progress(f"quality: training {ARCH} for {recipe['steps']} steps into {path}")
        train(path, tok, recipe)
    model, _ = load(path)
    model.set_dtype(mx.bfloat16)
    with open(os.path.join(path, "training.json")) as f:
        log = json.load(f)["loss"]
    return model, tok, path, log


# ---- codecs and scores ---------------------------------------------------------------

def through(state, codec):
    """The (keys, values) of each layer after codec: (state, bytes stored, raw bytes)."""
    out, stored, raw = [], 0, 0
    for k, v in state:
        pair = []
        for a in (k, v):
            raw += a.nbytes
            if codec == "raw":
                pair.append(a)
                stored += a.nbytes
                continue
            raw16 = np.array(a.view(mx.uint16))
            _, parts = quantizing.pack([memoryview(raw16).cast("B")], "bfloat16", codec)
            blob = b"".join(bytes(memoryview(p).cast("B")) for p in parts)
            stored += len(blob)
            back = np.empty_like(raw16)
            quantizing.Form(codec, "bfloat16", GROUP).unpack(blob, memoryview(back).cast("B"),
                                                             (0, back.nbytes, 1, back.nbytes), "quality", codec)
            pair.append(mx.array(back).view(mx.bfloat16))
        out.append(tuple(pair))
    mx.eval(out)
    return out, stored, raw


def as_cache(state):
    """mlx-lm KVCache objects holding state ((keys, values) per layer), as a restore hands them over."""
    cache = []
    for k, v in state:
        c = mlc.KVCache()
        c.state = (k, v, k.shape[2])
        cache.append(c)
    return cache


def prefix_state(model, ids):
    """(keys, values) of each layer after prefilling ids, as arrays of exactly their tokens."""
    cache = mlc.make_prompt_cache(model)
    model(mx.array([ids]), cache=cache)
    state = [(c.keys[..., :c.offset, :], c.values[..., :c.offset, :]) for c in cache]
    mx.eval(state)
    return state


def plane_ratio(state):
    """zlib(level 1) of the bfloat16 values split into their high and low byte planes, over their bytes."""
    raw = np.concatenate([np.array(a.view(mx.uint16)).reshape(-1) for kv in state for a in kv])
    planes = raw.view(np.uint8).reshape(-1, 2)
    packed = sum(len(zlib.compress(planes[:, i].tobytes(), 1)) for i in (0, 1))
    return packed / raw.nbytes


def score(model, state, prefix, cont):
    """(logits over cont teacher-forced, greedy tokens from the state) of a state holding prefix[:-1]."""
    logits = model(mx.array([[prefix[-1]] + cont[:-1]]), cache=as_cache(state))[0]
    cache, tok, greedy = as_cache(state), prefix[-1], []
    for _ in range(len(cont)):
        tok = int(mx.argmax(model(mx.array([[tok]]), cache=cache)[0, -1]))
        greedy.append(tok)
    mx.eval(logits)
    return logits.astype(mx.float32), greedy


def window_scores(model, other, ids):
    prefix, cont = ids[:PREFIX], ids[PREFIX:PREFIX + CONTINUATION]
    base = prefix_state(model, prefix[:-1])
    foreign = prefix_state(other, prefix[:-1])
    # Every state made before any canary runs: the canary writes its
    # recomputed row into the cache it checks, whose arrays these share.
    states = {codec: through(base, codec) for codec in CODECS}
    aliens = {codec: through(foreign, codec)[0] for codec in CODECS}
    ref_logits, ref_greedy = score(model, base, prefix, cont)
    out = {"raw": {"plane_zlib": plane_ratio(base)}}
    for codec, (state, stored, raw) in states.items():
        logits, greedy = score(model, state, prefix, cont)
        ce = nn.losses.cross_entropy(logits, mx.array(cont), reduction="mean")
        agree = float(mx.mean(mx.argmax(logits, axis=-1) == mx.argmax(ref_logits, axis=-1)))
        follow = next((i for i, (a, b) in enumerate(zip(greedy, ref_greedy)) if a != b), len(cont))
        out.setdefault(codec, {}).update(bytes_ratio=stored / raw, ppl=math.exp(float(ce)), agree=agree,
                                         follow=follow)
    for codec, (state, _, _) in states.items():
        lossy = "" if codec == "raw" else codec
        out[codec]["canary_own"] = canary.check(model, as_cache(state), prefix[:-1], lossy).distance
        out[codec]["canary_other"] = canary.check(model, as_cache(aliens[codec]), prefix[:-1], lossy).distance
    return out


def held_out_windows(tok, n):
    _, held = corpus(tok, 0)
    need = PREFIX + CONTINUATION
    long = [ids for ids in held if len(ids) >= need]
    step = max(1, len(long) // n)
    return [ids[:need] for ids in long[::step][:n]]


def report_rows(report, per_window):
    ref_ppl = statistics.median(w["raw"]["ppl"] for w in per_window)
    for codec in CODECS:
        got = {k: statistics.median(w[codec][k] for w in per_window)
               for k in ("bytes_ratio", "ppl", "agree", "follow", "canary_own", "canary_other")}
        report.add(f"{codec}: {PREFIX:,}-token prefix stored, {CONTINUATION} tokens scored",
                   {"text": f"ppl {got['ppl']:.3f}"}, {"text": f"ppl {ref_ppl:.3f}"}, "ppl",
                   got["ppl"] / ref_ppl,
                   note=f"bytes {got['bytes_ratio']:.3f} of raw; top token as raw's {got['agree']:.1%}; greedy "
                        f"follows raw's {got['follow']:.0f} of {CONTINUATION} tokens; canary distance "
                        f"{got['canary_own']:.3g} (another model's state {got['canary_other']:.3g}, tolerance "
                        f"{canary.tolerance('bfloat16', '' if codec == 'raw' else codec)})" + (
                            f"; byte-plane zlib {statistics.median(w['raw']['plane_zlib'] for w in per_window):.3f}"
                            if codec == "raw" else "") + f"; medians of {len(per_window)} windows")


def main(argv=None):
    args = harness_arguments(__doc__, "3 short training steps, one window", argv, strict_help="(no targets yet)")
    t0 = time.perf_counter()
    info = machine_info()
    recipe = QUICK_TRAIN if args.quick else TRAIN
    model, tok, path, log = trained_model(recipe)
    mx.random.seed(recipe["seed"] + 1)             # another model, the same one every run
    other = llama.Model(llama.ModelArgs.from_dict(demo.model_config(vocab=tok.vocab_size, **ARCH)))
    other.set_dtype(mx.bfloat16)
    windows = held_out_windows(tok, QUICK_WINDOWS if args.quick else WINDOWS)
    per_window = []
    for i, ids in enumerate(windows):
        per_window.append(window_scores(model, other, ids))
        progress(f"quality: window {i + 1}/{len(windows)} scored")
    report = TextTable()
    report.section(f"lossy KV against raw on a trained model ({ARCH}, bfloat16 KV, "
                   f"{recipe['steps']} steps, final loss {statistics.mean(log[-25:]):.2f})")
    report_rows(report, per_window)
    elapsed = time.perf_counter() - t0
    print(f"# KV codecs' quality ({'quick' if args.quick else 'full'} run)\n")
    print(machine_lines(info))
    print(f"- model: {path}\n- elapsed {elapsed:.1f} s\n")
    print(report.markdown())
    return finish(args, info, elapsed, report, windows=per_window, recipe=recipe, arch=ARCH)


if __name__ == "__main__":
    sys.exit(main())
