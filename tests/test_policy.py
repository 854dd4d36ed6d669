"""kvstore.policy against ds4's own arithmetic (docs/semantics.md §7 and §8).

Each ds4 function the policy follows is ported literally below (``ds4_*``):
C ``int`` math with truncating division and no overflow allowed, ``uint64_t``
sizes with ds4's overflow checks, ``double`` scores in ds4's evaluation
order.  The ports are read off ``ds4_kvstore.c`` (upstream commit ec6a82a for
the eviction score) and kept deliberately close to the C; policy.py is the
readable version.  Hypothesis compares the two; hand-checked examples pin the
numbers; the places where docs/semantics.md departs from ds4 are tested for its
behaviour.
"""

import dataclasses
import hashlib
import math
import time
import types

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kvstore import policy
from kvstore.format import Entry, ExtFlag, Reason
from kvstore.settings import DEFAULT_HALF_LIFE, DEFAULT_SETTINGS, Settings

# --- ds4, ported literally ---------------------------------------------------

INT_MAX = 2**31 - 1
INT_MIN = -(2**31)
UINT64_MAX = 2**64 - 1
DS4_FIXED_HEADER = 48                     # DS4_KVSTORE_FIXED_HEADER
DS4_HIT_HALF_LIFE_SECONDS = 6 * 60 * 60   # DS4_KVSTORE_HIT_HALF_LIFE_SECONDS
DS4_MIN_EFFECTIVE_HITS = 0.01             # KV_CACHE_MIN_EFFECTIVE_HITS
DS4_CONTINUED_PREFIX_MIN_FACTOR = 0.05
DS4_CONTINUED_PREFIX_HIT_FACTOR = 0.45
DS4_ANCHOR_REASON_SCORE_FACTOR = 2.0
DS4_REASON_COLD, DS4_REASON_CONTINUED, DS4_REASON_EVICT, DS4_REASON_SHUTDOWN = 1, 2, 3, 4


def c_int(v):
    """A C int result; signed overflow is undefined, so the test must not cause it."""
    assert INT_MIN <= v <= INT_MAX, f"C int overflow: {v}"
    return v


def c_div(a, b):
    """C's int division: truncates toward zero."""
    q = abs(a) // abs(b)
    return c_int(q if (a >= 0) == (b > 0) else -q)


def c_mod(a, b):
    """C's %: the sign follows the dividend."""
    return c_int(a - c_div(a, b) * b)


def c_exp2(x):
    return math.exp2(x) if hasattr(math, "exp2") else 2.0 ** x


@dataclasses.dataclass
class Ds4Opt:
    """ds4_kvstore_options."""
    min_tokens: int = 512
    cold_max_tokens: int = 30000
    continued_interval_tokens: int = 10000
    boundary_trim_tokens: int = 32
    boundary_align_tokens: int = 2048


@dataclasses.dataclass
class Ds4Kc:
    """The parts of ds4_kvstore the policy functions read."""
    opt: Ds4Opt
    enabled: bool = True
    continued_last_store_tokens: int = 0
    budget_bytes: int = 0


def ds4_store_len(kc, tokens):
    trim = kc.opt.boundary_trim_tokens
    align = kc.opt.boundary_align_tokens
    if tokens > c_int(kc.opt.min_tokens + trim):
        stable = c_int(tokens - trim)
        if align > 0:
            stable = c_int(stable - c_mod(stable, align))
        if stable >= kc.opt.min_tokens:
            return stable
    return tokens


def ds4_chat_anchor_pos(kc, prompt, user_token_id, assistant_token_id):
    if prompt is None or user_token_id < 0 or assistant_token_id < 0:
        return -1
    last_user = -1
    for i in range(len(prompt)):
        token = prompt[i]
        if token == assistant_token_id:
            break
        if token == user_token_id:
            last_user = i
    return last_user if last_user >= kc.opt.min_tokens else -1


def ds4_continued_step(kc):
    if not kc.enabled or kc.opt.continued_interval_tokens <= 0:
        return 0
    step = kc.opt.continued_interval_tokens
    align = kc.opt.boundary_align_tokens
    if align > 0:
        step = c_int(c_div(c_int(step + align - 1), align) * align)
        if step <= 0:
            step = align
    return step


def ds4_continued_store_target(kc, live_tokens):
    step = ds4_continued_step(kc)
    if step <= 0:
        return 0
    if live_tokens < kc.opt.min_tokens:
        return 0
    if c_mod(live_tokens, step) != 0:
        return 0
    if live_tokens <= kc.continued_last_store_tokens:
        return 0
    return live_tokens


def ds4_file_size_fits(kc, text_bytes, payload_bytes, trailer_bytes):
    fixed = DS4_FIXED_HEADER + 4
    # kv_cache_file_size_bytes
    if (UINT64_MAX - fixed < text_bytes
            or UINT64_MAX - fixed - text_bytes < payload_bytes
            or UINT64_MAX - fixed - text_bytes - payload_bytes < trailer_bytes):
        return False
    file_bytes = fixed + text_bytes + payload_bytes + trailer_bytes
    if kc is None or kc.budget_bytes == 0:
        return True
    # kv_cache_budget_required
    slack = file_bytes // 100
    if file_bytes % 100:
        slack += 1
    if UINT64_MAX - file_bytes < slack:
        return False
    required = file_bytes + slack
    return required <= kc.budget_bytes


@dataclasses.dataclass
class Ds4Entry:
    """ds4_kvstore_entry (the fields the score reads) plus the stored text."""
    sha: str
    reason: int
    tokens: int
    hits: int
    ctx_size: int
    model_id: int
    quant_bits: int
    created_at: int
    last_used: int
    text_bytes: int
    file_size: int


@dataclasses.dataclass
class Ds4Incoming:
    """ds4_kvstore_eviction_context."""
    text: bytes
    model_id: int
    quant_bits: int
    ctx_size: int
    reject_different_quant: bool


def ds4_incoming_supersedes_continued(e, incoming):
    if e is None or incoming is None or incoming.text is None:
        return False
    if e.reason != DS4_REASON_CONTINUED:
        return False
    if e.text_bytes == 0:
        return False
    if e.text_bytes >= len(incoming.text):
        return False
    if e.model_id != incoming.model_id:
        return False
    if incoming.reject_different_quant and e.quant_bits != incoming.quant_bits:
        return False
    if incoming.ctx_size > e.ctx_size:
        return False
    return hashlib.sha1(incoming.text[:e.text_bytes]).hexdigest() == e.sha


def ds4_reason_is_anchor(reason):
    return reason in (DS4_REASON_COLD, DS4_REASON_EVICT, DS4_REASON_SHUTDOWN)


def ds4_entry_eviction_score(e, now, incoming):
    if e is None or e.file_size == 0:
        return 0.0
    effective_hits = float(e.hits)
    used_at = e.last_used if e.last_used else e.created_at
    if used_at == 0:
        effective_hits = 0.0
    elif now > used_at:
        elapsed = float(now - used_at)
        effective_hits *= c_exp2(-elapsed / float(DS4_HIT_HALF_LIFE_SECONDS))
        if effective_hits < DS4_MIN_EFFECTIVE_HITS:
            effective_hits = 0.0
    score = (effective_hits + 1.0) * float(e.tokens) / float(e.file_size)
    if ds4_reason_is_anchor(e.reason):
        score *= DS4_ANCHOR_REASON_SCORE_FACTOR
    if ds4_incoming_supersedes_continued(e, incoming):
        h = effective_hits / (effective_hits + 1.0) if effective_hits > 0.0 else 0.0
        score *= DS4_CONTINUED_PREFIX_MIN_FACTOR + DS4_CONTINUED_PREFIX_HIT_FACTOR * h
    return score


def ds4_evict_victim(entries, now, incoming):
    """The victim index ds4_kvstore_evict's inner loop picks."""
    victim = 0
    victim_score = ds4_entry_eviction_score(entries[0], now, incoming)
    for i in range(1, len(entries)):
        score = ds4_entry_eviction_score(entries[i], now, incoming)
        if score < victim_score or (score == victim_score
                                    and entries[i].last_used < entries[victim].last_used):
            victim = i
            victim_score = score
    return victim


# --- helpers -----------------------------------------------------------------

def ds4_kc(options, last_store=0, budget=0):
    return Ds4Kc(opt=Ds4Opt(options.min_tokens, options.cold_max_tokens,
                            options.continued_interval_tokens,
                            options.boundary_trim_tokens, options.boundary_align_tokens),
                 continued_last_store_tokens=last_store, budget_bytes=budget)


def make_entry(sha="0" * 40, reason=Reason.COLD, tokens=4096, hits=0, ctx_size=32768,
               model_id=0, quant_bits=4, created_at=1_000_000, last_used=0,
               text_bytes=100, file_size=1 << 20):
    return Entry(sha=sha, path=f"/cache/{sha}.kv", quant_bits=quant_bits, reason=reason,
                 ext_flags=ExtFlag(0), model_id=model_id, tokens=tokens, hits=hits,
                 ctx_size=ctx_size, payload_abi=16, created_at=created_at,
                 last_used=last_used, payload_bytes=max(0, file_size - 52 - text_bytes),
                 text_bytes=text_bytes, file_size=file_size)


def spec_supersedes(entry_text, entry, incoming):
    """docs/semantics.md §8's definition, as a store would compute it from the texts."""
    return (0 < len(entry_text) < len(incoming.text)
            and incoming.text.startswith(entry_text)
            and entry.model_id == incoming.model_id
            and incoming.ctx_size <= entry.ctx_size
            and (not incoming.reject_different_quant
                 or entry.quant_bits == incoming.quant_bits))


HALF_LIFE = DEFAULT_HALF_LIFE

small_counts = st.integers(min_value=0, max_value=1 << 20)
options_strategy = st.builds(
    Settings,
    min_tokens=small_counts,
    cold_max_tokens=small_counts,
    continued_interval_tokens=st.integers(min_value=0, max_value=1 << 30),
    boundary_trim_tokens=small_counts,
    boundary_align_tokens=st.integers(min_value=1, max_value=1 << 20),
)
options_or_default = st.one_of(st.just(DEFAULT_SETTINGS), options_strategy)
token_counts = st.integers(min_value=0, max_value=INT_MAX)


# --- ds4's own unit tests (ds4_server.c test_kv_cache_*), replayed -----------

def test_ds4_store_len_cases():
    assert policy.store_len(11011) == 10240
    assert policy.store_len(1695) == 1695
    o = Settings(boundary_trim_tokens=0, boundary_align_tokens=1000)
    assert policy.store_len(3500, o) == 3000
    # ds4's alignment 0 ("none") is alignment 1 here
    assert policy.store_len(3500, Settings(boundary_trim_tokens=0, boundary_align_tokens=1)) == 3500


def test_ds4_chat_anchor_cases():
    user, assistant = 9001, 9002
    codex = [1, 2, user, 3, 4, user, 5, assistant]
    claude = [1, 2, 3, 4, user, 5, assistant]
    assert policy.chat_anchor_pos(codex, user, assistant, Settings(min_tokens=4)) == 5
    assert policy.chat_anchor_pos(claude, user, assistant, Settings(min_tokens=4)) == 4
    multiturn = [1, 2, user, 3, assistant, 4, user, 5, assistant]
    assert policy.chat_anchor_pos(multiturn, user, assistant, Settings(min_tokens=2)) == 2
    assert policy.chat_anchor_pos(multiturn, user, assistant, Settings(min_tokens=3)) == -1
    assert policy.chat_anchor_pos(multiturn, -1, assistant, Settings(min_tokens=2)) == -1
    assert policy.chat_anchor_pos(multiturn, user, -1, Settings(min_tokens=2)) == -1


def test_ds4_continued_cases():
    assert policy.continued_store_target(10239, 0) == 0
    assert policy.continued_store_target(10240, 0) == 10240
    assert policy.continued_store_target(10240, 4096) == 10240
    assert policy.continued_store_target(30720, 24576) == 30720
    assert policy.continued_store_target(18432, 10240) == 0
    assert policy.continued_store_target(20480, 10240) == 20480


# --- Settings ----------------------------------------------------------------

def test_defaults_are_ds4s():
    o = Settings()
    assert (o.min_tokens, o.cold_max_tokens, o.continued_interval_tokens,
            o.boundary_trim_tokens, o.boundary_align_tokens) == (512, 30000, 10000, 32, 2048)
    assert o.hit_half_life_s == 6 * 3600 == DS4_HIT_HALF_LIFE_SECONDS
    assert DEFAULT_SETTINGS == o
    assert dataclasses.astuple(Ds4Opt()) == (o.min_tokens, o.cold_max_tokens, o.continued_interval_tokens,
                                             o.boundary_trim_tokens, o.boundary_align_tokens)


def test_ds4_score_constants():
    assert policy.MIN_EFFECTIVE_HITS == DS4_MIN_EFFECTIVE_HITS
    assert policy.ANCHOR_SCORE_FACTOR == DS4_ANCHOR_REASON_SCORE_FACTOR
    assert policy.SUPERSEDED_MIN_FACTOR == DS4_CONTINUED_PREFIX_MIN_FACTOR
    assert policy.SUPERSEDED_HIT_FACTOR == DS4_CONTINUED_PREFIX_HIT_FACTOR


def test_options_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        DEFAULT_SETTINGS.min_tokens = 1


@pytest.mark.parametrize("field", ["min_tokens", "cold_max_tokens", "continued_interval_tokens",
                                   "boundary_trim_tokens", "boundary_align_tokens"])
def test_options_refuse_negative_counts(field):
    with pytest.raises(ValueError, match=rf"{field}=-3\b"):
        Settings(**{field: -3})


def test_options_refuse_zero_alignment():
    with pytest.raises(ValueError, match=r"boundary_align_tokens=0"):
        Settings(boundary_align_tokens=0)


@pytest.mark.parametrize("half_life", [0, -1, -0.5, float("nan")])
def test_options_refuse_bad_half_life(half_life):
    with pytest.raises(ValueError, match=r"hit_half_life_s="):
        Settings(hit_half_life_s=half_life)


@pytest.mark.parametrize("value", [1.5, "512", None, True])
def test_options_refuse_non_integers(value):
    with pytest.raises(TypeError, match=r"min_tokens="):
        Settings(min_tokens=value)


def test_options_accept_zero_counts_and_numpy_ints():
    o = Settings(min_tokens=np.int64(0), boundary_trim_tokens=0, continued_interval_tokens=0,
                boundary_align_tokens=np.uint32(1), hit_half_life_s=0.5)
    assert o.min_tokens == 0 and type(o.min_tokens) is int
    assert o.boundary_align_tokens == 1 and type(o.boundary_align_tokens) is int


# --- store_len ---------------------------------------------------------------

@pytest.mark.parametrize("tokens, expected", [
    (5000, 4096),     # 5000 - 32 = 4968, down to 2 * 2048
    (4127, 2048),     # 4095 rounds down to 2048
    (4128, 4096),     # 4096 exactly
    (2080, 2048),
    (2079, 2079),     # 2047 rounds down to 0 < 512: store everything
    (2000, 2000),
    (545, 545),       # > min + trim, but 513 rounds down to 0
    (544, 544),       # not > min + trim
    (300, 300),       # below min: full length
    (0, 0),
    (100_000, 98304),
])
def test_store_len_examples(tokens, expected):
    assert policy.store_len(tokens) == expected
    assert ds4_store_len(ds4_kc(DEFAULT_SETTINGS), tokens) == expected


def test_store_len_small_alignment_keeps_min():
    o = Settings(min_tokens=512, boundary_trim_tokens=32, boundary_align_tokens=256)
    assert policy.store_len(1000, o) == 768
    assert policy.store_len(800, o) == 768
    assert policy.store_len(799, o) == 512
    assert policy.store_len(700, o) == 512


@given(options_or_default, token_counts)
def test_store_len_matches_ds4(options, tokens):
    assume(options.min_tokens + options.boundary_trim_tokens <= INT_MAX)
    assert policy.store_len(tokens, options) == ds4_store_len(ds4_kc(options), tokens)


@given(options_or_default, token_counts)
def test_store_len_properties(options, tokens):
    n = policy.store_len(tokens, options)
    assert n <= tokens
    if n != tokens:
        assert n % options.boundary_align_tokens == 0
        assert options.min_tokens <= n <= tokens - options.boundary_trim_tokens


def test_store_len_refuses_negative():
    with pytest.raises(ValueError, match=r"tokens=-1"):
        policy.store_len(-1)


# --- chat_anchor_pos ---------------------------------------------------------

USER, ASSISTANT = 7, 9


def chat(length, users=(), assistants=(), filler=1):
    ids = [filler] * length
    for i in users:
        ids[i] = USER
    for i in assistants:
        ids[i] = ASSISTANT
    return ids


@pytest.mark.parametrize("ids, expected", [
    (chat(1000, users=[10, 600, 700], assistants=[800]), 700),      # last user before assistant
    (chat(1000, users=[10, 600, 900], assistants=[800]), 600),      # user after it ignored
    (chat(1000, users=[600, 900], assistants=[100, 800]), -1),      # first assistant rules
    (chat(1000, users=[100, 300], assistants=[800]), -1),           # anchor under min_tokens
    (chat(1000, users=[512], assistants=[800]), 512),               # exactly min_tokens
    (chat(1000, users=[511], assistants=[800]), -1),
    (chat(1000, users=[600, 950]), 950),                            # no assistant: last user
    (chat(1000, assistants=[800]), -1),                             # no user marker
    (chat(1000), -1),
    ([], -1),
])
def test_chat_anchor_examples(ids, expected):
    assert policy.chat_anchor_pos(ids, USER, ASSISTANT) == expected
    assert policy.chat_anchor_pos(tuple(ids), USER, ASSISTANT) == expected
    for dtype in (np.uint32, np.int64, np.int32, np.uint16):
        assert policy.chat_anchor_pos(np.array(ids, dtype=dtype), USER, ASSISTANT) == expected
    assert ds4_chat_anchor_pos(ds4_kc(DEFAULT_SETTINGS), ids, USER, ASSISTANT) == expected


@pytest.mark.parametrize("user, assistant", [(-1, ASSISTANT), (USER, -1), (-5, -5)])
def test_chat_anchor_negative_ids_mean_no_markers(user, assistant):
    ids = chat(1000, users=[700], assistants=[800])
    assert policy.chat_anchor_pos(ids, user, assistant) == -1
    assert policy.chat_anchor_pos(np.array(ids, dtype=np.uint32), user, assistant) == -1


def test_chat_anchor_none_prompt():
    assert policy.chat_anchor_pos(None, USER, ASSISTANT) == -1


def test_chat_anchor_same_id_for_both_markers():
    ids = chat(1000, users=[700])
    assert policy.chat_anchor_pos(ids, USER, USER) == -1
    assert policy.chat_anchor_pos(np.array(ids), USER, USER) == -1


def test_chat_anchor_ids_outside_the_dtype():
    ids = np.array(chat(1000, users=[700], assistants=[800]), dtype=np.uint16)
    # An id the dtype cannot hold cannot occur: no user marker, or no
    # assistant marker (so the last user marker anywhere counts).
    assert policy.chat_anchor_pos(ids, 70_000, ASSISTANT) == -1
    assert policy.chat_anchor_pos(ids, USER, 70_000) == 700
    assert policy.chat_anchor_pos(ids, USER, 2**70) == 700
    assert ds4_chat_anchor_pos(ds4_kc(DEFAULT_SETTINGS), list(ids), USER, 70_000) == 700


def test_chat_anchor_respects_min_tokens_option():
    ids = chat(1000, users=[100], assistants=[800])
    assert policy.chat_anchor_pos(ids, USER, ASSISTANT, Settings(min_tokens=100)) == 100
    assert policy.chat_anchor_pos(ids, USER, ASSISTANT, Settings(min_tokens=101)) == -1


marker_prompts = st.lists(st.sampled_from([0, 1, 2, USER, ASSISTANT]), max_size=300)


@given(marker_prompts, st.integers(min_value=0, max_value=300),
       st.sampled_from([(USER, ASSISTANT), (ASSISTANT, USER), (USER, USER), (-1, ASSISTANT),
                        (USER, 12345)]))
def test_chat_anchor_matches_ds4(ids, min_tokens, markers):
    user, assistant = markers
    options = Settings(min_tokens=min_tokens)
    expected = ds4_chat_anchor_pos(ds4_kc(options), ids, user, assistant)
    assert policy.chat_anchor_pos(ids, user, assistant, options) == expected
    assert policy.chat_anchor_pos(np.array(ids, dtype=np.uint32), user, assistant,
                                  options) == expected
    assert policy.chat_anchor_pos(np.array(ids, dtype=np.int64), user, assistant,
                                  options) == expected


def test_chat_anchor_is_fast_on_numpy():
    n = 100_000
    ids = np.random.default_rng(0).integers(10, 100_000, size=n, dtype=np.uint32)
    ids[[5_000, 60_000, 70_000]] = USER
    ids[[80_000, 90_000]] = ASSISTANT
    assert policy.chat_anchor_pos(ids, USER, ASSISTANT) == 70_000
    best = math.inf
    for _ in range(5):
        t0 = time.perf_counter()
        policy.chat_anchor_pos(ids, USER, ASSISTANT)
        best = min(best, time.perf_counter() - t0)
    # A Python loop over 100k numpy scalars takes ~10 ms; vectorised is ~0.1 ms.
    assert best < 0.003, f"chat_anchor_pos took {best * 1e3:.2f} ms on 100k tokens"


# --- continued_step / continued_store_target ---------------------------------

def test_continued_step_default_is_10240():
    assert policy.continued_step() == 10240
    assert ds4_continued_step(ds4_kc(DEFAULT_SETTINGS)) == 10240


@pytest.mark.parametrize("interval, align, expected", [
    (10000, 2048, 10240), (10240, 2048, 10240), (10241, 2048, 12288), (1, 2048, 2048),
    (4096, 4096, 4096), (7, 1, 7), (0, 2048, 0),
])
def test_continued_step_examples(interval, align, expected):
    o = Settings(continued_interval_tokens=interval, boundary_align_tokens=align)
    assert policy.continued_step(o) == expected


@given(st.integers(min_value=0, max_value=1 << 30), st.integers(min_value=1, max_value=1 << 20))
def test_continued_step_matches_ds4(interval, align):
    o = Settings(continued_interval_tokens=interval, boundary_align_tokens=align)
    assert policy.continued_step(o) == ds4_continued_step(ds4_kc(o))


@pytest.mark.parametrize("live, last, expected", [
    (10240, 0, 10240),
    (20480, 10240, 20480),
    (20480, 0, 20480),          # a missed earlier waypoint does not block a later one
    (10240, 10240, 0),          # already stored (e.g. a cold store on the frontier)
    (10240, 12000, 0),          # not beyond the last stored count
    (10000, 0, 0),              # the raw interval is not the step
    (10241, 0, 0),
    (0, 0, 0),
    (5120, 0, 0),
])
def test_continued_store_target_examples(live, last, expected):
    assert policy.continued_store_target(live, last) == expected
    assert ds4_continued_store_target(ds4_kc(DEFAULT_SETTINGS, last), live) == expected


def test_continued_store_target_off_when_interval_zero():
    o = Settings(continued_interval_tokens=0)
    assert policy.continued_store_target(10240, 0, o) == 0


def test_continued_store_target_needs_min_tokens():
    o = Settings(min_tokens=4096, continued_interval_tokens=1024, boundary_align_tokens=1024)
    assert policy.continued_store_target(3072, 0, o) == 0
    assert policy.continued_store_target(4096, 0, o) == 4096


@given(options_or_default, token_counts, token_counts)
def test_continued_store_target_matches_ds4(options, live, last):
    assume(options.continued_interval_tokens + options.boundary_align_tokens <= INT_MAX)
    kc = ds4_kc(options, last)
    assert policy.continued_store_target(live, last, options) == ds4_continued_store_target(kc, live)


@given(options_or_default, st.integers(min_value=0, max_value=40), token_counts)
def test_continued_store_target_at_multiples(options, k, last):
    step = policy.continued_step(options)
    assume(step > 0)
    live = k * step
    got = policy.continued_store_target(live, last, options)
    assert got == (live if live >= options.min_tokens and live > last else 0)
    assert policy.continued_store_target(live + 1, last, options) in (0, live + 1)
    if step > 1:
        assert policy.continued_store_target(live + 1, last, options) == 0


def test_continued_store_target_refuses_negative():
    with pytest.raises(ValueError, match=r"live_tokens=-1"):
        policy.continued_store_target(-1, 0)
    with pytest.raises(ValueError, match=r"last_store_tokens=-2"):
        policy.continued_store_target(10240, -2)


# --- effective_hits ----------------------------------------------------------

def test_effective_hits_halves_at_one_half_life():
    assert policy.effective_hits(8, 1000, 0, 1000 + HALF_LIFE, HALF_LIFE) == 4.0
    assert policy.effective_hits(8, 1000, 0, 1000 + 2 * HALF_LIFE, HALF_LIFE) == 2.0
    assert policy.effective_hits(8, 1000, 0, 1000 + 3600, 3600) == 4.0


def test_effective_hits_drop_to_zero_under_a_hundredth():
    # 1 hit after 6 half-lives: 1/64 = 0.0156 stays; after 7: 0.0078 is noise.
    assert policy.effective_hits(1, 1000, 0, 1000 + 6 * HALF_LIFE, HALF_LIFE) == 1 / 64
    assert policy.effective_hits(1, 1000, 0, 1000 + 7 * HALF_LIFE, HALF_LIFE) == 0.0


def test_effective_hits_no_time_means_no_evidence():
    assert policy.effective_hits(50, 0, 0, 10**9, HALF_LIFE) == 0.0


def test_effective_hits_now_at_or_before_t_is_raw():
    assert policy.effective_hits(5, 1000, 0, 1000, HALF_LIFE) == 5.0
    assert policy.effective_hits(5, 1000, 0, 999, HALF_LIFE) == 5.0
    assert isinstance(policy.effective_hits(5, 1000, 0, 999, HALF_LIFE), float)


def test_effective_hits_fall_back_to_created_at():
    assert policy.effective_hits(4, 0, 2000, 2000 + HALF_LIFE, HALF_LIFE) == 2.0
    # last_used wins over created_at when set
    assert policy.effective_hits(4, 5000, 2000, 5000 + HALF_LIFE, HALF_LIFE) == 2.0


# --- eviction_score ----------------------------------------------------------

def test_score_base_formula():
    e = make_entry(reason=Reason.UNKNOWN, tokens=4096, hits=3, last_used=5000,
                   file_size=1 << 20)
    assert policy.eviction_score(e, now=5000) == 4 * 4096 / (1 << 20)


def test_score_anchors_count_double():
    for reason in (Reason.COLD, Reason.EVICT, Reason.SHUTDOWN):
        anchor = make_entry(reason=reason, hits=2, last_used=100)
        plain = make_entry(reason=Reason.UNKNOWN, hits=2, last_used=100)
        assert policy.eviction_score(anchor, 100) == 2.0 * policy.eviction_score(plain, 100)
    for reason in (Reason.UNKNOWN, Reason.CONTINUED, Reason.AGENT_SYSTEM, Reason.AGENT_SESSION):
        assert not policy.is_anchor(reason)
    assert policy.is_anchor(1) and policy.is_anchor(3) and policy.is_anchor(4)
    assert not policy.is_anchor(2) and not policy.is_anchor(99)


@pytest.mark.parametrize("hits, factor", [(0, 0.05), (1, 0.05 + 0.45 * 0.5),
                                          (3, 0.05 + 0.45 * 0.75), (9, 0.05 + 0.45 * 0.9)])
def test_score_superseded_waypoint_scale(hits, factor):
    e = make_entry(reason=Reason.CONTINUED, hits=hits, last_used=100)
    base = policy.eviction_score(e, 100)
    assert base == (hits + 1) * e.tokens / e.file_size
    assert policy.eviction_score(e, 100, superseded=True) == pytest.approx(base * factor,
                                                                           rel=1e-15)


def test_score_superseded_applies_to_continued_only():
    # ds4's predicate starts with reason == continued; an anchor is never a
    # routine waypoint, whatever the caller says.
    for reason in (Reason.COLD, Reason.UNKNOWN, Reason.AGENT_SESSION):
        e = make_entry(reason=reason, hits=1, last_used=100)
        assert policy.eviction_score(e, 100, superseded=True) == policy.eviction_score(e, 100)


def test_score_decays_hits():
    e = make_entry(reason=Reason.UNKNOWN, hits=7, last_used=1000, tokens=100, file_size=100)
    assert policy.eviction_score(e, 1000) == 8.0
    assert policy.eviction_score(e, 1000 + HALF_LIFE) == 4.5
    assert policy.eviction_score(e, 1000 + HALF_LIFE, half_life_s=2 * HALF_LIFE) == \
        pytest.approx(1 + 7 / math.sqrt(2), rel=1e-15)
    assert policy.eviction_score(e, 1000 + 100 * HALF_LIFE) == 1.0


def test_score_empty_file_is_zero_and_protected_is_infinite():
    assert policy.eviction_score(make_entry(file_size=0), 100) == 0.0
    assert policy.eviction_score(make_entry(file_size=0), 100, protected=True) == 0.0
    assert policy.eviction_score(make_entry(), 100, protected=True) == math.inf


def test_score_accepts_any_object_with_the_fields():
    e = types.SimpleNamespace(hits=1, last_used=10, created_at=5, tokens=10, file_size=20,
                              reason=1)
    assert policy.eviction_score(e, 10) == 2.0 * (2 * 10 / 20)


texts = st.binary(min_size=0, max_size=40)


@st.composite
def score_cases(draw):
    incoming_text = draw(st.binary(min_size=0, max_size=40))
    n = draw(st.integers(min_value=0, max_value=len(incoming_text) + 3))
    prefix_of_incoming = draw(st.booleans())
    text = incoming_text[:n] if prefix_of_incoming else draw(texts)
    e = Ds4Entry(
        sha=hashlib.sha1(text).hexdigest(),
        reason=draw(st.integers(min_value=0, max_value=6)),
        tokens=draw(st.integers(min_value=1, max_value=2**32 - 1)),
        hits=draw(st.one_of(st.integers(min_value=0, max_value=10),
                            st.integers(min_value=0, max_value=2**32 - 1))),
        ctx_size=draw(st.sampled_from([4096, 32768, 65536])),
        model_id=draw(st.sampled_from([0, 1])),
        quant_bits=draw(st.sampled_from([2, 4])),
        created_at=draw(st.one_of(st.just(0), st.integers(min_value=0, max_value=2**40))),
        last_used=draw(st.one_of(st.just(0), st.integers(min_value=0, max_value=2**40))),
        text_bytes=len(text),
        file_size=draw(st.one_of(st.just(0), st.integers(min_value=1, max_value=2**50))),
    )
    incoming = Ds4Incoming(text=incoming_text, model_id=draw(st.sampled_from([0, 1])),
                           quant_bits=draw(st.sampled_from([2, 4])),
                           ctx_size=draw(st.sampled_from([4096, 32768, 65536])),
                           reject_different_quant=draw(st.booleans()))
    now = draw(st.one_of(st.integers(min_value=0, max_value=2**40),
                         st.builds(lambda t, d: t + d, st.just(e.last_used or e.created_at),
                                   st.integers(min_value=-10, max_value=30 * HALF_LIFE))))
    return text, e, incoming, max(0, now)


def policy_entry(e):
    return make_entry(sha=e.sha, reason=Reason(e.reason), tokens=e.tokens, hits=e.hits,
                      ctx_size=e.ctx_size, model_id=e.model_id, quant_bits=e.quant_bits,
                      created_at=e.created_at, last_used=e.last_used,
                      text_bytes=e.text_bytes, file_size=e.file_size)


@settings(max_examples=500)
@given(score_cases())
def test_eviction_score_matches_ds4(case):
    text, e, incoming, now = case
    entry = policy_entry(e)
    superseded = spec_supersedes(text, entry, incoming)
    got = policy.eviction_score(entry, now, superseded=superseded)
    assert got == ds4_entry_eviction_score(e, now, incoming)
    if e.file_size:
        eh = policy.effective_hits(e.hits, e.last_used, e.created_at, now, HALF_LIFE)
        assert got >= 0 and eh >= 0


# --- file_size_fits ----------------------------------------------------------

@pytest.mark.parametrize("text, payload, trailer, budget, fits", [
    (48, 0, 0, 101, True),        # file 100, slack 1
    (48, 0, 0, 100, False),
    (0, 0, 0, 53, True),          # file 52, slack ceil(0.52) = 1
    (0, 0, 0, 52, False),
    (100, 48, 0, 202, True),      # file 200, slack 2 exactly
    (100, 48, 0, 201, False),
    (100, 49, 0, 204, True),      # file 201, slack ceil(2.01) = 3
    (100, 49, 0, 203, False),
    (10, 20, 30, 0, True),        # budget 0: unlimited, as ds4
    (2**63, 2**63, 0, 0, False),  # does not fit a u64 even when unlimited
    (2**64 - 53, 0, 0, 0, True),  # exactly UINT64_MAX bytes
    (2**64 - 52, 0, 0, 0, False),
    (2**64 - 53, 0, 0, 2**64 - 1, False),   # slack overflows u64
])
def test_file_size_fits_examples(text, payload, trailer, budget, fits):
    assert policy.file_size_fits(text, payload, trailer, budget) is fits
    assert ds4_file_size_fits(Ds4Kc(Ds4Opt(), budget_bytes=budget), text, payload, trailer) is fits


sizes = st.one_of(st.integers(min_value=0, max_value=1 << 40),
                  st.integers(min_value=0, max_value=UINT64_MAX))


@given(sizes, sizes, sizes, st.one_of(st.just(0), sizes))
def test_file_size_fits_matches_ds4(text, payload, trailer, budget):
    kc = Ds4Kc(Ds4Opt(), budget_bytes=budget)
    assert policy.file_size_fits(text, payload, trailer, budget) == \
        ds4_file_size_fits(kc, text, payload, trailer)


@given(st.integers(min_value=0, max_value=1 << 40))
def test_file_size_fits_boundary_is_one_percent_rounded_up(file_extra):
    file_bytes = 52 + file_extra
    required = file_bytes + math.ceil(file_bytes / 100)
    assert policy.file_size_fits(file_extra, 0, 0, required)
    assert not policy.file_size_fits(file_extra, 0, 0, required - 1)


@pytest.mark.parametrize("args, name", [((-1, 0, 0, 10), "text_bytes"),
                                        ((0, -1, 0, 10), "payload_bytes"),
                                        ((0, 0, -1, 10), "trailer_bytes"),
                                        ((0, 0, 0, -1), "budget_bytes")])
def test_file_size_fits_refuses_negative(args, name):
    # docs/semantics.md departs from ds4 (whose sizes are unsigned): a negative budget is
    # an error, not "unlimited".
    with pytest.raises(ValueError, match=rf"{name}=-1"):
        policy.file_size_fits(*args)


# --- pick_victim -------------------------------------------------------------

def sha(i):
    return f"{i:040x}"


def test_pick_victim_empty():
    assert policy.pick_victim([], now=100) is None


def test_pick_victim_lowest_score():
    dense = make_entry(sha=sha(1), reason=Reason.CONTINUED, tokens=8000, last_used=50)
    sparse = make_entry(sha=sha(2), reason=Reason.CONTINUED, tokens=1000, last_used=50)
    hit = make_entry(sha=sha(3), reason=Reason.CONTINUED, tokens=1000, hits=20, last_used=50)
    assert policy.pick_victim([dense, sparse, hit], now=100) is sparse


def test_pick_victim_anchor_survives_denser_waypoint():
    cold = make_entry(sha=sha(1), reason=Reason.COLD, tokens=1024, last_used=50)
    cont = make_entry(sha=sha(2), reason=Reason.CONTINUED, tokens=1200, last_used=50)
    assert policy.pick_victim([cold, cont], now=100) is cont


def test_pick_victim_tie_goes_to_older_use():
    a = make_entry(sha=sha(1), reason=Reason.CONTINUED, last_used=300)
    b = make_entry(sha=sha(2), reason=Reason.CONTINUED, last_used=200)
    c = make_entry(sha=sha(3), reason=Reason.CONTINUED, last_used=400)
    # same hits (0), so same score whatever the times
    assert policy.pick_victim([a, b, c], now=1000) is b


def test_pick_victim_tie_uses_created_at_when_never_hit():
    # ds4 compares raw last_used, so a never-hit file (last_used 0) loses
    # every tie however new it is; docs/semantics.md §8 uses t = last_used or created_at.
    new_unhit = make_entry(sha=sha(1), reason=Reason.CONTINUED, last_used=0, created_at=2000)
    old_used = make_entry(sha=sha(2), reason=Reason.CONTINUED, last_used=1000, created_at=500)
    entries = [new_unhit, old_used]
    assert policy.pick_victim(entries, now=5000) is old_used
    ds4_entries = [Ds4Entry(e.sha, int(e.reason), e.tokens, e.hits, e.ctx_size, e.model_id,
                            e.quant_bits, e.created_at, e.last_used, e.text_bytes, e.file_size)
                   for e in entries]
    assert ds4_evict_victim(ds4_entries, 5000, None) == 0      # the deviation


def test_pick_victim_full_tie_takes_the_first():
    a = make_entry(sha=sha(1), reason=Reason.CONTINUED, last_used=100)
    b = make_entry(sha=sha(2), reason=Reason.CONTINUED, last_used=100)
    assert policy.pick_victim([a, b], now=1000) is a
    assert policy.pick_victim([b, a], now=1000) is b


def test_pick_victim_never_protected_unless_alone():
    fresh = make_entry(sha=sha(1), reason=Reason.CONTINUED, tokens=10, last_used=100)
    other = make_entry(sha=sha(2), reason=Reason.COLD, tokens=9000, hits=50, last_used=100)
    assert policy.pick_victim([fresh, other], 100, protected={sha(1)}) is other
    assert policy.pick_victim([fresh, other], 100, protected={fresh.name}) is other
    assert policy.pick_victim([fresh], 100, protected={sha(1)}) is fresh
    # all protected: the real scores decide
    assert policy.pick_victim([other, fresh], 100, protected={sha(1), sha(2)}) is fresh


def test_pick_victim_superseded_waypoint_goes_first():
    # waypoint 10240 / MiB against cold 2 * 2048 / MiB; superseded and never
    # hit, the waypoint keeps 5 %: 512 / MiB.
    waypoint = make_entry(sha=sha(1), reason=Reason.CONTINUED, tokens=10240, last_used=100)
    cold = make_entry(sha=sha(2), reason=Reason.COLD, tokens=2048, last_used=100)
    assert policy.pick_victim([waypoint, cold], 100) is cold
    assert policy.pick_victim([waypoint, cold], 100, superseded={sha(1)}) is waypoint
    # superseded names a cold entry: no effect (continued only)
    assert policy.pick_victim([waypoint, cold], 100, superseded={sha(2)}) is cold


def test_pick_victim_accepts_an_iterator():
    entries = [make_entry(sha=sha(i), reason=Reason.CONTINUED, tokens=1000 + i, last_used=10)
               for i in range(5)]
    assert policy.pick_victim(iter(entries), 100) is entries[0]


@st.composite
def victim_cases(draw):
    incoming_text = draw(st.binary(min_size=1, max_size=20))
    n = draw(st.integers(min_value=1, max_value=8))
    entries, texts_ = [], []
    for _ in range(n):
        text = incoming_text[:draw(st.integers(0, len(incoming_text)))] \
            if draw(st.booleans()) else draw(texts)
        entries.append(Ds4Entry(
            sha=hashlib.sha1(text).hexdigest(),
            reason=draw(st.sampled_from([0, 1, 2, 2, 2, 3, 4])),
            tokens=draw(st.sampled_from([512, 1024, 2048, 4096])),
            hits=draw(st.integers(min_value=0, max_value=4)),
            ctx_size=32768, model_id=0, quant_bits=4,
            created_at=draw(st.integers(min_value=0, max_value=10_000)),
            # ds4 ties on raw last_used; with last_used > 0 that is docs/semantics.md §8's t.
            last_used=draw(st.integers(min_value=1, max_value=10_000)),
            text_bytes=len(text),
            file_size=draw(st.sampled_from([0, 1 << 20, 2 << 20, 3 << 20]))))
        texts_.append(text)
    incoming = Ds4Incoming(incoming_text, 0, 4, 32768, False)
    now = draw(st.integers(min_value=0, max_value=10_000 + 3 * HALF_LIFE))
    return entries, texts_, incoming, now


@settings(max_examples=300)
@given(victim_cases())
def test_pick_victim_matches_ds4(case):
    ds4_entries, entry_texts, incoming, now = case
    entries = [policy_entry(e) for e in ds4_entries]
    superseded = {e.sha for e, text in zip(entries, entry_texts)
                  if spec_supersedes(text, e, incoming)}
    # distinct shas only: ds4 names files by sha, so duplicates cannot exist
    assume(len({e.sha for e in entries}) == len(entries))
    victim = policy.pick_victim(entries, now, superseded=superseded)
    assert victim is entries[ds4_evict_victim(ds4_entries, now, incoming)]
