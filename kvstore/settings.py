"""A store's settings: one frozen dataclass, the one home of every default and its check.

`KVStore(path, settings)` or `KVStore(path, **changes)` reads a Settings;
the store's parts read it from the open directory; the policy functions take
it for what to store and what to evict (docs/semantics.md §7); `kvstore
serve` and the command line make their options from its fields (flag, type,
help text and default, add_arguments) and their values back into a Settings
(from_arguments), so that a default or a check is written here and nowhere
else.  The values that are not settings stay arguments of KVStore: the
model's identity, the sealing key, the remote tier.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import math
import numbers
import operator
from collections.abc import Iterable
from typing import Any

from kvstore.counters import budget_capacity
from kvstore.format import Header
from kvstore.payload.forms import KV_CODECS

# --- Defaults of the store policy: each is ds4's compiled-in value (ds4_kvstore.c / ds4_kvstore.h).

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

# --- kvstore's own defaults.

# A checkpoint nobody has used for this long goes before any other when the
# directory is over its budget, whatever its score: in a directory that many
# models share (docs/semantics.md §17) the files of a model tried once and
# dropped would otherwise keep their anchors' double score for ever.  30 days
# outlives a month's pause in a project, not a model nobody runs any more.
DEFAULT_STALE_AFTER_S = 30 * 24 * 3600
# Pinned prefixes (kvstore.pins) may keep at most this share of the budget:
# half leaves the other half to what the workload itself makes worth keeping.
DEFAULT_MAX_PINNED_SHARE = 0.5
# Blocks of this many tokens.  mlx-lm grows its KV buffers in steps of 256
# tokens, and a block of 256 tokens of an 8B model (128 KiB of KV per token)
# is 32 MiB: large enough that its reads run at full speed, small enough
# that a prompt leaving a stored sequence loses at most 255 tokens of reuse.
DEFAULT_BLOCK_TOKENS = 256
# How a store writes: "chain" (ABI 17 blocks, docs/format.md §14) or "whole"
# (one ABI 16 file per checkpoint).  Both are always read.
LAYOUTS = ("chain", "whole")

_DAY = 86400

# The default disk budget, when none is set: this share of the filesystem
# that holds the directory, within these bounds.  ds4's fixed 4 GiB holds
# one 30,000-token session of an 8B model (128-144 KiB of KV a token) or
# none; a share of the disk grows with the machine, and the bounds keep a
# small disk useful and a large one from filling with checkpoints.
DEFAULT_BUDGET_SHARE = 0.10
DEFAULT_BUDGET_MIN_BYTES = 4 << 30
DEFAULT_BUDGET_MAX_BYTES = 64 << 30


def default_budget_text(where="the directory"):
    """How the default budget is chosen, in words (help texts, kvstore stats)."""
    return (f"{DEFAULT_BUDGET_SHARE:.0%} of the filesystem holding {where}, at least "
            f"{DEFAULT_BUDGET_MIN_BYTES >> 30} GiB, at most {DEFAULT_BUDGET_MAX_BYTES >> 30} GiB")


class BadSetting(ValueError):
    """A setting's value is out of its range; the message names the setting and the value.

    Attributes:
        name: the setting.
        value: the value given.
        reason: what the value must be ("must be >= 0").
    """

    def __init__(self, name, value, reason):
        super().__init__(f"{name}={value!r} {reason}")
        self.name, self.value, self.reason = name, value, reason

    def as_option(self, flag, typed):
        """The same error about a command-line option: "--flag value reason"."""
        e = BadSetting(self.name, typed, self.reason)
        e.args = (f"{flag} {typed} {self.reason}",)
        return e


def check_count(name, value):
    """Refuses a negative count or size (ds4's are unsigned), naming it.

    Raises:
        ValueError: value is negative.
    """
    if value < 0:
        raise BadSetting(name, value, "must be >= 0")


def duration(text):
    """Seconds of a duration option: a number of seconds, or one with a unit s, m, h or d."""
    units = {"s": 1, "m": 60, "h": 3600, "d": _DAY}
    scale = units.get(text[-1:], 1)
    try:
        value = float(text[:-1] if text[-1:] in units else text) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration (seconds, or 90s, 5m, 1h, 2d)") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive duration")
    return value


# ---- the checks, one per kind of value --------------------------------------

def _number(name, value, none=False):
    if value is None and none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}={value!r} is not a number" + (" or None" if none else ""))
    return value


def _integer(name, value, none=False):
    if value is None and none:
        return None
    try:
        if isinstance(value, bool):
            raise TypeError
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name}={value!r} is not an integer" + (" or None" if none else "")) from None


def _count(name, value):
    value = _integer(name, value)
    check_count(name, value)
    return value


def _at_least_one(name, value):
    value = _integer(name, value)
    if not 1 <= value < 2**32:
        raise BadSetting(name, value, "must be a positive u32")
    return value


def _seconds(name, value):
    """A positive, finite duration in seconds, or None (no limit)."""
    if _number(name, value, none=True) is not None and not 0 < value < float("inf"):
        raise BadSetting(name, value, "must be > 0 (or None)")
    return value


def _age(name, value):
    """A finite age in seconds, 0 included (everything is older), or None."""
    if _number(name, value, none=True) is not None and not 0 <= value < float("inf"):
        raise BadSetting(name, value, "must be >= 0 (or None)")
    return value


def _half_life(name, value):
    if not _number(name, value) > 0:          # also refuses NaN
        raise BadSetting(name, value, "must be > 0")
    return value


def _share(name, value):
    if not 0 <= _number(name, value) <= 1:
        raise BadSetting(name, value, "must be between 0 and 1")
    return value


def _budget(name, value):
    if _number(name, value, none=True) is not None:
        if not math.isfinite(value):
            raise BadSetting(name, value, "is not a finite number")
        check_count(name, value)
    return value


def _model_id(name, value):
    value = _integer(name, value)
    if not 0 <= value <= 255:
        raise BadSetting(name, value, "is outside 0..255")
    return value


def _quant_bits(name, value):
    value = _integer(name, value)
    try:
        Header(quant_bits=value, tokens=1, ctx_size=0, payload_bytes=0).pack()
    except ValueError:
        raise BadSetting(name, value, "is not a quant width a header records (2, 3, 4, 5, 6, 8 or 16)") from None
    return value


def _ctx_size(name, value):
    value = _integer(name, value, none=True)
    if value is not None and not 0 < value < 2**32:
        raise BadSetting(name, value, "must be a positive u32 or None")
    return value


def _write_budget(name, value):
    try:
        budget_capacity(value)
    except ValueError as e:
        raise BadSetting(name, value, str(e).split(" ", 1)[1]) from None
    return value


def _flag(name, value):
    if not isinstance(value, bool):
        raise TypeError(f"{name}={value!r} is not True or False")
    return value


def _one_of(choices):
    def check(name, value):
        if value not in choices:
            raise BadSetting(name, value, f"is not one of {', '.join(choices)}")
        return value
    return check


def _setting(default, check, doc, flag=None, type=None, choices=None, metavar=None, to_setting=None, shown=None,
             option_doc=None):
    """A field of Settings: its default, its check and its documentation.

    flag, type, choices, metavar: its command-line option where one exists
    (see add_arguments), to_setting the option's value made a setting's,
    shown the setting's value as the option spells it (for the help text),
    option_doc the option's help where it speaks in other units than doc."""
    return dataclasses.field(default=default, metadata=dict(
        check=check, doc=doc, flag=flag, type=type, choices=choices, metavar=metavar, to_setting=to_setting,
        shown=shown, option_doc=option_doc or doc))


@dataclasses.dataclass(frozen=True)
class Settings:
    """Every setting of a store (see each field's doc; docs/semantics.md §7 for the policy's).

    Raises:
        BadSetting (a ValueError): a value out of its range; TypeError: a
            value of the wrong type.  Both name the setting and the value.
    """
    # The directory.
    budget_mb: float | None = _setting(
        None, _budget, f"disk budget of the directory, all models together, in MiB (default: "
        f"{default_budget_text('it')}; 0: none)", flag="--budget-mb", type=float, metavar="MIB")
    durable: bool = _setting(True, _flag, "saves sync file and directory (crash-safe publish)")
    verify: bool = _setting(True, _flag, "loads check every payload CRC")
    quarantine: bool = _setting(False, _flag, "corrupt files are moved to .quarantine instead of deleted")
    max_age_s: float | None = _setting(None, _age, "checkpoints unused this long are removed (None: kept)")
    max_write_mb_per_hour: float | None = _setting(
        None, _write_budget, "SSD write budget in MiB per hour: when it runs low, stores are skipped in order of "
        "value (waypoints and evict states first, anchors last); default: none", flag="--max-write-mb-per-hour",
        type=float, metavar="MIB")
    # How the store writes.
    layout: str = _setting(
        "chain", _one_of(LAYOUTS), "chain: a chain of blocks of block_tokens tokens, every token's KV written once "
        "and a hit at every block boundary; whole: one file per checkpoint", flag="--layout", choices=LAYOUTS)
    block_tokens: int = _setting(DEFAULT_BLOCK_TOKENS, _at_least_one, "tokens per block of a chain",
                                 flag="--block-tokens", type=int, metavar="N")
    kv_codec: str = _setting(
        "raw", _one_of(KV_CODECS), "raw: a file's KV as it is; lossless: its float tensors as byte planes, "
        "4-bit table planes where that shrinks them; q8, q4: quantised to 8 or 4 bits a value, group-wise (lossy: "
        "every restore then passes the canary with the codec's tolerance); docs/format.md §20; with a key, "
        "packed before sealed", flag="--kv-codec", choices=KV_CODECS)
    # What this engine's files record and load.
    model_id: int = _setting(0, _model_id, "header model id of the store's files (0..255)")
    quant_bits: int = _setting(16, _quant_bits, "quant bits of the model weights (2, 3, 4, 5, 6, 8 or 16)")
    ctx_size: int | None = _setting(None, _ctx_size, "the engine's context size; checkpoints made with a larger "
                                    "one are never loaded (None: no limit)")
    reject_different_quant: bool = _setting(False, _flag, "quant is part of the match")
    accept_unidentified: bool = _setting(False, _flag, "with a model identity, also load files that name no "
                                         "model (they may be another model's state)")
    accept_unsealed: bool = _setting(False, _flag, "with a key, also load plain files (anyone who can write "
                                     "to the directory could have planted them)")
    # The store policy (docs/semantics.md §7): what to store and what to evict.
    min_tokens: int = _setting(DEFAULT_MIN_TOKENS, _count, "shortest prefix worth a checkpoint",
                               flag="--min-tokens", type=int, metavar="N")
    cold_max_tokens: int = _setting(DEFAULT_COLD_MAX_TOKENS, _count,
                                    "longest prompt that gets a cold checkpoint")
    continued_interval_tokens: int = _setting(
        DEFAULT_CONTINUED_INTERVAL_TOKENS, _count, "store a `continued` checkpoint every this many prompt tokens, "
        f"rounded up to the alignment ({DEFAULT_BOUNDARY_ALIGN_TOKENS}); 0: none", flag="--waypoint-tokens", type=int,
        metavar="N")
    boundary_trim_tokens: int = _setting(DEFAULT_BOUNDARY_TRIM_TOKENS, _count,
                                         "tokens dropped off a live prefix before storing")
    boundary_align_tokens: int = _setting(DEFAULT_BOUNDARY_ALIGN_TOKENS, _at_least_one,
                                          "store lengths and waypoints are multiples of this")
    hit_half_life_s: float = _setting(DEFAULT_HALF_LIFE, _half_life, "seconds for a checkpoint's hit count to halve")
    stale_after_s: float | None = _setting(
        DEFAULT_STALE_AFTER_S, _seconds, "seconds: a checkpoint nobody has used for this long goes before every "
        "fresher one when the directory is over its budget, whatever its model (None: by score alone)",
        option_doc="checkpoints nobody has used for this many days go first when the directory is over its "
        "budget, whatever their model (0: never)", flag="--stale-after-days", type=float,
        metavar="DAYS",
        to_setting=lambda days: days * _DAY or None, shown=lambda s: 0 if s is None else s / _DAY)
    max_pinned_share: float = _setting(
        DEFAULT_MAX_PINNED_SHARE, _share, "the share of the budget that pinned prefixes may keep; a pin past it "
        "is refused, never granted by unpinning others (0: no pins)", flag="--max-pinned-share", type=float,
        metavar="SHARE")
    max_pin_ttl_s: float | None = _setting(
        None, _seconds, "the longest lifetime a pin is granted, in seconds; a longer one is cut to it (None: no "
        "limit)", option_doc="the longest lifetime a pin is granted, in seconds or with a unit (90s, 5m, 1h, 2d); "
        "a longer one is cut to it", flag="--max-pin-ttl", type=duration,
        metavar="SECONDS")

    def __post_init__(self):
        for f in dataclasses.fields(self):
            object.__setattr__(self, f.name, f.metadata["check"](f.name, getattr(self, f.name)))

    def replace(self, **changes: Any) -> Settings:
        """A copy with changes (each checked; an unknown name is a TypeError naming it)."""
        unknown(changes, "Settings.replace()")
        return dataclasses.replace(self, **changes)


DEFAULT_SETTINGS = Settings()
NAMES = tuple(f.name for f in dataclasses.fields(Settings))


def unknown(changes, where):
    """Refuses a name that is not a setting, with the nearest one (TypeError)."""
    for name in changes:
        if name not in NAMES:
            near = difflib.get_close_matches(name, NAMES, 1)
            raise TypeError(f"{where}: {name!r} is not a setting" + (f" (did you mean {near[0]!r}?)" if near else ""))


def settings_of(settings: Settings | None, changes: dict) -> Settings:
    """settings (or the defaults) with changes, checked; TypeError for a name that is not a setting."""
    unknown(changes, "KVStore()")
    base = DEFAULT_SETTINGS if settings is None else settings
    if not isinstance(base, Settings):
        raise TypeError(f"settings={settings!r} is not a kvstore.Settings")
    return dataclasses.replace(base, **changes) if changes else base


# ---- command-line options made from the fields ------------------------------

def _field(name):
    return next(f for f in dataclasses.fields(Settings) if f.name == name)


def add_arguments(parser, names: Iterable[str], defaults: Settings = DEFAULT_SETTINGS, doc: dict | None = None):
    """Adds the option of each named setting to an argparse parser: its flag,
    type, choices and help text from the field, the default from defaults
    (an option not given leaves the setting as defaults has it).

    doc: {name: help text} where a command says it otherwise."""
    for name in names:
        f = _field(name)
        m = f.metadata
        default = getattr(defaults, name)
        shown = m["shown"](default) if m["shown"] else default
        text = (doc or {}).get(name, m["option_doc"])
        if default is not None and "(default" not in text:
            text += f" (default {shown:g})" if isinstance(shown, float) else f" (default {shown})"
        kw = dict(type=m["type"]) if m["type"] else {}
        if m["choices"]:
            kw["choices"] = m["choices"]
        if m["metavar"]:
            kw["metavar"] = m["metavar"]
        parser.add_argument(m["flag"], dest=name, default=None, help=text.replace("%", "%%"), **kw)


def from_arguments(args, names: Iterable[str], defaults: Settings = DEFAULT_SETTINGS) -> Settings:
    """defaults with every named option given on the command line.

    Raises:
        BadSetting: a value out of range, its message naming the option as
            typed (e.g. "--min-tokens -1 must be >= 0").
    """
    changes = {}
    for name in names:
        value = getattr(args, name, None)
        if value is not None:
            convert = _field(name).metadata["to_setting"]
            changes[name] = (convert(value) if convert else value, value)
    try:
        return dataclasses.replace(defaults, **{k: v for k, (v, _) in changes.items()})
    except BadSetting as e:
        if e.name not in changes:
            raise
        raise e.as_option(_field(e.name).metadata["flag"], changes[e.name][1]) from None


def flags(names: Iterable[str]) -> dict[str, str]:
    """{setting: its option's flag} of names."""
    return {name: _field(name).metadata["flag"] for name in names}


def describe() -> list[tuple[str, Any, str]]:
    """[(name, default, doc)] of every setting, in order (for docs and help)."""
    return [(f.name, f.default, f.metadata["doc"]) for f in dataclasses.fields(Settings)]


def shown(value) -> str:
    """A setting's value as docs/guide.md's table of settings writes it."""
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


__all__ = ["Settings", "BadSetting", "DEFAULT_SETTINGS", "NAMES", "LAYOUTS", "settings_of", "unknown",
           "add_arguments", "from_arguments", "flags", "describe", "shown", "check_count", "duration",
           "DEFAULT_MIN_TOKENS", "DEFAULT_COLD_MAX_TOKENS", "DEFAULT_CONTINUED_INTERVAL_TOKENS",
           "DEFAULT_BOUNDARY_TRIM_TOKENS", "DEFAULT_BOUNDARY_ALIGN_TOKENS", "DEFAULT_HALF_LIFE",
           "DEFAULT_STALE_AFTER_S", "DEFAULT_MAX_PINNED_SHARE", "DEFAULT_BLOCK_TOKENS", "DEFAULT_BUDGET_SHARE",
           "DEFAULT_BUDGET_MIN_BYTES", "DEFAULT_BUDGET_MAX_BYTES", "default_budget_text"]
