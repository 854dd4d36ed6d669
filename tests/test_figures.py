"""Every measured figure that README.md and docs/*.md quote comes from bench/results/.

`python -m bench` keeps each harness's results in bench/results/NAME.json and
NAME.md and rewrites the generated blocks of those files from them
(bench/figures.py: between `<!-- TAG:start -->` and `<!-- TAG:end -->`).
These tests fail when a block differs from what bench/figures.py makes of the
results on disk (run `python bench/figures.py` to rewrite the blocks from
them), and when a time, a speed or a ratio outside the blocks is not found in
any result: a measured figure is generated, or the prose refers to the
generated table instead.  Constants that carry a unit (a timeout, a refresh
interval) are listed in CONSTANTS with where they come from.
"""

import importlib.util
import json
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Every file of prose a reader meets: README.md and each doc in docs/ (a new
# doc is checked as soon as it exists).
DOCS = ("README.md", *sorted("docs/" + name for name in os.listdir(os.path.join(ROOT, "docs")) if name.endswith(".md")))

# bench/figures.py, loaded by path: bench/ holds scripts named like common
# modules (store, serve, remote) that must not shadow anything else here.
_spec = importlib.util.spec_from_file_location("bench_figures", os.path.join(ROOT, "bench", "figures.py"))
figures = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(figures)

# A number with a unit of time or speed, or a ratio written as "1.5×" / "3x".
# A spaced "4 × count" is a multiplication in a layout, not a measurement.
MEASURED = re.compile(r"(?<![\w.,])\d[\d,]*(?:\.\d+)?(?:[–-]\d[\d,]*(?:\.\d+)?)?"
                      r"(?:\s?(?:ms|µs|us|ns|s|seconds?|minutes?|hours?|[GMK]i?B/s|tok/s)|[×x])(?![\w/])")

# Figures with a unit that are settings, not measurements: the phrase that
# holds each (whitespace-insensitive) and where its value is set.
CONSTANTS = (
    ("thread waits up to 0.25 s", "kvstore serve's ADMIT_WAIT_S"),
    ("refreshed every 30 s", "the remote tier's default refresh_interval_s"),
    ("(1 s connect timeout)", "the remote tier's S3 client settings"),
    ("more than 50 ms after it", "the index's trust margin for directory mtimes"),
    ("within 30 s (`kvstore.index.RESCAN_NS`)", "kvstore.index.RESCAN_NS"),
    ("| `hit_half_life_s` | 21600 s (6 h)", "Settings.hit_half_life_s"),
    ("at most 0.25 s (`ADMIT_WAIT_S`)", "kvstore serve's ADMIT_WAIT_S"),
    ("21600 s is the default", "Settings.hit_half_life_s"),
    ("more than 24 hours old", "the age after which a temporary file is an orphan"),
    ("every 30 s into memory", "the remote tier's default refresh_interval_s"),
    ("(default 60 s;", "kvstore remote gc --min-age-s"),
    ("more than 24 hours ago", "the janitor's age for abandoned multipart uploads"),
    ("opens for 5 s", "the remote breaker's first cool-down"),
    ("up to 60 s", "the remote breaker's longest cool-down"),
    ("time out after 1 s and reads after 10 s", "the remote tier's S3 client settings"),
    ("queued uploads up to 10 s", "the remote tier's close() grace"),
    ("at most every 10 s", "the chain repair's interval"),
    ("7.5, 10 seconds and +Inf", "kvstore serve's Prometheus histogram buckets"),
    ("refill rate C per 3600 s", "the write budget's token bucket"),
)


def _read(path):
    with open(os.path.join(ROOT, path)) as f:
        return f.read()


def _blank(text, a, b):
    """text with [a, b) blanked, newlines kept (line numbers stay right)."""
    return text[:a] + re.sub(r"[^\n]", " ", text[a:b]) + text[b:]


def _outside_blocks(text):
    """The text with every generated block, markers included, blanked."""
    for m in re.finditer(r"<!-- (bench[\w:]*):start -->", text):
        end = text.index(f"<!-- {m.group(1)}:end -->", m.end())
        text = _blank(text, m.start(), end + len(f"<!-- {m.group(1)}:end -->"))
    return text


def _without_constants(text):
    for phrase, _ in CONSTANTS:
        pattern = r"\s+".join(re.escape(w) for w in phrase.split())
        for m in re.finditer(pattern, text):
            text = _blank(text, m.start(), m.end())
    return text


def _strings(value):
    """Every string in a JSON value (the cells and notes that reports print)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)


def _results_text(results):
    parts = []
    for name in sorted(os.listdir(results)):
        with open(os.path.join(results, name)) as f:
            if name.endswith(".md"):
                parts.append(f.read())
            elif name.endswith(".json"):
                parts.extend(_strings(json.load(f)))
    return " ".join(" ".join(p.split()) for p in parts)


def untraced_figures(text, results_text):
    """[(line, figure)] of the measured figures outside the blocks that no result holds."""
    text = _without_constants(_outside_blocks(text))
    out = []
    for m in MEASURED.finditer(text):
        figure = " ".join(m.group().split())
        bare = re.sub(r"(\d) (?=\D)", r"\1", figure)
        if figure not in results_text and bare not in results_text:
            out.append((text.count("\n", 0, m.start()) + 1, figure))
    return out


@pytest.mark.parametrize("path", DOCS)
def test_no_hand_typed_figures(path):
    """A measured figure outside the generated blocks must be one that a result holds."""
    untraced = untraced_figures(_read(path), _results_text(figures.RESULTS))
    assert not untraced, (
        f"{path}: figures found in no bench/results/ file: "
        + ", ".join(f"line {line}: {fig!r}" for line, fig in untraced)
        + ". Quote a generated block (bench/figures.py) instead, or list a constant in CONSTANTS.")


@pytest.mark.parametrize("path,tag", [(p, t) for p, t, _ in figures.BLOCKS])
def test_generated_blocks_match_results(path, tag):
    """Each generated block is what bench/figures.py makes of bench/results/ now."""
    want = figures.generate()[(path, tag)]
    assert figures.current_block(_read(path), tag, path) == want, (
        f"{path}'s {tag} block differs from bench/results/: run `python bench/figures.py`")


def test_figures_outside_blocks_are_caught():
    """The scan sees a typed time, speed or ratio, and leaves blocks and constants alone."""
    text = ("A hit takes 16 ms.\n<!-- bench:x:start -->\n12.3 ms\n<!-- bench:x:end -->\n"
            "It streams at 470 MB/s, 1.5× a miss; the breaker opens for 5 s; 4 × count bytes.\n")
    assert untraced_figures(text, "") == [(1, "16 ms"), (5, "470 MB/s"), (5, "1.5×")]
    assert untraced_figures(text, "16 ms 470 MB/s 1.5×") == []


def test_blocks_without_results(tmp_path):
    """With no results the blocks say so; a skipped harness gives its reason."""
    blocks = figures.generate(str(tmp_path))
    assert "no results yet" in blocks[("docs/remote.md", "bench:remote")]
    assert "not measured" in blocks[("docs/format.md", "bench:seal")]
    (tmp_path / "remote.json").write_text(json.dumps({"machine": {}, "skipped": "boto3 is not installed",
                                                      "rows": []}))
    assert "boto3 is not installed" in figures.generate(str(tmp_path))[("docs/remote.md", "bench:remote")]


def test_a_harness_is_skipped_only_when_it_says_why_in_a_sentence():
    """shapes.py lists the sizes it left out under "skipped": it ran, and its
    results replace the last run's (a whole skip keeps the last run's)."""
    assert figures.skipped({"skipped": "boto3 is not installed"}) == "boto3 is not installed"
    assert figures.skipped({"skipped": [{"geometry": "Llama-3.3-70B", "tokens": 32768, "why": "memory"}]}) is None
    assert figures.skipped({"skipped": []}) is None and figures.skipped({}) is None


def test_the_readme_quotes_three_headline_rows():
    """README.md's block holds three rows, each one of the headline rows docs/benchmarks.md holds."""
    headline = [(h[0], h[1], h[2] if len(h) > 2 else ()) for h in figures.HEADLINE]
    assert len(figures.README_HEADLINE) == 3
    assert all((name, needle, section) in headline for name, needle, section, _ in figures.README_HEADLINE)
    body = figures.current_block(_read("README.md"), "bench", "README.md")
    rows = [line for line in body.splitlines() if line.startswith("| ") and not line.startswith("| comparison")]
    assert len(rows) == 3, rows


def test_every_harness_imports_and_takes_its_options(tmp_path):
    """Each harness that `python -m bench` runs imports against the installed
    kvstore and parses its command line (--help).  CI's quick bench runs only
    the harnesses that take seconds (.ci/run says which); this keeps the
    others from rotting at import time between full runs."""
    import subprocess
    import sys
    code = """
import contextlib, importlib, importlib.util, io, sys
bench = sys.argv[1]
sys.path.insert(0, bench)
spec = importlib.util.spec_from_file_location("bench_main", bench + "/__main__.py")
runner = importlib.util.module_from_spec(spec)
spec.loader.exec_module(runner)
for name in runner.HARNESSES:
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            importlib.import_module(name).main(["--help"])
    except SystemExit as e:
        assert e.code == 0, (name, e.code)
    assert "--quick" in out.getvalue(), name
print("harnesses", len(runner.HARNESSES))
"""
    r = subprocess.run([sys.executable, "-c", code, os.path.join(ROOT, "bench")], cwd=tmp_path,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert r.stdout.split() == ["harnesses", "16"]
