"""Where a prompt leaves what is stored: the explanation of a partial miss.

A lookup answers how much of a prompt is stored.  When that is less than
the user expected (one id in a system prompt differs, a tool output was cut,
a template renders history differently), the question is where the prompt
parted from what was stored before, and how much it threw away.

From the deepest stored block whose text is a prefix of the prompt, the
blocks that follow it in the chains hold the text that other requests
continued with.  Each one's own text segment is compared with the prompt's
next bytes; the longest agreement is where the prompt left the longest
stored sequence, and the longest chain below that block says how much was
stored past that point.  One SHA1 pass and one short read per following
block (at most MAX_FOLLOWERS, longest chains first); prompt text never
leaves the process: the answer is offsets and counts.

Whole-layout files have no chains: there the answer is where the longest
stored prefix ends, with nothing known to follow it.
"""

import contextlib
import dataclasses

# Blocks that follow the shared one read for their text, at most: a system
# prompt's last shared block may be followed by one block per conversation
# that began with it; the longest chains are read first, as the sequence a
# returning client left is usually its own long one.
MAX_FOLLOWERS = 64


@dataclasses.dataclass(frozen=True)
class Divergence:
    """Where a prompt parts from the longest stored sequence that shares its first block.

    shared_bytes, shared_tokens: the deepest stored block that is a prefix of
        the prompt (its text length and tokens).
    byte: the prompt's first byte that the stored sequence does not continue
        with (shared_bytes <= byte).
    stored_bytes, stored_tokens: the longest stored sequence through that point.
    """
    shared_bytes: int
    shared_tokens: int
    byte: int
    stored_bytes: int
    stored_tokens: int

    @property
    def parted(self):
        """True when stored text went on past byte with something else (or past the prompt's end)."""
        return self.stored_bytes > self.byte


def common_prefix(a, b):
    """How many leading items (bytes, token ids) a and b share."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n            # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def divergence(index, data, segment, lock=contextlib.nullcontext()):
    """The Divergence of prompt bytes data in a directory, or None when no
    stored block is a prefix of data.  Found by name: one SHA1 pass.

    Args:
        index: the directory's kvstore.index.DirectoryIndex.
        data: the prompt bytes (a lookup key).
        segment: callable (Entry, n) -> the first n bytes of the block's own
            text, or None (kvstore.reader.read_segment).
        lock: what guards index (the store's directory lock).
    """
    with lock:
        index.refresh()
        shared = index.deepest_match(data)
        if shared is None:
            return None
        followers = index.kids_in_forest(shared.sha) if shared.is_block else []

    def longest_below(block):
        with lock:
            return index.longest_below(block.sha)
    return _parting(shared, followers, data, segment, longest_below)


def divergence_by_text(entries, data, segment):
    """divergence() found by reading stored text instead of by name: for a
    reader without the names' key (a directory of model-named files read
    without the model).  Reads the own text of every first block (and whole
    file), then of the blocks below each one that agrees with data."""
    kids = {}
    for e in entries:
        kids.setdefault(e.parent if e.is_block else "", []).append(e)

    def agrees(e):
        own = data[e.text_start:e.text_bytes] if e.is_block else data[:e.text_bytes]
        return e.text_bytes <= len(data) and segment(e, len(own) + 1) == own

    level, deepest = kids.get("", []), []
    while True:
        full = [e for e in level if agrees(e)]
        if not full:
            break               # level: the blocks below the deepest agreeing ones, none agreeing whole
        top = max(e.text_bytes for e in full)
        deepest = [e for e in full if e.text_bytes == top]
        level = [k for e in deepest if e.is_block for k in kids.get(e.sha, [])]
    if not deepest:
        return None

    def longest_below(block):
        todo, best, seen = [block], block, set()
        while todo:
            e = todo.pop()
            best = max(best, e, key=lambda x: x.tokens)
            seen.add(e.sha)
            todo += [k for k in kids.get(e.sha, []) if k.sha not in seen]
        return best
    return _parting(max(deepest, key=lambda e: e.tokens), level, data, segment, longest_below)


def _parting(shared, followers, data, segment, longest_below):
    """The Divergence from the deepest shared entry: its followers' own text
    against data's next bytes; longest_below(block) -> the longest chain's
    end at or below block."""
    rest = data[shared.text_bytes:]
    best, agreed = None, -1
    for block in sorted(followers, key=lambda e: -e.tokens)[:MAX_FOLLOWERS]:
        text = segment(block, len(rest) + 1)
        n = -1 if text is None else common_prefix(text, rest)
        if n > agreed:
            best, agreed = block, n
    if best is None:
        return Divergence(shared.text_bytes, shared.tokens, shared.text_bytes, shared.text_bytes, shared.tokens)
    longest = longest_below(best) or best
    return Divergence(shared.text_bytes, shared.tokens, shared.text_bytes + agreed, longest.text_bytes,
                      longest.tokens)
