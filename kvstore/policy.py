"""Store and eviction policy (docs/format.md §7 and §8) as pure functions.

This module owns the arithmetic a server uses to decide *what* to store and
*what* to delete: the aligned store length, the chat anchor of a cold
checkpoint, the continued-waypoint schedule, the decayed hit count, the
eviction score, the budget check and the choice of a victim.  It does no I/O
and keeps no state: the caller owns the directory, the index, the last stored
waypoint and the clock, and passes them in.

The numbers follow antirez's ds4 (``ds4_kvstore.c``; the eviction score as of
upstream commit ec6a82a, which added the anchor factor and the superseded
waypoint scale).  Where kvstore departs from ds4 the function says so in a
comment (docs/format.md §7 and §8 are the rules as implemented).
"""

import collections
import dataclasses
import heapq
import math
import numbers
import operator

import numpy as np

from kvstore.format import LOADABLE_ABIS, PREFIX_SIZE, Reason

# --- Defaults: each is ds4's compiled-in value (ds4_kvstore.c / ds4_kvstore.h).

# A checkpoint shorter than this is not worth a file: loading it saves less
# prefill than the disk read costs (ds4 KV_CACHE_DEFAULT_MIN_TOKENS).
DEFAULT_MIN_TOKENS = 512
# Cold checkpoints are written only for prompts up to this length; longer
# prompts are covered by continued waypoints (KV_CACHE_DEFAULT_COLD_MAX_TOKENS).
DEFAULT_COLD_MAX_TOKENS = 30000
# A continued waypoint every this many tokens of a long prefill, before
# rounding up to the alignment (KV_CACHE_DEFAULT_CONTINUED_INTERVAL_TOKENS).
DEFAULT_CONTINUED_INTERVAL_TOKENS = 10000
# Tokenizers may merge text across the prompt boundary, so the last few tokens
# of a live prefix are not stable (KV_CACHE_DEFAULT_BOUNDARY_TRIM_TOKENS).
DEFAULT_BOUNDARY_TRIM_TOKENS = 32
# ds4's prefill chunk size: a checkpoint cut on a chunk boundary restores to
# the same state as a cold prefill of the full prompt
# (KV_CACHE_DEFAULT_BOUNDARY_ALIGN_TOKENS).
DEFAULT_BOUNDARY_ALIGN_TOKENS = 2048
# Hits are evidence only while the workload still resembles the one that made
# them; they halve every six hours (DS4_KVSTORE_HIT_HALF_LIFE_SECONDS).
DEFAULT_HALF_LIFE = 6 * 3600
# A checkpoint nobody has used for this long goes before any other when the
# directory is over its budget, whatever its score: in a directory that many
# models share (docs/format.md §17) the files of a model tried once and
# dropped would otherwise keep their anchors' double score for ever.  30 days
# outlives a month's pause in a project, not a model nobody runs any more.
DEFAULT_STALE_AFTER_S = 30 * 24 * 3600
# Decayed hit counts below this are noise and count as zero
# (KV_CACHE_MIN_EFFECTIVE_HITS).
MIN_EFFECTIVE_HITS = 0.01
# Cold, evict and shutdown checkpoints are kept on purpose; a soft prior lets
# them outlive comparable waypoints while pressure and poor density can still
# evict them (KV_CACHE_ANCHOR_REASON_SCORE_FACTOR).
ANCHOR_SCORE_FACTOR = 2.0
# A continued waypoint that the incoming store supersedes is a routine stop on
# the same path: never-hit or stale ones become cheap victims, recently hit
# ones keep up to half their score (KV_CACHE_CONTINUED_PREFIX_MIN_FACTOR and
# KV_CACHE_CONTINUED_PREFIX_HIT_FACTOR).
SUPERSEDED_MIN_FACTOR = 0.05
SUPERSEDED_HIT_FACTOR = 0.45
# Headroom reserved on top of a file's exact size when checking it against the
# budget, so that accounting surprises cannot produce a file the next budget
# pass deletes at once (ds4 kv_cache_budget_required: 1%, rounded up).
BUDGET_SLACK_PERCENT = 1

# Sizes in the envelope are u64 (docs/format.md §2); ds4 refuses a file whose
# size does not fit, and so do we.
_U64_MAX = 2**64 - 1

_ANCHOR_REASONS = frozenset({Reason.COLD, Reason.EVICT, Reason.SHUTDOWN})


def _exp2(x):
    # ds4 decays with C exp2(); math.exp2 (Python 3.11+) calls the same libm
    # function, so scores match ds4 to the bit.
    return math.exp2(x) if hasattr(math, "exp2") else 2.0 ** x


@dataclasses.dataclass(frozen=True)
class Options:
    """Store-policy knobs (docs/format.md §7).  Defaults are ds4's.

    Attributes:
        min_tokens: shortest checkpoint worth storing.
        cold_max_tokens: longest prompt that gets a cold checkpoint.
        continued_interval_tokens: waypoint spacing before alignment; 0 turns
            continued waypoints off (as ds4).
        boundary_trim_tokens: tokens dropped off a live prefix before storing.
        boundary_align_tokens: store lengths and waypoints are multiples of
            this (>= 1; ds4's 0, "no alignment", is spelled 1 here).
        hit_half_life_s: seconds for a checkpoint's hit count to halve.
        stale_after_s: a checkpoint unused for this long is evicted before
            every fresher one when the directory is over its budget (None:
            by score alone).

    Raises:
        ValueError: a count is negative, the alignment is < 1 or the half-life
            is not > 0; the message names the field and the value.
        TypeError: a count is not an integer.
    """
    min_tokens: int = DEFAULT_MIN_TOKENS
    cold_max_tokens: int = DEFAULT_COLD_MAX_TOKENS
    continued_interval_tokens: int = DEFAULT_CONTINUED_INTERVAL_TOKENS
    boundary_trim_tokens: int = DEFAULT_BOUNDARY_TRIM_TOKENS
    boundary_align_tokens: int = DEFAULT_BOUNDARY_ALIGN_TOKENS
    hit_half_life_s: float = DEFAULT_HALF_LIFE
    stale_after_s: float = DEFAULT_STALE_AFTER_S

    def __post_init__(self):
        # ds4 validates none of these; a negative count or a zero alignment
        # there silently changes meaning, so we refuse them instead.
        for field in ("min_tokens", "cold_max_tokens", "continued_interval_tokens",
                      "boundary_trim_tokens", "boundary_align_tokens"):
            value = getattr(self, field)
            if isinstance(value, bool):
                raise TypeError(f"Options.{field}={value!r} is not an integer")
            try:
                value = operator.index(value)
            except TypeError:
                raise TypeError(f"Options.{field}={value!r} is not an integer") from None
            if value < 0:
                raise ValueError(f"Options.{field}={value} must be >= 0")
            object.__setattr__(self, field, value)
        if self.boundary_align_tokens < 1:
            raise ValueError(
                f"Options.boundary_align_tokens={self.boundary_align_tokens} must be >= 1")
        half_life = self.hit_half_life_s
        if isinstance(half_life, bool) or not isinstance(half_life, numbers.Real):
            raise TypeError(f"Options.hit_half_life_s={half_life!r} is not a number")
        if not half_life > 0:           # also refuses NaN
            raise ValueError(f"Options.hit_half_life_s={half_life} must be > 0")
        stale = self.stale_after_s
        if stale is not None:
            if isinstance(stale, bool) or not isinstance(stale, numbers.Real):
                raise TypeError(f"Options.stale_after_s={stale!r} is not a number or None")
            if not stale > 0:
                raise ValueError(f"Options.stale_after_s={stale} must be > 0 (or None)")


DEFAULT_OPTIONS = Options()


def _check_count(name, value):
    if value < 0:
        raise ValueError(f"{name}={value} must be >= 0")


# --- Store policy (docs/format.md §7)

def store_len(tokens, options=DEFAULT_OPTIONS):
    """How many tokens of a live prefix to store.

    Trim ``boundary_trim_tokens`` off the end (the tokenizer may still merge
    them with what follows), then round down to a multiple of
    ``boundary_align_tokens``.  If that leaves fewer than ``min_tokens``, the
    trimmed-and-aligned cut is useless and the full length is stored instead.
    With the defaults: 5000 -> 4096, 2080 -> 2048, 2079 -> 2079, 300 -> 300.

    Args:
        tokens: length of the live prefix.
        options: the store policy.

    Returns:
        the number of tokens to store (``tokens`` itself when no cut applies).

    Raises:
        ValueError: tokens is negative.
    """
    _check_count("tokens", tokens)
    trim = options.boundary_trim_tokens
    align = options.boundary_align_tokens
    # Only a prefix longer than min + trim can be trimmed and still be
    # worth storing (ds4 checks this first, and so keeps its int math
    # away from negative remainders).
    if tokens > options.min_tokens + trim:
        stable = tokens - trim
        stable -= stable % align
        if stable >= options.min_tokens:
            return stable
    return tokens


def chat_anchor_pos(token_ids, user_id, assistant_id, options=DEFAULT_OPTIONS):
    """Where to cut a cold checkpoint so that independent sessions share it.

    The stable part of a rendered chat is everything before the user message
    that asks this particular task.  Some clients put stable user-role
    scaffolding first, so the cut is the *last* user marker before the *first*
    assistant marker (ds4's rule).  A position under ``min_tokens`` is not
    worth a checkpoint and gives no anchor.

    Args:
        token_ids: the prompt's token ids: a list, tuple, any sequence of ints,
            or a 1-D numpy array (searched without a Python loop).
        user_id: the user-turn marker token; negative when the model has none.
        assistant_id: the assistant-turn marker token; negative when none.
        options: the store policy (``min_tokens``).

    Returns:
        the index of that user marker (so the checkpoint holds the tokens
        before it), or -1 when there is no anchor.
    """
    if token_ids is None or user_id < 0 or assistant_id < 0:
        return -1
    if isinstance(token_ids, np.ndarray) or hasattr(token_ids, "__array__"):
        last_user = _last_user_before_assistant_array(np.asarray(token_ids), user_id,
                                                      assistant_id)
    else:
        last_user = _last_user_before_assistant(token_ids, user_id, assistant_id)
    return last_user if last_user >= options.min_tokens else -1


def _last_user_before_assistant(token_ids, user_id, assistant_id):
    last_user = -1
    for i, token in enumerate(token_ids):
        if token == assistant_id:
            break
        if token == user_id:
            last_user = i
    return last_user


def _fits_dtype(array, value):
    if array.dtype.kind in "iu":
        info = np.iinfo(array.dtype)
        return info.min <= value <= info.max
    return True


def _last_user_before_assistant_array(array, user_id, assistant_id):
    array = array.reshape(-1)
    if array.size == 0:
        return -1
    # An id the dtype cannot hold cannot occur in the array; comparing with it
    # would overflow (or raise) on some numpy versions.
    end = array.size
    if _fits_dtype(array, assistant_id):
        is_assistant = array == assistant_id
        first = int(is_assistant.argmax())
        if is_assistant[first]:
            end = first
    if end == 0 or not _fits_dtype(array, user_id):
        return -1
    users = np.flatnonzero(array[:end] == user_id)
    return int(users[-1]) if users.size else -1


def continued_step(options=DEFAULT_OPTIONS):
    """Spacing of continued waypoints: the interval rounded up to the alignment.

    Rounding up keeps every waypoint on a prefill-chunk boundary; with the
    defaults 10000 becomes 10240.

    Args:
        options: the store policy.

    Returns:
        the step in tokens, or 0 when continued waypoints are off
        (``continued_interval_tokens`` is 0).
    """
    interval = options.continued_interval_tokens
    if interval <= 0:
        return 0
    align = options.boundary_align_tokens
    return -(-interval // align) * align


def continued_store_target(live_tokens, last_store_tokens, options=DEFAULT_OPTIONS):
    """Whether a long prefill that has reached ``live_tokens`` stores a waypoint now.

    A waypoint is written when the live length is an exact multiple of
    :func:`continued_step`, at least ``min_tokens``, and beyond the longest
    checkpoint this session already stored (so a cold store that landed on the
    frontier suppresses the waypoint there).

    Args:
        live_tokens: tokens prefilled so far.
        last_store_tokens: length of the longest checkpoint stored for this
            live session so far (0 when none).
        options: the store policy.

    Returns:
        the number of tokens to store (``live_tokens``), or 0 for none.

    Raises:
        ValueError: a count is negative.
    """
    _check_count("live_tokens", live_tokens)
    _check_count("last_store_tokens", last_store_tokens)
    step = continued_step(options)
    if step <= 0:
        return 0
    if live_tokens < options.min_tokens:
        return 0
    if live_tokens % step != 0:
        return 0
    if live_tokens <= last_store_tokens:
        return 0
    return live_tokens


# --- Eviction and budget (docs/format.md §8)

def is_anchor(reason):
    """True for checkpoints kept on purpose: reasons cold, evict and shutdown.

    Args:
        reason: a :class:`kvstore.Reason` or its integer value.

    Returns:
        bool.
    """
    return reason in _ANCHOR_REASONS


def effective_hits(hits, last_used, created_at, now, half_life_s):
    """A checkpoint's hit count, decayed by the time since it was last useful.

    ``t`` is ``last_used``, or ``created_at`` for a file never hit.  A file
    with no time at all has no evidence (0).  A file used "in the future"
    (clock skew) keeps its raw count.  Otherwise the count halves every
    ``half_life_s`` seconds and drops to 0 under 0.01.

    Args:
        hits: the header's hit count.
        last_used: unix seconds of the last hit (0: never).
        created_at: unix seconds the file was written (0: unknown).
        now: unix seconds.
        half_life_s: seconds for the count to halve.

    Returns:
        float.
    """
    t = last_used or created_at
    if t == 0:
        return 0.0
    if now <= t:
        return float(hits)
    decayed = float(hits) * _exp2(-float(now - t) / float(half_life_s))
    return 0.0 if decayed < MIN_EFFECTIVE_HITS else decayed


def eviction_score(entry, now, superseded=False, protected=False,
                   half_life_s=DEFAULT_HALF_LIFE):
    """How much a checkpoint is worth keeping; the lowest score is deleted first.

    ``(effective_hits + 1) * tokens / file_size``: tokens saved per byte of
    disk, weighted by recent use.  Anchors (cold, evict, shutdown) count
    double.  A continued waypoint that the incoming store supersedes is scaled
    by ``0.05 + 0.45 * h / (h + 1)`` (h its effective hits): a never-hit one
    keeps 5 %, a busy one up to half.

    Args:
        entry: anything with ``hits``, ``last_used``, ``created_at``,
            ``tokens``, ``file_size`` and ``reason`` (a :class:`kvstore.Entry`).
        now: unix seconds.
        superseded: the caller found the entry's text a strict byte prefix of
            the incoming checkpoint's text, and the incoming one at least as
            widely reusable (same model, context <= the entry's, same quant
            when quant matters).  Applies only to reason continued, as in ds4.
        protected: the entry is the file just written; it scores infinity.
        half_life_s: hit half-life in seconds.

    Returns:
        float; 0.0 for an empty or unreadable file (file_size <= 0), inf for a
        protected one.
    """
    # Empty or unreadable files go first, protected or not (ds4 tests the
    # size before the protected sha).
    if entry.file_size <= 0:
        return 0.0
    if protected:
        # ds4 returned DBL_MAX for the just-renamed file; later ds4 evicts room
        # *before* writing instead.  kvstore keeps the "never the victim" rule.
        return math.inf
    hits = effective_hits(entry.hits, entry.last_used, entry.created_at, now, half_life_s)
    score = (hits + 1.0) * float(entry.tokens) / float(entry.file_size)
    if is_anchor(entry.reason):
        score *= ANCHOR_SCORE_FACTOR
    # ds4 decides "superseded" inside the score (it hashes the incoming text);
    # here the caller, which has the text, decides and passes a flag.
    if superseded and entry.reason == Reason.CONTINUED:
        share = hits / (hits + 1.0) if hits > 0.0 else 0.0
        score *= SUPERSEDED_MIN_FACTOR + SUPERSEDED_HIT_FACTOR * share
    return score


def file_size_fits(text_bytes, payload_bytes, trailer_bytes, budget_bytes):
    """Whether a checkpoint of these parts may be written under the budget.

    The file is the 52-byte prefix (header + text length) plus text, payload
    and trailer.  It fits when that size plus 1 % of it (rounded up) is within
    the budget, so filesystem accounting cannot push a just-written file
    straight back out.  A budget of 0 means unlimited, as ds4's
    ``budget_bytes == 0``; any size still has to fit the envelope's u64.

    Args:
        text_bytes: length of the prompt text.
        payload_bytes: length of the payload.
        trailer_bytes: length of the trailer (0 when none).
        budget_bytes: the directory budget in bytes; 0 for unlimited.

    Returns:
        bool.

    Raises:
        ValueError: a size or the budget is negative (ds4's are unsigned; a
            negative budget is refused rather than read as unlimited).
    """
    for name, value in (("text_bytes", text_bytes), ("payload_bytes", payload_bytes),
                        ("trailer_bytes", trailer_bytes), ("budget_bytes", budget_bytes)):
        _check_count(name, value)
    return bytes_fit(PREFIX_SIZE + text_bytes + payload_bytes + trailer_bytes, budget_bytes)


def bytes_fit(file_bytes, budget_bytes):
    """Whether file_bytes of new files (one, or the blocks of a chained save)
    may be written under the budget: with 1 % slack, as file_size_fits.

    Args:
        file_bytes: the bytes the new files take in all.
        budget_bytes: the directory budget in bytes; 0 for unlimited.

    Returns:
        bool.
    """
    _check_count("file_bytes", file_bytes)
    _check_count("budget_bytes", budget_bytes)
    if file_bytes > _U64_MAX:
        return False
    if budget_bytes == 0:
        return True
    required = file_bytes + -(-file_bytes * BUDGET_SLACK_PERCENT // 100)
    if required > _U64_MAX:
        return False
    return required <= budget_bytes


def _used_at(entry):
    return entry.last_used or entry.created_at


def _named_in(entry, names):
    return getattr(entry, "sha", None) in names or getattr(entry, "name", None) in names


def eviction_order(entries, now, superseded=frozenset(), protected=frozenset(),
                   half_life_s=DEFAULT_HALF_LIFE, stale_after_s=None):
    """Every entry in the order eviction deletes them: the next victim first.

    Stale entries (unused for more than stale_after_s; an entry without
    any time is not) go first, the one used longest ago first.  Then the lowest :func:`eviction_score` goes
    first; on a tie, the one used longest ago (``last_used``, or
    ``created_at`` when never hit); on a further tie, the earlier in
    ``entries``.  Protected entries (the file just written) come after all
    the others, in the same order among themselves.  Scores do not change
    as victims go, so this one ordering serves the store, the command
    line's dry run and the bucket's janitor.

    Args:
        entries: candidate entries (:class:`kvstore.Entry` or alike).
        now: unix seconds.
        superseded: shas of continued waypoints the incoming store supersedes.
        protected: shas (or file names) to keep while others remain.
        half_life_s: hit half-life in seconds.
        stale_after_s: Options.stale_after_s (None: no stale rule).

    Returns:
        list of the entries.
    """
    # ds4 breaks ties on the raw last_used, so there a never-hit file (0)
    # loses every tie however new it is; this module uses the same time the
    # decay uses, t = last_used or created_at.
    def rank(indexed):
        index, entry = indexed
        used = _used_at(entry)
        if stale_after_s is not None and used and now - used > stale_after_s:
            return (_named_in(entry, protected), False, used, 0.0, index)
        score = eviction_score(entry, now, superseded=_named_in(entry, superseded),
                               half_life_s=half_life_s)
        return (_named_in(entry, protected), True, score, used, index)

    entries = list(entries)
    # A chain block another entry continues waits until that entry has gone:
    # chains go leaves first, never cut in the middle (docs/format.md §14).
    present = {getattr(e, "sha", None) for e in entries}
    waiting = collections.Counter(e.parent for e in entries
                                  if getattr(e, "parent", "") and e.parent in present)
    if not waiting:
        return [e for _, e in sorted(enumerate(entries), key=rank)]
    by_sha = {e.sha: (i, e) for i, e in enumerate(entries) if getattr(e, "sha", None)}
    heap = [(rank(ie), ie[0]) for ie in enumerate(entries) if waiting[getattr(ie[1], "sha", None)] == 0]
    heapq.heapify(heap)
    out = []
    while heap:
        _, i = heapq.heappop(heap)
        e = entries[i]
        out.append(e)
        parent = getattr(e, "parent", "")
        if parent in waiting:
            waiting[parent] -= 1
            if waiting[parent] == 0:
                heapq.heappush(heap, (rank(by_sha[parent]), by_sha[parent][0]))
    return out


def select_victims(entries, budget_bytes, now, superseded=frozenset(), protected=frozenset(),
                   half_life_s=DEFAULT_HALF_LIFE, kept_bytes=0, stale_after_s=None):
    """The entries to delete, in order, until the rest fit the budget.

    Args:
        entries: the candidates (``file_size`` each); all count for the budget.
        budget_bytes: the budget; 0 means unlimited (nothing is selected).
        now, superseded, protected, half_life_s, stale_after_s: as :func:`eviction_order`.
        kept_bytes: bytes that count for the budget but are never candidates.

    Returns:
        list of victims, the first to delete first.
    """
    entries = list(entries)
    total = kept_bytes + sum(e.file_size for e in entries)
    victims = []
    if not budget_bytes:
        return victims
    for e in eviction_order(entries, now, superseded, protected, half_life_s, stale_after_s):
        if total <= budget_bytes:
            break
        victims.append(e)
        total -= e.file_size
    return victims


def pick_victim(entries, now, superseded=frozenset(), protected=frozenset(),
                half_life_s=DEFAULT_HALF_LIFE):
    """The entry to delete next (the head of :func:`eviction_order`), or None when none."""
    order = eviction_order(entries, now, superseded, protected, half_life_s)
    return order[0] if order else None


def snapshot_every_block(tensors, positional, tokens, block_tokens):
    """Whether a chained store should take the state's snapshots at every block
    boundary, not only at anchors, waypoints and tails (docs/format.md §14).

    A snapshot (a sliding window, a recurrent state) is only ever whole where
    it was captured, so a block without one is a link, not a hit.  Taking
    it at every block costs its bytes each time: worth it when the snapshots
    are no bigger than the positional bytes a block holds anyway.

    Args:
        tensors: name -> array (anything with nbytes) of the whole state.
        positional: name -> axis of the tensors that grow with the tokens.
        tokens: the tokens the state holds.
        block_tokens: the chain grid.

    Returns:
        bool; False when there are no snapshots (every block is a hit anyway).
    """
    snapshot = sum(int(a.nbytes) for k, a in tensors.items() if k not in positional)
    if not snapshot or not tokens:
        return False
    per_block = sum(int(a.nbytes) for k, a in tensors.items() if k in positional) * block_tokens // tokens
    return snapshot <= per_block


# --- The SSD write budget (docs/format.md §15)
#
# KVStore(max_write_mb_per_hour=N) keeps a token bucket of one hour's bytes
# (kvstore.counters has its arithmetic).  When it runs low, saves are
# skipped in order of value: each reason may only spend the bucket down to
# its floor, a share of the capacity.  A save that would leave less is
# skipped; the bytes left below a floor stay for the reasons with a lower
# one.  kvstore has no ds4 number to follow here; the order is the §7 one
# of what a lost checkpoint costs to rebuild:
#   - cold and agent-system anchors (0): the shared prefix every request
#     starts from, written once and hit most; skipped last, only when the
#     bucket cannot pay for them at all;
#   - agent sessions (0.1): switched back to by name, never rebuilt by
#     lookup, but one user's;
#   - shutdown states (0.25): what a restart resumes; written in bursts at
#     exit, so they keep a quarter for what follows;
#   - continued waypoints and evict states (0.5), and unknown reasons:
#     stops on a path a later save of the same session covers again;
#     skipped first, keeping half the bucket for the others.
WRITE_BUDGET_FLOORS = {
    Reason.COLD: 0.0,
    Reason.AGENT_SYSTEM: 0.0,
    Reason.AGENT_SESSION: 0.1,
    Reason.SHUTDOWN: 0.25,
    Reason.EVICT: 0.5,
    Reason.CONTINUED: 0.5,
    Reason.UNKNOWN: 0.5,
}


def write_budget_floor(reason):
    """The share of the write budget's capacity a save of this reason must leave.

    Args:
        reason: a :class:`kvstore.Reason` or its integer value (an unknown
            value counts as UNKNOWN).

    Returns:
        a float in [0, 1].
    """
    try:
        return WRITE_BUDGET_FLOORS[Reason(reason)]
    except ValueError:
        return WRITE_BUDGET_FLOORS[Reason.UNKNOWN]


def write_allowed(reason, nbytes, available_bytes, capacity_bytes):
    """Whether a save may write nbytes out of the write budget now.

    It may when the bucket keeps at least its reason's floor
    (write_budget_floor) times the capacity after it.

    Args:
        reason: the save's :class:`kvstore.Reason`.
        nbytes: the bytes it would write (a chained save: its new blocks only).
        available_bytes: the bucket's level now.
        capacity_bytes: the bucket's capacity (one hour's bytes).

    Returns:
        bool.
    """
    _check_count("nbytes", nbytes)
    return available_bytes - nbytes >= write_budget_floor(reason) * capacity_bytes


# --- Which checkpoints an engine can load

def misfit(entry, model_id, ctx_size=None, quant_bits=None, reject_different_quant=False, abis=LOADABLE_ABIS,
           key_id=None, model_tag=0, accept_untagged=False):
    """Why a checkpoint cannot be loaded by an engine, or None when it fits.

    A checkpoint fits when its payload ABI is one this build loads, it was
    made by the same model (its model tag, docs/format.md §17) and model
    id, with a context no larger than the engine's (None: no limit), and,
    only when quant is part of the match, with the same quant bits
    (docs/format.md §4 and §7).

    Args:
        entry: a :class:`kvstore.Entry` (or anything with its header fields).
        model_id, ctx_size, quant_bits, reject_different_quant: the engine's.
        abis: the payload ABIs the store loads (a store with a key: the sealed
            ones, and the plain ones only when it accepts unsealed files).
        key_id: the store key's id: a sealed file of another key is foreign.
        model_tag: the engine's model tag (0: none); a file of another
            model is foreign.
        accept_untagged: a file that names no model (tag 0) fits too.

    Returns:
        None, or one of "payload_abi", "key", "model", "model_id", "ctx_size", "quant_bits".
    """
    if entry.payload_abi not in abis:
        return "payload_abi"
    if getattr(entry, "key_id", b"") and entry.key_id != key_id:
        return "key"
    tag = getattr(entry, "model_tag", 0)
    if tag != model_tag and not (tag == 0 and accept_untagged):
        return "model"
    if entry.model_id != model_id:
        return "model_id"
    if ctx_size is not None and entry.ctx_size > ctx_size:
        return "ctx_size"
    if reject_different_quant and entry.quant_bits != quant_bits:
        return "quant_bits"
    return None
