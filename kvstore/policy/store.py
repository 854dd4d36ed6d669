"""The store policy (docs/semantics.md §7, docs/format.md §14) as pure functions: what to store, where, why.

Every rule that decides a store lives here once, and both callers apply
it: PromptCache (kvstore.prompt_cache: one live session, a chunked prefill)
and the disk tier of kvstore serve (kvstore.serve.tier: mlx-lm's prompt
segments and RAM entries).  A caller turns what happens into targets, then
each target and the state into a token count:

    a prefill reaches pos    prefill_stores: the cold anchor, a continued
                             waypoint, or a block-grid snapshot, in order
    a request finished       finished_stores: its whole blocks (chains)
    a state leaves memory    leaving_stores: evict or shutdown, cut after the
                             prompt of the request it finished
    target + state           store_cut: how many tokens, or 0 when none are
                             worth a file (under min_tokens, or a cut the
                             state cannot take)

plus the cold target of a request (cold_target, over chat_anchor_pos and
store_len) and the session's last stored count (last_store_after).  The
numbers are ds4's (``ds4_kvstore.c``); nothing here does I/O or keeps state.
"""

import dataclasses

import numpy as np

from kvstore.format import Reason
from kvstore.settings import DEFAULT_SETTINGS, check_count


def store_len(tokens, settings=DEFAULT_SETTINGS):
    """How many tokens of a live prefix to store.

    Trim ``boundary_trim_tokens`` off the end (the tokenizer may still merge
    them with what follows), then round down to a multiple of
    ``boundary_align_tokens``.  If that leaves fewer than ``min_tokens``, the
    trimmed-and-aligned cut is useless and the full length is stored instead.
    With the defaults: 5000 -> 4096, 2080 -> 2048, 2079 -> 2079, 300 -> 300.

    Args:
        tokens: length of the live prefix.
        settings: the store's kvstore.Settings (its policy fields).

    Returns:
        the number of tokens to store (``tokens`` itself when no cut applies).

    Raises:
        ValueError: tokens is negative.
    """
    check_count("tokens", tokens)
    trim = settings.boundary_trim_tokens
    align = settings.boundary_align_tokens
    # Only a prefix longer than min + trim can be trimmed and still be
    # worth storing (ds4 checks this first, and so keeps its int math
    # away from negative remainders).
    if tokens > settings.min_tokens + trim:
        stable = tokens - trim
        stable -= stable % align
        if stable >= settings.min_tokens:
            return stable
    return tokens


def chat_anchor_pos(token_ids, user_id, assistant_id, settings=DEFAULT_SETTINGS):
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
        settings: the store's kvstore.Settings (its policy fields) (``min_tokens``).

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
    return last_user if last_user >= settings.min_tokens else -1


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


def continued_step(settings=DEFAULT_SETTINGS):
    """Spacing of continued waypoints: the interval rounded up to the alignment.

    Rounding up keeps every waypoint on a prefill-chunk boundary; with the
    defaults 10000 becomes 10240.

    Args:
        settings: the store's kvstore.Settings (its policy fields).

    Returns:
        the step in tokens, or 0 when continued waypoints are off
        (``continued_interval_tokens`` is 0).
    """
    interval = settings.continued_interval_tokens
    if interval <= 0:
        return 0
    align = settings.boundary_align_tokens
    return -(-interval // align) * align


def continued_store_target(live_tokens, last_store_tokens, settings=DEFAULT_SETTINGS):
    """Whether a long prefill that has reached ``live_tokens`` stores a waypoint now.

    A waypoint is written when the live length is an exact multiple of
    :func:`continued_step`, at least ``min_tokens``, and beyond the longest
    checkpoint this session already stored (so a cold store that landed on the
    frontier suppresses the waypoint there).

    Args:
        live_tokens: tokens prefilled so far.
        last_store_tokens: length of the longest checkpoint stored for this
            live session so far (0 when none).
        settings: the store's kvstore.Settings (its policy fields).

    Returns:
        the number of tokens to store (``live_tokens``), or 0 for none.

    Raises:
        ValueError: a count is negative.
    """
    check_count("live_tokens", live_tokens)
    check_count("last_store_tokens", last_store_tokens)
    step = continued_step(settings)
    if step <= 0:
        return 0
    if live_tokens < settings.min_tokens:
        return 0
    if live_tokens % step != 0:
        return 0
    if live_tokens <= last_store_tokens:
        return 0
    return live_tokens


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


# --- What to store, where, and why: the decisions PromptCache and kvstore serve share

# The kinds of StoreTarget.
ANCHOR = "anchor"          # the cold anchor of a request: reason cold
WAYPOINT = "waypoint"      # a continued waypoint of a long prefill
SNAPSHOT = "snapshot"      # a block-grid snapshot of a chained store (docs/format.md §14), when snapshots are cheap
BLOCKS = "blocks"          # the whole blocks of a finished request (chains)
LEAVING = "leaving"        # a state that leaves memory: evict or shutdown
PIN = "pin"                # a prefix a request pinned (docs/semantics.md §19): exactly its tokens


@dataclasses.dataclass(frozen=True)
class StoreTarget:
    """One store a caller may make now: why, and how the state may be cut for it.

    Attributes:
        reason: the checkpoint's :class:`kvstore.format.Reason`.
        kind: ANCHOR, WAYPOINT, SNAPSHOT, BLOCKS or LEAVING.
        prefer: store only this many tokens when the state can be cut
            there; a state that cannot is stored whole (None: no cut).
        grid: store whole multiples of this many tokens only; a state that
            cannot be cut there is not stored (0: no grid).
    """
    reason: Reason
    kind: str
    prefer: int = None
    grid: int = 0


def cold_target(prompt_tokens, anchor, settings=DEFAULT_SETTINGS):
    """Where a cold request stores its cold checkpoint (docs/semantics.md §7).

    At the anchor when there is one, else at the store length of the whole
    prompt.  A prompt longer than ``cold_max_tokens`` gets none: continued
    waypoints cover it.  (kvstore serve has no marker search: mlx-lm's system
    segment is its anchor, see prefill_stores.)

    Args:
        prompt_tokens: the prompt's length in tokens.
        anchor: :func:`chat_anchor_pos` of the prompt (<= 0: no anchor).
        settings: the store's kvstore.Settings (its policy fields).

    Returns:
        the target in tokens (the prefill stops there; under ``min_tokens``
        nothing is stored at it), or 0 for none.
    """
    if not 0 < prompt_tokens <= settings.cold_max_tokens:
        return 0
    return anchor if anchor > 0 else store_len(prompt_tokens, settings)


def prefill_stores(pos, settings=DEFAULT_SETTINGS, cold_target=0, last_store=0, block_tokens=0):
    """What to store when a prefill has reached pos tokens, best first.

    The caller stores the first target it can and stops there: a cold
    anchor that fails to store leaves the waypoint to be tried.

      - the cold anchor, when pos is the request's cold target (kvstore
        serve: the end of mlx-lm's system segment) and >= ``min_tokens``;
      - a continued waypoint (:func:`continued_store_target`);
      - else, on a chained store's block grid and >= ``min_tokens``, a
        snapshot: a state that does not decompose by position (a window, a
        recurrent state) is only whole where it was captured, so where its
        snapshots are cheap (:func:`snapshot_every_block`, which the caller
        holding the state asks) every block boundary gets one (docs/format.md §14).

    Args:
        pos: the tokens prefilled so far.
        settings: the store's kvstore.Settings (its policy fields).
        cold_target: the request's cold target (0: none).
        last_store: the session's last stored count (:func:`last_store_after`).
        block_tokens: the chain grid of a chained store that takes block
            snapshots (0: none).

    Returns:
        list of StoreTarget.
    """
    out = []
    if cold_target and pos == cold_target and pos >= settings.min_tokens:
        out.append(StoreTarget(Reason.COLD, ANCHOR))
    if continued_store_target(pos, last_store, settings):
        out.append(StoreTarget(Reason.CONTINUED, WAYPOINT))
    elif block_tokens and pos % block_tokens == 0 and pos >= settings.min_tokens:
        out.append(StoreTarget(Reason.CONTINUED, SNAPSHOT))
    return out


def last_store_after(last_store, pos, target):
    """The session's last stored count once target was stored at pos.

    An anchor or a waypoint raises it (so an anchor on a waypoint's frontier
    suppresses the waypoint); a block snapshot leaves it.
    """
    return max(last_store, pos) if target.kind in (ANCHOR, WAYPOINT) else last_store


def finished_stores(block_tokens):
    """What a chained store keeps when a request finishes (its prompt and answer).

    Their whole blocks: after a restart a prompt that leaves the
    conversation anywhere reuses it up to the last block boundary before it.

    Args:
        block_tokens: the chain grid; 0 for a store without chains.

    Returns:
        list of StoreTarget (empty without chains).
    """
    return [StoreTarget(Reason.CONTINUED, BLOCKS, grid=block_tokens)] if block_tokens else []


def pin_target(tokens):
    """The store a pinned prefix of this many tokens asks for: exactly those
    tokens, whatever the other rules would choose (docs/semantics.md §19).  A
    state that holds more is cut there when it can be (positional); the
    caller stores nothing when the cut is not exactly the prefix."""
    return StoreTarget(Reason.COLD, PIN, prefer=tokens)


def finished_tail(n, prompt_tokens):
    """Where to cut the n-token state of a finished request that leaves memory.

    After its prompt's last token but one: a request that repeats the
    prompt, or continues the conversation whatever text the answer is
    rendered as, reuses everything up to there (the server prefills at
    least the last token).

    Returns:
        the cut, or None (no finished request: prompt_tokens 0; or the cut
        is not inside the state).
    """
    cut = prompt_tokens - 1
    return cut if 0 < cut < n else None


def leaving_stores(reason, n, prompt_tokens=0):
    """What to store of an n-token state that leaves memory (reason evict or shutdown).

    Args:
        reason: Reason.EVICT or Reason.SHUTDOWN.
        n: the tokens the state holds.
        prompt_tokens: the prompt length of the request whose answer the
            state ends with (0: none); see :func:`finished_tail`.

    Returns:
        list of one StoreTarget.
    """
    return [StoreTarget(Reason(reason), LEAVING, prefer=finished_tail(n, prompt_tokens))]


def store_cut(n, settings=DEFAULT_SETTINGS, positional=True, prefer=None, grid=0, limit=None):
    """How many tokens of an n-token state to store; 0 when nothing is worth a file.

    A positional state (every tensor one row per token) can be cut
    anywhere.  Any other holds a snapshot that is whole only where it was
    captured: a preferred cut then stores it whole, and a required one (the
    grid, a limit) not at all.  Nothing under ``min_tokens`` is stored.

    Args:
        n: the tokens the state holds.
        settings: the store's kvstore.Settings (its policy fields).
        positional: the state can be cut anywhere.
        prefer: a preferred cut (StoreTarget.prefer).
        grid: store whole multiples of this only (StoreTarget.grid).
        limit: store at most this many (kvstore serve's admission).

    Returns:
        the tokens to store: n, a cut below it, or 0.

    Raises:
        ValueError: n is negative.
    """
    check_count("n", n)
    cut = n
    if prefer is not None and positional:
        cut = min(cut, prefer)
    if grid:
        cut = cut // grid * grid
    if limit is not None:
        cut = min(cut, max(limit, 0))
    if cut < n and not positional:
        return 0
    return cut if cut >= settings.min_tokens else 0
