"""The store-policy knobs (docs/semantics.md §7) and their defaults.

Each default is ds4's compiled-in value (``ds4_kvstore.c`` /
``ds4_kvstore.h``); Options checks what ds4 leaves unchecked.
"""

import dataclasses
import numbers
import operator

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
# models share (docs/semantics.md §17) the files of a model tried once and
# dropped would otherwise keep their anchors' double score for ever.  30 days
# outlives a month's pause in a project, not a model nobody runs any more.
DEFAULT_STALE_AFTER_S = 30 * 24 * 3600
# Pinned prefixes (kvstore.pins) may keep at most this share of the budget:
# half leaves the other half to what the workload itself makes worth keeping.
DEFAULT_MAX_PINNED_SHARE = 0.5


@dataclasses.dataclass(frozen=True)
class Options:
    """Store-policy knobs (docs/semantics.md §7).  Defaults are ds4's.

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
        max_pinned_share: the share of the budget pinned prefixes may keep
            (kvstore.pins): a pin past it is refused; 0 refuses every pin.
        max_pin_ttl_s: the longest lifetime a pin is granted; a longer one
            is cut to it (None: no limit).

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
    max_pinned_share: float = DEFAULT_MAX_PINNED_SHARE
    max_pin_ttl_s: float = None

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
        share = self.max_pinned_share
        if isinstance(share, bool) or not isinstance(share, numbers.Real):
            raise TypeError(f"Options.max_pinned_share={share!r} is not a number")
        if not 0 <= share <= 1:
            raise ValueError(f"Options.max_pinned_share={share} must be between 0 and 1")
        ttl = self.max_pin_ttl_s
        if ttl is not None:
            if isinstance(ttl, bool) or not isinstance(ttl, numbers.Real):
                raise TypeError(f"Options.max_pin_ttl_s={ttl!r} is not a number or None")
            if not 0 < ttl < float("inf"):
                raise ValueError(f"Options.max_pin_ttl_s={ttl} must be > 0 (or None)")


DEFAULT_OPTIONS = Options()


def check_count(name, value):
    """Refuses a negative count or size (ds4's are unsigned), naming it.

    Raises:
        ValueError: value is negative.
    """
    if value < 0:
        raise ValueError(f"{name}={value} must be >= 0")
