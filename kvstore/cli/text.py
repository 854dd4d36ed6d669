"""Text helpers of the command line: sizes, times, tables, one progress bar, usage errors.

Nothing here reads a checkpoint: the commands (one module per group of
directory commands, remote.py) hand in values and get lines back.  Prompt
text never passes through here; session titles, labels a person gave, are
shown with control characters replaced.
"""

import argparse
import math
import sys
import time
import unicodedata

from kvstore import ds4, settings
from kvstore.format import ExtFlag, Reason

PROG = "kvstore"

# Titles are shown whole in `inspect` and cut to this many characters in
# table rows, so one long label cannot push the other columns off screen.
TITLE_COLUMN = 40

# The progress bar redraws at most this often: a terminal that repaints for
# every 4 MiB chunk would spend more time drawing than verifying.
PROGRESS_INTERVAL_S = 0.1
PROGRESS_WIDTH = 30


class UsageError(Exception):
    """A mistake in the command line or its arguments: exit status 2."""


class Parser(argparse.ArgumentParser):
    """argparse, but an error is one line (no usage dump) and never exits by itself."""

    def error(self, message):
        raise UsageError(message)


def megabytes(text):
    """argparse type: a number of MiB >= 0."""
    try:
        v = float(text)
    except ValueError:
        v = math.nan
    if not math.isfinite(v) or v < 0:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: expected a number of MiB >= 0")
    return v


def gigabytes(text):
    """argparse type: a number of GiB > 0."""
    try:
        v = float(text)
    except ValueError:
        v = math.nan
    if not math.isfinite(v) or v <= 0:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: expected a number of GiB > 0")
    return v


def mib_bytes(mb):
    return int(mb * 1024 * 1024)


# ---- formatting -------------------------------------------------------------------

def reason_name(reason):
    return Reason(reason).name.lower().replace("_", "-")


def flag_names(flags):
    flags = int(flags)
    names = [f.name.lower().replace("_", "-") for f in ExtFlag if flags & f]
    unknown = flags & ~sum(int(f) for f in ExtFlag)
    if unknown:
        names.append(f"unknown-0x{unknown:02x}")
    return names


def size(n):
    """Bytes as ``812 B``, ``3.5 KiB``, ``1.2 GiB``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def span(seconds):
    """Seconds as ``42s``, ``7m``, ``3h``, ``12d``."""
    seconds = max(0, int(seconds))
    for unit, width in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= width:
            return f"{seconds // width}{unit}"
    return f"{seconds}s"


def age(t, now):
    return "?" if not t else span(now - t)


def used(e, now):
    return "never" if not e.last_used else span(now - e.last_used) + " ago"


def stamp(t, now):
    if not t:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) + f" ({span(now - t)} ago)"


def printable(s, limit=None):
    """A user label made safe for a terminal: control characters become '?'."""
    if s is None:
        return ""
    s = "".join("?" if unicodedata.category(c).startswith("C") else c for c in s)
    if limit is not None and len(s) > limit:
        s = s[:limit - 1] + "…"
    return s


def abi(e):
    if e.loadable:
        return str(e.payload_abi)
    if e.sealed:
        return f"{e.payload_abi}(sealed)"
    return f"{e.payload_abi}(ds4)" if ds4.is_ds4(e) else f"{e.payload_abi}(foreign)"


def table(rows, header, right=()):
    """Left-aligned columns (right-aligned where named), two spaces apart."""
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    out = []
    for r in [header] + rows:
        cells = [str(c).rjust(w) if i in right else str(c).ljust(w)
                 for i, (c, w) in enumerate(zip(r, widths))]
        out.append("  ".join(cells).rstrip())
    return "\n".join(out)


def pairs(rows, indent=""):
    """(label, value) rows as ``label  value`` lines, the values in one column."""
    w = max(len(k) for k, _ in rows)
    return "\n".join(f"{indent}{k.ljust(w)}  {v}" for k, v in rows)


def budget_help(what, where="DIR"):
    """The help text of a --budget-mb option (kvstore.settings.add_arguments): what, then the default in words."""
    return f"{what} (default: {settings.default_budget_text(where)}; 0: none)"


def budget_mb(args):
    """The --budget-mb a command was given (None: the default), checked as the store checks it.

    Raises:
        UsageError: naming the option and its value.
    """
    try:
        return settings.from_arguments(args, ["budget_mb"]).budget_mb
    except settings.BadSetting as e:
        raise UsageError(str(e)) from None


def budget_line(total, budget, derived=False):
    if not budget:
        return f"{size(total)} (no budget)"
    how = f", the default: {settings.default_budget_text('the store')}" if derived else ""
    return f"{size(total)} of {size(budget)} budget ({100.0 * total / budget:.1f}%{how})"


def plural(n, word):
    return f"{n} {word}{'s' if n != 1 else ''}"


# ---- the progress bar -------------------------------------------------------------

class Progress:
    """A one-line progress bar on stderr (only when it is a terminal, or asked for).

    Used two ways: advance(n) / reach(done) for bytes (`kvstore verify`), or
    called as progress(done, total) by a long job (the demo's prefills).

    Args:
        total: the amount of work (bytes, tokens); may be set later by a call.
        label: the text before the bar.
        enabled: draw at all (False: every call is a no-op on screen).
        unit: "bytes" (shown as sizes) or a word such as "tokens".
    """

    def __init__(self, total, label, enabled, stream=None, unit="bytes"):
        self.total, self.label, self.enabled, self.unit = max(total, 1), label, enabled, unit
        self.stream = stream or sys.stderr
        self.done = 0
        self.files = None
        self._last = 0.0
        self._width = 0

    def advance(self, n):
        self.done += n
        now = time.monotonic()
        if self.enabled and now - self._last >= PROGRESS_INTERVAL_S:
            self._last = now
            self._draw()

    def reach(self, done):
        """Sets the work done (at the end of a file: skipped padding and trailers count)."""
        self.done = max(self.done, done)
        self.advance(0)

    def __call__(self, done, total):
        self.total = max(total, 1)
        self.reach(done)

    def _amount(self, n):
        return size(n) if self.unit == "bytes" else str(n)

    def _draw(self):
        frac = min(1.0, self.done / self.total)
        fill = int(frac * PROGRESS_WIDTH)
        line = (f"{self.label} [{'#' * fill}{'.' * (PROGRESS_WIDTH - fill)}] {frac * 100:3.0f}% "
                f"{self._amount(self.done)}/{self._amount(self.total)}"
                + ("" if self.unit == "bytes" else f" {self.unit}")
                + ("" if self.files is None else f" files {self.files}"))
        self.stream.write("\r" + line.ljust(self._width))
        self.stream.flush()
        self._width = len(line)

    def clear(self):
        """Erases the bar (before another line is printed to the terminal)."""
        if self.enabled and self._width:
            self.stream.write("\r" + " " * self._width + "\r")
            self.stream.flush()
            self._width = 0
            self._last = 0.0

    def close(self):
        if self.enabled:
            self.done = self.total
            self._draw()
            self.stream.write("\n")
            self.stream.flush()
