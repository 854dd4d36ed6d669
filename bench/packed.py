"""Packed blocks (kv_codec="lossless") against raw blocks and mlx-lm's files, at real KV sizes.

Run as a script path (not ``python -m``), so the installed ``kvstore`` is the
one imported:

    python bench/packed.py              # two geometries at 8,192 tokens
    python bench/packed.py --quick      # one at 2,048 tokens
    python bench/packed.py --json results.json

Three sides on the same arrays, through bench/shapes.py's children (the
zoo's normal bfloat16 values, a KV cache as mlx-lm holds it): kvstore's
default store (raw blocks), a store that packs them (kv_codec="lossless":
docs/format.md §20), and mlx-lm's save_prompt_cache file.  Rows per
geometry: the bytes stored; a durable save of the session (then a turn of
1,000 tokens); a load into MLX from a cold page cache (dropped first, as
root) and from a warm one; each side's median over rounds in which the
sides take turns (bench/shapes.py says why).  Then the bytes a session of
the trained model of bench/quality.py stores packed against raw: real KV
statistics, where the zoo's are random.

Targets (issue 38): packed never slower to load warm than raw by more
than 5%, and faster cold wherever it stores fewer bytes.
"""

import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import shapes  # noqa: E402
from foundation import TextTable, drop_page_cache, finish, harness_arguments, machine_info, machine_lines  # noqa: E402

SIDES = ("kvstore", "lossless", "peer")
GEOMETRIES = (("Llama-3.1-8B", 8192), ("gpt-oss-20b", 8192))
QUICK_GEOMETRIES = (("Llama-3.1-8B", 2048),)
ROUNDS, QUICK_ROUNDS = 5, 1
WARM_TARGET = 1.05
GiB = 1 << 30


def bench_geometry(report, tmp, g, tokens, order, dropped, rounds):
    total = tokens + shapes.TURN_TOKENS
    report.section(f"{g[0]}: {shapes.per_token_text(g)}; a session of {tokens:,} tokens, then a turn to {total:,}")
    saves = shapes.measure_saves(tmp, g, tokens, order, min(rounds, shapes.SAVE_ROUNDS))
    raw, packed, peer = (saves[s] for s in SIDES)
    report.add(f"bytes stored, {tokens:,} tokens", shapes.cell_bytes(packed["save_bytes"]),
               shapes.cell_bytes(raw["save_bytes"]), "bytes", packed["save_bytes"] / raw["save_bytes"],
               target="context", note=f"mlx-lm's file {shapes.cell_bytes(peer['save_bytes'])['text']}")
    shapes.add_time(report, "durable save: packed vs raw", packed["save_s"], raw["save_s"], target=None,
                    note=f"mlx-lm's {peer['save_s']:.2f} s")
    shapes.add_time(report, f"a turn of {shapes.TURN_TOKENS:,} tokens: packed vs raw", packed["turn_s"],
                    raw["turn_s"], target=None)
    loads = shapes.measure_loads(tmp, g, total, order, dropped, rounds)
    arrays = shapes.state_bytes(g, total)
    for temp in ("cold", "warm"):
        k, p, m = (loads[temp][s]["seconds"] for s in SIDES)
        target = WARM_TARGET if temp == "warm" else 1.0
        note = "" if temp == "warm" or dropped else "page cache NOT dropped (not root)"
        shapes.add_time(report, f"load into MLX, {temp}, {total:,} tokens ({arrays / GiB:.2f} GiB): packed vs raw",
                        p, k, target=target, note=note)
        shapes.add_time(report, f"load into MLX, {temp}: packed vs mlx-lm", p, m, target=None)
    return dict(geometry=g[0], tokens=tokens, saves=saves, loads=loads)


def trained_bytes(report, tmp):
    """A session of the trained model (bench/quality.py) saved raw and packed: the bytes."""
    import kvstore
    import kvstore.mlx
    import quality
    model, tok, path, log = quality.trained_model(quality.QUICK_TRAIN)
    ids = quality.held_out_windows(tok, 1)[0][:quality.PREFIX]
    cache = quality.as_cache(quality.prefix_state(model, ids))
    sizes = {}
    for codec in ("raw", "lossless"):
        d = os.path.join(tmp, "trained-" + codec)
        with kvstore.KVStore(d, block_tokens=shapes.BLOCK_TOKENS, durable=False, kv_codec=codec,
                             options=kvstore.Options(min_tokens=1)) as store:
            text = b"".join(b"t%06d " % i for i in ids)
            e = kvstore.mlx.save_prompt_cache(store, text, ids, cache, None, min_tokens=1,
                                              text_offsets=lambda i: i * shapes.TOKEN_TEXT)
            assert e is not None
            sizes[codec] = store.stats()["bytes"]
    report.section(f"the trained model of bench/quality.py ({quality.ARCH}, {quality.QUICK_TRAIN['steps']} "
                   f"steps): a {len(ids):,}-token session")
    report.add("bytes stored", shapes.cell_bytes(sizes["lossless"]), shapes.cell_bytes(sizes["raw"]), "bytes",
               sizes["lossless"] / sizes["raw"], target="context", note="packed vs raw, files whole")
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
        trained = trained_bytes(report, tmp)
    elapsed = time.perf_counter() - t0
    print(f"# Packed blocks at real KV sizes ({'quick' if args.quick else 'full'} run)\n")
    print(machine_lines(info))
    print("- cold loads: " + ("page cache dropped before each (root)" if dropped else "page cache NOT dropped"))
    print(f"- elapsed {elapsed:.1f} s\n")
    print(report.markdown())
    return finish(args, info, elapsed, report, geometries=results, trained=trained)


if __name__ == "__main__":
    sys.exit(main())
