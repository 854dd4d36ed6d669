"""Which lossless codec for KV blocks: bytes saved against decode speed, measured on real KV statistics.

Run as a script path (not ``python -m``), so the installed ``kvstore`` is the
one imported:

    python bench/lossless.py              # every codec whose library is installed
    python bench/lossless.py --quick      # fewer repeats
    python bench/lossless.py --json results.json

The candidates need their libraries (the ``bench`` extra installs
zstandard, lz4 and blosc2); one whose library is missing is listed as
skipped.

The data: KV blocks as a chained checkpoint stores them, one tensor's
256 tokens (BLOCK_TOKENS) at a time, in bfloat16:

- the trained model of bench/quality.py (a 4-layer llama trained here on
  the standard library's sources, its weights cached; its quick recipe
  with ``--quick``): K and V of held-out windows after their prefill,
  apart, since they differ (V's low bytes repeat more);
- the zoo's random values (bench/shapes.py's normal bfloat16): what every
  storage row of python -m bench stores, so what compression does to those
  rows.

The candidates, each on whole blocks:

- planes + table: kvstore's kv_codec="lossless" (kvstore.payload.packing):
  the high plane as 4-bit codes into its 16 most common values, the rest
  as exceptions (csrc/table.h), the low plane raw;
- planes + zstd / lz4 / zlib: the block split into its two byte planes
  (kvstore._native.planes_split: high bytes, sign and exponent, apart from
  the low bytes, the mantissa) and each plane compressed by itself, kept
  raw when it does not shrink below PLANE_KEEP of its size; decode is the
  planes' decompression and planes_join into the destination;
- blosc2 with its own byte shuffle or bit shuffle and its LZ4 or zstd;
- zstd of the block as it is (no planes): what the planes are worth.

Reported per data set and codec: stored bytes over raw, and the decode and
encode rates in GB/s of raw bytes (the best of REPEATS), decode also on two
threads at once (each thread its own blocks): a codec that holds the GIL
gets no faster on two.  The peer column is a plain copy of the same bytes
(what a raw load does to them after the read), at the same thread count.
"""

import concurrent.futures
import os
import sys
import time
import zlib

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

from foundation import TextTable, finish, harness_arguments, machine_info, machine_lines  # noqa: E402
from kvstore import _native  # noqa: E402

BLOCK_TOKENS = 256          # a chained save's block (bench/shapes.py's)
PLANE_KEEP = 0.95           # a plane compressed to more than this share of its size is kept raw
REPEATS, QUICK_REPEATS = 7, 3
WINDOWS = 4                 # held-out windows of the trained model
RANDOM_BLOCK = (8, 128)     # the zoo's block: 8 KV heads of 128 dims (Llama-3.1-8B), 256 tokens
RANDOM_BLOCKS = 16


# ---- the data ----------------------------------------------------------------------

def trained_blocks(quick):
    """{"trained K": [block, ...], "trained V": [...]}: uint16 arrays of BLOCK_TOKENS tokens."""
    import mlx.core as mx
    import quality
    recipe = quality.QUICK_TRAIN if quick else quality.TRAIN
    model, tok, path, log = quality.trained_model(recipe)
    out = {"trained K": [], "trained V": []}
    for ids in quality.held_out_windows(tok, WINDOWS):
        for k, v in quality.prefix_state(model, ids[:quality.PREFIX]):
            for name, a in (("trained K", k), ("trained V", v)):
                a = np.array(a.view(mx.uint16))
                for t in range(0, a.shape[2] - BLOCK_TOKENS + 1, BLOCK_TOKENS):
                    out[name].append(np.ascontiguousarray(a[:, :, t:t + BLOCK_TOKENS]))
    return out, f"{recipe['steps']} training steps, final loss {sum(log[-25:]) / len(log[-25:]):.2f}"


def random_blocks():
    """The zoo's values: normal bfloat16, as bench/shapes.py fills its caches."""
    import mlx.core as mx
    mx.random.seed(0)
    heads, dim = RANDOM_BLOCK
    a = mx.random.normal((RANDOM_BLOCKS, 1, heads, BLOCK_TOKENS, dim), dtype=mx.bfloat16)
    a = np.array(a.view(mx.uint16))
    return [np.ascontiguousarray(b) for b in a]


# ---- the codecs --------------------------------------------------------------------

class Planes:
    """A block as two byte planes, each compressed by compress or kept raw."""

    def __init__(self, compress, decompress):
        self.compress, self.decompress = compress, decompress

    def encode(self, block):
        n = block.size
        planes = [bytearray(n), bytearray(n)]
        _native.planes_split([block], planes)
        out = []
        for p in planes:
            c = self.compress(p)
            out.append((True, c) if len(c) <= PLANE_KEEP * n else (False, bytes(p)))
        return out

    def stored(self, enc):
        return sum(len(c) for _, c in enc)

    def decode(self, enc, dst):
        n = len(dst) // 2
        planes = [self.decompress(c, n) if packed else c for packed, c in enc]
        _native.planes_join(planes, [dst])


class Table:
    """kvstore's own packing (kvstore.payload.packing): the planes, the high
    one a table plane (csrc/table.h) where that shrinks it."""

    def __init__(self):
        from kvstore.payload import packing
        self.packing = packing

    def encode(self, block):
        planes, parts = self.packing.pack([block], 2)
        return planes, b"".join(bytes(p) for p in parts)

    def stored(self, enc):
        return len(enc[1])

    def decode(self, enc, dst):
        self.packing.unpack(enc[1], enc[0], dst, (0, len(dst), 1, 0), "bench", "block")


class Whole:
    """A block compressed as it is."""

    def __init__(self, compress, decompress):
        self.compress, self.decompress = compress, decompress

    def encode(self, block):
        return self.compress(memoryview(block).cast("B"))

    def stored(self, enc):
        return len(enc)

    def decode(self, enc, dst):
        dst[:] = self.decompress(enc, len(dst))


class Blosc2:
    def __init__(self, blosc2, codec, shuffle, level):
        self.b, self.kw = blosc2, dict(typesize=2, clevel=level, codec=codec, filters=[shuffle], nthreads=1)
        blosc2.set_releasegil(True)

    def encode(self, block):
        return self.b.compress2(block, **self.kw)

    def stored(self, enc):
        return len(enc)

    def decode(self, enc, dst):
        self.b.decompress2(enc, dst=dst)


def codecs():
    """[(name, codec or None, why skipped)] for every candidate."""
    out = [("planes + table (kvstore's lossless)", Table(), "")]
    try:
        import zstandard
    except ImportError:
        zstandard = None
    try:
        import lz4.block as lz4
    except ImportError:
        lz4 = None
    try:
        import blosc2
    except ImportError:
        blosc2 = None

    def zstd(level):
        c = zstandard.ZstdCompressor(level=level)
        return c.compress, lambda data, n: zstandard.ZstdDecompressor().decompress(data, max_output_size=n)

    for level in (1, 3):
        out.append((f"planes + zstd {level}", Planes(*zstd(level)) if zstandard else None, "zstandard"))
    out.append(("zstd 1, no planes", Whole(*zstd(1)) if zstandard else None, "zstandard"))
    out.append(("planes + lz4", Planes(lambda p: lz4.compress(p, store_size=False),
                                       lambda c, n: lz4.decompress(c, uncompressed_size=n)) if lz4 else None, "lz4"))
    out.append(("planes + zlib 1", Planes(lambda p: zlib.compress(p, 1), lambda c, n: zlib.decompress(c)), ""))
    for label, codec, shuffle, level in (("blosc2 lz4 + bit shuffle", "LZ4", "BITSHUFFLE", 5),
                                         ("blosc2 zstd 1 + byte shuffle", "ZSTD", "SHUFFLE", 1)):
        out.append((label, Blosc2(blosc2, getattr(blosc2.Codec, codec), getattr(blosc2.Filter, shuffle), level)
                    if blosc2 else None, "blosc2"))
    return out


# ---- the measurements -------------------------------------------------------------

def best_rate(fn, nbytes, repeats):
    """GB/s of nbytes through fn, the best of repeats."""
    best = min(_timed(fn) for _ in range(repeats))
    return nbytes / best / 1e9


def _timed(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def on_threads(pool, work, threads):
    """work(i) for i in range(threads) on the pool, joined."""
    for f in [pool.submit(work, i) for i in range(threads)]:
        f.result()


def measure(codec, blocks, repeats, pool):
    raw = sum(b.nbytes for b in blocks)
    enc = [codec.encode(b) for b in blocks]
    dsts = [bytearray(b.nbytes) for b in blocks]
    for e, d, b in zip(enc, dsts, blocks):
        codec.decode(e, d)
        assert bytes(d) == b.tobytes(), "decode is not the block"
    halves = [list(range(0, len(blocks), 2)), list(range(1, len(blocks), 2))]

    def decode(idx):
        for i in idx:
            codec.decode(enc[i], dsts[i])

    return dict(ratio=sum(codec.stored(e) for e in enc) / raw,
                encode=best_rate(lambda: [codec.encode(b) for b in blocks], raw, repeats),
                decode1=best_rate(lambda: decode(range(len(blocks))), raw, repeats),
                decode2=best_rate(lambda: on_threads(pool, lambda i: decode(halves[i]), 2), raw, repeats))


def copy_rates(blocks, repeats, pool):
    raw = sum(b.nbytes for b in blocks)
    dsts = [bytearray(b.nbytes) for b in blocks]
    halves = [list(range(0, len(blocks), 2)), list(range(1, len(blocks), 2))]

    def copy(idx):
        for i in idx:
            _native.copy_runs(dsts[i], 0, blocks[i], 0, blocks[i].nbytes, 1, blocks[i].nbytes)

    return (best_rate(lambda: copy(range(len(blocks))), raw, repeats),
            best_rate(lambda: on_threads(pool, lambda i: copy(halves[i]), 2), raw, repeats))


def main(argv=None):
    args = harness_arguments(__doc__, f"{QUICK_REPEATS} repeats instead of {REPEATS}, quality.py's quick model",
                             argv)
    args.strict = False
    t0 = time.perf_counter()
    info = machine_info()
    repeats = QUICK_REPEATS if args.quick else REPEATS
    sets, how = trained_blocks(args.quick)
    sets[f"zoo's random normal ({RANDOM_BLOCK[0]} heads x {RANDOM_BLOCK[1]})"] = random_blocks()
    report = TextTable()
    results = {}
    skipped = sorted({why for _, c, why in codecs() if c is None})
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        for name, blocks in sets.items():
            raw = sum(b.nbytes for b in blocks)
            report.section(f"{name}: {len(blocks)} blocks of {blocks[0].nbytes // 1024} KiB "
                           f"({BLOCK_TOKENS} tokens of bfloat16)" + (f"; trained {how}" if "trained" in name else ""))
            c1, c2 = copy_rates(blocks, repeats, pool)
            results[name] = {"raw_bytes": raw, "copy": [c1, c2], "codecs": {}}
            for label, codec, _ in codecs():
                if codec is None:
                    continue
                m = measure(codec, blocks, repeats, pool)
                results[name]["codecs"][label] = m
                report.add(label, {"text": f"{m['ratio']:.3f} of the bytes; decode {m['decode1']:.2f} GB/s, "
                                           f"{m['decode2']:.2f} on 2 threads"},
                           {"text": f"copy {c1:.2f} GB/s, {c2:.2f} on 2"}, "bytes", m["ratio"],
                           note=f"encode {m['encode']:.2f} GB/s")
                print(f"codecs: {name}: {label}: {m['ratio']:.3f}", file=sys.stderr, flush=True)
    elapsed = time.perf_counter() - t0
    print(f"# Lossless codecs for KV blocks ({'quick' if args.quick else 'full'} run)\n")
    print(machine_lines(info))
    print("- skipped (library not installed): " + (", ".join(skipped) or "none"))
    print(f"- elapsed {elapsed:.1f} s\n")
    print(report.markdown())
    return finish(args, info, elapsed, report, sets=results, skipped=skipped)


if __name__ == "__main__":
    sys.exit(main())
