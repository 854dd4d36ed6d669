"""Packed and quantised blocks (kv_codec "lossless", "q8", "q4") against raw blocks and mlx-lm's files, at real KV sizes.

Run as a script path (not ``python -m``), so the installed ``kvstore`` is the
one imported:

    python bench/packed.py              # two geometries at 8,192 tokens
    python bench/packed.py --quick      # one at 2,048 tokens
    python bench/packed.py --json results.json

Five sides on the same arrays, through bench/shapes.py's children (the
zoo's normal bfloat16 values, a KV cache as mlx-lm holds it): kvstore's
default store (raw blocks), stores that pack them (kv_codec="lossless")
or quantise them (kv_codec="q8", "q4"; docs/format.md §20), and mlx-lm's
save_prompt_cache file.  Rows per
geometry: the bytes stored; a durable save of the session (then a turn of
1,000 tokens); a load into MLX from a cold page cache (dropped first, as
root) and from a warm one; each side's median over rounds in which the
sides take turns (bench/shapes.py says why).  Then the bytes a session of
the trained model of bench/quality.py stores packed against raw: real KV
statistics, where the zoo's are random.

Targets (issue 38): packed never slower to load warm than raw by more
than 5%, and faster cold wherever it stores fewer bytes; q8 at most 0.55
of raw's bytes, q4 0.30.
"""

import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import shapes  # noqa: E402
from foundation import TextTable, drop_page_cache, finish, harness_arguments, machine_info, machine_lines  # noqa: E402

CODECS = ("lossless", "q8", "q4")
SIDES = ("kvstore",) + CODECS + ("peer",)
GEOMETRIES = (("Llama-3.1-8B", 8192), ("gpt-oss-20b", 8192))
QUICK_GEOMETRIES = (("Llama-3.1-8B", 2048),)
ROUNDS, QUICK_ROUNDS = 5, 1
WARM_TARGET = 1.05
# The bytes a lossy codec stores against raw (16-bit KV: 0.53 and 0.28 by the form).
BYTES_TARGET = {"q8": 0.55, "q4": 0.30}
GiB = 1 << 30


def bytes_row(report, comparison, codec, got, raw, note):
    """A row of codec's stored bytes against raw's, judged where the codec has a target."""
    ratio, target = got / raw, BYTES_TARGET.get(codec)
    report.add(comparison, shapes.cell_bytes(got), shapes.cell_bytes(raw), "bytes", ratio,
               target=f"bytes ratio ≤ {target}" if target else None,
               passed=None if target is None else ratio <= target, note=note)


def bench_geometry(report, tmp, g, tokens, order, dropped, rounds):
    total = tokens + shapes.TURN_TOKENS
    report.section(f"{g[0]}: {shapes.per_token_text(g)}; a session of {tokens:,} tokens, then a turn to {total:,}")
    saves = shapes.measure_saves(tmp, g, tokens, order, min(rounds, shapes.SAVE_ROUNDS))
    raw, peer = saves["kvstore"], saves["peer"]
    for codec in CODECS:
        got = saves[codec]
        bytes_row(report, f"bytes stored, {tokens:,} tokens: {codec} vs raw", codec, got["save_bytes"],
                  raw["save_bytes"], f"mlx-lm's file {shapes.cell_bytes(peer['save_bytes'])['text']}")
        shapes.add_time(report, f"durable save: {codec} vs raw", got["save_s"], raw["save_s"], target=None,
                        note=f"mlx-lm's {peer['save_s']:.2f} s")
        shapes.add_time(report, f"a turn of {shapes.TURN_TOKENS:,} tokens: {codec} vs raw", got["turn_s"],
                        raw["turn_s"], target=None)
    loads = shapes.measure_loads(tmp, g, total, order, dropped, rounds)
    arrays = shapes.state_bytes(g, total)
    for temp in ("cold", "warm"):
        k, m = loads[temp]["kvstore"]["seconds"], loads[temp]["peer"]["seconds"]
        note = "" if temp == "warm" or dropped else "page cache NOT dropped (not root)"
        for codec in CODECS:
            p = loads[temp][codec]["seconds"]
            target = (WARM_TARGET if temp == "warm" else 1.0) if codec == "lossless" else None
            shapes.add_time(report, f"load into MLX, {temp}, {total:,} tokens ({arrays / GiB:.2f} GiB): "
                            f"{codec} vs raw", p, k, target=target, note=note)
            shapes.add_time(report, f"load into MLX, {temp}: {codec} vs mlx-lm", p, m, target=None)
    return dict(geometry=g[0], tokens=tokens, saves=saves, loads=loads)


def trained_bytes(report, tmp, quick):
    """A session of the trained model (bench/quality.py) saved raw and through each codec: the bytes."""
    import kvstore
    import kvstore.mlx
    import quality
    recipe = quality.QUICK_TRAIN if quick else quality.TRAIN
    model, tok, path, log = quality.trained_model(recipe)
    ids = quality.held_out_windows(tok, 1)[0][:quality.PREFIX]
    cache = quality.as_cache(quality.prefix_state(model, ids))
    sizes = {}
    for codec in ("raw",) + CODECS:
        d = os.path.join(tmp, "trained-" + codec)
        with kvstore.KVStore(d, block_tokens=shapes.BLOCK_TOKENS, durable=False, kv_codec=codec,
                             min_tokens=1) as store:
            text = b"".join(b"t%06d " % i for i in ids)
            e = kvstore.mlx.save_prompt_cache(store, text, ids, cache, None, min_tokens=1,
                                              text_offsets=lambda i: i * shapes.TOKEN_TEXT)
            assert e is not None
            sizes[codec] = store.stats()["bytes"]
    report.section(f"the trained model of bench/quality.py ({quality.ARCH}, {recipe['steps']} "
                   f"steps): a {len(ids):,}-token session")
    for codec in CODECS:
        bytes_row(report, f"bytes stored: {codec} vs raw", codec, sizes[codec], sizes["raw"],
                  "files whole (headers, text, manifests included)")
    return sizes


def main(argv=None):
    args = harness_arguments(__doc__, "one geometry at 2,048 tokens, one round", argv)
    args.strict = False
    t0 = time.perf_counter()
    info = machine_info()
    dropped = drop_page_cache()
    report = TextTable()
    results = []
    todo = QUICK_GEOMETRIES if args.quick else GEOMETRIES
    for i, (name, tokens) in enumerate(todo):
        order = SIDES if i % 2 == 0 else SIDES[::-1]
        print(f"packed: {name} at {tokens:,} tokens", file=sys.stderr, flush=True)
        with tempfile.TemporaryDirectory(prefix="kvstore-bench-packed-", dir=os.environ.get("TMPDIR", "/tmp")) as tmp:
            results.append(bench_geometry(report, tmp, shapes.geometry_named(name), tokens, order, dropped,
                                          QUICK_ROUNDS if args.quick else ROUNDS))
    with tempfile.TemporaryDirectory(prefix="kvstore-bench-packed-") as tmp:
        trained = trained_bytes(report, tmp, args.quick)
    elapsed = time.perf_counter() - t0
    print(f"# Packed blocks at real KV sizes ({'quick' if args.quick else 'full'} run)\n")
    print(machine_lines(info))
    print("- cold loads: " + ("page cache dropped before each (root)" if dropped else "page cache NOT dropped"))
    print(f"- elapsed {elapsed:.1f} s\n")
    print(report.markdown())
    return finish(args, info, elapsed, report, geometries=results, trained=trained)


if __name__ == "__main__":
    sys.exit(main())
