"""A finished request's store waits for the batch step that was in flight when it finished.

mlx-lm evaluates each batch step while it hands out the tokens of the one
before, so the step in flight when a request finishes still carries it (the
batch's slowest step when that request is long).  kvstore.serve.steps holds
the store's background work until the generation thread has completed that
step, gone idle, or a timeout has passed.  The clock is tested on its own,
the step hook on mlx-lm's own loop shape, and the whole in a server whose
batch step after a finish is held open: the save must not start inside it.
"""

import os
import threading
import time

import pytest

from kvstore.serve.steps import StepClock


def run_in_thread(fn):
    done = threading.Event()
    threading.Thread(target=lambda: (fn(), done.set()), daemon=True).start()
    return done


def test_deferred_work_waits_for_the_steps_after_it():
    clock = StepClock()
    clock.tick()                                     # a batch is running
    ran = run_in_thread(clock.deferred(lambda: None, steps=2, timeout_s=60))
    assert not ran.wait(0.2)
    clock.tick()
    assert not ran.wait(0.2), "ran after one step of two"
    clock.tick()
    assert ran.wait(10)
    assert clock.steps == 3


def test_deferred_work_runs_when_the_generation_thread_goes_idle():
    clock = StepClock()
    clock.tick()
    ran = run_in_thread(clock.deferred(lambda: None, steps=2, timeout_s=60))
    assert not ran.wait(0.2)
    clock.idle()
    assert ran.wait(10)


def test_deferred_work_runs_at_once_when_no_batch_runs_and_after_its_timeout():
    clock = StepClock()                              # nothing ran yet: idle
    assert run_in_thread(clock.deferred(lambda: None)).wait(10)
    clock.tick()
    t0 = time.monotonic()
    ran = run_in_thread(clock.deferred(lambda: None, steps=2, timeout_s=0.3))
    assert ran.wait(10)
    assert time.monotonic() - t0 >= 0.3


def test_deferred_work_returns_the_result_and_raises_the_error():
    clock = StepClock()
    assert clock.deferred(lambda a, b=0: a + b)(1, b=2) == 3
    with pytest.raises(ZeroDivisionError):
        clock.deferred(lambda: 1 / 0)()


def test_the_counted_budget_ticks_after_each_step_of_mlx_lms_loop():
    pytest.importorskip("mlx_lm")
    from kvstore.mlx.mlxlm import _CountedBudget

    class Budget:                                    # mlx-lm's TimeBudget: iter() restarts it
        def __init__(self, n):
            self.n, self.left = n, 0

        def __iter__(self):
            self.left = self.n
            return self

        def __next__(self):
            if not self.left:
                raise StopIteration
            self.left -= 1

    ticks, steps = [], []
    budget = _CountedBudget(Budget(3), lambda: ticks.append(len(steps)))
    for _ in range(2):                               # two passes of the server's loop
        for _ in budget:
            steps.append(1)                          # batch_generator.next()
    # A tick after every step, each after the step it counts, none before the first.
    assert ticks == [1, 2, 3, 4, 5, 6]
    for _ in budget:
        steps.append(1)
        break                                        # the server breaks when the batch is empty
    assert ticks[-1] == 6


# ---- in a server ------------------------------------------------------------------

pytest.importorskip("mlx_lm")

from kvhelpers import gated_server, system_prompt, wait_for_file  # noqa: E402

MODEL_SEED = 12
GATE_S = 120
LONG = 1000
A_TOKENS = 3000

# After the insert of the first finished request longer than LONG (B's,
# while A still decodes),
# holds the batch's next step until <gate>/release exists; <gate>/finished
# holds how many tokens that request's store keeps (its whole blocks), and
# <gate>/saves a line for each KVStore.save entered (its tokens).
_HOLD_AFTER_FINISH = """
import os, sys, time
gate = os.environ["KVSTORE_TEST_GATE"]
import mlx_lm.generate
import kvstore.store
from kvstore.serve import tier
from kvstore.settings import DEFAULT_BLOCK_TOKENS
G = sys.modules["mlx_lm.generate"]
hold = []
_insert = tier.TieredPromptCache.insert_cache
def insert_cache(self, model, tokens, prompt_cache, *, cache_type="assistant"):
    _insert(self, model, tokens, prompt_cache, cache_type=cache_type)
    if cache_type == "assistant" and len(tokens) > %d and not hold:
        hold.append(1)
        with open(os.path.join(gate, "finished"), "w") as f:
            f.write(str(len(tokens) // DEFAULT_BLOCK_TOKENS * DEFAULT_BLOCK_TOKENS))
tier.TieredPromptCache.insert_cache = insert_cache
_next = G.GenerationBatch.next
def next_(self):
    if len(hold) == 1:
        hold.append(2)
        deadline = time.monotonic() + %d
        while not os.path.exists(os.path.join(gate, "release")) and time.monotonic() < deadline:
            time.sleep(0.02)
    return _next(self)
G.GenerationBatch.next = next_
_save = kvstore.store.KVStore.save
def save(self, text, tokens, *a, **kw):
    with open(os.path.join(gate, "saves"), "a") as f:
        f.write(f"{len(tokens)} ")
    return _save(self, text, tokens, *a, **kw)
kvstore.store.KVStore.save = save
from kvstore.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_finished_requests_store_waits_for_the_step_in_flight(model_dir, workdir, tmp_path):
    system = system_prompt()
    gate = tmp_path / "gate"
    server = gated_server(_HOLD_AFTER_FINISH % (LONG, GATE_S), model_dir, tmp_path / "cache", workdir, "steps", gate)
    try:
        out = {}
        # A decodes A_TOKENS tokens (the EOS token banned) while B comes and goes.
        a = threading.Thread(target=lambda: out.setdefault("a", server.post(
            {"messages": [{"role": "user", "content": "Tell a long story."}], "max_tokens": A_TOKENS,
             "temperature": 0.0, "logit_bias": {"1": -100.0}})), daemon=True)
        a.start()
        time.sleep(0.5)                                 # A decodes
        server.chat([{"role": "system", "content": system}, {"role": "user", "content": "Part one."}],
                    max_tokens=2)
        wait_for_file(gate / "finished", server)
        time.sleep(1.0)
        cut = (gate / "finished").read_text()
        saves = lambda: (gate / "saves").read_text().split() if (gate / "saves").exists() else []  # noqa: E731
        early = saves()
        (gate / "release").touch()
        deadline = time.monotonic() + 60
        while cut not in saves() and time.monotonic() < deadline:
            time.sleep(0.05)
        a.join(120)
        assert out.get("a", (0,))[0] == 200, server.text()
        assert out["a"][1]["usage"]["completion_tokens"] == A_TOKENS
        assert cut not in early, "the store began inside the batch step that was in flight when its request finished"
        assert cut in saves(), (cut, saves(), server.text())
    finally:
        (gate / "release").touch()
        assert server.stop() == 0
