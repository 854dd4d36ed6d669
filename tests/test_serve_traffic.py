"""kvstore serve on production-shaped traffic: a request never waits for another's work.

Requests of very different lengths arrive one by one while others prefill
or decode.  Each test holds one piece of the server's work open with a
gate (a child process whose server has one function patched to wait for
<gate>/release; nothing else changed) and checks, by what the server did
rather than by timing, that another request's path does not wait for it:

- a short request that arrives during a long prefill is tokenized and
  looked up (prepared) while that prefill still runs, on a thread at the
  server's own CPU priority (a thread at a lower one could be starved while
  it holds the tokenizer's lock or the GIL);
- the generation thread does not hold the batch for a request that is
  loading its checkpoint (the admission wait counts only the cheap half of
  a request's preparation);
- a background writer that falls behind never holds the batch: the stores
  it has no room for are skipped and counted, and requests go on.
"""

import glob
import os
import threading
import time

import pytest

pytest.importorskip("mlx_lm")

from kvhelpers import gated_server, kvstore_server, system_prompt, wait_for_file

MODEL_SEED = 11
GATE_S = 120
SYSTEM = system_prompt()

# Holds the first prefill step of LONG_TOKENS or more (the long request's)
# until <gate>/release exists; records, for every request that reaches
# mlx-lm's queue, whether it was tokenized already and its thread's CPU
# niceness against the process's.
_PREFILL_GATE = """
import os, sys, time, threading
gate = os.environ["KVSTORE_TEST_GATE"]
from mlx_lm import server
from mlx_lm.generate import PromptProcessingBatch
_prompt = PromptProcessingBatch.prompt
held = []
def prompt(self, tokens):
    if not held and sum(len(t) for t in tokens) >= %d:
        held.append(1)
        open(os.path.join(gate, "prefilling"), "w").close()
        deadline = time.monotonic() + %d
        while not os.path.exists(os.path.join(gate, "release")) and time.monotonic() < deadline:
            time.sleep(0.02)
    return _prompt(self, tokens)
PromptProcessingBatch.prompt = prompt
_generate = server.ResponseGenerator.generate
queued = []
def generate_(self, request, *a, **kw):
    ticket = getattr(request, "kvstore_ticket", None)
    tokenized = ticket is not None and ticket.tokenized is not None
    nice = 0
    if sys.platform.startswith("linux"):        # a thread's own niceness (elsewhere: not per thread)
        nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) - os.getpriority(os.PRIO_PROCESS, os.getpid())
    queued.append(1)
    with open(os.path.join(gate, "queued-%%d" %% len(queued)), "w") as f:
        f.write(f"{int(tokenized)} {nice} {int(os.path.exists(os.path.join(gate, 'release')))}")
    return _generate(self, request, *a, **kw)
server.ResponseGenerator.generate = generate_
from kvstore.cli import main
sys.exit(main(sys.argv[1:]))
"""

# Holds every KVStore.<name> call until <gate>/release exists (after
# creating <gate>/entered).
_CALL_GATE = """
import os, sys, time
import kvstore.store
gate = os.environ["KVSTORE_TEST_GATE"]
_f = kvstore.store.KVStore.%s
def f(self, *a, **kw):
    open(os.path.join(gate, "entered"), "w").close()
    deadline = time.monotonic() + %d
    while not os.path.exists(os.path.join(gate, "release")) and time.monotonic() < deadline:
        time.sleep(0.02)
    return _f(self, *a, **kw)
kvstore.store.KVStore.%s = f
from kvstore.cli import main
sys.exit(main(sys.argv[1:]))
"""

# Holds every KVStore.load until <gate>/release exists; <gate>/entered holds
# how many requests the generator counted as being prepared (the count its
# admission wait waits on) once the load had begun.
_LOAD_GATE = """
import gc, os, sys, time
import kvstore.store
from kvstore.serve.generator import TieredResponseGenerator
gate = os.environ["KVSTORE_TEST_GATE"]
_load = kvstore.store.KVStore.load
def load(self, *a, **kw):
    gen = [o for o in gc.get_objects() if isinstance(o, TieredResponseGenerator)][0]
    with open(os.path.join(gate, "entered"), "w") as f:
        f.write(str(gen._preparing))
    deadline = time.monotonic() + %d
    while not os.path.exists(os.path.join(gate, "release")) and time.monotonic() < deadline:
        time.sleep(0.02)
    return _load(self, *a, **kw)
kvstore.store.KVStore.load = load
from kvstore.cli import main
sys.exit(main(sys.argv[1:]))
"""

LONG_TOKENS = 400


def in_thread(fn):
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("r", fn()), daemon=True)
    t.start()
    return t, out


def test_a_short_request_is_prepared_while_a_long_prefill_runs(model_dir, workdir, tmp_path):
    gate = tmp_path / "gate"
    server = gated_server(_PREFILL_GATE % (LONG_TOKENS, GATE_S), model_dir, tmp_path / "cache", workdir, "prefill",
                   gate)
    try:
        long_request, long_out = in_thread(lambda: server.chat(
            [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Summarise it."}], max_tokens=4))
        wait_for_file(gate / "prefilling", server)
        wait_for_file(gate / "queued-1", server)
        short_request, short_out = in_thread(lambda: server.chat(
            [{"role": "user", "content": "Hello there."}], max_tokens=4))
        # The long request's prefill is held: the short one must reach the
        # generation thread's queue prepared meanwhile, not after it.
        wait_for_file(gate / "queued-2", server, timeout=GATE_S / 2)
        tokenized, nice, released = (int(x) for x in (gate / "queued-2").read_text().split())
        (gate / "release").touch()
        long_request.join(120)
        short_request.join(120)
        assert released == 0, "the short request was queued only once the long prefill was let go"
        assert tokenized == 1, "the short request reached the queue without being tokenized"
        assert nice == 0, f"the short request was prepared at niceness +{nice} (a starved thread holds locks)"
        assert "r" in long_out and "r" in short_out, server.text()
    finally:
        (gate / "release").touch()
        server.stop()


@pytest.fixture(scope="module")
def stored(model_dir, workdir):
    """A cache directory holding a long conversation, stored by a first server."""
    cache = os.path.join(workdir, "cache-stored")
    first = kvstore_server(model_dir, cache, workdir, "store")
    try:
        first.chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Part one."}], max_tokens=4)
    finally:
        assert first.stop() == 0
    return cache


def test_the_batch_does_not_wait_for_a_request_that_is_loading(model_dir, workdir, stored, tmp_path):
    gate = tmp_path / "gate"
    server = gated_server(_LOAD_GATE % GATE_S, model_dir, stored, workdir, "loading", gate)
    try:
        loading, loaded = in_thread(lambda: server.chat(
            [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Part one."}], max_tokens=4))
        wait_for_file(gate / "entered", server)
        # B's load is held open; C arrives, is prepared and admitted: the
        # generation thread must not hold C's prefill for B.
        server.chat([{"role": "user", "content": "Something else entirely."}], max_tokens=4)
        held = not (gate / "release").exists() and "r" not in loaded
        (gate / "release").touch()
        loading.join(120)
        assert held and "r" in loaded
        assert (gate / "entered").read_text() == "0", "a request that is loading counts as being prepared"
        assert "admission_wait" not in server.text(), server.text()
        assert any(line.startswith("request source=disk") for line in server.request_lines()), server.text()
    finally:
        (gate / "release").touch()
        server.stop()


def test_a_writer_that_falls_behind_never_holds_the_batch(model_dir, workdir, tmp_path):
    gate = tmp_path / "gate"
    cache = tmp_path / "cache"
    server = gated_server(_CALL_GATE % ("save", GATE_S, "save"), model_dir, cache, workdir, "writer", gate)
    try:
        # Every save is held: the writer takes one, its queue (4) fills, and
        # each later request's store finds no room.  Each request must still
        # be answered (under a blocking queue, the generation thread would
        # wait for the writer after the sixth and answer nothing more).
        for i in range(8):
            server.chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Part {i}."}],
                        max_tokens=2)
        held = not (gate / "release").exists() and not glob.glob(os.path.join(cache, "*.kv"))
        assert held
        assert "why=writer_busy" in server.text(), server.text()
    finally:
        (gate / "release").touch()
        assert server.stop() == 0
    # What was queued is stored once the writer goes on.
    assert glob.glob(os.path.join(cache, "*.kv"))


def test_the_admission_wait_ends_when_the_request_it_waits_for_is_queued():
    # The generation thread waits (at most ADMIT_WAIT_S) for requests still
    # being prepared; it must take each one as soon as it is queued, not
    # wait the window out.  The window here is 60 s: a wait that missed the
    # queued request would take all of it.
    import queue
    import types

    from kvstore.mlx.mlxlm import _ReportingQueue
    from kvstore.serve.generator import TieredResponseGenerator
    from kvstore.serve.ticket import Ticket

    # The generator's admission state alone: no model, no generation thread.
    gen = TieredResponseGenerator.__new__(TieredResponseGenerator)
    gen._admission = threading.Condition()
    gen._preparing = 0
    gen._gather_until = time.monotonic() + 20
    gen.requests = _ReportingQueue(gen.request_queued)        # the queue HookedResponseGenerator gives it

    def stock_next_request(timeout=None):
        try:
            return gen.requests.get(timeout=timeout) if timeout is not None else gen.requests.get_nowait()
        except queue.Empty:
            return None
    gen.stock_next_request = stock_next_request
    ticket = Ticket()
    with gen._admission:                       # a request in the cheap half of its preparation
        gen._preparing, ticket.preparing = 1, True
    request = types.SimpleNamespace(kvstore_ticket=ticket)
    threading.Timer(0.2, lambda: gen.requests.put((None, request, None))).start()
    t0 = time.monotonic()
    got = gen.next_request(None)
    assert got is not None and got[1] is request
    assert time.monotonic() - t0 < 10, "the wait ran out its window instead of taking the queued request"
    assert gen._preparing == 0 and not ticket.preparing          # counted off once taken
