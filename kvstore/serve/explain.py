"""The miss explained: where a request's prompt left what the store holds.

A prompt that reuses less than its client expected (ollama #18267: a 65k
agent prompt cold again because one id in its system message changed) gets
an answer in its `usage.kvstore.miss` and its request log line:

    {"byte": 5123, "token": 1281, "message": 0, "role": "system",
     "shared_tokens": 1280, "stored_tokens_after": 14950}

byte and token: where the prompt's rendered text first differs from the
longest stored sequence that shares at least its first block (in the
rendered prompt, without a tenant's key prefix); message and role: the chat
message that byte falls in (None in the generation prompt); shared_tokens:
the deepest stored block's end before it; stored_tokens_after: how many
stored tokens that sequence held past the point (what the change cost).
Absent when nothing stored shares the first block, or when the prompt
only goes on past the end of what is stored (an ordinary next turn).
Offsets, counts and a role name; never text.
"""

import numpy as np

from kvstore.divergence import common_prefix
from kvstore import tenants

# The role names a log line may show; any other is "other" (a role is the client's string).
ROLES = ("system", "developer", "user", "assistant", "tool")


def message_at(text, byte, render, count):
    """The index of the message whose rendering holds text[byte], or None
    (the generation prompt); render(n) is the text of the first n messages.
    A binary search: log2(count) renderings."""
    lo, hi = 0, count                     # render(lo) ends at or before byte; find the first n that passes it
    if count == 0 or common_prefix(render(count).encode("utf-8", "surrogatepass"), text) <= byte:
        return None
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if common_prefix(render(mid).encode("utf-8", "surrogatepass"), text) > byte:
            hi = mid
        else:
            lo = mid
    return hi - 1


def explain(tier, tokens, tenant, messages=None, render=None):
    """The `miss` object of a prompt (module docstring), or None.

    Args:
        tier: the TieredPromptCache (its store, key bytes and key offsets).
        tokens: the prompt's token ids.
        tenant: its tenant tag, or None.
        messages: a chat request's messages, or None.
        render: callable n -> the text of the first n messages (with messages).
    """
    key = tier.key_bytes(tokens, tenant)
    d = tier.store.explain(key)
    if d is None or not d.parted:
        return None
    head = len(tenants.key_prefix(tenant))
    offsets = tier.key_offsets(tokens, tenant, len(key))
    token = None if offsets is None else int(np.searchsorted(offsets, d.byte, side="right")) - 1
    out = {"byte": d.byte - head, "token": token, "message": None, "role": None,
           "shared_tokens": d.shared_tokens,
           "stored_tokens_after": d.stored_tokens - (token if token is not None else d.shared_tokens)}
    if messages:
        i = message_at(key[head:], d.byte - head, render, len(messages))
        if i is not None:
            out["message"], out["role"] = i, messages[i].get("role")
    return out


def log_words(miss):
    """The request log line's view of a miss: numbers and a known role name only."""
    if miss is None:
        return "-"
    role = miss["role"] if miss["role"] in ROLES else ("-" if miss["role"] is None else "other")
    return f"byte:{miss['byte']},token:{miss['token']},message:{miss['message']},role:{role}," \
           f"after:{miss['stored_tokens_after']}"
