"""Budgets (docs/semantics.md §8 and §15), and which checkpoints an engine can load.

The disk budget check (with ds4's 1 % slack), the SSD write budget's floors
per reason, and misfit: why a checkpoint cannot be loaded by an engine.
Pure functions: the caller passes the sizes, levels and header fields.
"""

from kvstore.format import LOADABLE_ABIS, PREFIX_SIZE, Reason
from kvstore.settings import (DEFAULT_BUDGET_MAX_BYTES, DEFAULT_BUDGET_MIN_BYTES, DEFAULT_BUDGET_SHARE,
                              check_count)

# Headroom reserved on top of a file's exact size when checking it against the
# budget, so that accounting surprises cannot produce a file the next budget
# pass deletes at once (ds4 kv_cache_budget_required: 1%, rounded up).
BUDGET_SLACK_PERCENT = 1

# Sizes in the envelope are u64 (docs/format.md §2); ds4 refuses a file whose
# size does not fit, and so do we.
_U64_MAX = 2**64 - 1


def default_budget_bytes(filesystem_bytes):
    """The disk budget of a directory whose filesystem holds filesystem_bytes
    (its size, not its free space): DEFAULT_BUDGET_SHARE of it, at least
    DEFAULT_BUDGET_MIN_BYTES, at most DEFAULT_BUDGET_MAX_BYTES."""
    check_count("filesystem_bytes", filesystem_bytes)
    share = int(filesystem_bytes * DEFAULT_BUDGET_SHARE)
    return min(max(share, DEFAULT_BUDGET_MIN_BYTES), DEFAULT_BUDGET_MAX_BYTES)


def over_half_budget(before_bytes, after_bytes, budget_bytes):
    """Whether a save took one chain from at most half the budget to over it
    (the chain would then evict everything else to be kept); never for an
    unlimited budget (0)."""
    return bool(budget_bytes) and before_bytes * 2 <= budget_bytes < after_bytes * 2


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
        check_count(name, value)
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
    check_count("file_bytes", file_bytes)
    check_count("budget_bytes", budget_bytes)
    if file_bytes > _U64_MAX:
        return False
    if budget_bytes == 0:
        return True
    required = file_bytes + -(-file_bytes * BUDGET_SLACK_PERCENT // 100)
    if required > _U64_MAX:
        return False
    return required <= budget_bytes


# --- The SSD write budget (docs/semantics.md §15)
#
# KVStore(max_write_mb_per_hour=N) keeps a token bucket of one hour's bytes
# (kvstore.counters has its arithmetic).  When it runs low, saves are
# skipped in order of value: each reason may only spend the bucket down to
# its floor, a share of the capacity.  A save that would leave less is
# skipped; the bytes left below a floor stay for the reasons with a lower
# one.  kvstore has no ds4 number to follow here; the order is the one of
# docs/semantics.md §7, of what a lost checkpoint costs to rebuild:
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
        reason: a :class:`kvstore.format.Reason` or its integer value (an unknown
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
        reason: the save's :class:`kvstore.format.Reason`.
        nbytes: the bytes it would write (a chained save: its new blocks only).
        available_bytes: the bucket's level now.
        capacity_bytes: the bucket's capacity (one hour's bytes).

    Returns:
        bool.
    """
    check_count("nbytes", nbytes)
    return available_bytes - nbytes >= write_budget_floor(reason) * capacity_bytes


# --- Which checkpoints an engine can load

def misfit(entry, model_id, ctx_size=None, quant_bits=None, reject_different_quant=False, abis=LOADABLE_ABIS,
           key_id=None, model_tag=0, accept_untagged=False):
    """Why a checkpoint cannot be loaded by an engine, or None when it fits.

    A checkpoint fits when its payload ABI is one this build loads, it was
    made by the same model (its model tag, docs/semantics.md §17) and model
    id, with a context no larger than the engine's (None: no limit), and,
    only when quant is part of the match, with the same quant bits
    (docs/semantics.md §4 and §7).

    Args:
        entry: a :class:`kvstore.format.Entry` (or anything with its header fields).
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
