"""The `kvstore` command line, run as a real process on real cache directories.

Every directory holds ordinary checkpoints, an agent session with a title, a
ds4 checkpoint (payload ABI 2: listed, never loaded) and a checkpoint with one
payload byte flipped.  Every prompt text carries SECRET, and no command but
`inspect --text` may print it.
"""

import functools
import json
import os
import shutil
import stat
import subprocess
import sys
import time

import numpy as np
import pytest

import kvstore
from kvstore import cli, policy, sessions, settings
from kvstore import files
from kvstore.errors import CheckpointMissing
from kvstore.format import Reason, read_entry

from kvhelpers import colliding_texts as _colliding_texts
from kvhelpers import flip, index_of, make_store, make_tensors, write_checkpoint

SECRET = "SECRET-PROMPT-7f3a"
DS4_TEXT = f"<|begin|>{SECRET} ds4 system".encode()


# This file's saves: layers.0.k (2, n, 8) float16 and layers.0.v (2, n, 8) float32.
tensors = functools.partial(make_tensors, shape=(2, "n", 8), names=("layers.0.k", "layers.0.v"))


def build_cache(d, layout="whole"):
    """A cache directory with one of everything; returns {role: Entry or path}.

    Whole files by default (the tests below read their ABI 16 layout);
    chains are listed and inspected in test_chain.py."""
    s = make_store(d, layout=layout)
    out = {}
    out["cold"] = s.save(f"{SECRET} cold anchor", np.arange(64), tensors(64, 1), meta={"engine": "test"})
    out["continued"] = s.save(f"{SECRET} continued waypoint text", np.arange(96), tensors(96, 2),
                              reason=Reason.CONTINUED)
    out["session"] = sessions.save(s, f"{SECRET} session", np.arange(24), tensors(24, 3),
                                   title="fix the io path")
    out["hot"] = s.save(f"{SECRET} hot", np.arange(32), tensors(32, 4), reason=Reason.CONTINUED)
    for _ in range(5):
        kvstore.format.touch(out["hot"].path)
    out["ds4"] = write_checkpoint(d, DS4_TEXT, b"\x02" * 3000, quant_bits=2, payload_abi=2,
                                  tokens=900, reason=Reason.COLD)
    bad = s.save(f"{SECRET} to be corrupted", np.arange(40), tensors(40, 5))
    flip(bad.path, bad.trailer_offset - 1)          # the last byte of the last tensor
    out["corrupt"] = bad
    s.close()
    return out


@pytest.fixture
def cache(tmp_path):
    d = tmp_path / "cache"
    roles = build_cache(str(d))
    return str(d), roles


@pytest.fixture
def cwd(tmp_path):
    # Outside the repository: there the source tree would shadow the installed package.
    p = tmp_path / "cwd"
    p.mkdir()
    return str(p)


def run(cwd, *args):
    """Runs `python -m kvstore ARGS`; checks the rules every command keeps."""
    env = {k: v for k, v in os.environ.items() if k != "KVSTORE_DEBUG"}
    p = subprocess.run([sys.executable, "-m", "kvstore", *map(str, args)], cwd=cwd,
                       capture_output=True, text=True, timeout=60, env=env)
    assert "Traceback" not in p.stderr, p.stderr
    if "--text" not in args:
        assert SECRET not in p.stdout and SECRET not in p.stderr
    return p


def assert_usage_error(p, *words):
    assert p.returncode == 2, (p.returncode, p.stdout, p.stderr)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvstore: error: "), p.stderr
    for w in words:
        assert w in lines[0], (w, lines[0])


def names(d):
    return sorted(n for n in os.listdir(d) if n.endswith(".kv"))


def sha_of(x):
    return (x.sha if hasattr(x, "sha") else os.path.basename(x)[:-3])


# ---- ls ------------------------------------------------------------------------

def test_ls_json_has_every_field_ordered_by_eviction_score(cache, cwd):
    d, roles = cache
    p = run(cwd, "ls", d, "--json")
    assert p.returncode == 0 and p.stderr == ""
    rows = json.loads(p.stdout)
    assert {r["sha"] for r in rows} == {sha_of(v) for v in roles.values()}
    now = int(time.time())
    entries = [read_entry(os.path.join(d, n)) for n in names(d)]
    # Entries unused for 30 days (the ds4 file here) come last, whatever their score.
    def stale(e):
        return now - (e.last_used or e.created_at) > settings.DEFAULT_STALE_AFTER_S
    assert [stale(e) for e in entries].count(True) == 1
    want = sorted(entries, key=lambda e: (stale(e), -policy.eviction_score(e, now), -(e.last_used or e.created_at)))
    assert [r["sha"] for r in rows] == [e.sha for e in want]
    scores = [r["score"] for r in rows if not stale(read_entry(os.path.join(d, r["sha"] + ".kv")))]
    assert scores == sorted(scores, reverse=True)
    by = {r["sha"]: r for r in rows}
    ds4 = by[sha_of(roles["ds4"])]
    assert ds4["payload_abi"] == 2 and ds4["loadable"] is False and ds4["quant_bits"] == 2
    assert ds4["tokens"] == 900 and ds4["ctx_size"] == 32768
    assert by[roles["session"].sha]["title"] == "fix the io path"
    assert by[roles["session"].sha]["reason"] == "agent-session"
    hot = by[roles["hot"].sha]
    assert hot["hits"] == 5 and hot["reason"] == "continued" and hot["last_used"] > 0
    for r in rows:
        assert set(r) >= {"sha", "prefix", "reason", "tokens", "hits", "ctx_size", "quant_bits", "model_id",
                          "payload_abi", "loadable", "file_size", "created_at", "last_used", "age_s",
                          "idle_s", "title", "score"}
        assert r["prefix"] == r["sha"][:12]
        assert r["file_size"] == os.path.getsize(os.path.join(d, r["sha"] + ".kv"))
        if r["sha"] != roles["session"].sha:
            assert r["title"] is None


def test_ls_table_rows_totals_and_foreign_marker(cache, cwd):
    d, roles = cache
    p = run(cwd, "ls", d, "--budget-mb", "1")
    assert p.returncode == 0
    lines = p.stdout.splitlines()
    assert lines[0].split() == ["SHA", "REASON", "TOKENS", "HITS", "CTX", "QUANT", "MODEL", "ABI", "SIZE",
                                "AGE", "USED", "TITLE"]
    order = [json_row["prefix"] for json_row in json.loads(run(cwd, "ls", d, "--json").stdout)]
    assert [ln.split()[0] for ln in lines[1:7]] == order
    rows = {ln.split()[0]: ln for ln in lines[1:7]}
    assert "2(ds4)" in rows[sha_of(roles["ds4"])[:12]]
    assert "ds4" not in rows[roles["cold"].sha[:12]] and "foreign" not in rows[roles["cold"].sha[:12]]
    assert rows[roles["session"].sha[:12]].rstrip().endswith("fix the io path")
    assert "never" in rows[roles["cold"].sha[:12]]
    total = sum(os.path.getsize(os.path.join(d, n)) for n in names(d))
    assert f"6 checkpoints, {cli.text.size(total)} of 1.0 MiB budget ({100 * total / 2**20:.1f}%)" in p.stdout
    assert "1 written by ds4 (payload ABI 0 or 2)" in p.stdout and "foreign payload ABI" not in p.stdout


def test_ls_skips_bad_envelopes_and_sanitises_titles(tmp_path, cwd):
    d = str(tmp_path / "c")
    s = make_store(d)
    e = sessions.save(s, f"{SECRET} x", np.arange(4), tensors(4), title="red\x1b[31m\nnext")
    bad = os.path.join(d, "ab" * 20 + ".kv")
    with open(bad, "wb") as f:
        f.write(b"NOTKV" + bytes(100))
    with open(os.path.join(d, "notes.txt"), "w") as f:
        f.write("ignored")
    p = run(cwd, "ls", d)
    assert p.returncode == 0
    assert "1 stored sequence in 1 file (1 chain block)," in p.stdout and "1 file with a bad envelope" in p.stdout
    assert "\x1b" not in p.stdout and "red?[31m?next" in p.stdout
    assert json.loads(run(cwd, "ls", d, "--json").stdout)[0]["sha"] == e.sha
    empty = tmp_path / "empty"
    empty.mkdir()
    p = run(cwd, "ls", empty)
    assert p.returncode == 0 and "no checkpoints" in p.stdout and "0 checkpoints" in p.stdout


# ---- inspect --------------------------------------------------------------------

def test_inspect_shows_header_manifest_trailer_but_no_text(cache, cwd):
    d, roles = cache
    e = roles["session"]
    p = run(cwd, "inspect", e.sha[:8], "--dir", d)
    assert p.returncode == 0, p.stderr
    out = p.stdout
    for want in (f"sha          {e.sha}", "reason       agent-session (6)", "ext flags    0x08 (session-title)",
                 "tokens       24", "payload abi  16 (loadable)", f"text         {e.text_bytes} bytes",
                 "tokens: count=24", "tensors (2):", "layers.0.k", "float16", "(2, 24, 8)", "768",
                 "layers.0.v", "float32", "1536", "bit 3 (session-title)  length 15  crc ok",
                 "title: fix the io path"):
        assert want in out, want
    assert "text:" not in out
    p = run(cwd, "inspect", roles["cold"].path)          # by path, from anywhere
    assert p.returncode == 0 and "meta keys: engine" in p.stdout and "trailer sections (0):" in p.stdout


def test_inspect_text_prints_the_prompt_only_when_asked(cache, cwd):
    d, roles = cache
    e = roles["cold"]
    p = run(cwd, "inspect", e.path, "--text")
    assert p.returncode == 0
    assert p.stdout.endswith(f"text:\n{SECRET} cold anchor\n")
    p = run(cwd, "inspect", sha_of(roles["ds4"])[:6], "--dir", d, "--text")
    assert p.returncode == 0
    assert "2 (ds4's graph state" in p.stdout and "manifest" not in p.stdout
    assert DS4_TEXT.decode() in p.stdout


def test_inspect_prefix_in_current_directory_and_errors(cache, tmp_path, cwd):
    d, roles = cache
    p = run(d, "inspect", roles["hot"].sha[:10])          # --dir defaults to .
    assert p.returncode == 0 and roles["hot"].sha in p.stdout
    assert_usage_error(run(cwd, "inspect", "ffff0000", "--dir", d), "no checkpoint", "ffff0000")
    assert_usage_error(run(cwd, "inspect", "abc", "--dir", d), "4 to 40 hex digits")
    assert_usage_error(run(cwd, "inspect", "zzzzzz", "--dir", d), "hash prefix")
    assert_usage_error(run(cwd, "inspect", os.path.join(d, "00" * 20 + ".kv")), "no such file")
    assert_usage_error(run(cwd, "inspect", "abcd", "--dir", str(tmp_path / "nope")), "no such directory")
    a, b = colliding_texts(4)
    s = make_store(d)
    ea = s.save(a, np.arange(3), tensors(3))
    s.save(b, np.arange(3), tensors(3))
    assert_usage_error(run(cwd, "inspect", ea.sha[:4], "--dir", d), "ambiguous", ea.sha[:4])


def test_inspect_corrupt_envelope_exits_1(tmp_path, cwd):
    path = write_checkpoint(tmp_path, f"{SECRET} t".encode(), b"\x00" * 10, payload_bytes=10**6)
    p = run(cwd, "inspect", path)
    assert p.returncode == 1
    assert p.stderr.startswith("kvstore: error: ") and "truncated" in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1


def colliding_texts(digits):
    """Two prompt texts whose file names share the first `digits` hex digits."""
    return _colliding_texts(digits, base=f"{SECRET} collide")


# ---- verify ---------------------------------------------------------------------

def test_verify_reports_each_bad_file_and_exits_1(cache, cwd):
    d, roles = cache
    truncated = os.path.join(d, "cd" * 20 + ".kv")
    with open(roles["cold"].path, "rb") as f:
        data = f.read()
    with open(truncated, "wb") as f:
        f.write(data[:200])
    p = run(cwd, "verify", d)
    assert p.returncode == 1
    lines = p.stdout.strip().splitlines()
    bad = {ln.split(":")[0]: ln for ln in lines[:-1]}
    assert set(bad) == {roles["corrupt"].name, os.path.basename(truncated)}
    assert "crc: tensor 'layers.0.v' CRC mismatch" in bad[roles["corrupt"].name]
    assert "truncated" in bad[os.path.basename(truncated)]
    assert lines[-1] == f"verified 7 files in {d}: 4 ok, 1 foreign payload ABI (envelope only), 2 corrupt"
    assert p.stderr == ""                                 # no bar: stderr is not a terminal
    assert len(names(d)) == 7                             # verify alone moves nothing


def test_verify_clean_directory_exits_0_with_foreign_abi(cache, cwd):
    d, roles = cache
    os.unlink(roles["corrupt"].path)
    p = run(cwd, "verify", d, "--progress")
    assert p.returncode == 0, p.stdout
    assert p.stdout.strip() == f"verified 5 files in {d}: 4 ok, 1 foreign payload ABI (envelope only), 0 corrupt"
    assert "verify [" in p.stderr and "100%" in p.stderr and "files 5" in p.stderr


def test_verify_quarantine_moves_bad_files_aside(cache, cwd):
    d, roles = cache
    p = run(cwd, "verify", d, "--quarantine")
    assert p.returncode == 1
    assert f"{roles['corrupt'].name}: crc" in p.stdout and "moved to .quarantine/" in p.stdout
    q = os.path.join(d, ".quarantine")
    assert os.listdir(q) == [roles["corrupt"].name]
    assert stat.S_IMODE(os.stat(q).st_mode) == 0o700
    assert roles["corrupt"].name not in names(d) and len(names(d)) == 5
    p = run(cwd, "verify", d)
    assert p.returncode == 0 and "0 corrupt" in p.stdout


def test_verify_file_streams_through_a_small_buffer(cache, monkeypatch):
    d, roles = cache
    monkeypatch.setattr(files, "VERIFY_CHUNK", 100)   # every block spans many chunks
    seen = []
    assert files.verify_file(roles["cold"].path, seen.append) is None
    assert max(seen) <= 100 and sum(seen) >= roles["cold"].payload_bytes - 4096
    assert files.verify_file(roles["corrupt"].path) == "crc: tensor 'layers.0.v' CRC mismatch"
    assert files.verify_file(roles["ds4"]) is None    # foreign payload: envelope only
    flip(roles["hot"].path, roles["hot"].payload_offset + 30)   # inside the manifest
    assert files.verify_file(roles["hot"].path).startswith("crc: manifest")
    flip(roles["cold"].path, 60)                          # the stored text
    assert files.verify_file(roles["cold"].path).startswith("text_hash")
    with pytest.raises(CheckpointMissing):
        files.verify_file(os.path.join(d, "00" * 20 + ".kv"))


# ---- evict ----------------------------------------------------------------------

def test_evict_dry_run_deletes_nothing_then_the_real_run_fits(cache, cwd):
    d, roles = cache
    before = names(d)
    total = sum(os.path.getsize(os.path.join(d, n)) for n in before)
    budget_mb = total / 2 / 2**20
    p = run(cwd, "evict", d, "--budget-mb", repr(budget_mb), "--dry-run")
    assert p.returncode == 0
    assert names(d) == before
    would = [ln.split()[2] for ln in p.stdout.splitlines() if ln.startswith("would evict ") and "  " in ln]
    assert would and "would leave" in p.stdout
    # Entries unused for 30 days first (the ds4 file), then the lowest scores.
    now = int(time.time())
    ranked = [e.sha[:12] for e in sorted(
        (read_entry(os.path.join(d, n)) for n in before),
        key=lambda e: (now - (e.last_used or e.created_at) <= settings.DEFAULT_STALE_AFTER_S,
                       policy.eviction_score(e, now)))]
    assert ranked[0] == sha_of(roles["ds4"])[:12]
    assert would == ranked[:len(would)]
    p = run(cwd, "evict", d, "--budget-mb", repr(budget_mb))
    assert p.returncode == 0
    gone = [ln.split()[1] for ln in p.stdout.splitlines() if ln.startswith("evicted ") and "  " in ln]
    assert gone == would
    left = names(d)
    assert sum(os.path.getsize(os.path.join(d, n)) for n in left) <= budget_mb * 2**20
    assert {n[:12] for n in before} - {n[:12] for n in left} == set(would)


def test_evict_dry_run_names_the_orphans_and_the_real_run_removes_exactly_its_victims(cache, cwd):
    # kvstore.evictor.plan is behind both: orphaned chain blocks first, then
    # the budget's order.
    d, _ = cache
    with kvstore.KVStore(d, budget_mb=0, min_tokens=1, block_tokens=64) as s:
        ids = np.arange(200, dtype=np.uint32)
        text = "".join(f"w{i} " for i in ids)
        offsets = [0] + [len("".join(f"w{i} " for i in ids[:k + 1])) for k in range(len(ids))]
        s.save(text, ids, {"k": np.ones((2, 200), dtype=np.float16)}, positional={"k": 1}, text_offsets=offsets)
        blocks = sorted((e for e in s.entries() if e.is_block and e.text_bytes <= len(text)),
                        key=lambda e: e.tokens)
    os.unlink(blocks[0].path)                               # the blocks after it are orphans
    orphans = {e.sha[:12] for e in blocks[1:]}
    before = names(d)
    total = sum(os.path.getsize(os.path.join(d, n)) for n in before)
    budget_mb = total / 2 / 2**20
    p = run(cwd, "evict", d, "--budget-mb", repr(budget_mb), "--dry-run")
    would = [ln.split()[2] for ln in p.stdout.splitlines() if ln.startswith("would evict ") and "  " in ln]
    assert set(would[:len(orphans)]) == orphans and len(would) > len(orphans)
    assert names(d) == before
    p = run(cwd, "evict", d, "--budget-mb", repr(budget_mb))
    gone = [ln.split()[1] for ln in p.stdout.splitlines() if ln.startswith("evicted ") and "  " in ln]
    assert gone == would
    assert {n[:12] for n in before} - {n[:12] for n in names(d)} == set(would)


def test_evict_errors(cache, cwd):
    d, _ = cache
    assert_usage_error(run(cwd, "evict", d), "--budget-mb")
    assert_usage_error(run(cwd, "evict", d, "--budget-mb", "lots"), "invalid size 'lots'")
    assert_usage_error(run(cwd, "evict", d, "--budget-mb", "-1"), "invalid size")
    assert_usage_error(run(cwd, "evict", d, "--budget-mb", "nan"), "invalid size")
    assert_usage_error(run(cwd, "evict", d, "--budget-mb", "0"), "must be > 0", "wipe")
    assert len(names(d)) == 6


# ---- stats ----------------------------------------------------------------------

def test_stats_text_and_json(cache, cwd):
    d, roles = cache
    p = run(cwd, "stats", d, "--json")
    assert p.returncode == 0
    st = json.loads(p.stdout)
    sizes = [os.path.getsize(os.path.join(d, n)) for n in names(d)]
    assert st["entries"] == 6 and st["bytes"] == sum(sizes)
    # No --budget-mb: the store's default, derived from the filesystem's size.
    budget = policy.default_budget_bytes(shutil.disk_usage(d).total)
    assert st["budget_bytes"] == budget and st["budget_derived"] is True
    assert st["budget_use"] == pytest.approx(sum(sizes) / budget)
    assert st["by_reason"] == {"agent-session": 1, "cold": 3, "continued": 2}
    assert st["hits"] == 5 and st["not_loadable"] == 1
    assert st["oldest"] == 1_700_000_000                  # the ds4 file's created_at
    assert st["newest"] >= roles["corrupt"].created_at
    assert "the default: 10% of the filesystem" in run(cwd, "stats", d).stdout
    p = run(cwd, "stats", d, "--budget-mb", "2")
    assert p.returncode == 0 and "the default" not in p.stdout
    for want in ("entries    6 (1 with a foreign payload ABI)", "of 2.0 MiB budget",
                 "by reason  agent-session 1, cold 3, continued 2", "hits       5", "oldest     2023-"):
        assert want in p.stdout, want


# ---- wipe -----------------------------------------------------------------------

def test_wipe_needs_yes_then_wipes_one_or_all(cache, cwd):
    d, roles = cache
    before = names(d)
    assert_usage_error(run(cwd, "wipe", d), "--yes", "all 6 checkpoint files")
    assert_usage_error(run(cwd, "wipe", d, roles["hot"].sha[:6]), "--yes", roles["hot"].sha[:12])
    assert names(d) == before
    assert_usage_error(run(cwd, "wipe", d, "0000ffff", "--yes"), "no checkpoint")
    p = run(cwd, "wipe", d, roles["hot"].sha[:6], "--yes")
    assert p.returncode == 0 and "wiped 1 checkpoint file in" in p.stdout
    assert names(d) == sorted(set(before) - {roles["hot"].name})
    # A full wipe also takes what holds prompt text without being a valid
    # checkpoint: a bad envelope, and the quarantine.
    assert run(cwd, "verify", d, "--quarantine").returncode == 1
    bad = os.path.join(d, "ab" * 20 + ".kv")
    with open(bad, "wb") as f:
        f.write(b"KVC" + SECRET.encode() * 4)
    p = run(cwd, "wipe", d, "--yes")
    assert p.returncode == 0 and "wiped 5 checkpoint files" in p.stdout and "and 1 in .quarantine" in p.stdout
    assert names(d) == [] and os.listdir(os.path.join(d, ".quarantine")) == []


# ---- sessions -------------------------------------------------------------------

def test_session_list_shows_sessions_only_newest_first(cache, cwd):
    d, roles = cache
    s = make_store(d)
    newer = sessions.save(s, f"{SECRET} newer session", np.arange(8), tensors(8), title="second")
    with open(newer.path, "r+b") as f:                    # created a minute later than the first
        f.seek(24)
        f.write((roles["session"].created_at + 60).to_bytes(8, "little"))
    p = run(cwd, "session", "list", d)
    assert p.returncode == 0
    lines = p.stdout.splitlines()
    assert lines[0].split() == ["SHA", "TITLE", "TOKENS", "HITS", "USED", "AGE"]
    assert [ln.split()[0] for ln in lines[1:]] == [newer.sha[:12], roles["session"].sha[:12]]
    assert "second" in lines[1] and "fix the io path" in lines[2]
    rows = json.loads(run(cwd, "session", "list", d, "--json").stdout)
    assert [r["sha"] for r in rows] == [newer.sha, roles["session"].sha]
    assert rows[1]["title"] == "fix the io path" and rows[1]["tokens"] == 24
    empty = os.path.join(cwd, "empty")
    os.mkdir(empty)
    assert "no agent sessions" in run(cwd, "session", "list", empty).stdout


# ---- errors and the in-process entry point ---------------------------------------

def test_usage_errors_are_one_line_exit_2(cache, tmp_path, cwd):
    d, _ = cache
    f = os.path.join(cwd, "file")
    open(f, "w").close()
    assert_usage_error(run(cwd), "COMMAND")
    assert_usage_error(run(cwd, "frobnicate"), "frobnicate")
    assert_usage_error(run(cwd, "ls", str(tmp_path / "missing")), "no such directory")
    assert_usage_error(run(cwd, "ls", f), "not a directory")
    assert_usage_error(run(cwd, "stats", str(tmp_path / "missing")), "no such directory")
    assert_usage_error(run(cwd, "verify", str(tmp_path / "missing")), "no such directory")
    assert_usage_error(run(cwd, "ls", d, "--budget-mb", "1e999"), "--budget-mb inf is not a finite number")
    assert_usage_error(run(cwd, "session"), "SUBCOMMAND")
    assert_usage_error(run(cwd, "session", "list"), "DIR")
    assert not os.path.exists(tmp_path / "missing")       # nothing creates a directory
    p = run(cwd, "--version")
    assert p.returncode == 0 and p.stdout.strip() == f"kvstore {kvstore.__version__}"


def test_main_in_process_and_read_only_listing(cache, capsys):
    d, _ = cache
    before = sorted(os.listdir(d))
    assert cli.main(["ls", d]) == 0
    assert cli.main(["stats", d]) == 0
    assert cli.main(["session", "list", d]) == 0
    assert cli.main(["evict", d, "--budget-mb", "0.001", "--dry-run"]) == 0
    assert sorted(os.listdir(d)) == before                # not even a lock file
    assert cli.main(["ls", d + "-missing"]) == 2
    out = capsys.readouterr()
    assert SECRET not in out.out + out.err
    assert out.err.strip().splitlines() == [f"kvstore: error: {d}-missing: no such directory"]


def test_demo_without_its_dependencies_is_one_line(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tokenizers", None)        # the import fails
    assert cli.main(["demo"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["kvstore: error: kvstore demo needs MLX, mlx-lm and tokenizers (tokenizers is missing): "
                   "pip install 'kvstore[demo]'"]


# ---- chains (docs/format.md §14) -------------------------------------------------------

CHAIN_GRID = 16


def chain_text(n, tag="sequence"):
    """A text of n tokens, 4 bytes each, holding SECRET: token i renders to text[4i:4i+4]."""
    return (f"{SECRET} {tag} ".encode() + b"".join(b"%04d" % i for i in range(n)))[:4 * n]


def save_chain(s, n, tag="sequence", reason=Reason.COLD, seed=0, title=None):
    text = chain_text(n, tag)
    ts = tensors(n, seed)
    kw = dict(positional={"layers.0.k": 1, "layers.0.v": 1}, text_offsets=[4 * i for i in range(n + 1)])
    if title is not None:
        return sessions.save(s, text, np.arange(n), ts, title=title, **kw), text
    return s.save(text, np.arange(n), ts, reason=reason, **kw), text


@pytest.fixture
def chains(tmp_path):
    """A directory with two chains that share their first 32 tokens, and a titled session."""
    d = str(tmp_path / "chains")
    s = make_store(d, block_tokens=CHAIN_GRID)
    a, text_a = save_chain(s, 70, "shared prefix")
    b_text = text_a[:4 * 40] + b"X" * (4 * 20)
    b = s.save(b_text, np.arange(60), tensors(60, 3), reason=Reason.EVICT,
               positional={"layers.0.k": 1, "layers.0.v": 1}, text_offsets=[4 * i for i in range(61)])
    sess, _ = save_chain(s, 50, "a session", title="chain session", seed=5)
    s.close()
    return d, {"a": a, "b": b, "session": sess, "text_a": text_a}


def test_ls_folds_chains_into_sequences(chains, cwd):
    d, r = chains
    p = run(cwd, "ls", d)
    assert p.returncode == 0, p.stderr
    rows = {line.split()[0]: line.split() for line in p.stdout.splitlines()[1:-1]}
    files_ = kvstore.KVStore(d, budget_mb=0).entries()
    assert set(rows) == {r["a"].sha[:12], r["b"].sha[:12], r["session"].sha[:12]}
    # a: 70 tokens in blocks 0..16..32..48..64..70; b shares 0..16..32 and adds 32..48..60.
    assert rows[r["a"].sha[:12]][1:4] == ["cold", "70", "5"]
    assert rows[r["b"].sha[:12]][1:4] == ["evict", "60", "4"]
    assert rows[r["session"].sha[:12]][1:4] == ["agent-session", "50", "4"]
    assert p.stdout.splitlines()[-1].startswith(f"3 stored sequences in {len(files_)} files ({len(files_)} chain blocks)")
    assert "chain session" in p.stdout
    data = json.loads(run(cwd, "ls", d, "--json").stdout)
    a = next(x for x in data if x["sha"] == r["a"].sha)
    assert a["blocks"] == 5 and a["token_start"] == 64 and a["restorable"] is True
    # The chain's bytes: the files whose names are digests of prefixes of a's text.
    assert a["chain_bytes"] == sum(e.file_size for e in files_
                                   if kvstore.format.sha1(r["text_a"][:e.text_bytes]).hex() == e.sha)


def test_ls_blocks_unfolds_every_file_with_parent_and_range(chains, cwd):
    d, r = chains
    p = run(cwd, "ls", d, "--blocks")
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert lines[0].split()[:5] == ["SHA", "REASON", "TOKENS", "PARENT", "LOADS"]
    rows = {line.split()[0]: line.split() for line in lines[1:-1]}
    entries = {e.sha[:12]: e for e in kvstore.KVStore(d, budget_mb=0).entries()}
    assert set(rows) == set(entries)
    for prefix, e in entries.items():
        assert rows[prefix][2] == f"{e.token_start}..{e.tokens}"
        assert rows[prefix][3] == (e.parent[:12] if e.parent else "-")
    data = json.loads(run(cwd, "ls", d, "--blocks", "--json").stdout)
    assert len(data) == len(entries)
    assert all(x["parent"] == (entries[x["prefix"]].parent or None) for x in data)


def test_inspect_shows_a_blocks_parent_range_and_chain(chains, cwd):
    d, r = chains
    e = r["a"]
    p = run(cwd, "inspect", e.sha[:10], "--dir", d)
    assert p.returncode == 0, p.stderr
    out = p.stdout
    for want in (f"parent       {e.parent}", "block        tokens 64..70 of the sequence, grid 16",
                 f"text         24 bytes stored ({64 * 4}..{70 * 4} of the sequence)", "payload abi  17 (loadable)",
                 "restorable   yes", "ends a save  yes", "chain        5 blocks", "axis 1"):
        assert want in out, want
    first = index_of(kvstore.KVStore(d, budget_mb=0)).chain(kvstore.format.read_entry(e.path))[0]
    p = run(cwd, "inspect", first.sha[:10], "--dir", d)
    assert "parent       none (the first block)" in p.stdout and "chain        1 block," in p.stdout
    # --text prints the whole sequence, its parents' segments first.
    p = run(cwd, "inspect", e.sha[:10], "--dir", d, "--text")
    assert p.stdout.split("text:\n", 1)[1].rstrip("\n").encode() == r["text_a"]
    # A missing parent: inspect says the chain is broken.
    os.unlink(os.path.join(d, e.parent + ".kv"))
    p = run(cwd, "inspect", e.sha[:10], "--dir", d)
    assert f"BROKEN: parent {e.parent[:12]} is missing" in p.stdout


def test_verify_walks_chains(chains, cwd):
    d, r = chains
    p = run(cwd, "verify", d)
    n = len(kvstore.KVStore(d, budget_mb=0).entries())
    assert p.returncode == 0 and f"verified {n} files" in p.stdout and f"{n} ok, 0 corrupt" in p.stdout
    # A middle block's text byte flipped: it and every block after it fail the
    # digest of their whole text (their names).
    mid = kvstore.format.read_entry(os.path.join(d, r["a"].parent + ".kv"))     # tokens 48..64
    flip(mid.path, 52 + 1, 0x20)
    p = run(cwd, "verify", d)
    assert p.returncode == 1
    bad = {line.split(":")[0] for line in p.stdout.splitlines() if ".kv:" in line}
    assert bad == {mid.name, r["a"].name}
    assert f"{r['a'].name}: text_hash" in p.stdout
    # A missing parent is a broken chain.
    os.unlink(mid.path)
    p = run(cwd, "verify", d)
    assert f"{r['a'].name}: broken_chain: parent {mid.sha[:12]} is missing" in p.stdout


def test_export_and_import_a_chain(chains, cwd, tmp_path):
    d, r = chains
    out = tmp_path / "share.kv"
    p = run(cwd, "export", r["a"].sha[:8], out, "--dir", d)
    assert p.returncode == 0, p.stderr
    assert f"exported {r['a'].sha[:12]} (70 tokens" in p.stdout
    e = kvstore.format.read_entry(out)
    assert e.payload_abi == 16 and e.tokens == 70 and e.text_bytes == 280 and e.reason == Reason.COLD
    assert stat.S_IMODE(os.stat(out).st_mode) == 0o600
    assert files.verify_file(out, name=kvstore.format.sha1(r["text_a"]).hex() + ".kv") is None
    # Into a chained store with another grid: cut again where the export can be cut.
    d2 = tmp_path / "other"
    p = run(cwd, "import", out, "--dir", d2, "--block-tokens", "32")
    assert p.returncode == 0, p.stderr
    with kvstore.KVStore(d2, budget_mb=0, min_tokens=1) as s:
        blocks = sorted((x.token_start, x.tokens) for x in s.entries())
        assert blocks == [(0, 32), (32, 64), (64, 70)]
        ck = s.load(s.find(r["text_a"] + b"!"))
        want = tensors(70, 0)
        assert ck.tokens.tolist() == list(range(70)) and ck.text_bytes == r["text_a"]
        assert all(np.array_equal(ck.tensors[k], want[k]) for k in want)
        # Every block boundary of the import is a hit.
        assert s.load(s.find(r["text_a"][:40 * 4])).tokens.size == 32
    # Into a whole-file store: one ABI 16 file.
    d3 = tmp_path / "whole"
    assert run(cwd, "import", out, "--dir", d3, "--layout", "whole").returncode == 0
    assert [x.payload_abi for x in kvstore.KVStore(d3, budget_mb=0).entries()] == [16]
    # A session comes with its title.
    out2 = tmp_path / "session.kv"
    assert run(cwd, "export", r["session"].sha[:8], out2, "--dir", d).returncode == 0
    assert run(cwd, "import", out2, "--dir", d2).returncode == 0
    p = run(cwd, "session", "list", d2)
    assert "chain session" in p.stdout and "50" in p.stdout


def test_export_and_import_errors_are_one_line(chains, cwd, tmp_path):
    d, r = chains
    p = run(cwd, "export", "ffff", tmp_path / "x.kv", "--dir", d)
    assert p.returncode == 2 and "no checkpoint" in p.stderr
    p = run(cwd, "import", tmp_path / "missing.kv", "--dir", tmp_path / "d")
    assert p.returncode == 2 and "no such file" in p.stderr
    garbage = tmp_path / "garbage.kv"
    garbage.write_bytes(b"KVC\x01" + b"\x00" * 100)
    p = run(cwd, "import", garbage, "--dir", tmp_path / "d")
    assert p.returncode == 1 and len(p.stderr.strip().splitlines()) == 1 and "corrupt" in p.stderr
    # An export with a flipped tensor byte fails import's checks.
    out = tmp_path / "share.kv"
    assert run(cwd, "export", r["b"].sha[:8], out, "--dir", d).returncode == 0
    flip(out, os.path.getsize(out) - 3)
    p = run(cwd, "import", out, "--dir", tmp_path / "d2")
    assert p.returncode == 1 and "crc" in p.stderr and len(p.stderr.strip().splitlines()) == 1
    # A block (ABI 17) is not an export: import refuses it.
    p = run(cwd, "import", r["a"].path, "--dir", tmp_path / "d3")
    assert p.returncode == 1 and "only whole (ABI 16) files" in p.stderr


def test_explain_shows_where_a_prompt_leaves_the_stored_sequence(tmp_path, cwd):
    d, secret = tmp_path / "kv", SECRET.encode()
    text = b"system prompt " * 60 + secret + b" then the first question and its answer " * 20
    key = tmp_path / "store.key"
    assert run(cwd, "key", "new", key).returncode == 0
    for where, k in ((d, None), (tmp_path / "sealed", str(key))):
        with make_store(where, block_tokens=64, key=k) as s:
            tokens = np.arange(len(text) // 4, dtype=np.uint32)
            s.save(text, tokens, {"k": np.zeros((1, 2, tokens.size, 4), np.float16)}, positional={"k": 2},
                   text_offsets=list(range(0, len(text) - 3, 4))[:tokens.size] + [len(text)])
    at = text.index(b"first") + 2
    prompt = tmp_path / "prompt.txt"
    prompt.write_bytes(text[:at] + b"X other question")
    p = run(cwd, "explain", d, prompt)
    assert p.returncode == 0 and f"parted at byte {at}:" in p.stdout and "text:" not in p.stdout, p.stdout
    report = json.loads(run(cwd, "explain", d, prompt, "--json", "--text").stdout)
    assert (report["byte"], report["parted"], report["stored_bytes"]) == (at, True, len(text))
    assert report["before"] == text[at - 24:at].decode() and report["after"] == "X other question"
    sealed = tmp_path / "sealed"
    assert json.loads(run(cwd, "explain", sealed, prompt, "--json", "--key", key).stdout)["byte"] == at
    assert_usage_error(run(cwd, "explain", sealed, prompt), "sealed", "--key")
    prompt.write_bytes(b"nothing like it")
    assert "nothing shares its first block" in run(cwd, "explain", d, prompt).stdout
    assert_usage_error(run(cwd, "explain", d, tmp_path / "missing.txt"), "missing.txt")
    assert_usage_error(run(cwd, "explain", d, prompt, "--cache-salt", ""), "--cache-salt")
