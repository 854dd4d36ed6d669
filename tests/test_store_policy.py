"""One store policy: a table of situations and the decisions kvstore.policy takes.

Each row is (situation, expected decision).  The same rows run against the
pure functions of kvstore.policy and against both callers that store
checkpoints: PromptCache (one live session, a chunked prefill; kvstore
.prompt_cache) and the disk tier of kvstore serve (mlx-lm's prompt segments
and RAM entries; kvstore.serve.tier).  A caller runs every row it can be put
in (`applies`), so the two callers cannot drift from the policy, nor from
each other, without a row failing.

Both callers store through a recorder that notes every store they attempt
(reason, tokens) and lets those of the reasons a row refuses fail.
"""

import dataclasses
import types

import numpy as np
import pytest

from kvstore import policy
from kvstore.format import Reason
from kvstore.policy import ANCHOR, BLOCKS, SNAPSHOT, WAYPOINT
from kvstore.settings import Settings
from kvstore.prompt_cache import PromptCache, Request
from kvhelpers import ToyEngine

OPTS = Settings(min_tokens=64, cold_max_tokens=1000, continued_interval_tokens=200, boundary_trim_tokens=8,
               boundary_align_tokens=64)          # waypoints every 256 tokens
STEP = 64                                         # PromptCache's prefill chunk
USER, ASSISTANT = 1, 2
REASON_OF = {ANCHOR: "cold", WAYPOINT: "continued", SNAPSHOT: "continued", BLOCKS: "continued"}


# ---- situations ---------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Prefill:
    """A prefill has reached pos tokens.  Decision: the targets' kinds, best first."""
    pos: int
    cold_target: int = 0      # the request's cold target (serve: its system segment ends here)
    last_store: int = 0       # the session's last stored count (a disk hit of that many)
    block_tokens: int = 0     # a chained store whose state has cheap snapshots
    refuse: tuple = ()        # reasons whose store fails (the callers then try the next target)


@dataclasses.dataclass(frozen=True)
class Cold:
    """A cold request of prompt tokens, a user marker at anchor (0: none).  Decision: its cold target."""
    prompt: int
    anchor: int


@dataclasses.dataclass(frozen=True)
class Leaving:
    """An n-token state leaves memory; it ends with the answer to a prompt of prompt tokens
    (0: none).  Decision: the tokens stored (0: none)."""
    reason: str
    n: int
    positional: bool = True
    prompt: int = 0


@dataclasses.dataclass(frozen=True)
class Finished:
    """A request finished with n tokens (prompt and answer) in a chained store.  Decision: the tokens stored."""
    n: int
    block_tokens: int
    positional: bool = True


@dataclasses.dataclass(frozen=True)
class Admitted:
    """Admission allows the first `admitted` tokens of an n-token anchor.  Decision: the tokens stored."""
    n: int
    admitted: int
    positional: bool = True


TABLE = [
    # -- a prefill reaches pos: the anchor, a waypoint, a block snapshot, best first
    (Prefill(100), ()),
    (Prefill(256), (WAYPOINT,)),
    (Prefill(512, last_store=256), (WAYPOINT,)),
    (Prefill(256, last_store=256), ()),                                  # stored already at the frontier
    (Prefill(128, cold_target=128), (ANCHOR,)),
    (Prefill(256, cold_target=256), (ANCHOR, WAYPOINT)),                 # the anchor suppresses the waypoint
    (Prefill(256, cold_target=256, refuse=("cold",)), (ANCHOR, WAYPOINT)),   # ...unless it fails
    (Prefill(48, cold_target=48), ()),                                   # under min_tokens
    (Prefill(128, cold_target=64), ()),                                  # the anchor is elsewhere
    (Prefill(256, refuse=("continued",)), (WAYPOINT,)),
    (Prefill(128, block_tokens=64), (SNAPSHOT,)),
    (Prefill(96, block_tokens=64), ()),                                  # off the block grid
    (Prefill(32, block_tokens=32), ()),                                  # under min_tokens
    (Prefill(256, block_tokens=64), (WAYPOINT,)),                        # a waypoint, not also a snapshot
    (Prefill(128, cold_target=128, block_tokens=64), (ANCHOR, SNAPSHOT)),
    (Prefill(128, cold_target=128, block_tokens=64, refuse=("cold",)), (ANCHOR, SNAPSHOT)),
    # -- a cold request's target: its anchor, else the store length of the prompt
    (Cold(500, 100), 100),
    (Cold(500, 0), 448),                          # store_len: (500 - 8) // 64 * 64
    (Cold(500, 40), 448),                         # an anchor under min_tokens is none
    (Cold(1000, 100), 100),
    (Cold(1001, 100), 0),                         # past cold_max_tokens: waypoints cover it
    (Cold(50, 0), 50),                            # (the prefill stops there; nothing is stored)
    # -- a state leaves memory: whole, or cut after its prompt's last token but one
    (Leaving("evict", 300), 300),
    (Leaving("shutdown", 300, positional=False), 300),
    (Leaving("evict", 50), 0),                    # under min_tokens
    (Leaving("shutdown", 300, prompt=200), 199),
    (Leaving("shutdown", 300, positional=False, prompt=200), 300),   # a window cannot be cut: whole
    (Leaving("evict", 300, prompt=300), 299),
    (Leaving("evict", 300, prompt=60), 0),        # its tail is under min_tokens
    (Leaving("shutdown", 300, prompt=1), 300),    # no tail inside a one-token prompt
    # -- a finished request in a chained store: its whole blocks
    (Finished(300, 128), 256),
    (Finished(300, 128, positional=False), 0),    # a window cut to blocks would be a link without it
    (Finished(256, 128, positional=False), 256),  # ...unless it ends on the grid
    (Finished(150, 128), 128),
    (Finished(100, 128), 0),
    # -- admission: a positional state is cut to what it admits, any other is skipped
    (Admitted(300, 300), 300),
    (Admitted(300, 256), 256),
    (Admitted(300, 256, positional=False), 0),
    (Admitted(300, 32), 0),
    (Admitted(300, 1000, positional=False), 300),
]


def rows(caller=None):
    """The table's rows a caller can be put in (None: all), as pytest params named by their situation."""
    return [pytest.param(s, e, id=repr(s).replace(" ", "")) for s, e in TABLE if caller is None or applies(s, caller)]


# ---- the pure functions -----------------------------------------------------------------

def prompt_ids(n, anchor):
    """A byte-level prompt of n tokens with a user marker at anchor (0: none)."""
    ids = [32 + i % 90 for i in range(n)]
    if anchor:
        ids[anchor] = USER
    return ids


def decide(situation):
    """The decision kvstore.policy takes, from its pure functions alone."""
    s = situation
    if isinstance(s, Prefill):
        return tuple(t.kind for t in policy.prefill_stores(s.pos, OPTS, s.cold_target, s.last_store, s.block_tokens))
    if isinstance(s, Cold):
        anchor = policy.chat_anchor_pos(prompt_ids(s.prompt, s.anchor), USER, ASSISTANT, OPTS)
        return policy.cold_target(s.prompt, anchor, OPTS)
    if isinstance(s, Leaving):
        [target] = policy.leaving_stores(Reason[s.reason.upper()], s.n, s.prompt)
    elif isinstance(s, Finished):
        [target] = policy.finished_stores(s.block_tokens)
    else:
        return policy.store_cut(s.n, OPTS, s.positional, limit=s.admitted)
    return policy.store_cut(s.n, OPTS, s.positional, prefer=target.prefer, grid=target.grid)


@pytest.mark.parametrize("situation, expected", rows())
def test_policy(situation, expected):
    assert decide(situation) == expected


def test_the_table_covers_every_decision():
    kinds = {k for s, e in TABLE if isinstance(s, Prefill) for k in e}
    assert kinds == {ANCHOR, WAYPOINT, SNAPSHOT}
    assert {type(s) for s, _ in TABLE} == {Prefill, Cold, Leaving, Finished, Admitted}
    both = [s for s, _ in TABLE if applies(s, "prompt_cache") and applies(s, "tier")]
    assert {type(s) for s in both} == {Prefill, Leaving}


def applies(situation, caller):
    """Whether a caller can be put in a situation.

    PromptCache has no admission and stores nothing when a request
    finishes; it stores its live state whole (it does not know which prompt
    an answer finished).  The tier sees mlx-lm's segment ends only: no marker
    search (mlx-lm's system segment is its anchor), no block snapshots, no
    last stored count (its ledger knows what is stored).
    """
    s = situation
    if caller == "prompt_cache":
        if isinstance(s, Prefill):
            return s.last_store == 0 or (s.cold_target == 0 and s.pos > s.last_store)
        return isinstance(s, Cold) or (isinstance(s, Leaving) and s.prompt == 0)
    if isinstance(s, Prefill):
        return s.last_store == 0 and s.block_tokens == 0 and s.cold_target in (0, s.pos)
    return not isinstance(s, Cold)


def expected_attempts(kinds, refuse):
    """The stores a caller attempts for targets of these kinds: up to the first that stores."""
    out = []
    for k in kinds:
        out.append(REASON_OF[k])
        if REASON_OF[k] not in refuse:
            break
    return out


# ---- the callers ----------------------------------------------------------------------

class Recorder:
    """A store that records the stores attempted of it; those of refused reasons fail."""

    def __init__(self, layout="whole", block_tokens=256, refuse=()):
        self.settings = OPTS.replace(layout=layout, block_tokens=block_tokens, ctx_size=100_000)
        self.model_identity = None
        self.path = "recorder"
        self.refuse = refuse
        self.attempts = []         # (reason, tokens)

    def _record(self, reason, tokens):
        name = Reason(reason).name.lower()
        self.attempts.append((name, len(tokens)))
        return None if name in self.refuse else object()

    def save(self, text, tokens, tensors, reason=None, **kwargs):
        return self._record(reason, tokens)

    save_async = save

    def find(self, text, accept=None):
        return None

    def flush(self):
        pass

    def capture(self, tensors):
        return tensors, {}

    def submit(self, fn, tenant, tokens, key, tensors, dtypes, meta, positional, reason, pin=None):
        return self._record(reason, tokens)

    try_submit = submit

    def at(self, tokens=None, reason=None):
        return [(r, n) for r, n in self.attempts if (tokens is None or n == tokens) and (reason is None or r == reason)]


def checkpoint(ids):
    return types.SimpleNamespace(tensors={"state": np.array(ids, dtype=np.uint8)}, meta={"n": len(ids)},
                                 tokens=np.array(ids), text_bytes=bytes(ids), entry=None)


def prompt_cache(situation):
    """What PromptCache does in a situation: (its decision as the row states it, the recorder)."""
    s = situation
    chain = isinstance(s, Prefill) and s.block_tokens
    store = Recorder("chain" if chain else "whole", s.block_tokens if chain else 256, getattr(s, "refuse", ()))
    pc = PromptCache(store, ToyEngine(snapshots=bool(chain)), prefill_step=STEP)
    if isinstance(s, Cold):
        return pc.begin(bytes(prompt_ids(s.prompt, s.anchor))).cold_target, store
    if isinstance(s, Leaving):
        pc.adopt(checkpoint(prompt_ids(s.n, 0)))
        if s.reason == "evict":
            pc.adopt(checkpoint(prompt_ids(10, 0)))
        else:
            pc.close()
        return [n for _, n in store.at(reason=s.reason)], store
    ids = prompt_ids(s.pos, 0)
    if s.last_store:
        pc.adopt(checkpoint(ids[:s.last_store]))
    req = Request("disk" if s.last_store else "none", ids, s.last_store, bytes(ids), cold_target=s.cold_target)
    pc.prefill(req)
    return [r for r, _ in store.at(tokens=s.pos)], store


@pytest.mark.parametrize("situation, expected", rows("prompt_cache"))
def test_prompt_cache(situation, expected):
    got, _ = prompt_cache(situation)
    if isinstance(situation, Prefill):
        assert got == expected_attempts(expected, situation.refuse)
    elif isinstance(situation, Cold):
        assert got == expected
    else:
        assert got == ([expected] if expected else [])


class Tokenizer:
    """Token ids < 65536, two bytes each."""

    @staticmethod
    def token_bytes(ids):
        return b"".join(int(i).to_bytes(2, "big") for i in ids)


class AdmitsUpTo:
    """A ledger that knows nothing stored and admits the first `n` tokens of anything."""

    def __init__(self, n):
        self.n = n

    def known(self, key):
        return False

    def admitted(self, tokens, tenant, key):
        return min(self.n, len(tokens))

    def remember(self, key, lengths):
        pass

    def count_uses(self, tokens, tenant, key):
        pass


def kv_cache(n, positional=True):
    """An mlx-lm cache of n tokens; not positional: with a recurrent layer beside."""
    import mlx.core as mx
    from mlx_lm.models.cache import ArraysCache, KVCache
    kv = KVCache()
    kv.update_and_fetch(mx.zeros((1, 1, n, 4)), mx.zeros((1, 1, n, 4)))
    if positional:
        return [kv]
    recurrent = ArraysCache(1)
    recurrent[0] = mx.zeros((1, 4))
    return [kv, recurrent]


def serve_tier(situation):
    """What kvstore serve's tier does in a situation: (its decision as the row states it, the recorder)."""
    pytest.importorskip("mlx_lm")
    from kvstore.serve.ticket import Ticket
    from kvstore.serve.tier import WAYPOINT_TYPE, TieredPromptCache
    s = situation
    chain = isinstance(s, Finished)
    store = Recorder("chain" if chain else "whole", s.block_tokens if chain else 256, getattr(s, "refuse", ()))
    provider = types.SimpleNamespace(tokenizer=Tokenizer(), model=None, draft_model=None)
    tier = TieredPromptCache(lambda spec: store, provider, "m", store.settings, max_size=100)
    tier.store = store
    if isinstance(s, Prefill):
        ids = list(range(100, 100 + s.pos))
        tier.begin(Ticket(), ids + [7])
        tier.insert_cache("m", ids, kv_cache(s.pos), cache_type="system" if s.cold_target else WAYPOINT_TYPE)
        return [r for r, _ in store.at(tokens=s.pos)], store
    if isinstance(s, Admitted):
        tier.ledger = AdmitsUpTo(s.admitted)
        ids = list(range(100, 100 + s.n))
        tier.begin(Ticket(), ids + [7])
        tier.insert_cache("m", ids, kv_cache(s.n, s.positional), cache_type="system")
        return [n for _, n in store.at(reason="cold")], store
    ids = list(range(100, 100 + s.n))
    prompt = getattr(s, "prompt", 0) or (s.n - 3 if chain else 0)
    tier.begin(Ticket(), ids[:prompt] if prompt else ids + [7])
    tier.insert_cache("m", ids, kv_cache(s.n, s.positional), cache_type="assistant" if prompt else WAYPOINT_TYPE)
    if chain:
        return [n for _, n in store.at(reason="continued")], store
    if s.reason == "evict":
        tier.trim_to(n_sequences=0)          # mlx-lm's LRU lets the entry go
    else:
        tier.persist_all()
    return [n for _, n in store.at(reason=s.reason)], store


@pytest.mark.parametrize("situation, expected", rows("tier"))
def test_serve_tier(situation, expected):
    got, _ = serve_tier(situation)
    if isinstance(situation, Prefill):
        assert got == expected_attempts(expected, situation.refuse)
    else:
        assert got == ([expected] if expected else [])
