"""Store benchmarks: KVStore lookup, load and save against ds4 and mlx-lm, side by side.

Run as a script path (not ``python -m``), so the installed ``kvstore`` is the
one imported:

    python bench/store.py              # full run, under 6 minutes
    python bench/store.py --quick      # under 60 s
    python bench/store.py --json results.json --strict

Three comparisons, each with its peer measured in the same run, interleaved
sample by sample (A, B, B, A, ...), after a warm-up wherever a call costs less
than seconds; cells are median / min and targets are judged on the ratio of
the medians:

1. Lookup (docs/semantics.md §4): ``store.find(prompt)`` on a directory of N = 10 ..
   10,000 checkpoints against a Python port of ds4's
   ``ds4_kvstore_find_text_prefix`` (hashlib SHA1 of the prompt prefix for
   every candidate, ds4's skip rules, directory listing order), and against one
   hashlib.sha1 of the whole prompt.
2. Load (docs/semantics.md §5) of a 0.5 GiB KV state, first load in a fresh process
   with a warm page cache and a second one in the same process, against
   mlx-lm's ``load_prompt_cache``, ``mx.load`` of the same safetensors,
   ``np.load`` of the tensors as .npy and a raw sequential read of the .kv
   file: every sample is a new ``python -c`` child timed after its imports,
   and a child that exits non-zero or aborts ("terminate called ...") is
   reported.  The same state is also stored as a chain (docs/format.md §14,
   payload ABI 17) of CHAIN_BLOCKS blocks at the default block size (and of
   twice as many at half that size) and loaded by the same children, against
   the ABI 16 file and against mlx-lm.
3. Save (docs/semantics.md §6) of the same state, durable and not, against mlx-lm's
   ``save_prompt_cache``, ``mx.save_safetensors`` and ``np.save``; the file
   sizes against mlx-lm's.  The default path too: a save with KVStore's
   defaults (layout "chain", block_tokens 256, durable=True: every block
   written to a temporary file, fsync'ed, put in place, the directory
   fsync'ed) against
   ``save_prompt_cache`` followed by an fsync of its file and of the
   directory (the same promise), and against ``save_prompt_cache`` alone.

Every store here that writes passes its layout explicitly, except the one
that measures the defaults: KVStore's default is "chain" (docs/format.md
§14), and the lookup, ABI 16 load and other save rows are about one whole
ABI 16 file per checkpoint (layout="whole").

The JSON (--json) also holds the lookup curve and the GB/s of every load and
save method, which ``python -m bench`` plots (bench/plots.py).

The machine this was written for is a shared, noisy 2-core VM: compare
ratios, not absolute numbers.
"""

import dataclasses
import gc
import hashlib
import json
import os
import random
import statistics
import struct
import subprocess
import sys
import tempfile
import textwrap
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import kvstore  # noqa: E402
from foundation import PROMPT_BYTES, SAMPLE_NS, SEED, Table, compare, fmt_time, harness_arguments  # noqa: E402
from foundation import machine_info, machine_lines  # noqa: E402
from foundation import stats as _stats  # noqa: E402

# ---- lookup ------------------------------------------------------------------

LOOKUP_SIZES = (10, 100, 1000, 10000)
# The hit prompt is the longest stored text plus a new user turn of this size,
# so the longest text is 399 KB of the 400 KB prompt.
HIT_SUFFIX_BYTES = 1024
MAX_TEXT_BYTES = PROMPT_BYTES - HIT_SUFFIX_BYTES
# Envelope fields of the generated entries.  Quant 4: ds4's header reader drops
# every other value, so its port sees the same entries as kvstore.  The token
# count clears the default min_tokens (512).  The payload is a sparse hole:
# find() reads envelopes only, never payloads.
ENTRY_TOKENS = 1024
ENTRY_QUANT_BITS = 4
ENTRY_CTX_SIZE = 32768
ENTRY_PAYLOAD_BYTES = 64 * 1024
# A budget no directory here reaches (the sparse files' apparent size is ~2 GB).
UNLIMITED_BUDGET_MB = 1 << 20

LOOKUP_MIN_SPEEDUP = 100         # kvstore vs ds4 at 10,000 entries, a miss
LOOKUP_MAX_SHA1_RATIO = 3.0      # kvstore find vs one hashlib.sha1 of the prompt

# ---- load and save -----------------------------------------------------------

# 32 layers of an 8-KV-head, 128-dim model at 4096 tokens, float16: 64 tensors of
# 8 MiB, 0.5 GiB.  4096 is a multiple of mlx-lm's KVCache step (256), so its
# saved state holds exactly these bytes, no padding.
LAYERS = 32
KV_HEADS = 8
CONTEXT_TOKENS = 4096
HEAD_DIM = 128
KV_SHAPE = (1, KV_HEADS, CONTEXT_TOKENS, HEAD_DIM)
KV_BYTES = LAYERS * 2 * int(np.prod(KV_SHAPE)) * 2
CHECKPOINT_TEXT_BYTES = 16 * 1024        # the rendered prompt the state belongs to
RAW_READ_BUFFER = 16 << 20
CHILD_TIMEOUT_S = 300
CHILD_SETTLE_S = 0.2             # after the imports, before the first timed load

LOAD_MAX_TIME_RATIO = 1.0        # kvstore first load vs mlx-lm load_prompt_cache
# The same state as a chain (docs/format.md §14) at the default block size:
# 256 tokens a block, 16 blocks (512 KiB of each of the 64 tensors per block,
# read as 8 strided runs of 64 KiB).  The prompt text is CHECKPOINT_TEXT_BYTES
# / CONTEXT_TOKENS = 4 bytes per token, so every cut adds text.
CHAIN_BLOCK_TOKENS = kvstore.settings.DEFAULT_BLOCK_TOKENS
CHAIN_BLOCKS = CONTEXT_TOKENS // CHAIN_BLOCK_TOKENS
LOAD_CHAIN_MIN_SPEED = 0.95      # chain load speed vs the ABI 16 file's: time ratio ≤ 1 / 0.95
LOAD_CHAIN_MAX_TIME_RATIO = 1.0  # chain first load vs mlx-lm load_prompt_cache
SAVE_MAX_TIME_RATIO = 1.0        # kvstore save (durable=False) vs mlx-lm save_prompt_cache
# A save with KVStore's defaults (a durable chain) against save_prompt_cache
# made durable the same way (an fsync of the file and of its directory): no
# slower than the peer for the same promise.
SAVE_DURABLE_MAX_TIME_RATIO = 1.0
# Sealed checkpoints (docs/format.md §16): a sealed load and save at least
# 0.7x as fast as the plain ones, a sealed lookup within 10 % of a plain one.
SEALED_MIN_SPEED = 0.7
SEALED_LOOKUP_MAX_TIME_RATIO = 1.1
RSS_SLACK_MIB = 64               # docs/semantics.md §5: peak RSS above the arrays themselves

MiB = 1024 * 1024


# ---------------------------------------------------------------- reporting

def plural(n, word):
    return f"{n} {word}" + ("" if n == 1 else "s")


def fmt_ratio(r):
    if r == 0 or r >= 0.1:
        return f"{r:.2f}"
    return f"{r:.2g} (1/{1 / r:.0f})"


def fmt_cell(s):
    if s is None:
        return "—"
    if "median_mib" in s:
        return f"{s['median_mib']:.0f} MiB / {s['min_mib']:.0f} MiB"
    if "bytes" in s:
        return f"{s['bytes']:,} B"
    cell = f"{fmt_time(s['median_ns'])} / {fmt_time(s['min_ns'])}"
    if "median_gbps" in s:
        cell += f" ({s['median_gbps']:.2f} / {s['max_gbps']:.2f} GB/s)"
    return cell


def stats(ns_list, nbytes=None):
    """foundation.stats, keeping the samples (in run order) for the JSON."""
    return {**_stats(ns_list, nbytes), "samples_ns": list(ns_list)}


def paired_ratio(kv_ns, peer_ns):
    """Median of kvstore/peer over samples taken in the same round: drift cancels."""
    return statistics.median(a / b for a, b in zip(kv_ns, peer_ns))


def mib_stats(values_mib):
    return {"median_mib": statistics.median(values_mib), "min_mib": min(values_mib), "n": len(values_mib)}


class Report(Table):
    """Rows of the one results table (the columns of bench/foundation.py)."""

    fmt_cell = staticmethod(fmt_cell)
    fmt_ratio = staticmethod(fmt_ratio)

    def add(self, comparison, kv, peer, target=None, note="", passed=None, passed_target=""):
        """Adds a row; ratio = kvstore / peer on the medians (lower is better).

        kv, peer: foundation.stats() dicts (times), mib_stats() dicts (memory)
            or {"bytes": n} (file sizes).
        target: the highest passing ratio, or None for a context row.
        passed (with passed_target, its text) replaces the ratio test.
        """
        if "median_mib" in kv:
            key, low, unit = "median_mib", "min_mib", "memory"
        elif "bytes" in kv:
            key, low, unit = "bytes", "bytes", "size"
        else:
            key, low, unit = "median_ns", "min_ns", "time"
        ratio = kv[key] / peer[key] if peer[key] else float("inf")
        ratio_min = kv[low] / peer[low] if peer[low] else float("inf")
        target_text = f"{unit} ratio ≤ {fmt_ratio(target)}" if target is not None else "context"
        ok = ratio <= target if target is not None else None
        if passed is not None:
            ok, target_text = passed, passed_target
        self._row(comparison, kv, peer, unit, ratio, ratio_min, target_text, ok, note)


# ---------------------------------------------------------------- ds4's lookup, ported

@dataclasses.dataclass
class Ds4Entry:
    """The fields of ds4_kvstore_entry that ds4_kvstore_find_text_prefix reads."""
    sha: str
    quant_bits: int
    tokens: int
    ctx_size: int
    text_bytes: int


_DS4_FIXED_HEADER = 48
_HEX = frozenset("0123456789abcdefABCDEF")


def ds4_refresh(directory):
    """Port of ds4's kv_cache_refresh: every valid header, in readdir order.

    ds4_kvstore_sha_hex_name accepts 40 hex digits + ".kv"; read_entry_file
    stats the file, reads the 48-byte header and the text length, and keeps
    the entry when magic and version match, tokens != 0, quant is 2 or 4 and
    the file is long enough.
    """
    out = []
    with os.scandir(directory) as it:
        for de in it:
            name = de.name
            if len(name) != 43 or name[40:] != ".kv" or not set(name[:40]) <= _HEX:
                continue
            path = os.path.join(directory, name)
            try:
                size = os.stat(path).st_size
                if size < _DS4_FIXED_HEADER + 4:
                    continue
                with open(path, "rb") as f:
                    h = f.read(_DS4_FIXED_HEADER + 4)
            except OSError:
                continue
            if len(h) < _DS4_FIXED_HEADER + 4 or h[:4] != b"KVC\x01":
                continue
            quant = h[4]
            tokens, _hits, ctx = struct.unpack_from("<III", h, 8)
            (payload_bytes,) = struct.unpack_from("<Q", h, 40)
            (text_bytes,) = struct.unpack_from("<I", h, 48)
            if tokens == 0 or quant not in (2, 4):
                continue
            if size < _DS4_FIXED_HEADER + 4 + text_bytes + payload_bytes:
                continue
            out.append(Ds4Entry(name[:40].lower(), quant, tokens, ctx, text_bytes))
    return out


def ds4_find_text_prefix(entries, prompt, min_tokens, ctx_size, quant_bits=4, reject_different_quant=False):
    """Port of ds4_kvstore_find_text_prefix's loop (ds4_kvstore.c), skip rules as written.

    ds4 calls kv_cache_refresh() first (see ds4_refresh); entries is its result.
    Returns the index of the best entry, or -1.
    """
    prompt_bytes = len(prompt)
    mv = memoryview(prompt)
    best = -1
    for i, e in enumerate(entries):
        if e.text_bytes > prompt_bytes:
            continue
        if e.tokens < min_tokens:
            continue
        if ctx_size < e.ctx_size:
            continue
        if reject_different_quant and e.quant_bits != quant_bits:
            continue
        if best >= 0:
            b = entries[best]
            if e.text_bytes < b.text_bytes:
                continue
            if e.text_bytes == b.text_bytes and e.tokens <= b.tokens:
                continue
        if hashlib.sha1(mv[:e.text_bytes]).hexdigest() == e.sha:
            best = i
    return best


# ---------------------------------------------------------------- lookup

def sparse_entry_header():
    """The 48 header bytes every generated entry shares."""
    return kvstore.format.Header(quant_bits=ENTRY_QUANT_BITS, tokens=ENTRY_TOKENS, ctx_size=ENTRY_CTX_SIZE,
                          payload_bytes=ENTRY_PAYLOAD_BYTES, reason=kvstore.format.Reason.COLD, payload_abi=16,
                          created_at=int(time.time())).pack()


def write_sparse_entry(directory, name, text_len, header):
    """A valid envelope whose text (zeros) and payload are a sparse hole.

    The file is 52 + text_len + ENTRY_PAYLOAD_BYTES bytes long but occupies one
    block: the index reads the 52-byte prefix and the file size, nothing else.
    Its name is the SHA1 of its text, text_len zero bytes.
    """
    fd = os.open(os.path.join(directory, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, header + struct.pack("<I", text_len))
        os.ftruncate(fd, 52 + text_len + ENTRY_PAYLOAD_BYTES)
    finally:
        os.close(fd)


def sample(fns, repeats, heavy=()):
    """foundation.compare, except for the functions named in heavy.

    ds4's loop costs a second or more per call at 10,000 entries: a heavy
    function gets no warm-up and no calibration call, one call per sample.
    The others get 3 warm-up calls and enough calls per sample to last about
    SAMPLE_NS (at most 20).

    Returns:
        (name -> list of per-call nanoseconds, one per repeat,
         name -> what the last call returned).
    """
    names = list(fns)
    number = {}
    for name in names:
        if name in heavy:
            number[name] = 1
            continue
        for _ in range(3):
            fns[name]()
        t0 = time.perf_counter_ns()
        fns[name]()
        number[name] = max(1, min(20, SAMPLE_NS // max(1, time.perf_counter_ns() - t0)))
    out = {name: [] for name in names}
    last = {}
    for r in range(repeats):
        for name in (names if r % 2 == 0 else names[::-1]):
            fn, k = fns[name], number[name]
            t0 = time.perf_counter_ns()
            for _ in range(k):
                last[name] = fn()
            out[name].append((time.perf_counter_ns() - t0) / k)
    return out, last


def lookup_repeats(n, quick):
    # ds4's loop costs ~1 s per call at 10,000 entries: fewer repeats there.
    if quick:
        return 2 if n >= 10000 else 7
    return 9 if n >= 10000 else 21


class LookupDir:
    """A lookup directory that grows from 1 entry to N, for the scaling curve.

    One real checkpoint holds the hit prompt's first MAX_TEXT_BYTES; the other
    entries are sparse envelopes with distinct, shorter texts of zero bytes
    (write_sparse_entry), which no prompt here starts with.  grow(n) adds
    entries in place, so the curve's directories are built once.
    """

    def __init__(self, directory, rng):
        self.directory = directory
        # Prompts start with a non-zero byte, so no zero-filled text is a prefix
        # of either, and the miss prompt starts differently from the hit prompt.
        hit_prompt = bytearray(rng.randbytes(PROMPT_BYTES))
        miss_prompt = bytearray(rng.randbytes(PROMPT_BYTES))
        hit_prompt[0] = 0x41
        miss_prompt[0] = 0x42
        self.hit_prompt, self.miss_prompt = bytes(hit_prompt), bytes(miss_prompt)
        # 9,999 distinct lengths spread uniformly over 1..MAX_TEXT_BYTES-1, plus the
        # one real entry at MAX_TEXT_BYTES; N entries = the real one + the first N-1.
        self.lengths = rng.sample(range(1, MAX_TEXT_BYTES), max(LOOKUP_SIZES) - 1)
        self.names = [d.hex() + ".kv" for d in kvstore.format.sha1_prefixes(bytes(MAX_TEXT_BYTES), self.lengths)]
        # layout="whole": the real entry is an ABI 16 file like the sparse ones,
        # so find() takes the flat pass of docs/semantics.md §4 (a chain block
        # would make the directory a lookup forest, docs/format.md §14).
        self.store = kvstore.KVStore(directory, budget_mb=UNLIMITED_BUDGET_MB, quant_bits=ENTRY_QUANT_BITS,
                                     ctx_size=ENTRY_CTX_SIZE, durable=False,
                                     layout="whole")
        self.real = self.store.save(self.hit_prompt[:MAX_TEXT_BYTES], np.arange(ENTRY_TOKENS, dtype=np.uint32),
                                    {"x": np.zeros(16, np.float16)})
        assert self.real is not None, "the real lookup entry was refused"
        assert self.real.payload_abi == 16, self.real.payload_abi
        self.header = sparse_entry_header()
        self.n = 1

    def grow(self, n):
        """Adds sparse entries until the directory holds n; waits out the mtime granularity."""
        for name, length in zip(self.names[self.n - 1:n - 1], self.lengths[self.n - 1:n - 1]):
            write_sparse_entry(self.directory, name, length, self.header)
        self.n = max(self.n, n)
        time.sleep(0.1)               # past the index's mtime granularity: a warm, unchanged directory
        assert self.store.stats()["entries"] == self.n

    def digest_pass(self, n, prompt):
        """The SHA1 work of a find among the first n entries, alone: a callable
        running kvstore._native.sha1_prefix_matches over their lengths
        (ascending, as the index holds them) and names."""
        pairs = sorted(zip(self.lengths[:n - 1] + [MAX_TEXT_BYTES],
                           [bytes.fromhex(x[:40]) for x in self.names[:n - 1]] + [bytes.fromhex(self.real.sha)]))
        lengths = np.array([length for length, _ in pairs], dtype=np.uint64)
        digests = b"".join(d for _, d in pairs)
        return lambda: kvstore._native.sha1_prefix_matches(prompt, lengths, digests)

    def text_megabytes(self):
        """MB of text ds4's loop hashes on a miss: every entry's text."""
        return (sum(self.lengths[:self.n - 1]) + MAX_TEXT_BYTES) / 1e6

    def close(self):
        self.store.close()
        for name in os.listdir(self.directory):
            os.unlink(os.path.join(self.directory, name))
        os.rmdir(self.directory)


def bench_lookup(report, tmp, rng, quick):
    report.section("Lookup scaling: KVStore.find vs ds4's find loop, 400 KB prompt")
    lookup = LookupDir(os.path.join(tmp, "lookup"), rng)
    directory, store, opts = lookup.directory, lookup.store, lookup.store.settings
    hit_prompt, miss_prompt, real = lookup.hit_prompt, lookup.miss_prompt, lookup.real
    curve = []
    try:
        for n in LOOKUP_SIZES:
            t_n = time.perf_counter()
            lookup.grow(n)
            ds4_entries = ds4_refresh(directory)
            assert len(ds4_entries) == n, (len(ds4_entries), n)
            repeats = lookup_repeats(n, quick)
            fns = {
                "kv_miss": lambda: store.find(miss_prompt),
                "ds4_miss": lambda: ds4_find_text_prefix(ds4_entries, miss_prompt, opts.min_tokens,
                                                         ENTRY_CTX_SIZE),
                "kv_hit": lambda: store.find(hit_prompt),
                "ds4_hit": lambda: ds4_find_text_prefix(ds4_entries, hit_prompt, opts.min_tokens,
                                                        ENTRY_CTX_SIZE),
            }
            # ds4 hashes 0.2 GB (N=1,000) to 2 GB (N=10,000) a call.
            times, got = sample(fns, repeats, heavy=("ds4_miss", "ds4_hit") if n >= 1000 else ())
            # The comparisons with one SHA1 pass are sampled apart: a call
            # right after a second of ds4 hashing 2 GB starts with its arrays
            # and the prompt out of the caches.
            light, _ = sample({"kv_miss_alone": lambda: store.find(miss_prompt),
                               "sha1": lambda: hashlib.sha1(miss_prompt).digest(),
                               "digests": lookup.digest_pass(n, miss_prompt)}, repeats * 3)
            times.update(light)
            st = {k: stats(v) for k, v in times.items()}
            # Both found the same thing (checked on what the timed calls returned).
            assert got["kv_miss"] is None and got["ds4_miss"] == -1, (got["kv_miss"], got["ds4_miss"])
            e, position = got["kv_hit"], got["ds4_hit"]
            assert e is not None and e.sha == real.sha and e.text_bytes == MAX_TEXT_BYTES
            assert position >= 0 and ds4_entries[position].sha == real.sha
            top = n == max(LOOKUP_SIZES)
            # ds4 also rescans the directory before every lookup (kv_cache_refresh:
            # a stat, an open and a 52-byte read per file); the loop rows leave it out.
            rescan = statistics.median(sample({"r": lambda: ds4_refresh(directory)}, 3, heavy=("r",))[0]["r"])
            rows = [
                (f"find, N={n:,}, miss vs ds4 find loop (hashlib port)", "kv_miss", "ds4_miss",
                 1 / LOOKUP_MIN_SPEEDUP if top else None,
                 f"{repeats} repeats; ds4 hashes all {n:,} prefixes "
                 f"({lookup.text_megabytes():.0f} MB); "
                 f"its directory rescan, left out, adds {fmt_time(rescan)}"),
                (f"find, N={n:,}, hit vs ds4 find loop (hashlib port)", "kv_hit", "ds4_hit", None,
                 f"the hit is entry {position + 1:,} of {n:,} in listing order"),
                (f"find, N={n:,}, miss vs one hashlib.sha1 of the 400 KB prompt", "kv_miss_alone", "sha1",
                 LOOKUP_MAX_SHA1_RATIO if top else None,
                 f"{3 * repeats} repeats, sampled apart from ds4's loop"
                 + ("; its digest pass alone is the row below but one" if top else "")),
            ]
            if top:
                rows += [
                    (f"find, N={n:,}, miss vs its digest pass alone (sha1_prefix_matches of the same {n:,} "
                     "lengths, no index)", "kv_miss_alone", "digests", None,
                     f"{3 * repeats} repeats; what the lookup adds to the SHA1 work it cannot skip"),
                    (f"the digest pass alone: one SHA1 pass over the 400 KB prompt finishing {n:,} digests vs "
                     "one hashlib.sha1 of it", "digests", "sha1", None,
                     f"{3 * repeats} repeats; the floor of a find among {n:,} distinct lengths on this machine"),
                ]
            for label, a, b, target, note in rows:
                report.add(label, st[a], st[b], target, note=note)
            point = {"n": n, "ds4_rescan_ns": rescan, "hit_position": position, **st}
            curve.append(point)
            print(f"  [lookup N={n:,}: {time.perf_counter() - t_n:.1f} s]", file=sys.stderr, flush=True)
    finally:
        lookup.close()
    return curve


def write_sparse_sealed_entry(directory, name, text_len, header, key_id, lookup_tag):
    """write_sparse_entry for a sealed store (payload ABI 48): the envelope and
    the clear seal head the index reads (with the name's lookup tag); the body
    is a sparse hole."""
    from kvstore import seal
    from kvstore.format import SEAL_HEAD, SEAL_MAGIC, SEAL_VERSION
    body = text_len + ENTRY_PAYLOAD_BYTES
    size = seal.BODY_OFFSET + body
    h = kvstore.format.Header.unpack(header)
    h.payload_abi, h.payload_bytes = 48, size - 52 - text_len
    fd = os.open(os.path.join(directory, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, h.pack() + struct.pack("<I", text_len)
                 + SEAL_HEAD.pack(SEAL_MAGIC, SEAL_VERSION, seal.CHUNK_LOG2, 0, key_id, bytes(16), body,
                                  ENTRY_PAYLOAD_BYTES, 16, seal.CHUNK_BYTES, lookup_tag))
        os.ftruncate(fd, size)
    finally:
        os.close(fd)


def bench_sealed_lookup(report, tmp, rng, quick):
    """find() in a sealed store (HMAC-SHA1 names, lookup tags: the same one
    pass over the prompt, one more SHA1 block per tag that matches) vs a
    plain store, the same 10,000 lengths, in the same run."""
    from kvstore import seal
    from kvstore.names import names_of
    n = max(LOOKUP_SIZES)
    key = os.urandom(32)
    sealer = seal.Sealer(key)
    hit = bytearray(rng.randbytes(PROMPT_BYTES))
    miss = bytearray(rng.randbytes(PROMPT_BYTES))
    hit[0], miss[0] = 0x41, 0x42
    hit, miss = bytes(hit), bytes(miss)
    lengths = rng.sample(range(1, MAX_TEXT_BYTES), n - 1)
    digests = kvstore.format.sha1_prefixes(bytes(MAX_TEXT_BYTES), lengths)
    names, tags = names_of(bytes(MAX_TEXT_BYTES), lengths, sealer.names)
    header = sparse_entry_header()
    stores, reals = {}, {}
    for kind in ("plain", "sealed"):
        d = os.path.join(tmp, f"lookup-{kind}")
        kw = {"key": key} if kind == "sealed" else {}
        stores[kind] = kvstore.KVStore(d, budget_mb=UNLIMITED_BUDGET_MB, quant_bits=ENTRY_QUANT_BITS,
                                       ctx_size=ENTRY_CTX_SIZE, durable=False, layout="whole", **kw)
        reals[kind] = stores[kind].save(hit[:MAX_TEXT_BYTES], np.arange(ENTRY_TOKENS, dtype=np.uint32),
                                        {"x": np.zeros(16, np.float16)})
        for dg, name, tag, length in zip(digests, names, tags, lengths):
            if kind == "sealed":
                write_sparse_sealed_entry(d, name.hex() + ".kv", length, header, sealer.key_id, tag)
            else:
                write_sparse_entry(d, dg.hex() + ".kv", length, header)
    time.sleep(0.1)
    try:
        for s in stores.values():
            assert s.stats()["entries"] == n
        fns = {"sealed_miss": lambda: stores["sealed"].find(miss), "plain_miss": lambda: stores["plain"].find(miss),
               "sealed_hit": lambda: stores["sealed"].find(hit), "plain_hit": lambda: stores["plain"].find(hit)}
        times, got = sample(fns, lookup_repeats(n, quick) * 3)
        assert got["sealed_miss"] is None and got["plain_miss"] is None
        assert got["sealed_hit"].sha == reals["sealed"].sha and got["plain_hit"].sha == reals["plain"].sha
        st = {k: stats(v) for k, v in times.items()}
        report.add(f"find, N={n:,} sealed (keyed names), miss vs the same plain store", st["sealed_miss"],
                   st["plain_miss"], SEALED_LOOKUP_MAX_TIME_RATIO,
                   note=f"{n:,} distinct stored lengths: one SHA1 pass (from the key's inner state) gives "
                        "the inner hash at each; a lookup tag that does not match passes the length over")
        report.add(f"find, N={n:,} sealed (keyed names), hit vs the same plain store", st["sealed_hit"],
                   st["plain_hit"], SEALED_LOOKUP_MAX_TIME_RATIO,
                   note="the hit is the longest stored text: its tag matches, and one outer SHA1 block "
                        "finishes its HMAC")
    finally:
        for s in stores.values():
            s.close()


# ---------------------------------------------------------------- load: fresh processes

# Each child imports the same modules (whichever it uses), waits for them to
# settle, then times one load: the first in the process (fresh allocator,
# fresh pages), then a second one (warm).  It prints one JSON line.  The wait:
# `import numpy` starts OpenBLAS's threads, which spin for about 50 ms (one
# core busy, measured), and a load timed inside that window shares the CPU
# with them; which child imported numpy last would decide the result.
# Peak memory is VmHWM from /proc/self/status: ru_maxrss is
# useless here because Linux carries the parent's peak (this process holds
# the 0.5 GiB state, ~1 GiB at its peak) into the child across fork + exec;
# ru_maxrss is still recorded in the JSON.
_CHILD_PRELUDE = """
import gc, json, resource, sys, time
import numpy, mlx.core, mlx_lm.models.cache, kvstore
time.sleep(%(settle)s)
def peak_kib():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
def maxrss_kib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
def measure(once):
    hwm0, ru0 = peak_kib(), maxrss_kib()
    first, arrays = once()
    hwm1, ru1 = peak_kib(), maxrss_kib()
    nbytes = sum(a.nbytes for a in arrays)
    del arrays
    gc.collect()
    warm, arrays = once()
    del arrays
    return {"first_s": first, "warm_s": warm, "hwm0_kib": hwm0, "hwm1_kib": hwm1,
            "maxrss0_kib": ru0, "maxrss1_kib": ru1, "nbytes": nbytes}
""" % {"settle": CHILD_SETTLE_S}

_CHILD_KV = _CHILD_PRELUDE + textwrap.dedent("""
    import mlx.core as mx
    import kvstore
    store_dir, text_path, into = sys.argv[1:4]
    key = sys.argv[4] if len(sys.argv) > 4 else None      # a sealed store's key file
    with open(text_path, "rb") as f:
        text = f.read()
    store = kvstore.KVStore(store_dir, budget_mb=%(budget)d, verify=True, key=key)
    info = {}
    def once():
        t0 = time.perf_counter()
        ck = store.load(store.find(text), into=into)
        arrays = list(ck.tensors.values())
        if into == "mlx":
            mx.eval(arrays)
        dt = time.perf_counter() - t0
        # Untimed: what was loaded (an ABI 16 file, or a chain of how many blocks).
        info["payload_abi"] = ck.entry.payload_abi
        info["blocks"] = len(ck.cuts) if ck.entry.is_block else 1
        return dt, arrays
    out = measure(once)
    out.update(info)
    store.close()
    print(json.dumps(out))
""") % {"budget": UNLIMITED_BUDGET_MB}

_CHILD_MLX_LM = _CHILD_PRELUDE + textwrap.dedent("""
    import mlx.core as mx
    from mlx_lm.models.cache import load_prompt_cache
    path = sys.argv[1]
    def once():
        t0 = time.perf_counter()
        cache = load_prompt_cache(path)
        arrays = [a for c in cache for a in (c.keys, c.values)]
        mx.eval(arrays)
        return time.perf_counter() - t0, arrays
    print(json.dumps(measure(once)))
""")

_CHILD_MX_LOAD = _CHILD_PRELUDE + textwrap.dedent("""
    import mlx.core as mx
    path = sys.argv[1]
    def once():
        t0 = time.perf_counter()
        arrays = [a for a in mx.load(path).values() if a.ndim == 4]
        mx.eval(arrays)
        return time.perf_counter() - t0, arrays
    print(json.dumps(measure(once)))
""")


_CHILD_NP_LOAD = _CHILD_PRELUDE + textwrap.dedent("""
    import numpy as np
    path, count = sys.argv[1], int(sys.argv[2])
    def once():
        t0 = time.perf_counter()
        with open(path, "rb") as f:
            arrays = [np.load(f) for _ in range(count)]
        return time.perf_counter() - t0, arrays
    print(json.dumps(measure(once)))
""")


def np_save_all(path, tensors):
    """Peer: every tensor with np.save, one after another in one .npy stream."""
    with open(path, "wb") as f:
        for a in tensors.values():
            np.save(f, np.asarray(a))


def fsync_path(path, flags=os.O_RDONLY):
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_prompt_cache_durable(path, caches):
    """Peer: mlx_lm's save_prompt_cache, then an fsync of the file and of its
    directory: what a durable=True save promises (file and name survive a
    power cut once the call returns)."""
    from mlx_lm.models.cache import save_prompt_cache
    save_prompt_cache(path, caches)
    fsync_path(path)
    fsync_path(os.path.dirname(path) or ".", os.O_RDONLY | os.O_DIRECTORY)


def remove_saved(path):
    """Removes what one timed save wrote (a file, or a store directory's
    checkpoint files); returns (files, bytes) removed."""
    paths = [path]
    if os.path.isdir(path):
        paths = [os.path.join(path, n) for n in os.listdir(path) if kvstore.format.is_checkpoint_name(n)]
    nbytes = 0
    for p in paths:
        nbytes += os.path.getsize(p)
        os.unlink(p)
    return len(paths), nbytes


@dataclasses.dataclass
class ChildRun:
    variant: str
    sample: int
    rc: int
    aborted: bool
    stderr_tail: str
    result: dict = None


def run_child(variant, sample, code, args, cwd):
    """Runs one child; records a non-zero exit or a C++ terminate at exit, never hides it."""
    p = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=cwd,
                       timeout=CHILD_TIMEOUT_S)
    result = None
    for line in reversed(p.stdout.splitlines()):
        if line.startswith("{"):
            result = json.loads(line)
            break
    # A negative rc is a signal (SIGABRT: -6), e.g. std::terminate at exit.
    aborted = p.returncode != 0 or "terminate called" in p.stderr or result is None
    run = ChildRun(variant, sample, p.returncode, aborted, p.stderr[-600:], result)
    if aborted or p.stderr.strip():
        print(f"  CHILD {variant} sample {sample}: rc={p.returncode} stderr: {p.stderr[-600:]!r}",
              file=sys.stderr, flush=True)
    return run


def bar(op, method, nbytes, ns_list):
    """One bar of the throughput plot: GB/s of the median and of the best sample."""
    return {"op": op, "method": method, "median_gbps": nbytes / statistics.median(ns_list),
            "max_gbps": nbytes / min(ns_list)}


def read_raw(path, buf):
    """Sequential read of the whole file into one reused buffer (os.preadv)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        off = 0
        while True:
            n = os.preadv(fd, [buf], off)
            if n == 0:
                return off
            off += n
    finally:
        os.close(fd)


def make_state():
    """The KV state: 32 layers of float16 keys and values from MLX's generator.

    mx.random.normal runs at ~40 MB/s of float16 on this CPU (13 s for the
    whole state), so it draws one keys and one values tensor and every layer
    adds its index: distinct tensors (a swapped layer fails the check) at
    ~1.5 s.
    """
    import mlx.core as mx
    mx.random.seed(SEED)
    keys = mx.random.normal(KV_SHAPE, dtype=mx.float16)
    values = mx.random.normal(KV_SHAPE, dtype=mx.float16)
    tensors = {}
    for layer in range(LAYERS):
        shift = mx.array(layer, dtype=mx.float16)
        tensors[f"{layer}.keys"] = keys + shift
        tensors[f"{layer}.values"] = values - shift
    mx.eval(list(tensors.values()))
    return tensors


def peer_caches(tensors):
    from mlx_lm.models.cache import KVCache
    return [KVCache.from_state((tensors[f"{i}.keys"], tensors[f"{i}.values"], CONTEXT_TOKENS))
            for i in range(LAYERS)]


def kv_meta():
    return {"classes": ["KVCache"] * LAYERS, "offsets": [CONTEXT_TOKENS] * LAYERS}


def bench_load(report, tmp, rng, tensors, quick):
    import mlx.core as mx
    from mlx_lm.models.cache import save_prompt_cache

    store_dir = os.path.join(tmp, "load")
    text = rng.randbytes(CHECKPOINT_TEXT_BYTES)
    text_path = os.path.join(tmp, "load-text.bin")
    with open(text_path, "wb") as f:
        f.write(text)
    tokens = np.arange(CONTEXT_TOKENS, dtype=np.uint32)

    def store_whole(d, abi, **kw):
        """The state as one whole file (layout="whole": KVStore's default is
        "chain") of payload ABI abi, checked bit-exact; returns its Entry."""
        with kvstore.KVStore(d, budget_mb=UNLIMITED_BUDGET_MB, layout="whole", **kw) as store:
            e = store.save(text, tokens, tensors, meta=kv_meta())
            assert e is not None and e.payload_abi == abi, e
            # Correctness before speed: every tensor comes back bit-exact.
            ck = store.load(store.find(text), into="mlx")
            assert ck is not None and np.array_equal(ck.tokens, tokens)
            for k, a in tensors.items():
                assert mx.array_equal(ck.tensors[k], a).item(), k
            del ck
        return e

    entry = store_whole(store_dir, 16)
    kv_path = entry.path
    # The same state sealed (docs/format.md §16): one ABI 48 file.
    from kvstore import seal
    key_path = os.path.join(tmp, "bench.key")
    if not os.path.exists(key_path):
        seal.new_key_file(key_path)
    sealed_dir = os.path.join(tmp, "load-sealed")
    sealed = store_whole(sealed_dir, 48, key=key_path, durable=False)
    # The same state, text and tokens as a chain of CHAIN_BLOCKS blocks
    # (docs/format.md §14): every KV tensor grows along axis 2, one row per
    # token; text_offsets[i] is the byte length of the text of the first i tokens.
    per_token = len(text) // CONTEXT_TOKENS
    assert per_token * CONTEXT_TOKENS == len(text)

    def store_chain(name, block_tokens, key=None):
        """The state as a chain of CONTEXT_TOKENS / block_tokens blocks (sealed
        with key when given), checked bit-exact; returns the dir and files."""
        d = os.path.join(tmp, name)
        # durable=False: the fsyncs would only slow the set-up; the loads read the page cache either way.
        with kvstore.KVStore(d, budget_mb=UNLIMITED_BUDGET_MB, layout="chain", block_tokens=block_tokens,
                             durable=False, key=key) as store:
            last = store.save(text, tokens, tensors, meta=kv_meta(), positional={k: 2 for k in tensors},
                              text_offsets=[per_token * i for i in range(CONTEXT_TOKENS + 1)])
            assert last is not None and last.is_block and last.tokens == CONTEXT_TOKENS, last
            ck = store.load(store.find(text), into="mlx")
            assert ck is not None and ck.entry.is_block and np.array_equal(ck.tokens, tokens)
            assert sorted(ck.cuts) == list(range(block_tokens, CONTEXT_TOKENS + 1, block_tokens)), ck.cuts
            for k, a in tensors.items():
                assert mx.array_equal(ck.tensors[k], a).item(), k
            del ck
        paths = sorted(os.path.join(d, n) for n in os.listdir(d) if n.endswith(".kv"))
        assert len(paths) == CONTEXT_TOKENS // block_tokens, (len(paths), block_tokens)
        return d, paths

    chain_dir, chain_paths = store_chain("load-chain", CHAIN_BLOCK_TOKENS)
    small_dir, small_paths = store_chain("load-chain-small", CHAIN_BLOCK_TOKENS // 2)
    # KVStore's default layout, sealed (payload ABI 49).
    sealed_chain_dir, sealed_chain_paths = store_chain("load-chain-sealed", CHAIN_BLOCK_TOKENS, key_path)
    chain_size = sum(os.path.getsize(p) for p in chain_paths)
    st_path = os.path.join(tmp, "peer.safetensors")
    save_prompt_cache(st_path, peer_caches(tensors))
    npy_path = os.path.join(tmp, "peer.npy")
    np_save_all(npy_path, tensors)

    # Warm page cache: read the files once before any timed load.
    buf = bytearray(RAW_READ_BUFFER)
    for path in (kv_path, st_path, npy_path, sealed.path, *chain_paths, *small_paths, *sealed_chain_paths):
        read_raw(path, buf)

    # (child code, its arguments, samples quick/full).  The target pair gets
    # the most samples; a full run starts with one uncounted round (sample -1).
    variants = {
        "kv_mlx": (_CHILD_KV, [store_dir, text_path, "mlx"], 2, 11),
        "peer": (_CHILD_MLX_LM, [st_path], 2, 11),
        "kv_chain": (_CHILD_KV, [chain_dir, text_path, "mlx"], 2, 11),
        "kv_sealed": (_CHILD_KV, [sealed_dir, text_path, "mlx", key_path], 2, 11),
        "kv_chain_sealed": (_CHILD_KV, [sealed_chain_dir, text_path, "mlx", key_path], 2, 11),
        "kv_chain_small": (_CHILD_KV, [small_dir, text_path, "mlx"], 1, 5),
        "kv_numpy": (_CHILD_KV, [store_dir, text_path, "numpy"], 1, 5),
        "mx_load": (_CHILD_MX_LOAD, [st_path], 1, 5),
        "np_load": (_CHILD_NP_LOAD, [npy_path, str(len(tensors))], 1, 5),
    }
    names = list(variants)
    runs = {v: [] for v in names}
    children = []
    rounds = max(v[2 if quick else 3] for v in variants.values())
    for i in range(0 if quick else -1, rounds):
        order = names if i % 2 == 0 else names[::-1]
        for v in order:
            code, args, n_quick, n_full = variants[v]
            if i >= (n_quick if quick else n_full):
                continue
            run = run_child(v, i, code, args, tmp)
            children.append(run)
            if i >= 0 and run.result is not None:
                runs[v].append(run.result)

    raw = compare({"raw": lambda: read_raw(kv_path, buf)}, 5 if quick else 15, warmup=1, sample_ns=0)

    def times(v, key):
        return [r[key] * 1e9 for r in runs[v]]

    def rss(v):
        return [(r["hwm1_kib"] - r["hwm0_kib"]) / 1024 for r in runs[v]]

    aborts = [c for c in children if c.aborted]
    abort_note = (f"child aborts: {len(aborts)}/{len(children)}" if aborts
                  else f"{len(children)} children, none aborted")
    kv_size, st_size = os.path.getsize(kv_path), os.path.getsize(st_path)
    if not all(runs[v] for v in names):
        missing = [v for v in names if not runs[v]]
        raise RuntimeError(f"no successful child sample for {missing}; see the CHILD lines above")
    # What the children loaded: the ABI 16 file, and the whole chain.
    loaded = {v: sorted({(r["payload_abi"], r["blocks"]) for r in runs[v]})
              for v in ("kv_mlx", "kv_numpy", "kv_chain", "kv_chain_small")}
    assert loaded["kv_mlx"] == loaded["kv_numpy"] == [(16, 1)], loaded
    assert loaded["kv_chain"] == [(17, CHAIN_BLOCKS)], loaded
    assert loaded["kv_chain_small"] == [(17, 2 * CHAIN_BLOCKS)], loaded
    first_kv = stats(times("kv_mlx", "first_s"), KV_BYTES)
    report.add(f"load {KV_BYTES // MiB} MiB, 1st in a fresh process, into MLX, CRC on "
               "vs mlx_lm load_prompt_cache + eval", first_kv,
               stats(times("peer", "first_s"), KV_BYTES), LOAD_MAX_TIME_RATIO,
               note=f"{len(runs['kv_mlx'])}/{len(runs['peer'])} samples, warm page cache; median of per-round "
                    f"ratios {paired_ratio(times('kv_mlx', 'first_s'), times('peer', 'first_s')):.2f}; "
                    f"{abort_note}")
    assert sorted({(r["payload_abi"], r["blocks"]) for r in runs["kv_sealed"]}) == [(48, 1)]
    report.add(f"load {KV_BYTES // MiB} MiB sealed (AES-256-GCM), 1st in a fresh process, into MLX vs the "
               "same state as a plain ABI 16 file", stats(times("kv_sealed", "first_s"), KV_BYTES), first_kv,
               1 / SEALED_MIN_SPEED,
               note=f"{len(runs['kv_sealed'])}/{len(runs['kv_mlx'])} samples; chunks read into MLX's blob and "
                    f"decrypted in place; target: ≥ {SEALED_MIN_SPEED}× the plain load's speed; median of "
                    f"per-round ratios {paired_ratio(times('kv_sealed', 'first_s'), times('kv_mlx', 'first_s')):.2f}")
    first_chain = stats(times("kv_chain", "first_s"), KV_BYTES)
    assert sorted({(r["payload_abi"], r["blocks"]) for r in runs["kv_chain_sealed"]}) == [(49, CHAIN_BLOCKS)]
    report.add(f"load {KV_BYTES // MiB} MiB sealed chain ({CHAIN_BLOCKS} blocks), 1st in a fresh process, into "
               "MLX vs the same chain plain", stats(times("kv_chain_sealed", "first_s"), KV_BYTES), first_chain,
               1 / SEALED_MIN_SPEED,
               note=f"{len(runs['kv_chain_sealed'])}/{len(runs['kv_chain'])} samples; KVStore's default layout; "
                    "each chunk's ciphertext read straight into its rows in MLX's blob and decrypted there in "
                    "one GCM pass (zeroed if its tag fails), each I/O thread a run of whole chunks; target: "
                    f"≥ {SEALED_MIN_SPEED}× the plain load's speed; median of "
                    "per-round ratios "
                    f"{paired_ratio(times('kv_chain_sealed', 'first_s'), times('kv_chain', 'first_s')):.2f}")
    chain_rss = statistics.median(rss("kv_chain"))
    report.add(f"load {KV_BYTES // MiB} MiB chain ({CHAIN_BLOCKS} blocks), 1st in a fresh process, into MLX, "
               "CRC on vs the same state as one ABI 16 file", first_chain, first_kv, 1 / LOAD_CHAIN_MIN_SPEED,
               note=f"{len(runs['kv_chain'])}/{len(runs['kv_mlx'])} samples; {CHAIN_BLOCK_TOKENS} tokens a block "
                    f"(payload ABI 17), same store.find + store.load(into='mlx'); target: chain speed ≥ "
                    f"{LOAD_CHAIN_MIN_SPEED}× the file's; median of per-round ratios "
                    f"{paired_ratio(times('kv_chain', 'first_s'), times('kv_mlx', 'first_s')):.2f}; "
                    f"peak RSS increase {chain_rss:.0f} MiB; chain files {chain_size:,} B "
                    f"vs {kv_size:,} B")
    report.add(f"load {KV_BYTES // MiB} MiB chain ({CHAIN_BLOCKS} blocks), 1st in a fresh process, into MLX, "
               "CRC on vs mlx_lm load_prompt_cache + eval", first_chain,
               stats(times("peer", "first_s"), KV_BYTES), LOAD_CHAIN_MAX_TIME_RATIO,
               note=f"{len(runs['kv_chain'])}/{len(runs['peer'])} samples; median of per-round ratios "
                    f"{paired_ratio(times('kv_chain', 'first_s'), times('peer', 'first_s')):.2f}")
    report.add(f"load {KV_BYTES // MiB} MiB chain ({2 * CHAIN_BLOCKS} blocks of {CHAIN_BLOCK_TOKENS // 2} tokens), "
               "1st in a fresh process, into MLX, CRC on vs the same state as one ABI 16 file",
               stats(times("kv_chain_small", "first_s"), KV_BYTES), first_kv, None,
               note=f"{len(runs['kv_chain_small'])}/{len(runs['kv_mlx'])} samples; half the default block size: "
                    "twice the manifests and half-size runs; median of per-round ratios "
                    f"{paired_ratio(times('kv_chain_small', 'first_s'), times('kv_mlx', 'first_s')):.2f}")
    report.add(f"load {KV_BYTES // MiB} MiB, 1st in a fresh process, into NumPy, CRC on "
               "vs mlx_lm load_prompt_cache + eval", stats(times("kv_numpy", "first_s"), KV_BYTES),
               stats(times("peer", "first_s"), KV_BYTES), None, note=plural(len(runs["kv_numpy"]), "sample"))
    report.add(f"load {KV_BYTES // MiB} MiB, 1st in a fresh process, into MLX vs mx.load(path) "
               "of the safetensors + eval", first_kv, stats(times("mx_load", "first_s"), KV_BYTES), None,
               note=plural(len(runs["mx_load"]), "sample"))
    report.add(f"load {KV_BYTES // MiB} MiB, 1st in a fresh process, into NumPy vs np.load of the same "
               "tensors (.npy stream)", stats(times("kv_numpy", "first_s"), KV_BYTES),
               stats(times("np_load", "first_s"), KV_BYTES), None,
               note=f"{plural(len(runs['np_load']), 'sample')}; kvstore checks CRC32C, np.load nothing")
    report.add(f"load {KV_BYTES // MiB} MiB, 2nd in the same process (warm), into MLX "
               "vs mlx_lm load_prompt_cache 2nd", stats(times("kv_mlx", "warm_s"), KV_BYTES),
               stats(times("peer", "warm_s"), KV_BYTES), None, note="MLX's allocator reuses the freed buffers")
    report.add(f"load {KV_BYTES // MiB} MiB, 1st in a fresh process, into MLX vs raw read of the "
               f".kv file (os.preadv, reused 16 MiB buffer)", first_kv,
               stats(raw["raw"], kv_size), None, note="raw read in this process, page cache warm")
    kv_rss = rss("kv_mlx")
    report.add("peak RSS increase (VmHWM) of a 1st load, into MLX vs mlx_lm load_prompt_cache",
               mib_stats(kv_rss), mib_stats(rss("peer")), None,
               note=f"arrays are {KV_BYTES // MiB} MiB; into NumPy: "
                    f"{statistics.median(rss('kv_numpy')):.0f} MiB; mx.load: "
                    f"{statistics.median(rss('mx_load')):.0f} MiB",
               passed=statistics.median(kv_rss) <= KV_BYTES / MiB + RSS_SLACK_MIB,
               passed_target=f"kvstore ≤ arrays + {RSS_SLACK_MIB} MiB (docs/semantics.md §5)")
    report.add("file size: .kv (prompt text + token ids + tensors + CRCs) vs mlx_lm save_prompt_cache",
               {"bytes": kv_size}, {"bytes": st_size}, None,
               note=f".npy stream of the tensors: {os.path.getsize(npy_path):,} B")
    fresh, warm = "load, 1st in a fresh process", "load, 2nd in the same process"
    throughput = [bar(op, method, KV_BYTES, ns) for op, method, ns in (
        (fresh, "kvstore → MLX", times("kv_mlx", "first_s")),
        (fresh, f"kvstore chain ({CHAIN_BLOCKS} blocks) → MLX", times("kv_chain", "first_s")),
        (fresh, "kvstore → NumPy", times("kv_numpy", "first_s")),
        (fresh, "mlx_lm load_prompt_cache", times("peer", "first_s")),
        (fresh, "mx.load(safetensors)", times("mx_load", "first_s")),
        (fresh, "np.load(.npy)", times("np_load", "first_s")),
        (warm, "kvstore → MLX", times("kv_mlx", "warm_s")),
        (warm, f"kvstore chain ({CHAIN_BLOCKS} blocks) → MLX", times("kv_chain", "warm_s")),
        (warm, "mlx_lm load_prompt_cache", times("peer", "warm_s")),
        (warm, "mx.load(safetensors)", times("mx_load", "warm_s")),
        (warm, "np.load(.npy)", times("np_load", "warm_s")),
        ("raw sequential read of the .kv", "os.preadv, 16 MiB buffer", raw["raw"]))]
    for path in (kv_path, st_path, npy_path, text_path, sealed.path, *chain_paths, *small_paths,
                 *sealed_chain_paths):
        os.unlink(path)
    return children, {"kv_bytes": kv_size, "chain_bytes": chain_size, "safetensors_bytes": st_size}, throughput


# ---------------------------------------------------------------- save

def bench_save(report, tmp, rng, tensors, quick):
    import mlx.core as mx
    from mlx_lm.models.cache import save_prompt_cache

    text = rng.randbytes(CHECKPOINT_TEXT_BYTES)
    tokens = np.arange(CONTEXT_TOKENS, dtype=np.uint32)
    caches = peer_caches(tensors)
    meta = kv_meta()
    stores = {
        # One ABI 16 file per save, as the rows say (KVStore's default is "chain").
        "kv_fast": kvstore.KVStore(os.path.join(tmp, "save-fast"), budget_mb=UNLIMITED_BUDGET_MB, durable=False,
                                   layout="whole"),
        "kv_durable": kvstore.KVStore(os.path.join(tmp, "save-durable"), budget_mb=UNLIMITED_BUDGET_MB,
                                      durable=True, layout="whole"),
        "kv_sealed": kvstore.KVStore(os.path.join(tmp, "save-sealed"), budget_mb=UNLIMITED_BUDGET_MB,
                                     durable=False, layout="whole", key=os.urandom(32)),
        # KVStore's defaults: layout "chain", block_tokens 256, durable=True.
        "kv_chain": kvstore.KVStore(os.path.join(tmp, "save-chain"), budget_mb=UNLIMITED_BUDGET_MB),
    }
    chain_store = stores["kv_chain"]
    chain_settings = chain_store.settings
    assert (chain_settings.layout, chain_settings.block_tokens, chain_settings.durable) == ("chain", CHAIN_BLOCK_TOKENS, True)
    # The cut points of the chain: every tensor grows along axis 2, one row a
    # token; the text is the same number of bytes per token.
    positional = {k: 2 for k in tensors}
    per_token = len(text) // CONTEXT_TOKENS
    offsets = [per_token * i for i in range(CONTEXT_TOKENS + 1)]
    st_path = os.path.join(tmp, "save-peer.safetensors")
    npy_path = os.path.join(tmp, "save-peer.npy")
    sizes = {}

    def kv_save(name):
        e = stores[name].save(text, tokens, tensors, meta=meta)
        assert e is not None, f"{name}: save refused"
        assert e.payload_abi == (48 if name == "kv_sealed" else 16), e.payload_abi
        sizes[name] = e.file_size
        return e.path

    def kv_chain_save():
        last = chain_store.save(text, tokens, tensors, meta=meta, positional=positional, text_offsets=offsets)
        assert last is not None and last.is_block and last.tokens == CONTEXT_TOKENS, last
        return chain_store.path            # its blocks are counted and removed untimed

    def peer_save(name, path, save):
        save(path)
        sizes[name] = os.path.getsize(path)
        return path

    fns = {"kv_fast": lambda: kv_save("kv_fast"),
           "peer": lambda: peer_save("peer", st_path, lambda p: save_prompt_cache(p, caches)),
           "kv_chain": kv_chain_save,
           "peer_fsync": lambda: peer_save("peer_fsync", st_path, lambda p: save_prompt_cache_durable(p, caches)),
           "kv_durable": lambda: kv_save("kv_durable"),
           "kv_sealed": lambda: kv_save("kv_sealed"),
           "mx_save": lambda: peer_save("mx_save", st_path, lambda p: mx.save_safetensors(p, tensors)),
           "np_save": lambda: peer_save("np_save", npy_path, lambda p: np_save_all(p, tensors))}
    names = list(fns)
    samples = {v: [] for v in names}
    n = 3 if quick else 21
    try:
        for i in range(-1, n):                # sample -1: warm-up, not counted
            order = names if i % 2 == 0 else names[::-1]
            for v in order:
                gc.collect()
                t0 = time.perf_counter_ns()
                path = fns[v]()
                dt = time.perf_counter_ns() - t0
                files, nbytes = remove_saved(path)   # untimed: the next save writes new files
                if v == "kv_chain":
                    assert files == CHAIN_BLOCKS, files   # every block written again, none kept
                    sizes[v] = nbytes
                if i >= 0:
                    samples[v].append(dt)
    finally:
        for s in stores.values():
            s.close()
    peer = stats(samples["peer"], KV_BYTES)
    sizes_note = (f"file sizes: .kv {sizes['kv_fast']:,} B, safetensors {sizes['peer']:,} B "
                  f"({sizes['kv_fast'] / sizes['peer']:.4f}×)")
    report.add(f"save {KV_BYTES // MiB} MiB, durable=False vs mlx_lm save_prompt_cache",
               stats(samples["kv_fast"], KV_BYTES), peer, SAVE_MAX_TIME_RATIO,
               note=f"{n} samples; median of per-round ratios "
                    f"{paired_ratio(samples['kv_fast'], samples['peer']):.2f}; {sizes_note}")
    report.add(f"save {KV_BYTES // MiB} MiB sealed (AES-256-GCM), durable=False vs the same plain save",
               stats(samples["kv_sealed"], KV_BYTES), stats(samples["kv_fast"], KV_BYTES), 1 / SEALED_MIN_SPEED,
               note=f"{n} samples; target: ≥ {SEALED_MIN_SPEED}× the plain save's speed; median of per-round "
                    f"ratios {paired_ratio(samples['kv_sealed'], samples['kv_fast']):.2f}")
    report.add(f"save {KV_BYTES // MiB} MiB, durable=True (fsync file + dir) vs mlx_lm save_prompt_cache "
               "(no fsync)", stats(samples["kv_durable"], KV_BYTES), peer, None, note=f"{n} samples")
    chain = stats(samples["kv_chain"], KV_BYTES)
    chain_note = (f"{n} samples; KVStore's defaults: {CHAIN_BLOCKS} blocks of {CHAIN_BLOCK_TOKENS} tokens (payload "
                  "ABI 17), each published durably (temporary file, fsync, linked into place, directory fsync); "
                  f"chain files {sizes['kv_chain']:,} B vs safetensors {sizes['peer']:,} B; median of per-round "
                  "ratios ")
    report.add(f"save {KV_BYTES // MiB} MiB chain ({CHAIN_BLOCKS} blocks), durable=True (KVStore defaults) vs mlx_lm "
               "save_prompt_cache + fsync of the file and its directory", chain,
               stats(samples["peer_fsync"], KV_BYTES), SAVE_DURABLE_MAX_TIME_RATIO,
               note=chain_note + f"{paired_ratio(samples['kv_chain'], samples['peer_fsync']):.2f}; the peer's "
                                 "fsyncs make it as durable")
    report.add(f"save {KV_BYTES // MiB} MiB chain ({CHAIN_BLOCKS} blocks), durable=True (KVStore defaults) vs mlx_lm "
               "save_prompt_cache (no fsync)", chain, peer, None,
               note=chain_note + f"{paired_ratio(samples['kv_chain'], samples['peer']):.2f}; the peer's file may "
                                 "still be lost to a power cut when its call returns")
    report.add(f"save {KV_BYTES // MiB} MiB, durable=False vs mx.save_safetensors of the tensors",
               stats(samples["kv_fast"], KV_BYTES), stats(samples["mx_save"], KV_BYTES), None,
               note=f"{n} samples")
    report.add(f"save {KV_BYTES // MiB} MiB, durable=False vs np.save of the tensors (.npy stream)",
               stats(samples["kv_fast"], KV_BYTES), stats(samples["np_save"], KV_BYTES), None,
               note=f"{n} samples")
    throughput = [bar("save", method, KV_BYTES, samples[v]) for method, v in (
        ("kvstore durable=False", "kv_fast"), ("kvstore durable=True (fsync)", "kv_durable"),
        (f"kvstore chain ({CHAIN_BLOCKS} blocks), durable=True (defaults)", "kv_chain"),
        ("mlx_lm save_prompt_cache", "peer"), ("mlx_lm save_prompt_cache + fsync", "peer_fsync"),
        ("mx.save_safetensors", "mx_save"), ("np.save", "np_save"))]
    return sizes, throughput


# ---------------------------------------------------------------- main

def phase(name, fn, *args):
    t0 = time.perf_counter()
    out = fn(*args)
    print(f"  [{name}: {time.perf_counter() - t0:.1f} s]", file=sys.stderr, flush=True)
    return out


def main(argv=None):
    args = harness_arguments(__doc__, "fewer repeats; finishes in under 60 s", argv,
                             strict_help="exit 1 when a target is missed or a child process aborted")

    t_start = time.perf_counter()
    info = machine_info()
    rng = random.Random(SEED)
    report = Report()
    with tempfile.TemporaryDirectory(prefix="kvstore-bench-store-") as tmp:
        curve = phase("lookup", bench_lookup, report, tmp, rng, args.quick)
        phase("sealed lookup", bench_sealed_lookup, report, tmp, rng, args.quick)
        tensors = phase("state", make_state)
        report.section(f"Payload: save and load of a {KV_BYTES // MiB} MiB KV state vs mlx-lm, MLX, NumPy "
                       "and a raw read")
        children, load_sizes, load_bars = phase("load", bench_load, report, tmp, rng, tensors, args.quick)
        save_sizes, save_bars = phase("save", bench_save, report, tmp, rng, tensors, args.quick)
        del tensors
    elapsed = time.perf_counter() - t_start

    aborts = [c for c in children if c.aborted]
    print(f"# kvstore store benchmarks ({'quick' if args.quick else 'full'} run)\n")
    print(machine_lines(info))
    print(f"- lookup: 400 KB prompts; N entries with distinct text lengths in 1..{MAX_TEXT_BYTES:,} B "
          f"(sparse files); ds4 = Python port of ds4_kvstore_find_text_prefix with hashlib SHA1 "
          f"(ds4 itself uses a portable C SHA1)")
    print(f"- load/save: {LAYERS} layers × keys and values {KV_SHAPE} float16 = {KV_BYTES // MiB} MiB; "
          f"loads are child processes (`python -c`), timed after imports")
    noisy = [c for c in children if c.stderr_tail.strip() and not c.aborted]
    print(f"- child processes: {len(children)} run, {len(aborts)} aborted, exited non-zero or printed "
          f"no result; {len(noisy)} more wrote to stderr"
          + "".join(f"\n  - {c.variant} sample {c.sample}: rc={c.rc} stderr={c.stderr_tail!r}"
                    for c in aborts + noisy))
    print("- peak RSS is VmHWM from /proc/self/status in each child: ru_maxrss there starts at this "
          "process's own peak (Linux keeps it across fork + exec) and reads the same before and after")
    print(f"- elapsed {elapsed:.1f} s")
    print("- cells are median / min; ratio = kvstore / peer (lower is better); targets are judged on "
          "the medians\n")
    print(report.markdown())

    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": info, "quick": args.quick, "elapsed_s": elapsed, "rows": report.rows,
                       "lookup_curve": curve, "file_sizes": {**load_sizes, **save_sizes},
                       "throughput": load_bars + save_bars,
                       "children": [dataclasses.asdict(c) for c in children]}, f, indent=2)
    if args.strict and (aborts or any(r["result"] == "MISS" for r in report.rows)):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
