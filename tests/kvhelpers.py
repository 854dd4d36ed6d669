"""The tests' shared helpers: plain functions and constants (the fixtures are in conftest.py).

Test modules import what they need from here (``from kvhelpers import ...``);
no test module imports another.  Nothing here imports MLX at module level, so
the tests that do not need it run where it is missing.
"""

import contextlib
import functools
import hashlib
import json
import math
import multiprocessing
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import time
import urllib.error
import urllib.request

import numpy as np

import kvstore
from kvstore import KVStore
from kvstore.policy import Options

# fork is fast and needs nothing importable; spawn where fork does not exist.
CTX = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")

# Most store tests save a handful of tokens: lift the 512-token minimum.
OPTS = Options(min_tokens=1)


# ---- stores and their directories -------------------------------------------------------

def make_store(path, **kw):
    """A KVStore for tests: min_tokens=1 and no fsync unless asked.

    The layout is the package's default ("chain") unless asked, or unless
    KVSTORE_TEST_LAYOUT names another: CI runs the store's tests once more
    with KVSTORE_TEST_LAYOUT=whole, so both layouts keep every promise.
    """
    kw.setdefault("options", OPTS)
    kw.setdefault("durable", False)
    kw.setdefault("layout", os.environ.get("KVSTORE_TEST_LAYOUT", "chain"))
    return KVStore(path, **kw)


def checkpoint_files(directory, temporaries=False):
    """Sorted names of the checkpoints (40 hex digits + .kv) in directory, and with
    temporaries=True their temporary files (.kv.tmp.*) too; never the lock file."""
    pattern = r"^[0-9a-fA-F]{40}\.kv(\.tmp\..*)?$" if temporaries else r"^[0-9a-fA-F]{40}\.kv$"
    return sorted(n for n in os.listdir(directory) if re.match(pattern, n))


def listing(directory):
    """Every name in directory but the lock file and the counters file (tmp files and
    quarantine included)."""
    return sorted(n for n in os.listdir(directory) if n not in (".kvstore.lock", ".counters"))


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
        fields: kvstore.Header fields; defaults make a valid ABI-16 header
            whose payload_bytes is len(payload).
    """
    if header is None:
        values = dict(quant_bits=4, tokens=7, ctx_size=32768, payload_bytes=len(payload),
                      reason=kvstore.Reason.COLD, created_at=1_700_000_000,
                      last_used=1_700_000_100)
        values.update(fields)
        header = kvstore.Header(**values).pack()
    assert len(header) == 48
    tl = len(text) if text_len is None else text_len
    return header + struct.pack("<I", tl) + text + payload + trailer


def checkpoint_name(text):
    """The file name SPEC section 2 gives the checkpoint of text."""
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

    def __init__(self, cmd, cwd, log_path):
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
            except OSError:
                if time.monotonic() > deadline:
                    self.kill()
                    raise AssertionError(f"server not up after {STARTUP_S} s:\n{self.text()}")
                time.sleep(0.2)

    def url(self, path):
        return f"http://127.0.0.1:{self.port}{path}"

    def post(self, body, raw=None):
        """(status, parsed JSON or None) of a POST to /v1/chat/completions."""
        data = raw if raw is not None else json.dumps(body).encode()
        req = urllib.request.Request(self.url("/v1/chat/completions"), data=data,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                return r.status, json.load(r)
        except urllib.error.HTTPError as e:
            body = e.read()
            with contextlib.suppress(ValueError):
                return e.code, json.loads(body)
            return e.code, None

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
