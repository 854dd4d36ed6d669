"""Pins a request asks for: `cache_control` breakpoints on chat messages (docs/semantics.md §19).

A chat message, or one of its content parts, may carry the object
Anthropic-style clients already send:

    {"role": "system", "content": "...", "cache_control": {"type": "ephemeral", "ttl": "1h"}}

The prompt's prefix that ends with that message is stored, whatever the
store policy would have chosen, and pinned for the lifetime ("5m" when no
ttl is given; cut to the server's --max-pin-ttl).  Everything wrong with a
breakpoint is the client's to fix, so each is a 4xx naming it: an unknown
type or ttl (400), more than MAX_BREAKPOINTS (400), a prefix shorter than a
checkpoint may be (400), a pin the budget's pinned share has no room for
(409).  The prefix is found by rendering the messages up to the breakpoint
with the same chat template, without a generation prompt, and taking the
tokens it shares with the whole prompt.
"""

import dataclasses
import logging
import time

from kvstore import pins, policy
from kvstore.errors import PinRefused

log = logging.getLogger("kvstore")

# A breakpoint's scope: "tenant" (the default) keeps its prefix under the
# request's cache_salt; "global" stores it, and looks it up, without the salt
# (one shared system prompt for every tenant; kvstore.serve.tier).
TENANT_SCOPE, GLOBAL_SCOPE = "tenant", "global"
SCOPES = (TENANT_SCOPE, GLOBAL_SCOPE)

# Anthropic allows four breakpoints in one request.
MAX_BREAKPOINTS = 4
DEFAULT_TTL = "5m"
# The longest pin lifetime a server grants unless told otherwise: the
# longest cache_control ttl clients ask for ("1h").
DEFAULT_MAX_PIN_TTL_S = 3600


class BadPin(ValueError):
    """A breakpoint the server refuses; status is the HTTP answer (400 or 409)."""

    def __init__(self, message, status=400):
        self.status = status
        super().__init__(message)


@dataclasses.dataclass
class PinRequest:
    """One breakpoint of a request and what became of it."""
    message: int             # the index of the message the prefix ends with
    ttl_s: float
    tokens: int = 0          # the prefix's length in tokens, once tokenized
    state: str = "pending"   # "pending", "queued", "pinned", "refused" or "not_stored"
    until: int = 0           # the pin's end (unix seconds) once pinned
    origin: str = "cache_control"   # or "retention" (prompt_cache_retention, kvstore.serve.routing)
    scope: str = "tenant"    # "global": stored and found without the request's salt (GLOBAL_SCOPE)
    granted_s: float = 0.0   # the lifetime granted (ttl_s, or cut to --max-pin-ttl) once pinned

    def tenant_of(self, tenant):
        """The tenant whose keys this pin's prefix goes under: none for a global one."""
        return None if self.scope == GLOBAL_SCOPE else tenant

    def view(self):
        """The trace's view of it (no text)."""
        out = {"message": self.message, "tokens": self.tokens, "state": self.state, "origin": self.origin,
               "ttl_s": self.ttl_s, "scope": self.scope}
        if self.until:
            out["until"], out["granted_s"] = self.until, round(self.granted_s)
        return out


def _control_of(part, where):
    """(ttl, global) of one cache_control object, or None when there is none."""
    cc = part.get("cache_control") if isinstance(part, dict) else None
    if cc is None:
        return None
    if not isinstance(cc, dict) or cc.get("type") != "ephemeral":
        raise BadPin(f"{where}: cache_control must be {{\"type\": \"ephemeral\"}} with an optional ttl "
                     f"({', '.join(pins.TTL_NAMES)}), not {_short(cc)}")
    ttl = cc.get("ttl", DEFAULT_TTL)
    if ttl not in pins.TTL_NAMES:
        raise BadPin(f"{where}: cache_control ttl {_short(ttl)} is not one of {', '.join(pins.TTL_NAMES)}")
    scope = cc.get("scope", TENANT_SCOPE)
    if scope not in SCOPES:
        raise BadPin(f"{where}: cache_control scope {_short(scope)} is not one of {', '.join(SCOPES)}")
    return pins.TTL_NAMES[ttl], scope == GLOBAL_SCOPE


def _short(value):
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def breakpoints(messages):
    """The PinRequests of a chat request's messages, in message order.

    Raises:
        BadPin: a malformed cache_control, or more than MAX_BREAKPOINTS.
    """
    out = []
    for i, m in enumerate(messages if isinstance(messages, list) else []):
        found = [_control_of(m, f"messages[{i}]")]
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):
            found += [_control_of(p, f"messages[{i}].content[{j}]") for j, p in enumerate(content)]
        found = [f for f in found if f is not None]
        if found:
            out.append(PinRequest(i, max(ttl for ttl, _ in found),
                                  scope=GLOBAL_SCOPE if any(g for _, g in found) else TENANT_SCOPE))
    if len(out) > MAX_BREAKPOINTS:
        raise BadPin(f"{len(out)} cache_control breakpoints; at most {MAX_BREAKPOINTS} per request")
    return out


def global_system(messages, out):
    """Makes the breakpoint on a chat request's system message global, adding
    one (DEFAULT_TTL) to out (its PinRequests) when it has none: `kvstore
    serve --global-system-prompt`."""
    if not messages or not isinstance(messages[0], dict) or messages[0].get("role") != "system":
        return
    for p in out:
        if p.message == 0:
            p.scope = GLOBAL_SCOPE
            return
    out.insert(0, PinRequest(0, pins.TTL_NAMES[DEFAULT_TTL], origin="server", scope=GLOBAL_SCOPE))


class Pinner:
    """The pins of one store's breakpoints: judged on a request's HTTP thread,
    granted once what they pin is stored, each outcome logged and counted.

    Args:
        store: the KVStore the pins are in.
        settings: its kvstore.Settings (min_tokens: the shortest prefix a pin may ask for).
        metrics: a kvstore.serve.metrics.Metrics, or None.
    """

    def __init__(self, store, settings, metrics=None):
        self.store, self.settings, self.metrics = store, settings, metrics

    def judge(self, prompt, ticket, key_of):
        """Judges a request's breakpoints, once each one's length in tokens
        is known.  A prefix too short for a checkpoint is refused (400); one
        stored already is pinned now (its lifetime extended), or refused
        (409) when the budget's pinned share has no room for it; any other
        is queued: stored when the request's state passes its end, then
        pinned (grant()).

        Args:
            prompt: the request's tokens.
            ticket: its kvstore.serve.ticket.Ticket (its pins and tenant).
            key_of: (tokens, tenant) -> the disk key of those tokens.

        Raises:
            BadPin: the request's answer.
        """
        for p in ticket.pins:
            if not policy.store_cut(p.tokens, self.settings) and p.origin == "retention":
                p.state = "not_stored"            # too short to keep: not the client's error
                continue
            if not policy.store_cut(p.tokens, self.settings):
                raise BadPin(f"messages[{p.message}]: the prefix that ends there is {p.tokens} tokens, shorter "
                             f"than the {self.settings.min_tokens} tokens a checkpoint needs (--min-tokens)")
            p.state = "queued"
            tenant = p.tenant_of(ticket.tenant)
            self.grant(p, key_of(prompt[:p.tokens], tenant), tenant, upfront=True)

    def grant(self, p, key, tenant, upfront=False):
        """Pins the stored prefix key for p (a PinRequest), the outcome recorded in p; raises
        BadPin (409) upfront (on the HTTP thread) when the pinned share has no room."""
        try:
            pin = self.store.pin(key, p.ttl_s, tenant=tenant or "")
        except PinRefused as e:
            if e.reason == "not_stored" and upfront:
                return                    # queued: stored once the request's state passes it
            self.refused(p, "refused" if e.reason == "share" else "not_stored")
            if upfront:
                raise BadPin(f"messages[{p.message}]: {e}", 409) from None
            return
        p.state, p.until, p.granted_s = "pinned", pin.until, pin.until - time.time()
        log.info("kvstore: pinned tokens=%d until=%d file=%s", p.tokens, pin.until, pin.sha[:12])
        if self.metrics is not None:
            self.metrics.pin("pinned")

    def refused(self, p, state):
        """Records a breakpoint that was not pinned: its state, the log line, the metric."""
        p.state = state
        log.warning("kvstore: pin_refused reason=%s tokens=%d", "share" if state == "refused" else state, p.tokens)
        if self.metrics is not None:
            self.metrics.pin(state)


def add_arguments(p):
    """`kvstore serve`'s pin option --global-system-prompt (the pin limits are store settings)."""
    p.add_argument("--global-system-prompt", action="store_true",
                   help="share every request's system message across tenants: the prefix through it is stored "
                        "and found without the cache_salt (a 5m breakpoint, or the client's, made global); the "
                        "rest stays salted. Per breakpoint: cache_control {\"type\": \"ephemeral\", "
                        "\"scope\": \"global\"}")


__all__ = ["BadPin", "PinRequest", "Pinner", "breakpoints", "global_system", "GLOBAL_SCOPE",
           "add_arguments", "MAX_BREAKPOINTS",
           "DEFAULT_TTL", "DEFAULT_MAX_PIN_TTL_S"]
